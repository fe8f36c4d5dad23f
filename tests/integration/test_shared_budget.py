"""One request budget per Avito account, shared by every process that calls Avito for it
(issue 38): the sends of every responder and the receiver's poll count against one
per-minute window in Postgres, the poll takes at most its share, and a pause Avito asks
for holds every process."""

from __future__ import annotations

import asyncpg
import pytest

from platforms.ratelimit import _TAKE, BudgetSpent, SharedBudget
from shared.db import create_pool
from shared.settings import Settings

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("clean")]


async def test_two_processes_share_one_window_and_the_poll_stops_at_its_share(
    settings: Settings, pool: asyncpg.Pool
) -> None:
    # Two "processes": two pools, two budgets, one account.
    other = await create_pool(settings.database_url.get_secret_value(), size=2)
    try:
        sends, poll = SharedBudget(pool, "avito", 10), SharedBudget(other, "avito", 10)
        for _ in range(4):
            await sends.take("777")
        await poll.take("777", share=0.5)  # the fifth request of the minute: the poll's share
        with pytest.raises(BudgetSpent):
            await poll.take("777", share=0.5)
        used = await pool.fetchval("SELECT used FROM platform_budgets WHERE account_id = '777'")
        assert used == 5
        # The sends may use the rest of the minute, and another account has its own window.
        for _ in range(5):
            await sends.take("777")
        await poll.take("888", share=0.5)
        assert await pool.fetchval("SELECT used FROM platform_budgets WHERE account_id = '777'") == 10
    finally:
        await other.close()


async def test_a_pause_avito_asks_for_holds_every_process_and_its_stated_limit_wins(
    settings: Settings, pool: asyncpg.Pool
) -> None:
    other = await create_pool(settings.database_url.get_secret_value(), size=2)
    try:
        sends, poll = SharedBudget(pool, "avito", 1000), SharedBudget(other, "avito", 1000)
        await sends.pause("777", 60)  # a 429 one process met
        with pytest.raises(BudgetSpent):
            await poll.take("777", share=0.5)
        await pool.execute("UPDATE platform_budgets SET paused_until = now()")
        await sends.observe("777", 2)  # Avito says: 2 a minute
        await sends.take("777")
        with pytest.raises(BudgetSpent):
            await poll.take("777", share=0.5)  # its share of 2 is 1, taken
    finally:
        await other.close()


async def test_a_pause_holds_the_account_for_as_long_as_avito_asked_not_to_the_end_of_the_minute(
    settings: Settings, pool: asyncpg.Pool
) -> None:
    """A 429 asking for 2 s, in a minute whose window has room: the next request waits for the
    pause, not for the minute to turn (it waited up to a minute: a reply in parts whose
    second part met a 429 stalled for most of a minute)."""
    sends = SharedBudget(pool, "avito", 1000)
    await sends.take("777")  # the window of this minute is in use, far from spent
    await sends.pause("777", 2)
    row = await pool.fetchrow(_TAKE, "avito", "777", 1000, 1.0)
    assert not row["granted"]
    assert 0 < float(row["wait"]) <= 2.0, row["wait"]
    # Spent, the window's end is the wait.
    await pool.execute("UPDATE platform_budgets SET paused_until = NULL, used = 1000")
    row = await pool.fetchrow(_TAKE, "avito", "777", 1000, 1.0)
    to_the_minute = await pool.fetchval(
        "SELECT extract(epoch FROM window_start + interval '1 minute' - clock_timestamp()) FROM platform_budgets"
    )
    assert not row["granted"]
    assert abs(float(row["wait"]) - float(to_the_minute)) < 1.0, (row["wait"], to_the_minute)
