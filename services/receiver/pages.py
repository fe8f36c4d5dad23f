"""The pages a person opens in a browser (/ops, /sandbox) and their scripts and styles.

Scripts and styles are files of their own, never inline, so the Content-Security-Policy
allows this origin only: an injected ``<script>`` or ``onclick=`` does not run, no other
site can frame the page (the buttons retry and resolve operations), and the admin token
typed into /ops can only be sent back here."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import HTMLResponse, Response

from platforms.inbound import ApiError

STATIC = Path(__file__).with_name("static")

CONTENT_SECURITY_POLICY = "; ".join(
    [
        "default-src 'self'",
        "script-src 'self'",
        "style-src 'self'",
        "img-src 'self'",
        "connect-src 'self'",
        "object-src 'none'",
        "base-uri 'none'",
        "form-action 'self'",
        "frame-ancestors 'none'",
    ]
)
SECURITY_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}
# The files under /static/ and their media types; nothing else in the folder is served.
ASSETS = {
    "ops.css": "text/css",
    "ops.js": "text/javascript",
    "sandbox.css": "text/css",
    "sandbox.js": "text/javascript",
}

router = APIRouter()


def page(name: str) -> HTMLResponse:
    """One of the HTML pages, with the security headers."""
    return HTMLResponse((STATIC / name).read_text(encoding="utf-8"), headers=SECURITY_HEADERS)


@router.get("/ops", response_class=HTMLResponse, include_in_schema=False)
async def ops_page() -> HTMLResponse:
    return page("ops.html")


@router.get("/static/{name}", include_in_schema=False)
async def asset(name: str) -> Response:
    media_type = ASSETS.get(name)
    if media_type is None:
        raise ApiError(404, "not_found", f"no static file {name!r}")
    return Response((STATIC / name).read_bytes(), media_type=media_type, headers=SECURITY_HEADERS)
