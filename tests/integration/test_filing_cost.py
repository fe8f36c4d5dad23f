"""What filing a batch of messages costs Postgres (issue 20), on statistics taken while no
message was in transit: after a quiet minute, or the benchmark's warm-up, when the
coalescer had filed everything. Filing moves each message from 'accepted'/'queued' to
'waiting' by key; the planner, expecting no message in transit, ran that update as a walk
of the index of the messages in transit (its predicate is implied by those statuses), every entry
left by the messages since the last vacuum: 1.8 ms a batch of 10 under bench.pipeline
(found with pg_stat_statements), growing with the traffic. The count is read from
Postgres' own index statistics, so it does not depend on the machine's speed."""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime, timedelta

import asyncpg
import pytest

from services.coalescer.service import Coalescer
from services.coalescer.windows import WindowPolicy
from shared.db import create_pool
from shared.messages import InboundMessage

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("clean")]

IN_TRANSIT = 2000
BATCHES = 8
EACH = 10


async def in_transit(conn: asyncpg.Connection, prefix: str, n: int, at: datetime) -> list[uuid.UUID]:
    """n messages of n chats, queued (published, not yet filed)."""
    ids = [uuid.uuid4() for _ in range(n)]
    await conn.execute(
        """
        INSERT INTO operations (id, platform, account_id, event_id, chat_id, message_id, author_id, text,
                                sent_at, status, received_at, payload)
        SELECT id, 'telegram', '4242', $2 || i, $2 || i, '1', 'u', 'hello', $3, 'queued', $3, '{}'
        FROM unnest($1::uuid[]) WITH ORDINALITY AS t(id, i)
        """,
        ids,
        prefix,
        at,
    )
    return ids


async def test_filing_moves_each_message_by_key_even_when_the_statistics_predate_the_messages_in_transit(
    infra,
) -> None:
    now = datetime.now(UTC)
    # One connection for the filings and the counts: a backend's own statistics are flushed
    # on demand (pg_stat_force_next_flush), another's only about a second later.
    pool = await create_pool(infra.database_url, size=1)
    try:
        async with pool.acquire() as conn:
            await conn.execute("ANALYZE operations")  # no message in transit
            await in_transit(conn, "busy-", IN_TRANSIT, now - timedelta(seconds=5))
            batches = [await in_transit(conn, f"b{b}-", EACH, now) for b in range(BATCHES)]
        coalescer = Coalescer(pool, WindowPolicy(quiet=0, delay_min=30, delay_max=30, max_wait=60))
        # Every row of operations read other than by its primary key: by any other index (after
        # 0029 the walk moved from the in-transit index to operations_status_received, 16,640
        # entries) or by a scan of the table.
        counts = """
            SELECT (SELECT sum(idx_tup_read) FROM pg_stat_user_indexes
                    WHERE relname = 'operations' AND indexrelname <> 'operations_pkey')
                   + (SELECT seq_tup_read FROM pg_stat_user_tables WHERE relname = 'operations')
        """
        async with pool.acquire() as conn:
            await conn.execute("SELECT pg_stat_force_next_flush()")
            before = await conn.fetchval(counts)
        for b, ids in enumerate(batches):
            filed = await coalescer.file_many(inbound(ids, f"b{b}-", now))
            assert all(f is not None and not isinstance(f, Exception) for f in filed)
        async with pool.acquire() as conn:
            await conn.execute("SELECT pg_stat_force_next_flush()")
            read = await conn.fetchval(counts) - before
            waiting = await conn.fetchval(
                "SELECT count(*) FROM operations WHERE status = 'waiting' AND id = ANY($1::uuid[])",
                [op for ids in batches for op in ids],
            )
    finally:
        await pool.close()
    assert waiting == BATCHES * EACH
    print(
        f"\nfiling {BATCHES} batches of {EACH} beside {IN_TRANSIT} in transit: {read} rows read other than by key"
    )
    # Past PL/pgSQL's fifth call its plan is generic: still by key, not the 2,000 in transit.
    assert read < BATCHES * EACH * 10


# Every index of operations, its primary key included, and scans: a nested loop over a walk
# of the whole primary key is no scan by enable_seqscan's reckoning, yet reads every row.
ALL_READS = """
    SELECT (SELECT sum(idx_tup_read) FROM pg_stat_user_indexes WHERE relname = 'operations')
           + (SELECT seq_tup_read FROM pg_stat_user_tables WHERE relname = 'operations')
"""
FULL_BATCH = 64  # Settings.coalescer_file_batch_messages' default


def inbound(ops: list[uuid.UUID], prefix: str, now: datetime) -> list[InboundMessage]:
    return [
        InboundMessage(
            operation_id=op,
            platform="telegram",
            account_id="4242",
            chat_id=f"{prefix}{i + 1}",
            message_id="1",
            author_id="u",
            text="hello",
            sent_at=now,
            received_at=now,
        )
        for i, op in enumerate(ops)
    ]


async def test_a_full_batch_is_filed_by_key_from_the_first_call_of_a_session(infra) -> None:
    # PL/pgSQL plans a function's first five calls in a session for their values: with 64
    # messages beside 1,000, the move to waiting written as a join with unnest(ids) ran as a
    # nested loop over the whole primary key (1,256-1,752 rows read a batch, found by a
    # review), where the loop before it read 3 a message. Each batch here is the first call
    # of a fresh pool's session.
    now = datetime.now(UTC)
    per_batch = []
    for b in range(3):
        pool = await create_pool(infra.database_url, size=1)
        try:
            async with pool.acquire() as conn:
                if b == 0:
                    await conn.execute("ANALYZE operations")  # no message in transit
                    await in_transit(conn, "crowd-", 1000, now - timedelta(seconds=5))
                ids = await in_transit(conn, f"full{b}-", FULL_BATCH, now)
                await conn.execute("SELECT pg_stat_force_next_flush()")
                before = await conn.fetchval(ALL_READS)
            coalescer = Coalescer(pool, WindowPolicy(quiet=0, delay_min=30, delay_max=30, max_wait=60))
            filed = await coalescer.file_many(inbound(ids, f"full{b}-", now))
            assert all(f is not None and not isinstance(f, Exception) for f in filed)
            async with pool.acquire() as conn:
                await conn.execute("SELECT pg_stat_force_next_flush()")
                per_batch.append(await conn.fetchval(ALL_READS) - before)
        finally:
            await pool.close()
    print(f"\nrows of operations read a batch of {FULL_BATCH} beside 1,000 in transit: {per_batch}")
    # The lock step's probe, two foreign-key checks and the move: at most 4 a message.
    assert max(per_batch) <= FULL_BATCH * 4, per_batch


async def test_filing_locks_a_batchs_messages_in_key_order_so_a_writer_in_that_order_never_deadlocks_it(
    infra,
) -> None:
    # The claim of a batch of jobs (chatq_claim_jobs) moves their messages by id = ANY, in
    # key order. Were filing to lock in another order (its plan's: a walk, or the batch's),
    # a writer holding the first message by key while filing waits on it could then ask for
    # one filing already holds: a deadlock, and a failed batch. In key order filing holds
    # nothing past the message it waits on.
    now = datetime.now(UTC)
    filer = await asyncpg.connect(infra.database_url)
    writer = await asyncpg.connect(infra.database_url)
    try:
        await filer.execute("ANALYZE operations")
        await in_transit(filer, "crowd2-", 1000, now - timedelta(seconds=5))
        ids = await in_transit(filer, "order-", FULL_BATCH, now)
        by_key = sorted(ids, key=lambda u: u.bytes)
        tx = writer.transaction()
        await tx.start()
        await writer.execute("UPDATE operations SET updated_at = now() WHERE id = $1", by_key[0])
        windows = [uuid.uuid4() for _ in ids]
        n = len(ids)
        due = now + timedelta(seconds=30)
        filing = asyncio.create_task(
            filer.execute(
                """
                SELECT chatq_file_messages($1::uuid[], $2::boolean[], $3::text[], $4::text[], $5::text[],
                    $6::text[], $7::timestamptz[], $8::timestamptz[], $9::timestamptz[], $10::timestamptz[],
                    $11::float8[], $12::int[], $13::uuid[], $14::uuid[], $15::timestamptz[])
                """,
                windows,
                [True] * n,
                [f"telegram:4242:order-{i + 1}" for i in range(n)],
                ["telegram"] * n,
                ["4242"] * n,
                [f"order-{i + 1}" for i in range(n)],
                [now] * n,
                [now] * n,
                [now + timedelta(seconds=60)] * n,
                [due] * n,
                [30.0] * n,
                [1] * n,
                ids,
                windows,
                [due] * n,
            )
        )
        deadline = asyncio.get_running_loop().time() + 20
        while not await writer.fetchval(
            "SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = $1", filer.get_server_pid()
        ):
            assert asyncio.get_running_loop().time() < deadline, "filing never waited on the held message"
            await asyncio.sleep(0.05)
        # Filing waits on the first message by key; the writer now takes the last (and the
        # batch's first, if another): filing holds neither.
        for op in {by_key[-1], ids[0]} - {by_key[0]}:
            await writer.execute("UPDATE operations SET updated_at = now() WHERE id = $1", op)
        await tx.commit()
        await asyncio.wait_for(filing, 20)  # no deadlock: it goes on once the writer is done
        waiting = await filer.fetchval(
            "SELECT count(*) FROM operations WHERE id = ANY($1::uuid[]) AND status = 'waiting'", ids
        )
    finally:
        await filer.close()
        await writer.close()
    assert waiting == FULL_BATCH
