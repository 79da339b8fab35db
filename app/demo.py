"""`make demo`: the whole service on the embedded default (SQLite file + in-process worker), driven over HTTP.

1. Exact retraining on real data that ships with scikit-learn (the Wisconsin breast-cancer table, 569 rows):
   register, delete a data subject's rows, print the request's journey and old/new accuracy.
2. Fast methods on the same table (Newton, influence, L2UL): registration prepares them and measures each on real
   deletions against exact retrains; one deletion per method and one by "auto", side by side with retraining.
3. EASE on a federated tiny CLIP + LoRA (5 simulated clients over HTTP): a whole client leaves; forget/retain/test
   R@1 before and after, the published forget lock, and later rounds with the lock; a figure in var/demo.
Ends with the audit chain's verdict.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import threading
import time
from pathlib import Path

from app.client import DeletionRequest, LetheClient, LetheProblem, Model
from app.ids import short_id

HOME = Path("var/demo")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _write_dataset(path: Path) -> int:
    from sklearn.datasets import load_breast_cancer

    frame = load_breast_cancer(as_frame=True).frame
    frame.insert(0, "patient_id", [f"P{i:04d}" for i in range(len(frame))])
    frame["target"] = frame["target"].map({0: "malignant", 1: "benign"})
    frame.to_csv(path, index=False)
    return len(frame)


def _printer(label: str):
    """A progress callback for the client's waits: one line per change of status (and progress, for requests)."""
    last = None

    def show(item: Model | DeletionRequest) -> None:
        nonlocal last
        line = f"  {label}: {item.status}" + (
            f"  {item.progress:.0%} {item.message or ''}" if isinstance(item, DeletionRequest) else ""
        )
        if line != last:
            print(line, flush=True)
            last = line

    return show


def _wait_model(client: LetheClient, model_id: str, until=None, timeout: float = 600) -> Model:
    return client.wait_model(model_id, until, timeout=timeout, on_progress=_printer("model"))


def run_demo(keep: bool = False) -> None:
    if HOME.exists() and not keep:
        shutil.rmtree(HOME)
    HOME.mkdir(parents=True, exist_ok=True)
    os.environ.update({"LETHE_HOME": str(HOME), "LETHE_POLL_SECONDS": "0.2"})
    # the embedded server shares this terminal: its per-request lines (a 404 for each poll of a lock that does not
    # exist yet) would bury the story; LETHE_LOG_LEVEL still wins when set
    os.environ.setdefault("LETHE_LOG_LEVEL", "WARNING")
    os.environ.pop("LETHE_DATABASE_URL", None)
    os.environ.pop("LETHE_BROKER_URL", None)

    import uvicorn

    from app.auth.service import create_key
    from app.config import get_settings
    from app.db import migrate, reset_engine_cache, session_scope

    get_settings.cache_clear()
    reset_engine_cache()
    settings = get_settings()
    print(f"Lethe demo — embedded default: {settings.resolved_database_url}, in-process executor\n")
    migrate()
    with session_scope() as session:
        _, key = create_key(session, "demo", ["admin"])

    from app.main import create_app

    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    try:
        with LetheClient(f"http://127.0.0.1:{port}", key, timeout=60) as client:
            model_id = _tabular_story(client)
            _l2ul_story(client, model_id)
            _ease_story(client)
            verdict = client.verify_audit()
            state = "intact" if verdict.ok else f"BROKEN at row {verdict.first_broken_seq}"
            print(f"\nAudit chain: {state}, {verdict.checked} events, head {verdict.head['hash'][:16]}…")
            print(f"Everything is in {HOME}/ (database, artifacts, figures).")
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def _tabular_story(client: LetheClient) -> str:
    data_path = HOME / "breast_cancer.csv"
    n_rows = _write_dataset(data_path)
    print("━━ Part 1: exact retraining ━━")
    print(f"1. Register a logistic-regression model on {n_rows} rows (scikit-learn's breast-cancer table)")
    metadata = {
        "name": "breast-cancer-lr",
        "family": "logistic_regression",
        "dataset": {"row_id_column": "patient_id", "label_column": "target"},
    }
    model = client.register_model(metadata, data_path)
    model = _wait_model(client, model.id)
    v1 = model.current_version
    print(
        f"   version 1 {v1.digest[:12]}…  train acc {v1.metrics['accuracy_train']:.3f}  "
        f"holdout acc {v1.metrics['accuracy_holdout']:.3f}\n"
    )

    subject = ["P0003", "P0010", "P0042", "P0100", "P0321"]
    print(f"2. A data subject asks to be forgotten: rows {subject}")
    try:
        client.submit_deletion(model.id, {"kind": "samples", "sample_ids": ["P9999"]}, "alice@example.org")
    except LetheProblem as bad:
        print(f"   (a typo first: {bad.status} {bad.slug} {bad.extensions.get('unknown_sample_ids')})")
    request = client.submit_deletion(
        model.id,
        {"kind": "samples", "sample_ids": subject},
        "alice@example.org",
        method="retrain",
        idempotency_key="demo-request-1",
    )
    print(f"   POST /v1/deletion-requests → 202, Location {request.location}")
    request = client.wait(request.id, timeout=600, on_progress=_printer("request"))
    if request.status != "certified":
        raise SystemExit(f"the deletion did not complete: {request.error}")

    versions = client.versions(model.id)
    old, new = versions[-2], versions[-1]
    before, after = new.metrics["before"], new.metrics["after"]
    print("\n3. The request's journey (audit log):")
    for event in client.audit_events(entity_id=request.id).items:
        print(f"   #{event.seq:<3} {event.at.isoformat()[11:23]}  {event.action:<28} by {event.actor}")
    print(
        f"   received {_clock(request.created_at)} → started {_clock(request.started_at)} → "
        f"certified {_clock(request.completed_at)}  (attempts: {request.attempts})"
    )
    print("\n4. Old and new version:")
    print(f"   {'':<12}{'version':>8}{'retain acc':>12}{'forget acc':>12}{'holdout acc':>13}")
    for label, number, m in (("original", old.number, before), ("retrained", new.number, after)):
        print(
            f"   {label:<12}{number:>8}{m['accuracy_retain']:>12.4f}{m['accuracy_forget']:>12.4f}"
            f"{m['accuracy_holdout']:>13.4f}"
        )
    print(
        f"   lineage: v{old.number} {old.digest[:12]}… → v{new.number} "
        f"{new.digest[:12]}… ({new.method}, {new.metrics['unlearn_seconds']:.3f} s)"
    )
    print("\n5. Evidence:")
    _evidence(client, request, "retrain")
    return model.id


def _clock(moment) -> str:
    """HH:MM:SS.mmm, as the demo prints times."""
    return moment.isoformat()[11:23] if moment else "—"


def _evidence(client: LetheClient, request: DeletionRequest, label: str) -> None:
    """What a compliance officer gets: the verdict and why, the audit's power, the erasure, the certificate — checked
    offline here against the published keys, as a third party would."""
    from app.certificates.verify_cli import verify_file

    for report in client.reports(request.id):
        print(f"   verdict on {report.method}: {report.verdict.upper()}")
        for check in report.checks:
            mark = {True: "✓", False: "✗", None: "·"}[check.passed]
            print(f"     {mark} {check.message}")
        print(f"     membership audit: {'informative' if report.informative else 'UNINFORMATIVE'} — "
              f"{report.informative_detail or ''}")  # fmt: skip
        print(f"     evidence class: {', '.join(report.evidence) or 'none'}")
    manifest = request.erasure or {}
    if manifest:
        methods = ", ".join(f"{k}: {v['action']}" for k, v in manifest.get("method_state", {}).items()) or "none"
        print(
            f"   erased: {manifest.get('index', {}).get('rows_deleted', 0)} rows from the stored table and index; "
            f"{len(manifest.get('versions_retired', []))} earlier versions retired (410); method state: {methods}"
        )
    if "certificate" not in request.links:
        print(f"   {label}: no certificate (the verdict did not pass)")
        return
    envelope = client.certificate(request.links["certificate"])
    cert = HOME / f"certificate-{short_id(request.id)}.json"
    keys = HOME / "lethe-keys.json"
    cert.write_text(json.dumps(envelope, indent=1))
    keys.write_text(json.dumps(client.signing_keys()))
    ok, message = verify_file(str(cert), str(keys))
    print(f"   certificate {cert.name}: {'VERIFIED offline' if ok else 'INVALID'} — {message}")


def _why_not_certified(client: LetheClient, request: DeletionRequest) -> None:
    """Say plainly why EASE's model was not certified: which of its checks failed, with their figures. The
    thresholds are the service's verdict policy, not tuned to this story (issue 24 item 6). With the client-scope
    default (the server's excision from the stored updates) EASE passed here when written (retain R@1 92.3 → 90.7);
    since the check against the reference (stop 50) it can fail that check on a host whose bits differ (stop 52's
    machine: 1.78 points below the runs' mean, allowance 1.42) — this is where the demo says so."""
    ease = [r for r in client.reports(request.id) if r.method == "ease"]
    failed = [c for r in ease for c in r.checks if c.passed is False]
    reasons = [r for rep in ease for r in rep.reasons]
    verdict = ease[0].verdict.upper() if ease else "missing"
    print(f"   EASE's verdict was {verdict}: nothing published or erased. EASE failed on:")
    for check in failed:
        figure = "" if check.figure is None else f" (figure {check.figure:.3g} vs threshold {check.threshold:.3g})"
        print(f"     ✗ {check.name}{figure}: {check.message}")
    for reason in reasons if not failed else []:
        print(f"     ✗ {reason}")
    print(
        "   The thresholds are the service's verdict policy (the same for every method), not tuned to this demo: an\n"
        "   approximate deletion that does not pass them is not certified. The request runs again with auto."
    )


def _finished(client: LetheClient, request: DeletionRequest, label: str) -> DeletionRequest:
    return client.wait(request.id, timeout=900, on_progress=_printer(label))


def _l2ul_story(client: LetheClient, tabular_model_id: str) -> None:
    """The same table with fast methods prepared (Newton, influence, L2UL): each measured on real deletions at
    preparation, then one deletion per method and one by ``auto``, side by side with retraining."""

    print("\n━━ Part 2: fast unlearning, measured before it is trusted ━━")
    settings = {"m": 300, "subset_size": 300, "epochs": 150, "units": 4}
    methods = ["newton", "influence", "l2ul"]
    metadata = {
        "name": "breast-cancer-lr-fast",
        "family": "logistic_regression",
        "unlearning": methods,
        "method_settings": {"l2ul": settings},
        "dataset": {"row_id_column": "patient_id", "label_column": "target"},
    }
    print(
        f'1. Register the table again with "unlearning": {methods}: a Hessian factor (Newton, influence) and a '
        f"learned unlearner (L2UL, m={settings['m']} simulated deletions in {settings['units']} units); then each is "
        "checked on real deletions against exact retrains"
    )
    model_id = client.register_model(metadata, HOME / "breast_cancer.csv").id
    model = _wait_model(
        client,
        model_id,
        lambda b: (
            b.status == "failed"
            or all(b.unlearning.get(m, {}).get("status") in ("ready", "refused", "failed") for m in methods)
        ),
        timeout=900,
    )
    print(
        f"   {'method':<10}{'status':<10}{'param_ratio':>12}{'acc gap':>9}{'step ms':>9}   (median of real deletions)"
    )
    for name in methods:
        entry = model.unlearning.get(name, {})
        v = entry.get("info", {}).get("validation") or {}
        ratio, gap, step = v.get("param_ratio_median"), v.get("acc_gap_pts_median"), v.get("method_seconds_median")
        figures = f"{ratio:>12.4f}{gap:>+9.2f}{step * 1e3:>9.3f}" if ratio is not None else f"{'—':>12}{'':>18}"
        print(f"   {name:<10}{entry.get('status', '?'):<10}{figures}")
        if entry.get("reason"):
            print(f"      {entry['reason']}")
    rows = {
        "newton": ["P0005", "P0017", "P0200"],
        "l2ul": ["P0006", "P0018", "P0201"],
        "retrain": ["P0007", "P0019", "P0202"],
        "auto": ["P0008", "P0020", "P0203"],
    }
    outcome = {}
    for method, ids in rows.items():
        try:
            submitted = client.submit_deletion(
                model_id, {"kind": "samples", "sample_ids": ids}, f"demo-{method}", method=method
            )
        except LetheProblem as problem:
            print(f"   {method}: {problem.status} {problem.slug}: {problem.detail}")
            continue
        done = _finished(client, submitted, method)
        _evidence(client, done, method)
        if done.status != "certified":
            print(f"   {method}: {done.status} — {done.error['detail']}")
            continue
        outcome[method] = client.versions(model_id)[-1].metrics
    if outcome:
        print(f"2. Four subjects, three rows each: {'':<6}{'ran':>9}{'unlearn s':>11}{'holdout acc':>13}")
        for method, m in outcome.items():
            print(
                f"   {method:<37}{m['method']:>9}{m['unlearn_seconds']:>11.4f}{m['after']['accuracy_holdout']:>13.4f}"
            )
        if "auto" in outcome:
            print(f"   auto chose {outcome['auto']['choice']['method']}: {outcome['auto']['choice']['reason']}")
        if "newton" in outcome:
            info = outcome["newton"]["method_info"]
            bound = (info.get("bound") or {}).get("bound")
            print(
                f"   Newton step alone: {info['method_seconds'] * 1e3:.2f} ms; proven ||theta' - theta_retrain*|| <= "
                f"{bound:.2e}"
                if bound is not None
                else f"   Newton step alone: {info['method_seconds'] * 1e3:.2f} ms"
            )


def _ease_story(client: LetheClient) -> None:
    """A federated tiny CLIP + LoRA: clients train over HTTP, one client leaves, EASE removes it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from app.fedclient import SimulatedClients
    from app.ml.verification.retrieval import evaluate_retrieval

    print("\n━━ Part 3: EASE, federated CLIP + LoRA, a client leaves ━━")
    rounds = 20
    model_id = client.register_model(
        {
            "name": "federated-clip",
            "kind": "clip_federated",
            "data": {"kind": "synthetic", "seed": 0, "n_clients": 5, "pairs_per_client": 200, "n_test": 300},
            "fed_settings": {"rounds": rounds},
        }
    ).id
    print("1. Register a tiny open_clip model with LoRA on both towers (the backbone pretrains once, then is cached)")
    _wait_model(client, model_id, timeout=900)
    clients = SimulatedClients(client, model_id)
    scenario = clients.data.scenarios["client"]
    leaving = f"c{scenario['client']}"
    forget = clients.data.clients[scenario["client"]]
    test = clients.data.test

    def forget_r1() -> float:
        _, theta = clients.current_theta()
        clients.clip.set_theta(theta)
        return evaluate_retrieval(clients.clip, forget, test).mean_r1

    print(
        f"2. {rounds} FedAvg rounds: 5 clients train locally and upload their LoRA updates; client {leaving} alone "
        f"holds the concept {scenario.get('word', 'star')!r}"
    )
    curve = []
    for r in range(rounds):
        job = clients.round(r)
        if job["status"] != "succeeded":
            raise SystemExit(f"round {r} failed: {job['error']}")
        curve.append(forget_r1())
        if (r + 1) % 5 == 0:
            print(f"   round {r + 1:>2}: forget-client R@1 {curve[-1]:5.1f}")
    print(
        f"3. Client {leaving} leaves: POST a deletion with scope client, method ease (approximate: certified only if "
        "its own verdict passes). `auto` would not run EASE on this model: the verdict trains the recipe without the "
        "client (its audit reference), whose run 0 is exact retraining, so auto publishes that run instead"
    )
    submitted = client.submit_deletion(
        model_id, {"kind": "client", "client_id": leaving}, f"federated client {leaving}", method="ease"
    )
    done = _finished(client, submitted, "request")
    _evidence(client, done, "ease")
    if done.status != "certified":
        _why_not_certified(client, done)
        done = _finished(client, client.retry(done.id, method="auto"), "request")
        _evidence(client, done, "auto")
    if done.status != "certified":
        raise SystemExit(f"the client's deletion did not complete: {done.error}")
    version = client.versions(model_id)[-1]
    metrics, method = version.metrics, version.method
    if "choice" in metrics:
        print(f"   auto ran {method}: {metrics['choice']['note']}")
    before, after, info = metrics["before"], metrics["after"], metrics.get("method_info", {})
    print(f"   {'R@1 (mean i→t, t→i)':<24}{'forget':>8}{'retain':>8}{'test':>8}")
    for label, m in (("before (original)", before), (f"after {method}", after)):
        print(f"   {label:<24}{m['forget_r1']:>8.1f}{m['retain_r1']:>8.1f}{m['test_r1']:>8.1f}")
    traffic = info.get("bytes_total", 0) / 1e6
    print(f"   {method} took {metrics['unlearn_seconds']:.1f} s and {traffic:.2f} MB of traffic")
    lock = client.forget_lock(model_id)
    after_curve = [forget_r1()]
    if lock is None:
        print("4. No forget lock (only EASE publishes one): 5 more rounds of the remaining clients")
    else:
        print(f"4. GET /v1/models/…/forget-lock → rank {lock.rank}, alpha {lock.alpha}, for the remaining clients")
    for r in range(5):
        job = clients.round(rounds + r, use_lock=lock is not None)
        after_curve.append(forget_r1())
    print(
        f"   5 more rounds{' with the lock (server projection)' if lock else ''}: forget R@1 "
        f"{' → '.join(f'{v:.1f}' for v in after_curve)}"
    )
    figure = HOME / "ease_forget_r1.png"
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot(range(1, rounds + 1), curve, marker="o", label="federated training")
    ax.plot(range(rounds, rounds + len(after_curve)), after_curve, marker="s", label=f"after {method}")
    ax.axvline(rounds + 0.0, color="grey", linestyle=":")
    ax.set_xlabel("round")
    ax.set_ylabel(f"forget-client R@1 (client {leaving})")
    ax.set_title(f"{method}: a leaving client's knowledge, before and after unlearning")
    ax.legend()
    fig.tight_layout()
    fig.savefig(figure, dpi=110)
    print(f"   figure: {figure}")
