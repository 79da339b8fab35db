"""Screenshots of the dashboard's main pages into docs/screenshots/ (rerun after changing a page).

    PYTHONPATH=. .venv/bin/python scripts/screenshots.py [--out docs/screenshots]

Starts a throwaway embedded Lethe on a loopback port (a temporary home), registers a small tabular model with a
prepared fast method, certifies two deletions, leaves one request overdue and one waiting, then drives Debian's
Chromium (/usr/bin/chromium; `apt-get install chromium`) with Playwright. Nothing leaves the machine.
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

from tests.dashboard_stack import CHROMIUM, CHROMIUM_ARGS, Stack, log_in  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "screenshots")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="lethe-shots-") as tmp:
        stack = Stack(Path(tmp) / "home")
        try:
            stack.serve(background=True)
            model_id = stack.register_model("credit-lr", shadows=16, unlearning=["newton"])
            first = stack.delete(model_id, ["r1", "r2", "r3"])
            stack.wait_done(first["id"])
            second = stack.delete(model_id, ["r10"], method="newton")
            stack.wait_done(second["id"])
            stack.serve(background=False)  # no executor: what is asked now waits
            late = (datetime.now(UTC) - timedelta(days=38)).isoformat()
            stack.delete(model_id, ["r20", "r21"], received_at=late)
            stack.delete(model_id, ["r30"])
            base = stack.base_url
            with sync_playwright() as playwright:
                browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
                page = browser.new_page(viewport={"width": 1320, "height": 900}, device_scale_factor=1)
                log_in(page, base, stack.admin_key)
                shots = {
                    "requests.png": "/dashboard/requests",
                    "request.png": f"/dashboard/requests/{first['id']}",
                    "models.png": f"/dashboard/models/{model_id}",
                    "audit.png": "/dashboard/audit",
                }
                for name, path in shots.items():
                    page.goto(base + path)
                    page.wait_for_load_state("networkidle")
                    page.screenshot(path=str(args.out / name), full_page=True)
                    print(f"wrote {args.out / name}")
                browser.close()
        finally:
            stack.stop()


if __name__ == "__main__":
    main()
