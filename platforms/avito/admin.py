"""The Avito calls behind ``chatq connect avito``, ``chatq doctor`` and the accounts API's
connect: a token, the account's id, its webhook subscriptions; and what each refusal of the
whole account means. Every call raises ``platforms.admin.PlatformError`` with Avito's own
words; nothing here retries."""

from __future__ import annotations

from typing import Any

import httpx

from platforms.admin import PlatformError, json_of

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
        body = json_of(response)
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
