"""What reading the outbox's unpublished rows costs Postgres (issue 20), on statistics taken
while every row was published: after a quiet minute, or the benchmark's warm-up, when
the relay had caught up. The planner then expects no unpublished row, so both partial
indexes of the unpublished rows look empty, and it took the smaller one, by exchange and
id, for probes that name the chat too:

- the relay's probe of whether a row is its chat's head read every earlier unpublished
  row of the exchange: n^2/2 rows for a claim of n;
- the status a person reads ('accepted' or 'queued', chatq_shown_status) read every
  unpublished row of the exchange for each message, and the backlog gauges, which read
  it for every unfinished message every 10 s, took 1-2.7 s of Postgres a refresh under
  bench.pipeline (found with pg_stat_statements).

The counts come from EXPLAIN (ANALYZE, BUFFERS) of the statements the services run, so
they do not depend on the machine's speed."""

from __future__ import annotations

import json
import uuid
from typing import Any

import asyncpg
import pytest

from services.receiver.admin.read import collect_stats
from shared.broker.topology import INBOUND_EXCHANGE
from shared.outbox import _CLAIM_MANY_SQL, _CLAIM_ONE_SQL
from tests.integration.test_scheduler_cost import rows_read

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("clean")]

PUBLISHED = 5000
UNPUBLISHED = 2000
BATCH = 200


async def statistics_taken_with_every_row_published(conn: asyncpg.Connection) -> None:
    await conn.execute(
        """
        INSERT INTO outbox (exchange, routing_key, message_id, ordering_key, body, created_at, published_at)
        SELECT $1, 'inbound.telegram', 'old-' || g, 'telegram:bot:old-' || g, '\\x00'::bytea,
               clock_timestamp() - interval '1 minute', clock_timestamp()
        FROM generate_series(1, $2) g
        """,
        INBOUND_EXCHANGE,
        PUBLISHED,
    )
    await conn.execute("ANALYZE outbox")


async def accepted_messages_waiting_for_the_relay(conn: asyncpg.Connection, n: int) -> list[uuid.UUID]:
    """n messages of n chats, each 'accepted' with its inbound outbox row unpublished."""
    ids = [uuid.uuid4() for _ in range(n)]
    await conn.execute(
        """
        INSERT INTO operations (id, platform, account_id, event_id, chat_id, message_id, author_id, text,
                                sent_at, status, payload)
        SELECT id, 'telegram', 'bot', 'e-' || i, 'c-' || i, 'm-' || i, 'u', 'hello', now(), 'accepted', '{}'
        FROM unnest($1::uuid[]) WITH ORDINALITY AS t(id, i)
        """,
        ids,
    )
    await conn.execute(
        """
        INSERT INTO outbox (exchange, routing_key, message_id, ordering_key, operation_id, body)
        SELECT $2, 'inbound.telegram', id::text, chatq_chat_key('telegram', 'bot', 'c-' || i), id,
               '\\x00'::bytea
        FROM unnest($1::uuid[]) WITH ORDINALITY AS t(id, i)
        """,
        ids,
        INBOUND_EXCHANGE,
    )
    return ids


async def explained(conn: asyncpg.Connection, sql: str, *args: Any) -> dict[str, Any]:
    """EXPLAIN (ANALYZE, BUFFERS) of ``sql``, in a transaction rolled back (a claim locks)."""
    tx = conn.transaction()
    await tx.start()
    try:
        (plan,) = json.loads(await conn.fetchval("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + sql, *args))
    finally:
        await tx.rollback()
    return plan


CLAIMS = {
    "one exchange": (_CLAIM_ONE_SQL, INBOUND_EXCHANGE),
    "several exchanges": (_CLAIM_MANY_SQL, [INBOUND_EXCHANGE]),
}


@pytest.mark.parametrize("plan_cache_mode", ["force_custom_plan", "force_generic_plan"])
@pytest.mark.parametrize("claim", list(CLAIMS))
async def test_a_relay_claim_reads_each_rows_chat_once_even_when_the_statistics_predate_the_backlog(
    pool: asyncpg.Pool, claim: str, plan_cache_mode: str
) -> None:
    """2,000 chats with a message each, on statistics taken while every row was published:
    whether each row heads its chat is one probe of that chat's unpublished rows, not a walk
    over the exchange's earlier rows (BATCH^2/2 = 20,000 rows for a claim of 200); in the
    plan made for the values, and in the one Postgres keeps for any values."""
    sql, exchanges = CLAIMS[claim]
    async with pool.acquire() as conn:
        await statistics_taken_with_every_row_published(conn)
        await accepted_messages_waiting_for_the_relay(conn, UNPUBLISHED)
        await conn.execute(f"SET plan_cache_mode = {plan_cache_mode}")
        try:
            plan = await explained(conn, sql, BATCH, exchanges)
        finally:
            await conn.execute("RESET plan_cache_mode")
    assert plan["Plan"]["Actual Rows"] == BATCH
    read = rows_read(plan["Plan"], "outbox")
    print(f"\nrelay claim of {BATCH} behind {UNPUBLISHED} chats, statistics older: {read:.0f} rows of outbox")
    # The 200 rows taken, and no earlier row of their chats (each chat has one).
    assert read <= 2 * BATCH


async def test_a_relay_of_one_exchange_keeps_one_plan_for_its_claim(pool: asyncpg.Pool) -> None:
    """Over an array of exchanges, whose length a cached plan cannot know, the generic plan
    always looked dearer than a custom one: the claim was planned again on every call (half
    its cost under bench.pipeline). A relay of one exchange names it as a scalar."""
    async with pool.acquire() as conn:
        await statistics_taken_with_every_row_published(conn)
        await accepted_messages_waiting_for_the_relay(conn, UNPUBLISHED)
        tx = conn.transaction()
        await tx.start()
        try:
            for _ in range(10):
                await conn.fetch(_CLAIM_ONE_SQL, BATCH, INBOUND_EXCHANGE)
            generic = await conn.fetchval(
                "SELECT generic_plans FROM pg_prepared_statements WHERE statement = $1", _CLAIM_ONE_SQL
            )
        finally:
            await tx.rollback()
    assert generic is not None and generic >= 4


async def test_the_status_a_person_reads_costs_one_probe_of_the_messages_chat_even_when_the_statistics_predate_the_backlog(
    pool: asyncpg.Pool,
) -> None:
    """Whether a message is still 'accepted' (its inbound row unpublished) or 'queued' is one
    probe of its chat's unpublished rows: a few buffers, not the exchange's 2,000."""
    async with pool.acquire() as conn:
        await statistics_taken_with_every_row_published(conn)
        ids = await accepted_messages_waiting_for_the_relay(conn, UNPUBLISHED)
        sample = ids[::20]
        plan = await explained(
            conn,
            "SELECT chatq_shown_status(status, id, platform, account_id, chat_id) FROM operations"
            " WHERE id = ANY($1::uuid[])",
            sample,
        )
        shown = await conn.fetch(
            "SELECT chatq_shown_status(status, id, platform, account_id, chat_id) AS s FROM operations"
            " WHERE id = ANY($1::uuid[])",
            sample,
        )
    assert {r["s"] for r in shown} == {"accepted"}
    per_message = plan["Plan"]["Shared Hit Blocks"] / len(sample)
    print(f"\nshown status of one of {UNPUBLISHED} waiting messages: {per_message:.1f} buffers")
    # The operation's row (primary key) and one probe of the chat's head (index and heap).
    assert per_message < 12


async def test_the_backlog_gauges_read_each_unfinished_message_once(pool: asyncpg.Pool) -> None:
    """The counts behind chatq_backlog: 2,000 messages the relay has not published read
    'accepted', and after it publishes half of them those read 'queued', each counted once."""
    async with pool.acquire() as conn:
        await statistics_taken_with_every_row_published(conn)
        ids = await accepted_messages_waiting_for_the_relay(conn, UNPUBLISHED)
    stats = await collect_stats(pool)
    assert stats["backlog"]["accepted"]["count"] == UNPUBLISHED
    assert stats["backlog"]["queued"]["count"] == 0
    await pool.execute(
        "UPDATE outbox SET published_at = clock_timestamp() WHERE operation_id = ANY($1::uuid[])",
        ids[: UNPUBLISHED // 2],
    )
    stats = await collect_stats(pool)
    assert stats["backlog"]["accepted"]["count"] == UNPUBLISHED // 2
    assert stats["backlog"]["queued"]["count"] == UNPUBLISHED // 2
