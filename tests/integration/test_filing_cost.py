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
from shared.db import create_pool
from shared.messages import InboundMessage
from stores.windows.window import WindowPolicy

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


# Every index of the tables filing reads, primary keys included, and scans: a nested loop
# over a walk of a whole primary key is no scan by enable_seqscan's reckoning, yet reads
# every row.
READS = """
    SELECT (SELECT sum(idx_tup_read) FROM pg_stat_user_indexes WHERE relname = $1)
           + (SELECT seq_tup_read FROM pg_stat_user_tables WHERE relname = $1)
"""
READ_TABLES = ["operations", "reply_jobs", "chats", "chat_windows"]
IN_FLIGHT = 300  # chats with a reply job in flight (their new windows open blocked)
HELD = 300  # chats the seller holds


async def jobs_in_flight_and_held_chats(conn: asyncpg.Connection, now: datetime) -> None:
    """IN_FLIGHT chats (jf-1..) each with a closed window and a pending reply job, HELD
    chats (jh-1..) held by the seller for an hour."""
    await conn.execute(
        """
        INSERT INTO chats (chat_key, last_answered_sent_at, last_answered_message_id, last_reply_at,
                           seller_wrote_at, held_until)
        SELECT 'telegram:4242:jh-' || i, $1, 'm', $1, $1, $1::timestamptz + interval '1 hour'
        FROM generate_series(1, $2) i
        """,
        now,
        HELD,
    )
    await conn.execute(
        """
        WITH w AS (
            INSERT INTO chat_windows (id, chat_key, platform, account_id, chat_id, status, first_at, last_at,
                                      deadline_at, due_at, delay_seconds, message_count, closed_at, job_id)
            SELECT gen_random_uuid(), 'telegram:4242:jf-' || i, 'telegram', '4242', 'jf-' || i, 'closed',
                   $1, $1, $1, $1, 0, 1, $1, gen_random_uuid()
            FROM generate_series(1, $2) i
            RETURNING id, chat_key, chat_id, job_id
        )
        INSERT INTO reply_jobs (id, window_id, chat_key, platform, account_id, chat_id, status, operation_ids)
        SELECT w.job_id, w.id, w.chat_key, 'telegram', '4242', w.chat_id, 'pending', ARRAY[gen_random_uuid()]
        FROM w
        """,
        now,
        IN_FLIGHT,
    )


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


async def queued_in(conn: asyncpg.Connection, chats: list[str], at: datetime) -> list[uuid.UUID]:
    """One queued message in each of these chats."""
    ids = [uuid.uuid4() for _ in chats]
    await conn.execute(
        """
        INSERT INTO operations (id, platform, account_id, event_id, chat_id, message_id, author_id, text,
                                sent_at, status, received_at, payload)
        SELECT id, 'telegram', '4242', 'e-' || chat, chat, '1', 'u', 'hello', $3, 'queued', $3, '{}'
        FROM unnest($1::uuid[], $2::text[]) AS t(id, chat)
        """,
        ids,
        chats,
        at,
    )
    return ids


async def file_in(pool: asyncpg.Pool, ids: list[uuid.UUID], chats: list[str], now: datetime) -> None:
    """File message ids[i] of chat chats[i] as the coalescer's one batch; each filed."""
    messages = [
        m.model_copy(update={"chat_id": chat}) for m, chat in zip(inbound(ids, "", now), chats, strict=True)
    ]
    coalescer = Coalescer(pool, WindowPolicy(quiet=0, delay_min=30, delay_max=30, max_wait=60))
    filed = await coalescer.file_many(messages)
    assert all(f is not None and not isinstance(f, Exception) for f in filed)


async def test_a_full_batch_is_filed_by_key_from_the_first_call_of_a_session(infra) -> None:
    # PL/pgSQL plans a function's first five calls in a session for their values. With 64
    # messages beside 1,000, the move to waiting written as a join with unnest(ids) ran as a
    # nested loop over the whole primary key (1,256-1,752 rows read a batch), and the blocked
    # check written as EXISTS read every job in flight into a hashed set (both found by
    # reviews), where the loop before them read 3 rows of operations a message. Each batch
    # here is the first call of a fresh pool's session, on statistics of empty tables; a
    # third of its messages open a window in a chat with a job in flight, a third in a chat
    # the seller holds (both open blocked), the rest in new chats.
    now = datetime.now(UTC)
    per_batch = []
    third = FULL_BATCH // 3
    for b in range(3):
        chats = (
            [f"jf-{b * third + i + 1}" for i in range(third)]
            + [f"jh-{b * third + i + 1}" for i in range(third)]
            + [f"new{b}-{i + 1}" for i in range(FULL_BATCH - 2 * third)]
        )
        pool = await create_pool(infra.database_url, size=1)
        try:
            async with pool.acquire() as conn:
                if b == 0:
                    await conn.execute("ANALYZE")  # every table empty
                    await in_transit(conn, "crowd-", 1000, now - timedelta(seconds=5))
                    await jobs_in_flight_and_held_chats(conn, now)
                ids = await queued_in(conn, chats, now)
                await conn.execute("SELECT pg_stat_force_next_flush()")
                before = {t: await conn.fetchval(READS, t) for t in READ_TABLES}
            await file_in(pool, ids, chats, now)
            async with pool.acquire() as conn:
                await conn.execute("SELECT pg_stat_force_next_flush()")
                per_batch.append({t: await conn.fetchval(READS, t) - before[t] for t in READ_TABLES})
                blocked = await conn.fetchval(
                    "SELECT count(*) FROM chat_windows WHERE status = 'open' AND blocked AND chat_id = ANY($1::text[])",
                    chats,
                )
        finally:
            await pool.close()
        assert blocked == 2 * third  # the checks still see the jobs in flight and the holds
    print(
        f"\nrows read a batch of {FULL_BATCH} beside 1,000 in transit, {IN_FLIGHT} jobs in flight: {per_batch}"
    )
    # A message's reads, at most: of operations 4 (the lock step's probe, two foreign-key
    # checks, the move), of chat_windows 5 (the lock step's two probes by chat, the events'
    # by id, foreign-key checks), of reply_jobs and chats 1 (the blocked check's probes;
    # the hashed set read all 300 jobs in flight).
    most = {"operations": 4, "chat_windows": 5, "reply_jobs": 1, "chats": 1}
    for reads in per_batch:
        assert all(reads[t] <= FULL_BATCH * most[t] for t in READ_TABLES), per_batch


async def test_filing_opens_a_window_blocked_exactly_when_chatq_chat_blocked_says_the_chat_is(infra) -> None:
    # Filing inlines chatq_chat_blocked's two checks as probes (its own plans, made under
    # filing's settings, would stay cached for its other callers): the two must agree for
    # every job state and hold, or a window would open free while a reply is in flight.
    now = datetime.now(UTC)
    cases = [
        (job, hold)
        for job in (None, "pending", "processing", "sent", "superseded")
        for hold in (None, timedelta(hours=1), -timedelta(hours=1))
    ]
    chats = [f"eq-{i}" for i in range(len(cases))]
    pool = await create_pool(infra.database_url, size=1)
    try:
        async with pool.acquire() as conn:
            for chat, (job, hold) in zip(chats, cases, strict=True):
                key = f"telegram:4242:{chat}"
                if job is not None:
                    await conn.execute(
                        """
                        WITH w AS (
                            INSERT INTO chat_windows (id, chat_key, platform, account_id, chat_id, status, first_at,
                                                      last_at, deadline_at, due_at, delay_seconds, message_count,
                                                      closed_at, job_id)
                            VALUES (gen_random_uuid(), $1, 'telegram', '4242', $2, 'closed', $3, $3, $3, $3, 0, 1,
                                    $3, gen_random_uuid())
                            RETURNING id, job_id
                        )
                        INSERT INTO reply_jobs (id, window_id, chat_key, platform, account_id, chat_id, status,
                                                operation_ids, reply_text, sent_at)
                        SELECT w.job_id, w.id, $1, 'telegram', '4242', $2, $4, ARRAY[gen_random_uuid()],
                               CASE WHEN $4 = 'sent' THEN 'r' END, CASE WHEN $4 = 'sent' THEN $3::timestamptz END
                        FROM w
                        """,
                        key,
                        chat,
                        now,
                        job,
                    )
                if hold is not None:
                    await conn.execute(
                        """
                        INSERT INTO chats (chat_key, last_answered_sent_at, last_answered_message_id, last_reply_at,
                                           seller_wrote_at, held_until)
                        VALUES ($1, $2, 'm', $2, $2, $2::timestamptz + $3)
                        """,
                        key,
                        now,
                        hold,
                    )
            ids = await queued_in(conn, chats, now)
        await file_in(pool, ids, chats, now)
        async with pool.acquire() as conn:
            rows = await conn.fetch(
                """
                SELECT w.chat_id, w.blocked, chatq_chat_blocked(w.chat_key) AS by_function
                FROM chat_windows w WHERE w.status = 'open' AND w.chat_id = ANY($1::text[])
                """,
                chats,
            )
    finally:
        await pool.close()
    got = {r["chat_id"]: (r["blocked"], r["by_function"]) for r in rows}
    for chat, (job, hold) in zip(chats, cases, strict=True):
        expected = job in ("pending", "processing") or (hold is not None and hold > timedelta(0))
        assert got[chat] == (expected, expected), (job, hold, got[chat])
