"""Telegram Bot API: sendMessage. Telegram has no idempotency key and no way to list a
bot's sent messages, so a send whose answer was lost cannot be reconciled."""

from __future__ import annotations

import httpx

from ..failures import Failure, Kind, classify_status
from ..ratelimit import AccountRateLimiter
from .base import Sent, SentQuery, call, retry_after_of


class TelegramPlatform:
    name = "telegram"
    max_text = 4096
    idempotent = False
    can_reconcile = False

    def __init__(
        self, api_base: str, token: str, client: httpx.AsyncClient, limiter: AccountRateLimiter
    ) -> None:
        self._url = f"{api_base.rstrip('/')}/bot{token}/sendMessage"
        self._client = client
        self._limiter = limiter

    async def send(self, account_id: str, chat_id: str, text: str, *, key: str) -> Sent:
        response = await call(
            self._client,
            self._limiter,
            self.name,
            account_id,
            "POST",
            self._url,
            json={"chat_id": _chat(chat_id), "text": text},
        )
        try:
            body = response.json()
        except ValueError:
            body = {}
        if not isinstance(body, dict):
            body = {}
        if not response.is_success or not body.get("ok"):
            # Telegram may also answer 200 with {"ok": false, "error_code": N}.
            status = response.status_code if not response.is_success else _error_code(body)
            failure = classify_status(
                status, str(body.get("description", ""))[:200], retry_after_of(response), acts=True
            )
            raise failure or Failure(Kind.UNKNOWN, "Telegram answered without ok")
        try:
            return Sent(str(body["result"]["message_id"]))
        except (KeyError, TypeError):
            raise Failure(Kind.UNKNOWN, "Telegram answered ok without a message id") from None

    async def find_sent(self, query: SentQuery) -> Sent | None:
        raise NotImplementedError("Telegram cannot list a bot's sent messages")

    async def aclose(self) -> None:
        return None


def _chat(chat_id: str) -> int | str:
    return int(chat_id) if chat_id.lstrip("-").isdigit() else chat_id


def _error_code(body: dict[str, object]) -> int:
    code = body.get("error_code")
    return code if isinstance(code, int) else 500
