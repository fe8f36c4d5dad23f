"""The fake Telegram Bot API: its methods, checked against Telegram's own tables (``tests/fakes/spec.py``), on the world of ``tests/fakes/world.py``."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any
from urllib.parse import parse_qs, urlsplit

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from tests.fakes.spec import telegram_form_value, telegram_spec
from tests.fakes.world import (
    LOST_SECONDS,
    TELEGRAM_WEBHOOK_PORTS,
    FakeWorld,
    PlatformCall,
    before,
    telegram_error,
)

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
        b, early = await before(world, target, str(params.get("chat_id"))) if target else (None, None)
        response = early or await handler(world, token, params, b)
        answer_problems = spec.check_answer(name, json.loads(bytes(response.body)))
        if answer_problems:
            world.violated("telegram", f"answer to {name}", answer_problems)
        return response
