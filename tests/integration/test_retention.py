"""Retention: finished rows past the retention period go; unfinished rows, what a person
must still act on, and each chat's last-answered marker stay."""

from __future__ import annotations

import asyncpg
import pytest

from shared.retention import RETENTION_LOCK_KEY, Retention
from tests.support.pipeline import ADMIN, Pipeline

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("clean")]


async def counts(pool: asyncpg.Pool) -> dict[str, int]:
    tables = (
        "operations",
        "reply_jobs",
        "chat_windows",
        "window_messages",
        "reply_coverage",
        "deliveries",
        "chats",
    )
    return {t: await pool.fetchval(f"SELECT count(*) FROM {t}") for t in tables}


async def test_finished_rows_past_the_period_are_purged_and_what_a_person_holds_stays(
    pipeline: Pipeline, pool: asyncpg.Pool, world
) -> None:
    replied = await pipeline.telegram(1, 11, "Do you deliver?")
    assert (await pipeline.settled(replied))["status"] == "replied"
    world.fail("telegram.send", "400")
    failed = await pipeline.telegram(2, 22, "Price?")
    assert (await pipeline.settled(failed))["status"] == "failed"
    before = await counts(pool)
    assert before["operations"] == 2 and before["reply_jobs"] == 2

    # Nothing is old enough yet.
    assert await Retention(pool, keep_seconds=3600).purge() == {}
    # Everything is, now: the replied message and its job, window and delivery go; the
    # failed one (a person must act) and its job stay, and so do both chats' markers.
    await pool.execute(
        "UPDATE operations SET received_at = now() - interval '3 hours', updated_at = now() - interval '2 hours'"
    )
    await pool.execute(
        "UPDATE reply_jobs SET created_at = now() - interval '3 hours', updated_at = now() - interval '2 hours'"
    )
    await pool.execute("UPDATE chat_windows SET closed_at = now() - interval '2 hours'")
    purged = await Retention(pool, keep_seconds=3600, chunk=1).purge()

    assert purged == {"operations": 1, "reply_jobs": 1, "chat_windows": 1}
    left = await pool.fetch("SELECT id::text, status FROM operations")
    assert [(r["id"], r["status"]) for r in left] == [(failed, "failed")]
    assert await pool.fetchval("SELECT count(*) FROM reply_jobs WHERE status = 'failed'") == 1
    assert (await counts(pool))["chats"] == before["chats"] == 1
    doc = (await pipeline.client.get(f"/v1/operations/{failed}", headers=ADMIN)).json()
    assert doc["status"] == "failed"
    # The event record leaves with its operation, and only with it.
    assert (
        await pool.fetchval("SELECT count(*) FROM operation_events WHERE operation_id::text = $1", replied)
        == 0
    )
    assert [e["kind"] for e in doc["timeline"]][-1] == "failed"


async def test_a_message_received_long_ago_but_finished_lately_stays_for_the_whole_period(
    pipeline: Pipeline, pool: asyncpg.Pool
) -> None:
    """A person retried a week-old message today: its operation and reply count from their
    last change, not from the receipt."""
    op = await pipeline.telegram(1, 11, "Do you deliver?")
    assert (await pipeline.settled(op))["status"] == "replied"
    await pool.execute("UPDATE operations SET received_at = now() - interval '7 days'")
    await pool.execute("UPDATE reply_jobs SET created_at = now() - interval '7 days'")

    assert await Retention(pool, keep_seconds=3600).purge() == {}
    assert await pool.fetchval("SELECT count(*) FROM operations") == 1
    assert await pool.fetchval("SELECT count(*) FROM reply_jobs") == 1


async def test_one_replica_purges_at_a_time(pool: asyncpg.Pool) -> None:
    async with pool.acquire() as other:
        assert await other.fetchval("SELECT pg_try_advisory_lock($1)", RETENTION_LOCK_KEY)
        try:
            await pool.execute("INSERT INTO dead_letters (queue, reason, body) VALUES ('q', 'r', '')")
            await pool.execute("UPDATE dead_letters SET recorded_at = now() - interval '2 days'")
            assert await Retention(pool, keep_seconds=60).purge() == {}
        finally:
            await other.execute("SELECT pg_advisory_unlock($1)", RETENTION_LOCK_KEY)
    assert await Retention(pool, keep_seconds=60).purge() == {"dead_letters": 1}
