"""Worker services in-process, through their real composition roots."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from services.coalescer import app as coalescer_app
from services.responder import app as responder_app
from shared.settings import Settings
from tests.support.service_roles import as_service


@contextlib.asynccontextmanager
async def _running(
    run, settings: Settings, replicas: int, name: str
) -> AsyncIterator[list[asyncio.Task[None]]]:
    stops = [asyncio.Event() for _ in range(replicas)]
    tasks = [asyncio.create_task(run(settings, stop), name=f"{name}-{i}") for i, stop in enumerate(stops)]
    try:
        yield tasks
    finally:
        for stop in stops:
            stop.set()
        for task in tasks:
            await asyncio.wait_for(task, timeout=30)


def running_coalescers(settings: Settings, replicas: int = 1):
    return _running(coalescer_app.run, as_service(settings, "coalescer"), replicas, "coalescer")


def running_responders(settings: Settings, replicas: int = 1):
    return _running(responder_app.run, as_service(settings, "responder"), replicas, "responder")
