"""The Bot API calls behind ``chatq connect telegram``, ``chatq doctor`` and the accounts
API's connect: who the bot is and where its webhook points. Every call raises
``platforms.admin.PlatformError`` with Telegram's own words; nothing here retries."""

from __future__ import annotations

from typing import Any

import httpx

from platforms.admin import PlatformError, json_of


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
        body = json_of(response)
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
