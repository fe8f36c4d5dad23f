"""What a person's tools (``chatq connect``, ``chatq doctor``) ask Telegram and Avito:
who the bot is and where its webhook points; an Avito token, and the account's webhook
subscriptions. The replies themselves go through the responder's adapters
(``services/responder/platforms``), not through here.

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

#: A 403 from a Messenger call made with a token Avito issued a moment ago cannot be an
#: expired token: the account is not allowed the Messenger API.
AVITO_NO_PLAN = "the account has no paid Messenger plan (Avito refuses the Messenger API without one)"
AVITO_NO_PLAN_FIX = (
    "put the Avito account on a paid plan that includes the Messenger API (Avito's API "
    "documentation, developers.avito.ru, lists which), then run `chatq doctor` again"
)


#: What each refusal of the whole Avito account means, and its fix (chatq doctor and
#: connect; the responder pauses the account for each with the same words).
AVITO_REFUSALS: dict[int, tuple[str, str]] = {
    401: (
        "the account refuses this application (the token is fresh)",
        "the Avito account's owner must grant the application access to the Messenger API again "
        "(https://www.avito.ru/professionals/api), or the client credentials belong to another account",
    ),
    402: (
        "payment required: the account's subscription does not include the Messenger API or has run out",
        "renew the Avito subscription that includes the Messenger API, then run `chatq doctor` again",
    ),
    403: (AVITO_NO_PLAN, AVITO_NO_PLAN_FIX),
}


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


def _json(response: httpx.Response) -> Any:
    try:
        return response.json()
    except ValueError:
        return None


class TelegramAdmin:
    """The Bot API calls behind connect and doctor."""

    def __init__(self, api_base: str, token: str, client: httpx.AsyncClient) -> None:
        self._base = f"{api_base.rstrip('/')}/bot{token}"
        self._client = client

    async def _call(self, method: str, params: dict[str, Any] | None = None) -> tuple[Any, str]:
        """The method's result and Telegram's description of it."""
        try:
            response = await self._client.post(f"{self._base}/{method}", json=params or {})
        except httpx.HTTPError as exc:
            raise PlatformError("Telegram", method, None, f"no answer ({type(exc).__name__})") from None
        body = _json(response)
        if not isinstance(body, dict) or not isinstance(body.get("ok"), bool):
            raise PlatformError("Telegram", method, response.status_code, "not a Bot API answer")
        if body["ok"] is not True:
            code = body.get("error_code")
            status = code if isinstance(code, int) else response.status_code
            raise PlatformError("Telegram", method, status, str(body.get("description", ""))[:300])
        return body.get("result"), str(body.get("description", ""))

    async def get_me(self) -> dict[str, Any]:
        result, _ = await self._call("getMe")
        return result if isinstance(result, dict) else {}

    async def webhook_info(self) -> dict[str, Any]:
        result, _ = await self._call("getWebhookInfo")
        return result if isinstance(result, dict) else {}

    async def set_webhook(self, url: str, secret_token: str, allowed_updates: list[str]) -> str:
        _, description = await self._call(
            "setWebhook", {"url": url, "secret_token": secret_token, "allowed_updates": allowed_updates}
        )
        return description

    async def delete_webhook(self) -> str:
        _, description = await self._call("deleteWebhook", {"drop_pending_updates": False})
        return description


class AvitoAdmin:
    """The Avito calls behind connect and doctor: a client-credentials token, then the
    Messenger webhook subscriptions."""

    def __init__(self, api_base: str, client_id: str, client_secret: str, client: httpx.AsyncClient) -> None:
        self._base = api_base.rstrip("/")
        self._form = {
            "grant_type": "client_credentials",
            "client_id": client_id,
            "client_secret": client_secret,
        }
        self._client = client
        self._token: str | None = None

    async def _request(self, call: str, path: str, *, method: str = "POST", **kwargs: Any) -> Any:
        try:
            response = await self._client.request(method, f"{self._base}{path}", **kwargs)
        except httpx.HTTPError as exc:
            raise PlatformError("Avito", call, None, f"no answer ({type(exc).__name__})") from None
        body = _json(response)
        if response.is_error:
            err = body.get("error", body) if isinstance(body, dict) else body
            if isinstance(err, dict):
                detail = err.get("message") or err.get("error_description") or err.get("error") or ""
            else:
                detail = err or response.reason_phrase
            raise PlatformError("Avito", call, response.status_code, str(detail)[:300])
        return body

    async def token(self) -> str:
        """A fresh access token (one per command: nothing here lives long enough to refresh)."""
        if self._token is None:
            body = await self._request("token", "/token", data=self._form)
            token = body.get("access_token") if isinstance(body, dict) else None
            if not isinstance(token, str) or not token:
                raise PlatformError("Avito", "token", 200, "the answer carries no access_token")
            self._token = token
        return self._token

    async def _messenger(self, call: str, path: str, body: dict[str, Any] | None = None) -> Any:
        headers = {"Authorization": f"Bearer {await self.token()}"}
        if body is None:
            return await self._request(call, path, headers=headers)
        return await self._request(call, path, headers=headers, json=body)

    async def account(self) -> dict[str, Any]:
        """The account these credentials belong to (``GET /core/v1/accounts/self``): its
        ``id`` is the user_id every Messenger path takes."""
        headers = {"Authorization": f"Bearer {await self.token()}"}
        body = await self._request("accounts/self", "/core/v1/accounts/self", method="GET", headers=headers)
        if not isinstance(body, dict) or not isinstance(body.get("id"), int):
            raise PlatformError("Avito", "accounts/self", 200, "the answer carries no account id")
        return body

    async def subscriptions(self) -> list[str]:
        body = await self._messenger("subscriptions", "/messenger/v1/subscriptions")
        items = body.get("subscriptions") if isinstance(body, dict) else None
        if not isinstance(items, list):
            raise PlatformError("Avito", "subscriptions", 200, "the answer carries no subscriptions list")
        return [str(s["url"]) for s in items if isinstance(s, dict) and "url" in s]

    async def subscribe(self, url: str) -> None:
        await self._messenger("subscribe", "/messenger/v3/webhook", {"url": url})

    async def unsubscribe(self, url: str) -> None:
        await self._messenger("unsubscribe", "/messenger/v1/webhook/unsubscribe", {"url": url})
