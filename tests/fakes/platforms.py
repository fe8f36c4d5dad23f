"""In-repo fakes of the outside world, one HTTP server: Telegram Bot API, Avito
(token, send, list messages), an OpenAI-compatible model, a generic reply endpoint and
an alert sink. They follow ../shared/platforms.md and Avito's OpenAPI shapes, record what
they receive, and fail on demand.

Failure behaviours, queued per target with ``FakeWorld.fail(target, *behaviours)`` and
used one per call: ``"500"``/``"503"``/``"400"``/``"403"`` (that status), ``"429:N"``
(rate limited, retry after N s), ``"lost"`` (do the action, then hold the answer past
the client's timeout: the outcome is unknown to the caller), ``"hang"`` (hold past the
timeout and do nothing: as unknown to the caller, but nothing happened), ``"late:N"``
(Avito send: hold past the timeout, and do the action N s after the request), ``"slow:N"``
(answer after N s), ``"quota"`` (LLM: 429 insufficient_quota).
Targets: telegram.send, avito.send, avito.list, avito.token, generic.send, llm;
``telegram.send:<chat_id>`` fails only that chat's sends.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import random
import time
from collections import defaultdict, deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from shared.ops_http import OpsServer
from tests.support.processes import free_port

LOST_SECONDS = 3.0  # longer than the platform timeout tests give the responder


@dataclass
class FakeWorld:
    faults: dict[str, deque[str]] = field(default_factory=lambda: defaultdict(deque))
    telegram: list[dict[str, Any]] = field(default_factory=list)
    avito: list[dict[str, Any]] = field(default_factory=list)
    generic: list[dict[str, Any]] = field(default_factory=list)
    generic_keys: dict[str, str] = field(default_factory=dict)
    llm: list[dict[str, Any]] = field(default_factory=list)
    llm_in_flight: int = 0
    llm_max_in_flight: int = 0
    alerts: list[dict[str, Any]] = field(default_factory=list)
    avito_tokens: set[str] = field(default_factory=set)
    avito_token_requests: int = 0
    #: Actions scheduled to happen later ("late:N") that have not happened yet.
    pending_actions: int = 0
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

    def replies_to(self, chat_id: str) -> list[str]:
        """Every reply any platform received for this chat, in order."""
        out = [m["text"] for m in self.telegram if str(m["chat_id"]) == chat_id]
        out += [m["text"] for m in self.avito if m["chat_id"] == chat_id]
        out += [m["text"] for m in self.generic if m["chat_id"] == chat_id]
        return out


async def _before(
    world: FakeWorld, target: str, chat: str | None = None
) -> tuple[str | None, JSONResponse | None]:
    """Apply a queued behaviour. Returns (behaviour, response to send instead)."""
    b = world.take(target, chat)
    if b is None or b == "lost" or b.startswith("late:"):
        return b, None
    if b == "hang":
        # Hold the request past the client's timeout and do nothing: the caller cannot
        # tell this from "lost", but nothing happened.
        await asyncio.sleep(LOST_SECONDS)
        b = "504"
    if b.startswith("slow:"):
        await asyncio.sleep(float(b.split(":", 1)[1]))
        return b, None
    if b.startswith("429"):
        after = int(b.split(":", 1)[1]) if ":" in b else 1
        body = {
            "ok": False,
            "error_code": 429,
            "description": "Too Many Requests",
            "parameters": {"retry_after": after},
        }
        return b, JSONResponse(body, status_code=429, headers={"retry-after": str(after)})
    if b == "quota":
        body = {"error": {"message": "quota", "type": "insufficient_quota", "code": "insufficient_quota"}}
        return b, JSONResponse(body, status_code=429)
    status = int(b)
    if target.startswith("avito."):
        # Avito's error shape (its OpenAPI documents): {"error": {"code", "message"}}.
        return b, JSONResponse({"error": {"code": status, "message": f"fake {status}"}}, status_code=status)
    return b, JSONResponse(
        {"ok": False, "error_code": status, "description": f"fake {status}"}, status_code=status
    )


def fake_app(world: FakeWorld) -> FastAPI:
    app = FastAPI()

    @app.post("/bot{token}/sendMessage")
    async def telegram_send(token: str, request: Request) -> JSONResponse:
        body = await request.json()
        b, early = await _before(world, "telegram.send", str(body.get("chat_id")))
        if early is not None:
            return early
        message_id = next(world.ids)
        world.telegram.append({"chat_id": body["chat_id"], "text": body["text"], "message_id": message_id})
        if b == "lost":
            await asyncio.sleep(LOST_SECONDS)
        return JSONResponse(
            {"ok": True, "result": {"message_id": message_id, "chat": {"id": body["chat_id"]}}}
        )

    @app.post("/token/")
    async def avito_token(request: Request) -> JSONResponse:
        _b, early = await _before(world, "avito.token")
        if early is not None:
            return early
        form = {k: v[0] for k, v in parse_qs((await request.body()).decode()).items()}
        if form.get("grant_type") != "client_credentials" or not form.get("client_secret"):
            return JSONResponse({"error": "invalid_client"}, status_code=400)
        world.avito_token_requests += 1
        token = f"tok-{world.avito_token_requests}"
        world.avito_tokens.add(token)
        return JSONResponse({"access_token": token, "expires_in": 86400, "token_type": "Bearer"})

    def avito_authorized(request: Request) -> bool:
        auth = request.headers.get("authorization", "")
        return auth.startswith("Bearer ") and auth[7:] in world.avito_tokens

    @app.post("/messenger/v1/accounts/{user_id}/chats/{chat_id}/messages")
    async def avito_send(user_id: str, chat_id: str, request: Request) -> JSONResponse:
        if not avito_authorized(request):
            return JSONResponse({"error": {"code": 403, "message": "token expired"}}, status_code=403)
        b, early = await _before(world, "avito.send")
        if early is not None:
            return early
        body = await request.json()
        if body.get("type") != "text" or not isinstance(body.get("message", {}).get("text"), str):
            return JSONResponse({"error": {"code": 400, "message": "bad request"}}, status_code=400)

        def create() -> dict[str, Any]:
            message = {
                "id": f"av-{next(world.ids)}",
                "user_id": user_id,
                "chat_id": chat_id,
                "text": body["message"]["text"],
                "created": int(time.time()),
            }
            world.avito.append(message)
            return message

        if b is not None and b.startswith("late:"):
            # The send lands N s after the request, while the caller has long timed out.
            def land() -> None:
                create()
                world.pending_actions -= 1

            world.pending_actions += 1
            asyncio.get_running_loop().call_later(float(b.split(":", 1)[1]), land)
            await asyncio.sleep(LOST_SECONDS)
            return JSONResponse({"error": {"code": 504, "message": "fake late"}}, status_code=504)
        message = create()
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

    @app.get("/messenger/v3/accounts/{user_id}/chats/{chat_id}/messages/")
    async def avito_list(user_id: str, chat_id: str, request: Request) -> JSONResponse:
        if not avito_authorized(request):
            return JSONResponse({"error": {"code": 403, "message": "token expired"}}, status_code=403)
        _b, early = await _before(world, "avito.list")
        if early is not None:
            return early
        items = [
            {
                "id": m["id"],
                "author_id": int(user_id),
                "created": m["created"],
                "direction": "out",
                "type": "text",
                "content": {"text": m["text"]},
            }
            for m in reversed(world.avito)
            if m["chat_id"] == chat_id and m["user_id"] == user_id
        ]
        # A bare array, newest first (Avito's ``Messages`` schema).
        return JSONResponse(items[: int(request.query_params.get("limit", 100))])

    @app.post("/generic/replies")
    async def generic_send(request: Request) -> JSONResponse:
        b, early = await _before(world, "generic.send")
        if early is not None:
            return early
        key = request.headers.get("idempotency-key", "")
        raw = (await request.body()).decode()
        body = await request.json()
        if key and key in world.generic_keys:
            return JSONResponse({"message_id": world.generic_keys[key], "duplicate": True})
        message_id = f"g-{next(world.ids)}"
        world.generic.append({**body, "message_id": message_id, "raw": raw, "headers": dict(request.headers)})
        if key:
            world.generic_keys[key] = message_id
        if b == "lost":
            await asyncio.sleep(LOST_SECONDS)
        return JSONResponse({"message_id": message_id})

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
        text = "Answer to: " + " | ".join(last.splitlines())
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
async def running_fakes() -> AsyncIterator[FakeWorld]:
    import uvicorn

    world = FakeWorld()
    # A caller that gave up on a "lost" answer disconnects; that is the point, not an error.
    logging.getLogger("uvicorn.error").setLevel(logging.CRITICAL)
    port = free_port()
    server = OpsServer(
        uvicorn.Config(fake_app(world), host="127.0.0.1", port=port, log_config=None, access_log=False)
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
