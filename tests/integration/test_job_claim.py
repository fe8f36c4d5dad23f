"""The responder's claim, before-send and record, each one statement in Postgres (migration
0006): every branch of the claim decision against real rows, seeded directly so each
situation is exact (answered already, late, held by another job, interrupted send)."""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime, timedelta

import asyncpg
import pytest

from shared.broker.consumer import Reject
from stores.jobs.postgres import JobStore
from stores.jobs.protocol import Job, JobBusy, Reconcile, Skip
from tests.support.broker import wait_for
from tests.support.seed import job, operation

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("clean")]

T0 = datetime(2026, 11, 1, 12, 0, tzinfo=UTC)
CHAT = "telegram:bot:77"


async def claim(pool: asyncpg.Pool, job_id: uuid.UUID, attempt: int = 1) -> Job | Skip | Reconcile:
    async with JobStore(pool).exclusive(job_id) as db:
        return await db.claim(job_id, attempt)


async def statuses(pool: asyncpg.Pool, *ops: uuid.UUID) -> list[tuple[str, str | None]]:
    rows = {
        r["id"]: (r["status"], r["status_reason"])
        for r in await pool.fetch(
            "SELECT id, chatq_shown_status(status, id, platform, account_id, chat_id) AS status, status_reason"
            " FROM operations WHERE id = ANY($1::uuid[])",
            ops,
        )
    }
    return [rows[o] for o in ops]


async def test_a_fresh_job_is_claimed_with_its_messages_in_platform_order_and_holds_them(pool):
    # message ids compare numerically: "9" before "10" at the same timestamp
    b = await operation(pool, "10", at=T0)
    a = await operation(pool, "9", at=T0)
    c = await operation(pool, "11", at=T0 + timedelta(seconds=1))
    job_id = await job(pool, [b, a, c])

    state = await claim(pool, job_id, attempt=3)

    assert isinstance(state, Job)
    assert [m.message_id for m in state.messages] == ["9", "10", "11"]
    assert (state.platform, state.account_id, state.chat_id) == ("telegram", "bot", "77")
    assert await pool.fetchval("SELECT status || ':' || attempts FROM reply_jobs WHERE id = $1", job_id) == (
        "processing:3"
    )
    assert await statuses(pool, a, b, c) == [("replying", None)] * 3
    held = await pool.fetch("SELECT operation_id FROM reply_coverage WHERE job_id = $1", job_id)
    assert {r["operation_id"] for r in held} == {a, b, c}


async def test_a_job_not_in_the_database_is_rejected(pool):
    with pytest.raises(Reject, match="not in the database"):
        await claim(pool, uuid.uuid4())


async def test_a_final_job_is_skipped_and_left_as_it_is(pool):
    op = await operation(pool, "1", at=T0, status="replied")
    job_id = await job(pool, [op], status="sent")

    state = await claim(pool, job_id)

    assert state == Skip("job already sent")
    assert await pool.fetchval("SELECT status FROM reply_jobs WHERE id = $1", job_id) == "sent"


async def test_a_job_whose_messages_a_sent_reply_already_covers_is_superseded(pool):
    op = await operation(pool, "1", at=T0, status="replied")
    sent = await job(pool, [op], status="sent")
    await pool.execute("INSERT INTO reply_coverage (operation_id, job_id) VALUES ($1, $2)", op, sent)
    again = await job(pool, [op])  # a copy of the message filed again
    await pool.execute("UPDATE operations SET job_id = $1 WHERE id = $2", sent, op)

    state = await claim(pool, again)

    assert state == Skip("every message is answered or held by another reply")
    assert await pool.fetchval("SELECT status FROM reply_jobs WHERE id = $1", again) == "superseded"
    assert await statuses(pool, op) == [("replied", None)]
    assert await pool.fetchval("SELECT job_id FROM operations WHERE id = $1", op) == sent


async def test_a_job_whose_chat_the_seller_answered_after_it_was_built_is_withdrawn_by_its_claim(pool):
    """The seller wrote in person while a responder worked on the job (so their message did
    not withdraw it), and that attempt failed before its send: the job is pending again.
    Its next claim withdraws it. The claim read a job with no delivery yet as neither
    reconciling nor not (NULL), called the withdrawal and then moved the job it had just
    superseded on to processing, which the state check refuses: every redelivery failed
    the same way until the queue's delivery limit gave the job up, and the messages the
    seller had answered ended failed."""
    op = await operation(pool, "1", at=T0)
    job_id = await job(pool, [op])
    await pool.execute(
        """
        INSERT INTO chats (chat_key, last_answered_sent_at, last_answered_message_id, last_answered_received_at,
                           last_reply_at, seller_wrote_at, seller_message_id)
        VALUES ($1, $2, '0', $2, $2, now() + interval '1 second', 's-1')
        """,
        CHAT,
        T0,
    )

    state = await claim(pool, job_id)

    assert state == Skip("withdrawn: the seller answered the chat in person")
    assert await pool.fetchval("SELECT status FROM reply_jobs WHERE id = $1", job_id) == "superseded"
    assert await statuses(pool, op) == [("replied", "answered by the seller (message s-1)")]


async def test_a_message_older_than_the_chats_last_answered_one_is_answered_in_the_next_reply(pool):
    # Whatever brought it late (a person's retry, a redelivery), a buyer message no sent
    # reply covers is answered, never "ignored because a later one was answered first".
    answered = await operation(pool, "5", at=T0 + timedelta(seconds=5), status="replied")
    sent = await job(pool, [answered], status="sent")
    await pool.execute(
        "SELECT chatq_advance_last_answered($1, 'telegram', $2, '5', $2, now(), $3)",
        CHAT,
        T0 + timedelta(seconds=5),
        sent,
    )
    late = await operation(pool, "4", at=T0 + timedelta(seconds=4))
    new = await operation(pool, "6", at=T0 + timedelta(seconds=6))
    job_id = await job(pool, [late, new])

    state = await claim(pool, job_id)

    assert isinstance(state, Job)
    assert [m.operation_id for m in state.messages] == [late, new]
    assert await pool.fetchval("SELECT operation_ids FROM reply_jobs WHERE id = $1", job_id) == [late, new]
    assert await statuses(pool, late, new) == [("replying", None), ("replying", None)]
    held = await pool.fetch("SELECT operation_id FROM reply_coverage WHERE job_id = $1", job_id)
    assert {r["operation_id"] for r in held} == {late, new}


async def test_a_message_another_job_holds_is_left_to_that_job(pool):
    shared_op = await operation(pool, "1", at=T0)
    own = await operation(pool, "2", at=T0 + timedelta(seconds=1))
    holder = await job(pool, [shared_op], status="processing")
    await pool.execute("INSERT INTO reply_coverage (operation_id, job_id) VALUES ($1, $2)", shared_op, holder)
    await pool.execute(
        "UPDATE reply_jobs SET chat_key = 'other' WHERE id = $1", holder
    )  # one in flight per chat
    job_id = await job(pool, [shared_op, own])

    state = await claim(pool, job_id)

    assert isinstance(state, Job)
    assert [m.operation_id for m in state.messages] == [own]
    assert (
        await pool.fetchval("SELECT job_id FROM reply_coverage WHERE operation_id = $1", shared_op) == holder
    )


async def test_a_job_whose_every_message_another_job_holds_is_superseded(pool):
    op = await operation(pool, "1", at=T0)
    holder = await job(pool, [op], status="processing")
    await pool.execute("INSERT INTO reply_coverage (operation_id, job_id) VALUES ($1, $2)", op, holder)
    await pool.execute("UPDATE reply_jobs SET chat_key = 'other' WHERE id = $1", holder)
    job_id = await job(pool, [op])

    assert await claim(pool, job_id) == Skip("every message is answered or held by another reply")
    assert await pool.fetchval("SELECT status FROM reply_jobs WHERE id = $1", job_id) == "superseded"


async def test_a_job_with_an_interrupted_send_is_reconciled_with_the_text_it_was_sending(pool):
    op = await operation(pool, "1", at=T0)
    job_id = await job(pool, [op])
    async with JobStore(pool).exclusive(job_id) as db:
        claimed = await db.claim(job_id, 1)
        assert isinstance(claimed, Job)
        await db.before_send(claimed, "the reply", 1, fold=False)

    state = await claim(pool, job_id, attempt=2)

    assert isinstance(state, Reconcile)
    assert (state.text, state.delivery_status) == ("the reply", "sending")
    assert [m.operation_id for m in state.job.messages] == [op]


async def test_recording_a_reply_moves_job_delivery_operations_and_last_answered_together(pool):
    a = await operation(pool, "1", at=T0)
    b = await operation(pool, "2", at=T0 + timedelta(seconds=1))
    job_id = await job(pool, [a, b])
    async with JobStore(pool).exclusive(job_id) as db:
        claimed = await db.claim(job_id, 1)
        assert isinstance(claimed, Job)
        await db.before_send(claimed, "the reply", 1)
        sent_at = await db.record_sent(claimed, "the reply", "m-9")

    row = await pool.fetchrow(
        """
        SELECT j.status, j.reply_text, j.platform_message_id, j.sent_at, d.status AS d_status, d.finished_at,
               c.last_answered_message_id, c.last_job_id
        FROM reply_jobs j JOIN deliveries d ON d.job_id = j.id JOIN chats c ON c.chat_key = j.chat_key
        WHERE j.id = $1
        """,
        job_id,
    )
    assert dict(row) == {
        "status": "sent",
        "reply_text": "the reply",
        "platform_message_id": "m-9",
        "sent_at": sent_at,
        "d_status": "sent",
        "finished_at": sent_at,
        "last_answered_message_id": "2",
        "last_job_id": job_id,
    }
    assert await statuses(pool, a, b) == [("replied", None)] * 2


async def test_before_send_folds_the_chats_open_window_into_the_job_and_then_records_the_intent(pool):
    first = await operation(pool, "1", at=T0)
    job_id = await job(pool, [first])
    later = await operation(pool, "2", at=T0 + timedelta(seconds=2))
    window = uuid.uuid4()
    await pool.execute(
        """
        INSERT INTO chat_windows (id, chat_key, platform, account_id, chat_id, status, first_at, last_at,
                                  deadline_at, due_at, delay_seconds, message_count)
        VALUES ($1, $2, 'telegram', 'bot', '77', 'open', $3, $3, $3, $3, 0, 1)
        """,
        window,
        CHAT,
        T0,
    )
    await pool.execute("INSERT INTO window_messages (operation_id, window_id) VALUES ($1, $2)", later, window)
    async with JobStore(pool).exclusive(job_id) as db:
        claimed = await db.claim(job_id, 1)
        assert isinstance(claimed, Job)
        folded = await db.before_send(claimed, "a reply to one", 1)
        assert await pool.fetchval("SELECT count(*) FROM deliveries WHERE job_id = $1", job_id) == 0
        again = await db.before_send(folded, "a reply to both", 1)

    assert [m.operation_id for m in folded.messages] == [first, later]
    assert again is folded
    assert await pool.fetchval("SELECT status || ':' || text FROM deliveries WHERE job_id = $1", job_id) == (
        "sending:a reply to both"
    )
    assert await pool.fetchval("SELECT count(*) FROM chat_windows WHERE id = $1", window) == 0
    assert await pool.fetchval("SELECT operation_ids FROM reply_jobs WHERE id = $1", job_id) == [first, later]
    assert await statuses(pool, later) == [("replying", None)]


async def test_a_second_handler_of_the_same_job_is_refused_while_the_first_holds_it(pool):
    op = await operation(pool, "1", at=T0)
    job_id = await job(pool, [op])
    store = JobStore(pool)
    async with store.exclusive(job_id) as first:
        assert isinstance(await first.claim(job_id, 1), Job)
        async with store.exclusive(job_id) as second:
            with pytest.raises(JobBusy):
                await second.claim(job_id, 2)
    async with store.exclusive(job_id) as db:  # released: the next one gets it
        assert isinstance(await db.claim(job_id, 3), Job)
    assert await pool.fetchval("SELECT attempts FROM reply_jobs WHERE id = $1", job_id) == 3


async def test_recording_the_reply_releases_the_job_for_a_copy_that_then_skips_it(pool):
    op = await operation(pool, "1", at=T0)
    job_id = await job(pool, [op])
    store = JobStore(pool)
    async with store.exclusive(job_id) as first:
        claimed = await first.claim(job_id, 1)
        assert isinstance(claimed, Job)
        await first.before_send(claimed, "the reply", 1)
        await first.record_sent(claimed, "the reply", "m-1")
        async with store.exclusive(job_id) as copy:
            assert await copy.claim(job_id, 2) == Skip("job already sent")


async def test_a_claim_brings_the_chats_earlier_turns_oldest_first(pool):
    first_contact = await operation(pool, "0", at=T0 - timedelta(seconds=30))
    first_job = await job(pool, [first_contact])
    assert (await claim(pool, first_job)).history == ()  # no reply in this chat yet
    await pool.execute("UPDATE reply_jobs SET status = 'superseded' WHERE id = $1", first_job)

    earlier = await operation(pool, "1", at=T0)
    sent = await job(pool, [earlier], status="sent")
    await pool.execute("UPDATE operations SET status = 'replied' WHERE id = $1", earlier)
    await pool.execute(
        "UPDATE reply_jobs SET reply_text = 'an earlier reply', sent_at = $2 WHERE id = $1",
        sent,
        T0 + timedelta(seconds=2),
    )
    await pool.execute(
        "SELECT chatq_advance_last_answered($1, 'telegram', $2, '1', $2, $3, $4)", CHAT, T0, T0, sent
    )
    now = await operation(pool, "2", at=T0 + timedelta(seconds=10))
    job_id = await job(pool, [now])

    state = await claim(pool, job_id)

    assert isinstance(state, Job)
    assert [(t.role, t.text) for t in state.history] == [("buyer", "message 1"), ("bot", "an earlier reply")]


async def test_before_send_leaves_the_window_alone_while_an_earlier_message_of_the_chat_is_in_transit(pool):
    # Message 2 was received before message 3 but is still on its way (redelivered after a
    # consumer died): folding 3 into this reply would answer it before 2's reply.
    first = await operation(pool, "1", at=T0)
    job_id = await job(pool, [first])
    in_transit = await operation(pool, "2", at=T0 + timedelta(seconds=1), status="queued")
    later = await operation(pool, "3", at=T0 + timedelta(seconds=2))
    await pool.execute(
        "UPDATE operations SET received_at = now() - interval '2 seconds' WHERE id = $1", in_transit
    )
    window = uuid.uuid4()
    await pool.execute(
        """
        INSERT INTO chat_windows (id, chat_key, platform, account_id, chat_id, status, first_at, last_at,
                                  deadline_at, due_at, delay_seconds, message_count)
        VALUES ($1, $2, 'telegram', 'bot', '77', 'open', now(), now(), now(), now(), 0, 1)
        """,
        window,
        CHAT,
    )
    await pool.execute("INSERT INTO window_messages (operation_id, window_id) VALUES ($1, $2)", later, window)
    async with JobStore(pool).exclusive(job_id) as db:
        claimed = await db.claim(job_id, 1)
        assert isinstance(claimed, Job)
        assert await db.before_send(claimed, "a reply to one", 1) is claimed

    assert await pool.fetchval("SELECT status FROM deliveries WHERE job_id = $1", job_id) == "sending"
    assert (
        await pool.fetchval("SELECT window_id FROM window_messages WHERE operation_id = $1", later) == window
    )
    assert await pool.fetchval("SELECT operation_ids FROM reply_jobs WHERE id = $1", job_id) == [first]


async def test_the_previous_releases_claim_still_answers_with_its_parallel_arrays_during_a_rollout(
    pool: asyncpg.Pool,
) -> None:
    # chatq_claim (one row of nineteen columns) stays one release for the responders
    # still running it; it spreads chatq_claim_job's composite value out the old way.
    late = await operation(pool, "11", at=T0 + timedelta(seconds=5))
    early = await operation(pool, "9", at=T0)
    job_id = await job(pool, [late, early])
    async with pool.acquire() as conn:
        row = await conn.fetchrow("SELECT * FROM chatq_claim($1, 1, 4242, 12)", job_id)
        await conn.execute("SELECT pg_advisory_unlock_all()")
    assert row is not None and row["outcome"] == "claimed" and row["platform"] == "telegram"
    assert row["operation_ids"] == [early, late]
    assert row["message_ids"] == ["9", "11"]
    assert row["texts"] == ["message 9", "message 11"]
    assert row["sent_ats"] == [T0, T0 + timedelta(seconds=5)]
    assert row["delivery_status"] is None and row["history_roles"] == []


async def reply(store: JobStore, job_id: uuid.UUID, text: str) -> None:
    """One job's handling: claim, before send, record sent."""
    async with store.exclusive(job_id) as db:
        claimed = await db.claim(job_id, 1)
        assert isinstance(claimed, Job)
        await db.before_send(claimed, text, 1)
        await db.record_sent(claimed, text, f"m-{job_id}")


async def test_jobs_in_flight_together_take_each_step_in_one_statement_on_one_connection(pool):
    jobs = [
        await job(pool, [await operation(pool, str(n), at=T0, chat=str(n))], chat=str(n)) for n in range(3)
    ]
    store = JobStore(pool, batch=8)
    await asyncio.gather(*(reply(store, j, f"reply {n}") for n, j in enumerate(jobs)))
    rows = await pool.fetch("SELECT status, reply_text FROM reply_jobs WHERE id = ANY($1::uuid[])", jobs)
    assert sorted((r["status"], r["reply_text"]) for r in rows) == [
        ("sent", "reply 0"),
        ("sent", "reply 1"),
        ("sent", "reply 2"),
    ]
    # Three steps for three jobs: nine calls in three statements (claim, before send, record).
    assert (store.calls, store.statements) == (9, 3)
    assert store.holders == {}


async def test_with_batches_of_one_each_job_takes_its_own_statements(pool):
    jobs = [
        await job(pool, [await operation(pool, str(n), at=T0, chat=str(n))], chat=str(n)) for n in range(2)
    ]
    store = JobStore(pool, batch=1)
    await asyncio.gather(*(reply(store, j, "a reply") for j in jobs))
    assert (store.calls, store.statements) == (6, 6)


async def test_a_job_whose_record_fails_fails_alone_and_the_others_of_its_statement_are_recorded(pool):
    good, bad = [
        await job(pool, [await operation(pool, str(n), at=T0, chat=str(n))], chat=str(n)) for n in range(2)
    ]
    store = JobStore(pool, batch=8)
    ready = asyncio.Event()
    sessions_ready = 0

    async def handle(job_id: uuid.UUID) -> str:
        nonlocal sessions_ready
        async with store.exclusive(job_id) as db:
            claimed = await db.claim(job_id, 1)
            assert isinstance(claimed, Job)
            await db.before_send(claimed, "a reply", 1)
            sessions_ready += 1
            if sessions_ready == 2:
                # Settled meanwhile from elsewhere: it is no longer in flight.
                await pool.execute("UPDATE reply_jobs SET status = 'superseded' WHERE id = $1", bad)
                ready.set()
            await asyncio.wait_for(ready.wait(), timeout=10)
            try:
                await db.record_sent(claimed, "a reply", f"m-{job_id}")
            except asyncpg.CheckViolationError:
                return "refused"
            return "recorded"

    outcomes = await asyncio.gather(handle(good), handle(bad))
    assert outcomes == ["recorded", "refused"]
    assert await pool.fetchval("SELECT status FROM reply_jobs WHERE id = $1", good) == "sent"
    # Neither job's lock outlived its session: another connection takes both at once.
    async with JobStore(pool).exclusive(bad) as other:
        assert await other.claim(bad, 2) == Skip("job already superseded")
    async with JobStore(pool).exclusive(good) as other:
        assert await other.claim(good, 2) == Skip("job already sent")


async def test_a_job_whose_claim_fails_fails_alone_and_its_lock_is_given_back(pool):
    good, bad = [
        await job(pool, [await operation(pool, str(n), at=T0, chat=str(n))], chat=str(n)) for n in range(2)
    ]
    # A poison job: any change to its row fails (as a bug or a bad row would).
    await pool.execute(
        f"""
        CREATE FUNCTION test_poison() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            IF NEW.id = '{bad}' THEN RAISE EXCEPTION 'poison job'; END IF;
            RETURN NEW;
        END $$;
        CREATE TRIGGER test_poison BEFORE UPDATE ON reply_jobs FOR EACH ROW EXECUTE FUNCTION test_poison();
        """
    )
    store = JobStore(pool, batch=8)

    async def claim_one(job_id: uuid.UUID) -> object:
        async with store.exclusive(job_id) as db:
            try:
                return await db.claim(job_id, 1)
            except asyncpg.RaiseError as exc:
                return str(exc)

    try:
        claimed, failed = await asyncio.gather(claim_one(good), claim_one(bad))
    finally:
        await pool.execute("DROP TRIGGER test_poison ON reply_jobs; DROP FUNCTION test_poison()")
    assert isinstance(claimed, Job) and claimed.job_id == good
    assert failed == "poison job"
    assert await pool.fetchval("SELECT status FROM reply_jobs WHERE id = $1", bad) == "pending"
    async with JobStore(pool).exclusive(bad) as other:  # its lock did not stay with the connection
        assert isinstance(await other.claim(bad, 2), Job)


async def test_a_claim_writes_no_operation_row_of_a_message_filed_and_reads_none_in_transit(pool):
    """A claim used to update every message's row to 'replying' (not HOT: eight index
    entries each); the status is read from the coverage row now, and only a message not
    yet filed is written (it must leave the in-transit states). Claims of one session, past
    the point where PL/pgSQL plans them once for any values, read by key: none reads the
    messages in transit."""
    await pool.execute(
        """
        INSERT INTO operations (id, platform, account_id, event_id, chat_id, message_id, text, sent_at,
                                status, received_at, payload)
        SELECT gen_random_uuid(), 'telegram', 'bot', 'old-' || g, 'old-' || g, '1', 'hi', $1, 'replied', $1, '{}'
        FROM generate_series(1, 20000) g
        """,
        T0,
    )
    for n in range(300):
        await operation(pool, f"t{n}", at=T0, status="accepted", chat=f"busy-{n}")
    jobs = []
    for n in range(8):
        filed = await operation(pool, f"f{n}", at=T0, chat=f"c{n}")
        early = await operation(pool, f"e{n}", at=T0 + timedelta(seconds=1), status="queued", chat=f"c{n}")
        jobs.append((await job(pool, [filed, early], chat=f"c{n}"), filed, early))
    await pool.execute("ANALYZE operations")
    counts = """
        SELECT (SELECT n_tup_upd FROM pg_stat_user_tables WHERE relname = 'operations'),
               (SELECT idx_tup_read FROM pg_stat_user_indexes WHERE indexrelname = 'operations_in_transit_by_receipt')
    """
    # One connection for the claims and the counts: a backend's own statistics are flushed
    # on demand (pg_stat_force_next_flush), another's only about a second later.
    async with pool.acquire() as conn:
        await conn.execute("SELECT pg_stat_force_next_flush()")
        updated, in_transit_read = await conn.fetchrow(counts)
        for job_id, _, _ in jobs:
            assert (
                await conn.fetchval("SELECT (chatq_claim_job($1, 1, 4242, 0)).outcome", job_id) == "claimed"
            )
            await conn.execute("SELECT pg_advisory_unlock(4242)")
        await conn.execute("SELECT pg_stat_force_next_flush()")
        updated_after, in_transit_read_after = await conn.fetchrow(counts)
    assert updated_after - updated == len(jobs), (
        "only each message not yet filed is written (it leaves transit)"
    )
    assert in_transit_read_after - in_transit_read < 10 * len(jobs)
    for _, filed, early in jobs:
        assert await statuses(pool, filed, early) == [("replying", None)] * 2
        assert await pool.fetchval("SELECT status FROM operations WHERE id = $1", filed) == "waiting"


async def waits_on_a_lock(pool: asyncpg.Pool, conn: asyncpg.Connection) -> bool:
    """Whether ``conn``'s backend is waiting for a lock (a row's, an advisory one)."""
    return bool(
        await pool.fetchval(
            "SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = $1", conn.get_server_pid()
        )
    )


async def test_a_record_of_several_jobs_takes_their_chats_locks_in_the_order_the_coalescer_takes_them(pool):
    """Recording a job's reply ends it, and the trigger that unblocks its chat's next window
    takes the chat's lock (40_windows_blocked.sql), held until the statement commits. The
    coalescer's filing of a batch takes its chats' locks in the order of their lock keys
    (chatq_lock_chats), as do before-send batches: a record of several jobs that took them
    in the order the jobs came deadlocked with a filing of the same two chats (Postgres
    broke it after deadlock_timeout, failing one of them), more often the more jobs share
    a statement (RESPONDER_BATCH_JOBS)."""
    keys = {c: await pool.fetchval("SELECT hashtextextended($1, 0)", f"telegram:bot:{c}") for c in "12"}
    # The job recorded first has the chat whose lock comes last.
    first, second = sorted(keys, key=lambda c: keys[c], reverse=True)
    jobs = {
        c: await job(pool, [await operation(pool, c, at=T0, chat=c)], status="processing", chat=c)
        for c in (first, second)
    }
    async with pool.acquire() as blocker, pool.acquire() as filer, pool.acquire() as responder:
        held = blocker.transaction()
        await held.start()
        # Something holds the second job's row a moment (a sweep, a person's retry).
        await blocker.execute("SELECT 1 FROM reply_jobs WHERE id = $1 FOR UPDATE", jobs[second])
        recording = asyncio.create_task(
            responder.fetch(
                "SELECT * FROM chatq_record_sent_many($1, $2, $3, $4) ORDER BY i",
                [jobs[first], jobs[second]],
                ["reply 1", "reply 2"],
                ["m-1", "m-2"],
                [1, 2],
            )
        )
        await wait_for(lambda: waits_on_a_lock(pool, responder), what="the record to wait on the held row")
        filing_tx = filer.transaction()
        await filing_tx.start()
        filing = asyncio.create_task(
            filer.fetch(
                "SELECT * FROM chatq_lock_chats($1::text[], $2::uuid[])",
                [f"telegram:bot:{first}", f"telegram:bot:{second}"],
                [uuid.uuid4(), uuid.uuid4()],
            )
        )
        # Before the fix the filing waits on the first chat's lock, which the record holds;
        # after it, the filing takes both locks at once.
        await wait_for(
            lambda: filing.done() or waits_on_a_lock(pool, filer), what="the filing to lock or to wait"
        )
        await held.rollback()
        filed = (await asyncio.gather(asyncio.wait_for(filing, timeout=10), return_exceptions=True))[0]
        await filing_tx.rollback()
        recorded = (await asyncio.gather(asyncio.wait_for(recording, timeout=10), return_exceptions=True))[0]
    assert not isinstance(filed, BaseException), filed
    assert not isinstance(recorded, BaseException), recorded
    assert await pool.fetchval("SELECT count(*) FROM reply_jobs WHERE status = 'sent'") == 2
