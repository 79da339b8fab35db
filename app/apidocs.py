"""``/docs`` (Swagger UI) and ``/redoc`` (ReDoc) from assets installed with the package: no CDN (issue 23).

FastAPI's default pages load their JavaScript and CSS from a CDN (and ReDoc's fonts from Google), so an air-gapped
install shows a blank page. The assets here come from the ``fastapi-offline`` package (a dependency: Swagger UI's
``swagger-ui-bundle.js`` and ``swagger-ui.css``, ReDoc's ``redoc.standalone.js``, a favicon), served by Starlette's
``StaticFiles`` under ``ASSETS_URL``; the pages are still FastAPI's ``get_swagger_ui_html`` / ``get_redoc_html``,
pointed at those local URLs. Swagger UI's online validator badge is off (it would send the spec's URL to an outside
service). Both pages carry a Content-Security-Policy in the dashboard's spirit: scripts, styles, images, fonts and
fetches from this origin only (the pages' one inline script allowed by its hash), so a CDN URL that crept back in
would be refused by the browser too. The policy is also what keeps ReDoc itself offline: its side menu shows
Redocly's logo from their CDN, with no option to turn it off; refused, the image is dropped (ReDoc's onError).
"""

from __future__ import annotations

import base64
import hashlib
import re

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.staticfiles import StaticFiles
from starlette.responses import HTMLResponse

ASSETS_PACKAGE = ("fastapi_offline", "static")
"""(package, folder) holding the assets: the folder ships inside the package's wheel."""
ASSETS_URL = "/docs-assets"
SWAGGER_JS, SWAGGER_CSS = "swagger-ui-bundle.js", "swagger-ui.css"
REDOC_JS, FAVICON = "redoc.standalone.js", "favicon.png"
SWAGGER_UI_PARAMETERS = {"validatorUrl": None}
"""Merged into FastAPI's defaults. No online validator: its badge would send the spec's URL to an outside host."""

_INLINE_SCRIPT = re.compile(r"<script>(.*?)</script>", re.DOTALL)
_CSP = (
    "default-src 'self'; script-src 'self'{hashes}; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
    "font-src 'self' data:; connect-src 'self'; worker-src 'self' blob:; object-src 'none'; "
    "frame-ancestors 'none'; form-action 'self'; base-uri 'none'"
)
"""Styles may be inline: both UIs inject theirs at run time. Scripts may not, but for the page's own (by hash)."""


def content_security_policy(html: str) -> str:
    """The docs pages' policy: ``html``'s inline scripts allowed by their sha256, nothing from another origin."""
    hashes = "".join(
        f" 'sha256-{base64.b64encode(hashlib.sha256(body.encode()).digest()).decode()}'"
        for body in _INLINE_SCRIPT.findall(html)
    )
    return _CSP.format(hashes=hashes)


def _secured(page: HTMLResponse) -> HTMLResponse:
    html = page.body.decode()
    headers = {
        "Content-Security-Policy": content_security_policy(html),
        "X-Frame-Options": "DENY",
        "Referrer-Policy": "same-origin",
        "X-Content-Type-Options": "nosniff",
    }
    return HTMLResponse(html, headers=headers)


def install(app: FastAPI, docs_url: str = "/docs", redoc_url: str = "/redoc") -> None:
    """Serve the assets and the two pages. ``app`` is made with ``docs_url=None, redoc_url=None`` (no CDN pages)."""
    app.mount(ASSETS_URL, StaticFiles(packages=[ASSETS_PACKAGE]), name="docs-assets")

    def urls(request: Request) -> tuple[str, str]:
        root = request.scope.get("root_path", "").rstrip("/")  # behind a proxy that strips a prefix
        return f"{root}{app.openapi_url}", f"{root}{ASSETS_URL}"

    @app.get(docs_url, include_in_schema=False)
    def swagger_ui(request: Request) -> HTMLResponse:
        openapi_url, assets = urls(request)
        return _secured(
            get_swagger_ui_html(
                openapi_url=openapi_url,
                title=f"{app.title} - Swagger UI",
                swagger_js_url=f"{assets}/{SWAGGER_JS}",
                swagger_css_url=f"{assets}/{SWAGGER_CSS}",
                swagger_favicon_url=f"{assets}/{FAVICON}",
                swagger_ui_parameters=SWAGGER_UI_PARAMETERS,
            )
        )

    @app.get(redoc_url, include_in_schema=False)
    def redoc(request: Request) -> HTMLResponse:
        openapi_url, assets = urls(request)
        return _secured(
            get_redoc_html(
                openapi_url=openapi_url,
                title=f"{app.title} - ReDoc",
                redoc_js_url=f"{assets}/{REDOC_JS}",
                redoc_favicon_url=f"{assets}/{FAVICON}",
                with_google_fonts=False,
            )
        )
