"""The fakes as one HTTP server: Telegram (``telegram.py``) and Avito (``avito.py``) routes, an OpenAI-compatible model, a generic reply endpoint and an alert sink, over one ``world.FakeWorld`` (what the fakes are, how they fail: its docstring)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from shared.ops_http import OpsServer
from tests.fakes.avito import _avito_routes
from tests.fakes.telegram import _telegram_routes
from tests.fakes.world import LOST_SECONDS, FakeWorld, before
from tests.support.processes import free_port

# --------------------------------------------------------------------------------------


def fake_app(world: FakeWorld) -> FastAPI:
    app = FastAPI()
    _telegram_routes(app, world)
    _avito_routes(app, world)

    @app.post("/generic/replies")
    async def generic_send(request: Request) -> JSONResponse:
        b, early = await before(world, "generic.send")
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
            _b, early = await before(world, "llm")
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
