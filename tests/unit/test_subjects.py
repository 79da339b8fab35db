"""Per-person erasure across models (item 4): a subject column indexed as keyed hashes only, one erasure fanning out
to one deletion request per model, one combined certificate that verifies offline (embedded default, SQLite)."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select, update

from app.certificates import signing
from app.certificates.service import envelope_digest
from app.certificates.verify_cli import verify_file
from app.config import get_settings
from app.db import session_scope
from app.main import create_app
from app.registry.tables import Model
from app.registry.versions import hash_row_id
from app.subjects.service import settle_due, subject_hash
from app.subjects.tables import SubjectErasure, SubjectRow
from tests.helpers import configure, make_key, wait_for, wait_model, write_table

SCOPES = ["models:write", "requests:write", "requests:read", "audit:read", "admin"]
ALICE = "alice.subject-7f3a9c@example.org"  # a value that appears nowhere else
BOB = "bob.subject-2b8d1e@example.org"


def _table(path: Path, n: int, seed: int, prefix: str, people: dict[str, list[int]]) -> None:
    frame = write_table(path, n=n, seed=seed)
    frame["row_id"] = [f"{prefix}{i}" for i in range(n)]
    frame["person"] = [f"other-{i % 17}" for i in range(n)]
    for person, rows in people.items():
        frame.loc[rows, "person"] = person
    frame.to_csv(path, index=False)


def _register(client, path: Path, name: str, subject_column: str | None = "person") -> str:
    metadata = {
        "name": name,
        "verification": {"shadows": 8},
        "dataset": {"row_id_column": "row_id", "label_column": "label", "subject_column": subject_column},
    }
    with path.open("rb") as handle:
        response = client.post(
            "/v1/models", data={"metadata": json.dumps(metadata)}, files={"file": (path.name, handle, "text/csv")}
        )
    assert response.status_code == 202, response.text
    return response.json()["id"]


@pytest.fixture
def two_models(tmp_path):
    configure(tmp_path / "home", poll_seconds="0.05")
    headers = {"authorization": f"Bearer {make_key(SCOPES)}"}
    _table(tmp_path / "a.csv", 150, 1, "a", {ALICE: [3, 40, 77], BOB: [5]})
    _table(tmp_path / "b.csv", 140, 2, "b", {ALICE: [11, 90]})
    _table(tmp_path / "c.csv", 120, 3, "c", {BOB: [8]})
    with TestClient(create_app(run_background=True), headers=headers) as client:
        ids = [_register(client, tmp_path / f"{n}.csv", n) for n in ("a", "b", "c")]
        for model_id in ids:
            wait_for(lambda m=model_id: client.get(f"/v1/models/{m}").json()["status"] == "ready", 180, what="ready")
    return headers, ids


def _database_bytes() -> bytes:
    path = get_settings().local_database_path
    return b"".join(p.read_bytes() for p in path.parent.glob(path.name + "*"))


def _wait_erasure(client, erasure_id: str) -> dict:
    return wait_for(
        lambda: (b := client.get(f"/v1/subjects/erasures/{erasure_id}").json())["status"] != "in-progress" and b,
        timeout=300,
        interval=0.3,
        what=f"erasure {erasure_id}",
    )


def test_the_subject_column_is_indexed_as_keyed_hashes_and_is_no_feature(two_models):
    headers, (a, b, c) = two_models
    with session_scope() as session:
        hashed = subject_hash(ALICE)
        assert session.execute(select(func.count()).where(SubjectRow.subject_hash == hashed)).scalar() == 5
        encoder = session.get(Model, a).state["encoder"]
    assert "colour" in json.dumps(encoder) and "person" not in json.dumps(
        encoder
    )  # never a feature: the model cannot have learnt who is who
    assert ALICE.encode() not in _database_bytes()  # the raw value lives only in the data set's own rows
    with TestClient(create_app(run_background=False), headers=headers) as client:
        model = client.get(f"/v1/models/{a}").json()
        assert model["subject_column"] == "person"
        bad = {"name": "x", "dataset": {"row_id_column": "row_id", "label_column": "label", "subject_column": "nope"}}
        refused = client.post(
            "/v1/models", data={"metadata": json.dumps(bad)}, files={"file": ("t.csv", b"row_id,label\n1,a\n")}
        )
        assert refused.status_code == 422 and refused.json()["type"].endswith("/unknown-column")


def test_an_erasure_across_two_models_ends_with_one_combined_certificate(two_models, tmp_path):
    headers, (a, b, c) = two_models
    with TestClient(create_app(run_background=True), headers=headers) as client:
        missing = client.post("/v1/subjects/erasures", json={"subject_ref": "nobody@example.org", "method": "retrain"})
        assert missing.status_code == 202, missing.text  # issue 22: the answer does not say whether anyone was there
        nothing = missing.json()
        assert nothing["status"] == "certified" and nothing["no_data_found"] is True and nothing["children"] == []
        assert _no_data_predicate(client, nothing)["search"]["models_searched"] == [a, b, c]  # all indexed models

        created = client.post("/v1/subjects/erasures", json={"subject_ref": ALICE, "method": "retrain"})
        assert created.status_code == 202, created.text
        erasure = created.json()
        assert set(erasure) == set(nothing) and set(created.headers) == set(missing.headers)  # the same shape
        assert erasure["status"] == "in-progress" and erasure["no_data_found"] is False
        assert created.headers["location"] == f"/v1/subjects/erasures/{erasure['id']}"
        assert erasure["subject_hash"] == subject_hash(ALICE)
        assert {ch["model_id"]: ch["n_samples"] for ch in erasure["children"]} == {a: 3, b: 2}  # not c: no rows
        first = client.get(erasure["children"][0]["links"]["self"]).json()
        assert "sample_ids" not in first["scope"] and "positions" not in first["scope"]  # keyed hashes only
        rows = (["a3", "a40", "a77"], ["b11", "b90"])
        assert sorted(first["scope"]["sample_id_hashes"]) in [sorted(map(hash_row_id, r)) for r in rows]
        assert first["subject_hash"] == erasure["subject_hash"]

        done = _wait_erasure(client, erasure["id"])
        assert done["status"] == "certified", done
        assert done["children_by_status"] == {"certified": 2}
        envelope = client.get(done["links"]["certificate"]).json()
        statement = json.loads(base64.b64decode(envelope["payload"]))
        assert statement["predicateType"] == signing.SUBJECT_ERASURE_PREDICATE_TYPE
        predicate = statement["predicate"]
        assert predicate["erasure_id"] == erasure["id"] and predicate["subject_hash"] == erasure["subject_hash"]
        for child in done["children"]:
            child_envelope = client.get(child["links"]["certificate"]).json()
            listed = next(x for x in predicate["children"] if x["request_id"] == child["request_id"])
            assert listed["certificate_digest"] == envelope_digest(child_envelope) == child["certificate_digest"]
        assert sorted(s["digest"]["sha256"] for s in statement["subject"]) == sorted(
            x["certificate_digest"] for x in predicate["children"]
        )
        keys = client.get("/.well-known/lethe-keys.json").json()
        cert_path, keys_path = tmp_path / "combined.json", tmp_path / "keys.json"
        cert_path.write_text(json.dumps(envelope))
        keys_path.write_text(json.dumps(keys))
        ok, message = verify_file(cert_path, str(keys_path))
        assert ok and "combined erasure certificate" in message and "2 model(s)" in message, message
        tampered = dict(envelope, payload=base64.b64encode(base64.b64decode(envelope["payload"]) + b" ").decode())
        cert_path.write_text(json.dumps(tampered))
        ok, message = verify_file(cert_path, str(keys_path))
        assert not ok and "bad-signature" in message

        found = client.get(f"/v1/subjects/{erasure['subject_hash']}/requests").json()
        assert {r["id"] for r in found["requests"]} == {ch["request_id"] for ch in erasure["children"]}
        assert [e["id"] for e in found["erasures"]] == [erasure["id"]]
        assert client.get("/v1/subjects/not-a-hash/requests").status_code == 422
        # by the person's reference: the server computes the keyed hash (a POST keeps the reference out of URLs)
        by_ref = client.post("/v1/subjects/lookup", json={"subject_ref": ALICE})
        assert by_ref.status_code == 200 and by_ref.json() == found, by_ref.text
        nobody = client.post("/v1/subjects/lookup", json={"subject_ref": "nobody at all"}).json()
        assert nobody["requests"] == [] and nobody["subject_hash"] == subject_hash("nobody at all")
        assert client.post("/v1/subjects/lookup", json={"subject_ref": ALICE, "x": 1}).status_code == 422
        assert client.post("/v1/subjects/lookup", content=ALICE).status_code == 415
        events = [e["action"] for e in client.get("/v1/audit", params={"entity_id": erasure["id"]}).json()["items"]]
        assert events == ["subject_erasure.received", "subject_erasure.certified"]

        with session_scope() as session:  # erased rows took their subject index entries with them
            assert (
                session.execute(select(func.count()).where(SubjectRow.subject_hash == subject_hash(ALICE))).scalar()
                == 0
            )
            assert (
                session.execute(select(func.count()).where(SubjectRow.subject_hash == subject_hash(BOB))).scalar() == 2
            )
        again = client.post("/v1/subjects/erasures", json={"subject_ref": ALICE})  # erased: nothing left to find
        assert again.status_code == 202 and again.json()["no_data_found"] is True, again.text
        assert again.json()["status"] == "certified" and again.json()["subject_hash"] == subject_hash(ALICE)
        assert client.get("/v1/audit/verify").json()["ok"] is True
    assert ALICE.encode() not in _database_bytes()

    with session_scope() as session:  # the sweep issues a certificate the publishing transaction could not
        session.execute(
            update(SubjectErasure)
            .where(SubjectErasure.id == erasure["id"])
            .values(certificate=None, certificate_digest=None, completed_at=None)
        )
    with session_scope() as session:
        assert settle_due(session) == 1
    with session_scope() as session:
        assert settle_due(session) == 0  # once


def _no_data_predicate(client, erasure: dict) -> dict:
    envelope = client.get(erasure["links"]["certificate"]).json()
    verified = signing.verify_envelope(
        envelope, client.get("/.well-known/lethe-keys.json").json(), predicate_type=signing.PREDICATE_TYPES
    )
    assert verified.predicate["no_data_found"] is True and verified.predicate["children"] == []
    return verified.predicate


def _fake_untrained_model(name: str) -> str:
    """A model registered with a subject column whose first training has not finished (no version, no index)."""
    with session_scope() as session:
        model = Model(name=name, kind="tabular", status="registering", spec={"subject_column": "person"}, state={})
        session.add(model)
        session.flush()
        return model.id


def test_a_subject_no_model_holds_is_certified_at_once_and_the_certificate_says_so(tmp_path):
    """Issue 23: "no data found" is answered like any erasure (202, the same body), audited, and certified by its
    own combined certificate that says so, verified offline by the same code as every certificate."""
    configure(tmp_path / "home")
    headers = {"authorization": f"Bearer {make_key(SCOPES)}"}
    pending = _fake_untrained_model("still-training")
    with session_scope() as session:  # a model without a subject column is not a model a subject search covers
        session.add(Model(name="no-subjects", kind="tabular", status="registering", spec={}, state={}))
    with TestClient(create_app(run_background=False), headers=headers) as client:
        created = client.post("/v1/subjects/erasures", json={"subject_ref": "nobody@example.org"})
        assert created.status_code == 202, created.text
        assert created.headers["location"] == f"/v1/subjects/erasures/{created.json()['id']}"
        assert "retry-after" in created.headers
        erasure = created.json()
        assert erasure["subject_hash"] == subject_hash("nobody@example.org")
        assert erasure["status"] == "certified" and erasure["no_data_found"] is True
        assert erasure["children"] == [] and erasure["children_by_status"] == {}
        assert erasure["completed_at"] and erasure["certificate_digest"]
        assert client.get(f"/v1/subjects/erasures/{erasure['id']}").json() == erasure  # read back the same

        envelope = client.get(erasure["links"]["certificate"]).json()
        assert envelope_digest(envelope) == erasure["certificate_digest"]
        statement = json.loads(base64.b64decode(envelope["payload"]))
        assert statement["predicateType"] == signing.SUBJECT_ERASURE_PREDICATE_TYPE
        predicate = statement["predicate"]
        assert predicate["no_data_found"] is True and predicate["children"] == []
        assert predicate["erasure_id"] == erasure["id"] and predicate["subject_hash"] == erasure["subject_hash"]
        assert predicate["search"]["models_searched"] == []
        assert [m["model_id"] for m in predicate["search"]["models_not_searched"]] == [pending]
        assert statement["subject"] == [
            {
                "name": f"subject-search:{erasure['id']}",
                "digest": {"sha256": signing.search_digest(predicate["search"])},
            }
        ]
        deadline = predicate["deadline"]
        assert deadline["answered_on_time"] is True and deadline["due_at"] > predicate["timestamps"]["completed_at"]

        events = client.get("/v1/audit", params={"entity_id": erasure["id"]}).json()["items"]
        assert [e["action"] for e in events] == [
            "subject_erasure.received",
            "subject_erasure.no_data_found",
            "subject_erasure.certified",
        ]
        found = events[1]["payload"]
        assert (
            found["subject_hash"] == erasure["subject_hash"] and found["models_not_searched"][0]["model_id"] == pending
        )
        assert "nobody@example.org" not in json.dumps(events)  # the keyed hash, never the reference
        assert events[2]["payload"]["certificate_digest"] == erasure["certificate_digest"]
        assert predicate["audit_chain_head"]["seq"] == events[1]["seq"]  # bound to the event that says so
        verdict = client.get("/v1/audit/verify").json()
        assert verdict["ok"] is True and verdict["checked"] >= 3, verdict

        keys_path, cert_path = tmp_path / "keys.json", tmp_path / "nodata.json"
        keys_path.write_text(json.dumps(client.get("/.well-known/lethe-keys.json").json()))
        cert_path.write_text(json.dumps(envelope))
        ok, message = verify_file(cert_path, str(keys_path))
        assert ok and "NO DATA FOUND" in message and "no model held rows of this subject" in message, message
        assert f"model {pending} (status registering)" in message and "on time" in message, message
        found_by_hash = client.get(f"/v1/subjects/{erasure['subject_hash']}/requests").json()
        assert found_by_hash["requests"] == [] and [e["id"] for e in found_by_hash["erasures"]] == [erasure["id"]]

        late = client.post(  # received by the controller longer ago than the deadline: answered, but late
            "/v1/subjects/erasures",
            json={"subject_ref": "nobody@example.org", "received_at": "2020-01-15T09:00:00+00:00"},
        )
        assert late.status_code == 202 and late.json()["status"] == "certified", late.text
        late_deadline = _no_data_predicate(client, late.json())["deadline"]
        assert late_deadline == {
            "received_at": "2020-01-15T09:00:00Z",
            "due_at": "2020-02-15T09:00:00Z",
            "answered_on_time": False,
        }
        cert_path.write_text(json.dumps(client.get(late.json()["links"]["certificate"]).json()))
        ok, message = verify_file(cert_path, str(keys_path))
        assert ok and "LATE" in message, message
    with session_scope() as session:
        assert settle_due(session) == 0  # certified already: nothing for the sweep


def test_a_refused_method_is_refused_whether_or_not_the_subject_has_rows(tmp_path):
    """Issue 22: a method no per-person erasure can use is refused before the subject is looked up, the same way
    for anyone (so the refusal is no presence oracle), and refuses nothing into the database."""
    configure(tmp_path / "home")
    headers = {"authorization": f"Bearer {make_key(SCOPES)}"}
    with TestClient(create_app(run_background=False), headers=headers) as client:
        unknown = client.post("/v1/subjects/erasures", json={"subject_ref": "nobody", "method": "no-such-method"})
        assert unknown.status_code == 422 and unknown.json()["type"].endswith("/unknown-method"), unknown.text
        clip_only = client.post("/v1/subjects/erasures", json={"subject_ref": "nobody", "method": "ease"})
        assert clip_only.status_code == 422 and clip_only.json()["type"].endswith("/method-not-supported")
    with session_scope() as session:
        assert session.execute(select(func.count()).select_from(SubjectErasure)).scalar() == 0


def test_a_child_that_cannot_start_is_recorded_failed_not_a_refusal(two_models):
    """Issue 22, subject oracle: rows of the person held by an unfinished request on one model used to refuse the
    whole erasure (409 naming the model, nothing written) — an answer that only a present person could get. Now the
    erasure is accepted like any other (202), recorded and audited; that model's child is failed with the reason
    and holds nothing, and can be retried once the other request has ended."""
    headers, (a, b, c) = two_models
    with TestClient(create_app(run_background=False), headers=headers) as client:
        held = client.post(
            "/v1/deletion-requests",
            json={"subject_ref": "x", "model_id": c, "scope": {"kind": "samples", "sample_ids": ["c8"]}},
        )
        assert held.status_code == 202
        accepted = client.post("/v1/subjects/erasures", json={"subject_ref": BOB})
        assert accepted.status_code == 202, accepted.text
        erasure = accepted.json()
        blocked = [child for child in erasure["children"] if child["model_id"] == c]
        assert len(blocked) == 1 and blocked[0]["status"] == "failed"
        assert blocked[0]["error"]["type"].endswith("/deletion-in-progress") and c in blocked[0]["error"]["detail"]
        assert all(child["status"] != "failed" for child in erasure["children"] if child["model_id"] != c)
        events = client.get("/v1/audit", params={"entity_id": erasure["id"]}).json()["items"]
        assert [e["action"] for e in events] == ["subject_erasure.received"]
        retried = client.post(f"/v1/deletion-requests/{blocked[0]['request_id']}/retry")
        assert retried.status_code == 409, retried.text  # the other request still holds the row
        unknown = client.post("/v1/subjects/erasures", json={"subject_ref": BOB, "method": "no-such-method"})
        assert unknown.status_code == 422 and unknown.json()["type"].endswith("/unknown-method")
        reader = make_key(["requests:read"], name="reader")
        forbidden = client.post(
            "/v1/subjects/erasures", json={"subject_ref": BOB}, headers={"authorization": f"Bearer {reader}"}
        )
        assert forbidden.status_code == 403
    with session_scope() as session:
        assert session.execute(select(func.count()).select_from(SubjectErasure)).scalar() == 1


def test_an_inconsistent_combined_certificate_is_refused(tmp_path):
    configure(tmp_path / "home")
    child = {"request_id": "r", "model_id": "m", "certificate_id": "c", "certificate_digest": "ab" * 32,
             "new_version_digest": "cd" * 32}  # fmt: skip
    predicate = signing.build_subject_erasure_predicate(
        erasure_id="e", subject_hash="f" * 64, children=[child], audit_chain_head={}, requested_at=None,
        completed_at=None,
    )  # fmt: skip
    keys = signing.public_keys()
    verified = signing.verify_envelope(
        signing.issue_subject_erasure_certificate(predicate), keys, predicate_type=signing.PREDICATE_TYPES
    )
    assert verified.predicate["children"][0]["certificate_digest"] == "ab" * 32
    with pytest.raises(signing.InvalidCertificate) as refused:  # only deletion certificates by default
        signing.verify_envelope(signing.issue_subject_erasure_certificate(predicate), keys)
    assert refused.value.code == "wrong-predicate-type"
    signer = signing.default_keystore().active_signer()
    forged = {
        "_type": signing.STATEMENT_TYPE,
        "subject": [{"name": "deletion-certificate:c", "digest": {"sha256": "ee" * 32}}],
        "predicateType": signing.SUBJECT_ERASURE_PREDICATE_TYPE,
        "predicate": {**predicate, "key_id": signer.key_id},
    }
    with pytest.raises(signing.InvalidCertificate) as inconsistent:
        signing.verify_envelope(signing.sign_envelope(forged), keys, predicate_type=signing.PREDICATE_TYPES)
    assert inconsistent.value.code == "inconsistent"


def _refused(statement: dict, keys: dict) -> str:
    with pytest.raises(signing.InvalidCertificate) as refused:
        signing.verify_envelope(signing.sign_envelope(statement), keys, predicate_type=signing.PREDICATE_TYPES)
    return refused.value.code


def test_a_no_data_certificate_must_be_what_it_says(tmp_path):
    """A validly signed statement that says no data was found but lists a child, changes the search it names, or
    says ``no_data_found`` with anything but true/false, is refused; a child-bearing one cannot claim no data."""
    configure(tmp_path / "home")
    keys = signing.public_keys()
    predicate = signing.build_no_data_predicate(
        erasure_id="e", subject_hash="f" * 64, searched_at="2026-01-01T00:00:00Z", models_searched=["m1", "m2"],
        models_not_searched=[], received_at="2026-01-01T00:00:00Z", due_at="2026-02-01T00:00:00Z",
        audit_chain_head={"seq": 3, "hash": "0" * 64}, requested_at="2026-01-01T00:00:00Z",
        completed_at="2026-01-01T00:00:01Z",
    )  # fmt: skip
    envelope = signing.issue_subject_erasure_certificate(predicate)
    verified = signing.verify_envelope(envelope, keys, predicate_type=signing.PREDICATE_TYPES)
    assert verified.predicate["no_data_found"] is True and verified.subject_name == "subject-search:e"
    assert verified.predicate["deadline"]["answered_on_time"] is True
    statement = json.loads(base64.b64decode(envelope["payload"]))
    assert _refused({**statement, "predicate": {**statement["predicate"], "no_data_found": "yes"}}, keys) == (
        "inconsistent"
    )
    narrower = {**statement["predicate"], "search": {**statement["predicate"]["search"], "models_searched": ["m1"]}}
    assert _refused({**statement, "predicate": narrower}, keys) == "inconsistent"  # the subject digest no longer fits
    child = {"request_id": "r", "model_id": "m", "certificate_id": "c", "certificate_digest": "ab" * 32,
             "new_version_digest": "cd" * 32}  # fmt: skip
    with_child = {**statement["predicate"], "children": [child]}
    assert _refused({**statement, "predicate": with_child}, keys) == "inconsistent"
    claims_nothing = signing.build_subject_erasure_predicate(
        erasure_id="e", subject_hash="f" * 64, children=[child], audit_chain_head={}, requested_at=None,
        completed_at=None,
    )  # fmt: skip
    signed = json.loads(base64.b64decode(signing.issue_subject_erasure_certificate(claims_nothing)["payload"]))
    assert signed["predicate"]["no_data_found"] is False
    assert _refused({**signed, "predicate": {**signed["predicate"], "no_data_found": True}}, keys) == "inconsistent"
    with pytest.raises(ValueError):
        signing.issue_subject_erasure_certificate(with_child)


@pytest.mark.parametrize("suffix", [".csv", ".parquet"])
def test_identifiers_are_read_as_written(tmp_path, suffix):
    """Issue 22: ids are never re-typed. A subject ``0077777`` stays 0077777 (not 77777), ``NA``/``null``/``N/A``
    are names, a ``+49…`` number keeps its plus and an id past 2^53 its last digit; a row id ``000003`` is found as
    written. Each is erased by the value the file holds, and the re-typed value finds nobody."""
    configure(tmp_path / "home", poll_seconds="0.05")
    headers = {"authorization": f"Bearer {make_key(SCOPES)}"}
    path = tmp_path / f"ids{suffix}"
    frame = write_table(path, n=160, seed=4)
    frame["row_id"] = [f"{i:06d}" for i in range(160)]
    people = ["0077777", "NA", "null", "N/A", "+4915112345678", "9007199254740993"]
    frame["person"] = [people[i % len(people)] if i < 60 else f"{i}" for i in range(160)]
    frame["person"] = frame["person"].astype(str)
    if suffix == ".csv":
        frame.to_csv(path, index=False)
    else:
        frame.to_parquet(path, index=False)
    with TestClient(create_app(run_background=True), headers=headers) as client:
        model_id = _register(client, path, "ids")
        body = wait_model(client, model_id, timeout=180)
        assert body["status"] == "ready", body
        for retyped in ("77777", "9007199254740992", "4915112345678"):
            nobody = client.post("/v1/subjects/erasures", json={"subject_ref": retyped})
            assert nobody.status_code == 202 and nobody.json()["no_data_found"] is True, (retyped, nobody.text)
        for person in ("0077777", "NA", "+4915112345678", "9007199254740993"):
            created = client.post("/v1/subjects/erasures", json={"subject_ref": person, "method": "retrain"})
            assert created.status_code == 202, (person, created.text)
            rows = [f"{i:06d}" for i in range(60) if people[i % len(people)] == person]
            scope = client.get(created.json()["children"][0]["links"]["self"]).json()["scope"]
            assert "sample_ids" not in scope  # from intake on, only the keyed hashes of its ids are kept
            assert sorted(scope["sample_id_hashes"]) == sorted(hash_row_id(r) for r in rows)
        by_row = client.post(
            "/v1/deletion-requests",
            json={"subject_ref": "r", "model_id": model_id, "scope": {"kind": "samples", "sample_ids": ["000100"]}},
        )
        assert by_row.status_code == 202, by_row.text
        unknown = client.post(
            "/v1/deletion-requests",
            json={"subject_ref": "r", "model_id": model_id, "scope": {"kind": "samples", "sample_ids": ["100"]}},
        )
        assert unknown.status_code in (404, 422) and "problem+json" in unknown.headers["content-type"]


def test_calls_about_people_are_rate_limited_per_key(tmp_path):
    """Issue 22, subject oracle: each erasure or look-up answers about one named person, so one key may make only
    LETHE_SUBJECT_CALLS_PER_MINUTE of them a minute (429 with Retry-After beyond); another key is not held back."""
    configure(tmp_path / "home", subject_calls_per_minute="3")
    first = {"authorization": f"Bearer {make_key(SCOPES, name='first')}"}
    second = {"authorization": f"Bearer {make_key(SCOPES, name='second')}"}
    with TestClient(create_app(run_background=False)) as client:
        answers = [
            client.post("/v1/subjects/lookup", json={"subject_ref": f"guess-{i}"}, headers=first) for i in range(3)
        ]
        assert [a.status_code for a in answers] == [200, 200, 200]
        limited = client.post("/v1/subjects/erasures", json={"subject_ref": "guess-3"}, headers=first)
        assert limited.status_code == 429 and limited.json()["type"].endswith("/rate-limited"), limited.text
        assert 1 <= int(limited.headers["retry-after"]) <= 60
        assert client.post("/v1/subjects/lookup", json={"subject_ref": "guess-0"}, headers=second).status_code == 200
