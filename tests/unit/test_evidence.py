"""Evidence issue: every deletion ends in an audit, a verdict, a report and — only when the verdict passes — a signed
certificate that verifies offline; a method that changes nothing is never certified, and ``auto`` escalates from it
to exact retraining in the same request (embedded default: SQLite + in-process worker)."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest
from fastapi.testclient import TestClient

from app.certificates.verify_cli import verify_file
from app.main import create_app
from app.ml.unlearning import base
from tests.helpers import configure, delete_rows, make_key, wait_model, write_table

DO_NOTHING = "app.ml.unlearning.baselines.sisa:DoNothing"
DO_NOTHING_CONFIG = "app.ml.unlearning.baselines.sisa:DoNothingConfig"


@pytest.fixture
def stack(tmp_path):
    configure(tmp_path / "home", poll_seconds="0.05")
    key = make_key(["models:write", "requests:write", "requests:read", "audit:read", "admin"])
    with TestClient(create_app(run_background=True)) as client:
        client.headers["authorization"] = f"Bearer {key}"
        yield client


@pytest.fixture
def do_nothing_methods():
    """The do-nothing floor registered for this test only (the service never registers it): once by name, once as
    the method ``auto`` prefers, to show neither is ever certified."""
    base.register_method("test-do-nothing", DO_NOTHING_CONFIG, DO_NOTHING, model_kinds={"tabular"}, scopes={"samples"})
    base.register_method(
        "test-do-nothing-auto",
        DO_NOTHING_CONFIG,
        DO_NOTHING,
        model_kinds={"tabular"},
        scopes={"samples"},
        auto_priority=10_000,
    )
    yield
    for name in ("test-do-nothing", "test-do-nothing-auto"):
        base._REGISTRY.pop(name, None)


def _register(client, tmp_path):
    source = tmp_path / "t.csv"
    write_table(source, n=400, seed=2)
    metadata = {
        "name": "evidence",
        "holdout_fraction": 0.25,
        "verification": {"shadows": 16},
        "dataset": {"row_id_column": "row_id", "label_column": "label"},
    }
    with source.open("rb") as handle:
        response = client.post(
            "/v1/models", data={"metadata": json.dumps(metadata)}, files={"file": ("t.csv", handle, "text/csv")}
        )
    model_id = response.json()["id"]
    model = wait_model(
        client,
        model_id,
        timeout=120,
        what="registration",
    )
    assert model["status"] == "ready", model
    return model_id


def _delete(client, model_id, ids, method):
    return delete_rows(client, model_id, ids, method)


def test_a_certified_deletion_carries_a_report_and_a_certificate_that_verifies_offline(stack, tmp_path):
    model_id = _register(stack, tmp_path)
    done = _delete(stack, model_id, ["r1", "r2", "r3"], "retrain")
    assert done["status"] == "certified", done
    reports = stack.get(done["links"]["reports"]).json()["items"]
    assert len(reports) == 1 and reports[0]["verdict"] == "pass"
    report = reports[0]
    assert report["attack"]["n_shadows"] == 16 and 1 <= report["n_forget"] <= 3  # held-out rows are not audited
    assert set(report["models"]) >= {"original", "unlearned"} and "informative" in report
    assert report["proven"]["grad_norm"] >= 0  # L2-regularised LR: the retained gradient at θ′
    first = stack.get(f"/v1/reports/{report['id']}")
    assert stack.get(f"/v1/reports/{report['id']}", headers={"if-none-match": first.headers["etag"]}).status_code == 304
    png = stack.get(report["plots"]["roc.png"])
    assert png.status_code == 200 and png.content[:8] == b"\x89PNG\r\n\x1a\n"

    envelope = stack.get(done["links"]["certificate"]).json()
    keys = stack.get("/.well-known/lethe-keys.json").json()
    cert_path, keys_path = tmp_path / "certificate.json", tmp_path / "keys.json"
    cert_path.write_text(json.dumps(envelope))
    keys_path.write_text(json.dumps(keys))
    ok, message = verify_file(str(cert_path), str(keys_path))
    assert ok, message
    statement = json.loads(base64.b64decode(envelope["payload"]))
    version = stack.get(f"/v1/models/{model_id}").json()["current_version"]
    assert statement["subject"][0]["digest"]["sha256"] == version["digest"]
    predicate = statement["predicate"]
    assert predicate["request_id"] == done["id"] and predicate["verification"]["verdict"] == "pass"
    assert predicate["erasure_manifest"]["index"]["rows_deleted"] == 3
    audit = [e for e in stack.get("/v1/audit", params={"entity_id": done["id"]}).json()["items"]]
    certified = next(e for e in audit if e["action"] == "deletion_request.certified")
    assert certified["payload"]["certificate_id"] == envelope_id(done)

    tampered = dict(envelope, payload=base64.b64encode(base64.b64decode(envelope["payload"]) + b" ").decode())
    cert_path.write_text(json.dumps(tampered))
    ok, message = verify_file(str(cert_path), str(keys_path))
    assert not ok and "signature" in message.lower()


def envelope_id(done: dict) -> str:
    return done["links"]["certificate"].rsplit("/", 1)[-1]


def test_a_method_that_changes_nothing_is_never_certified(stack, tmp_path, do_nothing_methods):
    model_id = _register(stack, tmp_path)
    before = stack.get(f"/v1/models/{model_id}").json()["current_version"]
    failed = _delete(stack, model_id, ["r5"], "test-do-nothing")
    assert failed["status"] == "failed" and failed["error"]["type"].endswith("/verification-failed"), failed
    assert "certificate" not in failed["links"]
    reports = stack.get(failed["links"]["reports"]).json()["items"]
    assert [r["verdict"] for r in reports] == ["fail"]
    assert any(c["name"] == "parameters_changed" and c["passed"] is False for c in reports[0]["checks"])
    assert stack.get(f"/v1/models/{model_id}").json()["current_version"]["id"] == before["id"]  # nothing published
    # nothing was erased either: the row can still be deleted properly, once the failed request (which still owes
    # the erasure, so holds the row) is withdrawn
    assert stack.post(f"/v1/deletion-requests/{failed['id']}/cancel").status_code == 200
    assert _delete(stack, model_id, ["r5"], "retrain")["status"] == "certified"

    escalated = _delete(stack, model_id, ["r6"], "auto")
    assert escalated["status"] == "certified", escalated
    reports = stack.get(escalated["links"]["reports"]).json()["items"]
    assert [(r["method"], r["verdict"]) for r in reports] == [("test-do-nothing-auto", "fail"), ("retrain", "pass")]
    assert stack.get(f"/v1/models/{model_id}").json()["current_version"]["method"] == "retrain"


@pytest.mark.parametrize("n_classes", [2, 3])
def test_the_bound_summed_over_row_blocks_equals_one_pass(monkeypatch, n_classes):
    """The proven bound's float64 passes run over blocks of rows (a 1M-row table at once made 170 MB temporaries):
    the Hessian, the typical row norm and rho must be those of one pass over all rows."""
    from app.ml import tabular as T
    from app.ml.verification import bounds

    rng = np.random.default_rng(n_classes)
    X = rng.normal(size=(1_000, 6)).astype(np.float32)
    y = rng.integers(0, n_classes, 1_000)
    recipe = T.TabularRecipe(l2=1e-2)
    theta, _ = T.fit(recipe, X[:900], y[:900], n_classes)
    _, g = T.objective_gradient(recipe, theta, X[:900], y[:900], n_classes)
    whole = bounds.strong_convexity_bound(recipe, theta, X[:900], n_classes, g)
    monkeypatch.setattr(bounds, "ROW_BLOCK", 64)
    blocked = bounds.strong_convexity_bound(recipe, theta, X[:900], n_classes, g)
    assert whole["bound"] is not None
    for key in ("bound", "mu", "mu_at_theta", "newton_step_norm"):
        assert blocked[key] == pytest.approx(whole[key], rel=1e-9), key


@pytest.mark.parametrize("n_classes", [2, 3])
def test_the_one_pass_over_the_retained_rows_gives_the_gradients_hessian_and_bound_of_the_separate_passes(
    monkeypatch, n_classes
):
    """bounds.retained_pass reads the retained rows once for both gradients, the Hessian and the row norms (issue 21:
    the 1M-row deletion's verification made three passes and two float64 copies of the rows): each figure must be
    the one objective_gradient and strong_convexity_bound compute from the copied-out rows, to float64 summation
    order, with a row mask, several blocks (some with no retained row) and an objective perturbation."""
    import torch

    from app.ml import tabular as T
    from app.ml.verification import bounds, evidence

    rng = np.random.default_rng(10 + n_classes)
    X = rng.normal(size=(1_200, 6)).astype(np.float32)
    y = rng.integers(0, n_classes, 1_200)
    retain = rng.random(1_200) < 0.8
    retain[64:128] = False  # a whole block without a retained row
    recipe = T.TabularRecipe(l2=1e-2)
    theta, _ = T.fit(recipe, X[retain], y[retain], n_classes)
    parent = theta + 0.05 * torch.from_numpy(rng.normal(size=theta.numel()).astype(np.float32))
    linear = rng.normal(size=theta.numel())
    monkeypatch.setattr(bounds, "ROW_BLOCK", 64)
    one = bounds.retained_pass(recipe, [theta, parent], X, y, n_classes, retain, linear)
    assert one.rows == int(retain.sum())
    for got, at in zip(one.grads, (theta, parent), strict=True):
        _, want = T.objective_gradient(recipe, at, X[retain], y[retain], n_classes, linear=linear)
        assert np.allclose(got, want.numpy(), rtol=1e-9, atol=1e-13)
    k = 1 if n_classes == 2 else n_classes
    hessian = bounds._hessian64(recipe, theta.double().numpy(), X[retain], k)
    assert np.allclose(one.hessian, hessian, rtol=1e-12, atol=1e-15)
    norms = np.linalg.norm(np.concatenate([X[retain], np.ones((retain.sum(), 1))], 1).astype(np.float64), axis=1)
    assert one.typical_row_norm == pytest.approx(norms.mean(), rel=1e-12)

    _, g = T.objective_gradient(recipe, theta, X[retain], y[retain], n_classes)
    separate = bounds.strong_convexity_bound(recipe, theta, X[retain], n_classes, g, others={"parent": parent})
    plain = bounds.retained_pass(recipe, [theta, parent], X, y, n_classes, retain)
    fused = bounds.strong_convexity_bound(
        recipe, theta, X, n_classes, torch.from_numpy(plain.grads[0]), {"parent": parent}, mask=retain, computed=plain
    )
    assert separate["bound"] is not None and separate["rows"] == fused["rows"]
    for key in ("mu_at_theta", "newton_step_norm"):
        assert fused[key] == pytest.approx(separate[key], rel=1e-6), key
    assert one.max_row_norm == pytest.approx(norms.max(), rel=1e-12)
    # the fused bound takes rho from the rows' largest norm (no second pass): at least the exact rho, so still a
    # proof, and a bound within (e^t - 1) <= 0.1 % of the convexity bound above the exact rho's
    assert (fused["rho"]["by"], separate["rho"]["by"]) == ("row norms", "exact pass")
    assert fused["rho"]["value"] >= separate["rho"]["value"]
    assert fused["mu"] <= separate["mu"]
    assert separate["bound"] <= fused["bound"] <= separate["bound"] + 1e-3 * separate["bound_strong_convexity"]
    # far from the optimum (the parent) the row-norm rho certifies no first radius: the exact pass decides
    _, g_far = T.objective_gradient(recipe, parent, X[retain], y[retain], n_classes)
    far_alone = bounds.strong_convexity_bound(recipe, parent, X[retain], n_classes, g_far)
    far_pass = bounds.retained_pass(recipe, [parent], X, y, n_classes, retain)
    far = bounds.strong_convexity_bound(recipe, parent, X, n_classes, g_far, mask=retain, computed=far_pass)
    assert far.get("rho", {}).get("by") != "row norms"
    assert far["bound"] == pytest.approx(far_alone["bound"], rel=1e-6) if far_alone["bound"] else far["bound"] is None

    # the evidence itself: the same figures and verdict as from the copied-out rows' separate passes
    checks = evidence.tabular_evidence(recipe, parent, theta, X, y, n_classes, retain, exact=False)
    assert [c["name"] for c in checks] == ["proven_distance"]
    assert checks[0]["passed"] and checks[0]["informative"]
    assert checks[0]["figure"] == pytest.approx(fused["bound"], rel=1e-6)
    assert checks[0]["detail"]["rows"] == int(retain.sum())
