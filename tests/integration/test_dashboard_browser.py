"""The operator's dashboard in a real browser: Playwright drives Debian's Chromium (``apt-get install chromium``;
never Playwright's own download) against the real API on a loopback port (embedded SQLite + in-process executor,
see tests/dashboard_stack.py).

Log in; watch a request go from waiting through running to certified without a reload; its report's plots load;
its certificate verifies against the published keys; an overdue request is flagged (a failed one too); a waiting
request is cancelled (audited as the API's cancel is); a pending-approval request is approved by a second admin
(never by the key that submitted it) or rejected with a reason; requests ticked on the list are approved at once
(the approver's own and a cancelled one skipped, with why) and every request matching a filter rejected; a model's
settings are changed on its page as the API's PATCH changes them; a person is erased from every model holding their
rows and the page follows the erasure to its combined certificate; a person's requests are found by their reference;
the dashboard works over plain http on a non-localhost host name (mapped to 127.0.0.1 inside Chromium) once
LETHE_DASHBOARD_INSECURE_COOKIES allows it; no key, a wrong or revoked key, a read-only key and a forged form are
refused.
"""

from __future__ import annotations

import re
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from app.auth.service import revoke_key
from app.certificates.verify_cli import verify_file
from app.config import get_settings
from app.dashboard import router as dashboard
from app.db import session_scope
from app.ids import short_id
from app.jobs import outbox
from app.requests import service as requests_service
from app.subjects.service import subject_hash
from tests.dashboard_stack import ADMIN_SCOPES, CHROMIUM, CHROMIUM_ARGS, Stack, free_port, log_in
from tests.helpers import make_key

playwright_api = pytest.importorskip("playwright.sync_api", reason="the dev extra installs playwright")
if not Path(CHROMIUM).exists():
    pytest.fail(f"{CHROMIUM} is missing: apt-get install chromium", pytrace=False)

TIMEOUT_MS = 120_000


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    stack = Stack(tmp_path_factory.mktemp("dashboard") / "home", poll_seconds="0.1")
    saved, dashboard.POLL_MS = dashboard.POLL_MS, 200  # the page polls often, so short states are seen
    try:
        stack.serve(background=True)
        stack.model_id = stack.register_model("credit-lr", shadows=8)
        yield stack
    finally:
        dashboard.POLL_MS = saved
        stack.stop()


@pytest.fixture(scope="module")
def playwright():
    with playwright_api.sync_playwright() as running:
        yield running


@pytest.fixture(scope="module")
def browser(playwright):
    chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
    yield chromium
    chromium.close()


@pytest.fixture
def page(browser):
    context = browser.new_context()
    context.set_default_timeout(TIMEOUT_MS)
    yield context.new_page()
    context.close()


def _audit_actions(stack: Stack, request_id: str) -> list[tuple[str, str]]:
    with stack.api() as client:
        items = client.get("/v1/audit", params={"entity_id": request_id}).json()["items"]
    return [(e["action"], e["actor"]) for e in items]


def _listed(page) -> set[str]:
    return set(page.eval_on_selector_all("tr[data-request-id]", "rows => rows.map(r => r.dataset.requestId)"))


def _status(stack: Stack, request_id: str) -> str:
    with stack.api() as client:
        return client.get(f"/v1/deletion-requests/{request_id}").json()["status"]


def _token(page) -> str:
    return page.get_attribute("form[action='/dashboard/logout'] input[name=csrf]", "value")


def _fail(request_id: str, error: str = "simulated worker failure") -> None:
    """Fail a request as the worker does: its job failed for good, then the request."""
    with session_scope() as session:
        job_id = requests_service.get_request_or_404(session, request_id).job_id
        assert outbox.fail(session, job_id, None, error, permanent=True) is not None
        requests_service.mark_failed(session, request_id, job_id, 1, error, "failed", "job-failed")


def test_no_key_no_data(stack, page):
    base = stack.serve(background=False)
    request = stack.delete(stack.model_id, ["r40"])

    page.goto(f"{base}/dashboard/requests")
    assert page.url.endswith("/dashboard/login")
    assert short_id(request["id"]) not in page.content()
    for path in (
        f"/dashboard/requests/{request['id']}",
        f"/dashboard/requests/{request['id']}/live",
        f"/dashboard/api/requests?ids={request['id']}",
        "/dashboard/models",
        "/dashboard/audit",
    ):
        answer = page.request.get(base + path, max_redirects=0)
        assert answer.status in (303, 401), (path, answer.status)
        assert request["id"] not in answer.text() and stack.model_id not in answer.text()

    log_in(page, base, "lethe_00000000_not-a-key")
    assert page.url.endswith("/dashboard/login")
    assert "Unknown, expired or revoked" in page.inner_text("#login-error")

    log_in(page, base, make_key(["models:write"], name="no-read"))
    assert "lacks the scope `requests:read`" in page.inner_text("#login-error")
    assert not [c for c in page.context.cookies() if c["name"] == "lethe_dashboard"]

    # a key revoked after login is refused on the next page (it is looked up on every request)
    key = make_key(["requests:read"], name="soon-revoked")
    log_in(page, base, key)
    assert page.url.endswith("/dashboard/requests") and short_id(request["id"]) in page.content()
    (cookie,) = [c for c in page.context.cookies() if c["name"] == "lethe_dashboard"]
    assert cookie["httpOnly"] and cookie["secure"] and cookie["sameSite"] == "Strict"
    assert key not in page.content()
    page.goto("about:blank")  # stop the list's poller: its own 401 would race this test's next navigation
    with session_scope() as session:
        revoke_key(session, key.split("_")[1])
    response = page.goto(f"{base}/dashboard/requests")
    assert response.status == 401 and "was refused" in page.inner_text("#refused, #login-error")
    assert short_id(request["id"]) not in page.content()


def test_request_runs_to_certified_without_reload_with_report_and_certificate(stack, page, monkeypatch):
    from app.jobs import tabular

    real_verify = tabular.Deletion.verify

    def unhurried_verify(self, work, unlearned, ctx):  # the real audit, begun a moment later: a small deletion
        time.sleep(1.0)  # now certifies between two of the page's polls, and the page must be seen to follow it
        return real_verify(self, work, unlearned, ctx)

    monkeypatch.setattr(tabular.Deletion, "verify", unhurried_verify)
    base = stack.serve(background=False)  # no executor yet: the request waits while the page opens
    hook = f"http://127.0.0.1:{free_port()}/hook"  # nobody listens: the delivery fails and can be sent again
    request = stack.delete(stack.model_id, ["r1", "r2", "r3"], callback_url=hook)
    log_in(page, base, stack.admin_key)
    page.goto(f"{base}/dashboard/requests/{request['id']}")
    assert page.inner_text("#status") == "received" and page.is_visible("#progress")
    page.evaluate(
        """() => {
          window.__sameDocument = true;
          window.__seen = [document.querySelector('#status').textContent];
          new MutationObserver(() => {
            const now = document.querySelector('#status').textContent;
            if (window.__seen[window.__seen.length - 1] !== now) window.__seen.push(now);
          }).observe(document.querySelector('#status'), {childList: true, characterData: true, subtree: true});
        }"""
    )
    stack.serve(background=True)  # the same origin, now with the in-process worker
    page.wait_for_function("() => document.querySelector('#status').textContent === 'certified'")
    seen = page.evaluate("() => window.__seen")
    assert page.evaluate("() => window.__sameDocument === true"), "the page was reloaded"
    assert seen[0] == "received" and seen[-1] == "certified", seen
    assert {"running", "verifying"} & set(seen), f"never saw it run: {seen}"
    assert not page.is_visible("#progress")

    # the body was fetched again when the status changed: report with its plots, certificate, erasure, timeline
    page.wait_for_selector("img.plot")
    plots = page.eval_on_selector_all(
        "img.plot", "imgs => imgs.map(i => ({src: i.getAttribute('src'), w: i.naturalWidth, done: i.complete}))"
    )
    assert plots, "no plots"
    page.wait_for_function("() => [...document.querySelectorAll('img.plot')].every(i => i.naturalWidth > 0)")
    assert all(p["src"].startswith("/dashboard/reports/") for p in plots)
    assert "pass" in page.inner_text(".report .badge")
    assert "rows erased" in page.inner_text("#erasure")
    timeline = page.inner_text("#timeline")
    for step in ("received", "running", "verifying", "certified"):
        assert step in timeline

    assert page.inner_text("#verify-result").startswith("VALID")
    page.evaluate("() => { document.querySelector('#verify-result').textContent = ''; }")
    page.click("#verify")
    page.wait_for_function("() => document.querySelector('#verify-result').textContent.includes('checked')")
    result = page.inner_text("#verify-result")
    assert result.startswith("VALID: deletion certificate") and request["id"] in result
    assert "valid" in page.get_attribute("#verify-result", "class").split()
    download = page.request.get(base + page.get_attribute("#download", "href"))
    assert download.status == 200 and download.json()["payloadType"] == "application/vnd.in-toto+json"

    # the certified event's webhook delivery is listed; an admin sends it again
    assert "deletion.certified" in page.inner_text("#webhooks") and hook in page.inner_text("#webhooks")
    page.click("#webhooks button:has-text('Redeliver')")
    page.wait_for_selector("#notice")
    assert "sent again" in page.inner_text("#notice")

    # the model page draws its lineage as inline SVG: v1 retired by this request, v2 current
    page.goto(f"{base}/dashboard/models/{stack.model_id}")
    assert page.locator("svg.lineage g.version").count() >= 2
    assert page.locator("svg.lineage g.version.retired").count() >= 1
    assert short_id(request["id"]) in page.inner_text("#versions")
    for column in ("acc-test", "acc-trained"):  # every tabular version's accuracy, measured when it was made
        figures = page.locator(f"#versions td.{column}").all_inner_texts()
        assert len(figures) >= 2 and all(re.fullmatch(r"[01]\.\d{3}", f) for f in figures), figures

    page.goto(f"{base}/dashboard/audit")
    assert "Intact" in page.inner_text("#chain-verdict")


def test_overdue_flagged_and_waiting_request_cancelled(stack, page, browser):
    base = stack.serve(background=False)  # nothing runs: both requests wait
    late = stack.delete(stack.model_id, ["r50"], received_at=(datetime.now(UTC) - timedelta(days=40)).isoformat())
    fresh = stack.delete(stack.model_id, ["r51"])
    log_in(page, base, stack.admin_key)

    page.goto(f"{base}/dashboard/requests")
    late_row = page.locator(f"tr[data-request-id='{late['id']}']")
    assert re.match(r"OVERDUE by \d", late_row.locator("[data-field=time_left]").inner_text())
    assert "flag-overdue" in late_row.locator("[data-field=time_left]").get_attribute("class")
    fresh_row = page.locator(f"tr[data-request-id='{fresh['id']}']")
    assert "left" in fresh_row.locator("[data-field=time_left]").inner_text()
    page.check("input[name=overdue]")
    page.click("form.filters button[type=submit]")
    page.wait_for_url(re.compile(r"overdue=true"))
    assert _listed(page) == {late["id"]}

    # the date filter counts the day the request reached Lethe; the model filter its model
    today, yesterday = datetime.now(UTC).date(), datetime.now(UTC).date() - timedelta(days=1)
    page.goto(f"{base}/dashboard/requests?since={today}&model_id={stack.model_id}")
    assert {late["id"], fresh["id"]} <= _listed(page)
    page.goto(f"{base}/dashboard/requests?until={yesterday}")
    assert _listed(page) == set()
    page.goto(f"{base}/dashboard/requests?model_id=no-such-model")
    assert _listed(page) == set()

    # a read-only officer sees no actions, and a POST with a valid form token of its session is still refused
    officer = browser.new_context()
    officer_page = officer.new_page()
    log_in(officer_page, base, stack.reader_key)
    officer_page.goto(f"{base}/dashboard/requests/{fresh['id']}")
    assert officer_page.locator("#cancel").count() == 0
    token = officer_page.get_attribute("form[action='/dashboard/logout'] input[name=csrf]", "value")
    refused = officer_page.request.post(f"{base}/dashboard/requests/{fresh['id']}/cancel", form={"csrf": token})
    assert refused.status == 403
    officer.close()
    # the admin's session without a form token (a forged cross-site form) is refused too
    forged = page.request.post(f"{base}/dashboard/requests/{fresh['id']}/cancel", form={"csrf": "forged"})
    assert forged.status == 403
    with stack.api() as client:
        assert client.get(f"/v1/deletion-requests/{fresh['id']}").json()["status"] == "received"

    page.goto(f"{base}/dashboard/requests/{fresh['id']}")
    page.click("#cancel")
    page.wait_for_selector("#notice")
    assert "cancelled" in page.inner_text("#notice") and page.inner_text("#status") == "cancelled"
    with stack.api() as client:
        assert client.get(f"/v1/deletion-requests/{fresh['id']}").json()["status"] == "cancelled"
    admin_id = page.inner_text("header .who span")  # the key's name; its id is in the audit actor
    assert admin_id.startswith("operator")
    actions = _audit_actions(stack, fresh["id"])
    cancelled = [actor for action, actor in actions if action == "deletion_request.cancelled"]
    assert len(cancelled) == 1 and cancelled[0].startswith("api-key:")

    # a finished request cannot be cancelled: the page answers with the service's refusal (409), nothing changes
    again = page.request.post(
        f"{base}/dashboard/requests/{fresh['id']}/cancel",
        form={"csrf": page.get_attribute("form[action='/dashboard/logout'] input[name=csrf]", "value")},
    )
    assert again.status == 409 and "Only a request no worker has started" in again.text()

    # retry a failed one (its failure written as the worker writes one: the job failed for good, then the request)
    broken = stack.delete(stack.model_id, ["r52"])
    _fail(broken["id"])
    page.goto(f"{base}/dashboard/requests/{broken['id']}")
    assert page.inner_text("#status") == "failed" and "simulated worker failure" in page.inner_text("#attempts")
    page.click("#retry")
    page.wait_for_selector("#notice")
    assert "queued again" in page.inner_text("#notice") and page.inner_text("#status") == "received"
    retried = [actor for action, actor in _audit_actions(stack, broken["id"]) if action == "deletion_request.retried"]
    assert retried == cancelled  # the same key, recorded as the API records it

    # extend the overdue one: audited as the API's extension, no longer overdue
    page.goto(f"{base}/dashboard/requests/{late['id']}")
    assert page.inner_text("#time-left").startswith("OVERDUE")
    page.fill("form.extend input[name=reason]", "complex request")
    page.select_option("form.extend select[name=months]", "2")
    page.click("#extend")
    page.wait_for_selector("#notice")
    assert page.inner_text("#time-left").endswith("left")
    assert "deletion_request.extended" in [a for a, _ in _audit_actions(stack, late["id"])]


def test_failed_request_past_its_deadline_is_flagged_overdue(stack, page):
    """A failed request still owes the erasure: past its deadline it is OVERDUE (list, page, filter), not answered."""
    base = stack.serve(background=False)
    failed = stack.delete(stack.model_id, ["r60"], received_at=(datetime.now(UTC) - timedelta(days=45)).isoformat())
    _fail(failed["id"], "the worker ran out of memory")
    log_in(page, base, stack.reader_key)

    page.goto(f"{base}/dashboard/requests?status=failed")
    row = page.locator(f"tr[data-request-id='{failed['id']}']")
    assert row.locator("[data-field=status]").inner_text() == "failed"
    flag = row.locator("[data-field=time_left]")
    assert re.match(r"OVERDUE by \d", flag.inner_text()) and "flag-overdue" in flag.get_attribute("class")
    assert "overdue" in row.get_attribute("class").split()
    page.goto(f"{base}/dashboard/requests?overdue=true")
    assert failed["id"] in _listed(page)

    page.goto(f"{base}/dashboard/requests/{failed['id']}")
    assert page.inner_text("#status") == "failed" and "ran out of memory" in page.inner_text("#attempts")
    assert re.match(r"OVERDUE by \d", page.inner_text("#time-left"))
    assert "flag-overdue" in page.get_attribute("#time-left", "class")


def test_pending_request_approved_by_a_second_admin_and_another_rejected(stack, page, browser):
    stack.serve(background=True)
    gated = stack.register_model("gated-lr", shadows=8, requires_approval=True, tags=["credit", "eu"])
    second_key = make_key(ADMIN_SCOPES, name="second-admin")
    to_approve = stack.delete(gated, ["r5", "r6"])  # submitted with the operator's key
    to_reject = stack.delete(gated, ["r7"])
    assert to_approve["status"] == to_reject["status"] == "pending-approval"
    base = stack.base_url

    # the submitter sees the request waiting, who submitted it, and may not approve it (four eyes)
    log_in(page, base, stack.admin_key)
    page.goto(f"{base}/dashboard/requests/{to_approve['id']}")
    assert page.inner_text("#status") == "pending-approval"
    assert page.inner_text("#submitter") == "operator"
    assert "second admin" in page.inner_text("#four-eyes") and page.is_disabled("#approve")
    forced = page.request.post(f"{base}/dashboard/requests/{to_approve['id']}/approve", form={"csrf": _token(page)})
    assert forced.status == 403 and "cannot be approved by the key that submitted it" in forced.text()
    assert _status(stack, to_approve["id"]) == "pending-approval"

    # the models page says the model needs approval, with its tags
    page.goto(f"{base}/dashboard/models/{gated}")
    assert page.inner_text("#requires-approval") == "requires approval"
    assert {"credit", "eu"} <= set(page.locator(".model-facts .tag").all_inner_texts())

    # a second admin approves it from the page: its job is created and it runs to certified
    second = browser.new_context()
    second.set_default_timeout(TIMEOUT_MS)
    other = second.new_page()
    log_in(other, base, second_key)
    other.goto(f"{base}/dashboard/requests/{to_approve['id']}")
    assert other.locator("#four-eyes").count() == 0 and not other.is_disabled("#approve")
    other.fill("#approval input[name=note]", "checked with the DPO")
    other.click("#approve")
    other.wait_for_selector("#notice")
    assert "approved" in other.inner_text("#notice") and other.locator("#approval").count() == 0
    other.wait_for_function("() => document.querySelector('#status').textContent === 'certified'")
    timeline = other.inner_text("#timeline")
    assert "approved by second-admin" in timeline and "checked with the DPO" in timeline
    assert "received by operator" in timeline and "api-key:" not in timeline  # keys by name, not by id
    approved = [actor for action, actor in _audit_actions(stack, to_approve["id"]) if action.endswith(".approved")]
    assert len(approved) == 1 and approved[0].startswith("api-key:") and approved[0] in other.content()  # a title

    # the other is rejected with a reason: no reason is refused, the reason is recorded and shown
    other.goto(f"{base}/dashboard/requests/{to_reject['id']}")
    empty = other.request.post(
        f"{base}/dashboard/requests/{to_reject['id']}/reject", form={"csrf": _token(other), "reason": " "}
    )
    assert empty.status == 422 and "say why" in empty.text()
    other.fill("#approval input[name=reason]", "not a data subject of ours")
    other.click("#reject")
    other.wait_for_selector("#notice")
    assert "rejected" in other.inner_text("#notice") and other.inner_text("#status") == "rejected"
    assert "not a data subject of ours" in other.inner_text("#attempts")
    assert "rejected by second-admin" in other.inner_text("#timeline")
    assert other.inner_text("#time-left") == "answered"
    assert _status(stack, to_reject["id"]) == "rejected"
    again = other.request.post(
        f"{base}/dashboard/requests/{to_reject['id']}/approve", form={"csrf": _token(other)}
    )  # nothing is waiting for approval now
    assert again.status == 409 and "Only a request waiting for approval" in again.text()
    second.close()

    page.goto(f"{base}/dashboard/audit")
    assert "second-admin" in page.inner_text("table.grid")


def test_per_person_erasure_followed_to_its_combined_certificate(stack, page, browser, tmp_path):
    person = "dana.subject-51c0@example.org"  # appears nowhere else
    stack.serve(background=True)
    for name, rows in (("people-a", [3, 40]), ("people-b", [7])):
        stack.register_model(name, shadows=8, people={person: rows})
    base = stack.serve(background=False)  # nothing runs yet: the erasure page opens while it is in progress
    log_in(page, base, stack.admin_key)

    page.goto(f"{base}/dashboard/subjects")
    page.fill("#erase-ref", "nobody.known@example.org")  # no model holds rows of theirs: answered, certified at once
    page.click("#erase-submit")
    page.wait_for_url(re.compile(r"/dashboard/erasures/[0-9a-f-]+\?done=erasure$"))
    assert page.inner_text("#erasure-status") == "certified" and "No data found" in page.inner_text("#no-data")
    assert page.locator("#erasure-download").count() == 1 and page.locator("tr[data-child-id]").count() == 0

    page.goto(f"{base}/dashboard/subjects")
    page.fill("#erase-ref", person)
    page.click("#erase-submit")
    page.wait_for_url(re.compile(r"/dashboard/erasures/[0-9a-f-]+\?done=erasure$"))
    erasure_id = page.url.split("/dashboard/erasures/")[1].split("?")[0]
    assert "one deletion request per model" in page.inner_text("#notice")
    assert page.inner_text("#erasure-status") == "in-progress" and page.locator("#combined-pending").count() == 1
    children = page.eval_on_selector_all("tr[data-child-id]", "rows => rows.map(r => r.dataset.childId)")
    assert len(children) == 2 and {"people-a", "people-b"} == set(
        page.locator("#children td a[href^='/dashboard/models/']").all_inner_texts()
    )
    assert person not in page.content() and person not in page.url
    page.evaluate("() => { window.__sameDocument = true; }")

    stack.serve(background=True)  # the same origin, now with the in-process worker: the page follows it
    page.wait_for_function("() => document.querySelector('#erasure-status').textContent === 'certified'")
    assert page.evaluate("() => window.__sameDocument === true"), "the page was reloaded"
    assert page.locator("#children .badge").all_inner_texts() == ["certified", "certified"]
    result = page.inner_text("#erasure-verify-result")
    assert result.startswith(f"VALID: combined erasure certificate {erasure_id}") and "2 model(s)" in result
    page.evaluate("() => { document.querySelector('#erasure-verify-result').textContent = ''; }")
    page.click("#erasure-verify")
    page.wait_for_function("() => document.querySelector('#erasure-verify-result').textContent.includes('checked')")
    assert page.inner_text("#erasure-verify-result").startswith("VALID: combined erasure certificate")

    # the combined certificate downloads and verifies offline against the published keys, as the page says
    download = page.request.get(base + page.get_attribute("#erasure-download", "href"))
    assert download.status == 200 and "attachment" in download.headers["content-disposition"]
    saved = tmp_path / "erasure.json"
    saved.write_bytes(download.body())
    valid, summary = verify_file(saved, f"{base}/.well-known/lethe-keys.json")
    assert valid and erasure_id in summary and all(child in summary for child in children)
    for child in children:
        assert _status(stack, child) == "certified"

    # a lookup by the person's reference (posted, never in a URL) lists their requests and the erasure
    page.goto(f"{base}/dashboard/subjects")
    page.fill("#lookup input[name=subject_ref]", person)
    page.click("#lookup-submit")
    page.wait_for_url(re.compile(r"/dashboard/subjects/[0-9a-f]{64}$"))
    assert page.url.endswith(subject_hash(person)) and person not in page.url and person not in page.content()
    assert _listed(page) == set(children)
    assert short_id(erasure_id) in page.inner_text("#erasures") and "certified" in page.inner_text("#erasures")
    page.click(f"#erasures a[href='/dashboard/erasures/{erasure_id}']")
    page.wait_for_selector("#erasure-download")

    # a read-only key sees no erasure form and its POST is refused
    reader = browser.new_context()
    reader_page = reader.new_page()
    log_in(reader_page, base, stack.reader_key)
    reader_page.goto(f"{base}/dashboard/subjects")
    assert reader_page.locator("#erase-submit").count() == 0 and reader_page.locator("#lookup-submit").count() == 1
    refused = reader_page.request.post(
        f"{base}/dashboard/subjects/erasures", form={"csrf": _token(reader_page), "subject_ref": person}
    )
    assert refused.status == 403
    reader.close()


def _outcomes(page) -> dict[str, tuple[str, str, str]]:
    """The bulk outcome's rows: request id -> (outcome, status now, why it was skipped)."""
    return {
        row.get_attribute("data-outcome-id"): tuple(row.locator("td").nth(i).inner_text().strip() for i in (1, 2, 3))
        for row in page.locator("#bulk-outcome tr[data-outcome-id]").all()
    }


def test_bulk_approve_from_the_list_skips_the_approvers_own_and_a_cancelled_request(stack, page, browser):
    """Tick four requests, approve them at once: the two another key submitted are approved (audited as the API's
    approve, by the approver's key), the approver's own is skipped (four eyes) and a cancelled one is skipped (not
    waiting); then every request matching the filter is rejected, a reason required."""
    stack.serve(background=True)
    gated = stack.register_model("bulk-lr", shadows=8, requires_approval=True)
    base = stack.serve(background=False)  # nothing runs: an approved request stays `received`
    approver_key = make_key(ADMIN_SCOPES, name="bulk-approver")
    first, second, gone = (stack.delete(gated, [row])["id"] for row in ("r11", "r12", "r14"))  # the operator's
    with stack.api(approver_key) as client:
        scope = {"kind": "samples", "sample_ids": ["r13"]}
        own = client.post("/v1/deletion-requests", json={"subject_ref": "own", "model_id": gated, "scope": scope})
        own = own.json()["id"]
        assert client.post(f"/v1/deletion-requests/{gone}/cancel").status_code == 200

    log_in(page, base, approver_key)
    page.goto(f"{base}/dashboard/requests?model_id={gated}")
    assert _listed(page) == {first, second, own, gone}
    for request_id in (first, second, own, gone):
        page.check(f"input[name=ids][value='{request_id}']")
    assert page.inner_text("#bulk-count") == "4" and page.is_checked("#pick-all")
    page.select_option("#bulk-action", "approve")
    page.click("#bulk-apply")
    page.wait_for_selector("#bulk-outcome")
    assert page.inner_text("#bulk-outcome h2") == "Approve: 2 done, 2 skipped of 4 selected"
    outcomes = _outcomes(page)
    assert outcomes[first] == outcomes[second] == ("done", "received", "")
    assert outcomes[own][:2] == ("skipped", "pending-approval") and outcomes[own][2].startswith(
        "approval-by-submitter: "
    )
    assert outcomes[gone] == ("skipped", "cancelled", "not-awaiting-approval: status is 'cancelled'")
    assert [_status(stack, r) for r in (first, second, own, gone)] == [
        "received", "received", "pending-approval", "cancelled"
    ]  # fmt: skip
    me = page.get_attribute("header .who span", "title")  # the approver's key, as the audit log names it
    for request_id in (first, second):
        assert [actor for action, actor in _audit_actions(stack, request_id) if action.endswith(".approved")] == [me]
    assert not [a for a, _ in _audit_actions(stack, own) if a.endswith(".approved")]
    row = page.locator(f"#requests tr[data-request-id='{first}'] [data-field=status]")
    assert row.inner_text() == "received"  # the list under the outcome is the list after the action

    # every request matching the filter (only the approver's own is still waiting): reject needs a reason
    page.goto(f"{base}/dashboard/requests?status=pending-approval&model_id={gated}")
    assert page.inner_text("#bulk-matching-count") == "1" and "matching the filter" in page.inner_text("#bulk")
    page.check("#bulk-matching")
    page.select_option("#bulk-action", "reject")
    page.click("#bulk-apply")
    page.wait_for_selector("#action-error")
    assert "say why" in page.inner_text("#action-error") and _status(stack, own) == "pending-approval"
    assert page.is_checked("#bulk-matching")  # the form comes back as it was sent
    page.fill("#bulk-reason", "submitted by mistake")
    page.click("#bulk-apply")
    page.wait_for_selector("#bulk-outcome")
    assert page.inner_text("#bulk-outcome h2") == "Reject: 1 done, 0 skipped of 1 selected"
    assert _outcomes(page)[own] == ("done", "rejected", "") and _status(stack, own) == "rejected"

    # a forged form and a read-only key are refused; the reader sees no boxes to tick
    forged = page.request.post(f"{base}/dashboard/requests/bulk",
                               form={"csrf": "forged", "action": "cancel", "ids": first})  # fmt: skip
    assert forged.status == 403 and _status(stack, first) == "received"
    reader = browser.new_context()
    reader_page = reader.new_page()
    log_in(reader_page, base, stack.reader_key)
    reader_page.goto(f"{base}/dashboard/requests?model_id={gated}")
    assert reader_page.locator("input[name=ids]").count() == 0 and reader_page.locator("#bulk").count() == 0
    refused = reader_page.request.post(
        f"{base}/dashboard/requests/bulk", form={"csrf": _token(reader_page), "action": "cancel", "ids": first}
    )
    assert refused.status == 403 and _status(stack, first) == "received"
    reader.close()


def test_model_settings_changed_on_the_model_page_as_the_api_would(stack, page, browser):
    """Approval, tags and batch bounds changed from the model page: shown there, answered by GET /v1/models/{id},
    audited as the API's PATCH (one model.updated per change, none for a form saved unchanged), and in force: the
    next deletion request waits for approval."""
    from app.requests.intake import MODEL_TTL

    base = stack.serve(background=True)
    model_id = stack.register_model("settings-lr", shadows=8, tags=["credit"])
    log_in(page, base, stack.admin_key)
    page.goto(f"{base}/dashboard/models/{model_id}")
    assert not page.is_checked("#set-approval") and page.input_value("#set-tags") == "credit"
    assert page.input_value("#set-max-requests") == "2000" and page.input_value("#set-max-rows") == "20000"
    page.check("#set-approval")
    page.fill("#set-tags", "prod, team:fraud")
    page.fill("#set-max-requests", "7")
    page.fill("#set-max-rows", "500")
    page.click("#save-settings")
    page.wait_for_selector("#notice")
    assert "saved" in page.inner_text("#notice")
    assert page.inner_text("#requires-approval") == "requires approval" and page.is_checked("#set-approval")
    assert page.locator(".model-facts .tag").all_inner_texts() == ["prod", "team:fraud"]
    assert page.inner_text("#batch-bounds") == "Batches: at most 7 requests and 500 rows per version."
    with stack.api() as client:
        model = client.get(f"/v1/models/{model_id}").json()
        events = client.get("/v1/audit", params={"entity_id": model_id}).json()["items"]
    assert model["requires_approval"] is True and model["tags"] == ["prod", "team:fraud"]
    assert model["batch"] == {"max_requests": 7, "max_rows": 500}
    updates = [e for e in events if e["action"] == "model.updated"]
    assert len(updates) == 3 and {e["actor"] for e in updates} == {updates[0]["actor"]}
    assert updates[0]["actor"].startswith("api-key:")
    assert {k for e in updates for k in e["payload"]} >= {"requires_approval", "tags", "batch"}

    page.click("#save-settings")  # saved unchanged: nothing changes, nothing is recorded
    page.wait_for_selector("#notice")
    with stack.api() as client:
        again = client.get("/v1/audit", params={"entity_id": model_id}).json()["items"]
    assert [e for e in again if e["action"] == "model.updated"] == updates

    page.fill("#set-tags", "Not A Tag")
    page.click("#save-settings")
    page.wait_for_selector("#settings-error")
    assert "'Not', 'A', 'Tag' are not tags" in page.inner_text("#settings-error")
    assert page.input_value("#set-tags") == "Not A Tag"  # the form comes back as it was typed
    with stack.api() as client:
        assert client.get(f"/v1/models/{model_id}").json()["tags"] == ["prod", "team:fraud"]

    time.sleep(MODEL_TTL + 0.1)  # the intake's snapshot of the model is at most MODEL_TTL old
    assert stack.delete(model_id, ["r3"])["status"] == "pending-approval"

    reader = browser.new_context()
    reader_page = reader.new_page()
    log_in(reader_page, base, stack.reader_key)
    reader_page.goto(f"{base}/dashboard/models/{model_id}")
    assert reader_page.locator("#model-settings").count() == 0 and "7 requests" in reader_page.inner_text(
        "#batch-bounds"
    )
    refused = reader_page.request.post(f"{base}/dashboard/models/{model_id}/settings",
                                       form={"csrf": _token(reader_page), "tags": "hacked"})  # fmt: skip
    assert refused.status == 403
    reader.close()
    forged = page.request.post(f"{base}/dashboard/models/{model_id}/settings", form={"csrf": "forged", "tags": "x"})
    assert forged.status == 403
    with stack.api() as client:
        assert client.get(f"/v1/models/{model_id}").json()["tags"] == ["prod", "team:fraud"]


def test_plain_http_on_a_non_localhost_host_name_with_the_setting(stack, playwright, monkeypatch):
    """``lethe.test`` is mapped to 127.0.0.1 inside Chromium (nothing is resolved for real, every other name fails):
    an origin that is not localhost over plain http, where a browser drops a Secure cookie. Every request to it goes
    through Chromium (navigation, clicks, the page's own fetch), never through Playwright's resolver."""
    base = stack.serve(background=False).replace("127.0.0.1", "lethe.test")
    waiting = stack.delete(stack.model_id, ["r70"])
    rules = "--host-resolver-rules=MAP lethe.test 127.0.0.1, MAP * ~NOTFOUND, EXCLUDE 127.0.0.1"
    chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=[*CHROMIUM_ARGS, rules, "--no-proxy-server"])
    try:
        # by default the cookies are Secure: the browser drops them, and the login form says why
        context = chromium.new_context()
        context.set_default_timeout(TIMEOUT_MS)
        page = context.new_page()
        log_in(page, base, stack.admin_key)
        assert page.url.endswith("/dashboard/login")
        assert "LETHE_DASHBOARD_INSECURE_COOKIES" in page.inner_text("#login-error")
        assert not [c for c in context.cookies() if c["name"].startswith("lethe_dashboard")]
        context.close()

        # allowed: the same cookies without Secure (still HttpOnly, SameSite=Strict), forms and CSRF work
        monkeypatch.setenv("LETHE_DASHBOARD_INSECURE_COOKIES", "true")
        get_settings.cache_clear()
        context = chromium.new_context()
        context.set_default_timeout(TIMEOUT_MS)
        page = context.new_page()
        log_in(page, base, stack.admin_key)
        assert page.url == f"{base}/dashboard/requests" and short_id(waiting["id"]) in page.content()
        (cookie,) = [c for c in context.cookies() if c["name"] == "lethe_dashboard"]
        assert not cookie["secure"] and cookie["httpOnly"] and cookie["sameSite"] == "Strict"
        # (from inside the page: Playwright's own page.request would resolve lethe.test for real, outside Chromium)
        forged = page.evaluate(
            """async (url) => (await fetch(url, {method: "POST", credentials: "same-origin",
                                                 body: new URLSearchParams({csrf: "forged"})})).status""",
            f"/dashboard/requests/{waiting['id']}/cancel",
        )
        assert forged == 403
        page.goto(f"{base}/dashboard/requests/{waiting['id']}")
        page.click("#cancel")
        page.wait_for_selector("#notice")
        assert "cancelled" in page.inner_text("#notice") and _status(stack, waiting["id"]) == "cancelled"
        page.click("header .who button")
        page.wait_for_url(re.compile(r"/dashboard/login$"))
        assert not [c for c in context.cookies() if c["name"] == "lethe_dashboard"]
        context.close()
    finally:
        chromium.close()
        monkeypatch.delenv("LETHE_DASHBOARD_INSECURE_COOKIES", raising=False)
        get_settings.cache_clear()


def test_logout_ends_the_session_server_side_so_a_copied_cookie_is_refused(stack, browser):
    """Issue 22: the cookie holds a random session token, never the key; logging out deletes the session, so the
    same cookie copied into another browser (what a thief would replay) opens nothing."""
    base = stack.serve(background=False)
    key = make_key(["requests:read"], name="copied-cookie")
    context = browser.new_context()
    context.set_default_timeout(TIMEOUT_MS)
    page = context.new_page()
    log_in(page, base, key)
    assert page.url.endswith("/dashboard/requests")
    (cookie,) = [c for c in context.cookies() if c["name"] == "lethe_dashboard"]
    assert key not in cookie["value"] and key.rsplit("_", 1)[1][:12] not in cookie["value"]
    thief = browser.new_context()
    thief.set_default_timeout(TIMEOUT_MS)
    thief.add_cookies([cookie])
    stolen = thief.new_page()
    assert stolen.goto(f"{base}/dashboard/requests").status == 200  # the copy works while the session lives
    stolen.close()  # (its poller, refused after the logout, would make the thief's browser drop the cookie)
    page.click("header .who button")
    page.wait_for_url(re.compile(r"/dashboard/login$"))
    assert [c["value"] for c in thief.cookies() if c["name"] == "lethe_dashboard"] == [cookie["value"]]
    stolen = thief.new_page()
    response = stolen.goto(f"{base}/dashboard/requests")
    assert response.status == 401 and "was refused" in stolen.inner_text("#login-error")
    thief.close()
    context.close()
