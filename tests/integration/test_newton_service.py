"""Issue 10 through PostgreSQL + Celery: a model prepared for ``newton`` and ``l2ul_n`` (the Newton step with a
learned, gated correction) takes deletions naming each, then ``auto``, which picks by the quality measured at
preparation and records why; every version is certified and chained to its parent."""

from __future__ import annotations

import json

import pytest

from tests.helpers import delete_rows, wait_for, write_table

SMALL_L2ULN = {"m": 16, "units": 4, "subset_size": 200, "epochs": 30, "calibration_tasks": 2, "workers": 1}


pytestmark = pytest.mark.timeout(1200)  # each wait below is at most 600 s: a slow job names itself before the kill


def _delete(stack, model_id, rows, method):
    return delete_rows(stack.client, model_id, rows, method, timeout=600)


def test_newton_l2ul_n_and_auto_through_the_api(stack, tmp_path):
    path = tmp_path / "table.csv"
    write_table(path, n=2000, seed=13)
    metadata = {
        "name": "newton-it",
        "unlearning": ["newton", "l2ul_n"],
        "method_settings": {"l2ul_n": SMALL_L2ULN},
        "dataset": {"row_id_column": "row_id", "label_column": "label"},
    }
    with path.open("rb") as handle:
        response = stack.client.post(
            "/v1/models", data={"metadata": json.dumps(metadata)}, files={"file": ("table.csv", handle, "text/csv")}
        )
    assert response.status_code == 202, response.text
    model_id = response.json()["id"]
    model = wait_for(
        lambda: (
            all(
                (b := stack.client.get(f"/v1/models/{model_id}").json())["unlearning"].get(m, {}).get("status")
                in ("ready", "refused")
                for m in ("newton", "l2ul_n")
            )
            and b
        ),
        timeout=600,
        interval=0.5,
        what="preparation",
    )
    for m in ("newton", "l2ul_n"):
        assert model["unlearning"][m]["status"] == "ready", model["unlearning"][m]
        assert model["unlearning"][m]["info"]["validation"]["param_ratio_median"] is not None
    assert 0.0 <= model["unlearning"]["l2ul_n"]["info"]["gate"] <= 1.0

    assert _delete(stack, model_id, ["r1"], "newton")["status"] == "certified"
    second = _delete(stack, model_id, ["r2", "r3"], "l2ul_n")
    # L2UL-N's learned correction is judged like any approximate step (issue 20): certified only when its proven
    # distance to the retained optimum is within max_residual_ratio (0.1) of doing nothing's, failed otherwise
    (report,) = stack.client.get("/v1/reports", params={"request_id": second["id"]}).json()["items"]
    check = next(c for c in report["checks"] if c["name"] == "proven_distance")
    if second["status"] == "certified":
        assert check["passed"] is True and check["detail"]["ratio"] <= 0.1, check
    else:
        assert second["error"]["type"].endswith("/verification-failed"), second
        assert check["passed"] is False and check["detail"]["ratio"] > 0.1, check
    fourth = _delete(stack, model_id, ["r4"], "auto")
    assert fourth["status"] == "certified"
    attempts = stack.client.get("/v1/reports", params={"request_id": fourth["id"]}).json()["items"]

    versions = stack.client.get(f"/v1/models/{model_id}/versions").json()
    published = ["train", "newton"] + (["l2ul_n"] if second["status"] == "certified" else [])
    assert [v["method"] for v in versions[: len(published)]] == published
    choice = versions[len(published)]["metrics"]["choice"]
    validated = {m: model["unlearning"][m]["info"]["validation"] for m in ("newton", "l2ul_n")}
    # stated, not derived from the measurement: the Newton step on a logistic regression is within the quality bar
    # (ratio <= 0.1; README "Fast tabular methods"), so auto takes a fast method, never retrain: newton, or L2UL-N
    # (that same step plus its learned correction) if it measured faster and within the bar too. A collapse of
    # Newton's quality, or auto falling back to retraining, fails here.
    assert validated["newton"]["param_ratio_median"] <= 0.1, validated
    assert versions[len(published)]["method"] == choice["method"], choice
    chosen = choice["method"]
    if len(attempts) == 2:  # escalated: allowed only for a chance detection (README "Batches"), which the exact
        # retrain, never trained on the row, shows as well; the fast method failed nothing else
        fast, exact = ({c["name"]: c for c in a["checks"]} for a in attempts)
        assert [n for n, c in fast.items() if c["passed"] is False] == ["forget_attack"], attempts[0]
        assert exact["forget_attack"]["figure"] == fast["forget_attack"]["figure"] > 0, attempts
        assert chosen == "retrain" and choice["note"].startswith("explained as "), choice
        chosen = choice["note"].removeprefix("explained as ").strip("'")
    assert chosen in ("newton", "l2ul_n") and validated[chosen]["param_ratio_median"] <= 0.1, (choice, validated)
    assert choice["reason"]
    assert [v["parent_id"] for v in versions[1:]] == [v["id"] for v in versions[:-1]]
    if second["status"] == "certified":
        info = versions[2]["metrics"]["method_info"]
        assert info["units_dropped"] and 1 <= info["newton"]["rows_forgotten"] <= 2  # held-out rows: never trained on
