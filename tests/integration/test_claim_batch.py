"""The claim of several jobs at once (chatq_claim_jobs, issue 20) against the claim of each
alone (chatq_claim_job, which it replaces on the hot path). Every branch of the claim is
seeded into random batches: jobs final, missing, held by another session, to reconcile
(a send that may have reached the chat), to withdraw (the seller wrote since), messages
answered, held by another reply, not yet filed, shared by two jobs of the same batch,
accounts paused, chats with history. Each batch is claimed both ways on the same rows (a
savepoint between them), and the results and every row the claims write must be equal.
A cost test then checks the batched claim reads its tables by key, with statistics taken
while nothing was in flight and 2,000 jobs in flight when it runs."""

from __future__ import annotations

import asyncio
import random
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import pytest

from shared.db import create_pool
from shared.state.job import lock_key
from tests.integration.test_record_cost import jobs_in_flight

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("clean")]

T0 = datetime(2026, 11, 1, 12, 0, tzinfo=UTC)
BATCHES = 120

NEW = "SELECT t.i, (t.claim).* FROM chatq_claim_jobs($1, $2, $3, $4) AS t ORDER BY t.i"
ONE_BY_ONE = """
SELECT t.i, c.*
FROM unnest($1::uuid[], $2::integer[], $3::bigint[]) WITH ORDINALITY AS t(job, attempt, lock_key, i)
CROSS JOIN LATERAL chatq_claim_job(t.job, t.attempt, t.lock_key, $4) AS c
ORDER BY t.i
"""

# What a claim writes, without the clock.
STATE = """
SELECT (SELECT array_agg((id, status, attempts, operation_ids, error_message)::text ORDER BY id) FROM reply_jobs),
       (SELECT array_agg((id, status, status_reason, job_id)::text ORDER BY id) FROM operations),
       (SELECT array_agg((operation_id, job_id)::text ORDER BY operation_id) FROM reply_coverage),
       (SELECT array_agg((operation_id, kind, detail, job_id)::text ORDER BY operation_id, kind, detail, job_id)
        FROM operation_events)
"""


class Seeder:
    """Rows for one random batch, written on ``conn`` (inside the test's transaction)."""

    def __init__(self, conn: asyncpg.Connection, rnd: random.Random, tag: str) -> None:
        self.conn, self.rnd, self.tag = conn, rnd, tag
        self.n = 0

    def name(self) -> str:
        self.n += 1
        return f"{self.tag}-{self.n}"

    async def operation(
        self, chat: str, account: str, status: str, at: datetime, bc: str | None
    ) -> uuid.UUID:
        op = uuid.uuid4()
        mid = self.name()
        await self.conn.execute(
            """
            INSERT INTO operations (id, platform, account_id, event_id, chat_id, message_id, text, sent_at,
                                    status, received_at, payload, business_connection_id)
            VALUES ($1, 'telegram', $2, $3, $4, $5, 'message ' || $5, $6::timestamptz, $7, $6::timestamptz + interval '1 second', '{}', $8)
            """,
            op, account, mid, chat, f"{self.rnd.randint(1, 50)}{self.n:03d}", at, status, bc,
        )  # fmt: skip
        return op

    async def job(
        self, chat: str, account: str, ops: list[uuid.UUID], status: str, created: datetime
    ) -> uuid.UUID:
        window, job_id = uuid.uuid4(), uuid.uuid4()
        key = f"telegram:{account}:{chat}"
        await self.conn.execute(
            """
            INSERT INTO chat_windows (id, chat_key, platform, account_id, chat_id, status, first_at, last_at,
                                      deadline_at, due_at, delay_seconds, message_count, closed_at, job_id)
            VALUES ($1, $2, 'telegram', $3, $4, 'closed', $5, $5, $5, $5, 0, 1, $5, $6)
            """,
            window, key, account, chat, created, job_id,
        )  # fmt: skip
        await self.conn.execute(
            """
            INSERT INTO reply_jobs (id, window_id, chat_key, platform, account_id, chat_id, status, operation_ids,
                                    reply_text, sent_at, created_at)
            VALUES ($1, $2, $3, 'telegram', $4, $5, $6::text, $7,
                    CASE WHEN $6 = 'sent' THEN 'an earlier reply' END, CASE WHEN $6 = 'sent' THEN $8::timestamptz END, $8::timestamptz)
            """,
            job_id, window, key, account, chat, status, ops, created,
        )  # fmt: skip
        return job_id


async def seed_batch(conn: asyncpg.Connection, rnd: random.Random, tag: str) -> list[uuid.UUID]:
    """A batch of 1-8 jobs over a few chats, each in a situation drawn at random."""
    s = Seeder(conn, rnd, tag)
    accounts = [f"{tag}-a{n}" for n in range(2)]
    if rnd.random() < 0.3:
        await conn.execute(
            "INSERT INTO accounts (platform, account_id, state, state_reason)"
            " VALUES ('telegram', $1, 'paused_by_person', 'a person paused it')",
            accounts[0],
        )
    chats = [(f"c{n}", rnd.choice(accounts)) for n in range(rnd.randint(1, 4))]
    jobs: list[uuid.UUID] = []
    last_ops: dict[tuple[str, str], list[uuid.UUID]] = {}
    in_flight: set[tuple[str, str]] = set()
    for _ in range(rnd.randint(1, 8)):
        chat, account = rnd.choice(chats)
        created = T0 + timedelta(seconds=rnd.randint(0, 100))
        ops = []
        for _ in range(rnd.randint(1, 3)):
            status = rnd.choice(["waiting"] * 5 + ["accepted", "queued", "replying", "replied"])
            bc = rnd.choice([None, None, f"bc-{rnd.randint(1, 3)}"])
            ops.append(
                await s.operation(chat, account, status, T0 + timedelta(seconds=rnd.randint(0, 9)), bc)
            )
        earlier = last_ops.get((chat, account))
        if earlier and rnd.random() < 0.4:
            ops.insert(rnd.randint(0, len(ops)), rnd.choice(earlier))  # a message in two jobs of the batch
        last_ops.setdefault((chat, account), []).extend(ops)
        status = rnd.choice(["pending"] * 6 + ["processing", "sent", "superseded"])
        if (chat, account) in in_flight:  # one job in flight per chat (reply_jobs_one_in_flight)
            status = rnd.choice(["sent", "superseded"])
        elif status in ("pending", "processing"):
            in_flight.add((chat, account))
        job_id = await s.job(chat, account, ops, status, created)
        jobs.append(job_id)
        mine = [o for o in ops if rnd.random() < 0.7]
        await conn.execute(
            "UPDATE operations SET job_id = $1 WHERE id = ANY($2::uuid[]) AND job_id IS NULL", job_id, mine
        )
        if rnd.random() < 0.25:  # a send that may have reached the chat, now or once
            d_status = rnd.choice(["sending", "unknown", "not_sent"])
            await conn.execute(
                "INSERT INTO deliveries (job_id, status, text, attempt, started_at, maybe_sent, maybe_since)"
                " VALUES ($1, $2, 'the reply', 1, $3::timestamptz, $4, CASE WHEN $4 THEN $3::timestamptz END)",
                job_id, d_status, created, d_status == "not_sent" and rnd.random() < 0.5,
            )  # fmt: skip
        elif rnd.random() < 0.1:
            await conn.execute(
                "INSERT INTO deliveries (job_id, status, text, attempt, started_at) VALUES ($1, 'not_sent', 'x', 1, $2)",
                job_id,
                created,
            )
        if rnd.random() < 0.2:  # another reply holds one of its messages
            held = rnd.choice(ops)
            other = await s.job(s.name(), account, [held], "processing", created)
            await conn.execute(
                "INSERT INTO reply_coverage (operation_id, job_id) VALUES ($1, $2) ON CONFLICT DO NOTHING",
                held,
                other,
            )
        if rnd.random() < 0.1:  # its own coverage from an earlier attempt
            await conn.execute(
                "INSERT INTO reply_coverage (operation_id, job_id) VALUES ($1, $2) ON CONFLICT DO NOTHING",
                rnd.choice(ops),
                job_id,
            )
    for chat, account in chats:
        if rnd.random() < 0.5:
            continue
        # The chat was answered before (history), and maybe the seller wrote since a job.
        answered = await s.operation(chat, account, "replied", T0 - timedelta(minutes=5), None)
        sent = await s.job(chat, account, [answered], "sent", T0 - timedelta(minutes=5))
        wrote = rnd.choice([None, T0 + timedelta(seconds=rnd.randint(0, 100))])
        await conn.execute(
            """
            INSERT INTO chats (chat_key, last_answered_sent_at, last_answered_message_id, last_answered_received_at,
                               last_reply_at, last_job_id, seller_wrote_at, seller_message_id)
            VALUES ($1, $2, '1', $2, $2, $3, $4::timestamptz, CASE WHEN $4::timestamptz IS NOT NULL THEN 's-1' END)
            """,
            f"telegram:{account}:{chat}", T0 - timedelta(minutes=5), sent, wrote,
        )  # fmt: skip
    if rnd.random() < 0.1:
        jobs.insert(rnd.randint(0, len(jobs)), uuid.uuid4())  # not in the database
    return jobs


def comparable(rows: list[asyncpg.Record]) -> list[dict[str, Any]]:
    def plain(v: Any) -> Any:
        if isinstance(v, asyncpg.Record):
            return tuple(plain(x) for x in v.values())
        if isinstance(v, list):
            return [plain(x) for x in v]
        return v

    return [{k: plain(v) for k, v in r.items()} for r in rows]


HOLDS = """
SELECT array_agg((SELECT count(*) FROM generate_series(1, 3) WHERE pg_advisory_unlock(t.k))::integer ORDER BY t.n)
FROM unnest($1::bigint[]) WITH ORDINALITY AS t(k, n)
"""


async def claimed_and_written(conn: asyncpg.Connection, query: str, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """What ``query`` returns and writes, and how many times it left each job's lock held;
    then all of it undone (a savepoint; the locks given back)."""
    savepoint = conn.transaction()
    await savepoint.start()
    try:
        rows = comparable(await conn.fetch(query, *args))
        state = list(await conn.fetchrow(STATE))
    finally:
        await savepoint.rollback()
        holds = await conn.fetchval(HOLDS, args[2])
    return rows, state, holds


async def test_claiming_a_batch_at_once_gives_every_job_the_result_and_the_writes_of_its_own_claim(pool):
    rnd = random.Random(20)
    other = await pool.acquire()  # holds some jobs' locks: "another consumer"
    outcomes: dict[str, int] = {}
    try:
        async with pool.acquire() as conn:
            for b in range(BATCHES):
                tx = conn.transaction()
                await tx.start()
                try:
                    jobs = await seed_batch(conn, rnd, f"b{b}")
                    keys = [b * 1000 + n for n in range(len(jobs))]
                    for k in keys:
                        if rnd.random() < 0.1:
                            await other.execute("SELECT pg_advisory_lock($1)", k)
                    args = (jobs, [rnd.randint(1, 4) for _ in jobs], keys, rnd.choice([0, 12]))
                    batched = await claimed_and_written(conn, NEW, args)
                    alone = await claimed_and_written(conn, ONE_BY_ONE, args)
                    assert batched == alone, f"batch {b}"
                    for row in batched[0]:
                        outcomes[row["outcome"]] = outcomes.get(row["outcome"], 0) + 1
                finally:
                    await tx.rollback()
                    await other.execute("SELECT pg_advisory_unlock_all()")
    finally:
        await pool.release(other)
    print(f"\noutcomes over {BATCHES} batches: {outcomes}")
    # Every branch was taken, more than once.
    assert {k: v > 2 for k, v in outcomes.items()} == dict.fromkeys(
        ["busy", "missing", "skip", "reconcile", "claimed"], True
    )


IN_FLIGHT = 2000
COST_BATCHES = 8
EACH = 6
TABLES = ["operations", "reply_jobs", "deliveries", "reply_coverage", "chats", "accounts"]
# Rows read other than by a primary key, in the tables the claim reads: by another index,
# or by a scan of the table.
READ_NOT_BY_KEY = """
SELECT coalesce(sum(t.seq_tup_read), 0)
       + coalesce(sum((SELECT sum(i.idx_tup_read) FROM pg_stat_user_indexes i
                       WHERE i.relid = t.relid AND i.indexrelname NOT LIKE '%\\_pkey')), 0)
FROM pg_stat_user_tables t WHERE t.relname = ANY($1::name[])
"""


async def test_a_claim_of_several_jobs_reads_each_table_by_key_even_when_the_statistics_predate_the_jobs_in_flight(
    infra,
) -> None:
    # One connection for the claims and the counts: a backend's own statistics are flushed
    # on demand (pg_stat_force_next_flush), another's only about a second later.
    pool = await create_pool(infra.database_url, size=1)
    try:
        async with pool.acquire() as conn:
            await conn.execute("ANALYZE")  # nothing in flight
            await jobs_in_flight(conn, "busy-", IN_FLIGHT)
            batches = []
            for b in range(COST_BATCHES):
                jobs = await jobs_in_flight(conn, f"b{b}-", EACH)
                # Fresh jobs, as the coalescer emits them: pending, no attempt yet.
                await conn.execute("DELETE FROM deliveries WHERE job_id = ANY($1::uuid[])", jobs)
                await conn.execute("DELETE FROM reply_coverage WHERE job_id = ANY($1::uuid[])", jobs)
                await conn.execute(
                    "UPDATE reply_jobs SET status = 'pending' WHERE id = ANY($1::uuid[])", jobs
                )
                batches.append(jobs)
            await conn.execute("SELECT pg_stat_force_next_flush()")
            before = await conn.fetchval(READ_NOT_BY_KEY, TABLES)
            for b, jobs in enumerate(batches):
                rows = await conn.fetch(NEW, jobs, [1] * EACH, [b * 100 + n for n in range(EACH)], 12)
                assert [r["outcome"] for r in rows] == ["claimed"] * EACH
                await conn.execute("SELECT pg_advisory_unlock_all()")
            await conn.execute("SELECT pg_stat_force_next_flush()")
            read = await conn.fetchval(READ_NOT_BY_KEY, TABLES) - before
            held = await conn.fetchval("SELECT count(*) FROM reply_coverage")
    finally:
        await pool.close()
    n = COST_BATCHES * EACH
    assert held == IN_FLIGHT + n
    print(
        f"\nclaiming {COST_BATCHES} batches of {EACH} beside {IN_FLIGHT} in flight: {read} rows read other than by key"
    )
    # Past PL/pgSQL's fifth call its plans are generic: still by key, not the 2,000 in flight.
    assert read < n


@pytest.mark.parametrize("ending", ["withdrawn", "superseded"])
async def test_a_batched_claim_that_ends_jobs_of_two_chats_takes_their_locks_in_the_order_a_filing_of_them_does(
    pool, ending: str
):
    """A claim that ends a job (withdrawn: the seller wrote since it was built, claimed by
    chatq_claim_job; superseded: every message answered, the common way) takes the job's
    chat lock through the trigger that unblocks the chat's next window. Ending Y's job, then
    X's (X < Y in lock-key order), while a filing of both chats holds X and then asks for
    Y, the two waited on each other: a deadlock, one of them failed (issue 40, point 2)."""
    from tests.integration.test_before_send_batch import beside_a_filing, job_in_flight

    async with pool.acquire() as conn:
        keys = {
            c: await conn.fetchval("SELECT hashtextextended($1, 0)", f"telegram:acc:{c}")
            for c in ("d1", "d2")
        }
        x, y = sorted(keys, key=keys.__getitem__)
        # Y's job first, in the batch's order and the table's.
        b, ky = await job_in_flight(conn, y, seller_wrote=ending == "withdrawn")
        a, kx = await job_in_flight(conn, x, seller_wrote=ending == "withdrawn")
        if ending == "superseded":
            await conn.execute(
                "UPDATE operations SET status = 'replied' WHERE job_id = ANY($1::uuid[])", [a, b]
            )
    rows = await beside_a_filing(pool, [kx, ky], NEW, [b, a], [1, 1], [lock_key(b), lock_key(a)], 0)
    assert [(r["i"], r["outcome"]) for r in rows] == [(1, "skip"), (2, "skip")]
    async with pool.acquire() as conn:
        statuses = await conn.fetch("SELECT status FROM reply_jobs WHERE id = ANY($1::uuid[])", [a, b])
    assert [r["status"] for r in statuses] == ["superseded", "superseded"]


async def beside_a_seller(
    pool: asyncpg.Pool, chat_key: str, job: uuid.UUID, statement: str, *args: Any
) -> Any:
    """``statement``'s rows, run on one connection while a seller's message of the chat holds
    the chat's lock and then asks for the job's row (as chatq_seller_wrote does). A step
    that took the job's row before the chat's lock deadlocks here."""
    async with pool.acquire() as responder, pool.acquire() as seller:
        pid = await responder.fetchval("SELECT pg_backend_pid()")
        try:
            async with seller.transaction():
                await seller.execute("SELECT pg_advisory_xact_lock(hashtextextended($1, 0))", chat_key)
                step = asyncio.ensure_future(responder.fetch(statement, *args))
                deadline = asyncio.get_running_loop().time() + 10
                while not await seller.fetchval("SELECT cardinality(pg_blocking_pids($1)) > 0", pid):
                    assert asyncio.get_running_loop().time() < deadline, (
                        "the step never waited for the seller"
                    )
                    await asyncio.sleep(0.02)
                await seller.execute("SELECT 1 FROM reply_jobs WHERE id = $1 FOR UPDATE", job)
            return await asyncio.wait_for(step, 10)
        finally:
            await responder.execute("SELECT pg_advisory_unlock_all()")


@pytest.mark.parametrize("step", ["chatq_give_up", "chatq_record_sent", "chatq_claim_job"])
async def test_a_single_job_step_that_ends_the_job_takes_the_chats_lock_before_the_jobs_row(pool, step: str):
    """Give-up, record and claim end the job, whose trigger takes the chat's lock: taken
    after the job's row, a seller's message of the chat (chat's lock, then the row) and the
    step waited on each other, one of them failed (found by the review of issue 40)."""
    from tests.integration.test_before_send_batch import job_in_flight

    async with pool.acquire() as conn:
        job, key = await job_in_flight(
            conn, f"s-{uuid.uuid4().hex[:6]}", seller_wrote=step == "chatq_claim_job",
            status="pending" if step == "chatq_claim_job" else "processing",
        )  # fmt: skip
    statement, args = {
        "chatq_give_up": (
            "SELECT * FROM chatq_give_up($1, 'permanent', 'refused', 'ops', $2)",
            (job, lock_key(job)),
        ),
        "chatq_record_sent": (
            "SELECT * FROM chatq_record_sent($1, 'the reply', 'm-1', $2)",
            (job, lock_key(job)),
        ),
        "chatq_claim_job": ("SELECT (chatq_claim_job($1, 1, $2, 12)).*", (job, lock_key(job))),
    }[step]
    rows = await beside_a_seller(pool, key, job, statement, *args)
    async with pool.acquire() as conn:
        status = await conn.fetchval("SELECT status FROM reply_jobs WHERE id = $1", job)
    # The step ended the job as it would alone: the seller's message waited its turn.
    assert len(rows) == 1
    assert (
        status
        == {"chatq_give_up": "failed", "chatq_record_sent": "sent", "chatq_claim_job": "superseded"}[step]
    )


async def test_a_known_record_waits_for_the_job_while_another_consumer_holds_it(pool):
    """The process holds a reply's platform id whose record was lost with its connection,
    while another consumer (a redelivery elsewhere) holds the job: the record is not made
    behind that consumer's back, the claim is refused as busy, and once that consumer lets
    go the record is made with the id, before anything else (the review of issue 40 found
    it made without the job's lock)."""
    from stores.jobs.postgres import JobStore, Unrecorded
    from stores.jobs.protocol import JobBusy, Skip
    from tests.integration.test_before_send_batch import job_in_flight

    async with pool.acquire() as conn:
        job, _ = await job_in_flight(conn, f"k-{uuid.uuid4().hex[:6]}", seller_wrote=False)
    store = JobStore(pool)
    store.unrecorded[job] = Unrecorded(sent=("the reply", "m-1"))
    async with pool.acquire() as other:
        assert await other.fetchval("SELECT pg_try_advisory_lock($1)", lock_key(job))
        async with store.exclusive(job) as session:
            with pytest.raises(JobBusy):
                await session.claim(job, 2)
        assert await pool.fetchval("SELECT status FROM reply_jobs WHERE id = $1", job) == "processing"
        assert job in store.unrecorded, "the known id was dropped"
        await other.execute("SELECT pg_advisory_unlock($1)", lock_key(job))
    async with store.exclusive(job) as session:
        settled = await session.claim(job, 2)
    assert isinstance(settled, Skip), settled  # the reply is recorded, not claimed again
    row = await pool.fetchrow("SELECT status, platform_message_id FROM reply_jobs WHERE id = $1", job)
    assert (row["status"], row["platform_message_id"]) == ("sent", "m-1")
    assert job not in store.unrecorded
