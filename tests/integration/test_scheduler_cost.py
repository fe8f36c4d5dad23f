"""What a scheduler round costs Postgres (issue 20): the rows it reads follow what it
emits, not the due windows waiting behind an account's fair share. The claim used to
number every due window in a window function each round: with thousands waiting behind one
account's share, 4-8 ms of Postgres per round to emit a handful, found with auto_explain
under bench.pipeline. The count here comes from EXPLAIN ANALYZE of the very statement the
scheduler runs, so it does not depend on the machine's speed."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import pytest

from services.coalescer.sweeper import _STUCK
from stores.windows.postgres import _CLAIM_DUE, PgWindowStore

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("clean")]

SHARE = 16
WAITING = 2000


def rows_read(node: dict[str, Any], table: str) -> float:
    """Rows of ``table`` the plan's scans returned or filtered out, over all their loops."""
    own = 0.0
    if node.get("Relation Name") == table:
        own = (node.get("Actual Rows", 0) + node.get("Rows Removed by Filter", 0)) * node.get(
            "Actual Loops", 1
        )
    return own + sum(rows_read(child, table) for child in node.get("Plans", []))


async def open_window(
    conn: asyncpg.Connection, account: str, chat: str, due: datetime, platform: str = "telegram"
) -> None:
    await conn.execute(
        """
        INSERT INTO chat_windows (id, chat_key, platform, account_id, chat_id, status, first_at, last_at,
                                  deadline_at, due_at, delay_seconds, message_count)
        VALUES ($1, $2, $6, $3, $4, 'open', $5::timestamptz, $5, $5::timestamptz + interval '1 minute',
                $5, 0, 1)
        """,
        uuid.uuid4(),
        f"{platform}:{account}:{chat}",
        account,
        chat,
        due,
        platform,
    )


async def job_in_flight(conn: asyncpg.Connection, account: str, chat: str, at: datetime) -> None:
    window, job = uuid.uuid4(), uuid.uuid4()
    await conn.execute(
        """
        INSERT INTO chat_windows (id, chat_key, platform, account_id, chat_id, status, first_at, last_at,
                                  deadline_at, due_at, delay_seconds, message_count, closed_at, job_id)
        VALUES ($1, $2, 'telegram', $3, $4, 'closed', $5, $5, $5, $5, 0, 1, $5, $6)
        """,
        window,
        f"telegram:{account}:{chat}",
        account,
        chat,
        at,
        job,
    )
    await conn.execute(
        """
        INSERT INTO reply_jobs (id, window_id, chat_key, platform, account_id, chat_id, status, operation_ids)
        VALUES ($1, $2, $3, 'telegram', $4, $5, 'processing', ARRAY[$6::uuid])
        """,
        job,
        window,
        f"telegram:{account}:{chat}",
        account,
        chat,
        uuid.uuid4(),
    )


async def a_waits_behind_its_share_and_b_is_due(conn: asyncpg.Connection, now: datetime) -> None:
    """Account "a" has its whole share in flight and 2,000 due windows waiting behind it;
    account "b" has one window due, later than all of them."""
    for n in range(SHARE):
        await job_in_flight(conn, "a", f"busy-{n}", now - timedelta(seconds=30))
    for n in range(WAITING):
        await open_window(conn, "a", f"waiting-{n}", now - timedelta(seconds=20) + timedelta(milliseconds=n))
    await open_window(conn, "b", "one", now - timedelta(seconds=1))


async def claim_plan(pool: asyncpg.Pool, alone: int) -> dict[str, Any]:
    """The claim's plan as it runs (EXPLAIN ANALYZE, with the pages it touched), rolled back."""
    async with pool.acquire() as conn:
        tx = conn.transaction()
        await tx.start()
        try:
            (plan,) = json.loads(
                await conn.fetchval(
                    "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + _CLAIM_DUE, 200, SHARE, alone
                )
            )
        finally:
            await tx.rollback()
    result: dict[str, Any] = plan
    return result


async def only_b_is_claimed(pool: asyncpg.Pool) -> dict[str, Any]:
    """Claims account b's window "one" alone, then returns the claim's plan as it ran
    (EXPLAIN ANALYZE, with the pages it touched), rolled back."""
    async with PgWindowStore(pool).transaction() as tx:
        due = await tx.claim_due(200, SHARE, SHARE * 4)
        assert [(w.account_id, w.chat_id) for w in due] == [("b", "one")]
    return await claim_plan(pool, SHARE * 4)


async def test_a_round_reads_what_it_emits_not_the_windows_waiting_behind_an_accounts_share(
    pool: asyncpg.Pool,
) -> None:
    now = datetime.now(UTC)
    async with pool.acquire() as conn, conn.transaction():
        await a_waits_behind_its_share_and_b_is_due(conn, now)
        await conn.execute("ANALYZE chat_windows, reply_jobs")

    plan = await only_b_is_claimed(pool)
    read = rows_read(plan["Plan"], "chat_windows")
    print(f"\nclaim with {WAITING} windows waiting behind a share: {read:.0f} rows of chat_windows read")
    # The count of due windows that chooses the way stops at 200; then the accounts (a skip
    # scan: a probe each), b's window, its re-read and its lock: 4 rows. The previous
    # release's claim, which numbered the due windows, read 2,019.
    assert read < 200 + 50


async def test_a_round_reads_what_it_emits_even_when_the_statistics_predate_the_windows(
    pool: asyncpg.Pool,
) -> None:
    """Statistics taken while few windows were open (a quiet minute, the benchmark's
    warm-up) made the planner expect one ready window: it read every ready window from the
    index by due time and sorted them by account, twice a round (10 ms a round with 13,000
    waiting, in bench.pipeline). The walk by account cannot be planned on that index.
    Statistics as in the benchmark: taken over windows all closed, before the flood."""
    now = datetime.now(UTC)
    async with pool.acquire() as conn:
        await conn.execute(
            """
            INSERT INTO chat_windows (id, chat_key, platform, account_id, chat_id, status, first_at,
                                      last_at, deadline_at, due_at, delay_seconds, message_count,
                                      closed_at, job_id)
            SELECT gen_random_uuid(), 'telegram:old:' || n, 'telegram', 'old', n::text, 'closed',
                   $1, $1, $1, $1, 0, 1, $1, gen_random_uuid()
            FROM generate_series(1, 5000) AS n
            """,
            now - timedelta(hours=1),
        )
        await conn.execute("ANALYZE chat_windows, reply_jobs")
    async with pool.acquire() as conn, conn.transaction():
        await a_waits_behind_its_share_and_b_is_due(conn, now)

    plan = await only_b_is_claimed(pool)
    read = rows_read(plan["Plan"], "chat_windows")
    print(f"\nclaim with {WAITING} windows waiting, statistics older than them: {read:.0f} rows read")
    assert read < 200 + 50


ACCOUNTS = 2000


async def test_a_round_probes_each_account_once_not_every_account_after_it(pool: asyncpg.Pool) -> None:
    """Many accounts, each with a window not yet due, and one due window. Asked for as a
    range of (platform, account, due time), an account's probe of
    chat_windows_ready_account did not stop at the end of the account: Postgres (before
    18) stops a scan on a row comparison only where its first column decides, so every
    probe stepped over the ready windows of every account after it (3,000 accounts: 0.5 s
    a round). Counted in index and table pages the plan touched, which do not depend on
    the machine's speed."""
    now = datetime.now(UTC)
    async with pool.acquire() as conn, conn.transaction():
        for n in range(ACCOUNTS):
            await open_window(conn, f"acct-{n:04}", "later", now + timedelta(minutes=1))
        await open_window(conn, "b", "one", now - timedelta(seconds=1))
        # Enough windows due (behind account c's full share) that the round walks the accounts.
        for n in range(SHARE):
            await job_in_flight(conn, "c", f"busy-{n}", now - timedelta(seconds=30))
        for n in range(250):
            await open_window(
                conn, "c", f"waiting-{n}", now - timedelta(seconds=20) + timedelta(milliseconds=n)
            )
        await conn.execute("ANALYZE chat_windows, reply_jobs")

    plan = await only_b_is_claimed(pool)
    pages = plan["Plan"]["Shared Hit Blocks"] + plan["Plan"]["Shared Read Blocks"]
    print(
        f"\nclaim with {ACCOUNTS} accounts' windows not yet due: {pages} pages ({pages / ACCOUNTS:.1f} an account)"
    )
    # The skip scan's probe of each account (3 pages: a descent of the index and the row):
    # about 3 an account. Stepping over the accounts after each one: 10.5 an account.
    assert pages < 5 * ACCOUNTS


async def test_each_account_of_each_platform_gets_its_earliest_due_windows_up_to_its_free_places(
    pool: asyncpg.Pool,
) -> None:
    now = datetime.now(UTC)

    def ago(seconds: float) -> datetime:
        return now - timedelta(seconds=seconds)

    async with pool.acquire() as conn, conn.transaction():
        for chat, age in (("x3", 1), ("x1", 3), ("x2", 2)):
            await open_window(conn, "x", chat, ago(age))
        # The same account id on another platform is another account, with its own share.
        await open_window(conn, "x", "later", ago(-60), platform="avito")
        await open_window(conn, "x", "a1", ago(5), platform="avito")
        # Its earliest window not due yet: nothing of it goes.
        await open_window(conn, "y", "later", ago(-60))
        await open_window(conn, "y", "much-later", ago(-120))
        # One job in flight: one free place.
        await job_in_flight(conn, "z", "busy", ago(30))
        await open_window(conn, "z", "z2", ago(4))
        await open_window(conn, "z", "z1", ago(6))

    async with PgWindowStore(pool).transaction() as tx:
        due = await tx.claim_due(200, 2)
    assert [(w.platform, w.account_id, w.chat_id) for w in due] == [
        ("telegram", "z", "z1"),
        ("avito", "x", "a1"),
        ("telegram", "x", "x1"),
        ("telegram", "x", "x2"),
    ]
    async with PgWindowStore(pool).transaction() as tx:
        due = await tx.claim_due(200, 0)
    assert len(due) == 6, "share 0: every due window goes"


async def test_an_account_alone_gets_its_larger_share_until_another_account_has_a_window_due_or_a_job(
    pool: asyncpg.Pool,
) -> None:
    """A lone account on an unpaced platform was held to its share (16) with nobody to
    share with: bench.pipeline's single bot sent 199 replies/s with 16 jobs in flight and
    261/s with 64. The share of an account alone is larger; as soon as another account
    has a window due or a job unfinished, each is back to its share."""
    now = datetime.now(UTC)
    async with pool.acquire() as conn, conn.transaction():
        await job_in_flight(conn, "a", "busy", now - timedelta(seconds=30))
        for n in range(10):
            await open_window(conn, "a", f"w{n}", now - timedelta(seconds=10 - n))
        # Another account's window still in its pause does not count.
        await open_window(conn, "b", "later", now + timedelta(minutes=1))

    async def claimed() -> list[tuple[str, str]]:
        async with PgWindowStore(pool).transaction() as tx:
            return [(w.account_id, w.chat_id) for w in await tx.claim_due(200, 2, 6)]

    # Alone: 6 places, one taken by its job in flight.
    assert await claimed() == [("a", f"w{n}") for n in range(5)]
    async with pool.acquire() as conn:
        await job_in_flight(conn, "c", "busy", now - timedelta(seconds=30))
    assert await claimed() == [("a", "w0")], "another account's job unfinished: back to the share"
    async with pool.acquire() as conn:
        await conn.execute("DELETE FROM reply_jobs WHERE account_id = 'c'")
        await open_window(conn, "d", "due", now - timedelta(seconds=1))
    assert await claimed() == [("a", "w0"), ("d", "due")], "another account's window due: shares"
    async with PgWindowStore(pool).transaction() as tx:
        due = await tx.claim_due(200, 2)
    assert len(due) == 2, "no larger share given: the share"


async def test_a_round_with_few_windows_due_does_not_walk_the_accounts(pool: asyncpg.Pool) -> None:
    """Many accounts with windows open in their pause, one window due: the round reads the
    due windows from their own index instead of probing every account (walking them cost
    27 ms a round with 3,000 accounts). Counted in pages, as above."""
    now = datetime.now(UTC)
    async with pool.acquire() as conn, conn.transaction():
        for n in range(ACCOUNTS):
            await open_window(conn, f"acct-{n:04}", "later", now + timedelta(minutes=1))
        await open_window(conn, "b", "one", now - timedelta(seconds=1))
        await conn.execute("ANALYZE chat_windows, reply_jobs")

    plan = await only_b_is_claimed(pool)
    pages = plan["Plan"]["Shared Hit Blocks"] + plan["Plan"]["Shared Read Blocks"]
    print(f"\nclaim with {ACCOUNTS} accounts' windows not yet due and one due: {pages} pages")
    # A few index pages and b's row: independent of the number of accounts (walking them: ~3
    # pages each, 6,000 here).
    assert pages < 100


async def in_transit(conn: asyncpg.Connection, account: str, chat: str, received: datetime) -> None:
    """A message of the chat stored and not yet filed (on its way to the coalescer)."""
    await conn.execute(
        """
        INSERT INTO operations (id, platform, account_id, chat_id, message_id, text, sent_at, status,
                                received_at, payload)
        VALUES ($1, 'telegram', $2, $3, $4, 'on its way', $5, 'accepted', $5, '{}')
        """,
        uuid.uuid4(),
        account,
        chat,
        str(uuid.uuid4()),
        received,
    )


async def test_an_account_is_not_alone_while_another_accounts_due_window_waits_for_a_message_in_transit(
    pool: asyncpg.Pool,
) -> None:
    """The in-memory store (stores/windows/fake.py) must decide as this claim does
    (tests/unit/test_coalescer_branches.py has the same case)."""
    now = datetime.now(UTC)
    async with pool.acquire() as conn, conn.transaction():
        for n in range(3):
            await open_window(conn, "a", f"a{n}", now - timedelta(seconds=10 - n))
        await in_transit(conn, "b", "b1", now - timedelta(seconds=5))
        await open_window(conn, "b", "b1", now - timedelta(seconds=1))
        await open_window(conn, "c", "c1", now - timedelta(seconds=4))
        await in_transit(conn, "c", "c1", now - timedelta(seconds=5))
        await open_window(conn, "c", "c2", now - timedelta(seconds=3))
    async with PgWindowStore(pool).transaction() as tx:
        due = await tx.claim_due(200, 1, 3)
    # b's window is due (it waits for b1's message on its way), so a is not alone and
    # keeps its share of 1; c's first window holds c's one place while it waits.
    assert [(w.account_id, w.chat_id) for w in due] == [("a", "a0")]


FINISHED = 5000


async def test_whether_an_account_is_alone_is_read_from_the_jobs_in_flight_not_every_job_kept(
    pool: asyncpg.Pool,
) -> None:
    """Finished jobs stay in reply_jobs until retention purges them (days of them in a real
    install). Deciding whether an account is alone read every one of them (a sequential
    scan for any other account's job, 2 ms a round at 6,000 jobs in bench.pipeline); it now
    reads the jobs in flight only. Statistics as in the benchmark: taken over the finished
    jobs, before the jobs now in flight."""
    now = datetime.now(UTC)
    async with pool.acquire() as conn:
        await statistics_taken_with_no_job_in_flight(conn, now - timedelta(hours=1))
    async with pool.acquire() as conn, conn.transaction():
        for n in range(3):
            await job_in_flight(conn, "b", f"busy-{n}", now - timedelta(seconds=30))
        await open_window(conn, "b", "one", now - timedelta(seconds=1))

    plan = await only_b_is_claimed(pool)
    read = rows_read(plan["Plan"], "reply_jobs")
    print(f"\nclaim with {FINISHED} finished jobs kept: {read:.0f} rows of reply_jobs read")
    # b's 3 jobs in flight, read by each probe of the share (twice: the first and the last
    # account in flight) and by b's count of its own: about 10. The scan read 5,003.
    assert read < 50


async def closed_windows_with_jobs(
    conn: asyncpg.Connection, accounts: list[str], each: int, status: str, at: datetime
) -> None:
    """``each`` reply jobs in ``status`` ('sent' or 'processing') for each of ``accounts``,
    each of a closed window of its own chat."""
    await conn.execute(
        """
        WITH ids AS (
            SELECT account, account || '-' || n AS chat, gen_random_uuid() AS window_id,
                   gen_random_uuid() AS job_id
            FROM unnest($2::text[]) AS account, generate_series(1, $3) AS n
        ), w AS (
            INSERT INTO chat_windows (id, chat_key, platform, account_id, chat_id, status, first_at,
                                      last_at, deadline_at, due_at, delay_seconds, message_count,
                                      closed_at, job_id)
            SELECT window_id, 'telegram:' || account || ':' || chat, 'telegram', account, chat, 'closed',
                   $1, $1, $1, $1, 0, 1, $1, job_id
            FROM ids
            RETURNING id, chat_key, account_id, chat_id, job_id
        )
        INSERT INTO reply_jobs (id, window_id, chat_key, platform, account_id, chat_id, status,
                                operation_ids, reply_text, sent_at, platform_message_id)
        SELECT w.job_id, w.id, w.chat_key, 'telegram', w.account_id, w.chat_id, $4,
               ARRAY[gen_random_uuid()], CASE WHEN $4 = 'sent' THEN 'hello' END,
               CASE WHEN $4 = 'sent' THEN $1 END, CASE WHEN $4 = 'sent' THEN '1' END
        FROM w
        """,
        at,
        accounts,
        each,
        status,
    )


async def statistics_taken_with_no_job_in_flight(conn: asyncpg.Connection, at: datetime) -> None:
    """FINISHED jobs kept, none in flight, analyzed: the planner then expects no job in
    flight and every partial index of them empty (reply_jobs grows by days of finished
    jobs, so a flood of jobs in flight changes too few of its rows for autovacuum to
    analyze it again soon)."""
    await closed_windows_with_jobs(conn, ["old"], FINISHED, "sent", at)
    await conn.execute("ANALYZE chat_windows, reply_jobs")


async def jobs_in_flight(conn: asyncpg.Connection, accounts: int, each: int, at: datetime) -> None:
    """``each`` jobs in flight for each of ``accounts`` accounts acct-0000, acct-0001..."""
    await closed_windows_with_jobs(conn, [f"acct-{a:04}" for a in range(accounts)], each, "processing", at)


IN_FLIGHT_ACCOUNTS = 200


async def test_whether_an_account_is_alone_costs_two_probes_even_when_the_statistics_predate_the_jobs_in_flight(
    pool: asyncpg.Pool,
) -> None:
    """One account with a window due while 200 others have 8 jobs each in flight, on
    statistics taken when no job was: the share's two probes (the first and the last
    account in flight) were planned on reply_jobs_in_flight_age, which holds the same jobs
    ordered by age, each reading every job in flight to sort them (3,200 rows)."""
    now = datetime.now(UTC)
    async with pool.acquire() as conn:
        await statistics_taken_with_no_job_in_flight(conn, now - timedelta(hours=1))
    async with pool.acquire() as conn, conn.transaction():
        await jobs_in_flight(conn, IN_FLIGHT_ACCOUNTS, 8, now - timedelta(seconds=30))
        await open_window(conn, "b", "one", now - timedelta(seconds=1))

    plan = await only_b_is_claimed(pool)
    read = rows_read(plan["Plan"], "reply_jobs")
    print(
        f"\nclaim with {IN_FLIGHT_ACCOUNTS * 8} jobs in flight, statistics older: {read:.0f} rows of reply_jobs"
    )
    # The first and the last account in flight, and b's count of its own (none): 2 rows.
    assert read < 50


async def test_the_sweeper_still_reads_stuck_jobs_by_age(pool: asyncpg.Pool) -> None:
    """The index of the jobs in flight by age serves only queries that compare updated_at:
    the sweeper's, which must keep it whatever the statistics."""
    now = datetime.now(UTC)
    async with pool.acquire() as conn:
        await statistics_taken_with_no_job_in_flight(conn, now - timedelta(hours=1))
        await jobs_in_flight(conn, IN_FLIGHT_ACCOUNTS, 8, now - timedelta(seconds=30))
        plan = "\n".join(r[0] for r in await conn.fetch("EXPLAIN " + _STUCK, 60.0, 100))
    assert "reply_jobs_in_flight_by_age" in plan, plan


async def test_each_account_counts_its_own_jobs_in_flight_even_when_the_statistics_predate_them(
    pool: asyncpg.Pool,
) -> None:
    """200 accounts with 8 jobs in flight and a window due each, on statistics taken when
    no job was in flight: each account's count of its jobs in flight read every job in
    flight from reply_jobs_in_flight_age and kept its own (320,000 rows, 28 ms a round
    against 3 ms with fresh statistics)."""
    now = datetime.now(UTC)
    async with pool.acquire() as conn:
        await statistics_taken_with_no_job_in_flight(conn, now - timedelta(hours=1))
    async with pool.acquire() as conn, conn.transaction():
        await jobs_in_flight(conn, IN_FLIGHT_ACCOUNTS, 8, now - timedelta(seconds=30))
        for n in range(IN_FLIGHT_ACCOUNTS):
            await open_window(conn, f"acct-{n:04}", "due", now - timedelta(seconds=1))

    async with PgWindowStore(pool).transaction() as tx:
        due = await tx.claim_due(200, SHARE, SHARE * 4)
    assert len(due) == IN_FLIGHT_ACCOUNTS
    plan = await claim_plan(pool, SHARE * 4)
    read = rows_read(plan["Plan"], "reply_jobs")
    in_flight = IN_FLIGHT_ACCOUNTS * 8
    print(f"\nclaim with {in_flight} jobs in flight over {IN_FLIGHT_ACCOUNTS} accounts: {read:.0f} rows read")
    # Each account's own 8, read once (or twice: where the due windows are counted, and
    # where they are placed): at most 2 * 1,600.
    assert read <= 2 * in_flight + 50


async def test_an_account_alone_counts_its_jobs_in_flight_once_a_round_not_once_for_each_due_window(
    pool: asyncpg.Pool,
) -> None:
    """One account alone, most of its larger share in flight and fewer than 200 windows
    due (a busy seller, unpaced): the due windows are numbered, and each one's place was
    checked against a count of the account's jobs in flight made again for that window,
    the share's 64 windows times its 60 jobs: 3,840 rows of reply_jobs a round."""
    alone = SHARE * 4
    in_flight = alone - 4
    now = datetime.now(UTC)
    async with pool.acquire() as conn, conn.transaction():
        for n in range(in_flight):
            await job_in_flight(conn, "a", f"busy-{n}", now - timedelta(seconds=30))
        for n in range(150):
            await open_window(conn, "a", f"due-{n}", now - timedelta(seconds=20) + timedelta(milliseconds=n))
        await conn.execute("ANALYZE chat_windows, reply_jobs")

    async with PgWindowStore(pool).transaction() as tx:
        due = await tx.claim_due(200, SHARE, alone)
    # Its free places, the earliest due first.
    assert [w.chat_id for w in due] == [f"due-{n}" for n in range(alone - in_flight)]
    plan = await claim_plan(pool, alone)
    read = rows_read(plan["Plan"], "reply_jobs")
    print(
        f"\nclaim of an account alone with {in_flight} jobs in flight and 150 windows due: {read:.0f} rows read"
    )
    # Its jobs read once for the count, and by the share's two probes.
    assert read <= 2 * in_flight + 50
