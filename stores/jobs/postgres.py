"""The responder's state in Postgres: every decision about a job is taken here, before
any side effect, and every state change is one transaction (the job functions of
stores/jobs/functions/30_jobs.sql, under the transition tables of shared/state).

- A job already final (sent, failed, needs_review, superseded) is skipped.
- A job whose delivery says ``sending`` or ``unknown`` may already be on the platform:
  it is reconciled, never re-sent blindly, and giving up on it goes to a person.
- A job keeps the messages no other reply holds; one whose messages are all answered or
  held elsewhere is superseded. A message is never dropped because a later one of its
  chat was answered first.
- The job, the operations it covers and the chat's last answered message move together.
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import TypeVar

import asyncpg
from asyncpg.pool import PoolConnectionProxy

from shared import metrics
from shared.broker.consumer import Outcome, Reject, classify
from shared.db import Conn, announce_jobs_ended, one
from shared.messages import JobCaps
from shared.state import job as job_state
from shared.state.job import DeliveryStatus, lock_key
from stores.accounts import postgres as account_state
from stores.jobs.batches import SharedConnection, lost
from stores.jobs.protocol import (
    AccountStopped,
    Attempts,
    Job,
    JobBusy,
    JobWithdrawn,
    Message,
    Part,
    Reconcile,
    Settled,
    Skip,
    Turn,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")
ItemT = TypeVar("ItemT")
R = TypeVar("R")


#: chatq_before_send's SQLSTATEs for an account removed, or paused, meanwhile.
_ACCOUNT_REMOVED, _ACCOUNT_PAUSED = "CQ001", "CQ002"


@dataclass
class Unrecorded:
    """What the platform told this process about a job's sends whose record was lost with
    the connection (the statement may not have committed): the platform's message ids.
    When the connection drops, the consumer runs the job's handler again in this process,
    and its claim records these first (``PgJobSession.claim``). Claimed again instead, the
    job found its delivery 'sending' and, on a platform that cannot be asked (Telegram),
    went to a person although its reply was delivered."""

    #: Parts of a reply in parts the platform took: part number -> platform message id.
    parts: dict[int, str] = field(default_factory=dict)
    #: The whole reply the platform took: its text and its (last part's) platform message id.
    sent: tuple[str, str] | None = None


def _connection_lost(exc: BaseException) -> bool:
    """Whether a statement failed with its connection or server (the consumer then runs
    the handler again, in this process) rather than for what it asked."""
    return classify(exc) is Outcome.RETRY_IN_PROCESS


class JobStore:
    def __init__(
        self,
        pool: asyncpg.Pool,
        *,
        history: int = 12,
        caps: JobCaps | None = None,
        batch: int = 8,
        per_job: bool = False,
    ) -> None:
        self._pool = pool
        self._history = history
        self._caps = caps or JobCaps()
        self._batch = batch
        #: Each step as the per-job functions (chatq_claim_job, chatq_before_send,
        #: chatq_record_sent), never the batch ones: what runs when a batch fails for one
        #: job's reason. The batch functions take the common way in one statement for every
        #: job and are a second definition of it; tests/contract runs its bodies both ways.
        self._steps = PER_JOB if per_job else BATCHED
        #: Shared connections that sessions may still join.
        self._open: list[SharedConnection] = []
        #: The session of this process that holds each job's lock now (or may: a claim sent).
        self.holders: dict[uuid.UUID, PgJobSession] = {}
        #: Sends the platform took whose record was lost with the connection, by job.
        self.unrecorded: dict[uuid.UUID, Unrecorded] = {}
        #: Statements sent on connections given back, and the jobs' calls they answered.
        self.statements = 0
        self.calls = 0

    @contextlib.asynccontextmanager
    async def exclusive(self, job_id: uuid.UUID) -> AsyncIterator[PgJobSession]:
        """A session for the whole handling of a job, on a connection it shares with the
        other jobs in flight (up to ``batch`` of them; stores/jobs/batches.py):
        their claims, delivery intents and records go as one statement each. The claim
        takes the job's session advisory lock on it, held across the platform call: a
        redelivered copy (the broker's, after a lost ack) that arrives while the first
        handler still runs is refused instead of reconciling a send that is still in
        progress (a copy in this process is refused before Postgres is asked: on the same
        connection the lock would be granted to it again). Recording the reply releases
        it; otherwise it is released here. A handler that dies releases it with its
        connection, and a connection whose unlock did not complete is closed rather than
        pooled with the lock still held, once its other jobs are done."""
        shared = next((c for c in self._open if c.members < self._batch and not c.broken), None)
        if shared is None:
            shared = SharedConnection(self._pool.acquire())
            self._open.append(shared)
        shared.members += 1
        try:
            await shared.connection()
            session = PgJobSession(
                shared, job_id, self._history, self._caps, self.holders, self.unrecorded, self._steps
            )
            try:
                yield session
            finally:
                await session.release()
        finally:
            shared.members -= 1
            if shared.members == 0:
                await self._close(shared)

    async def _close(self, shared: SharedConnection) -> None:
        """Back to the pool once its last session ended (closed first if it is broken)."""
        if shared in self._open:
            self._open.remove(shared)
        self.statements += shared.statements
        self.calls += shared.calls
        try:
            conn = await shared.connection()
        except Exception:
            return  # never acquired
        if shared.broken:
            # A connection lost under us is detached from its proxy already, and the pool
            # knows: terminate (which then raises) has nothing left to do.
            with contextlib.suppress(asyncpg.InterfaceError):
                conn.terminate()
        assert isinstance(conn, PoolConnectionProxy)  # acquired from the pool
        await self._pool.release(conn)

    async def give_up(self, job_id: uuid.UUID, kind: str, reason: str, owner: str) -> Settled:
        """``PgJobSession.give_up`` on a connection of its own (the consumer's hooks)."""
        async with self.exclusive(job_id) as session:
            return await session.give_up(job_id, kind, reason, owner)

    async def retry_scheduled(self, job_id: uuid.UUID, attempt: int, delay: float) -> None:
        """On the record of each of the job's messages: when the next attempt comes (the
        consumer's retry hook, once the job is in its retry tier)."""
        await self._pool.execute(
            """
            SELECT chatq_log(operation_ids, 'retry_scheduled',
                             'next: attempt ' || $2 || ' after the ' || $3 || 's retry tier', id)
            FROM reply_jobs WHERE id = $1 AND status = 'pending'
            """,
            job_id,
            str(attempt),
            f"{delay:g}",
        )

    async def pause_account(self, platform: str, account_id: str, reason: str, probe_in: float) -> bool:
        """The platform refused the account as a whole. True when it was active until now."""
        async with self._pool.acquire() as conn:
            return await account_state.pause_by_platform(conn, platform, account_id, reason, probe_in)

    async def resume_account(self, platform: str, account_id: str) -> bool:
        async with self._pool.acquire() as conn:
            return await account_state.resume(conn, platform, account_id)

    async def probe_later(self, platform: str, account_id: str, reason: str, probe_in: float) -> None:
        async with self._pool.acquire() as conn:
            await account_state.probe_later(conn, platform, account_id, reason, probe_in)

    @contextlib.asynccontextmanager
    async def accounts_to_probe(self, platforms: list[str]) -> AsyncIterator[list[asyncpg.Record]]:
        """The paused accounts due for a probe, to one replica at a time (an empty list to
        the others while it probes)."""
        async with self._pool.acquire() as conn:
            if not await conn.fetchval("SELECT pg_try_advisory_lock($1)", PROBE_LOCK_KEY):
                yield []
                return
            try:
                yield await account_state.due_for_probe(conn, platforms)
            finally:
                await conn.execute("SELECT pg_advisory_unlock($1)", PROBE_LOCK_KEY)


#: One account prober at a time across responder replicas.
PROBE_LOCK_KEY = 0x63686174_70726F62  # "chatprob"


class PgJobSession:
    """The job's state changes, on the connection it shares with the other jobs in flight.
    Each is one statement (the functions of stores/jobs/functions/30_jobs.sql), so one
    transaction: a reply costs three (claim, before send, record sent), each sent as one
    round trip with the same step of the other jobs that take it at that moment."""

    def __init__(
        self,
        shared: SharedConnection,
        job_id: uuid.UUID,
        history: int,
        caps: JobCaps | None = None,
        holders: dict[uuid.UUID, PgJobSession] | None = None,
        unrecorded: dict[uuid.UUID, Unrecorded] | None = None,
        steps: Steps | None = None,
    ) -> None:
        self._steps = steps or BATCHED
        self._shared = shared
        self._job_id = job_id
        self._lock_key = lock_key(job_id)
        self._history = history
        self._caps = caps or JobCaps()
        self._holders = holders if holders is not None else {}
        self._unrecorded = unrecorded if unrecorded is not None else {}
        # None: unknown (a claim that raised may have taken it); True: held; False: not held.
        self._locked: bool | None = False

    async def _run(self, statement: Callable[[Conn], Awaitable[T]]) -> T:
        """One statement of this job alone, in turn with the connection's other jobs."""
        async with self._shared.alone() as conn:
            return await statement(conn)

    def _held_elsewhere(self, job_id: uuid.UUID) -> bool:
        """Another session of this process holds the job (or may: its claim is out)."""
        holder = self._holders.get(job_id)
        return holder is not None and holder is not self

    def _set_locked(self, locked: bool | None) -> None:
        self._locked = locked
        if locked is False:
            if self._holders.get(self._job_id) is self:
                del self._holders[self._job_id]
        else:
            self._holders[self._job_id] = self

    async def release(self) -> None:
        if self._locked is False:
            return
        unlocked = False
        try:
            async with self._shared.alone() as conn:
                if lost(conn):
                    return  # the connection's locks ended with it (it is closed, not pooled)
                if conn.is_in_transaction():
                    raise asyncpg.InterfaceError("a transaction is still open")
                # Only this job's lock: the connection's other jobs hold theirs. Session
                # locks stack and outlive a failed statement (a give-up inside the handler
                # that raised may have left a second hold; a claim that raised, none):
                # every hold this connection has on it, which no other session of this
                # process shares (JobStore.holders).
                await conn.execute(
                    "SELECT count(*) FROM generate_series(1, 4) WHERE pg_advisory_unlock($1)", self._lock_key
                )
            unlocked = True
        finally:
            if not unlocked:
                self._shared.broken = True  # closed, not pooled, once its other jobs are done
            self._set_locked(False)

    async def claim(self, job_id: uuid.UUID, attempt: int) -> Job | Skip | Reconcile:
        if self._held_elsewhere(job_id):
            raise JobBusy(f"job {job_id} is being handled by another consumer")
        known = self._unrecorded.get(job_id)
        if known is not None:
            # Before anything else: what the platform took, recorded with its ids.
            done = await self._record_known(job_id, known)
            if done is not None:
                return done
        self._set_locked(None)
        # One composite value (chatq_claim_result) per job, its fields and its rows read by name.
        row = await self._shared.together(
            "claim", (job_id, attempt, self._lock_key, self._history), self._steps.claim
        )
        self._set_locked(row["outcome"] != "busy")
        if row["outcome"] == "busy":
            raise JobBusy(f"job {job_id} is being handled by another consumer")
        if row["outcome"] == "missing":
            raise Reject(f"job {job_id} is not in the database")
        if row["outcome"] == "skip":
            return Skip(row["reason"])
        job = Job(
            job_id,
            row["platform"],
            row["account_id"],
            row["chat_id"],
            tuple(_message(m) for m in row["messages"] or ()),
            tuple(Turn(t["role"], t["text"]) for t in row["history"] or ()),
            row["account_paused"],
            row["business_connection_id"],
        )
        if row["outcome"] == "reconcile":
            delivery = row["delivery"]
            return Reconcile(
                job, delivery["text"], delivery["started_at"], delivery["status"], delivery["maybe_since"]
            )
        return job

    async def before_send(self, job: Job, text: str, attempt: int, *, fold: bool = True) -> Job:
        """Fold the chat's messages that arrived since the job was built into it (one reply
        covers them) and return the grown job, to be written again; or, when there are
        none (or ``fold`` is false), record the delivery intent and return the job as it
        is: committed before the platform is called, from now on the send may have happened."""
        try:
            rows = await self._shared.together(
                "before_send",
                (job.job_id, job.chat_key, text, attempt, fold, self._caps.messages, self._caps.chars),
                self._steps.before_send,
            )
        except asyncpg.PostgresError as exc:
            if exc.sqlstate not in (_ACCOUNT_REMOVED, _ACCOUNT_PAUSED):
                raise
            raise AccountStopped(str(exc), removed=exc.sqlstate == _ACCOUNT_REMOVED) from None
        if not rows:
            return job
        if rows[0]["withdrawn"]:
            raise JobWithdrawn(f"job {job.job_id} withdrawn: the seller answered the chat in person")
        return replace(job, messages=tuple(_message(r) for r in rows))

    async def record_sent(self, job: Job, text: str, platform_message_id: str) -> datetime:
        try:
            row = await self._record_sent(job.job_id, text, platform_message_id)
        except Exception as exc:
            if _connection_lost(exc):
                self._unrecorded.setdefault(job.job_id, Unrecorded()).sent = (text, platform_message_id)
            raise
        self._unrecorded.pop(job.job_id, None)
        return row["sent_at"]  # type: ignore[no-any-return]

    async def _record_sent(self, job_id: uuid.UUID, text: str, platform_message_id: str) -> asyncpg.Record:
        """chatq_record_sent with the jobs recording at this moment; the receipt-to-reply
        and replied metrics."""
        row = await self._shared.together(
            "record_sent", (job_id, text, platform_message_id, self._lock_key), self._steps.record_sent
        )
        self._set_locked(False)
        sent_at: datetime = row["sent_at"]
        for received_at in row["received_ats"]:
            metrics.RECEIPT_TO_REPLY.observe(max((sent_at - received_at).total_seconds(), 0.0))
        metrics.OPERATIONS.labels(outcome="replied").inc(len(row["received_ats"]))
        return row

    async def _record_known(self, job_id: uuid.UUID, known: Unrecorded) -> Skip | None:
        """Record what the platform took before the connection was lost (see
        ``Unrecorded``): parts first; then the reply, which settles the job (a Skip says
        so). None when only parts were known: the claim goes on, and resumes the reply
        from them. A loss again raises, and what is known stays for the next run."""
        # The job's lock first, as its claim takes it: another consumer holding the job
        # decides it (its give-up, its record), and this one waits its turn.
        got = await self._run(lambda conn: conn.fetchval("SELECT pg_try_advisory_lock($1)", self._lock_key))
        if not got:
            raise JobBusy(f"job {job_id} is being handled by another consumer")
        self._set_locked(True)
        for number, message_id in sorted(known.parts.items()):
            await self.part_done(job_id, number, DeliveryStatus.SENT, message_id)
            known.parts.pop(number, None)
        if known.sent is None:
            self._unrecorded.pop(job_id, None)
            return None
        text, message_id = known.sent
        try:
            await self._record_sent(job_id, text, message_id)
        except asyncpg.CheckViolationError:
            # Not in flight: recorded before the connection went (its commit's answer was
            # what was lost), or settled since by another consumer.
            self._unrecorded.pop(job_id, None)
            status = await self._run(
                lambda conn: conn.fetchval("SELECT status FROM reply_jobs WHERE id = $1", job_id)
            )
            if status != job_state.J.SENT:
                logger.error(
                    "job %s: the platform took its reply (message %s), but the job is %s now: not recorded",
                    job_id,
                    message_id,
                    status,
                    extra={"job_id": job_id},
                )
            return Skip(f"job already {status}")
        self._unrecorded.pop(job_id, None)
        return Skip(f"its reply (platform message {message_id}) recorded again after the connection was lost")

    async def recorded_message_ids(self, job: Job, limit: int = 200) -> list[str]:
        """The platform ids of the chat's replies (and their parts) already recorded,
        newest first: an identical reply of an earlier job must never be taken for this
        job's."""
        rows = await self._run(
            lambda conn: conn.fetch(
                """
            SELECT id FROM (
                SELECT r.platform_message_id AS id, r.sent_at AS at FROM reply_jobs r
                WHERE r.chat_key = $1 AND r.status = 'sent' AND r.platform_message_id IS NOT NULL AND r.id <> $2
                UNION ALL
                SELECT p.platform_message_id, p.finished_at FROM reply_jobs r JOIN delivery_parts p ON p.job_id = r.id
                WHERE r.chat_key = $1 AND p.status = 'sent' AND r.id <> $2
            ) recorded
            ORDER BY at DESC NULLS LAST
            LIMIT $3
            """,
                job.chat_key,
                job.job_id,
                limit,
            )
        )
        return [r["id"] for r in rows]

    async def part_intent(self, job_id: uuid.UUID, number: int, text: str) -> None:
        """Before part ``number`` of a long reply is sent: committed first, like a reply's
        intent (a part already sent is never sent again)."""
        await self._run(
            lambda conn: conn.execute(
                """
            INSERT INTO delivery_parts (job_id, part, text, status, started_at) VALUES ($1, $2, $3, 'sending', now())
            ON CONFLICT (job_id, part) DO UPDATE
            SET status = 'sending', text = EXCLUDED.text, started_at = now(), finished_at = NULL,
                platform_message_id = NULL
            WHERE delivery_parts.status = ANY(chatq_delivery_part_sources('sending'))
            """,
                job_id,
                number,
                text,
            )
        )

    async def part_done(
        self, job_id: uuid.UUID, number: int, status: DeliveryStatus, message_id: str | None = None
    ) -> None:
        """Part ``number``'s outcome. Once a part is on the platform the job's reply is partly
        sent (maybe_sent): every later attempt resumes it, never writes a new one. A part
        sent whose record is lost with the connection is recorded by the job's next claim
        in this process (``Unrecorded``)."""
        try:
            await self._part_done(job_id, number, status, message_id)
        except Exception as exc:
            if status is DeliveryStatus.SENT and message_id is not None and _connection_lost(exc):
                self._unrecorded.setdefault(job_id, Unrecorded()).parts[number] = message_id
            raise

    async def _part_done(
        self, job_id: uuid.UUID, number: int, status: DeliveryStatus, message_id: str | None
    ) -> None:
        await self._run(
            lambda conn: conn.execute(
                """
            WITH part AS (
                UPDATE delivery_parts SET status = $3, platform_message_id = $4, finished_at = now()
                WHERE job_id = $1 AND part = $2 AND status = ANY(chatq_delivery_part_sources($3))
                RETURNING status
            )
            , reply AS (
                UPDATE deliveries SET maybe_sent = true, maybe_since = coalesce(maybe_since, started_at)
                WHERE job_id = $1 AND EXISTS (SELECT 1 FROM part WHERE part.status IN ('sent', 'unknown'))
            )
            SELECT chatq_log(r.operation_ids, 'part_sent', 'part ' || $2 || ' of the reply sent (platform message '
                             || $4 || ')', $1)
            FROM reply_jobs r WHERE r.id = $1 AND EXISTS (SELECT 1 FROM part WHERE part.status = 'sent')
            """,
                job_id,
                number,
                status.value,
                message_id,
            )
        )

    async def delivery_parts(self, job_id: uuid.UUID) -> dict[int, Part]:
        """The parts of the job's reply recorded so far (a reply of one part has none)."""
        rows = await self._run(
            lambda conn: conn.fetch(
                "SELECT part, text, status, platform_message_id, started_at FROM delivery_parts WHERE job_id = $1",
                job_id,
            )
        )
        return {
            r["part"]: Part(r["text"], DeliveryStatus(r["status"]), r["platform_message_id"], r["started_at"])
            for r in rows
        }

    async def unknown_rivals(self, job: Job) -> list[Attempts]:
        """The chat's other jobs a person must look at because their reply may be in the
        chat unrecorded: a reply that could be theirs is not taken for this job's."""
        rows = await self._run(
            lambda conn: conn.fetch(
                """
            SELECT d.text, coalesce(d.maybe_since, d.started_at) AS since, d.started_at AS latest
            FROM reply_jobs r JOIN deliveries d ON d.job_id = r.id
            WHERE r.chat_key = $1 AND r.status = 'needs_review' AND r.id <> $2
            """,
                job.chat_key,
                job.job_id,
            )
        )
        return [Attempts(r["text"], r["since"], r["latest"]) for r in rows]

    async def record_delivery(self, job_id: uuid.UUID, status: DeliveryStatus, error: str) -> None:
        """The attempt's outcome when no reply was recorded: not sent, or unknown."""
        await self._run(
            lambda conn: conn.execute(
                """
            UPDATE deliveries SET status = $2, error = $3, finished_at = now()
            WHERE job_id = $1 AND status = ANY(chatq_delivery_sources($2))
            """,
                job_id,
                status.value,
                error[:500],
            )
        )

    async def record_cut(self, job_id: uuid.UUID, detail: str) -> None:
        await self._run(
            lambda conn: conn.execute(
                "SELECT chatq_log(operation_ids, 'prompt_cut', $2, id) FROM reply_jobs WHERE id = $1",
                job_id,
                detail[:500],
            )
        )

    async def record_retry(self, job_id: uuid.UUID, kind: str, reason: str) -> None:
        """Back to pending until the retry tier hands it back; the chat stays blocked. The
        attempt's outcome goes on the record of each of the job's messages (a wait for a
        paused account is not an attempt, and is not recorded again and again)."""
        await self._run(lambda conn: job_state.back_to_pending(conn, job_id, kind, reason))

    async def give_up(self, job_id: uuid.UUID, kind: str, reason: str, owner: str) -> Settled:
        """Stop trying (see chatq_give_up): needs_review when the last send may have
        reached the chat, failed otherwise; nothing when another session holds the job or
        it is final already."""
        if self._held_elsewhere(job_id):
            # On this connection Postgres would grant the lock again: ask nobody.
            return Settled(job_id, "busy", "", [])
        held = self._locked
        self._set_locked(None)
        async with self._shared.alone() as conn:
            row = await conn.fetchrow(
                "SELECT * FROM chatq_give_up($1, $2, $3, $4, $5)",
                job_id,
                kind,
                reason[:500],
                owner,
                self._lock_key,
            )
        assert row is not None
        # The function takes the lock (a second time when this session holds it) and
        # releases what it took.
        self._set_locked(held)
        settled = Settled(job_id, row["outcome"], row["chat_key"] or "", list(row["operation_ids"] or ()))
        if settled.outcome in ("failed", "needs_review"):
            metrics.OPERATIONS.labels(outcome=settled.outcome).inc(len(settled.operation_ids))
        return settled


def _message(r: asyncpg.Record) -> Message:
    return Message(r["operation_id"], r["message_id"], r["text"], r["sent_at"], r["received_at"])


# ---- one statement for the jobs that take the same step together (batches.py) ----------

#: Errors of a whole batch that say nothing about its jobs: the connection or the server.
_INFRASTRUCTURE_SQLSTATE_CLASSES = ("08", "53", "57")


def _whole_batch_failed(exc: Exception) -> bool:
    """Whether a batch's error is the connection's (every job gets it) rather than
    possibly one job's (then each job is tried alone, so a poison job fails alone)."""
    if isinstance(exc, asyncpg.PostgresError):
        return (getattr(exc, "sqlstate", None) or "")[:2] in _INFRASTRUCTURE_SQLSTATE_CLASSES
    return True


async def _each_alone(
    items: Sequence[ItemT], one_job: Callable[[ItemT], Awaitable[R]]
) -> list[R | Exception]:
    results: list[R | Exception] = []
    for item in items:
        try:
            results.append(await one_job(item))
        except Exception as exc:
            results.append(exc)
    return results


_CLAIM_MANY = "SELECT t.i, (t.claim).* FROM chatq_claim_jobs($1, $2, $3, $4) AS t ORDER BY t.i"


async def _claim_many(
    conn: Conn, items: Sequence[tuple[uuid.UUID, int, int, int]]
) -> Sequence[asyncpg.Record | Exception]:
    """chatq_claim_job for each job, in one statement (chatq_claim_jobs: one write per table
    for the jobs that take the common way). If it fails for a reason that may be one job's,
    the locks it took are given back (they outlive the rollback) and each job is claimed
    alone."""
    history = items[0][3]
    try:
        rows = await conn.fetch(
            _CLAIM_MANY, [i[0] for i in items], [i[1] for i in items], [i[2] for i in items], history
        )
        return list(rows)
    except Exception as exc:
        if len(items) == 1 or _whole_batch_failed(exc):
            raise
    # No job of the batch was held by this connection before (JobStore.holders).
    await conn.execute("SELECT pg_advisory_unlock(k) FROM unnest($1::bigint[]) AS k", [i[2] for i in items])
    return await _claim_each(conn, items)


async def _claim_each(
    conn: Conn, items: Sequence[tuple[uuid.UUID, int, int, int]]
) -> Sequence[asyncpg.Record | Exception]:
    """chatq_claim_job for each job, a statement each."""
    return await _each_alone(
        items, lambda i: _fetch_one(conn, "SELECT * FROM chatq_claim_job($1, $2, $3, $4)", *i)
    )


#: chatq_before_send_many: one write of the delivery intents for the jobs that take the
#: common way, chatq_before_send itself for each job off it (a fold, a seller's answer, an
#: account paused or removed).
_BEFORE_SEND_MANY = "SELECT * FROM chatq_before_send_many($1, $2, $3, $4, $5, $6, $7) ORDER BY i, pos"


async def _before_send_many(
    conn: Conn, items: Sequence[tuple[uuid.UUID, str, str, int, bool, int, int]]
) -> Sequence[list[asyncpg.Record] | Exception]:
    """chatq_before_send for each job, in one statement: each job's rows, in order. If it
    fails for a reason that may be one job's (an account paused, a poison row), each job is
    asked alone, so only its own call fails."""
    try:
        rows = await conn.fetch(
            _BEFORE_SEND_MANY,
            *([i[n] for i in items] for n in range(5)),
            items[0][5],
            items[0][6],
        )
    except Exception as exc:
        if len(items) == 1 or _whole_batch_failed(exc):
            raise
        return await _before_send_each(conn, items)
    by_job: list[list[asyncpg.Record]] = [[] for _ in items]
    for row in rows:
        by_job[row["i"] - 1].append(row)
    return list(by_job)


async def _before_send_each(
    conn: Conn, items: Sequence[tuple[uuid.UUID, str, str, int, bool, int, int]]
) -> Sequence[list[asyncpg.Record] | Exception]:
    """chatq_before_send for each job, a statement each."""
    return await _each_alone(
        items,
        lambda i: conn.fetch("SELECT * FROM chatq_before_send($1, $2, $3, $4, $5, $6, $7) ORDER BY pos", *i),
    )


async def _record_sent_many(
    conn: Conn, items: Sequence[tuple[uuid.UUID, str, str, int]]
) -> Sequence[asyncpg.Record | Exception]:
    """chatq_record_sent for each job, in one statement that releases the jobs' locks
    only once every record is in (chatq_record_sent_many); if it fails, each job is
    recorded alone."""
    try:
        rows = await conn.fetch(
            "SELECT * FROM chatq_record_sent_many($1, $2, $3, $4) ORDER BY i",
            *([i[n] for i in items] for n in range(4)),
        )
    except Exception as exc:
        if len(items) == 1 or _whole_batch_failed(exc):
            raise
        return await _record_sent_each(conn, items)
    return await _announced(conn, rows)


async def _record_sent_each(
    conn: Conn, items: Sequence[tuple[uuid.UUID, str, str, int]]
) -> Sequence[asyncpg.Record | Exception]:
    """chatq_record_sent for each job, a statement each."""
    results = await _each_alone(
        items, lambda i: _fetch_one(conn, "SELECT * FROM chatq_record_sent($1, $2, $3, $4)", *i)
    )
    return await _announced(conn, results)


async def _announced(
    conn: Conn, results: Sequence[asyncpg.Record | Exception]
) -> Sequence[asyncpg.Record | Exception]:
    if not all(isinstance(r, Exception) for r in results):
        # Jobs ended: their accounts' places in the fair share are free.
        await announce_jobs_ended(conn)
    return list(results)


@dataclass(frozen=True)
class Steps:
    """How a session's steps reach Postgres: each a runner for the calls of that step made
    together (``batches.SharedConnection.together``)."""

    claim: Callable[
        [Conn, Sequence[tuple[uuid.UUID, int, int, int]]], Awaitable[Sequence[asyncpg.Record | Exception]]
    ]
    before_send: Callable[
        [Conn, Sequence[tuple[uuid.UUID, str, str, int, bool, int, int]]],
        Awaitable[Sequence[list[asyncpg.Record] | Exception]],
    ]
    record_sent: Callable[
        [Conn, Sequence[tuple[uuid.UUID, str, str, int]]], Awaitable[Sequence[asyncpg.Record | Exception]]
    ]


#: One statement for every job taking the step together (the batch functions).
BATCHED = Steps(_claim_many, _before_send_many, _record_sent_many)
#: A statement for each job (the per-job functions).
PER_JOB = Steps(_claim_each, _before_send_each, _record_sent_each)


async def _fetch_one(conn: Conn, query: str, *args: object) -> asyncpg.Record:
    return one(await conn.fetchrow(query, *args))
