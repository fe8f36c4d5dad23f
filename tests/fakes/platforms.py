"""In-repo fakes of the outside world, one HTTP server: the Telegram Bot API, Avito (token,
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
import contextlib
import itertools
import json
import logging
import random
import time
from collections import defaultdict, deque
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, urlsplit

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from shared.ops_http import OpsServer
from tests.fakes.spec import AvitoCheck, avito_spec, telegram_form_value, telegram_spec
from tests.support.processes import free_port

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


async def _before(
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


# --------------------------------------------------------------------------------------
# Telegram

#: A Bot API method: (world, token, parameters, the fault behaviour drawn for this call).
TelegramHandler = Callable[[FakeWorld, str, dict[str, Any], str | None], Awaitable[JSONResponse]]


def _ok(result: Any, description: str | None = None) -> JSONResponse:
    body: dict[str, Any] = {"ok": True, "result": result}
    if description:
        body["description"] = description
    return JSONResponse(body)


#: Telegram's refusals of a send through a business connection it will not use: turned
#: off by the business account, or without the right to reply.
BUSINESS_DISABLED = "Bad Request: BUSINESS_CONNECTION_INVALID"
BUSINESS_NO_REPLY = "Forbidden: BUSINESS_CONNECTION_NOT_ALLOWED"


async def _telegram_send(world: FakeWorld, token: str, params: dict[str, Any], b: str | None) -> JSONResponse:
    connection = params.get("business_connection_id")
    known = world.telegram_business.get(connection) if connection is not None else None
    if known is not None and not known["is_enabled"]:
        return telegram_error(400, BUSINESS_DISABLED)
    if known is not None and not known["rights"].get("can_reply"):
        return telegram_error(403, BUSINESS_NO_REPLY)
    message_id = next(world.ids)
    sent = {
        "chat_id": params["chat_id"],
        "text": params["text"],
        "message_id": message_id,
        "bot": world.telegram_bot(token).user["id"],
    }
    if connection is not None:
        sent["business_connection_id"] = connection
    thread = params.get("message_thread_id")
    if thread is not None:
        sent["message_thread_id"] = thread
    world.telegram.append(sent)
    if b == "lost":
        await asyncio.sleep(LOST_SECONDS)
    chat = params["chat_id"]
    if isinstance(chat, str) and chat.lstrip("-").isdigit():
        chat = int(chat)  # a chat's id given as text ("-100..."): the chat is that number's
    message = {
        "message_id": message_id,
        "from": world.telegram_bot(token).user,
        "chat": {"id": chat, "type": "private" if isinstance(chat, int) and chat > 0 else "supergroup"},
        "date": int(time.time()),
        "text": params["text"],
    }
    if connection is not None:
        # Sent as the business account, in its chat with the customer, by this bot.
        message |= {
            "business_connection_id": connection,
            "sender_business_bot": world.telegram_bot(token).user,
        }
    if thread is not None:
        message |= {"message_thread_id": thread, "is_topic_message": True}
    return _ok(message)


async def _telegram_business_connection(
    world: FakeWorld, token: str, params: dict[str, Any], b: str | None
) -> JSONResponse:
    known = world.telegram_business.get(params["business_connection_id"])
    if known is None:
        return telegram_error(400, "Bad Request: business connection not found")
    return _ok(known)


async def _telegram_get_me(
    world: FakeWorld, token: str, params: dict[str, Any], b: str | None
) -> JSONResponse:
    return _ok({**world.telegram_bot(token).user, "can_join_groups": True, "supports_inline_queries": False})


def _webhook_refusal(url: str) -> str | None:
    """Telegram's answer to a webhook URL it will not call."""
    parts = urlsplit(url)
    if parts.scheme != "https" or not parts.hostname:
        return "Bad Request: bad webhook: An HTTPS URL must be provided for webhook"
    try:
        port = parts.port or 443
    except ValueError:
        return "Bad Request: bad webhook: Failed to resolve host: Name or service not known"
    if port not in TELEGRAM_WEBHOOK_PORTS:
        return "Bad Request: bad webhook: Webhook can be set up only on ports 80, 88, 443 or 8443"
    return None


async def _telegram_set_webhook(
    world: FakeWorld, token: str, params: dict[str, Any], b: str | None
) -> JSONResponse:
    bot = world.telegram_bot(token)
    url = params["url"]
    if url == "":
        return await _telegram_delete_webhook(world, token, params, b)
    refusal = _webhook_refusal(url)
    if refusal:
        return telegram_error(400, refusal)
    wanted = (
        url,
        params.get("secret_token"),
        params.get("allowed_updates", bot.allowed_updates),
        params.get("max_connections", 40),
    )
    if wanted == (bot.webhook_url, bot.secret_token, bot.allowed_updates, bot.max_connections):
        return _ok(True, "Webhook is already set")
    if url != bot.webhook_url:
        bot.last_error_date = bot.last_error_message = None
    bot.webhook_url, bot.secret_token, bot.allowed_updates, bot.max_connections = wanted
    if params.get("drop_pending_updates"):
        bot.pending_update_count = 0
    return _ok(True, "Webhook was set")


async def _telegram_delete_webhook(
    world: FakeWorld, token: str, params: dict[str, Any], b: str | None
) -> JSONResponse:
    bot = world.telegram_bot(token)
    if params.get("drop_pending_updates"):
        bot.pending_update_count = 0
    if not bot.webhook_url:
        return _ok(True, "Webhook is already deleted")
    bot.webhook_url, bot.secret_token = "", None
    bot.last_error_date = bot.last_error_message = None
    return _ok(True, "Webhook was deleted")


async def _telegram_webhook_info(
    world: FakeWorld, token: str, params: dict[str, Any], b: str | None
) -> JSONResponse:
    bot = world.telegram_bot(token)
    info: dict[str, Any] = {
        "url": bot.webhook_url,
        "has_custom_certificate": False,
        "pending_update_count": bot.pending_update_count,
    }
    if bot.webhook_url:
        info["ip_address"] = "203.0.113.10"
        info["max_connections"] = bot.max_connections
    if bot.allowed_updates is not None:
        info["allowed_updates"] = bot.allowed_updates
    if bot.last_error_date is not None:
        info["last_error_date"] = bot.last_error_date
        info["last_error_message"] = bot.last_error_message or ""
    return _ok(info)


#: What the fake implements: method -> (fault target, handler).
TELEGRAM_METHODS: dict[str, tuple[str | None, TelegramHandler]] = {
    "sendMessage": ("telegram.send", _telegram_send),
    "getMe": (None, _telegram_get_me),
    "getBusinessConnection": ("telegram.business", _telegram_business_connection),
    "setWebhook": ("telegram.webhook", _telegram_set_webhook),
    "deleteWebhook": ("telegram.webhook", _telegram_delete_webhook),
    "getWebhookInfo": ("telegram.webhook", _telegram_webhook_info),
}


async def _telegram_params(
    request: Request, types: Mapping[str, list[str]]
) -> tuple[dict[str, Any], str | None]:
    """A call's parameters, from the query string and the body, as the Bot API reads
    them (JSON, or form values read by each field's type, as are JSON strings)."""
    params: dict[str, Any] = {
        k: telegram_form_value(v, types.get(k, ["String"])) for k, v in request.query_params.items()
    }
    body = await request.body()
    if not body:
        return params, None
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype == "application/json":
        try:
            data = json.loads(body)
        except ValueError:
            return params, "Bad Request: can't parse JSON object"
        if not isinstance(data, dict):
            return params, "Bad Request: can't parse JSON object"
        # A JSON string where a number or a boolean is documented is read from its text, as
        # from a form: clients that send every value as a string (telebot, which
        # Alertmanager's telegram_configs uses) work against the real Bot API.
        data = {
            k: telegram_form_value(v, types.get(k, ["String"])) if isinstance(v, str) else v
            for k, v in data.items()
        }
        return {**params, **data}, None
    if ctype == "application/x-www-form-urlencoded":
        form = parse_qs(body.decode("utf-8", "replace"), keep_blank_values=True)
        return {
            **params,
            **{k: telegram_form_value(v[-1], types.get(k, ["String"])) for k, v in form.items()},
        }, None
    return params, f"Bad Request: the fake does not read {ctype or 'untyped'} bodies"


def _telegram_refusal(method: str, params: Mapping[str, Any], problems: list[str]) -> str:
    """Telegram's description for a call the Bot API does not allow: its own words where
    the fakes know them, else "Bad Request: " and what is wrong."""
    text = params.get("text")
    if method == "sendMessage" and "chat_id" not in params:
        return "Bad Request: chat_id is empty"
    if method == "sendMessage" and (not isinstance(text, str) or not text):
        return "Bad Request: message text is empty"
    if method == "sendMessage" and isinstance(text, str) and len(text) > 4096:
        return "Bad Request: message is too long"
    return "Bad Request: " + problems[0]


def _telegram_routes(app: FastAPI, world: FakeWorld) -> None:
    spec = telegram_spec()

    @app.api_route("/bot{token}/{method}", methods=["GET", "POST"])
    async def telegram(token: str, method: str, request: Request) -> Response:
        name = spec.method(method)
        if name is None:
            params: dict[str, Any] = {}
            unreadable, problems = None, [f"no method {method!r} in Bot API {spec.version}"]
        else:
            params, unreadable = await _telegram_params(request, spec.field_types(name))
            problems = [unreadable] if unreadable else spec.check_call(name, params)
        world.platform_calls.append(PlatformCall("telegram", name, not problems))
        if problems:
            world.violated("telegram", name or method, problems)
        # Telegram checks the token first, then the method, then the parameters.
        if token in world.telegram_revoked:
            return telegram_error(401)
        if name is None:
            return telegram_error(404)
        if problems:
            return telegram_error(400, unreadable or _telegram_refusal(name, params, problems))
        implemented = TELEGRAM_METHODS.get(name)
        if implemented is None:
            world.violated("telegram", name, [f"the fake does not implement {name}"])
            return telegram_error(500)
        target, handler = implemented
        b, early = await _before(world, target, str(params.get("chat_id"))) if target else (None, None)
        response = early or await handler(world, token, params, b)
        answer_problems = spec.check_answer(name, json.loads(bytes(response.body)))
        if answer_problems:
            world.violated("telegram", f"answer to {name}", answer_problems)
        return response


# --------------------------------------------------------------------------------------
# Avito

#: An Avito operation: (world, the checked request, the fault behaviour drawn for this call).
AvitoHandler = Callable[[FakeWorld, AvitoCheck, str | None], Awaitable[JSONResponse]]


async def _avito_token(world: FakeWorld, check: AvitoCheck, b: str | None) -> Response:
    body = check.body if isinstance(check.body, dict) else {}
    if world.avito_client_secret is not None and body.get("client_secret") != world.avito_client_secret:
        # Wrong client credentials, in Avito's error shape.
        return avito_error(400, "invalid client credentials")
    if b == "garbage":
        return Response("<html>Service Temporarily Unavailable</html>", media_type="text/html")
    world.avito_token_requests += 1
    token = f"tok-{world.avito_token_requests}"
    world.avito_tokens.add(token)
    world.avito_token_clients[token] = str(body.get("client_id"))
    return JSONResponse({"access_token": token, "expires_in": 86400, "token_type": "Bearer"})


async def _avito_send(world: FakeWorld, check: AvitoCheck, b: str | None) -> JSONResponse:
    user_id, chat_id = str(check.path_params["user_id"]), str(check.path_params["chat_id"])
    text = check.body["message"]["text"]

    def create() -> dict[str, Any]:
        message = {
            "id": f"av-{next(world.ids)}",
            "user_id": user_id,
            "chat_id": chat_id,
            "text": text,
            "created": int(time.time()),
        }
        world.avito.append(message)
        return message

    if b is not None and b.startswith("late:"):
        # The send lands N s after the request, while the caller has long timed out.
        async def land() -> None:
            await asyncio.sleep(float(b.split(":", 1)[1]))
            await _avito_echo(world, create())
            world.pending_actions -= 1

        world.pending_actions += 1
        world.background.add(task := asyncio.get_running_loop().create_task(land()))
        task.add_done_callback(world.background.discard)
        await asyncio.sleep(LOST_SECONDS)
        return avito_error(504)
    message = create()
    await _avito_echo(world, message)
    if b == "lost":
        await asyncio.sleep(LOST_SECONDS)
    return JSONResponse(
        {
            "id": message["id"],
            "created": message["created"],
            "direction": "out",
            "type": "text",
            "content": {"text": message["text"]},
        }
    )


async def _avito_echo(world: FakeWorld, message: dict[str, Any]) -> None:
    """The webhook Avito delivers for a message the account sent (author_id = user_id)."""
    echo = {
        "id": f"evt-{message['id']}",
        "version": "v3.0.0",
        "timestamp": message["created"],
        "payload": {
            "type": "message",
            "value": {
                "id": message["id"],
                "chat_id": message["chat_id"],
                "user_id": int(message["user_id"]),
                "author_id": int(message["user_id"]),
                "created": message["created"],
                "type": "text",
                "chat_type": "u2i",
                "content": {"text": message["text"]},
                "published_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(message["created"])),
            },
        },
    }
    world.avito_echoes.append(echo)
    if world.avito_echo is not None:
        await world.avito_echo(echo)


def _avito_messages(world: FakeWorld, user_id: str, chat_id: str) -> list[dict[str, Any]]:
    """The chat's messages as Avito lists them (``Messages``), newest first: the buyers'
    (in) and the account's (out)."""
    chat = world.avito_chats.get((user_id, chat_id))
    unread = bool(chat and chat["unread"])
    listed = [
        (
            int(m["id"].removeprefix("av-")) if m["id"].startswith("av-") else 0,
            {
                "id": m["id"],
                "author_id": int(user_id),
                "created": m["created"],
                "direction": "out",
                "type": "text",
                "content": {"text": m["text"]},
                "is_read": True,
            },
        )
        for m in world.avito
        if m["chat_id"] == chat_id and m["user_id"] == user_id
    ]
    listed += [
        (
            m["seq"],
            {
                "id": m["id"],
                "author_id": m["author_id"],
                "created": m["created"],
                "direction": "out" if str(m["author_id"]) == user_id else "in",
                "type": m["type"],
                "content": m["content"],
                "is_read": not unread,
            },
        )
        for m in world.avito_inbox
        if m["chat_id"] == chat_id and m["user_id"] == user_id
    ]
    listed.sort(key=lambda pair: (pair[1]["created"], pair[0]), reverse=True)
    return [item for _, item in listed]


async def _avito_list(world: FakeWorld, check: AvitoCheck, b: str | None) -> JSONResponse:
    user_id, chat_id = str(check.path_params["user_id"]), str(check.path_params["chat_id"])
    offset, limit = check.query.get("offset", 0), check.query.get("limit", 100)
    # Newest first, one page: a bare array (Avito's ``Messages`` schema), or the object
    # public clients read from the live API (avito-observed-openapi.json).
    listed = _avito_messages(world, user_id, chat_id)
    page = listed[offset : offset + limit]
    if world.avito_list_shape == "object":
        return JSONResponse({"messages": page, "meta": {"has_more": offset + limit < len(listed)}})
    return JSONResponse(page)


def _chat(world: FakeWorld, user_id: str, chat: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in chat.items() if k not in ("unread", "chat_type")}
    messages = _avito_messages(world, user_id, chat["id"])
    if messages:
        out["last_message"] = {k: v for k, v in messages[0].items() if k != "is_read"}
    return out


async def _avito_chats(world: FakeWorld, check: AvitoCheck, b: str | None) -> JSONResponse:
    user_id = str(check.path_params["user_id"])
    # Avito's default is chats about listings only (chat_types: u2i).
    types = check.query.get("chat_types", ["u2i"])
    chats = [
        c
        for (owner, _), c in world.avito_chats.items()
        if owner == user_id
        and c["chat_type"] in types
        and (c["unread"] or not check.query.get("unread_only", False))
    ]
    chats.sort(key=lambda c: c["updated"], reverse=True)
    offset, limit = check.query.get("offset", 0), check.query.get("limit", 100)
    body: dict[str, Any] = {"chats": [_chat(world, user_id, c) for c in chats[offset : offset + limit]]}
    if world.avito_list_shape == "object":
        body["meta"] = {"has_more": offset + limit < len(chats)}
    return JSONResponse(body)


async def _avito_chat(world: FakeWorld, check: AvitoCheck, b: str | None) -> JSONResponse:
    user_id, chat_id = str(check.path_params["user_id"]), str(check.path_params["chat_id"])
    chat = world.avito_chats.get((user_id, chat_id))
    if chat is None:
        return avito_error(404)
    return JSONResponse(_chat(world, user_id, chat))


async def _avito_read(world: FakeWorld, check: AvitoCheck, b: str | None) -> JSONResponse:
    user_id, chat_id = str(check.path_params["user_id"]), str(check.path_params["chat_id"])
    world.avito_reads.append((user_id, chat_id))
    chat = world.avito_chats.get((user_id, chat_id))
    if chat is not None:
        chat["unread"] = False
    return JSONResponse({"ok": True})


async def _avito_subscribe(world: FakeWorld, check: AvitoCheck, b: str | None) -> JSONResponse:
    url = check.body["url"]
    if url not in world.avito_subscriptions:
        world.avito_subscriptions.append(url)
    return JSONResponse({"ok": True})


async def _avito_subscriptions(world: FakeWorld, check: AvitoCheck, b: str | None) -> JSONResponse:
    return JSONResponse({"subscriptions": [{"url": u, "version": "3"} for u in world.avito_subscriptions]})


async def _avito_unsubscribe(world: FakeWorld, check: AvitoCheck, b: str | None) -> JSONResponse:
    with contextlib.suppress(ValueError):
        world.avito_subscriptions.remove(check.body["url"])
    return JSONResponse({"ok": True})


async def _avito_self(world: FakeWorld, check: AvitoCheck, b: str | None) -> JSONResponse:
    user_id = world.avito_self_id(check.client_id)
    return JSONResponse(
        {
            "id": user_id,
            "name": f"Shop {user_id}",
            "profile_url": f"https://www.avito.ru/user/{user_id}/profile",
        }
    )


#: What the fake implements: operationId -> (fault target, handler).
AVITO_OPERATIONS: dict[str, tuple[str | None, AvitoHandler]] = {
    "getUserInfoSelf": ("avito.self", _avito_self),
    "getAccessToken": ("avito.token", _avito_token),
    "postSendMessage": ("avito.send", _avito_send),
    "getMessagesV3": ("avito.list", _avito_list),
    "getChatsV2": ("avito.chats", _avito_chats),
    "getChatByIdV2": ("avito.chat", _avito_chat),
    "chatRead": ("avito.read", _avito_read),
    "postWebhookV3": ("avito.webhook", _avito_subscribe),
    "getSubscriptions": ("avito.webhook", _avito_subscriptions),
    "postWebhookUnsubscribe": ("avito.webhook", _avito_unsubscribe),
}
#: Operations that need no access token.
AVITO_PUBLIC = ("getAccessToken",)


def _avito_routes(app: FastAPI, world: FakeWorld) -> None:
    spec = avito_spec()

    async def avito(request: Request) -> Response:
        body = await request.body()
        # The path as sent, not as Starlette decodes it: an id with an encoded "/" in it is
        # one segment, as Avito's router reads it.
        raw_path = request.scope.get("raw_path") or request.url.path.encode()
        check = spec.check_request(
            request.method, raw_path.decode("latin-1"), request.url.query, request.headers, body
        )
        op = check.operation
        world.platform_calls.append(
            PlatformCall("avito", op.operation_id if op else None, op is not None and not check.problems)
        )
        if op is None:
            world.violated("avito", f"{request.method} {request.url.path}", check.problems)
            return avito_error(404)
        if check.problems:
            world.violated("avito", op.operation_id, check.problems)
            if check.unauthenticated:
                return avito_error(401)
            return avito_error(400, "Validation error", fields={"request": "; ".join(check.problems)[:500]})
        implemented = AVITO_OPERATIONS.get(op.operation_id)
        if implemented is None:
            world.violated("avito", op.operation_id, [f"the fake does not implement {op.operation_id}"])
            return avito_error(500)
        if op.operation_id not in AVITO_PUBLIC:
            auth = request.headers.get("authorization", "")
            if not (auth.startswith("Bearer ") and auth[7:] in world.avito_tokens):
                # An expired or unknown token gives 403 (docs/platforms.md).
                return avito_error(403)
            user = check.path_params.get("user_id")
            world.avito_callers.append(
                (
                    op.operation_id,
                    None if user is None else str(user),
                    world.avito_token_clients.get(auth[7:]),
                )
            )
            check.client_id = world.avito_token_clients.get(auth[7:])
            refused = world.avito_account_refusals.get(str(user)) if user is not None else None
            if refused is not None:
                # The account as a whole: 401 (it refuses this application whatever the
                # token), 402 (payment required).
                return avito_error(refused)
            if not world.avito_messenger_plan and op.operation_id != "getUserInfoSelf":
                # The account has no paid Messenger plan: Avito refuses the Messenger API.
                return avito_error(403)
            owner = world.avito_accounts.get(str(check.path_params.get("user_id")))
            if owner is not None and world.avito_token_clients.get(auth[7:]) != owner:
                # Another account's token: Avito refuses it.
                return avito_error(403)
        target, handler = implemented
        b, early = await _before(world, target) if target else (None, None)
        response = early or await handler(world, check, b)
        answer_problems = spec.check_response(op, response.status_code, json.loads(bytes(response.body)))
        if answer_problems:
            world.violated("avito", f"answer to {op.operation_id}", answer_problems)
        return response

    for prefix in ("/token{rest:path}", "/messenger/{rest:path}", "/core/{rest:path}"):
        app.add_api_route(prefix, avito, methods=["GET", "POST", "PUT", "PATCH", "DELETE"])


# --------------------------------------------------------------------------------------


def fake_app(world: FakeWorld) -> FastAPI:
    app = FastAPI()
    _telegram_routes(app, world)
    _avito_routes(app, world)

    @app.post("/generic/replies")
    async def generic_send(request: Request) -> JSONResponse:
        b, early = await _before(world, "generic.send")
        if early is not None:
            return early
        key = request.headers.get("idempotency-key", "")
        raw = (await request.body()).decode()
        body = await request.json()
        if body.get("probe") is True:
            # chatq asking whether a paused endpoint accepts it again: nothing to send.
            world.generic_probes.append(body)
            return JSONResponse({"ok": True})
        if key and key in world.generic_keys:
            return JSONResponse({"message_id": world.generic_keys[key], "duplicate": True})
        message_id = f"g-{next(world.ids)}"
        world.generic.append({**body, "message_id": message_id, "raw": raw, "headers": dict(request.headers)})
        if key:
            world.generic_keys[key] = message_id
        if b == "lost":
            await asyncio.sleep(LOST_SECONDS)
        return JSONResponse({"message_id": message_id})

    @app.get("/v1/models")
    async def llm_models() -> JSONResponse:
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {"id": m, "object": "model", "created": 0, "owned_by": "fake"} for m in world.llm_models
                ],
            }
        )

    @app.post("/v1/chat/completions")
    async def llm(request: Request) -> JSONResponse:
        world.llm_in_flight += 1
        world.llm_max_in_flight = max(world.llm_max_in_flight, world.llm_in_flight)
        try:
            _b, early = await _before(world, "llm")
        finally:
            world.llm_in_flight -= 1
        if early is not None:
            return early
        body = await request.json()
        world.llm.append(body)
        last = body["messages"][-1]["content"]
        text = world.llm_answer or "Answer to: " + " | ".join(last.splitlines())
        return JSONResponse(
            {
                "id": "cmpl-1",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": body.get("model", "fake"),
                "choices": [
                    {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
                ],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            }
        )

    @app.post("/alerts")
    async def alerts(request: Request) -> JSONResponse:
        raw = (await request.body()).decode()
        world.alerts.append({"body": await request.json(), "raw": raw, "headers": dict(request.headers)})
        return JSONResponse({"ok": True})

    return app


@contextlib.asynccontextmanager
async def running_fakes(host: str = "127.0.0.1") -> AsyncIterator[FakeWorld]:
    """The fakes on a free port of ``host`` (``world.url`` says where). The container test
    listens on every address of its private network namespace, so the containers reach it
    through their gateway."""
    import uvicorn

    world = FakeWorld()
    # A caller that gave up on a "lost" answer disconnects; that is the point, not an error.
    logging.getLogger("uvicorn.error").setLevel(logging.CRITICAL)
    port = free_port()
    server = OpsServer(
        uvicorn.Config(fake_app(world), host=host, port=port, log_config=None, access_log=False)
    )
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()
        await asyncio.sleep(0.02)
    world.url = f"http://127.0.0.1:{port}"
    try:
        yield world
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, timeout=10)
