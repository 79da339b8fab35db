"""Stream benchmark (issue 21): how many certified deletions per second a model sustains when requests arrive faster
than the service drains them, batched versions against one version per request, measured in the same run.

Real processes on this machine: PostgreSQL, Redis, the API (uvicorn, its dispatcher on) and two Celery workers, with
the settings a user gets by default (holdout 0.2, 64 shadows, method ``auto``, the default batch bounds). Per model:

1. register it (Adult LR with ``newton`` and ``influence``; the generated 1M-row LR likewise; Adult MLP with no
   prepared method: ``auto`` retrains it), wait until its methods are prepared;
2. the first requests after registration: one one-row ``auto`` request at a time, POST → certified (3 times, once
   for the MLP; median ``first_after_registration_s``: a worker's first request on the model reads and encodes the
   whole table);
3. unbatched: the model's batch bound set to one request (PATCH), one-row ``auto`` requests POSTed at once (an async
   client, 32 in flight; a few hundred for the LR models, ``MLP_UNBATCHED`` for the MLP); certified deletions per
   second from the first POST to the last certificate, with the relative standard error of the mean interval
   between certificates; then the idle latency of the model in service (both workers have served it;
   ``idle_auto_s``): one request at a time, each after the previous job's upkeep has ended, 3 times (once for the
   MLP: the issue's idle aims are the LR models'), median;
4. batched: the default bounds again, the stream (Adult LR 10,000; 1M-row LR 3,000; Adult MLP 1,000) POSTed at once;
   the same figures, and p50/p99 POST → certified, versions created, verdicts, CPU-seconds per deletion (the two
   workers' process trees);
5. checks: every request of the stream certified, once (its audit events); every certificate verifies offline
   (``verify_envelope``, the code of ``lethe verify-certificate``) against the published keys; the audit chain
   verifies; no erased row id is left in the stored table or in any byte of the artifact store.

Rows are drawn at random from the whole table, as a user's requests would be: about 20 % of them are held-out rows
(no version ever trained on them; their verdict is ``held_out``), and the JSON says how many.

    python -m bench.stream            # the full run (bench/results/stream.json, stream.png)
    python -m bench.stream --quick    # a short run of the same code (bench/results/stream_quick.json)
    python -m bench.stream --models adult_lr
    python -m bench.stream --idle-only  # registration, first requests, warm-up, idle latency (stream_idle.json)

Loopback only: every server listens on 127.0.0.1 and every request goes there.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pandas as pd

from app.registry.schemas import BatchIn
from bench.common import DATA_DIR, REPO
from tests.stack import PG_ADMIN, Services, fresh_database

BATCH = BatchIn()  # the batch bounds a model gets at registration
REDIS_URL = os.environ.get("LETHE_BENCH_REDIS", "redis://127.0.0.1:6379/14")
RESULTS = REPO / "bench" / "results"
IN_FLIGHT = 32
"""Concurrent POSTs of the stream (the intake's own limit is far above what the workers drain)."""
IDLE_WARMUP = 4
"""--idle-only: unbatched requests between the first requests and the idle ones (so that both workers serve it)."""
ROW_ID = "row_id"
ID_PATTERN = re.compile(rb"[a-z]+-\d{7}")
"""A row id as the tables write them: the table's own prefix (``row_prefix``) and seven digits. Each table has its
own prefix: the models share one artifact store, and a scan for one table's erased ids must not find another table's
live rows with the same number (the 1M-row check once counted an Adult row ``row-0012345`` as its own erased id)."""


@dataclass(frozen=True)
class Setting:
    source: str  # adult | synthetic
    family: str
    methods: tuple[str, ...]
    requests: int
    unbatched: int
    rows: int | None = None  # synthetic only
    quick_requests: int = 200
    quick_unbatched: int = 20
    first: int = 3  # first requests after registration, one at a time
    idle: int = 3  # idle requests, one at a time


SETTINGS = {
    "adult_lr": Setting("adult", "logistic_regression", ("newton", "influence"), 10_000, 150, None, 600, 30),
    "synthetic_lr": Setting("synthetic", "logistic_regression", ("newton", "influence"), 3_000, 12, 1_000_000, 200, 4),
    "adult_mlp": Setting("adult", "mlp", (), 1_000, 5, None, 60, 3, first=1, idle=1),
}
MLP_UNBATCHED = SETTINGS["adult_mlp"].unbatched
"""The MLP's unbatched phase: 5 requests. Each one-row version's erasure drops the ~51 of 64 shadows that saw its
row, and the next request waits for the refill to the pool's minimum (~20 shadows, each a full MLP fit), so a
request costs ~1 min and a few hundred would outlast the run; the rate's relative standard error is reported."""


DEFAULT_MODELS = ("adult_lr", "synthetic_lr", "adult_mlp")
NOT_RUN_BY_DEFAULT: dict[str, str] = {}
SHRED_WAIT_S = 600
"""How long the checks wait for the last upkeep and the shred queue (the MLP's last refill trains up to 64 shadows)."""


def row_prefix(setting: Setting) -> str:
    """adultlr, syntheticlr, adultmlp: one prefix per model's table."""
    return setting.source + ("mlp" if setting.family == "mlp" else "lr")


def write_table(setting: Setting, path: Path, seed: int = 0) -> int:
    """The table as a user would register it: a row-id column, the features, a label column."""
    if setting.source == "synthetic":
        from sklearn.datasets import make_classification

        X, y = make_classification(
            n_samples=setting.rows, n_features=20, n_informative=10, n_redundant=5, flip_y=0.05, random_state=seed
        )
        frame = pd.DataFrame(X.astype(np.float32), columns=[f"f{i}" for i in range(20)])
        frame["label"] = np.where(y == 1, "pos", "neg")
    else:
        frame = pd.read_csv(DATA_DIR / "adult.csv", skipinitialspace=True).rename(columns={"Salary": "label"})
    frame.insert(0, ROW_ID, [f"{row_prefix(setting)}-{i:07d}" for i in range(len(frame))])
    frame.to_parquet(path, index=False)
    return len(frame)


class Bench:
    def __init__(self, home: Path, services: Services, key: str):
        self.home, self.services = home, services
        self.client = httpx.Client(base_url=services.base_url, headers={"authorization": f"Bearer {key}"}, timeout=120)
        self.key = key
        self.idle_phases: list[dict[str, float]] = []

    def register(self, name: str, setting: Setting, path: Path) -> dict[str, Any]:
        started = time.perf_counter()
        response = self.client.post(
            "/v1/models",
            json={
                "name": name,
                "family": setting.family,
                "unlearning": list(setting.methods),
                "dataset": {"path": str(path), "row_id_column": ROW_ID, "label_column": "label"},
            },
        )
        response.raise_for_status()
        model_id = response.json()["id"]
        while True:
            body = self.client.get(f"/v1/models/{model_id}").json()
            methods = body.get("unlearning") or {}
            if body["status"] == "failed":
                raise RuntimeError(f"registration failed: {body.get('error')}")
            if body["status"] == "ready" and all(
                methods.get(m, {}).get("status") in ("ready", "refused", "failed") for m in setting.methods
            ):
                body["registration_s"] = round(time.perf_counter() - started, 1)
                return body
            time.sleep(1.0)

    def set_batch(self, model_id: str, max_requests: int, max_rows: int) -> None:
        response = self.client.patch(
            f"/v1/models/{model_id}", json={"batch": {"max_requests": max_requests, "max_rows": max_rows}}
        )
        response.raise_for_status()

    async def _post_all(self, model_id: str, rows: list[str]) -> list[tuple[str, float]]:
        """POST one one-row ``auto`` request per row, IN_FLIGHT at a time; (request id, POST time) each."""
        out: list[tuple[str, float]] = []
        queue: asyncio.Queue[str] = asyncio.Queue()
        for row in rows:
            queue.put_nowait(row)
        headers = {"authorization": f"Bearer {self.key}"}
        async with httpx.AsyncClient(base_url=self.services.base_url, headers=headers, timeout=120) as client:

            async def worker() -> None:
                while not queue.empty():
                    row = queue.get_nowait()
                    sent = time.time()
                    response = await client.post(
                        "/v1/deletion-requests",
                        json={
                            "subject_ref": f"subject-{row}",
                            "model_id": model_id,
                            "method": "auto",
                            "scope": {"kind": "samples", "sample_ids": [row]},
                        },
                    )
                    if response.status_code != 202:
                        raise RuntimeError(f"POST refused: {response.status_code} {response.text[:300]}")
                    out.append((response.json()["id"], sent))

            await asyncio.gather(*(worker() for _ in range(IN_FLIGHT)))
        return out

    def stream(self, model_id: str, rows: list[str], tag: str, timeout: float, rate_se: bool = False) -> dict[str, Any]:
        """POST the rows' requests at once and wait until every one has ended; the phase's figures. ``rate_se``: the
        rate's relative standard error, taking the intervals between certificates as independent (one version per
        request: the unbatched phase; a batched phase's certificates come in a few bursts)."""
        from sqlalchemy import func, select

        from app.db import session_scope
        from app.registry.tables import ModelVersion
        from app.requests.tables import DeletionRequest

        with session_scope() as session:
            versions_before = session.execute(
                select(func.count()).select_from(ModelVersion).where(ModelVersion.model_id == model_id)
            ).scalar_one()
        cpu_before = self.services_cpu()
        posted = asyncio.run(self._post_all(model_id, rows))
        post_s = posted[-1][1] - min(t for _, t in posted) if posted else 0.0
        ids = [rid for rid, _ in posted]
        sent = dict(posted)
        deadline = time.monotonic() + timeout
        timeline: list[tuple[float, int]] = []
        first = min(sent.values())
        while True:
            with session_scope() as session:
                done = session.execute(
                    select(DeletionRequest.id, DeletionRequest.status, DeletionRequest.completed_at).where(
                        DeletionRequest.id.in_(ids), DeletionRequest.completed_at.is_not(None)
                    )
                ).all()
            certified = sum(1 for _, status, _ in done if status == "certified")
            timeline.append((round(time.time() - first, 2), certified))
            if len(done) == len(ids) or time.monotonic() > deadline:
                break
            print(f"  {tag}: {len(done)}/{len(ids)} ended ({certified} certified)", flush=True)
            time.sleep(2.0)
        cpu_s = self.services_cpu() - cpu_before
        with session_scope() as session:
            made = session.execute(
                select(ModelVersion.number, ModelVersion.method, ModelVersion.metrics, ModelVersion.created_at)
                .where(ModelVersion.model_id == model_id, ModelVersion.number > versions_before)
                .order_by(ModelVersion.number)
            ).all()
        versions_after = versions_before + len(made)
        batches = [
            {
                "version": number,
                "method": method,
                "requests": len((metrics or {}).get("requests") or ()),
                "unlearn_s": (metrics or {}).get("unlearn_seconds"),
                "at_s": round(created.timestamp() - first, 2),
            }
            for number, method, metrics, created in made
        ]
        statuses: dict[str, int] = {}
        for _, status, _ in done:
            statuses[status] = statuses.get(status, 0) + 1
        latencies = sorted(c.timestamp() - sent[rid] for rid, status, c in done if status == "certified")
        ends = [c.timestamp() for _, status, c in done if status == "certified"]
        span = (max(ends) - first) if ends else float("nan")
        gaps = np.diff([first, *sorted(ends)])  # the intervals the rate is the inverse mean of
        rel_se = float(np.std(gaps, ddof=1) / np.mean(gaps) / np.sqrt(len(gaps))) if len(gaps) > 1 else None
        rate_figures = {"certified_per_s_rel_se": round(rel_se, 3) if rel_se is not None else None} if rate_se else {}
        return {
            "requests": len(ids),
            "post_s": round(post_s, 2),
            "statuses": statuses,
            "unfinished": len(ids) - len(done),
            "certified_per_s": round(len(ends) / span, 3) if ends else 0.0,
            **rate_figures,
            "span_s": round(span, 2),
            "p50_s": round(float(np.percentile(latencies, 50)), 3) if latencies else None,
            "p99_s": round(float(np.percentile(latencies, 99)), 3) if latencies else None,
            "versions": versions_after - versions_before,
            "batches": batches,
            "worker_cpu_s_per_deletion": round(cpu_s / max(1, len(ends)), 4),
            "timeline": timeline,
            "ids": ids,
        }

    def idle(self, model_id: str, rows: list[str]) -> list[float]:
        """POST → certified of one one-row ``auto`` request on an idle model, one at a time: each waits until the
        previous one's job has ended (its upkeep after the certificate included)."""
        from sqlalchemy import select

        from app.db import session_scope
        from app.jobs.tables import Job

        def busy() -> bool:
            with session_scope() as session:
                return bool(
                    session.execute(
                        select(Job.id).where(
                            Job.model_id == model_id, Job.status.in_(("pending", "dispatched", "running"))
                        )
                    ).first()
                )

        out = []
        for row in rows:
            while busy():
                time.sleep(0.2)
            started = time.perf_counter()
            response = self.client.post(
                "/v1/deletion-requests",
                json={
                    "subject_ref": "idle",
                    "model_id": model_id,
                    "method": "auto",
                    "scope": {"kind": "samples", "sample_ids": [row]},
                },
            )
            response.raise_for_status()
            url = f"/v1/deletion-requests/{response.json()['id']}"
            while (body := self.client.get(url).json())["status"] not in ("certified", "failed", "rejected"):
                time.sleep(0.01)
            out.append(round(time.perf_counter() - started, 3) if body["status"] == "certified" else float("nan"))
            self.idle_phases.append(self.phases(body["id"]))
        return out

    def phases(self, request_id: str) -> dict[str, float]:
        """Seconds from the request's acceptance to each later event of its audit trail (where the time goes)."""
        items = self.client.get("/v1/audit", params={"entity_id": request_id}).json()["items"]
        times = {e["action"].split(".")[-1]: datetime.fromisoformat(e["at"]) for e in items}
        start = times.get("received") or min(times.values())
        return {
            action: round((at - start).total_seconds(), 3) for action, at in sorted(times.items(), key=lambda x: x[1])
        }

    def services_cpu(self) -> float:
        """CPU seconds the workers' process trees have used so far."""
        import psutil

        total = 0.0
        for proc in self.services.workers:
            try:
                root = psutil.Process(proc.pid)
                for p in [root, *root.children(recursive=True)]:
                    times = p.cpu_times()
                    total += times.user + times.system
            except psutil.NoSuchProcess:
                continue
        return total

    def check(self, model_id: str, ids: list[str], erased_rows: list[str]) -> dict[str, Any]:
        """Every request certified once; every certificate verifies offline; the audit chain verifies; no erased
        row id is in the stored table or in any byte of the artifact store."""
        from sqlalchemy import func, select

        from app.audit.tables import AuditEvent
        from app.certificates.signing import verify_envelope
        from app.certificates.tables import Certificate
        from app.certificates.verify_cli import PREDICATE_TYPES
        from app.db import session_scope

        keys = self.client.get("/.well-known/lethe-keys.json").json()
        verified, invalid = 0, []
        certified_events = {}
        with session_scope() as session:
            for start in range(0, len(ids), 1000):
                chunk = ids[start : start + 1000]
                for request_id, envelope in session.execute(
                    select(Certificate.request_id, Certificate.envelope).where(Certificate.request_id.in_(chunk))
                ).all():
                    try:
                        verify_envelope(envelope, keys, predicate_type=PREDICATE_TYPES)
                        verified += 1
                    except Exception as exc:  # a certificate that does not verify is a finding, not a crash
                        invalid.append(f"{request_id}: {exc}")
                certified_events.update(
                    session.execute(
                        select(AuditEvent.entity_id, func.count())
                        .where(AuditEvent.entity_id.in_(chunk), AuditEvent.action == "deletion_request.certified")
                        .group_by(AuditEvent.entity_id)
                    ).all()
                )
        chain = self.client.get("/v1/audit/verify").json()
        erased = set(erased_rows)
        first = self._scan(erased)  # right after the last certificate, with a job's upkeep possibly still running
        queued = self._queued(list(first))
        drained = self._wait_for_shreds(timeout=SHRED_WAIT_S)
        after = self._scan(erased)
        return {
            "certificates_verified": verified,
            "certificates_invalid": invalid[:5],
            "certified_once": sum(1 for rid in ids if certified_events.get(rid) == 1),
            "certified_twice": sum(1 for rid in ids if certified_events.get(rid, 0) > 1),
            "audit_chain_ok": bool(chain.get("ok")),
            "erased_ids_found_in_store": sum(first.values()),
            "erased_ids_by_blob": {d: {"ids": n, "queued_for_shredding": d in queued} for d, n in first.items()},
            "shred_queue_drained": drained,
            "erased_ids_found_after_shredding": sum(after.values()),
        }

    def _scan(self, erased: set[str]) -> dict[str, int]:
        """Per stored blob, how many erased row ids its bytes hold literally (a compressed table shows only the
        few ids that stayed literal: any hit means the blob holds erased rows)."""
        from app.config import get_settings

        store = get_settings().local_artifact_path
        found: dict[str, int] = {}
        for path in store.rglob("*") if store is not None and store.exists() else []:
            if path.is_file():
                hits = {m.decode() for m in ID_PATTERN.findall(path.read_bytes())} & erased
                if hits:
                    found[path.name] = len(hits)
        return found

    def _queued(self, digests: list[str]) -> set[str]:
        from sqlalchemy import select

        from app.db import session_scope
        from app.registry.tables import ShredItem

        with session_scope() as session:
            return set(session.execute(select(ShredItem.digest).where(ShredItem.digest.in_(digests))).scalars())

    def _wait_for_shreds(self, timeout: float) -> bool:
        """Until no blob is due for shredding (the dispatcher's tick deletes them) and no job runs."""
        from sqlalchemy import select

        from app.db import session_scope, utcnow
        from app.jobs.tables import Job
        from app.registry.tables import ShredItem

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with session_scope() as session:
                due = session.execute(
                    select(ShredItem.id).where(ShredItem.done_at.is_(None), ShredItem.not_before <= utcnow())
                ).first()
                running = session.execute(select(Job.id).where(Job.status == "running")).first()
            if due is None and running is None:
                return True
            time.sleep(1.0)
        return False


def run_model(
    bench: Bench,
    name: str,
    setting: Setting,
    quick: bool,
    rng: np.random.Generator,
    idle_only: bool = False,
    requests: int | None = None,
) -> dict[str, Any]:
    path = bench.home / "data" / f"{name}.parquet"
    n_rows = write_table(setting, path)
    print(f"{name}: {n_rows} rows; registering ({setting.family}, methods {list(setting.methods) or 'none'})")
    model = bench.register(name, setting, path)
    model_id = model["id"]
    print(f"  registered in {model['registration_s']} s")
    n_stream = requests or (setting.quick_requests if quick else setting.requests)
    n_unbatched = setting.quick_unbatched if quick else setting.unbatched
    if idle_only:
        n_unbatched = min(n_unbatched, IDLE_WARMUP)
    n_one = setting.first + setting.idle
    order = [f"{row_prefix(setting)}-{i:07d}" for i in rng.permutation(n_rows)[: n_stream + n_unbatched + n_one]]
    first_rows, idle_rows = order[: setting.first], order[setting.first : n_one]
    unbatched_rows, stream_rows = order[n_one : n_one + n_unbatched], order[n_one + n_unbatched :]
    first = bench.idle(model_id, first_rows)
    first_phases = bench.idle_phases[-len(first) :]
    print(f"  first requests after registration, one at a time: {first} s")
    print(f"  where it goes (s after acceptance): {first_phases}")
    defaults = model["batch"]  # what registration gave the model
    bench.set_batch(model_id, 1, 1)
    unbatched = bench.stream(model_id, unbatched_rows, "unbatched", timeout=3600, rate_se=True)
    print(
        f"  unbatched: {unbatched['certified_per_s']} certified/s over {unbatched['requests']} requests "
        f"(relative standard error {unbatched['certified_per_s_rel_se']})"
    )
    idle = bench.idle(model_id, idle_rows)  # the model in service (both workers have served it), idle again
    print(f"  idle one-row auto, model in service: {idle} s")
    print(f"  where it goes (s after acceptance): {bench.idle_phases[-len(idle) :]}")
    if idle_only:  # --idle-only: the same registration, first requests, short unbatched warm-up and idle latency
        return {
            "rows": n_rows,
            "registration_s": model["registration_s"],
            "idle_auto_s": idle,
            "idle_phases_s": bench.idle_phases[-len(idle) :],
            "first_after_registration_s": first,
            "first_after_registration_phases_s": first_phases,
            "unbatched": {k: v for k, v in unbatched.items() if k not in ("ids", "timeline")},
        }
    bench.set_batch(model_id, defaults["max_requests"], defaults["max_rows"])  # back to the defaults
    batched = bench.stream(model_id, stream_rows, "batched", timeout=3600)
    print(
        f"  batched: {batched['certified_per_s']} certified/s over {batched['requests']} requests, "
        f"{batched['versions']} versions, p50 {batched['p50_s']} s, p99 {batched['p99_s']} s"
    )
    print(f"  batches: {[(b['method'], b['requests'], b['at_s']) for b in batched['batches']]}")
    checks = bench.check(model_id, batched["ids"] + unbatched["ids"], order)
    print(f"  checks: {checks}")
    held_out = _held_out_count(batched["ids"])
    for phase in (batched, unbatched):
        phase.pop("ids")
    ratio = batched["certified_per_s"] / unbatched["certified_per_s"] if unbatched["certified_per_s"] else None
    return {
        "rows": n_rows,
        "registration_s": model["registration_s"],
        "methods": {m: e.get("status") for m, e in (model.get("unlearning") or {}).items()},
        "idle_auto_s": idle,
        "idle_phases_s": bench.idle_phases[-len(idle) :],
        "first_after_registration_s": first,
        "first_after_registration_phases_s": first_phases,
        "unbatched": unbatched,
        "batched": batched,
        "batched_over_unbatched": round(ratio, 2) if ratio else None,
        "held_out_requests": held_out,
        "checks": checks,
    }


def _held_out_count(ids: list[str]) -> int:
    """Requests whose one row was held out of training (verdict ``held_out``: no version ever saw it)."""
    from sqlalchemy import select

    from app.db import session_scope
    from app.reports.tables import Report

    held: set[str] = set()
    with session_scope() as session:
        for start in range(0, len(ids), 1000):
            chunk = ids[start : start + 1000]
            query = select(Report.request_id, Report.body).where(Report.request_id.in_(chunk))
            for rid, body in session.execute(query):
                if body.get("n_forget") == 0:
                    held.add(rid)
    return len(held)


def summary(results: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for name, r in results.items():
        b, u, c = r["batched"], r["unbatched"], r["checks"]
        out[name] = {
            "certified_per_s": b["certified_per_s"],
            "unbatched_per_s": u["certified_per_s"],
            "unbatched_requests": u["requests"],
            "unbatched_per_s_rel_se": u.get("certified_per_s_rel_se"),
            "p50_s": b["p50_s"],
            "p99_s": b["p99_s"],
            "versions": b["versions"],
            "requests": b["requests"],
            "all_certified": b["statuses"].get("certified", 0) == b["requests"],
            "certificates_verified": c["certificates_verified"],
            "idle_auto_s": statistics.median(r["idle_auto_s"]),
            "first_after_registration_s": statistics.median(r["first_after_registration_s"]),
            "wall_s": r.get("wall_s"),
        }
    return out


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5.5 * len(results), 4), squeeze=False)
    for ax, (name, r) in zip(axes[0], results.items(), strict=True):
        for phase, style in (("batched", "-"), ("unbatched", "--")):
            t, n = zip(*r[phase]["timeline"], strict=True) if r[phase]["timeline"] else ((), ())
            ax.plot(t, n, style, label=f"{phase}: {r[phase]['certified_per_s']:.2f}/s")
        ax.set_title(name)
        ax.set_xlabel("seconds since the first POST")
        ax.set_ylabel("certified deletions")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a short run of the same code")
    parser.add_argument(
        "--models", default=",".join(DEFAULT_MODELS), help=f"comma-separated, of {list(SETTINGS)} (default: all)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--requests", type=int, help="the stream's length per model (default: the setting's)")
    parser.add_argument(
        "--idle-only",
        action="store_true",
        help="registration, the first requests, a short unbatched warm-up (both workers serve the model) and the "
        "idle latency only (bench/results/stream_idle.json); the full run is unchanged",
    )
    args = parser.parse_args()
    names = [n for n in args.models.split(",") if n]
    unknown = set(names) - set(SETTINGS)
    if unknown:
        sys.exit(f"unknown models {sorted(unknown)}; choose from {list(SETTINGS)}")
    import redis

    redis.Redis.from_url(REDIS_URL).flushdb()
    started = time.perf_counter()
    home = Path(tempfile.mkdtemp(prefix="lethe-stream-"))
    (home / "data").mkdir()
    results: dict[str, Any] = {}
    with fresh_database("lethe_stream") as url:
        os.environ.update(
            {
                "LETHE_HOME": str(home / "lethe"),  # beside the data root: neither may hold the other
                "LETHE_DATABASE_URL": url,
                "LETHE_BROKER_URL": REDIS_URL,
                "LETHE_SECRET_KEY": "bench-secret-0123456789abcdef-0123456789",
                "LETHE_DATA_ROOTS": json.dumps([str(home / "data")]),
            }
        )
        from app.auth.service import create_key
        from app.config import get_settings
        from app.db import migrate, reset_engine_cache, session_scope

        get_settings.cache_clear()
        reset_engine_cache()
        migrate()
        with session_scope() as session:
            key = create_key(session, "bench", ["admin"])[1]
        services = Services({**os.environ, "PYTHONUNBUFFERED": "1"}, home)
        try:
            services.start_api()
            services.workers = [services.start_worker("s1"), services.start_worker("s2")]
            bench = Bench(home, services, key)
            rng = np.random.default_rng(args.seed)
            for name in names:
                model_started = time.perf_counter()
                results[name] = run_model(bench, name, SETTINGS[name], args.quick, rng, args.idle_only, args.requests)
                results[name]["wall_s"] = round(time.perf_counter() - model_started, 1)
        finally:
            services.stop()
    if args.idle_only:
        idle = {
            name: {
                "idle_auto_s": statistics.median(r["idle_auto_s"]),
                "first_after_registration_s": statistics.median(r["first_after_registration_s"]),
            }
            for name, r in results.items()
        }
        RESULTS.mkdir(exist_ok=True)
        out = {"benchmark": "idle one-row auto latency only (--idle-only)", "summary": idle, "models": results,
               "wall_s": round(time.perf_counter() - started, 1)}  # fmt: skip
        (RESULTS / "stream_idle.json").write_text(json.dumps(out, indent=1, default=str))
        print(json.dumps(idle, indent=1))
        return
    out = {
        "benchmark": "stream of one-row auto deletions, batched versions vs one version per request",
        "quick": args.quick,
        "requests_override": args.requests,
        "setup": {
            "database": "PostgreSQL (fresh database)",
            "broker": "Redis",
            "workers": "2 Celery workers (solo pool, one process each)",
            "api": "uvicorn, one process, dispatcher on",
            "defaults": (
                f"holdout 0.2, 64 shadows, method auto, batch bounds {BATCH.max_requests} requests / "
                f"{BATCH.max_rows} rows"
            ),
            "in_flight_posts": IN_FLIGHT,
            "machine": f"{os.cpu_count()} cores",
            "pg_admin": PG_ADMIN.rsplit("@", 1)[-1],
        },
        "summary": summary(results),
        "not_run": {name: why for name, why in NOT_RUN_BY_DEFAULT.items() if name not in names},
        "models": results,
        "wall_s": round(time.perf_counter() - started, 1),
    }
    RESULTS.mkdir(exist_ok=True)
    stem = "stream_quick" if args.quick else "stream"
    (RESULTS / f"{stem}.json").write_text(json.dumps(out, indent=1, default=str))
    plot(results, RESULTS / f"{stem}.png")
    print(json.dumps(out["summary"], indent=1))
    print(f"wrote {RESULTS / f'{stem}.json'} in {out['wall_s']} s")


if __name__ == "__main__":
    main()
