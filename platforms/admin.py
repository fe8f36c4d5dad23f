"""What a person's tools (``chatq connect``, ``chatq doctor``, the accounts API) share when
they ask a platform about this deployment: where the receiver takes webhooks, how a URL is
printed safely, whether the public URL can take webhooks at all, and the error every such
call raises. Each platform's own calls are its ``admin`` module (``platforms.telegram.admin``,
``platforms.avito.admin``); the replies go through its ``adapter``.

Every call raises ``PlatformError`` with the platform's own words when it did not work;
nothing here retries: a person is waiting and reads the reason.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx

#: Where the receiver takes each platform's webhooks (services/receiver/app.py).
TELEGRAM_WEBHOOK_PATH = "/v1/webhooks/telegram"
AVITO_WEBHOOK_PATH = "/v1/webhooks/avito/"
#: Telegram calls webhooks only over HTTPS, and only on these ports.
TELEGRAM_WEBHOOK_PORTS = (443, 80, 88, 8443)


class PlatformError(Exception):
    """A platform call that did not work: ``status`` is the HTTP status (None: no answer)."""

    def __init__(self, platform: str, call: str, status: int | None, detail: str) -> None:
        self.platform, self.call, self.status, self.detail = platform, call, status, detail
        answer = f"HTTP {status}: {detail}" if status is not None else detail
        super().__init__(f"{platform} {call}: {answer}")


def masked_url(url: str) -> str:
    """A URL safe to print: no user info or query, the Avito path secret as ``***``, and
    the path of any other site's URL hidden (it may hold that site's secret)."""
    parts = urlsplit(url)
    netloc = parts.hostname or ""
    if parts.port:
        netloc += f":{parts.port}"
    path = parts.path
    if AVITO_WEBHOOK_PATH in path:
        path = path[: path.index(AVITO_WEBHOOK_PATH) + len(AVITO_WEBHOOK_PATH)] + "***"
    elif path.strip("/") and not (
        path.endswith(TELEGRAM_WEBHOOK_PATH) or path.rsplit("/", 1)[0].endswith(TELEGRAM_WEBHOOK_PATH)
    ):
        path = "/…"
    return urlunsplit((parts.scheme, netloc, path, "…" if parts.query else "", ""))


def public_url_problem(public_url: str | None, *, telegram: bool) -> str | None:
    """Why the platforms cannot call webhooks at ``public_url``, or None."""
    if not public_url:
        return (
            "CHATQ_PUBLIC_URL is not set: set it to the HTTPS address where the platforms reach "
            "this deployment's receiver, e.g. https://chat.example.com"
        )
    parts = urlsplit(public_url)
    if parts.scheme != "https":
        return (
            f"CHATQ_PUBLIC_URL is {masked_url(public_url)}: the platforms deliver webhooks over "
            "HTTPS only; put the receiver behind a TLS-terminating proxy and use its https:// address"
        )
    port = parts.port or 443
    if telegram and port not in TELEGRAM_WEBHOOK_PORTS:
        return (
            f"CHATQ_PUBLIC_URL uses port {port}: Telegram calls webhooks only on ports 443, 80, 88 "
            "and 8443; publish the receiver on one of them"
        )
    return None


def json_of(response: httpx.Response) -> Any:
    try:
        return response.json()
    except ValueError:
        return None
