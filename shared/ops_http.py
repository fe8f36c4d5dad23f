"""The operations endpoint of services without an HTTP API of their own (coalescer,
responder): /healthz, /readyz and /metrics on METRICS_PORT, served in the service's own
event loop so that liveness really means "the loop is turning"."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Iterator

import asyncpg
import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from shared.broker.consumer import Consumer

ReadinessCheck = Callable[[], Awaitable[dict[str, str]]]


def ops_app(readiness: ReadinessCheck) -> Starlette:
    async def healthz(_: Request) -> JSONResponse:
        return JSONResponse({"status": "ok"})

    async def readyz(_: Request) -> JSONResponse:
        checks = await readiness()
        ready = all(v == "ok" for v in checks.values())
        return JSONResponse(
            {"status": "ok" if ready else "unready", "checks": checks}, status_code=200 if ready else 503
        )

    async def metrics(_: Request) -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    return Starlette(
        routes=[Route("/healthz", healthz), Route("/readyz", readyz), Route("/metrics", metrics)]
    )


class OpsServer(uvicorn.Server):
    """uvicorn without its signal handling: the service owns SIGTERM and drains first."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def consumer_readiness(consumer: Consumer, pool: asyncpg.Pool) -> ReadinessCheck:
    """Ready when the consumer is attached to its queue and Postgres answers."""

    async def check() -> dict[str, str]:
        checks = {"rabbitmq": "ok" if consumer.consuming else "not consuming"}
        try:
            await asyncio.wait_for(pool.fetchval("SELECT 1"), timeout=2)
            checks["postgres"] = "ok"
        except Exception as exc:
            checks["postgres"] = f"unreachable: {type(exc).__name__}"
        return checks

    return check


def ops_server(readiness: ReadinessCheck, host: str, port: int) -> OpsServer:
    config = uvicorn.Config(ops_app(readiness), host=host, port=port, log_config=None, access_log=False)
    return OpsServer(config)
