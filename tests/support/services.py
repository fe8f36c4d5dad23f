"""Worker services in-process, through their real composition roots."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from services.coalescer import app as coalescer_app
from services.responder import app as responder_app
from shared.lifecycle import cancel_and_wait
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
        # All of them, each bounded: one that fails or hangs leaves none running into the
        # next test (where it would still take from the shared queues).
        done, stuck = await asyncio.wait(tasks, timeout=30)
        for task in stuck:
            await cancel_and_wait(task)
        for task in tasks:
            if task in done:
                task.result()
        if stuck:
            raise TimeoutError(f"{sorted(t.get_name() for t in stuck)} did not stop within 30 s")


def running_coalescers(settings: Settings, replicas: int = 1):
    return _running(coalescer_app.run, as_service(settings, "coalescer"), replicas, "coalescer")


def running_responders(settings: Settings, replicas: int = 1):
    return _running(responder_app.run, as_service(settings, "responder"), replicas, "responder")
