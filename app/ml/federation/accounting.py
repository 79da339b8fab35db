"""What a federated procedure costs, counted the same way for every method (issue 11 item 2, "honest accounting").

* **bytes**: everything sent, each way, by item (θ, replayed models, bases, a lock basis, probe scalars), in float32
  (EASE's replayed GSD bases and probe embeddings in float16: ease/method.py ``BASIS_DTYPE``, ``EMBEDDING_BYTES``);
* **compute**: CPU seconds of every party together (clients one after another, as the simulation runs them);
* **critical path**: the same work with the parties of each stage in parallel — per stage the slowest party — which is
  what a deployment waits for;
* **pair-gradient evaluations**: pairs × steps of every backward pass (a CPU-independent measure of work), and pair
  forwards (evaluations without gradient, e.g. the probes of EASE's adaptive strength);
* **client round trips**: stages in which any client takes part, one after another — the latency in rounds a
  deployment waits for, whatever the CPU (issue 24 item 4: retraining's is its number of rounds).

CPU time (``time.process_time``), not wall time: on a shared machine the wall clock measures the neighbours.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from app.ml.federation.engine import RoundResult


@dataclass
class Ledger:
    bytes_down: dict[str, int] = field(default_factory=dict)
    bytes_up: dict[str, int] = field(default_factory=dict)
    compute_seconds: float = 0.0
    critical_seconds: float = 0.0
    pair_grads: int = 0
    pair_forwards: int = 0
    stages: list[dict[str, Any]] = field(default_factory=list)
    client_round_trips: int = 0

    def down(self, item: str, nbytes: int) -> None:
        self.bytes_down[item] = self.bytes_down.get(item, 0) + int(nbytes)

    def up(self, item: str, nbytes: int) -> None:
        self.bytes_up[item] = self.bytes_up.get(item, 0) + int(nbytes)

    def stage(self, name: str, party_seconds: Mapping[str, float], pair_grads: int = 0, pair_forwards: int = 0) -> None:
        """One stage whose parties (``"server"``, ``"client 3"`` …) run in parallel."""
        secs = [float(s) for s in party_seconds.values()]
        if any(party != "server" for party in party_seconds):  # clients took part: one more round trip
            self.client_round_trips += 1
        self.compute_seconds += sum(secs)
        self.critical_seconds += max(secs, default=0.0)
        self.pair_grads += int(pair_grads)
        self.pair_forwards += int(pair_forwards)
        self.stages.append(
            {
                "stage": name,
                "compute_seconds": round(sum(secs), 4),
                "critical_seconds": round(max(secs, default=0.0), 4),
                "pair_grads": int(pair_grads),
                "pair_forwards": int(pair_forwards),
            }
        )

    def round(self, name: str, res: RoundResult) -> None:
        """A FedAvg round: its clients in parallel, then the server."""
        self.down(f"{name}: θ to clients", res.bytes_down)
        self.client_round_trips += 1
        self.up(f"{name}: updates from clients", res.bytes_up)
        self.compute_seconds += res.compute_seconds
        self.critical_seconds += res.critical_seconds
        self.pair_grads += res.pair_grads
        self.stages.append(
            {
                "stage": name,
                "compute_seconds": round(res.compute_seconds, 4),
                "critical_seconds": round(res.critical_seconds, 4),
                "pair_grads": res.pair_grads,
                "pair_forwards": 0,
            }
        )

    @property
    def bytes_total(self) -> int:
        return sum(self.bytes_down.values()) + sum(self.bytes_up.values())

    def to_info(self) -> dict[str, Any]:
        return {
            "bytes_down": sum(self.bytes_down.values()),
            "bytes_up": sum(self.bytes_up.values()),
            "bytes_total": self.bytes_total,
            "bytes_by_item": {"down": dict(self.bytes_down), "up": dict(self.bytes_up)},
            "compute_seconds": round(self.compute_seconds, 4),
            "critical_seconds": round(self.critical_seconds, 4),
            "pair_grads": self.pair_grads,
            "pair_forwards": self.pair_forwards,
            "client_round_trips": self.client_round_trips,
            "stages": list(self.stages),
        }


@contextmanager
def cpu_timer() -> Iterator[list[float]]:
    """``with cpu_timer() as t: …`` then ``t[0]`` holds the CPU seconds the block took."""
    out = [0.0]
    start = time.process_time()
    try:
        yield out
    finally:
        out[0] = time.process_time() - start
