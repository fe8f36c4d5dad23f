"""The responder's state in Postgres: every decision about a job is taken here, before
any side effect, and every state change is one transaction (the job functions of
shared/functions/30_jobs.sql, under the transition tables of shared/state).

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
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from datetime import datetime

import asyncpg

from shared import metrics
from shared.broker.consumer import Reject
from shared.db import Conn, one
from shared.messages import JobCaps
from shared.messages import chat_key as make_chat_key
from shared.state import account as account_state
from shared.state import job as job_state
from shared.state.job import DeliveryStatus, lock_key

from .llm import Turn
from .platforms.base import Attempts


@dataclass(frozen=True)
class Message:
    operation_id: uuid.UUID
    message_id: str
    text: str
    sent_at: datetime
    received_at: datetime


@dataclass(frozen=True)
class Job:
    job_id: uuid.UUID
    platform: str
    account_id: str
    chat_id: str
    messages: tuple[Message, ...]
    #: The chat's last turns before this job (buyer messages and our replies), oldest first.
    history: tuple[Turn, ...] = ()
    #: Why the job's account may not send now (paused), or None.
    account_paused: str | None = None
    #: Telegram Business: the connection the reply goes through, or None.
    business_connection_id: str | None = None

    @property
    def chat_key(self) -> str:
        return make_chat_key(self.platform, self.account_id, self.chat_id)

    @property
    def operation_ids(self) -> list[uuid.UUID]:
        return [m.operation_id for m in self.messages]


@dataclass(frozen=True)
class Part:
    """One part of a long reply, as recorded."""

    text: str
    status: DeliveryStatus
    message_id: str | None
    started_at: datetime


@dataclass(frozen=True)
class Skip:
    reason: str


@dataclass(frozen=True)
class Reconcile:
    """A job some attempt of which may have sent: ``text`` is what it sent, from the first
    such attempt (``since``) to the latest (``started_at``)."""

    job: Job
    text: str
    started_at: datetime
    delivery_status: str
    since: datetime


@dataclass(frozen=True)
class Settled:
    """What giving up changed, for alerts and metrics: ``outcome`` is failed or
    needs_review, or busy / final when nothing changed."""

    job_id: uuid.UUID
    outcome: str
    chat_key: str
    operation_ids: list[uuid.UUID]


class JobWithdrawn(Exception):
    """The seller answered the chat in person since the job was built: nothing was sent, and
    the job and its messages are settled (superseded; "answered by the seller")."""


class AccountStopped(Exception):
    """A person paused or removed the job's account since the job was claimed: nothing was
    sent, no intent recorded. ``removed``: the job fails with the reason; else it waits."""

    def __init__(self, reason: str, *, removed: bool) -> None:
        super().__init__(reason)
        self.reason = reason
        self.removed = removed


#: chatq_before_send's SQLSTATEs for an account removed, or paused, meanwhile.
_ACCOUNT_REMOVED, _ACCOUNT_PAUSED = "CQ001", "CQ002"


class JobBusy(Exception):
    """Another handler (a redelivery racing the first) is working on this job now."""


class JobStore:
    def __init__(self, pool: asyncpg.Pool, *, history: int = 12, caps: JobCaps | None = None) -> None:
        self._pool = pool
        self._history = history
        self._caps = caps or JobCaps()

    @contextlib.asynccontextmanager
    async def exclusive(self, job_id: uuid.UUID) -> AsyncIterator[PgJobSession]:
        """One connection for the whole handling of a job, which does all of its work (a
        connection per job, not per statement). The claim takes the job's session
        advisory lock on it, held across the platform call: a redelivered copy (the
        broker's, after a lost ack) that arrives while the first handler still runs is
        refused instead of reconciling a send that is still in progress. Recording the
        reply releases it; otherwise it is released here. A handler that dies releases it
        with its connection, and a connection whose unlock did not complete is closed
        rather than pooled with the lock still held."""
        async with self._pool.acquire() as conn:
            session = PgJobSession(conn, job_id, self._history, self._caps)
            try:
                yield session
            finally:
                await session.release()

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
    """The job's state changes, on the connection that holds the job. Each is one
    statement (the functions of shared/functions/30_jobs.sql), so one round trip and one
    transaction: a reply costs three (claim, before send, record sent)."""

    def __init__(self, conn: Conn, job_id: uuid.UUID, history: int, caps: JobCaps | None = None) -> None:
        self._conn = conn
        self._lock_key = lock_key(job_id)
        self._history = history
        self._caps = caps or JobCaps()
        # None: unknown (a claim that raised may have taken it); True: held; False: not held.
        self._locked: bool | None = False

    async def release(self) -> None:
        if self._locked is False:
            return
        try:
            if self._conn.is_in_transaction():
                raise asyncpg.InterfaceError("a transaction is still open")
            # Session locks outlive a failed statement and stack when taken twice (a give-up
            # inside the handler): release every one this connection holds (only the job's).
            await self._conn.execute("SELECT pg_advisory_unlock_all()")
            self._locked = False
        finally:
            if self._locked is not False:
                self._conn.terminate()

    async def claim(self, job_id: uuid.UUID, attempt: int) -> Job | Skip | Reconcile:
        self._locked = None
        # One composite value (chatq_claim_result), its fields and its rows read by name.
        row = one(
            await self._conn.fetchrow(
                "SELECT * FROM chatq_claim_job($1, $2, $3, $4)",
                job_id,
                attempt,
                self._lock_key,
                self._history,
            )
        )
        self._locked = row["outcome"] != "busy"
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
            rows = await self._conn.fetch(
                "SELECT * FROM chatq_before_send($1, $2, $3, $4, $5, $6, $7) ORDER BY pos",
                job.job_id,
                job.chat_key,
                text,
                attempt,
                fold,
                self._caps.messages,
                self._caps.chars,
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
        row = one(
            await self._conn.fetchrow(
                "SELECT * FROM chatq_record_sent($1, $2, $3, $4)",
                job.job_id,
                text,
                platform_message_id,
                self._lock_key,
            )
        )
        self._locked = False
        sent_at: datetime = row["sent_at"]
        for received_at in row["received_ats"]:
            metrics.RECEIPT_TO_REPLY.observe(max((sent_at - received_at).total_seconds(), 0.0))
        metrics.OPERATIONS.labels(outcome="replied").inc(len(row["received_ats"]))
        return sent_at

    async def recorded_message_ids(self, job: Job, limit: int = 200) -> list[str]:
        """The platform ids of the chat's replies (and their parts) already recorded,
        newest first: an identical reply of an earlier job must never be taken for this
        job's."""
        rows = await self._conn.fetch(
            """
            SELECT r.platform_message_id AS id FROM reply_jobs r
            WHERE r.chat_key = $1 AND r.status = 'sent' AND r.platform_message_id IS NOT NULL AND r.id <> $2
            UNION
            SELECT p.platform_message_id FROM reply_jobs r JOIN delivery_parts p ON p.job_id = r.id
            WHERE r.chat_key = $1 AND p.status = 'sent' AND r.id <> $2
            LIMIT $3
            """,
            job.chat_key,
            job.job_id,
            limit,
        )
        return [r["id"] for r in rows]

    async def part_intent(self, job_id: uuid.UUID, number: int, text: str) -> None:
        """Before part ``number`` of a long reply is sent: committed first, like a reply's
        intent (a part already sent is never sent again)."""
        await self._conn.execute(
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

    async def part_done(
        self, job_id: uuid.UUID, number: int, status: DeliveryStatus, message_id: str | None = None
    ) -> None:
        """Part ``number``'s outcome. Once a part is on the platform the job's reply is partly
        sent (maybe_sent): every later attempt resumes it, never writes a new one."""
        await self._conn.execute(
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

    async def delivery_parts(self, job_id: uuid.UUID) -> dict[int, Part]:
        """The parts of the job's reply recorded so far (a reply of one part has none)."""
        rows = await self._conn.fetch(
            "SELECT part, text, status, platform_message_id, started_at FROM delivery_parts WHERE job_id = $1",
            job_id,
        )
        return {
            r["part"]: Part(r["text"], DeliveryStatus(r["status"]), r["platform_message_id"], r["started_at"])
            for r in rows
        }

    async def unknown_rivals(self, job: Job) -> list[Attempts]:
        """The chat's other jobs a person must look at because their reply may be in the
        chat unrecorded: a reply that could be theirs is not taken for this job's."""
        rows = await self._conn.fetch(
            """
            SELECT d.text, coalesce(d.maybe_since, d.started_at) AS since, d.started_at AS latest
            FROM reply_jobs r JOIN deliveries d ON d.job_id = r.id
            WHERE r.chat_key = $1 AND r.status = 'needs_review' AND r.id <> $2
            """,
            job.chat_key,
            job.job_id,
        )
        return [Attempts(r["text"], r["since"], r["latest"]) for r in rows]

    async def record_delivery(self, job_id: uuid.UUID, status: DeliveryStatus, error: str) -> None:
        """The attempt's outcome when no reply was recorded: not sent, or unknown."""
        await self._conn.execute(
            """
            UPDATE deliveries SET status = $2, error = $3, finished_at = now()
            WHERE job_id = $1 AND status = ANY(chatq_delivery_sources($2))
            """,
            job_id,
            status.value,
            error[:500],
        )

    async def record_retry(self, job_id: uuid.UUID, kind: str, reason: str) -> None:
        """Back to pending until the retry tier hands it back; the chat stays blocked. The
        attempt's outcome goes on the record of each of the job's messages (a wait for a
        paused account is not an attempt, and is not recorded again and again)."""
        await job_state.back_to_pending(self._conn, job_id, kind, reason)

    async def give_up(self, job_id: uuid.UUID, kind: str, reason: str, owner: str) -> Settled:
        """Stop trying (see chatq_give_up): needs_review when the last send may have
        reached the chat, failed otherwise; nothing when another session holds the job or
        it is final already."""
        held, self._locked = self._locked, None
        row = await self._conn.fetchrow(
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
        self._locked = held
        settled = Settled(job_id, row["outcome"], row["chat_key"] or "", list(row["operation_ids"] or ()))
        if settled.outcome in ("failed", "needs_review"):
            metrics.OPERATIONS.labels(outcome=settled.outcome).inc(len(settled.operation_ids))
        return settled


def _message(r: asyncpg.Record) -> Message:
    return Message(r["operation_id"], r["message_id"], r["text"], r["sent_at"], r["received_at"])
