"""Issue 23: Swagger UI (``/docs``) and ReDoc (``/redoc``) render in a real browser with no network but loopback.

Playwright drives Debian's Chromium (never Playwright's own download) against the real API on a loopback port. Every
request the browser makes to anything other than that origin is refused and recorded (the test then fails), so this
is the air-gapped install: the pages must render the API from the assets the app serves, under their own
Content-Security-Policy (a violation is recorded too). Unit checks of the same pages: tests/unit/test_docs_assets.py.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlsplit

import pytest

from tests.dashboard_stack import CHROMIUM, CHROMIUM_ARGS, Stack

playwright_api = pytest.importorskip("playwright.sync_api", reason="the dev extra installs playwright")
if not Path(CHROMIUM).exists():
    pytest.fail(f"{CHROMIUM} is missing: apt-get install chromium", pytrace=False)

TIMEOUT_MS = 60_000
REDOCLY_LOGO = "https://cdn.redoc.ly/redoc/logo-mini.svg"
RECORD_VIOLATIONS = """
window.__violations = [];
document.addEventListener("securitypolicyviolation",
    e => window.__violations.push(`${e.violatedDirective} ${e.blockedURI}`));
"""


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    stack = Stack(tmp_path_factory.mktemp("docs-browser") / "home")
    try:
        yield stack.serve(background=False)
    finally:
        stack.stop()


@pytest.fixture(scope="module")
def browser():
    with playwright_api.sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


@pytest.fixture
def offline_page(browser, base):
    """A page whose every request to another origin is aborted; yields (page, refused URLs, page errors)."""
    context = browser.new_context()
    context.set_default_timeout(TIMEOUT_MS)
    refused: list[str] = []
    errors: list[str] = []
    origin = urlsplit(base).netloc

    def gate(route):
        url = route.request.url
        if urlsplit(url).scheme in ("data", "blob") or urlsplit(url).netloc == origin:
            route.continue_()
        else:
            refused.append(url)
            route.abort()

    context.route("**/*", gate)
    context.add_init_script(RECORD_VIOLATIONS)
    page = context.new_page()
    page.on("pageerror", lambda error: errors.append(str(error)))
    yield page, refused, errors
    context.close()


def _assert_clean(page, refused, errors, blocked_by_policy=()):
    assert refused == [], f"the page asked for outside URLs: {refused}"
    assert errors == [], errors
    assert sorted(set(page.evaluate("window.__violations"))) == sorted(blocked_by_policy)


def test_swagger_ui_renders_the_api_offline(base, offline_page):
    page, refused, errors = offline_page
    page.goto(f"{base}/docs")
    page.wait_for_selector(".swagger-ui .info .title")
    assert "Lethe" in page.inner_text(".swagger-ui .info .title")
    page.wait_for_selector(".opblock")
    assert page.locator(".opblock").count() > 10
    assert page.locator(".opblock-summary-path", has_text="/v1/deletion-requests").count() >= 1
    page.locator(".opblock-summary", has_text="/v1/deletion-requests").first.click()  # an operation opens
    page.wait_for_selector(".opblock.is-open")
    assert page.locator("button.authorize").count() == 1  # the bearer scheme is offered
    _assert_clean(page, refused, errors)


def test_redoc_renders_the_api_offline(base, offline_page):
    page, refused, errors = offline_page
    page.goto(f"{base}/redoc")
    page.wait_for_selector(".api-info h1")
    assert "Lethe" in page.inner_text(".api-info h1")
    page.wait_for_selector("[data-section-id^='operation/']")
    assert page.locator("[data-section-id^='operation/']").count() > 10
    page.fill("input[placeholder='Search...']", "deletion")  # ReDoc's search (its worker) answers
    page.wait_for_selector("[data-role='search:results'] li")  # none before a search
    assert "Deletion Request" in page.inner_text("[data-role='search:results']")
    # ReDoc's side menu shows Redocly's logo from their CDN, with no option to turn it off: the page's policy refuses
    # it (so the browser never asks for it) and ReDoc drops the image when it fails to load
    _assert_clean(page, refused, errors, blocked_by_policy=[f"img-src {REDOCLY_LOGO}"])
    assert page.locator("img[alt='redocly logo']").count() == 0
