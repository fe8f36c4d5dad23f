"""Worker services in-process, through their real composition roots."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from services.coalescer import app as coalescer_app
from shared.settings import Settings


@contextlib.asynccontextmanager
async def running_coalescers(
    settings: Settings, replicas: int = 1
) -> AsyncIterator[list[asyncio.Task[None]]]:
    stops = [asyncio.Event() for _ in range(replicas)]
    tasks = [
        asyncio.create_task(coalescer_app.run(settings, stop), name=f"coalescer-{i}")
        for i, stop in enumerate(stops)
    ]
    try:
        yield tasks
    finally:
        for stop in stops:
            stop.set()
        for task in tasks:
            await asyncio.wait_for(task, timeout=30)
