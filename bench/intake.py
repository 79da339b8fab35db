"""Deletion-request intake on PostgreSQL: requests/s and p50/p99 latency of POST /v1/deletion-requests, against the
ceiling of a trivial FastAPI POST endpoint measured in the same run with the same load generator.

The load generator is ``wrk`` (C, Debian package ``wrk``) with ``bench/intake.lua``, which gives every request its own
subject, sample id and Idempotency-Key, counts every status and keeps the id of every 202. A Python generator (httpx)
saturates long before the server does on 2 cores (~350 req/s on a trivial endpoint against ~4,000 for wrk), so the
previous version of this benchmark mostly measured itself.

Two servers started alike by ``python -m app.serving`` (what ``lethe serve`` runs: uvicorn with uvloop and httptools,
``--workers`` processes each, default 2, every worker on a listening socket of its own; with uvicorn's shared socket
one worker took all 32 connections in about one run in five): the real API (``app.asgi:app``, dispatcher
off so no worker competes; jobs stay in the outbox; its log lines go to a file) and ``bench/trivial_app.py`` (one
pydantic body, no database). Each round runs wrk against the trivial
endpoint and then against the real one, closed loop at ``--connections``; ratios are taken round by round, so noise from
other work on the machine hits both sides alike. Afterwards every 202's request id is looked up in the database.

    flock /tmp/lethe-bench.lock python bench/intake.py            # full run
    flock /tmp/lethe-bench.lock python bench/intake.py --quick    # the same code, shorter (< 2 minutes)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx
import psutil
import psycopg

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
PG_ADMIN = os.environ.get("LETHE_BENCH_PG_ADMIN", "postgresql://postgres@127.0.0.1:5432/postgres")
LUA = ROOT / "bench" / "intake.lua"
PATH = "/v1/deletion-requests"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _serve(app: str, port: int, env: dict, workers: int = 1, log_path: Path | None = None) -> subprocess.Popen:
    log_file = open(log_path, "ab") if log_path else None  # noqa: SIM115 (the server writes to it until the end)
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "app.serving",  # what `lethe serve` runs: uvicorn (uvloop + httptools), a listening socket per worker
            app,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--log-level",
            "warning",
            "--workers",
            str(workers),
        ],
        cwd=ROOT,
        env=env,
        stdout=log_file,
        stderr=subprocess.STDOUT if log_file else None,
    )
    for _ in range(300):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                return server
        except httpx.HTTPError:
            time.sleep(0.1)
    server.terminate()
    raise RuntimeError(f"{app} did not start")


def _cpu(server: subprocess.Popen) -> dict[str, float]:
    """CPU seconds so far (user + system) of the server's processes, of every PostgreSQL process, and of this
    process's finished children (wrk)."""

    def seconds(process: psutil.Process) -> float:
        try:
            times = process.cpu_times()
        except psutil.Error:  # gone meanwhile
            return 0.0
        return times.user + times.system

    tree = psutil.Process(server.pid)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {
        "server": seconds(tree) + sum(seconds(p) for p in tree.children(recursive=True)),
        "postgres": sum(seconds(p) for p in psutil.process_iter() if p.name() == "postgres"),
        "wrk": children.ru_utime + children.ru_stime,
    }


def _pg_counters() -> tuple[int, int]:
    """(checkpoints so far, WAL position in bytes) of the PostgreSQL server (version 17 moved the counts to
    ``pg_stat_checkpointer``)."""
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        wal = conn.execute("SELECT pg_current_wal_lsn() - '0/0'::pg_lsn").fetchone()[0]
        try:
            done = conn.execute("SELECT checkpoints_timed + checkpoints_req FROM pg_stat_bgwriter").fetchone()[0]
        except psycopg.errors.UndefinedColumn:
            done = conn.execute("SELECT num_timed + num_requested FROM pg_stat_checkpointer").fetchone()[0]
    return int(done), int(wal)


def _wrk(
    port, *, seconds, connections, model_id, api_key, tag, first_row, id_file="", server: subprocess.Popen
) -> dict:
    """One wrk run (one thread: the API, PostgreSQL and wrk share 2 cores). Returns wrk's summary plus statuses, and
    the CPU each side spent per answer (``cpu_us_per_answer``) with the cores they kept busy between them: the
    machine is shared, so a ratio of rates is a ratio of CPU per request only where both runs keep the cores busy.
    Also the WAL PostgreSQL wrote per answer and the checkpoints meanwhile (after one, the first change of each page
    is a whole page in the WAL)."""
    command = [
        "wrk",
        "-t1",
        f"-c{connections}",
        f"-d{seconds}s",
        "--timeout",
        "10s",
        "-s",
        str(LUA),
        f"http://127.0.0.1:{port}",
        "--",
        PATH,
        model_id,
        api_key,
        tag,
        str(first_row),
        id_file,
        "1",
    ]
    checkpoints, wal = _pg_counters()
    before = _cpu(server)
    done = subprocess.run(command, capture_output=True, text=True, timeout=seconds + 60)
    after = _cpu(server)
    checkpoints_after, wal_after = _pg_counters()
    match = re.search(r"^WRK_RESULT (\{.*\})$", done.stdout, re.M)
    if done.returncode != 0 or match is None:
        raise RuntimeError(f"wrk failed ({done.returncode}): {done.stdout[-2000:]} {done.stderr[-2000:]}")
    raw = json.loads(match.group(1))
    wall = raw["duration_us"] / 1e6
    statuses = {int(k): v for k, v in raw["statuses"].items()}
    ok = sum(v for k, v in statuses.items() if 200 <= k < 300)
    spent = {side: after[side] - before[side] for side in after}
    return {
        "connections": connections,
        "wall_s": round(wall, 3),
        "responses": raw["requests"],
        "statuses": statuses,
        "socket_errors": raw["errors"],
        "requests_per_s": round(ok / wall, 1),  # 2xx answers per second (202s on the real endpoint)
        "p50_ms": raw["p50_us"] / 1000,
        "p90_ms": raw["p90_us"] / 1000,
        "p99_ms": raw["p99_us"] / 1000,
        "max_ms": raw["max_us"] / 1000,
        "mean_ms": round(raw["mean_us"] / 1000, 3),
        "cpu_us_per_answer": {side: round(cpu / max(raw["requests"], 1) * 1e6, 1) for side, cpu in spent.items()},
        "cores_busy": round(sum(spent.values()) / wall, 2),
        "wal_bytes_per_answer": round((wal_after - wal) / max(raw["requests"], 1)),
        "checkpoints": checkpoints_after - checkpoints,  # PostgreSQL checkpoints that began or ended meanwhile
    }


def _py_spy() -> str:
    """The venv's py-spy, else the one on PATH (installed apart: ``pip install --target DIR py-spy``)."""
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.exists() else (shutil.which("py-spy") or str(beside))


def _wrk_version() -> str:
    done = subprocess.run(["wrk", "-v"], capture_output=True, text=True)
    return (done.stdout + done.stderr).strip().splitlines()[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="short run of the same code (< 2 minutes)")
    parser.add_argument("--seconds", type=int, default=None, help="seconds per wrk run (default 20; quick 6)")
    parser.add_argument("--rounds", type=int, default=None, help="trivial + real pairs (default 3; quick 1)")
    parser.add_argument("--connections", type=int, default=32, help="wrk connections (requests in flight)")
    parser.add_argument(
        "--rows", type=int, default=None, help="table rows = fresh sample ids (default 500k; quick 80k)"
    )
    parser.add_argument("--workers", type=int, default=2, help="uvicorn worker processes, both servers (default 2)")
    parser.add_argument(
        "--log-level", default="INFO", help="LETHE_LOG_LEVEL of the API (default INFO, as in production)"
    )
    parser.add_argument("--py-spy", default=None, help="record the API with py-spy (raw, --idle off) during round 1")
    parser.add_argument("--out", default=None, help="default: results/intake.json (intake_quick.json with --quick)")
    args = parser.parse_args()
    seconds = args.seconds or (6 if args.quick else 20)
    rounds = args.rounds or (1 if args.quick else 3)
    n_rows = args.rows or (80_000 if args.quick else 500_000)  # ~5,000 req/s x 20 s x 3 rounds, with room
    warm_seconds = 2 if args.quick else 4
    if shutil.which("wrk") is None:
        sys.exit("wrk is not installed: apt-get install -y wrk")

    db_name = f"lethe_bench_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{db_name}"')
    home = Path(tempfile.mkdtemp(prefix="lethe-bench-"))
    url = PG_ADMIN.rsplit("/", 1)[0].replace("postgresql://", "postgresql+psycopg://", 1) + f"/{db_name}"
    os.environ.update(
        {
            "LETHE_DATABASE_URL": url,
            "LETHE_HOME": str(home / "lethe"),  # beside the data root: neither may hold the other (app/config.py)
            "LETHE_SECRET_KEY": "bench-secret-0123456789abcdef-0123456789",  # >= 32 bytes
            "LETHE_RUN_DISPATCHER": "false",  # intake only: no worker competes during the load
            "LETHE_DATA_ROOTS": json.dumps([str(home / "data")]),
            "LETHE_LOG_LEVEL": args.log_level,
        }
    )
    os.environ.pop("LETHE_BROKER_URL", None)
    servers: list[subprocess.Popen] = []
    try:
        from sqlalchemy import func, select

        from app.audit.service import verify_chain
        from app.auth.service import create_key
        from app.db import migrate, session_scope
        from app.jobs.pipeline import execute_job
        from app.jobs.tables import Job
        from app.requests.tables import DeletionRequest
        from tests.helpers import write_table

        migrate()
        with session_scope() as session:
            api_key = create_key(session, "bench", ["requests:write", "models:write"])[1]
        (home / "data").mkdir()
        setup_started = time.perf_counter()
        write_table(home / "data" / "table.csv", n=n_rows)

        port, ceiling_port = _free_port(), _free_port()
        log_path = home / "server.log"
        servers.append(_serve("app.asgi:app", port, os.environ.copy(), args.workers, log_path))
        servers.append(_serve("bench.trivial_app:app", ceiling_port, os.environ.copy(), args.workers, log_path))
        load_before = os.getloadavg()
        response = httpx.post(
            f"http://127.0.0.1:{port}/v1/models",
            headers={"authorization": f"Bearer {api_key}"},
            json={
                "name": "bench",
                "dataset": {
                    "path": str(home / "data" / "table.csv"),
                    "row_id_column": "row_id",
                    "label_column": "label",
                },
            },
            timeout=300,
        )
        response.raise_for_status()
        model_id = response.json()["id"]
        # version 1 is trained in this process (the API's dispatcher is off, so the load phase times intake only)
        with session_scope() as session:
            job_id = session.execute(select(Job.id).where(Job.model_id == model_id)).scalar_one()
        assert execute_job(job_id, "bench") == "succeeded"
        setup_s = time.perf_counter() - setup_started

        next_row = 0
        id_files: list[Path] = []

        def real(tag: str, secs: int) -> dict:
            nonlocal next_row
            id_file = home / f"ids-{tag}.txt"
            id_files.append(id_file)
            point = _wrk(
                port,
                seconds=secs,
                connections=args.connections,
                model_id=model_id,
                api_key=api_key,
                tag=tag,
                first_row=next_row,
                id_file=str(id_file),
                server=servers[0],
            )
            next_row += point["responses"] + args.connections  # requests still in flight at the end used ids too
            return point

        def ceiling(tag: str, secs: int) -> dict:
            return _wrk(
                ceiling_port,
                seconds=secs,
                connections=args.connections,
                model_id=model_id,
                api_key=api_key,
                tag=tag,
                first_row=0,
                server=servers[1],
            )

        ceiling("warm-ceiling", warm_seconds)
        real("warm", warm_seconds)
        pairs = []
        for r in range(rounds):
            top = ceiling(f"ceiling{r}", seconds)
            spy = None
            if args.py_spy and r == 0:
                spy = subprocess.Popen(
                    [
                        _py_spy(),
                        "record",
                        "--pid",
                        str(servers[0].pid),
                        "--format",
                        "raw",
                        "--rate",
                        "200",
                        "--duration",
                        str(seconds),
                        "-o",
                        args.py_spy,
                        "--threads",
                        *(["--subprocesses"] if args.workers > 1 else []),
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            point = real(f"run{r}", seconds)
            if spy is not None:
                spy.wait()
            pairs.append(
                {"ceiling": top, "real": point, "ratio": round(point["requests_per_s"] / top["requests_per_s"], 3)}
            )
            print(
                f"round {r + 1}/{rounds}: trivial {top['requests_per_s']:.0f} req/s (p99 {top['p99_ms']:.1f} ms)  "
                f"real {point['requests_per_s']:.0f} req/s (p50 {point['p50_ms']:.1f} ms, p99 {point['p99_ms']:.1f} ms)"
                f"  ratio {pairs[-1]['ratio']:.2f}  statuses {point['statuses']}",
                flush=True,
            )
        load_after = os.getloadavg()
        log_lines = log_path.read_text(errors="replace").splitlines() if log_path.exists() else []
        if next_row > n_rows:
            print(f"warning: {next_row} sample ids used but the table has {n_rows} rows (raise --rows)")

        accepted_ids: list[str] = []
        for path in id_files:
            accepted_ids += [line for line in path.read_text().splitlines() if line]
        found = 0
        with session_scope() as session:
            for start in range(0, len(accepted_ids), 5000):
                chunk = accepted_ids[start : start + 5000]
                found += session.execute(
                    select(func.count()).select_from(DeletionRequest).where(DeletionRequest.id.in_(chunk))
                ).scalar_one()
            rows_in_db = session.execute(select(func.count()).select_from(DeletionRequest)).scalar_one()
        with session_scope() as session:  # the batched appends of two API processes still form one verified chain
            verdict = verify_chain(session)

        measured = [p["real"] for p in pairs]
        tops = [p["ceiling"] for p in pairs]
        total_ok = sum(p["statuses"].get(202, 0) for p in measured)
        total_wall = sum(p["wall_s"] for p in measured)
        rps = total_ok / total_wall
        ceiling_rps = sum(sum(v for k, v in p["statuses"].items() if 200 <= k < 300) for p in tops) / sum(
            p["wall_s"] for p in tops
        )
        non_202 = {}
        for p in measured:
            for k, v in p["statuses"].items():
                if k != 202:
                    non_202[k] = non_202.get(k, 0) + v
        result = {
            "benchmark": "deletion-request intake on PostgreSQL",
            "quick": args.quick,
            "generator": {
                "tool": _wrk_version(),
                "script": "bench/intake.lua",
                "threads": 1,
                "connections": args.connections,
                "seconds_per_run": seconds,
                "rounds": rounds,
                "mode": "closed loop (each connection sends its next request when the previous one is answered)",
            },
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
            "server": f"app.serving (uvicorn), {args.workers} worker process(es) on listening sockets of their own, "
            f"uvloop + httptools, dispatcher off, "
            f"LETHE_LOG_LEVEL={args.log_level}",
            "load_average_1_5_15": {
                "before": [round(x, 2) for x in load_before],
                "after": [round(x, 2) for x in load_after],
            },
            "server_log_lines": len(log_lines),
            "requests_per_s": round(rps, 1),
            "p50_ms": max(p["p50_ms"] for p in measured),
            "p99_ms": max(p["p99_ms"] for p in measured),
            "ceiling_requests_per_s": round(ceiling_rps, 1),
            "ceiling_p99_ms": max(p["p99_ms"] for p in tops),
            "ratio_to_ceiling": round(rps / ceiling_rps, 3),
            "accepted": len(accepted_ids),
            "found_in_db": found,
            "rows_in_db": rows_in_db,
            "non_202": non_202,
            "audit_chain": {"ok": verdict.ok, "events_checked": verdict.checked, "reason": verdict.reason},
            "rounds": pairs,
            "setup_s": round(setup_s, 1),
            "table_rows": n_rows,
            "notes": "requests_per_s: 202s per second over the measured real runs (warm-up excluded); p50_ms, "
            "p99_ms: the worst round's; ceiling: the trivial FastAPI endpoint (bench/trivial_app.py, one pydantic "
            "body, no database) with the same uvicorn flags (workers included), wrk script and connections, measured "
            "just before each real run. accepted counts every 202 of every real run (warm-up included); "
            "found_in_db: how many of their ids are rows in deletion_requests afterwards. wrk, uvicorn and "
            "PostgreSQL share the machine's cores (and other work on it: see load_average_1_5_15).",
        }
        out = args.out or str(ROOT / "bench" / "results" / ("intake_quick.json" if args.quick else "intake.json"))
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(result, indent=2) + "\n")
        print(
            f"real {rps:.0f} req/s (p50 {result['p50_ms']:.1f} ms, p99 {result['p99_ms']:.1f} ms)  ceiling "
            f"{ceiling_rps:.0f} req/s  ratio {result['ratio_to_ceiling']:.2f}  accepted {len(accepted_ids)}, found in "
            f"the database {found} (rows {rows_in_db}), other statuses {non_202}, audit chain "
            f"{'verifies' if verdict.ok else 'BROKEN: ' + str(verdict.reason)} ({verdict.checked} events) → {out}"
        )
    finally:
        for server in servers:
            server.terminate()
            try:
                server.wait(timeout=20)
            except subprocess.TimeoutExpired:
                server.kill()
        from app.db import reset_engine_cache

        reset_engine_cache()
        with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{db_name}" WITH (FORCE)')
        shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    main()
