"""Batched versions (issue 21): requests already waiting on a model when a worker takes one are served by ONE new
version, each judged on its own rows and certified with its own certificate; a member whose verdict fails never
holds the others hostage and is never certified (embedded default: SQLite + in-process worker)."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient

from app.certificates.verify_cli import verify_file
from app.jobs.tabular import stored_frame
from app.main import create_app
from app.storage import get_store
from tests.helpers import configure, make_key, wait_for, wait_model, wait_request, write_table

SCOPES = ["models:write", "models:read", "requests:write", "requests:read", "audit:read", "admin"]


@pytest.fixture
def model(tmp_path):
    """A registered LR model (16 shadows, Newton prepared) and the key's headers; no worker runs after this."""
    return _register(tmp_path, shadows=16)


@pytest.fixture
def model32(tmp_path):
    """The same with 32 shadows: each row OUT of 8 of them, twice the pool's minimum (a 16-shadow pool's minimum is
    the full pool)."""
    return _register(tmp_path, shadows=32)


def _register(tmp_path, shadows: int):
    configure(tmp_path / "home", poll_seconds="0.05")
    headers = {"authorization": f"Bearer {make_key(SCOPES)}"}
    source = tmp_path / "t.csv"
    write_table(source, n=400, seed=2)
    metadata = {
        "name": "batch",
        "holdout_fraction": 0.25,
        "unlearning": ["newton"],
        "verification": {"shadows": shadows},
        "dataset": {"row_id_column": "row_id", "label_column": "label"},
    }
    with TestClient(create_app(run_background=True), headers=headers) as client:
        with source.open("rb") as handle:
            response = client.post(
                "/v1/models", data={"metadata": json.dumps(metadata)}, files={"file": ("t.csv", handle, "text/csv")}
            )
        body = wait_model(client, response.json()["id"], timeout=180)
        assert body["status"] == "ready", body
    return body["id"], headers


def _queue(headers, model_id, scopes: list[list[str]], method: str) -> list[str]:
    """POST the requests with no worker running: they wait in the outbox together."""
    with TestClient(create_app(run_background=False), headers=headers) as client:
        ids = []
        for rows in scopes:
            response = client.post(
                "/v1/deletion-requests",
                json={
                    "subject_ref": f"s-{rows[0]}",
                    "model_id": model_id,
                    "method": method,
                    "scope": {"kind": "samples", "sample_ids": rows},
                },
            )
            assert response.status_code == 202, response.text
            ids.append(response.json()["id"])
    return ids


def _plots_drawn_on_demand(client, links: list[str]) -> None:
    """A deletion stores its audit's plot data, not PNGs (issue 21): the first GET draws the PNG and keeps it, a
    second is served the same bytes, and the ETag (the data's digest) answers 304."""
    from app.db import session_scope
    from app.reports.tables import Report

    assert links, "no plots on the batch's reports"
    report_id, name = links[0].split("/")[-3], links[0].split("/")[-1]
    with session_scope() as session:
        assert "png" not in session.get(Report, report_id).plots[name]  # nothing drawn during the deletion
    first = client.get(links[0])
    assert first.status_code == 200 and first.content.startswith(b"\x89PNG")
    with session_scope() as session:
        assert session.get(Report, report_id).plots[name]["png"]  # kept
    again = client.get(links[0], headers={"if-none-match": first.headers["etag"]})
    assert again.status_code == 304
    assert client.get(links[0]).content == first.content


def _statement(envelope: dict) -> dict:
    return json.loads(base64.b64decode(envelope["payload"]))


def test_waiting_requests_share_one_version_and_each_gets_its_own_certificate(model, tmp_path):
    model_id, headers = model
    rows = [[f"r{i}"] for i in (3, 11, 40, 57, 90, 123)]
    ids = _queue(headers, model_id, rows, "retrain")
    with TestClient(create_app(run_background=True), headers=headers) as client:
        done = [wait_request(client, rid, timeout=300) for rid in ids]
        assert [d["status"] for d in done] == ["certified"] * len(ids), done
        versions = client.get(f"/v1/models/{model_id}/versions").json()
        assert len(versions) == 2  # registration's, and ONE for the six requests
        current = client.get(f"/v1/models/{model_id}").json()["current_version"]
        assert {d["result_version_id"] for d in done} == {current["id"]}
        keys_path = tmp_path / "keys.json"
        keys_path.write_text(json.dumps(client.get("/.well-known/lethe-keys.json").json()))
        certificates, plot_links = [], set()
        for d in done:
            envelope = client.get(d["links"]["certificate"]).json()
            path = tmp_path / f"{d['id']}.json"
            path.write_text(json.dumps(envelope))
            ok, message = verify_file(str(path), str(keys_path))
            assert ok, message
            certificates.append(envelope)
            reports = client.get(d["links"]["reports"]).json()["items"]
            assert [r["verdict"] for r in reports] == ["pass"]
            assert reports[0]["n_forget"] in (0, 1)  # its own row only (0: it was held out of training)
            plot_links.update(reports[0]["plots"].values())
        predicates = [_statement(c)["predicate"] for c in certificates]
        assert len({c["payloadType"] + c["payload"] for c in certificates}) == len(ids)  # each its own
        assert [p["request_id"] for p in predicates] == ids
        assert {_statement(c)["subject"][0]["digest"]["sha256"] for c in certificates} == {current["digest"]}
        for p in predicates:
            manifest = p["erasure_manifest"]
            assert manifest["index"]["rows_deleted"] == 1  # its own row, not the batch's
            assert manifest["batch"] == {"version_id": current["id"], "requests": len(ids), "rows": len(ids)}
        assert client.get("/v1/audit/verify").json()["ok"] is True
        _plots_drawn_on_demand(client, sorted(plot_links))
        certified = [
            e
            for rid in ids
            for e in client.get("/v1/audit", params={"entity_id": rid}).json()["items"]
            if e["action"] == "deletion_request.certified"
        ]
        assert len(certified) == len(ids)
    # no erased row id in the stored table
    from app.db import session_scope
    from app.registry.tables import Dataset, Model

    with session_scope() as session:
        dataset = session.get(Dataset, session.get(Model, model_id).dataset_id)
        chunked = dataset.chunks
        table = stored_frame(dataset.digest, ("row_id",), chunked=True)
    assert chunked and all(get_store().exists(d) for d in chunked)  # a manifest of chunks, not a table file
    assert not set(table["row_id"]) & {r[0] for r in rows}
    assert len(table) == 400 - len(ids)


def test_a_failing_member_is_split_off_and_fails_alone_while_the_others_are_certified(model):
    """Five requests named ``newton``: four one-row ones, and one naming 45 % of the table, further than one Newton
    step can go (its own proven distance fails). Their batch's version fails for all (its evidence is the shared
    retained objective's); a named method cannot escalate, so every member is given back to run alone: the four
    are certified, the poisoned one fails on its own verdict. Nothing is certified on a failed verdict."""
    model_id, headers = model
    poison = [f"r{i}" for i in range(200, 380)]
    singles = [[f"r{i}"] for i in (5, 17, 29, 61)]
    ids = _queue(headers, model_id, [singles[0], singles[1], poison, singles[2], singles[3]], "newton")
    poisoned = ids[2]
    with TestClient(create_app(run_background=True), headers=headers) as client:
        done = {rid: wait_request(client, rid, timeout=300) for rid in ids}
        failed = done.pop(poisoned)
        assert failed["status"] == "failed" and failed["error"]["type"].endswith("/verification-failed"), failed
        assert "certificate" not in failed["links"]
        assert [d["status"] for d in done.values()] == ["certified"] * 4, done
        reports = client.get(failed["links"]["reports"]).json()["items"]
        assert [r["verdict"] for r in reports] == ["fail", "fail"]  # in the batch, then alone
        assert reports[0]["batch"] == {"requests": 5}
        actions = [e["action"] for e in client.get("/v1/audit", params={"entity_id": poisoned}).json()["items"]]
        assert "deletion_request.split_off" in actions and "deletion_request.certified" not in actions
        for rid, d in done.items():
            envelope = client.get(d["links"]["certificate"]).json()
            assert _statement(envelope)["predicate"]["request_id"] == rid
        current = client.get(f"/v1/models/{model_id}").json()["current_version"]
        assert current["method"] == "newton"
        assert client.get("/v1/audit/verify").json()["ok"] is True


def test_an_admin_sets_the_batch_bounds_and_one_request_a_version_turns_batching_off(model):
    model_id, headers = model
    with TestClient(create_app(run_background=False), headers=headers) as client:
        assert client.get(f"/v1/models/{model_id}").json()["batch"] == {"max_requests": 2000, "max_rows": 20_000}
        bad = client.patch(f"/v1/models/{model_id}", json={"batch": {"max_requests": 0, "max_rows": 10}})
        assert bad.status_code == 422 and bad.headers["content-type"] == "application/problem+json"
        ok = client.patch(f"/v1/models/{model_id}", json={"batch": {"max_requests": 1, "max_rows": 1}})
        assert ok.status_code == 200 and ok.json()["batch"] == {"max_requests": 1, "max_rows": 1}
        events = client.get("/v1/audit", params={"entity_id": model_id}).json()["items"]
        assert any(e["action"] == "model.updated" and e["payload"] == {"batch": ok.json()["batch"]} for e in events)
    ids = _queue(headers, model_id, [["r7"], ["r8"], ["r9"]], "retrain")
    with TestClient(create_app(run_background=True), headers=headers) as client:
        done = [wait_request(client, rid, timeout=300) for rid in ids]
        assert [d["status"] for d in done] == ["certified"] * 3
        assert len({d["result_version_id"] for d in done}) == 3  # one version each
        assert all("batch" not in d["erasure"] for d in done)


def _shadow_count(model_id: str) -> tuple[int, dict]:
    from app.db import session_scope
    from app.ml.verification.shadows import shadows_from_bytes
    from app.registry.tables import Model

    with session_scope() as session:
        entry = session.get(Model, model_id).state["verification"]
    return shadows_from_bytes(get_store().get_bytes(entry["shadows"])).n_shadows, entry


def test_the_shadows_that_saw_the_rows_go_with_the_erasure_and_the_pool_is_refilled_after_the_certificate(model):
    """Issue 21, upkeep off the critical path: the published set (the manifest's after-digest) holds no shadow that
    trained on an erased row; after the certificate the same job trains the missing ones back, so the next request
    finds the full pool. A job re-taken after its certificate (its worker died in the upkeep) only finishes the
    upkeep: the request stays certified, no version is added."""
    from sqlalchemy import select, update

    from app.db import session_scope
    from app.jobs.tables import Job
    from app.ml.verification.shadows import shadows_from_bytes
    from tests.helpers import wait_for

    model_id, headers = model
    assert _shadow_count(model_id)[0] == 16
    [rid] = _queue(headers, model_id, [["r21", "r22", "r23"]], "retrain")
    with TestClient(create_app(run_background=True), headers=headers) as client:
        done = wait_request(client, rid, timeout=300)
        assert done["status"] == "certified", done
        swap = done["erasure"]["verification_shadows"]
        assert swap["before"] != swap["after"]  # the published set is another one: the copies left with the rows
        wait_for(lambda: _shadow_count(model_id)[0] == 16, timeout=120, what="the refill, block by block")
        n, entry = _shadow_count(model_id)
        dropped = entry["last_erasure"]["dropped"]
        assert dropped >= 1 and entry["last_erasure"]["kept"] == 16 - dropped
        assert n == 16 and entry["last_refill"]["trained"] == dropped and entry["last_refill"]["shadows"] == 16
        refilled = shadows_from_bytes(get_store().get_bytes(entry["shadows"]))
        positions = {int(p) for p in refilled.row_ids}
        with session_scope() as session:
            from app.registry.tables import DatasetRow

            erased = session.execute(select(DatasetRow.position).where(DatasetRow.row_id.in_(["r21", "r22", "r23"])))
            assert erased.all() == []  # their index entries are gone
        assert len(positions) == 400 - 3  # the pool lost exactly the three erased rows
        with session_scope() as session:
            job = session.execute(select(Job).where(Job.request_id == rid)).scalar_one()
        wait_for(lambda: _job_status(job.id) == "succeeded", timeout=60, what="the job to finish its upkeep")
        # the purge of newton's state that the erase step began (deferred) is completed in the same upkeep
        assert _job_result(job.id)["upkeep"] == {**entry["last_refill"], "purges_completed": ["newton"]}
        versions = client.get(f"/v1/models/{model_id}/versions").json()
        with session_scope() as session:  # as if its worker had died in the upkeep: re-offered
            session.execute(update(Job).where(Job.id == job.id).values(status="pending", attempts=1))
        wait_for(lambda: _job_status(job.id) == "succeeded", timeout=60, what="the re-taken job")
        assert client.get(f"/v1/deletion-requests/{rid}").json()["status"] == "certified"
        assert client.get(f"/v1/models/{model_id}/versions").json() == versions
        assert _job_result(job.id) == {"resumed": "upkeep", "upkeep": {"trained": 0, "shadows": 16, "missing": 0}}


def _trained_rows(model_id: str, k: int) -> list[str]:
    """k rows the model trained on (not held out): a deletion of one is audited."""
    from app.db import session_scope
    from app.jobs.tabular import holdout_mask
    from app.registry.tables import Model

    with session_scope() as session:
        spec = session.get(Model, model_id).spec
    held = holdout_mask(400, spec["holdout_fraction"], spec["recipe"]["seed"])
    return [f"r{i}" for i in range(30, 400) if not held[i]][:k]


def _report(client, rid: str) -> dict:
    done = wait_request(client, rid, timeout=300)
    assert done["status"] == "certified", done
    [report] = client.get(done["links"]["reports"]).json()["items"]
    return report


def test_a_pool_below_its_minimum_is_refilled_to_it_before_any_audit(model32):
    """Issue 21's minimum pool: a pool that leaves a row fewer than MIN_OUT_SHADOWS OUT shadows (the erasure dropped
    them, no refill followed) is refilled by the next deletion before it audits, to the minimum only: the request
    waits for that, its audit scores every row against at least that many OUT shadows, and the rest of the refill
    follows its certificate (nothing waits: the pool is full again)."""
    import numpy as np

    from app.db import session_scope
    from app.jobs.tabular import MIN_OUT_SHADOWS, pool_below_minimum, store_shadows
    from app.ml.verification.shadows import drop_shadows, out_counts, shadows_from_bytes
    from app.registry import versions as registry
    from app.registry.tables import Model

    model_id, headers = model32
    n, entry = _shadow_count(model_id)
    assert n == 32
    shadows = shadows_from_bytes(get_store().get_bytes(entry["shadows"]))
    short, counts = drop_shadows(shadows, np.asarray(shadows.row_ids[:2]))  # rows most shadows trained on
    assert 0 < short.n_shadows < 32 and out_counts(short).min() < MIN_OUT_SHADOWS
    with session_scope() as session:
        entry_short = {**entry, "shadows": store_shadows(short)}
        assert registry.swap_verification(session, model_id, entry["shadows"], entry_short)
        assert pool_below_minimum(session.get(Model, model_id))
    [rid] = _queue(headers, model_id, [_trained_rows(model_id, 1)], "retrain")
    with TestClient(create_app(run_background=True), headers=headers) as client:
        report = _report(client, rid)
        wait_for(lambda: _shadow_count(model_id)[0] == 32, timeout=120, what="the refill after the certificate")
    assert report["n_forget"] == 1 and report["attack"]["min_out_shadows"] >= MIN_OUT_SHADOWS, report["attack"]
    assert report["attack"]["n_shadows"] < 32  # audited on the minimum: the rest of the refill came after


def test_the_upkeep_yields_to_a_waiting_deletion_once_the_pool_meets_its_minimum(model32):
    """Issue 21, upkeep off the critical path: two one-row requests, one version each (batch bound 1). The first
    one's erasure drops the shadows that saw its row; its upkeep refills only to the minimum, since the second
    waits, and stops; the second is audited on that pool (every row at least MIN_OUT_SHADOWS OUT shadows, never
    fewer) and its own upkeep, with nothing waiting, refills the pool to the full 32."""
    from sqlalchemy import select

    from app.db import session_scope
    from app.jobs.tables import Job
    from app.jobs.tabular import MIN_OUT_SHADOWS

    model_id, headers = model32
    with TestClient(create_app(run_background=False), headers=headers) as client:
        response = client.patch(f"/v1/models/{model_id}", json={"batch": {"max_requests": 1, "max_rows": 1}})
        assert response.status_code == 200, response.text
    first, second = _queue(headers, model_id, [[r] for r in _trained_rows(model_id, 2)], "retrain")
    with TestClient(create_app(run_background=True), headers=headers) as client:
        reports = [_report(client, first), _report(client, second)]
        wait_for(lambda: _shadow_count(model_id)[0] == 32, timeout=120, what="the last refill")
    with session_scope() as session:
        jobs = {j.request_id: j.id for j in session.execute(select(Job).where(Job.model_id == model_id)).scalars()}
    assert reports[0]["attack"]["n_shadows"] == 32  # the registered pool
    yielded, last = _job_result(jobs[first])["upkeep"], _job_result(jobs[second])["upkeep"]
    assert yielded["shadows"] < 32 and yielded["missing"] > 0, yielded  # stopped at the minimum: the second waited
    assert reports[1]["attack"]["n_shadows"] == yielded["shadows"]  # audited on what the first one's upkeep left
    assert reports[1]["attack"]["min_out_shadows"] >= MIN_OUT_SHADOWS, reports[1]["attack"]
    assert last["shadows"] == 32 and last["missing"] == 0, last


def _job_status(job_id: str) -> str:
    return _job_result(job_id, "status")


def _job_result(job_id: str, field: str = "result"):
    from app.db import session_scope
    from app.jobs.tables import Job

    with session_scope() as session:
        return getattr(session.get(Job, job_id), field)


def test_an_auto_batch_whose_approximate_step_fails_escalates_as_a_whole_to_one_exact_version(model):
    """Four one-row ``auto`` requests batched on a model with Newton prepared: Newton's step on their union fails a
    request's own verdict, so the whole batch escalates once to exact retraining — one version, every request
    certified on it with both attempts in its reports, the failed one included (never certified on Newton)."""
    model_id, headers = model
    ids = _queue(headers, model_id, [["r31"], ["r32"], ["r33"], ["r34"]], "auto")
    with TestClient(create_app(run_background=True), headers=headers) as client:
        done = [wait_request(client, rid, timeout=300) for rid in ids]
        assert [d["status"] for d in done] == ["certified"] * 4, done
        assert len({d["result_version_id"] for d in done}) == 1
        first = []
        for d in done:
            reports = client.get(d["links"]["reports"]).json()["items"]
            assert [(r["method"], r["batch"]) for r in reports] == [
                ("newton", {"requests": 4}),
                ("retrain", {"requests": 4}),
            ]
            assert reports[-1]["verdict"] == "pass"
            first.append(reports[0]["verdict"])
        assert "fail" in first, first
        versions = client.get(f"/v1/models/{model_id}/versions").json()
        assert [v["method"] for v in versions] == ["train", "retrain"]
        _every_blob_referenced()  # the Newton attempt's weights were never published: shredded (issue 22)


def _every_blob_referenced() -> None:
    """Every blob in the store is referenced (a version, a data set, model state, a report, a live attempt...)."""
    from app.db import session_scope
    from app.jobs.blobs import referenced

    with session_scope() as session:
        live = referenced(session)
    names = [p.name for p in (Path(get_store().root) / "sha256").rglob("*") if p.is_file()]
    assert [n for n in names if n not in live] == []


def test_a_large_auto_batch_runs_exact_once_without_an_approximate_pass(model):
    """The hall applies the rule below: 100 one-row ``auto`` requests on a model with Newton prepared expect one
    chance failure, so they are served by ONE exact version and each report is a single ``retrain`` attempt (no
    Newton pass first), the version's choice saying why."""
    model_id, headers = model
    ids = _queue(headers, model_id, [[f"r{i}"] for i in range(200, 300)], "auto")
    with TestClient(create_app(run_background=True), headers=headers) as client:
        done = [wait_request(client, rid, timeout=300) for rid in ids]
        assert {d["status"] for d in done} == {"certified"}, done
        assert len({d["result_version_id"] for d in done}) == 1
        for d in done[:10]:
            reports = client.get(d["links"]["reports"]).json()["items"]
            assert [(r["method"], r["attempt"]) for r in reports] == [("retrain", 1)], reports
        version = client.get(f"/v1/models/{model_id}/versions").json()[-1]
        assert version["method"] == "retrain"
        assert "from the start" in version["metrics"]["choice"]["note"], version["metrics"]["choice"]


def test_auto_batch_that_chance_alone_would_escalate_runs_exact_from_the_start():
    """Each request of a batch is judged on its own rows, so an ``auto`` batch of b one-row requests expects
    b · attack_fpr attack-check failures by chance alone, and one failure escalates the whole batch: from one
    expected failure on, the exact method runs from the start (no wasted approximate pass); never for a named
    method, never below that."""
    from types import SimpleNamespace

    from app.jobs.tabular import Deletion
    from app.jobs.work import DeletionWork, Member
    from app.jobs.work import exact_from_the_start as from_the_start
    from app.ml.unlearning.base import get_method

    def exact_from_the_start(work: DeletionWork):
        return from_the_start(work, Deletion())  # a tabular verification never trains the exact deletion

    def work(n: int, method: str = "auto", policy: dict | None = None) -> DeletionWork:
        members = [
            Member(None, SimpleNamespace(method=method, scope={"kind": "samples", "sample_ids": [f"r{i}"]}))
            for i in range(n)
        ]
        model = SimpleNamespace(kind="tabular", spec={"verification": {"policy": policy or {}}})
        spec = get_method("influence")
        return DeletionWork(members, model, None, None, "influence", spec, spec.build({}), "v")

    assert exact_from_the_start(work(99)) is None  # 0.99 expected failures
    chosen = work(100)
    exact = exact_from_the_start(chosen)
    assert exact is not None and exact[0] == "retrain" and exact[1].exact
    assert "1 attack-check failures expected" in chosen.choice_note
    assert exact_from_the_start(work(100, method="influence")) is None  # named: it runs, failures split off
    assert exact_from_the_start(work(20, policy={"attack_fpr": 0.05})) is not None
    assert exact_from_the_start(work(1, policy={"attack_fpr": 0.5})) is None  # a request alone: nothing to escalate


def test_the_upkeep_completes_the_deferred_purge_of_the_newton_state(model):
    """A newton deletion stores its state downdated by the erased rows' terms (purge "deferred": nothing more on the
    request's path); the upkeep after the certificate recomputes it at the served model over the retained rows and
    the downdated blob is shredded (newton/method.py, module docstring)."""
    from sqlalchemy import select

    from app.db import session_scope
    from app.jobs.tables import Job
    from app.jobs.work import weights
    from app.ml.unlearning.newton.method import ARTIFACT_STATE, NewtonState
    from app.registry import versions as registry
    from app.registry.tables import Model

    model_id, headers = model
    with session_scope() as session:
        before = session.get(Model, model_id).state["methods"]["newton"]["artifacts"][ARTIFACT_STATE]
    (rid,) = _queue(headers, model_id, [["r7", "r8"]], "newton")
    with TestClient(create_app(run_background=True), headers=headers) as client:
        done = wait_request(client, rid, timeout=300)
        assert done["status"] == "certified"
        manifest = _statement(client.get(done["links"]["certificate"]).json())["predicate"]["erasure_manifest"]

        def finished():
            with session_scope() as session:
                return session.execute(select(Job.status).where(Job.request_id == rid)).scalar_one() == "succeeded"

        wait_for(finished, timeout=120, what="the deletion's upkeep")
    downdated = manifest["method_state"]["newton"]["after"][ARTIFACT_STATE]  # what the certificate's step stored
    assert downdated != before
    with session_scope() as session:
        digest = session.get(Model, model_id).state["methods"]["newton"]["artifacts"][ARTIFACT_STATE]
        served = weights(registry.load_model(session, model_id)[2].digest)
        registry.shred_due(session)
    state = NewtonState.from_bytes(get_store().get_bytes(digest))
    assert torch.equal(state.theta, served) and torch.equal(state.hessian_theta, served)  # recomputed there
    assert digest != downdated and not get_store().exists(downdated) and not get_store().exists(before)


def test_a_table_is_stored_in_chunks_at_its_first_version(model):
    """The registered table is re-stored in chunks when version 1 is trained (the first erasure then rewrites one
    chunk instead of splitting the whole table), and the file as uploaded is shredded (the same rows, now in chunks)."""
    from sqlalchemy import select

    from app.audit.tables import AuditEvent
    from app.db import session_scope
    from app.registry import versions as registry
    from app.registry.tables import Dataset, Model

    model_id, _ = model
    with session_scope() as session:
        dataset = session.get(Dataset, session.get(Model, model_id).dataset_id)
        chunked, digest = dataset.chunks, dataset.digest
        registered = session.execute(
            select(AuditEvent.payload).where(AuditEvent.entity_id == model_id, AuditEvent.action == "model.registered")
        ).scalar_one()
        registry.shred_due(session)
    uploaded = registered["dataset_digest"]
    assert chunked and digest != uploaded
    table = stored_frame(digest, ("row_id",), chunked=True)
    assert len(table) == 400 and set(table["row_id"]) == {f"r{i}" for i in range(400)}
    assert all(get_store().exists(d) for d in chunked) and not get_store().exists(uploaded)
