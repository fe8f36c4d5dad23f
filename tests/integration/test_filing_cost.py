"""What filing a batch of messages costs Postgres (issue 20), on statistics taken while no
message was in transit: after a quiet minute, or the benchmark's warm-up, when the
coalescer had filed everything. Filing moves each message from 'accepted'/'queued' to
'waiting' by key; the planner, expecting no message in transit, ran that update as a walk
of the index of the messages in transit (its predicate is implied by those statuses), every entry
left by the messages since the last vacuum: 1.8 ms a batch of 10 under bench.pipeline
(found with pg_stat_statements), growing with the traffic. The count is read from
Postgres' own index statistics, so it does not depend on the machine's speed."""

from __future__ import annotations

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
            filed = await coalescer.file_many(
                [
                    InboundMessage(
                        operation_id=op,
                        platform="telegram",
                        account_id="4242",
                        chat_id=f"b{b}-{i + 1}",
                        message_id="1",
                        author_id="u",
                        text="hello",
                        sent_at=now,
                        received_at=now,
                    )
                    for i, op in enumerate(ids)
                ]
            )
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
