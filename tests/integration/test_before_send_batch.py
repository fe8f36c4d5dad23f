"""The step before a batch's sends at once (chatq_before_send_many, issue 20) against the
same step for each job alone (chatq_before_send, which the batch called once a job
before). Random batches are claimed first (test_claim_batch's seeds), then their chats get
what takes a job off the common way: an open window with messages to fold in (now and
then more than a job may carry), the seller writing since the job was built, the account
paused or removed, an earlier attempt's delivery row. Each batch takes the step both ways
on the same rows (a savepoint between them): the rows returned, every row written, and
the error raised (an account paused or removed fails the statement, and the responder
then asks each job alone) must be equal. A cost test then checks the batch reads its
tables by key with statistics taken while nothing was in flight, and a test of two
sessions that it takes its chats' locks in the order a filing does (one session cannot
see a deadlock)."""

from __future__ import annotations

import asyncio
import random
import uuid
from datetime import timedelta
from typing import Any

import asyncpg
import pytest

from tests.integration.test_claim_batch import NEW as CLAIM
from tests.integration.test_claim_batch import READ_NOT_BY_KEY, T0, comparable, seed_batch
from tests.integration.test_record_cost import jobs_in_flight

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("clean")]

BATCHES = 150
MAX_MESSAGES, MAX_CHARS = 4, 4000

BATCHED = "SELECT * FROM chatq_before_send_many($1, $2, $3, $4, $5, $6, $7) ORDER BY i, pos"
# What the responder sent before: chatq_before_send for each job, in the chats' lock order.
ONE_BY_ONE = """
SELECT t.i::integer AS i, b.*
FROM (
    SELECT * FROM unnest($1::uuid[], $2::text[], $3::text[], $4::integer[], $5::boolean[])
        WITH ORDINALITY AS u(job, chat_key, body, attempt, fold, i)
    ORDER BY hashtextextended(u.chat_key, 0)
) t
CROSS JOIN LATERAL chatq_before_send(t.job, t.chat_key, t.body, t.attempt, t.fold, $6, $7) AS b
ORDER BY t.i, b.pos
"""

# What the step writes, without the clock.
STATE = """
SELECT (SELECT array_agg((id, status, operation_ids, folded, error_message)::text ORDER BY id) FROM reply_jobs),
       (SELECT array_agg((id, status, status_reason, job_id)::text ORDER BY id) FROM operations),
       (SELECT array_agg((operation_id, job_id)::text ORDER BY operation_id) FROM reply_coverage),
       (SELECT array_agg((job_id, status, text, attempt, finished_at, error, platform_message_id, maybe_sent,
                          maybe_since IS NOT NULL)::text ORDER BY job_id) FROM deliveries),
       (SELECT array_agg((id, status)::text ORDER BY id) FROM chat_windows),
       (SELECT array_agg((operation_id, window_id)::text ORDER BY operation_id) FROM window_messages),
       (SELECT array_agg((operation_id, kind, detail, job_id)::text ORDER BY operation_id, kind, detail, job_id)
        FROM operation_events)
"""


async def stepped_and_written(conn: asyncpg.Connection, query: str, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """What ``query`` returns (or the error it raises) and writes; then all of it undone."""
    savepoint = conn.transaction()
    await savepoint.start()
    try:
        try:
            rows: Any = comparable(await conn.fetch(query, *args))
        except asyncpg.PostgresError as exc:
            return ("error", exc.sqlstate, str(exc))
        return rows, list(await conn.fetchrow(STATE))
    finally:
        await savepoint.rollback()


async def off_the_common_way(conn: asyncpg.Connection, rnd: random.Random, tag: str, jobs: list[Any]) -> None:
    """Open windows to fold, sellers' answers, accounts paused or removed, earlier intents."""
    for n, (job, chat_key, chat_id, account, created) in enumerate(jobs):
        if rnd.random() < 0.35:
            window = uuid.uuid4()
            await conn.execute(
                """
                INSERT INTO chat_windows (id, chat_key, platform, account_id, chat_id, status, first_at, last_at,
                                          deadline_at, due_at, delay_seconds, message_count)
                VALUES ($1, $2, 'telegram', $3, $4, 'open', $5, $5, $5, $5, 0, 1)
                """,
                window, chat_key, account, chat_id, T0 + timedelta(seconds=30),
            )  # fmt: skip
            for m in range(rnd.choice([1, 1, 2, 4])):  # 4: past what one job carries
                op = uuid.uuid4()
                await conn.execute(
                    """
                    INSERT INTO operations (id, platform, account_id, event_id, chat_id, message_id, text, sent_at,
                                            status, received_at, payload)
                    VALUES ($1, 'telegram', $2, $3, $4, $5, 'late ' || $5::text, $6::timestamptz, 'waiting', $6::timestamptz, '{}')
                    """,
                    op, account, f"{tag}-late-{n}-{m}", chat_id, f"9{n}{m}", T0 + timedelta(seconds=20 + m),
                )  # fmt: skip
                await conn.execute(
                    "INSERT INTO window_messages (operation_id, window_id) VALUES ($1, $2)", op, window
                )
        if rnd.random() < 0.1:
            await conn.execute(
                """
                INSERT INTO chats (chat_key, last_answered_sent_at, last_answered_message_id,
                                   last_answered_received_at, last_reply_at, seller_wrote_at, seller_message_id)
                VALUES ($1, $3, '1', $3, $3, $2, 's-9')
                ON CONFLICT (chat_key) DO UPDATE SET seller_wrote_at = EXCLUDED.seller_wrote_at,
                                                     seller_message_id = EXCLUDED.seller_message_id
                """,
                chat_key, created + timedelta(seconds=1), T0 - timedelta(minutes=5),
            )  # fmt: skip
        if rnd.random() < 0.05:
            await conn.execute(
                """
                INSERT INTO accounts (platform, account_id, state, state_reason, removed_at)
                VALUES ('telegram', $1, 'paused_by_person', 'a person paused it', CASE WHEN $2 THEN now() END)
                ON CONFLICT (platform, account_id) DO UPDATE
                SET state = EXCLUDED.state, state_reason = EXCLUDED.state_reason, removed_at = EXCLUDED.removed_at
                """,
                account, rnd.random() < 0.5,
            )  # fmt: skip
        if rnd.random() < 0.2:
            await conn.execute(
                """
                INSERT INTO deliveries (job_id, status, text, attempt, started_at, maybe_sent, maybe_since)
                VALUES ($1, $2, 'an earlier attempt', 1, $3::timestamptz, $4, CASE WHEN $4 THEN $3::timestamptz END)
                ON CONFLICT (job_id) DO NOTHING
                """,
                job, rnd.choice(["sending", "unknown", "not_sent"]), created, rnd.random() < 0.3,
            )  # fmt: skip


async def test_the_step_before_sending_a_batch_gives_every_job_the_rows_and_the_writes_of_its_own_step(pool):
    rnd = random.Random(21)
    # "intent only": no rows returned, the intent recorded (the common way, or a fold the caps
    # refused).
    seen = {"intent only": 0, "folded": 0, "withdrawn": 0, "error": 0}
    async with pool.acquire() as conn:
        for b in range(BATCHES):
            tx = conn.transaction()
            await tx.start()
            try:
                seeded = await seed_batch(conn, rnd, f"s{b}")
                keys = [b * 1000 + n for n in range(len(seeded))]
                claims = await conn.fetch(CLAIM, seeded, [1] * len(seeded), keys, 0)
                await conn.execute("SELECT pg_advisory_unlock_all()")
                claimed = [seeded[r["i"] - 1] for r in claims if r["outcome"] == "claimed"]
                if not claimed:
                    continue
                rows = await conn.fetch(
                    "SELECT id, chat_key, chat_id, account_id, created_at FROM reply_jobs WHERE id = ANY($1)",
                    claimed,
                )
                jobs = [tuple(r.values()) for r in rows]
                rnd.shuffle(jobs)
                await off_the_common_way(conn, rnd, f"s{b}", jobs)
                args = (
                    [j[0] for j in jobs],
                    [j[1] for j in jobs],
                    [f"reply {n}" for n in range(len(jobs))],
                    [rnd.randint(1, 3) for _ in jobs],
                    [rnd.random() < 0.8 for _ in jobs],
                    MAX_MESSAGES,
                    MAX_CHARS,
                )
                batched = await stepped_and_written(conn, BATCHED, args)
                alone = await stepped_and_written(conn, ONE_BY_ONE, args)
                assert batched == alone, f"batch {b}"
                if batched[0] == "error":
                    seen["error"] += 1
                    continue
                returned = batched[0]
                seen["folded"] += len({r["i"] for r in returned if not r["withdrawn"]})
                seen["withdrawn"] += sum(1 for r in returned if r["withdrawn"])
                seen["intent only"] += len(jobs) - len({r["i"] for r in returned})
            finally:
                await tx.rollback()
    print(f"\njobs over {BATCHES} batches: {seen}")
    # Every way was taken, more than once.
    assert {k: v > 2 for k, v in seen.items()} == dict.fromkeys(seen, True)


IN_FLIGHT = 2000
TABLES = ["reply_jobs", "deliveries", "chats", "accounts", "chat_windows"]
# (READ_NOT_BY_KEY: a chat's open window is probed by chat_windows_one_open, and none is
# open here.)


async def test_the_step_before_sending_a_batch_reads_each_table_by_key_even_when_the_statistics_predate_the_jobs_in_flight(
    pool,
):
    async with pool.acquire() as conn:
        await conn.execute("ANALYZE")  # statistics of empty tables
        jobs = await jobs_in_flight(conn, "cost", IN_FLIGHT)
        # Every chat answered before, and as many other chats with a window open.
        await conn.execute(
            """
            INSERT INTO chats (chat_key, last_answered_sent_at, last_answered_message_id, last_answered_received_at,
                               last_reply_at)
            SELECT chat_key, now() - interval '1 hour', '1', now() - interval '1 hour', now() - interval '1 hour'
            FROM reply_jobs
            """
        )
        await conn.execute(
            """
            INSERT INTO chat_windows (id, chat_key, platform, account_id, chat_id, status, first_at, last_at,
                                      deadline_at, due_at, delay_seconds, message_count)
            SELECT gen_random_uuid(), 'telegram:4242:other' || i, 'telegram', '4242', 'other' || i, 'open',
                   now(), now(), now() + interval '1 hour', now() + interval '1 hour', 30, 1
            FROM generate_series(1, $1) AS i
            """,
            IN_FLIGHT,
        )
        rows = await conn.fetch(
            "SELECT id, chat_key FROM reply_jobs WHERE id = ANY($1) ORDER BY id", jobs[:16]
        )
        await conn.execute("SELECT pg_stat_force_next_flush()")
        await conn.execute("SELECT pg_stat_clear_snapshot()")
        before = await conn.fetchval(READ_NOT_BY_KEY, TABLES)
        for _ in range(3):  # the first calls of a session plan for the values they are given
            await conn.fetch(
                BATCHED,
                [r["id"] for r in rows],
                [r["chat_key"] for r in rows],
                ["a reply"] * len(rows),
                [1] * len(rows),
                [True] * len(rows),
                MAX_MESSAGES,
                MAX_CHARS,
            )
        await conn.execute("SELECT pg_stat_force_next_flush()")
        await conn.execute("SELECT pg_stat_clear_snapshot()")
        after = await conn.fetchval(READ_NOT_BY_KEY, TABLES)
        written = await conn.fetchval(
            "SELECT count(*) FROM deliveries WHERE job_id = ANY($1)", [r["id"] for r in rows]
        )
    assert written == len(rows)
    assert after - before == 0


async def job_in_flight(
    conn: asyncpg.Connection,
    chat: str,
    *,
    seller_wrote: bool,
    platform: str = "telegram",
    status: str = "processing",
) -> tuple[uuid.UUID, str]:
    """A claimed job of one waiting message in ``chat`` (account ``acc``); the seller wrote
    since, or not."""
    key = f"{platform}:acc:{chat}"
    op, window, job = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    await conn.execute(
        """
        INSERT INTO operations (id, platform, account_id, event_id, chat_id, message_id, text, sent_at, status,
                                received_at, payload)
        VALUES ($1, $4, 'acc', $2, $2, '1', 'hi', $3, 'waiting', $3, '{}')
        """,
        op, chat, T0 - timedelta(seconds=5), platform,
    )  # fmt: skip
    await conn.execute(
        """
        INSERT INTO chat_windows (id, chat_key, platform, account_id, chat_id, status, first_at, last_at,
                                  deadline_at, due_at, delay_seconds, message_count, closed_at, job_id)
        VALUES ($1, $2, $6, 'acc', $3, 'closed', $4, $4, $4, $4, 0, 1, $4, $5)
        """,
        window, key, chat, T0, job, platform,
    )  # fmt: skip
    await conn.execute(
        """
        INSERT INTO reply_jobs (id, window_id, chat_key, platform, account_id, chat_id, status, operation_ids,
                                created_at)
        VALUES ($1, $2, $3, $7, 'acc', $4, $8, $5, $6)
        """,
        job, window, key, chat, [op], T0, platform, status,
    )  # fmt: skip
    await conn.execute("UPDATE operations SET job_id = $1 WHERE id = $2", job, op)
    if seller_wrote:
        await conn.execute(
            """
            INSERT INTO chats (chat_key, last_answered_sent_at, last_answered_message_id, last_answered_received_at,
                               last_reply_at, seller_wrote_at, seller_message_id)
            VALUES ($1, $2, '0', $2, $2, $3, 's-1')
            """,
            key, T0 - timedelta(hours=1), T0 + timedelta(seconds=1),
        )  # fmt: skip
    return job, key


async def beside_a_filing(pool: asyncpg.Pool, chat_keys: list[str], statement: str, *args: Any) -> list[Any]:
    """``statement``'s rows, run on one connection while another files messages in
    ``chat_keys`` (taken in lock-key order, as chatq_lock_chats does): the filing holds the
    first chat's lock until the statement waits for it, then asks for the others. A
    statement that took another of those chats' locks before the first deadlocks here."""
    async with pool.acquire() as responder, pool.acquire() as filing:
        pid = await responder.fetchval("SELECT pg_backend_pid()")
        try:
            async with filing.transaction():
                await filing.execute("SELECT pg_advisory_xact_lock(hashtextextended($1, 0))", chat_keys[0])
                step = asyncio.ensure_future(responder.fetch(statement, *args))
                deadline = asyncio.get_running_loop().time() + 10
                while not await filing.fetchval("SELECT cardinality(pg_blocking_pids($1)) > 0", pid):
                    assert asyncio.get_running_loop().time() < deadline, (
                        "the statement never waited for the filing"
                    )
                    await asyncio.sleep(0.02)
                await filing.fetch(
                    "SELECT * FROM chatq_lock_chats($1, $2)", chat_keys, [uuid.uuid4() for _ in chat_keys]
                )
            return list(await asyncio.wait_for(step, 10))
        finally:
            await responder.execute("SELECT pg_advisory_unlock_all()")


async def test_a_batch_with_a_job_withdrawn_takes_its_chats_locks_in_the_order_a_filing_of_the_same_chats_does(
    pool,
):
    # Job A (chat X, no fold: its last round) is withdrawn, the seller having answered; job
    # B (chat Y, X < Y in lock-key order) may fold. The withdrawal takes X's lock (the
    # trigger that unblocks X's next window): taken after Y's, while filing holds X and
    # then asks for Y, the two waited on each other (a deadlock, one of them failed).
    async with pool.acquire() as conn:
        keys = {
            c: await conn.fetchval("SELECT hashtextextended($1, 0)", f"telegram:acc:{c}")
            for c in ("c1", "c2")
        }
        x, y = sorted(keys, key=keys.__getitem__)
        a, kx = await job_in_flight(conn, x, seller_wrote=True)
        b, ky = await job_in_flight(conn, y, seller_wrote=False)
    rows = await beside_a_filing(
        pool, [kx, ky], BATCHED, [a, b], [kx, ky], ["r1", "r2"], [1, 1], [False, True], 4, 4000
    )
    assert [(r["i"], r["withdrawn"]) for r in rows] == [(1, True)]
    async with pool.acquire() as conn:
        assert await conn.fetchval("SELECT status FROM deliveries WHERE job_id = $1", b) == "sending"
        assert await conn.fetchval("SELECT status FROM reply_jobs WHERE id = $1", a) == "superseded"
