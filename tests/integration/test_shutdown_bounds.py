"""A service's way out is bounded where it waits on something it does not control: its
Postgres pool closes even while a task still holds a connection (asyncpg's close waits
for every one to come back, for ever if its holder never ends)."""

from __future__ import annotations

import asyncio
import logging
from contextlib import AsyncExitStack

import pytest

from shared import runner
from shared.runner import Supervisor
from shared.settings import Settings
from tests.conftest import replace

pytestmark = pytest.mark.integration


async def test_the_pool_closes_within_its_bound_while_a_task_still_holds_a_connection(
    settings: Settings, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(runner, "POOL_CLOSE_SECONDS", 0.5)
    held = asyncio.Event()
    release = asyncio.Event()

    async def holds_a_connection(pool: object) -> None:
        async with pool.acquire():  # type: ignore[attr-defined]
            held.set()
            await release.wait()  # never, until the test ends

    stack = AsyncExitStack()
    parts = Supervisor("test", replace(settings, migrate_on_start=False), stack)
    pool = await parts.database(size=2)
    holder = asyncio.create_task(holds_a_connection(pool))
    await asyncio.wait_for(held.wait(), 10)
    loop = asyncio.get_running_loop()
    started = loop.time()
    with caplog.at_level(logging.WARNING, logger="shared.runner"):
        await asyncio.wait_for(stack.aclose(), 10)
    assert loop.time() - started < 5
    assert pool.is_closing()
    assert "connections still in use" in caplog.text
    release.set()
    await asyncio.wait({holder}, timeout=5)
