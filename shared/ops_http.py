"""The operations endpoint of services without an HTTP API of their own (coalescer,
responder): /healthz, /readyz and /metrics on METRICS_PORT, served in the service's own
event loop so that liveness really means "the loop is turning"."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Iterator, Sequence

import asyncpg
import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from shared import metrics
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


def consumer_readiness(
    consumer: Consumer, pool: asyncpg.Pool, *, stall_seconds: float, others: Sequence[Consumer] = ()
) -> ReadinessCheck:
    """Ready when the consumers are attached to their queues and making progress (none has
    held a message unsettled for ``stall_seconds``), and Postgres answers."""
    consumers = (consumer, *others)
    for c in consumers:
        metrics.CONSUMER_OLDEST_UNSETTLED.labels(queue=c.queue).set_function(c.oldest_unsettled_seconds)

    async def check() -> dict[str, str]:
        checks = {"rabbitmq": "ok" if all(c.consuming for c in consumers) else "not consuming"}
        stalled = [
            f"{c.queue} has held a message unsettled for {c.oldest_unsettled_seconds():.0f}s"
            for c in consumers
            if c.oldest_unsettled_seconds() > stall_seconds
        ]
        checks["progress"] = "; ".join(stalled) if stalled else "ok"
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
