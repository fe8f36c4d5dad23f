"""The receiver's composition root: ``create_app(settings)`` builds every part from the
settings and wires them; ``__main__`` serves it with uvicorn."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import asyncpg
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from prometheus_client import make_asgi_app

from shared import metrics
from shared.broker.connection import BrokerConnection
from shared.broker.topology import build_topology
from shared.db import create_pool
from shared.faults import fault_point
from shared.lifecycle import freeze_startup_heap
from shared.migrate import migrate_dsn
from shared.outbox import Relay
from shared.settings import Settings

from . import operations, pages, sandbox
from .errors import ApiError, install_error_handlers
from .intake import Intake, Stored, parse_json, store
from .limits import BodySizeLimit
from .openapi import json_body
from .webhooks import avito, generic, telegram

logger = logging.getLogger(__name__)


@dataclass
class Runtime:
    pool: asyncpg.Pool
    broker: BrokerConnection
    relay: Relay | None
    relay_task: asyncio.Task[None] | None
    stats_task: asyncio.Task[None] | None = None


async def _backlog_gauges(pool: asyncpg.Pool, interval: float = 10.0) -> None:
    """chatq_backlog and chatq_oldest_unfinished_age_seconds, from Postgres."""
    while True:
        try:
            stats = await operations.collect_stats(pool)
            for state, b in stats["backlog"].items():
                metrics.BACKLOG.labels(state=state).set(b["count"])
                metrics.OLDEST_UNFINISHED.labels(state=state).set(b["oldest_age_seconds"])
        except Exception as exc:
            logger.debug("backlog gauges not refreshed: %s", exc)
        await asyncio.sleep(interval)


def create_app(settings: Settings) -> FastAPI:
    generic_verifier = generic.verifier(_secret(settings.generic_webhook_secret))
    telegram_secret = _secret(settings.telegram_webhook_secret)
    avito_secret = _secret(settings.avito_webhook_secret)
    telegram_account = settings.telegram_account_id

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        runtime = await _start(settings)
        app.state.pool = runtime.pool
        app.state.runtime = runtime
        freeze_startup_heap()
        try:
            yield
        finally:
            await _stop(runtime)

    app = FastAPI(
        title="chatqueue receiver",
        version="0.1.0",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
    )
    app.state.admin_token = _secret(settings.admin_token)
    app.state.sandbox_active = settings.sandbox_active
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_body_bytes)
    install_error_handlers(app)
    app.include_router(operations.router)
    app.include_router(sandbox.router)
    app.include_router(pages.router)

    app.mount("/metrics", make_asgi_app())

    async def accept(request: Request, platform: str, intake: Intake) -> Stored:
        stored = await store(request.app.state.pool, intake)
        fault_point("receiver.after_commit")
        runtime: Runtime = request.app.state.runtime
        if runtime.relay is not None and not stored.duplicate and stored.status == "accepted":
            runtime.relay.notify()
        outcome = "duplicate" if stored.duplicate else ("ignored" if intake.ignored_reason else "accepted")
        metrics.WEBHOOKS.labels(platform=platform, outcome=outcome).inc()
        return stored

    @app.post("/v1/webhooks/telegram", openapi_extra=json_body(telegram.TelegramUpdate))
    async def telegram_webhook(request: Request) -> JSONResponse:
        started = time.perf_counter()
        with _rejections("telegram"):
            telegram.authenticate(telegram_secret, request.headers.get(telegram.SECRET_HEADER))
            data, raw = parse_json(await _json_body(request))
            stored = await accept(request, "telegram", telegram.normalise(data, raw, telegram_account))
        metrics.WEBHOOK_SECONDS.labels(platform="telegram").observe(time.perf_counter() - started)
        return JSONResponse(_ack(stored))

    @app.post("/v1/webhooks/avito/{secret}", openapi_extra=json_body(avito.AvitoWebhook))
    async def avito_webhook(secret: str, request: Request) -> JSONResponse:
        started = time.perf_counter()
        with _rejections("avito"):
            avito.authenticate(avito_secret, secret)
            data, raw = parse_json(await _json_body(request))
            stored = await accept(request, "avito", avito.normalise(data, raw))
        metrics.WEBHOOK_SECONDS.labels(platform="avito").observe(time.perf_counter() - started)
        return JSONResponse(_ack(stored))

    @app.post("/v1/webhooks/generic", status_code=202, openapi_extra=json_body(generic.GenericMessage))
    async def generic_webhook(request: Request) -> JSONResponse:
        started = time.perf_counter()
        with _rejections("generic"):
            body = await request.body()
            webhook_id = generic.authenticate(generic_verifier, body, dict(request.headers))
            _require_json(request)
            data, raw = parse_json(body)
            stored = await accept(request, "generic", generic.normalise(data, raw, webhook_id))
        metrics.WEBHOOK_SECONDS.labels(platform="generic").observe(time.perf_counter() - started)
        doc = _ack(stored)
        doc["status_url"] = f"/v1/operations/{stored.operation_id}"
        return JSONResponse(doc, status_code=202)

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz(request: Request) -> JSONResponse:
        runtime: Runtime = request.app.state.runtime
        checks: dict[str, str] = {}
        try:
            await asyncio.wait_for(runtime.pool.fetchval("SELECT 1"), timeout=2)
            checks["postgres"] = "ok"
        except Exception as exc:
            checks["postgres"] = f"unreachable: {type(exc).__name__}"
        checks["rabbitmq"] = "ok" if runtime.broker.is_open else "unreachable"
        # Intake needs Postgres only: while RabbitMQ is away the outbox holds what
        # arrives, so the receiver stays in rotation and reports itself degraded.
        ready = checks["postgres"] == "ok"
        status = "ok" if ready and checks["rabbitmq"] == "ok" else ("degraded" if ready else "unready")
        return JSONResponse({"status": status, "checks": checks}, status_code=200 if ready else 503)

    return app


async def _start(settings: Settings) -> Runtime:
    dsn = settings.database_url.get_secret_value()
    if settings.migrate_on_start:
        await migrate_dsn(dsn)
    pool = await create_pool(dsn, size=settings.database_pool_size)
    broker = BrokerConnection(
        settings.amqp_url.get_secret_value(),
        build_topology(settings.retry_delays()),
        name="chatq-receiver-relay",
    )
    relay = None
    task = None
    if settings.relay_enabled:
        relay = Relay.from_settings(pool, broker, settings)
        task = asyncio.create_task(relay.run(), name="outbox-relay")
    return Runtime(
        pool, broker, relay, task, asyncio.create_task(_backlog_gauges(pool), name="backlog-gauges")
    )


async def _stop(runtime: Runtime) -> None:
    if runtime.stats_task is not None:
        runtime.stats_task.cancel()
    if runtime.relay is not None and runtime.relay_task is not None:
        runtime.relay.stop()
        try:
            await asyncio.wait_for(runtime.relay_task, timeout=10)
        except TimeoutError:
            runtime.relay_task.cancel()
    await runtime.broker.close()
    await runtime.pool.close()


def _secret(value: Any) -> str | None:
    return value.get_secret_value() if value is not None else None


def _ack(stored: Stored) -> dict[str, Any]:
    return {
        "ok": True,
        "operation_id": str(stored.operation_id),
        "status": stored.status,
        "duplicate": stored.duplicate,
    }


def _require_json(request: Request) -> None:
    ctype = request.headers.get("content-type", "")
    media = ctype.split(";", 1)[0].strip().lower()
    if media != "application/json":
        raise ApiError(415, "unsupported_media_type", "send the body as application/json")


async def _json_body(request: Request) -> bytes:
    _require_json(request)
    return await request.body()


class _rejections:
    """Count every 4xx a webhook endpoint answers, by platform."""

    def __init__(self, platform: str) -> None:
        self.platform = platform

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        if isinstance(exc, ApiError):
            metrics.WEBHOOKS.labels(platform=self.platform, outcome="rejected").inc()
            logger.info("rejected %s webhook: %s %s", self.platform, exc.status, exc.code)
