"""Telegram Bot API: sendMessage, and getMe to probe the bot. Telegram has no idempotency
key and no way to list a bot's sent messages, so a send whose answer was lost cannot be
reconciled. A 401 (revoked or mistyped token) or 404 (no such bot) is about the bot, not
the chat: the account is paused until getMe works again; a 403 ("bot was blocked by the
user") is about the chat, and that job fails alone."""

from __future__ import annotations

from platforms.base import HttpClient, Sent, SentQuery, call, retry_after_of
from platforms.failures import Failure, Kind, classify_status
from platforms.ratelimit import AccountRateLimiter


class TelegramPlatform:
    name = "telegram"
    max_text = 4096
    idempotent = False
    can_reconcile = False

    def __init__(self, api_base: str, token: str, client: HttpClient, limiter: AccountRateLimiter) -> None:
        self._base = f"{api_base.rstrip('/')}/bot{token}"
        self._url = f"{self._base}/sendMessage"
        self._client = client
        self._limiter = limiter

    async def send(
        self, account_id: str, chat_id: str, text: str, *, key: str, business_connection_id: str | None = None
    ) -> Sent:
        chat, thread = telegram_chat(chat_id)
        params: dict[str, object] = {"chat_id": chat, "text": text}
        if thread is not None:
            # A topic's message is answered in that topic.
            params["message_thread_id"] = thread
        if business_connection_id is not None:
            # Telegram Business: sent as the business account, in its chat with the customer.
            params["business_connection_id"] = business_connection_id
        response = await call(
            self._client, self._limiter, self.name, account_id, "POST", self._url, json=params
        )
        try:
            body = response.json()
        except ValueError:
            body = None
        if not isinstance(body, dict) or not isinstance(body.get("ok"), bool):
            if response.is_success:
                # Telegram took the request and answered something we cannot read: it may
                # have sent the message, and it has no key to send it again safely.
                raise Failure(
                    Kind.UNKNOWN, f"Telegram answered HTTP {response.status_code} with a body we cannot read"
                )
            body = {}
        if body.get("ok") is True:
            try:
                return Sent(str(body["result"]["message_id"]))
            except (KeyError, TypeError):
                raise Failure(Kind.UNKNOWN, "Telegram answered ok without a message id") from None
        # Telegram may also answer 200 with {"ok": false, "error_code": N}.
        status = _error_code(body) if response.is_success else response.status_code
        detail = str(body.get("description", ""))[:200]
        if status in (401, 404):
            raise Failure(Kind.ACCOUNT, _refused_token(status, detail))
        if business_connection_id is not None and status in (400, 403) and refuses_connection(detail):
            # The business account turned the bot off, or does not let it reply: its chats
            # wait for the connection, nothing about this reply is wrong.
            raise Failure(
                Kind.CONNECTION,
                f"Telegram refused Telegram Business connection {business_connection_id} (HTTP {status}: {detail}): "
                "the business account turned the bot off or does not let it reply "
                "(in Telegram: Settings > Telegram Business > Chatbots)",
            )
        if status >= 500:
            # No idempotency key and no way to list the bot's messages: a server error after
            # the request reached Telegram may come after the message was sent. Retry only
            # what never left and 429s (docs/platforms.md); this goes to a person.
            raise Failure(
                Kind.UNKNOWN, f"Telegram answered HTTP {status}; the message may have been sent ({detail})"
            )
        failure = classify_status(status, detail, retry_after_of(response), acts=True)
        raise failure or Failure(Kind.UNKNOWN, "Telegram answered without ok")

    async def probe(self, account_id: str) -> None:
        """getMe: whether Telegram accepts the bot token."""
        response = await call(
            self._client, self._limiter, self.name, account_id, "POST", f"{self._base}/getMe"
        )
        if response.status_code in (401, 404):
            raise Failure(Kind.ACCOUNT, _refused_token(response.status_code, "getMe"))
        try:
            ok = response.json().get("ok") is True
        except (ValueError, AttributeError):
            ok = False
        if not ok:
            raise Failure(Kind.TRANSIENT, f"Telegram's getMe answered HTTP {response.status_code}")

    async def business_connection(self, account_id: str, connection_id: str) -> tuple[bool, bool]:
        """getBusinessConnection: whether the connection is enabled and lets the bot reply.
        Raises ``Failure`` (kind connection) when Telegram no longer knows it."""
        response = await call(
            self._client,
            self._limiter,
            self.name,
            account_id,
            "POST",
            f"{self._base}/getBusinessConnection",
            json={"business_connection_id": connection_id},
        )
        try:
            body = response.json()
        except ValueError:
            body = None
        if (
            not isinstance(body, dict)
            or body.get("ok") is not True
            or not isinstance(body.get("result"), dict)
        ):
            detail = str(body.get("description", "")) if isinstance(body, dict) else ""
            kind = Kind.CONNECTION if response.status_code in (400, 403) else Kind.TRANSIENT
            raise Failure(
                kind,
                f"Telegram's getBusinessConnection answered HTTP {response.status_code} {detail}".strip(),
            )
        result = body["result"]
        rights = result.get("rights") if isinstance(result.get("rights"), dict) else {}
        return bool(result.get("is_enabled")), bool(rights.get("can_reply"))

    async def find_sent(self, query: SentQuery) -> Sent | None:
        raise NotImplementedError("Telegram cannot list a bot's sent messages")

    async def aclose(self) -> None:
        return None


def telegram_chat(chat_id: str) -> tuple[int | str, int | None]:
    """Telegram's chat id and topic for ours: a business chat's (``<chat id>@<connection>``,
    kept apart from the bot's own chat with the same person) is the part before the ``@``;
    a topic's (``<chat id>#<thread id>``) names the thread after the ``#``."""
    base = chat_id.partition("@")[0] or chat_id
    chat, _, thread = base.partition("#")
    topic = int(thread) if thread.isdigit() else None
    return (int(chat) if chat.lstrip("-").isdigit() else chat), topic


def refuses_connection(description: str) -> bool:
    """Whether Telegram's description of a refused send names the business connection as a
    whole (BUSINESS_CONNECTION_INVALID, BUSINESS_CONNECTION_NOT_ALLOWED, "business connection
    not found"), not one customer (BUSINESS_PEER_INVALID is about the chat)."""
    lowered = description.lower()
    return "business_connection" in lowered or "business connection" in lowered


def _error_code(body: dict[str, object]) -> int:
    code = body.get("error_code")
    return code if isinstance(code, int) else 500


def _refused_token(status: int, detail: str) -> str:
    return (
        f"Telegram refused the bot token (HTTP {status}: {detail or 'Unauthorized'}): it was revoked or mistyped; "
        "get the current one from @BotFather (/mybots, API Token), set CHATQ_TELEGRAM_BOT_TOKEN and restart"
    )
