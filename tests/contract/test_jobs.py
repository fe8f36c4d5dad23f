"""The jobs store's contract: the same bodies against ``stores.jobs.fake.InMemoryJobs``
and ``stores.jobs.postgres.JobStore`` (the job functions of stores/jobs/functions/30_jobs.sql:
the batch functions, on a shared connection and on one each, and the per-job ones). The responder's
branches are unit-tested on the fake (tests/unit/test_responder_branches.py); these say the
fake decides what Postgres decides: which messages a claim takes, what is skipped, what a
send that may have happened becomes, what a record and a give-up move."""

from __future__ import annotations

import asyncio
import uuid
from datetime import datetime, timedelta
from typing import Protocol

import asyncpg
import pytest

from shared.broker.consumer import Reject
from shared.state.job import JobStatus
from shared.state.operation import OperationStatus
from stores.jobs.fake import InMemoryJobs
from stores.jobs.postgres import JobStore
from stores.jobs.protocol import Job, JobBusy, JobStorage, Reconcile, Skip
from tests.contract.conftest import MEMORY, OWN_CONNECTION, PER_JOB, POSTGRES, backends, postgres_pool
from tests.support import seed

T0 = seed.T0
SUPERSEDED = Skip("every message is answered or held by another reply")


class Jobs(Protocol):
    """A store and what a body needs around it: seeding, and reading state back. A
    message's status is read as a person reads it: on Postgres ``chatq_shown_status`` (a
    claim writes no operation row: a message a reply holds shows as replying), in the fake
    as stored (its claim and ``hold`` write replying)."""

    store: JobStorage

    async def message(self, message_id: str, *, at: datetime = T0, status: str = "waiting") -> uuid.UUID: ...

    async def job(self, *ops: uuid.UUID, status: str = "pending", chat: str = "77") -> uuid.UUID: ...

    async def hold(self, op: uuid.UUID, job_id: uuid.UUID) -> None: ...

    async def arrive_in_window(self, job_id: uuid.UUID, *ops: uuid.UUID) -> None: ...

    async def job_status(self, job_id: uuid.UUID) -> str: ...

    async def statuses(self, *ops: uuid.UUID) -> list[str]: ...

    async def delivery(self, job_id: uuid.UUID) -> tuple[str, str] | None: ...


class MemoryJobs:
    def __init__(self) -> None:
        self.store = self.fake = InMemoryJobs()

    async def message(self, message_id: str, *, at: datetime = T0, status: str = "waiting") -> uuid.UUID:
        return self.fake.message(message_id, at=at, status=OperationStatus(status))

    async def job(self, *ops: uuid.UUID, status: str = "pending", chat: str = "77") -> uuid.UUID:
        return self.fake.job(*ops, chat_id=chat, status=JobStatus(status))

    async def hold(self, op: uuid.UUID, job_id: uuid.UUID) -> None:
        self.fake.hold(op, job_id)

    async def arrive_in_window(self, job_id: uuid.UUID, *ops: uuid.UUID) -> None:
        self.fake.arrive_in_window(job_id, *ops)

    async def job_status(self, job_id: uuid.UUID) -> str:
        return self.fake.jobs[job_id].status.value

    async def statuses(self, *ops: uuid.UUID) -> list[str]:
        return [self.fake.operations[o].status.value for o in ops]

    async def delivery(self, job_id: uuid.UUID) -> tuple[str, str] | None:
        d = self.fake.jobs[job_id].delivery
        return None if d is None else (d.status.value, d.text)


class PostgresJobs:
    """Rows seeded directly (as tests/integration/test_job_claim.py does), so each situation
    is exact."""

    def __init__(self, pool: asyncpg.Pool, *, batch: int = 8, per_job: bool = False) -> None:
        self.pool = pool
        self.store = JobStore(pool, batch=batch, per_job=per_job)

    async def message(self, message_id: str, *, at: datetime = T0, status: str = "waiting") -> uuid.UUID:
        return await seed.operation(self.pool, message_id, at=at, status=status)

    async def job(self, *ops: uuid.UUID, status: str = "pending", chat: str = "77") -> uuid.UUID:
        return await seed.job(self.pool, list(ops), status=status, chat=chat)

    async def hold(self, op: uuid.UUID, job_id: uuid.UUID) -> None:
        await self.pool.execute(
            "INSERT INTO reply_coverage (operation_id, job_id) VALUES ($1, $2)", op, job_id
        )

    async def arrive_in_window(self, job_id: uuid.UUID, *ops: uuid.UUID) -> None:
        window = uuid.uuid4()
        await self.pool.execute(
            """
            INSERT INTO chat_windows (id, chat_key, platform, account_id, chat_id, status, first_at, last_at,
                                      deadline_at, due_at, delay_seconds, message_count)
            SELECT $1, chat_key, platform, account_id, chat_id, 'open', $3, $3, $3, $3, 0, $4
            FROM reply_jobs WHERE id = $2
            """,
            window,
            job_id,
            T0,
            len(ops),
        )
        await self.pool.executemany(
            "INSERT INTO window_messages (operation_id, window_id) VALUES ($1, $2)",
            [(o, window) for o in ops],
        )

    async def job_status(self, job_id: uuid.UUID) -> str:
        status: str = await self.pool.fetchval("SELECT status FROM reply_jobs WHERE id = $1", job_id)
        return status

    async def statuses(self, *ops: uuid.UUID) -> list[str]:
        rows = {
            r["id"]: r["status"]
            for r in await self.pool.fetch(
                # What a reader sees: a claim leaves the row 'waiting' and shows 'replying'.
                "SELECT id, chatq_shown_status(status, id, platform, account_id, chat_id) AS status"
                " FROM operations WHERE id = ANY($1::uuid[])",
                ops,
            )
        }
        return [rows[o] for o in ops]

    async def delivery(self, job_id: uuid.UUID) -> tuple[str, str] | None:
        row = await self.pool.fetchrow("SELECT status, text FROM deliveries WHERE job_id = $1", job_id)
        return None if row is None else (row["status"], row["text"])


@backends(MEMORY, POSTGRES, OWN_CONNECTION, PER_JOB)
def jobs(request: pytest.FixtureRequest) -> Jobs:
    if request.param == MEMORY:
        return MemoryJobs()
    pool = postgres_pool(request)
    if request.param == OWN_CONNECTION:
        return PostgresJobs(pool, batch=1)
    return PostgresJobs(pool, per_job=request.param == PER_JOB)


async def claim(jobs: Jobs, job_id: uuid.UUID, attempt: int = 1) -> Job | Skip | Reconcile:
    async with jobs.store.exclusive(job_id) as session:
        return await session.claim(job_id, attempt)


async def claimed(jobs: Jobs, job_id: uuid.UUID) -> Job:
    state = await claim(jobs, job_id)
    assert isinstance(state, Job), state
    return state


# ---- claim ---------------------------------------------------------------------------------


async def test_a_fresh_job_is_claimed_with_its_messages_in_platform_order_and_holds_them(jobs: Jobs) -> None:
    # Message ids compare as numbers: "9" before "10" at the same moment.
    b = await jobs.message("10", at=T0)
    a = await jobs.message("9", at=T0)
    c = await jobs.message("11", at=T0 + timedelta(seconds=1))
    job_id = await jobs.job(b, a, c)

    state = await claimed(jobs, job_id)

    assert [m.message_id for m in state.messages] == ["9", "10", "11"]
    assert (state.platform, state.account_id, state.chat_id) == ("telegram", "bot", "77")
    assert await jobs.job_status(job_id) == "processing"
    assert await jobs.statuses(a, b, c) == ["replying"] * 3


async def test_a_job_the_store_does_not_have_is_rejected(jobs: Jobs) -> None:
    with pytest.raises(Reject, match="not in the database"):
        await claim(jobs, uuid.uuid4())


async def test_a_final_job_is_skipped_and_left_as_it_is(jobs: Jobs) -> None:
    op = await jobs.message("1", status="replied")
    job_id = await jobs.job(op, status="sent")

    assert await claim(jobs, job_id) == Skip("job already sent")
    assert await jobs.job_status(job_id) == "sent"
    assert await jobs.statuses(op) == ["replied"]


async def test_a_message_another_job_holds_is_left_to_that_job(jobs: Jobs) -> None:
    held = await jobs.message("1", at=T0)
    own = await jobs.message("2", at=T0 + timedelta(seconds=1))
    holder = await jobs.job(held, status="processing", chat="other")
    await jobs.hold(held, holder)
    job_id = await jobs.job(held, own)

    state = await claimed(jobs, job_id)

    assert [m.operation_id for m in state.messages] == [own]
    assert await jobs.statuses(held, own) == ["replying", "replying"]


async def test_a_job_whose_every_message_another_job_holds_is_superseded(jobs: Jobs) -> None:
    op = await jobs.message("1")
    holder = await jobs.job(op, status="processing", chat="other")
    await jobs.hold(op, holder)
    job_id = await jobs.job(op)

    assert await claim(jobs, job_id) == SUPERSEDED
    assert await jobs.job_status(job_id) == "superseded"
    assert await jobs.statuses(op) == ["replying"]  # still the holder's


async def test_a_second_handler_of_the_same_job_is_refused_while_the_first_holds_it(jobs: Jobs) -> None:
    job_id = await jobs.job(await jobs.message("1"))
    async with jobs.store.exclusive(job_id) as first:
        assert isinstance(await first.claim(job_id, 1), Job)
        async with jobs.store.exclusive(job_id) as second:
            with pytest.raises(JobBusy):
                await second.claim(job_id, 2)
    assert isinstance(await claim(jobs, job_id, 3), Job)  # released: the next one gets it


# ---- before send, record -------------------------------------------------------------------


async def test_a_job_with_an_interrupted_send_is_reconciled_with_the_text_it_was_sending(jobs: Jobs) -> None:
    op = await jobs.message("1")
    job_id = await jobs.job(op)
    async with jobs.store.exclusive(job_id) as session:
        job = await session.claim(job_id, 1)
        assert isinstance(job, Job)
        await session.before_send(job, "the reply", 1, fold=False)

    state = await claim(jobs, job_id, 2)

    assert isinstance(state, Reconcile)
    assert (state.text, state.delivery_status) == ("the reply", "sending")
    assert [m.operation_id for m in state.job.messages] == [op]


async def test_recording_a_reply_moves_the_job_its_delivery_and_its_messages_together(jobs: Jobs) -> None:
    a = await jobs.message("1", at=T0)
    b = await jobs.message("2", at=T0 + timedelta(seconds=1))
    job_id = await jobs.job(a, b)
    async with jobs.store.exclusive(job_id) as session:
        job = await session.claim(job_id, 1)
        assert isinstance(job, Job)
        await session.before_send(job, "the reply", 1)
        await session.record_sent(job, "the reply", "m-9")

    assert await jobs.job_status(job_id) == "sent"
    assert await jobs.delivery(job_id) == ("sent", "the reply")
    assert await jobs.statuses(a, b) == ["replied", "replied"]


async def test_recording_the_reply_releases_the_job_for_a_copy_that_then_skips_it(jobs: Jobs) -> None:
    job_id = await jobs.job(await jobs.message("1"))
    async with jobs.store.exclusive(job_id) as first:
        job = await first.claim(job_id, 1)
        assert isinstance(job, Job)
        await first.before_send(job, "the reply", 1)
        await first.record_sent(job, "the reply", "m-1")
        async with jobs.store.exclusive(job_id) as copy:
            assert await copy.claim(job_id, 2) == Skip("job already sent")


async def a_job_and_a_later_message_in_its_window(jobs: Jobs) -> tuple[uuid.UUID, uuid.UUID, uuid.UUID]:
    """A job for one message, and a second message of the chat, 2 s later, in the window
    open behind it: (the first message, the job, the later message)."""
    first = await jobs.message("1", at=T0)
    job_id = await jobs.job(first)
    later = await jobs.message("2", at=T0 + timedelta(seconds=2))
    await jobs.arrive_in_window(job_id, later)
    return first, job_id, later


async def test_before_send_folds_the_chats_open_window_into_the_job_and_then_records_the_intent(
    jobs: Jobs,
) -> None:
    first, job_id, later = await a_job_and_a_later_message_in_its_window(jobs)
    async with jobs.store.exclusive(job_id) as session:
        job = await session.claim(job_id, 1)
        assert isinstance(job, Job)
        folded = await session.before_send(job, "a reply to one", 1)
        assert await jobs.delivery(job_id) is None  # nothing recorded: the reply is written again
        again = await session.before_send(folded, "a reply to both", 1)

    assert [m.operation_id for m in folded.messages] == [first, later]
    assert again is folded
    assert await jobs.delivery(job_id) == ("sending", "a reply to both")
    assert await jobs.statuses(later) == ["replying"]


async def test_before_send_without_folding_records_the_intent_and_leaves_the_window_waiting(
    jobs: Jobs,
) -> None:
    first, job_id, later = await a_job_and_a_later_message_in_its_window(jobs)
    async with jobs.store.exclusive(job_id) as session:
        job = await session.claim(job_id, 1)
        assert isinstance(job, Job)
        kept = await session.before_send(job, "a reply to one", 1, fold=False)

    assert [m.operation_id for m in kept.messages] == [first]
    assert await jobs.delivery(job_id) == ("sending", "a reply to one")
    assert await jobs.statuses(later) == ["waiting"]


# ---- retry, give up ------------------------------------------------------------------------


async def test_a_retried_job_is_pending_again_and_its_next_claim_takes_the_same_messages(jobs: Jobs) -> None:
    op = await jobs.message("1")
    job_id = await jobs.job(op)
    async with jobs.store.exclusive(job_id) as session:
        assert isinstance(await session.claim(job_id, 1), Job)
        await session.record_retry(job_id, "transient", "the platform answered 503")

    assert await jobs.job_status(job_id) == "pending"
    again = await claimed(jobs, job_id)
    assert [m.operation_id for m in again.messages] == [op]


async def test_giving_up_before_any_send_fails_the_job_and_its_messages(jobs: Jobs) -> None:
    a, b = await jobs.message("1"), await jobs.message("2", at=T0 + timedelta(seconds=1))
    job_id = await jobs.job(a, b)
    await claimed(jobs, job_id)

    settled = await jobs.store.give_up(job_id, "permanent", "the platform refused the chat", "on-call")

    assert (settled.outcome, sorted(settled.operation_ids)) == ("failed", sorted([a, b]))
    assert await jobs.job_status(job_id) == "failed"
    assert await jobs.statuses(a, b) == ["failed", "failed"]


async def test_giving_up_after_a_send_began_hands_the_job_and_its_messages_to_a_person(jobs: Jobs) -> None:
    op = await jobs.message("1")
    job_id = await jobs.job(op)
    async with jobs.store.exclusive(job_id) as session:
        job = await session.claim(job_id, 1)
        assert isinstance(job, Job)
        await session.before_send(job, "the reply", 1)

    settled = await jobs.store.give_up(job_id, "unknown", "the send timed out", "on-call")

    assert settled.outcome == "needs_review"
    assert await jobs.job_status(job_id) == "needs_review"
    assert await jobs.statuses(op) == ["needs_review"]


async def test_giving_up_on_a_job_already_final_changes_nothing(jobs: Jobs) -> None:
    op = await jobs.message("1", status="replied")
    job_id = await jobs.job(op, status="sent")

    settled = await jobs.store.give_up(job_id, "permanent", "late", "on-call")

    assert (settled.outcome, settled.operation_ids) == ("final", [])
    assert await jobs.job_status(job_id) == "sent"
    assert await jobs.statuses(op) == ["replied"]


# ---- jobs in flight together ---------------------------------------------------------------


async def test_jobs_in_flight_together_each_claim_send_and_record_only_their_own_messages(jobs: Jobs) -> None:
    """On Postgres with a shared connection, each step of the three jobs goes as one
    statement (chatq_claim_jobs, chatq_before_send_many, chatq_record_sent_many); per job,
    as chatq_claim_job, chatq_before_send, chatq_record_sent each: the same outcome every
    way, and the fake's."""
    ops = {chat: [await jobs.message(f"{chat}-{n}") for n in (1, 2)] for chat in ("a", "b", "c")}
    job_ids = {chat: await jobs.job(*ops[chat], chat=chat) for chat in ops}

    async def handle(chat: str) -> list[uuid.UUID]:
        async with jobs.store.exclusive(job_ids[chat]) as session:
            job = await session.claim(job_ids[chat], 1)
            assert isinstance(job, Job)
            await session.before_send(job, f"reply to {chat}", 1)
            await session.record_sent(job, f"reply to {chat}", f"m-{chat}")
            return job.operation_ids

    taken = await asyncio.gather(*(handle(chat) for chat in ops))

    assert [sorted(t) for t in taken] == [sorted(ops[chat]) for chat in ops]
    for chat in ops:
        assert await jobs.job_status(job_ids[chat]) == "sent"
        assert await jobs.delivery(job_ids[chat]) == ("sent", f"reply to {chat}")
        assert await jobs.statuses(*ops[chat]) == ["replied", "replied"]
