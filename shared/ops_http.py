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

#: A check's value when it passes.
OK = "ok"
#: The beginning of a check's value when it was not judged: what it looks at waits on a
#: check that failed (a consumer makes no progress while Postgres is away). Not failing.
NOT_JUDGED = "not judged"
#: How often the readiness gauges (chatq_ready) are re-evaluated between probes.
READINESS_SECONDS = 5.0


def failing(checks: dict[str, str]) -> list[str]:
    """The checks that failed: the cause, never what only waits on it."""
    return [name for name, value in checks.items() if value != OK and not value.startswith(NOT_JUDGED)]


def export_readiness(checks: dict[str, str]) -> list[str]:
    """chatq_ready{check} from one evaluation; returns the failing checks."""
    failed = failing(checks)
    for name in checks:
        metrics.READY.labels(check=name).set(0 if name in failed else 1)
    return failed


def readiness_gauges(readiness: ReadinessCheck) -> Callable[[], Awaitable[None]]:
    """One round of the readiness gauges (a service runs it every READINESS_SECONDS): an
    outage shows in /metrics within seconds, whether or not a probe asks /readyz."""

    async def refresh() -> None:
        export_readiness(await readiness())

    return refresh


def ops_app(readiness: ReadinessCheck) -> Starlette:
    async def healthz(_: Request) -> JSONResponse:
        return JSONResponse({"status": "ok"})

    async def readyz(_: Request) -> JSONResponse:
        checks = await readiness()
        failed = export_readiness(checks)
        return JSONResponse(
            {"status": "unready" if failed else "ok", "failing": failed, "checks": checks},
            status_code=503 if failed else 200,
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
    held a message unsettled for ``stall_seconds``), and Postgres answers. While Postgres is
    away its handlers retry and hold their messages: progress is then not judged, so
    /readyz and chatq_ready name Postgres alone."""
    consumers = (consumer, *others)
    for c in consumers:
        metrics.CONSUMER_OLDEST_UNSETTLED.labels(queue=c.queue).set_function(c.oldest_unsettled_seconds)

    async def check() -> dict[str, str]:
        checks = {"rabbitmq": OK if all(c.consuming for c in consumers) else "not consuming"}
        checks["postgres"] = await postgres_check(pool)
        stalled = [
            f"{c.queue} has held a message unsettled for {c.oldest_unsettled_seconds():.0f}s"
            for c in consumers
            if c.oldest_unsettled_seconds() > stall_seconds
        ]
        if stalled and checks["postgres"] != OK:
            # Its handlers retry until Postgres answers: the cause is Postgres, named once.
            checks["progress"] = f"{NOT_JUDGED} while postgres is unreachable ({'; '.join(stalled)})"
        else:
            checks["progress"] = "; ".join(stalled) if stalled else OK
        return checks

    return check


async def postgres_check(pool: asyncpg.Pool) -> str:
    """The postgres check: a round trip within 2 s, or why not."""
    try:
        async with asyncio.timeout(2):
            await pool.fetchval("SELECT 1")
    except Exception as exc:
        return f"unreachable: {type(exc).__name__}"
    return OK


def ops_server(readiness: ReadinessCheck, host: str, port: int) -> OpsServer:
    config = uvicorn.Config(ops_app(readiness), host=host, port=port, log_config=None, access_log=False)
    return OpsServer(config)
