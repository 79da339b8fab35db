"""Issue 23: ``/docs`` (Swagger UI) and ``/redoc`` (ReDoc) work in an air-gapped install. Every URL the two pages
reference is same-origin, and each answers 200 with the content type its tag needs, from assets installed with the
package (``fastapi-offline``); the pages' Content-Security-Policy allows nothing from another origin, and their one
inline script by its hash. A CDN URL that reappears (FastAPI's defaults, Google Fonts) fails here. In a real browser,
with every non-loopback request refused: tests/integration/test_docs_browser.py; from an installed wheel:
tests/integration/test_installed_pg.py."""

from __future__ import annotations

import base64
import hashlib
import re
from html.parser import HTMLParser
from urllib.parse import urljoin, urlsplit

import pytest
from fastapi.testclient import TestClient

from app import apidocs
from app.main import create_app
from tests.helpers import configure

BASE = "http://testserver"
PAGES = ("/docs", "/redoc")
EXPECTED_TYPES = {"script": "javascript", "stylesheet": "text/css", "icon": "image/", "spec": "application/json"}


class _References(HTMLParser):
    """(kind, url) of every URL a page makes the browser load: scripts, stylesheets, icons, ReDoc's spec-url, and any
    src/href attribute at all (so a new tag kind cannot slip a CDN URL past the kinds named here)."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: list[tuple[str, str]] = []
        self.inline_scripts: list[str] = []
        self._in_inline_script = False

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "script" and attrs.get("src"):
            self.refs.append(("script", attrs["src"]))
        elif tag == "script":
            self._in_inline_script = True
            self.inline_scripts.append("")
        elif tag == "link" and "stylesheet" in (attrs.get("rel") or ""):
            self.refs.append(("stylesheet", attrs["href"]))
        elif tag == "link" and "icon" in (attrs.get("rel") or ""):
            self.refs.append(("icon", attrs["href"]))
        elif tag == "redoc":
            self.refs.append(("spec", attrs["spec-url"]))
        else:
            self.refs += [("other", value) for name, value in attrs.items() if name in ("src", "href") and value]

    def handle_endtag(self, tag):
        self._in_inline_script = False

    def handle_data(self, data):
        if self._in_inline_script:
            self.inline_scripts[-1] += data


def _parse(html: str) -> _References:
    parser = _References()
    parser.feed(html)
    return parser


@pytest.fixture(scope="module")
def http(tmp_path_factory):
    configure(tmp_path_factory.mktemp("docs"))
    with TestClient(create_app(run_background=False), base_url=BASE) as client:
        yield client


def _swagger_spec_url(script: str) -> str:
    (url,) = re.findall(r"url: '([^']*)'", script)
    return url


@pytest.mark.parametrize("page", PAGES)
def test_every_url_a_docs_page_references_is_same_origin_and_answers(http, page):
    answer = http.get(page)
    assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/html")
    parsed = _parse(answer.text)
    refs = list(parsed.refs)
    if page == "/docs":  # Swagger UI's spec URL is in its init script
        (script,) = parsed.inline_scripts
        refs.append(("spec", _swagger_spec_url(script)))
    kinds = {kind for kind, _ in refs}
    assert {"script", "icon", "spec"} <= kinds, refs
    assert "other" not in kinds, refs  # a page that grows a new kind of reference needs a look (and a test)
    for kind, url in refs:
        absolute = urljoin(f"{BASE}{page}", url)
        assert urlsplit(absolute).netloc == urlsplit(BASE).netloc, f"{page} loads {url} from another origin"
        asset = http.get(absolute)
        assert asset.status_code == 200, (page, url, asset.status_code)
        assert EXPECTED_TYPES[kind] in asset.headers["content-type"], (page, url, asset.headers["content-type"])
        assert asset.content, (page, url)


@pytest.mark.parametrize("page", PAGES)
def test_no_cdn_or_outside_host_anywhere_in_the_page(http, page):
    """Not only in tags: no absolute http(s) URL, no protocol-relative one (``//host/...``), no known CDN host."""
    html = http.get(page).text
    assert not re.search(r"https?://", html, re.IGNORECASE), html
    assert not re.search(r"""["'(=]\s*//""", html), html
    for host in ("jsdelivr", "unpkg", "cdnjs", "googleapis", "gstatic", "fastapi.tiangolo.com"):
        assert host not in html.lower(), (page, host)


@pytest.mark.parametrize("page", PAGES)
def test_the_pages_policy_allows_only_this_origin_and_the_pages_own_inline_script(http, page):
    answer = http.get(page)
    policy = dict(
        (directive.split(" ", 1) + [""])[:2] for directive in answer.headers["content-security-policy"].split("; ")
    )
    for directive in ("default-src", "script-src", "style-src", "img-src", "font-src", "connect-src"):
        sources = policy[directive].split()
        assert "'self'" in sources, (directive, sources)
        assert not [s for s in sources if "://" in s or s in ("*", "http:", "https:")], (directive, sources)
    assert "'unsafe-inline'" not in policy["script-src"] and "'unsafe-eval'" not in policy["script-src"]
    assert policy["frame-ancestors"] == "'none'" and policy["object-src"] == "'none'"
    inline = _parse(answer.text).inline_scripts
    allowed = {s for s in policy["script-src"].split() if s.startswith("'sha256-")}
    assert allowed == {f"'sha256-{base64.b64encode(hashlib.sha256(s.encode()).digest()).decode()}'" for s in inline}
    assert answer.headers["x-frame-options"] == "DENY" and answer.headers["x-content-type-options"] == "nosniff"


def test_swagger_ui_has_no_online_validator(http):
    """Swagger UI's default badge asks an outside validator about the spec's URL; it is switched off."""
    (script,) = _parse(http.get("/docs").text).inline_scripts
    assert '"validatorUrl": null' in script


def test_behind_a_proxy_prefix_the_pages_reference_the_prefixed_urls(tmp_path):
    configure(tmp_path)
    with TestClient(create_app(run_background=False), base_url=BASE, root_path="/lethe") as client:
        parsed = _parse(client.get("/docs").text)
        urls = [url for _, url in parsed.refs] + [_swagger_spec_url(parsed.inline_scripts[0])]
        assert urls and all(url.startswith("/lethe/") for url in urls), urls


def test_the_assets_come_from_the_installed_package_and_are_the_versions_expected(http):
    """Swagger UI 5 (OpenAPI 3.1, which /openapi.json is) and ReDoc 2: the package's files, not a copy of ours."""
    from importlib.resources import files

    folder = files(apidocs.ASSETS_PACKAGE[0]) / apidocs.ASSETS_PACKAGE[1]
    bundle = (folder / apidocs.SWAGGER_JS).read_bytes()
    assert http.get(f"{apidocs.ASSETS_URL}/{apidocs.SWAGGER_JS}").content == bundle
    (version,) = re.findall(rb'PACKAGE_VERSION:"([0-9.]+)"', bundle)
    assert int(version.split(b".")[0]) >= 5, version
    assert re.search(rb'ReDoc Version: ","2\.', (folder / apidocs.REDOC_JS).read_bytes())
    assert http.get(f"{apidocs.ASSETS_URL}/%2e%2e/core.py").status_code == 404  # the package's code is not served
