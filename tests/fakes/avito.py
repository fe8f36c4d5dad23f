"""The fake Avito API: token, Messenger (send, list, chats, read, webhook subscriptions), accounts/self, checked against Avito's OpenAPI documents (``tests/fakes/spec.py``), on the world of ``tests/fakes/world.py``."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from tests.fakes.spec import AvitoCheck, avito_spec
from tests.fakes.world import LOST_SECONDS, FakeWorld, PlatformCall, avito_error, before

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
        b, early = await before(world, target) if target else (None, None)
        response = early or await handler(world, check, b)
        answer_problems = spec.check_response(op, response.status_code, json.loads(bytes(response.body)))
        if answer_problems:
            world.violated("avito", f"answer to {op.operation_id}", answer_problems)
        return response

    for prefix in ("/token{rest:path}", "/messenger/{rest:path}", "/core/{rest:path}"):
        app.add_api_route(prefix, avito, methods=["GET", "POST", "PUT", "PATCH", "DELETE"])
