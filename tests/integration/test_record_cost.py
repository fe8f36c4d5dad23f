"""What recording the replies of several jobs costs Postgres (issue 20). The record of a
batch writes each table once for all its jobs (chatq_record_sent_many): the jobs, their
deliveries, their messages, their events and their chats. Set-based, a statement can be
planned as a walk of a partial index its status check implies (the jobs in flight, the
messages in transit) instead of a lookup of the keys it was given, and PL/pgSQL keeps
that plan for the session; the statistics here are taken while nothing was in flight (a
quiet minute, the benchmark's warm-up), and 2,000 jobs are in flight when the batches are
recorded. The count is read from Postgres' own index statistics, so it does not depend on
the machine's speed."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

import asyncpg
import pytest

from shared.db import create_pool

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("clean")]

IN_FLIGHT = 2000
BATCHES = 8
EACH = 6


async def jobs_in_flight(conn: asyncpg.Connection, prefix: str, n: int) -> list[uuid.UUID]:
    """n jobs of n chats, each claimed (processing, its delivery intent recorded) with one
    message waiting."""
    now = datetime.now(UTC)
    ops, windows, jobs = ([uuid.uuid4() for _ in range(n)] for _ in range(3))
    await conn.execute(
        """
        INSERT INTO operations (id, platform, account_id, event_id, chat_id, message_id, author_id, text,
                                sent_at, status, received_at, payload)
        SELECT id, 'telegram', '4242', $2 || i, $2 || i, '1', 'u', 'hello', $3, 'waiting', $3, '{}'
        FROM unnest($1::uuid[]) WITH ORDINALITY AS t(id, i)
        """,
        ops,
        prefix,
        now,
    )
    await conn.execute(
        """
        INSERT INTO chat_windows (id, chat_key, platform, account_id, chat_id, status, first_at, last_at,
                                  deadline_at, due_at, delay_seconds, message_count, closed_at, job_id)
        SELECT w, 'telegram:4242:' || $3 || i, 'telegram', '4242', $3 || i, 'closed', $4, $4, $4, $4, 0, 1, $4, j
        FROM unnest($1::uuid[], $2::uuid[]) WITH ORDINALITY AS t(w, j, i)
        """,
        windows,
        jobs,
        prefix,
        now,
    )
    await conn.execute(
        """
        INSERT INTO reply_jobs (id, window_id, chat_key, platform, account_id, chat_id, status, operation_ids,
                                attempts)
        SELECT j, w, 'telegram:4242:' || $4 || i, 'telegram', '4242', $4 || i, 'processing', ARRAY[o], 1
        FROM unnest($1::uuid[], $2::uuid[], $3::uuid[]) WITH ORDINALITY AS t(j, w, o, i)
        """,
        jobs,
        windows,
        ops,
        prefix,
    )
    await conn.execute(
        "UPDATE operations o SET job_id = t.j FROM unnest($1::uuid[], $2::uuid[]) AS t(o, j) WHERE o.id = t.o",
        ops,
        jobs,
    )
    await conn.execute(
        "INSERT INTO reply_coverage (operation_id, job_id) SELECT * FROM unnest($1::uuid[], $2::uuid[])",
        ops,
        jobs,
    )
    await conn.execute(
        "INSERT INTO deliveries (job_id, status, text, attempt, started_at)"
        " SELECT j, 'sending', 'a reply', 1, now() FROM unnest($1::uuid[]) AS j",
        jobs,
    )
    return jobs


# Every row read other than by its primary key, in the tables the record updates: by any
# other index, or by a scan of the table. (chats, which it inserts into by its key, is read
# by the trigger that unblocks each chat's next window: a scan while it holds a few rows.)
READ_NOT_BY_KEY = """
SELECT (SELECT coalesce(sum(idx_tup_read), 0) FROM pg_stat_user_indexes
        WHERE relname = ANY($1::name[]) AND indexrelname NOT IN ('operations_pkey', 'reply_jobs_pkey',
              'deliveries_pkey'))
       + (SELECT coalesce(sum(seq_tup_read), 0) FROM pg_stat_user_tables WHERE relname = ANY($1::name[]))
"""
TABLES = ["operations", "reply_jobs", "deliveries"]


async def test_a_record_of_several_jobs_writes_each_by_key_even_when_the_statistics_predate_the_jobs_in_flight(
    infra,
) -> None:
    # One connection for the records and the counts: a backend's own statistics are flushed
    # on demand (pg_stat_force_next_flush), another's only about a second later.
    pool = await create_pool(infra.database_url, size=1)
    try:
        async with pool.acquire() as conn:
            await conn.execute("ANALYZE")  # nothing in flight
            await jobs_in_flight(conn, "busy-", IN_FLIGHT)
            batches = [await jobs_in_flight(conn, f"b{b}-", EACH) for b in range(BATCHES)]
            await conn.execute("SELECT pg_stat_force_next_flush()")
            before = await conn.fetchval(READ_NOT_BY_KEY, TABLES)
            for b, jobs in enumerate(batches):
                rows = await conn.fetch(
                    "SELECT * FROM chatq_record_sent_many($1, $2, $3, $4) ORDER BY i",
                    jobs,
                    [f"reply {n}" for n in range(EACH)],
                    [f"m-{b}-{n}" for n in range(EACH)],
                    [b * 100 + n for n in range(EACH)],
                )
                assert [r["i"] for r in rows] == list(range(1, EACH + 1))
                assert all(len(r["received_ats"]) == 1 for r in rows)
            await conn.execute("SELECT pg_stat_force_next_flush()")
            read = await conn.fetchval(READ_NOT_BY_KEY, TABLES) - before
            recorded = await conn.fetchrow(
                """
                SELECT (SELECT count(*) FROM reply_jobs WHERE status = 'sent') AS jobs,
                       (SELECT count(*) FROM deliveries WHERE status = 'sent') AS deliveries,
                       (SELECT count(*) FROM operations WHERE status = 'replied') AS replied,
                       (SELECT count(*) FROM operation_events WHERE kind = 'replied') AS events,
                       (SELECT count(*) FROM chats) AS chats
                """
            )
    finally:
        await pool.close()
    n = BATCHES * EACH
    assert dict(recorded) == {"jobs": n, "deliveries": n, "replied": n, "events": n, "chats": n}
    print(
        f"\nrecording {BATCHES} batches of {EACH} beside {IN_FLIGHT} in flight: {read} rows read other than by key"
    )
    # Past PL/pgSQL's fifth call its plans are generic: still by key, not the 2,000 in flight.
    assert read < n
