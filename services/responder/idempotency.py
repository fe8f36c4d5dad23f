"""The responder's state in Postgres: every decision about a job is taken here, before
any side effect, and every state change is one transaction.

- A job already final (sent, failed, needs_review, superseded) is skipped.
- A job whose delivery says ``sending`` or ``unknown`` may already be on the platform:
  it is reconciled, never re-sent blindly.
- A job whose messages are all already answered (by a sent job, or older than the chat's
  last answered message) is superseded.
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
from shared.messages import chat_key as make_chat_key

from .llm import Turn

FINAL = ("sent", "failed", "needs_review", "superseded")


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

    @property
    def chat_key(self) -> str:
        return make_chat_key(self.platform, self.account_id, self.chat_id)

    @property
    def operation_ids(self) -> list[uuid.UUID]:
        return [m.operation_id for m in self.messages]


@dataclass(frozen=True)
class Skip:
    reason: str


@dataclass(frozen=True)
class Reconcile:
    job: Job
    text: str
    started_at: datetime
    delivery_status: str


@dataclass(frozen=True)
class Settled:
    """What a final transition changed, for alerts and metrics."""

    job_id: uuid.UUID
    chat_key: str
    operation_ids: list[uuid.UUID]


class JobBusy(Exception):
    """Another handler (a redelivery racing the first) is working on this job now."""


class JobStore:
    def __init__(self, pool: asyncpg.Pool, *, history: int = 12) -> None:
        self._pool = pool
        self._history = history

    @contextlib.asynccontextmanager
    async def exclusive(self, job_id: uuid.UUID) -> AsyncIterator[JobSession]:
        """One connection for the whole handling of a job, which does all of its work (a
        connection per job, not per statement). The claim takes the job's session
        advisory lock on it, held across the platform call: a redelivered copy (the
        broker's, after a lost ack) that arrives while the first handler still runs is
        refused instead of reconciling a send that is still in progress. Recording the
        reply releases it; otherwise it is released here. A handler that dies releases it
        with its connection, and a connection whose unlock did not complete is closed
        rather than pooled with the lock still held."""
        async with self._pool.acquire() as conn:
            session = JobSession(conn, job_id, self._history)
            try:
                yield session
            finally:
                await session.release()

    async def finish_unsent(
        self, job_id: uuid.UUID, status: str, kind: str, reason: str, owner: str | None = None
    ) -> Settled | None:
        async with self._pool.acquire() as conn:
            return await JobSession(conn, job_id, 0).finish_unsent(job_id, status, kind, reason, owner)


class JobSession:
    """The job's state changes, on the connection that holds the job. Each is one
    statement (the functions of migration 0006), so one round trip and one transaction:
    a reply costs three (claim, before send, record sent)."""

    def __init__(self, conn: asyncpg.Connection, job_id: uuid.UUID, history: int) -> None:
        self._conn = conn
        self._lock_key = uuid.UUID(bytes=job_id.bytes).int & 0x7FFF_FFFF_FFFF_FFFF
        self._history = history
        # None: unknown (a claim that raised may have taken it); True: held; False: not held.
        self._locked: bool | None = False

    async def release(self) -> None:
        if self._locked is False:
            return
        try:
            if self._conn.is_in_transaction():
                raise asyncpg.InterfaceError("a transaction is still open")
            await self._conn.execute("SELECT pg_advisory_unlock($1)", self._lock_key)
            self._locked = False
        finally:
            if self._locked is not False:
                self._conn.terminate()

    async def claim(self, job_id: uuid.UUID, attempt: int) -> Job | Skip | Reconcile:
        self._locked = None
        rows = await self._conn.fetch(
            "SELECT * FROM chatq_claim_job($1, $2, $3, $4) ORDER BY pos",
            job_id,
            attempt,
            self._lock_key,
            self._history,
        )
        head = rows[0]
        self._locked = head["outcome"] != "busy"
        if head["outcome"] == "busy":
            raise JobBusy(f"job {job_id} is being handled by another consumer")
        if head["outcome"] == "missing":
            raise Reject(f"job {job_id} is not in the database")
        if head["outcome"] == "skip":
            return Skip(head["reason"])
        job = Job(
            job_id,
            head["platform"],
            head["account_id"],
            head["chat_id"],
            tuple(_message(r) for r in rows if r["operation_id"] is not None),
            tuple(
                Turn(role, text)
                for role, text in zip(head["history_roles"] or (), head["history_texts"] or (), strict=True)
            ),
        )
        if head["outcome"] == "reconcile":
            return Reconcile(job, head["delivery_text"], head["delivery_started_at"], head["delivery_status"])
        return job

    async def before_send(self, job: Job, text: str, attempt: int, *, fold: bool = True) -> Job:
        """Fold the chat's messages that arrived since the job was built into it (one reply
        covers them) and return the grown job, to be written again; or, when there are
        none (or ``fold`` is false), record the delivery intent and return the job as it
        is: committed before the platform is called, from now on the send may have happened."""
        rows = await self._conn.fetch(
            "SELECT * FROM chatq_before_send($1, $2, $3, $4, $5) ORDER BY pos",
            job.job_id,
            job.chat_key,
            text,
            attempt,
            fold,
        )
        if not rows:
            return job
        merged = sorted((*job.messages, *(_message(r) for r in rows)), key=_platform_order)
        return replace(job, messages=tuple(merged))

    async def record_delivery(self, job_id: uuid.UUID, status: str, error: str) -> None:
        await self._conn.execute(
            "UPDATE deliveries SET status = $2, error = $3, finished_at = now() WHERE job_id = $1",
            job_id,
            status,
            error[:500],
        )

    async def record_sent(self, job: Job, text: str, platform_message_id: str) -> datetime:
        last = max(job.messages, key=_platform_order)
        row = await self._conn.fetchrow(
            "SELECT * FROM chatq_record_sent($1, $2, $3, $4, $5, $6)",
            job.job_id,
            text,
            platform_message_id,
            last.sent_at,
            last.message_id,
            self._lock_key,
        )
        self._locked = False
        sent_at: datetime = row["sent_at"]
        for received_at in row["received_ats"]:
            metrics.RECEIPT_TO_REPLY.observe(max((sent_at - received_at).total_seconds(), 0.0))
        metrics.OPERATIONS.labels(outcome="replied").inc(len(row["received_ats"]))
        return sent_at

    async def record_retry(self, job_id: uuid.UUID, kind: str, reason: str) -> None:
        """Back to pending until the retry tier hands it back; the chat stays blocked."""
        await self._conn.execute(
            """
            UPDATE reply_jobs SET status = 'pending', error_kind = $2, error_message = $3, updated_at = now()
            WHERE id = $1 AND status NOT IN ('sent', 'failed', 'needs_review', 'superseded')
            """,
            job_id,
            kind,
            reason[:500],
        )

    async def finish_unsent(
        self, job_id: uuid.UUID, status: str, kind: str, reason: str, owner: str | None = None
    ) -> Settled | None:
        """failed or needs_review, with the reason (and owner). None if already final."""
        assert status in ("failed", "needs_review")
        conn = self._conn
        async with conn.transaction():
            row = await conn.fetchrow(
                """
                UPDATE reply_jobs SET status = $2, error_kind = $3, error_message = $4, owner = $5, updated_at = now()
                WHERE id = $1 AND status NOT IN ('sent', 'failed', 'needs_review', 'superseded')
                RETURNING chat_key, operation_ids
                """,
                job_id,
                status,
                kind,
                reason[:500],
                owner,
            )
            if row is None:
                return None
            if status == "failed":
                # Nothing was sent: the messages may be answered by a retry.
                await conn.execute("DELETE FROM reply_coverage WHERE job_id = $1", job_id)
            changed = await conn.fetch(
                """
                UPDATE operations SET status = $2, status_reason = $3, updated_at = now()
                WHERE id = ANY($1::uuid[]) AND status NOT IN ('replied', 'ignored')
                RETURNING id
                """,
                row["operation_ids"],
                status,
                reason[:500],
            )
        metrics.OPERATIONS.labels(outcome=status).inc(len(changed))
        return Settled(job_id, row["chat_key"], [r["id"] for r in changed])


def _message(r: asyncpg.Record) -> Message:
    return Message(r["operation_id"], r["message_id"], r["text"], r["sent_at"], r["received_at"])


def _platform_order(m: Message) -> tuple[datetime, int, str, datetime]:
    return (m.sent_at, len(m.message_id), m.message_id, m.received_at)
