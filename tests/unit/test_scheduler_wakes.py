"""The scheduler's wakes (issue 43): a job's end wakes it at once, rounds stay at least
ROUND_GAP_SECONDS apart, and stop() ends it at once wherever it is, the gap included (a
review found a stop during the gap lost: the scheduler ran one more round and slept a
whole poll)."""

from __future__ import annotations

import asyncio
import time

import pytest

from services.coalescer import service
from services.coalescer.service import Coalescer
from stores.windows.fake import InMemoryWindows
from stores.windows.window import WindowPolicy
from tests.support.broker import wait_for

pytestmark = pytest.mark.unit

POLICY = WindowPolicy(quiet=2, delay_min=5, delay_max=5, max_wait=8)


class CountedRounds(InMemoryWindows):
    """The in-memory store, counting the scheduler's rounds (each ends by asking when
    the next window falls due)."""

    rounds = 0

    async def seconds_to_next_due(self) -> float | None:
        self.rounds += 1
        return await super().seconds_to_next_due()


async def scheduler_after_its_first_round(
    monkeypatch: pytest.MonkeyPatch, *, gap: float
) -> tuple[CountedRounds, Coalescer, asyncio.Task[None]]:
    """A scheduler with rounds ``gap`` seconds apart and a poll of 30 s, its first round done."""
    monkeypatch.setattr(service, "ROUND_GAP_SECONDS", gap)
    store = CountedRounds()
    coalescer = Coalescer(store, POLICY, draw=lambda: 0.0)
    task = asyncio.create_task(coalescer.run_scheduler(poll_seconds=30.0))
    await wait_for(lambda: store.rounds == 1, within=5, what="the first round")
    return store, coalescer, task


async def test_a_stop_during_the_gap_between_two_rounds_ends_the_scheduler_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    store, coalescer, task = await scheduler_after_its_first_round(monkeypatch, gap=5.0)
    try:
        coalescer.wake()  # a job ended: the next round waits out the gap
        for _ in range(5):
            await asyncio.sleep(0)  # into the gap
        assert store.rounds == 1
        stopped = time.monotonic()
        coalescer.stop()
        await asyncio.wait_for(task, timeout=10)
        assert time.monotonic() - stopped < 1.0, "the scheduler waited out its gap or a poll after stop()"
        assert store.rounds == 1, "a round ran after stop()"
    finally:
        task.cancel()


async def test_wakes_within_the_gap_make_one_round_not_one_each(monkeypatch: pytest.MonkeyPatch) -> None:
    store, coalescer, task = await scheduler_after_its_first_round(monkeypatch, gap=0.2)
    try:
        for _ in range(20):  # twenty jobs end, a notification each
            coalescer.wake()
            await asyncio.sleep(0)
        await wait_for(lambda: store.rounds == 2, within=5, what="the round the wakes asked for")
        # The wakes came before the second round started: it took them all, and the
        # scheduler sleeps (a poll of 30 s) until something else wakes it.
        coalescer.wake()
        await wait_for(lambda: store.rounds == 3, within=5, what="a round for a wake after it")
        assert store.rounds == 3
    finally:
        coalescer.stop()
        await asyncio.wait_for(task, timeout=10)
