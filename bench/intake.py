"""Deletion-request intake on PostgreSQL: requests/s and p50/p99 latency of POST /v1/deletion-requests.

The API runs as a uvicorn process; the load generator runs in a second process (asyncio + httpx). Two phases, side by
side in one run: a closed loop at fixed concurrency (the throughput ceiling) and an open loop at a fixed arrival rate
(the latency a client sees at that rate). Afterwards every accepted request id is looked up in the database.
The dispatcher is off during the measurement, so only intake is timed (jobs stay in the outbox).

    python bench/intake.py            # full run
    python bench/intake.py --quick    # the same code, shorter
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx
import numpy as np
import psycopg

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
PG_ADMIN = os.environ.get("LETHE_BENCH_PG_ADMIN", "postgresql://postgres@127.0.0.1:5432/postgres")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _percentiles(latencies: list[float]) -> dict[str, float]:
    arr = np.asarray(latencies) * 1000
    return {
        "p50_ms": float(np.percentile(arr, 50)),
        "p90_ms": float(np.percentile(arr, 90)),
        "p99_ms": float(np.percentile(arr, 99)),
        "max_ms": float(arr.max()),
        "mean_ms": float(arr.mean()),
    }


async def _one(
    client: httpx.AsyncClient, body: dict, key: str, out: list, errors: list, started: float | None = None
) -> None:
    started = time.perf_counter() if started is None else started
    try:
        response = await client.post("/v1/deletion-requests", json=body, headers={"Idempotency-Key": key})
    except httpx.HTTPError as exc:
        errors.append(repr(exc))
        return
    elapsed = time.perf_counter() - started
    if response.status_code == 202:
        out.append((elapsed, response.json()["id"]))
    else:
        errors.append(f"{response.status_code} {response.text[:200]}")


def _bodies(model_id: str, row_ids: list[str], n: int, seed: int) -> list[tuple[dict, str]]:
    rng = np.random.default_rng(seed)
    return [
        (
            {
                "subject_ref": f"subject-{seed}-{i}",
                "model_id": model_id,
                "scope": {"kind": "samples", "sample_ids": [row_ids[j] for j in rng.choice(len(row_ids), 3, False)]},
            },
            f"bench-{seed}-{i}-{uuid.uuid4().hex[:8]}",
        )
        for i in range(n)
    ]


async def _closed_loop(base_url, api_key, bodies, concurrency):
    results, errors = [], []
    queue: asyncio.Queue = asyncio.Queue()
    for item in bodies:
        queue.put_nowait(item)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(
        base_url=base_url, headers={"authorization": f"Bearer {api_key}"}, limits=limits, timeout=30
    ) as client:

        async def worker():
            while not queue.empty():
                body, key = queue.get_nowait()
                await _one(client, body, key, results, errors)

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - started
    return results, errors, wall


async def _open_loop(base_url, api_key, bodies, rate):
    """Arrivals at a fixed rate over at most 64 connections (a generator with hundreds of httpx connections in one
    event loop starves itself before the server does). Latency counts from the scheduled arrival, not from when a
    connection became free, so a server that falls behind shows it."""
    results, errors = [], []
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with httpx.AsyncClient(
        base_url=base_url, headers={"authorization": f"Bearer {api_key}"}, limits=limits, timeout=30
    ) as client:
        started = time.perf_counter()
        tasks = []
        for i, (body, key) in enumerate(bodies):
            due = started + i / rate
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(_one(client, body, key, results, errors, started=due)))
        await asyncio.gather(*tasks)
        wall = time.perf_counter() - started
    return results, errors, wall


def _load_process(mode, base_url, api_key, bodies, param, conn):
    """Runs in a second process so the load generator does not share the API's interpreter."""
    runner = _closed_loop if mode == "closed" else _open_loop
    results, errors, wall = asyncio.run(runner(base_url, api_key, bodies, param))
    conn.send((results, errors, wall))
    conn.close()


def _run_phase(mode, base_url, api_key, bodies, param):
    parent, child = mp.Pipe(duplex=False)
    proc = mp.get_context("spawn").Process(target=_load_process, args=(mode, base_url, api_key, bodies, param, child))
    proc.start()
    results, errors, wall = parent.recv()
    proc.join()
    latencies = [r[0] for r in results]
    summary = {
        "mode": mode,
        "requests": len(bodies),
        "accepted": len(results),
        "errors": len(errors),
        "error_samples": errors[:5],
        "wall_s": wall,
        "requests_per_s": len(results) / wall,
        **(_percentiles(latencies) if latencies else {}),
    }
    summary["concurrency" if mode == "closed" else "target_rate_per_s"] = param
    return summary, [r[1] for r in results]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="short run of the same code")
    parser.add_argument("--requests", type=int, default=6000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rate", type=float, default=150.0, help="open-loop arrival rate (requests/s)")
    parser.add_argument("--api-workers", type=int, default=1, help="uvicorn worker processes")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "intake.json"))
    args = parser.parse_args()
    n = 600 if args.quick else args.requests

    db_name = f"lethe_bench_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{db_name}"')
    home = Path(tempfile.mkdtemp(prefix="lethe-bench-"))
    url = PG_ADMIN.rsplit("/", 1)[0].replace("postgresql://", "postgresql+psycopg://", 1) + f"/{db_name}"
    os.environ.update(
        {
            "LETHE_DATABASE_URL": url,
            "LETHE_HOME": str(home),
            "LETHE_SECRET_KEY": "bench-secret-0123456789abcdef-0123456789",  # >= 32 bytes
            "LETHE_RUN_DISPATCHER": "false",
            "LETHE_DATA_ROOTS": json.dumps([str(home / "data")]),  # a data root may not contain the home
        }
    )
    os.environ.pop("LETHE_BROKER_URL", None)
    server = None
    try:
        from app.auth.service import create_key
        from app.db import migrate, session_scope
        from tests.helpers import write_table

        migrate()
        with session_scope() as session:
            api_key = create_key(session, "bench", ["admin"])[1]
        (home / "data").mkdir()
        frame = write_table(home / "data" / "table.csv", n=5000)
        row_ids = frame["row_id"].tolist()

        port = _free_port()
        base_url = f"http://127.0.0.1:{port}"
        server = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "uvicorn",
                "app.asgi:app",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--workers",
                str(args.api_workers),
                "--log-level",
                "warning",
                "--no-access-log",
            ],
            cwd=ROOT,
            env=os.environ.copy(),
        )
        for _ in range(200):
            try:
                if httpx.get(f"{base_url}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        headers = {"authorization": f"Bearer {api_key}"}
        response = httpx.post(
            f"{base_url}/v1/models",
            headers=headers,
            json={
                "name": "bench",
                "dataset": {
                    "path": str(home / "data" / "table.csv"),
                    "row_id_column": "row_id",
                    "label_column": "label",
                },
            },
        )
        model_id = response.json()["id"]
        # version 1 is trained in this process (the dispatcher is off so that the measurement is intake only)
        from sqlalchemy import select

        from app.jobs.pipeline import execute_job
        from app.jobs.tables import Job

        with session_scope() as session:
            job_id = session.execute(select(Job.id).where(Job.model_id == model_id)).scalar_one()
        assert execute_job(job_id, "bench") == "succeeded"

        warm = _bodies(model_id, row_ids, 200, seed=0)
        _run_phase("closed", base_url, api_key, warm, args.concurrency)
        sweep, sweep_ids = [], []
        for concurrency in (4, 8):  # latency against load: fewer clients in flight, shorter queues
            point, ids = _run_phase(
                "closed", base_url, api_key, _bodies(model_id, row_ids, n // 3, 10 + concurrency), concurrency
            )
            sweep.append(point)
            sweep_ids += ids
        closed, closed_ids = _run_phase("closed", base_url, api_key, _bodies(model_id, row_ids, n, 1), args.concurrency)
        sweep.append(closed)
        opened, open_ids = _run_phase(
            "open", base_url, api_key, _bodies(model_id, row_ids, max(300, n // 2), 2), args.rate
        )

        accepted_ids = sweep_ids + closed_ids + open_ids
        from app.requests.tables import DeletionRequest

        found = 0
        with session_scope() as session:
            for start in range(0, len(accepted_ids), 1000):
                chunk = accepted_ids[start : start + 1000]
                found += len(
                    session.execute(select(DeletionRequest.id).where(DeletionRequest.id.in_(chunk))).scalars().all()
                )
        result = {
            "benchmark": "deletion-request intake on PostgreSQL",
            "quick": args.quick,
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
            "api_workers": args.api_workers,
            "requests_per_s": closed["requests_per_s"],
            "p50_ms": closed.get("p50_ms"),
            "p99_ms": closed.get("p99_ms"),
            "accepted": len(accepted_ids),
            "found_in_db": found,
            "closed_loop": closed,
            "concurrency_sweep": sweep,
            "open_loop": opened,
            "notes": "requests_per_s, p50_ms, p99_ms: closed loop at --concurrency (default 16); concurrency_sweep: "
            "the same at 4 and 8 clients in flight; open_loop: arrivals at --rate over at most 64 connections, latency "
            "from the scheduled arrival (the httpx generator itself limits this phase). Load generator in a separate "
            "process; API, generator and PostgreSQL share the machine's cores.",
        }
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2))
        for point in sweep[:-1]:
            print(
                f"closed loop  c={point['concurrency']}: {point['requests_per_s']:.0f} req/s  p50 "
                f"{point['p50_ms']:.1f} ms  p99 {point['p99_ms']:.1f} ms"
            )
        print(
            f"closed loop  c={args.concurrency}: {closed['requests_per_s']:.0f} req/s  p50 {closed['p50_ms']:.1f} ms"
            f"  p99 {closed['p99_ms']:.1f} ms  ({closed['accepted']}/{closed['requests']} accepted)"
        )
        print(
            f"open loop  {args.rate:.0f}/s: {opened['requests_per_s']:.0f} req/s  p50 {opened['p50_ms']:.1f} ms"
            f"  p99 {opened['p99_ms']:.1f} ms  ({opened['accepted']}/{opened['requests']} accepted)"
        )
        print(f"accepted {len(accepted_ids)}, found in the database {found} → {args.out}")
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=20)
        from app.db import reset_engine_cache

        reset_engine_cache()
        with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{db_name}" WITH (FORCE)')


if __name__ == "__main__":
    main()
