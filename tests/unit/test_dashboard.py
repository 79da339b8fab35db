"""The dashboard's access rules without a browser (the browser tests are tests/integration/test_dashboard_browser.py):
cookie flags, CSRF bound to the session and to this origin, scopes, and pages that answer HTML, not JSON."""

from __future__ import annotations

import re
from datetime import UTC, datetime
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from app.dashboard.views import (
    actor_label,
    actor_names,
    carried_deletions,
    lineage_svg,
    method_quality,
    time_left,
    version_accuracy,
)
from app.main import create_app
from tests.helpers import configure, make_key

BASE = "https://testserver"


@pytest.fixture
def app(tmp_path):
    configure(tmp_path)
    return create_app(run_background=False)


def _login(client: TestClient, key: str):
    form = client.get("/dashboard/login")
    token = re.search(r'name="csrf" value="([^"]+)"', form.text).group(1)
    return client.post("/dashboard/login", data={"api_key": key, "csrf": token}, follow_redirects=False)


def _csrf(page_html: str) -> str:
    return re.search(r'name="csrf" value="([^"]+)"', page_html).group(1)


def test_login_sets_a_secure_httponly_strict_cookie_and_pages_need_it(app):
    key = make_key(["requests:read"])
    with TestClient(app, base_url=BASE) as client:
        assert client.get("/dashboard/requests", follow_redirects=False).headers["location"] == "/dashboard/login"
        assert client.get("/dashboard/api/requests?ids=x").status_code == 401
        answer = _login(client, key)
        assert answer.status_code == 303 and answer.headers["location"] == "/dashboard/requests"
        cookie = [c for c in answer.headers.get_list("set-cookie") if c.startswith("lethe_dashboard=")][0].lower()
        for flag in ("httponly", "secure", "samesite=strict", "path=/dashboard"):
            assert flag in cookie
        assert key not in cookie  # signed and encoded, and never echoed into a page
        page = client.get("/dashboard/requests")
        assert page.status_code == 200 and "text/html" in page.headers["content-type"]
        assert "script-src 'self'" in page.headers["content-security-policy"] and key not in page.text
        assert client.get("/dashboard/audit").status_code == 403  # requests:read is not audit:read


def test_plain_http_setting_drops_only_the_secure_flag(tmp_path):
    """LETHE_DASHBOARD_INSECURE_COOKIES: off by default (above: Secure); on, the cookies lose Secure and nothing else.
    A login whose cookie never came back over plain http from a non-loopback host says why (in-process client: the
    host name is never resolved)."""
    configure(tmp_path, dashboard_insecure_cookies="true")
    key = make_key(["requests:read"])
    with TestClient(create_app(run_background=False), base_url="http://lethe.test") as client:
        form = client.get("/dashboard/login")
        login_cookie = form.headers["set-cookie"].lower()
        assert "secure" not in login_cookie and "httponly" in login_cookie and "samesite=strict" in login_cookie
        answer = _login(client, key)
        assert answer.status_code == 303
        cookie = [c for c in answer.headers.get_list("set-cookie") if c.startswith("lethe_dashboard=")][0].lower()
        assert "secure" not in cookie and "httponly" in cookie and "samesite=strict" in cookie
        assert client.get("/dashboard/requests").status_code == 200
    configure(tmp_path)
    with TestClient(create_app(run_background=False), base_url="http://lethe.test") as client:
        token = _csrf(client.get("/dashboard/login").text)
        client.cookies.clear()  # what a browser does with a Secure cookie sent over plain http to this host
        refused = client.post("/dashboard/login", data={"api_key": key, "csrf": token})
        assert refused.status_code == 403 and "LETHE_DASHBOARD_INSECURE_COOKIES" in refused.text
    with TestClient(create_app(run_background=False), base_url="http://127.0.0.1") as client:
        token = _csrf(client.get("/dashboard/login").text)
        client.cookies.clear()
        refused = client.post("/dashboard/login", data={"api_key": key, "csrf": token})
        assert refused.status_code == 403 and "LETHE_DASHBOARD_INSECURE_COOKIES" not in refused.text


def test_login_form_needs_its_token_and_a_wrong_key_is_refused(app):
    key = make_key(["requests:read"])
    with TestClient(app, base_url=BASE) as client:
        forged = client.post("/dashboard/login", data={"api_key": key, "csrf": "x"}, follow_redirects=False)
        assert forged.status_code == 403 and "lethe_dashboard=" not in forged.headers.get("set-cookie", "")
        assert _login(client, "lethe_deadbeef_nope").status_code == 401
        assert _login(client, make_key(["models:read"])).status_code == 403


def test_actions_need_admin_a_session_bound_token_and_this_origin(app):
    admin, reader = make_key(["admin"]), make_key(["requests:read"])
    with TestClient(app, base_url=BASE) as a, TestClient(app, base_url=BASE) as b:
        _login(a, admin)
        _login(b, reader)
        token_a = _csrf(a.get("/dashboard/requests").text)
        token_b = _csrf(b.get("/dashboard/requests").text)
        target = "/dashboard/requests/no-such-request/cancel"
        assert b.post(target, data={"csrf": token_b}).status_code == 403  # no admin scope
        assert a.post(target, data={"csrf": token_b}).status_code == 403  # another session's token
        assert a.post(target, data={"csrf": token_a}, headers={"origin": "https://evil.example"}).status_code == 403
        missing = a.post(target, data={"csrf": token_a}, headers={"origin": BASE})
        assert missing.status_code == 404 and "text/html" in missing.headers["content-type"]  # past the guards
        out = a.post("/dashboard/logout", data={"csrf": token_a}, follow_redirects=False)
        assert out.status_code == 303
        assert a.get("/dashboard/requests", follow_redirects=False).status_code == 303


def test_bulk_and_model_settings_forms_need_admin_a_session_bound_token_and_this_origin(app):
    """The list's bulk form and the model page's settings form: shown to an admin only, and each POST refused
    without admin, with another session's token or from another origin, before anything is read or done."""
    admin, reader = make_key(["admin", "requests:read"]), make_key(["requests:read"])
    with TestClient(app, base_url=BASE) as a, TestClient(app, base_url=BASE) as b:
        _login(a, admin)
        _login(b, reader)
        listing_a, listing_b = a.get("/dashboard/requests").text, b.get("/dashboard/requests").text
        assert 'id="bulk"' in listing_a and 'id="pick-all"' in listing_a
        assert 'id="bulk"' not in listing_b and 'id="pick-all"' not in listing_b
        token_a, token_b = _csrf(listing_a), _csrf(listing_b)
        bulk = {"action": "cancel", "selection": "ids", "ids": ["no-such-request"]}
        settings = {"tags": "prod", "requires_approval": "true"}
        for target, form in (
            ("/dashboard/requests/bulk", bulk),
            ("/dashboard/models/no-such-model/settings", settings),
        ):
            assert b.post(target, data={**form, "csrf": token_b}).status_code == 403  # no admin scope
            assert a.post(target, data={**form, "csrf": token_b}).status_code == 403  # another session's token
            evil = {"origin": "https://evil.example"}
            assert a.post(target, data={**form, "csrf": token_a}, headers=evil).status_code == 403
        done = a.post("/dashboard/requests/bulk", data={**bulk, "csrf": token_a}, headers={"origin": BASE})
        assert done.status_code == 200 and 'data-outcome="skipped"' in done.text  # past the guards: request-not-found
        assert "request-not-found" in done.text
        nothing = a.post("/dashboard/requests/bulk", data={"action": "cancel", "csrf": token_a})
        assert nothing.status_code == 422 and "Nothing is selected" in nothing.text
        missing = a.post("/dashboard/models/no-such-model/settings", data={**settings, "csrf": token_a})
        assert missing.status_code == 404 and "text/html" in missing.headers["content-type"]


def test_views_wording_and_lineage():
    assert time_left(-2.5, True, "queued") == "OVERDUE by 2.5 d"
    assert time_left(12.0, False, "running") == "12 d left"
    assert time_left(0.25, False, "received") == "6 h left"
    assert time_left(-3, False, "certified") == "answered"
    versions = [
        {"id": "a", "number": 1, "parent_id": None, "digest": "0" * 64, "method": "train", "request_id": None,
         "retired_at": "x"},
        {"id": "b", "number": 2, "parent_id": "a", "digest": "1" * 64, "method": "retrain", "request_id": "r1"},
        {"id": "c", "number": 3, "parent_id": "b", "digest": "2" * 64, "method": "newton", "request_id": "r2",
         "current": True},
    ]  # fmt: skip
    assert carried_deletions(versions) == {"a": [], "b": ["r1"], "c": ["r1", "r2"]}
    svg = str(lineage_svg(versions))
    assert svg.startswith("<svg") and svg.count('<g class="version') == 3 and "retired" in svg and "marker-end" in svg


def test_federated_model_pages_show_clients_methods_and_the_forget_lock():
    from starlette.requests import Request

    from app.dashboard.router import templates

    model = {
        "id": "m1", "name": "fed-clip", "kind": "clip_federated", "status": "ready", "family": None,
        "current_version": {"number": 3, "method": "ease"},
        "unlearning": {"ease": {"status": "ready", "info": {"validation": {"forget_r1": 0.02, "curve": [1, 2]},
                                                          "rank": 8, "alpha": 0.5}},
                       "l2ul": {"status": "refused", "reason": "too few rows", "info": {}}},
        "federation": {"clients": ["c0", "c1", "c2"], "removed_clients": ["c2"], "rounds": 4},
    }  # fmt: skip
    lock = {"request_id": "req-12345678", "version_id": "v3", "alpha": 0.5, "rank": 8, "n_params": 4096,
            "digest": "ab" * 32}  # fmt: skip
    versions = [
        {"id": "v1", "number": 1, "parent_id": None, "digest": "0" * 64, "method": "init", "request_id": None,
         "metrics": {}, "created_at": None, "retired_at": None, "retired_by": None, "current": False},
        {"id": "v3", "number": 3, "parent_id": "v1", "digest": "1" * 64, "method": "ease", "request_id": "req-12345678",
         "metrics": {}, "created_at": None, "retired_at": None, "retired_by": None, "current": True},
    ]  # fmt: skip
    request = Request(
        {"type": "http", "method": "GET", "path": "/dashboard/models", "headers": [], "query_string": b""}
    )
    common = {"request": request, "principal": None, "poll_ms": 1000}
    listing = templates.get_template("models.html").render(
        **common, models=[{"m": model, "versions": versions, "lock": lock}], page="models"
    )
    assert "3 clients (1 removed), 4 rounds" in listing
    assert 'id="forget-lock"' in listing and "rank 8" in listing and "req-1234" in listing
    assert "validation.forget_r1" in listing and "too few rows" in listing and "curve" not in listing
    assert "prepared without a measured quality" not in listing  # EASE's validation is shown, if not as tabular
    page = templates.get_template("model.html").render(
        **common, m=model, versions=versions, carried={"v1": [], "v3": ["req-12345678"]},
        lineage=lineage_svg(versions), lock=lock, page="models",
    )  # fmt: skip
    assert "<svg" in page and "v3 · ease" in page and 'id="forget-lock"' in page


def test_actors_by_key_name():
    keys = [
        SimpleNamespace(id="k1", name="operator", prefix="aa11"),
        SimpleNamespace(id="k2", name="second-admin", prefix="bb22"),
        SimpleNamespace(id="k3", name="second-admin", prefix="cc33"),
    ]
    names = actor_names(keys)
    assert actor_label("api-key:k1", names) == "operator"
    assert actor_label("api-key:k3", names) == "second-admin (lethe_cc33_…)"  # two keys share the name
    assert actor_label("dispatcher", names) == "dispatcher" and actor_label("api-key:gone", names) == "api-key:gone"


def test_accuracy_per_version_and_validated_quality_in_a_few_figures():
    assert version_accuracy({"accuracy_train": 0.91, "accuracy_holdout": 0.825}) == {"holdout": 0.825, "trained": 0.91}
    child = {"after": {"accuracy_retain": 0.9, "accuracy_holdout": 0.85}, "before": {"accuracy_holdout": 0.1}}
    assert version_accuracy(child) == {"holdout": 0.85, "trained": 0.9}
    assert version_accuracy({"round": 3, "after": {"test": {"r1": 0.5}}}) == {"holdout": None, "trained": None}

    validation = {"deletions": 4, "param_ratio_median": 0.0088, "acc_gap_pts_median": 0.0,
                  "method_seconds_median": 2.3e-5, "retrain_seconds_median": 0.41,
                  "equals_do_nothing": False}  # fmt: skip
    quality = method_quality({"timings": {"gradient_s": 0.1}, "validation": validation}, 0.1)
    assert quality == {"deletions": "4", "param_ratio": "0.0088", "acc_gap": "+0.00 pts", "time": "23 µs",
                       "retrain": "410.0 ms", "bound": "yes: 0.0088 ≤ 0.1", "within": "yes"}  # fmt: skip
    assert method_quality({"validation": {**validation, "param_ratio_median": 0.3}}, 0.1)["bound"] == "no: 0.3 > 0.1"
    assert method_quality({"validation": {**validation, "equals_do_nothing": True}}, 0.1)["within"] == "no"
    assert method_quality({"rank": 8}, 0.1) is None


def test_models_page_shows_accuracy_per_version_tags_approval_and_one_quality_row_per_method():
    from starlette.requests import Request

    from app.dashboard.router import templates

    validation = {"deletions": 4, "param_ratio_median": 0.0088, "acc_gap_pts_median": 0.0,
                  "method_seconds_median": 2.3e-5, "retrain_seconds_median": 0.41,
                  "equals_do_nothing": False}  # fmt: skip
    info = {"method": "newton", "rows": 160, "timings": {"gradient_s": 0.0005, "hessian_s": 0.047},
            "validation": validation, "determinism_probe": {"chaotic": False, "theta_norm": 6.5}}  # fmt: skip
    model = {
        "id": "m2", "name": "credit-lr", "kind": "tabular", "status": "ready", "family": "logistic_regression",
        "current_version": {"number": 2, "method": "newton"}, "requires_approval": True, "tags": ["credit", "eu"],
        "subject_column": "person", "federation": None,
        "unlearning": {"newton": {"status": "ready", "info": info}},
    }  # fmt: skip
    versions = [
        {"id": "v1", "number": 1, "parent_id": None, "digest": "0" * 64, "method": "train", "request_id": None,
         "metrics": {}, "accuracy": {"holdout": 0.825, "trained": 0.9125}, "created_at": None,
         "retired_at": datetime(2026, 1, 2, tzinfo=UTC), "retired_by": "r1", "current": False},
        {"id": "v2", "number": 2, "parent_id": "v1", "digest": "1" * 64, "method": "newton", "request_id": "r1",
         "metrics": {}, "accuracy": {"holdout": 0.846, "trained": None}, "created_at": None, "retired_at": None,
         "retired_by": None, "current": True},
    ]  # fmt: skip
    scope = {"type": "http", "method": "GET", "path": "/dashboard/models", "headers": [], "query_string": b""}
    common = {"request": Request(scope), "principal": None, "poll_ms": 1000}
    for page in (
        templates.get_template("models.html").render(
            **common, models=[{"m": model, "versions": versions, "lock": None}], page="models"
        ),
        templates.get_template("model.html").render(
            **common, m=model, versions=versions, carried={"v1": [], "v2": ["r1"]},
            lineage=lineage_svg(versions), lock=None, page="models",
        ),
    ):  # fmt: skip
        assert 'id="requires-approval"' in page and '<span class="tag">credit</span>' in page and "person" in page
        assert "0.825" in page and "0.912" in page and "0.846" in page  # accuracy per version
        row = re.search(r'<tr class="method" data-method="newton">(.*?)</tr>', page, re.S).group(1)
        for figure in ("4 deletions", "0.0088", "+0.00 pts", "23 µs", "410.0 ms", "yes: 0.0088 ≤ 0.1"):
            assert figure in row
        before_details, details = row.split("<details", 1)
        assert "timings.gradient_s" not in before_details and "timings.gradient_s" in details  # raw figures folded
