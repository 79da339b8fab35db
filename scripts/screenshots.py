"""Screenshots of the dashboard's main pages into docs/screenshots/ (rerun after changing a page).

    PYTHONPATH=. .venv/bin/python scripts/screenshots.py [--out docs/screenshots]

Starts a throwaway embedded Lethe on a loopback port (a temporary home), registers a small tabular model with a
prepared fast method, a model whose deletions need approval and two models with a subject column; certifies two
deletions and one person's erasure across two models, leaves one request overdue, one waiting, one failed past its
deadline and five waiting for approval, four of which a second admin ticks on the list and approves at once (its own
among them: skipped, four eyes), then drives Debian's Chromium (/usr/bin/chromium; `apt-get install chromium`) with
Playwright. Nothing leaves the machine.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from datetime import UTC, datetime, timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from playwright.sync_api import sync_playwright  # noqa: E402

from app.db import session_scope  # noqa: E402
from app.jobs import outbox  # noqa: E402
from app.requests import service as requests_service  # noqa: E402
from tests.dashboard_stack import ADMIN_SCOPES, CHROMIUM, CHROMIUM_ARGS, Stack, log_in  # noqa: E402
from tests.helpers import make_key, wait_for  # noqa: E402

PERSON = "customer-30417"


def fail(request_id: str, error: str) -> None:
    """Fail a request as a worker does when its one attempt fails: running, then the job for good, then the request
    (the failure itself is staged: the page shows what a real one leaves)."""
    with session_scope() as session:
        job_id = requests_service.get_request_or_404(session, request_id).job_id
        requests_service.mark_running(session, request_id, job_id, 1, "screenshots")
        outbox.fail(session, job_id, None, error, permanent=True)
        requests_service.mark_failed(session, request_id, job_id, 1, error, "failed", "job-failed")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "screenshots")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="lethe-shots-") as tmp:
        stack = Stack(Path(tmp) / "home")
        try:
            stack.serve(background=True)
            model_id = stack.register_model("credit-lr", shadows=16, unlearning=["newton"], tags=["credit", "eu"])
            gated = stack.register_model("loans-lr", shadows=8, requires_approval=True, tags=["loans"])
            for name, rows in (("churn-lr", [4, 91]), ("fraud-lr", [17])):
                stack.register_model(name, shadows=8, people={PERSON: rows})
            first = stack.delete(model_id, ["r1", "r2", "r3"])
            stack.wait_done(first["id"])
            second = stack.delete(model_id, ["r10"], method="newton")
            stack.wait_done(second["id"])
            with stack.api() as client:
                erasure = client.post("/v1/subjects/erasures", json={"subject_ref": PERSON}).json()
                wait_for(
                    lambda: client.get(f"/v1/subjects/erasures/{erasure['id']}").json()["status"] == "certified",
                    timeout=300,
                    interval=0.3,
                    what="the erasure's combined certificate",
                )
            stack.serve(background=False)  # no executor: what is asked now waits
            late = (datetime.now(UTC) - timedelta(days=38)).isoformat()
            stack.delete(model_id, ["r20", "r21"], received_at=late)
            stack.delete(model_id, ["r30"])
            failed = stack.delete(model_id, ["r40"], received_at=(datetime.now(UTC) - timedelta(days=41)).isoformat())
            fail(failed["id"], "the worker ran out of memory")
            pending = stack.delete(gated, ["r5", "r6"])
            second_admin = make_key(ADMIN_SCOPES, name="dpo-office")
            ticked = [stack.delete(gated, [row])["id"] for row in ("r7", "r8", "r9")]
            with stack.api(second_admin) as client:  # one the approver submitted itself: four eyes skip it
                scope = {"kind": "samples", "sample_ids": ["r11"]}
                body = {"subject_ref": "walk-in", "model_id": gated, "scope": scope}
                ticked.append(client.post("/v1/deletion-requests", json=body).json()["id"])
            base = stack.base_url
            with sync_playwright() as playwright:
                browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
                page = browser.new_page(viewport={"width": 1320, "height": 900}, device_scale_factor=1)
                log_in(page, base, stack.admin_key)
                shots = {
                    "requests.png": "/dashboard/requests",
                    "request.png": f"/dashboard/requests/{first['id']}",
                    "overdue-failed.png": f"/dashboard/requests/{failed['id']}",
                    "erasure.png": f"/dashboard/erasures/{erasure['id']}",
                    "models.png": f"/dashboard/models/{model_id}",
                    "audit.png": "/dashboard/audit",
                }
                for name, path in shots.items():
                    page.goto(base + path)
                    page.wait_for_load_state("networkidle")
                    page.screenshot(path=str(args.out / name), full_page=True)
                    print(f"wrote {args.out / name}")
                # the pending request as a second admin sees it (the submitter's Approve is disabled: four eyes)
                page.context.clear_cookies()
                log_in(page, base, second_admin)
                page.goto(f"{base}/dashboard/requests/{pending['id']}")
                page.wait_for_load_state("networkidle")
                page.screenshot(path=str(args.out / "approval.png"), full_page=True)
                print(f"wrote {args.out / 'approval.png'}")
                # bulk: waiting requests ticked to be approved at once, then each one's outcome (the approver's own
                # skipped: four eyes)
                page.goto(f"{base}/dashboard/requests?status=pending-approval")
                for request_id in ticked:
                    page.check(f"input[name=ids][value='{request_id}']")
                page.select_option("#bulk-action", "approve")
                page.screenshot(path=str(args.out / "bulk.png"), full_page=True)
                print(f"wrote {args.out / 'bulk.png'}")
                page.click("#bulk-apply")
                page.wait_for_selector("#bulk-outcome")
                page.screenshot(path=str(args.out / "bulk-outcome.png"), full_page=True)
                print(f"wrote {args.out / 'bulk-outcome.png'}")
                browser.close()
        finally:
            stack.stop()


if __name__ == "__main__":
    main()
