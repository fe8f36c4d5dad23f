"""In-repo fakes of the outside world, one HTTP server (``tests/fakes/platforms.py``
assembles it: ``telegram.py`` and ``avito.py`` are each platform's routes, this module the
world they share): the Telegram Bot API, Avito (token,
Messenger: send, list messages, chats, mark read, webhook subscriptions; buyers write with
``FakeWorld.avito_buyer_writes``), an OpenAI-compatible model,
a generic reply endpoint and an alert sink. They record what they receive and fail on
demand.

**They cannot lie.** Every Telegram and Avito request is checked against the platforms'
own reference documents (``tests/fakes/spec.py``, ``tests/fakes/reference``): the method or
path must exist, parameters and bodies must have the documented fields and types (text
up to 4096 characters for Telegram, 1000 for Avito). A request the documents do not
allow gets the platform's error answer and is recorded in ``FakeWorld.violations``; the
``world`` fixture fails the test that made it unless the test is marked
``spec_violations_expected``. Every answer the fakes give is checked against the
documents too (a fake answering a shape the platform never would is recorded the same
way). Errors have the platforms' shapes: Avito ``{"error": {"code", "message"}}``,
Telegram ``{"ok": false, "error_code", "description"}`` with Telegram's descriptions.

Accounts: a revoked Telegram token answers 401 "Unauthorized"
(``FakeWorld.revoke_telegram_token``); an Avito account without the paid Messenger plan
answers 403 to every Messenger call (``FakeWorld.avito_messenger_plan = False``); with
``FakeWorld.avito_accounts`` each Avito account takes only its own client's tokens, and
``FakeWorld.avito_callers`` records whose token each Messenger call used.

Failure behaviours, queued per target with ``FakeWorld.fail(target, *behaviours)`` and
used one per call: ``"500"``/``"503"``/``"400"``/``"403"`` (that status), ``"429:N"``
(rate limited, retry after N s), ``"lost"`` (do the action, then hold the answer past
the client's timeout: the outcome is unknown to the caller), ``"garbage"`` (Avito's token
endpoint: a 200 that is not JSON), ``"hang"`` (hold past the
timeout and do nothing: as unknown to the caller, but nothing happened), ``"late:N"``
(Avito send: hold past the timeout, and do the action N s after the request), ``"slow:N"``
(answer after N s), ``"ok"`` (this call goes through: queued before a failure of a later one),
``"quota"`` (LLM: 429 insufficient_quota).
Targets: telegram.send, telegram.webhook (setWebhook, deleteWebhook, getWebhookInfo),
avito.send, avito.list (a chat's messages), avito.chats (the chat list), avito.chat (one
chat), avito.read, avito.token, avito.webhook (subscribe, list, unsubscribe), generic.send, llm; ``telegram.send:<chat_id>`` fails only that chat's sends.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from collections import defaultdict, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi.responses import JSONResponse

LOST_SECONDS = 3.0  # longer than the platform timeout tests give the responder

#: Telegram's descriptions of the errors the fakes give.
TELEGRAM_ERRORS = {
    400: "Bad Request: chat not found",
    401: "Unauthorized",
    403: "Forbidden: bot was blocked by the user",
    404: "Not Found",
    409: "Conflict: terminated by other getUpdates request; make sure that only one bot instance is running",
    500: "Internal Server Error",
    502: "Bad Gateway",
    503: "Service Unavailable",
    504: "Gateway Timeout",
}
#: Avito's error messages (the examples of its documents' error schemas).
AVITO_ERRORS = {
    400: "Bad Request",
    401: "Unauthorized",
    402: "Payment required",
    403: "Forbidden",
    404: "Not found",
    429: "Too Many Requests",
    500: "Error while processing request. Please, contact support",
    502: "Bad Gateway",
    503: "Service temporarily unavailable. Please, contact support",
    504: "Gateway Timeout",
}
#: Telegram accepts webhooks only on these ports, and only over HTTPS.
TELEGRAM_WEBHOOK_PORTS = (443, 80, 88, 8443)


@dataclass(frozen=True)
class Violation:
    """A request the platform's documents do not allow, or an answer the fake gave that
    they do not describe."""

    platform: str
    call: str
    problems: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.platform} {self.call}: " + "; ".join(self.problems)


@dataclass(frozen=True)
class PlatformCall:
    """One Telegram or Avito request the fakes received: the documented method or
    operation it was (``None`` when the documents have no such thing), and whether the
    documents allow it."""

    platform: str
    name: str | None
    allowed: bool


@dataclass
class TelegramBot:
    """What Telegram keeps about one bot: who it is, and its webhook."""

    id: int
    webhook_url: str = ""
    secret_token: str | None = None
    allowed_updates: list[str] | None = None
    max_connections: int = 40
    pending_update_count: int = 0
    last_error_date: int | None = None
    last_error_message: str | None = None

    @property
    def user(self) -> dict[str, Any]:
        return {"id": self.id, "is_bot": True, "first_name": "Shop bot", "username": f"shop{self.id}_bot"}


@dataclass
class FakeWorld:
    faults: dict[str, deque[str]] = field(default_factory=lambda: defaultdict(deque))
    telegram: list[dict[str, Any]] = field(default_factory=list)
    avito: list[dict[str, Any]] = field(default_factory=list)
    generic: list[dict[str, Any]] = field(default_factory=list)
    generic_keys: dict[str, str] = field(default_factory=dict)
    #: The probes chatq sent a paused generic endpoint ({"probe": true}).
    generic_probes: list[dict[str, Any]] = field(default_factory=list)
    llm: list[dict[str, Any]] = field(default_factory=list)
    llm_in_flight: int = 0
    llm_max_in_flight: int = 0
    #: When set, the model answers this text (a long reply, say) instead of echoing.
    llm_answer: str | None = None
    llm_models: tuple[str, ...] = ("gpt-4o-mini",)
    alerts: list[dict[str, Any]] = field(default_factory=list)
    avito_tokens: set[str] = field(default_factory=set)
    avito_token_requests: int = 0
    #: The client id each access token was issued to.
    avito_token_clients: dict[str, str] = field(default_factory=dict)
    #: user_id -> the client id whose tokens may use that account's Messenger API (unset:
    #: any token may, as with one account); another client's token gets 403, as on Avito.
    avito_accounts: dict[str, str] = field(default_factory=dict)
    #: Every Messenger call with a valid token: (operationId, user_id in the path or None,
    #: the client id the token was issued to), in order: whose credentials read which account.
    avito_callers: list[tuple[str, str | None, str | None]] = field(default_factory=list)
    #: False: the Avito account has no paid Messenger plan; every Messenger call is 403.
    avito_messenger_plan: bool = True
    #: user_id -> the status every Messenger call of that account gets, whatever the
    #: token (401: the account refuses this application; 402: "payment required").
    avito_account_refusals: dict[str, int] = field(default_factory=dict)
    #: How the message list answers: a bare array (the document's ``Messages``), or the
    #: object public clients read from the live API, ``{"messages": [...], "meta": {...}}``
    #: (and then the chat list carries a ``meta`` too).
    avito_list_shape: str = "array"
    #: client id -> the user_id ``/core/v1/accounts/self`` names for its tokens (unset: the
    #: account ``avito_accounts`` gives the client, else 777).
    avito_self: dict[str, int] = field(default_factory=dict)
    #: Called with the echo webhook Avito delivers for every message the account sends
    #: (author_id = user_id), before the send is answered: a test posts it to the receiver,
    #: as Avito would (the echo can come before the send's own answer).
    avito_echo: Callable[[dict[str, Any]], Awaitable[None]] | None = None
    #: Every echo webhook made, in order (delivered or not).
    avito_echoes: list[dict[str, Any]] = field(default_factory=list)
    #: Telegram Business connections by id: ``is_enabled``, ``can_reply``, the owner's user id
    #: and private chat (``business_connection``); a send through one disabled or without
    #: ``can_reply`` is refused as Telegram refuses it.
    telegram_business: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: The Avito account's webhook subscriptions (URLs), in the order they were made.
    avito_subscriptions: list[str] = field(default_factory=list)
    #: (user_id, chat_id) -> the chat as Avito describes it (``add_avito_chat``), with two
    #: keys of the fake's own: ``unread`` and ``chat_type`` (u2i, u2u, a2u).
    avito_chats: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    #: Messages buyers wrote in Avito chats (``avito_buyer_writes``), oldest first.
    avito_inbox: list[dict[str, Any]] = field(default_factory=list)
    #: (user_id, chat_id) of every chat marked read, in order.
    avito_reads: list[tuple[str, str]] = field(default_factory=list)
    #: Telegram bots by token, made on first use.
    telegram_bots: dict[str, TelegramBot] = field(default_factory=dict)
    #: Tokens Telegram no longer accepts (revoked in @BotFather): every call is 401.
    telegram_revoked: set[str] = field(default_factory=set)
    #: When set, Avito's token endpoint takes only this client secret (else any).
    avito_client_secret: str | None = None
    #: Every Telegram and Avito request, and what the documents say of it.
    platform_calls: list[PlatformCall] = field(default_factory=list)
    #: Requests the documents do not allow, and answers they do not describe.
    violations: list[Violation] = field(default_factory=list)
    #: Actions scheduled to happen later ("late:N") that have not happened yet.
    pending_actions: int = 0
    background: set[asyncio.Task[None]] = field(default_factory=set)
    ids: itertools.count = field(default_factory=lambda: itertools.count(1))
    url: str = ""
    #: Random failures once the queues are empty: target -> [(behaviour, probability)].
    random_faults: dict[str, list[tuple[str, float]]] = field(default_factory=dict)
    rng: random.Random = field(default_factory=lambda: random.Random(7))

    def fail(self, target: str, *behaviours: str) -> None:
        self.faults[target].extend(behaviours)

    def take(self, target: str, chat: str | None = None) -> str | None:
        """The next behaviour for this call: one queued for this chat
        (``"telegram.send:42"``) first, else one queued for the target."""
        for key in ((f"{target}:{chat}",) if chat is not None else ()) + (target,):
            queue = self.faults.get(key)
            if queue:
                return queue.popleft()
        roll = self.rng.random()
        for behaviour, p in self.random_faults.get(target, ()):
            if roll < p:
                return behaviour
            roll -= p
        return None

    def expire_avito_tokens(self) -> None:
        self.avito_tokens.clear()

    def telegram_bot(self, token: str) -> TelegramBot:
        if token not in self.telegram_bots:
            prefix = token.split(":", 1)[0]
            self.telegram_bots[token] = TelegramBot(int(prefix) if prefix.isdigit() else 1)
        return self.telegram_bots[token]

    def revoke_telegram_token(self, token: str) -> None:
        self.telegram_revoked.add(token)

    def telegram_delivery_failed(self, token: str, message: str, *, at: float | None = None) -> None:
        """Telegram could not deliver an update to the bot's webhook (as getWebhookInfo
        then reports it)."""
        bot = self.telegram_bot(token)
        bot.last_error_date = int(at if at is not None else time.time())
        bot.last_error_message = message
        bot.pending_update_count += 1

    def add_avito_chat(
        self,
        user_id: str,
        chat_id: str,
        *,
        title: str = "Bicycle",
        price: str = "12 000 ₽",
        unread: bool = True,
        chat_type: str = "u2i",
        updated: int | None = None,
        owner: str | int | None = None,
    ) -> None:
        now = int(time.time()) if updated is None else updated
        self.avito_chats[(str(user_id), chat_id)] = {
            "id": chat_id,
            "created": now,
            "updated": now,
            "context": {
                "type": "item",
                "value": {
                    "id": 42,
                    # The listing's author: the account's own listing unless a test says.
                    "user_id": int(user_id if owner is None else owner),
                    "title": title,
                    "price_string": price,
                    "url": f"https://www.avito.ru/moskva/velosipedy/{chat_id}",
                },
            },
            "users": [{"id": int(user_id), "name": "Seller"}, {"id": 555, "name": "Buyer"}],
            "unread": unread,
            "chat_type": chat_type,
        }

    def avito_buyer_writes(
        self,
        user_id: str | int,
        chat_id: str,
        text: str | None = "Is it still available?",
        *,
        author_id: int = 555,
        kind: str = "text",
        message_id: str | None = None,
        content: dict[str, Any] | None = None,
        created: int | None = None,
    ) -> dict[str, Any]:
        """A buyer writes in an Avito chat (made when new): the message is in the chat's
        list, the chat unread; returns the webhook Avito would deliver for it (a test
        posts it, late, or never). ``content``: the message's content as Avito gives it
        for its ``kind`` (``avito_content``); by default ``{"text": text}``. ``author_id``
        the account's own user id: a message the account wrote (its owner, an autoresponder,
        Avito on its behalf)."""
        user_id = str(user_id)
        now = int(time.time()) if created is None else created
        chat = self.avito_chats.get((user_id, chat_id))
        if chat is None:
            self.add_avito_chat(user_id, chat_id, updated=now)
            chat = self.avito_chats[(user_id, chat_id)]
        seq = next(self.ids)
        if content is None:
            content = {"text": text} if text is not None else {}
        message = {
            "id": message_id or f"in-{seq}",
            "seq": seq,
            "user_id": user_id,
            "chat_id": chat_id,
            "author_id": author_id,
            "type": kind,
            "content": content,
            "created": now,
        }
        self.avito_inbox.append(message)
        chat["unread"], chat["updated"] = True, max(chat["updated"], now)
        return {
            "id": f"evt-{message['id']}",
            "version": "v3.0.0",
            "timestamp": now,
            "payload": {
                "type": "message",
                "value": {
                    "id": message["id"],
                    "chat_id": chat_id,
                    "user_id": int(user_id),
                    "author_id": author_id,
                    "created": now,
                    "type": kind,
                    "chat_type": chat["chat_type"],
                    "content": content,
                    "item_id": chat["context"]["value"]["id"],
                    "published_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now)),
                },
            },
        }

    def avito_self_id(self, client_id: str | None) -> int:
        """The user_id ``/core/v1/accounts/self`` names for a token of this client."""
        if client_id in self.avito_self:
            return self.avito_self[client_id]
        owned = [int(u) for u, c in self.avito_accounts.items() if c == client_id]
        return owned[0] if owned else 777

    def business_connection(
        self,
        connection_id: str,
        *,
        owner: int = 9009,
        enabled: bool = True,
        can_reply: bool = True,
        date: int | None = None,
    ) -> dict[str, Any]:
        """A Telegram Business account connects (or changes) this bot: the connection as
        Telegram keeps it; returns the BusinessConnection a ``business_connection`` update
        carries."""
        connection = {
            "id": connection_id,
            "user": {"id": owner, "is_bot": False, "first_name": "Shop owner"},
            "user_chat_id": owner,
            "date": int(time.time()) if date is None else date,
            "rights": {"can_reply": can_reply, "can_read_messages": True},
            "is_enabled": enabled,
        }
        self.telegram_business[connection_id] = connection
        return connection

    def replies_to(self, chat_id: str) -> list[str]:
        """Every reply any platform received for this chat, in order."""
        out = [m["text"] for m in self.telegram if str(m["chat_id"]) == chat_id]
        out += [m["text"] for m in self.avito if m["chat_id"] == chat_id]
        out += [m["text"] for m in self.generic if m["chat_id"] == chat_id]
        return out

    def violated(self, platform: str, call: str, problems: list[str]) -> None:
        self.violations.append(Violation(platform, call, tuple(problems)))


def telegram_error(status: int, description: str | None = None, **extra: Any) -> JSONResponse:
    described = description or TELEGRAM_ERRORS.get(status, f"Error {status}")
    body = {"ok": False, "error_code": status, "description": described, **extra}
    return JSONResponse(body, status_code=status)


def avito_error(status: int, message: str | None = None, **extra: Any) -> JSONResponse:
    return JSONResponse(
        {
            "error": {
                "code": status,
                "message": message or AVITO_ERRORS.get(status, f"Error {status}"),
                **extra,
            }
        },
        status_code=status,
    )


async def before(
    world: FakeWorld, target: str, chat: str | None = None
) -> tuple[str | None, JSONResponse | None]:
    """Apply a queued behaviour. Returns (behaviour, response to send instead)."""
    b = world.take(target, chat)
    if b == "ok":  # queued to let this call through, and fail a later one
        return None, None
    if b is None or b in ("lost", "garbage") or b.startswith("late:"):
        return b, None
    if b == "hang":
        # Hold the request past the client's timeout and do nothing: the caller cannot
        # tell this from "lost", but nothing happened.
        await asyncio.sleep(LOST_SECONDS)
        b = "504"
    if b.startswith("slow:"):
        await asyncio.sleep(float(b.split(":", 1)[1]))
        return b, None
    avito = target.startswith("avito.")
    if b.startswith("429"):
        after = int(b.split(":", 1)[1]) if ":" in b else 1
        headers = {"retry-after": str(after)}
        if avito:
            response = avito_error(429)
        else:
            response = telegram_error(
                429, f"Too Many Requests: retry after {after}", parameters={"retry_after": after}
            )
        response.headers.update(headers)
        return b, response
    if b == "quota":
        body = {"error": {"message": "quota", "type": "insufficient_quota", "code": "insufficient_quota"}}
        return b, JSONResponse(body, status_code=429)
    status = int(b)
    return b, avito_error(status) if avito else telegram_error(status)
