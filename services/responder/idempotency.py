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
from shared.answered import UPSERT_LAST_ANSWERED
from shared.broker.consumer import Reject
from shared.messages import chat_key as make_chat_key

from .llm import Turn

FINAL = ("sent", "failed", "needs_review", "superseded")
_ORDER = "sent_at, length(message_id), message_id, received_at"


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
    def __init__(self, pool: asyncpg.Pool) -> None:
        self._pool = pool

    @contextlib.asynccontextmanager
    async def exclusive(self, job_id: uuid.UUID) -> AsyncIterator[None]:
        """Hold the job for the whole handling: a session advisory lock on a connection
        of its own. A redelivered copy (the broker's, after a lost ack) that arrives
        while the first handler still runs is refused instead of reconciling a send
        that is still in progress; a handler that dies releases the lock with its
        connection."""
        async with self._pool.acquire() as conn:
            key = uuid.UUID(bytes=job_id.bytes).int & 0x7FFF_FFFF_FFFF_FFFF
            if not await conn.fetchval("SELECT pg_try_advisory_lock($1)", key):
                raise JobBusy(f"job {job_id} is being handled by another consumer")
            try:
                yield
            finally:
                await conn.execute("SELECT pg_advisory_unlock($1)", key)

    async def claim(self, job_id: uuid.UUID, attempt: int) -> Job | Skip | Reconcile:
        async with self._pool.acquire() as conn, conn.transaction():
            row = await conn.fetchrow(
                """
                SELECT j.status, j.platform, j.account_id, j.chat_id, j.operation_ids, j.chat_key,
                       d.status AS d_status, d.text AS d_text, d.started_at AS d_started
                FROM reply_jobs j LEFT JOIN deliveries d ON d.job_id = j.id
                WHERE j.id = $1
                FOR UPDATE OF j
                """,
                job_id,
            )
            if row is None:
                raise Reject(f"job {job_id} is not in the database")
            if row["status"] in FINAL:
                return Skip(f"job already {row['status']}")
            messages = await _messages(conn, row["operation_ids"])
            job = Job(job_id, row["platform"], row["account_id"], row["chat_id"], messages)
            await conn.execute(
                "UPDATE reply_jobs SET status = 'processing', attempts = $2, updated_at = now() WHERE id = $1",
                job_id,
                attempt,
            )
            if row["d_status"] in ("sending", "unknown"):
                return Reconcile(job, row["d_text"], row["d_started"], row["d_status"])
            answered = await conn.fetch(
                """
                SELECT o.id,
                       EXISTS (SELECT 1 FROM reply_jobs s WHERE s.status = 'sent' AND o.id = ANY(s.operation_ids))
                           AS covered
                FROM operations o
                WHERE o.id = ANY($1::uuid[])
                  AND (EXISTS (SELECT 1 FROM reply_jobs s WHERE s.status = 'sent' AND o.id = ANY(s.operation_ids))
                       OR EXISTS (SELECT 1 FROM chats c WHERE c.chat_key = $2
                                  AND (o.sent_at, length(o.message_id), o.message_id)
                                      <= (c.last_answered_sent_at, length(c.last_answered_message_id),
                                          c.last_answered_message_id)))
                """,
                job.operation_ids,
                job.chat_key,
            )
            if len(answered) == len(messages):
                older = [r["id"] for r in answered if not r["covered"]]
                await conn.execute(
                    "UPDATE reply_jobs SET status = 'superseded', updated_at = now() WHERE id = $1", job_id
                )
                await conn.execute(
                    """
                    UPDATE operations SET status = 'ignored', updated_at = now(),
                           status_reason = CASE WHEN id = ANY($2::uuid[])
                               THEN 'arrived after a reply to a later message of this chat'
                               ELSE 'already answered by an earlier reply' END
                    WHERE id = ANY($1::uuid[]) AND status NOT IN ('replied', 'ignored')
                    """,
                    job.operation_ids,
                    older,
                )
                return Skip("every message was already answered")
            stale = {r["id"] for r in answered}
            # Take the messages for this job; one another job already holds is not ours
            # to answer (the primary key decides, whatever race brought it here twice).
            taken = {
                r["operation_id"]
                for r in await conn.fetch(
                    """
                    INSERT INTO reply_coverage (operation_id, job_id)
                    SELECT unnest($1::uuid[]), $2
                    ON CONFLICT (operation_id) DO UPDATE SET job_id = reply_coverage.job_id
                    RETURNING operation_id, job_id
                    """,
                    [m.operation_id for m in messages if m.operation_id not in stale],
                    job_id,
                )
                if r["job_id"] != job_id
            }
            if stale or taken:
                # Late messages (older than a reply already sent) would reorder the chat;
                # messages another reply holds would be answered twice. The job keeps the
                # rest; the late ones are ignored with that reason.
                await conn.execute(
                    """
                    UPDATE operations SET status = 'ignored', job_id = NULL, updated_at = now(),
                           status_reason = 'arrived after a reply to a later message of this chat'
                    WHERE id = ANY($1::uuid[]) AND status NOT IN ('replied', 'ignored')
                    """,
                    list(stale - taken),
                )
                keep = tuple(m for m in messages if m.operation_id not in stale | taken)
                job = replace(job, messages=keep)
                await conn.execute(
                    "UPDATE reply_jobs SET operation_ids = $2::uuid[] WHERE id = $1",
                    job_id,
                    job.operation_ids,
                )
                if not keep:
                    await conn.execute(
                        "UPDATE reply_jobs SET status = 'superseded', updated_at = now() WHERE id = $1",
                        job_id,
                    )
                    return Skip("every message is answered or held by another reply")
            await conn.execute(
                """
                UPDATE operations SET status = 'replying', updated_at = now()
                WHERE id = ANY($1::uuid[]) AND status IN ('accepted', 'queued', 'waiting', 'replying')
                """,
                job.operation_ids,
            )
            return job

    async def history(self, job: Job, limit: int) -> list[Turn]:
        """The chat's last turns before this job: buyer messages and our replies."""
        if limit <= 0 or not job.messages:
            return []
        rows = await self._pool.fetch(
            """
            SELECT * FROM (
                SELECT 'buyer' AS role, text, received_at AS at FROM operations
                WHERE platform = $1 AND account_id = $2 AND chat_id = $3 AND status = 'replied'
                  AND received_at < $4
                UNION ALL
                SELECT 'bot', reply_text, sent_at FROM reply_jobs
                WHERE chat_key = $5 AND status = 'sent' AND sent_at < $4
            ) t ORDER BY at DESC LIMIT $6
            """,
            job.platform,
            job.account_id,
            job.chat_id,
            job.messages[0].received_at,
            job.chat_key,
            limit,
        )
        return [Turn(r["role"], r["text"]) for r in reversed(rows)]

    async def fold_in(self, job: Job) -> Job:
        """Move the messages gathered in the chat's open window since this job was built
        into this job, so one reply covers them. Same per-chat lock as the coalescer."""
        async with self._pool.acquire() as conn, conn.transaction():
            await conn.execute("SELECT pg_advisory_xact_lock(hashtextextended($1, 0))", job.chat_key)
            window = await conn.fetchval(
                "SELECT id FROM chat_windows WHERE chat_key = $1 AND status = 'open' FOR UPDATE", job.chat_key
            )
            if window is None:
                return job
            ids = [
                r["operation_id"]
                for r in await conn.fetch(
                    "DELETE FROM window_messages WHERE window_id = $1 RETURNING operation_id", window
                )
            ]
            await conn.execute("DELETE FROM chat_windows WHERE id = $1", window)
            ids = [
                r["operation_id"]
                for r in await conn.fetch(
                    """
                    INSERT INTO reply_coverage (operation_id, job_id) SELECT unnest($1::uuid[]), $2
                    ON CONFLICT (operation_id) DO NOTHING RETURNING operation_id
                    """,
                    ids,
                    job.job_id,
                )
            ]
            if not ids:
                return job
            await conn.execute(
                """
                UPDATE reply_jobs SET operation_ids = operation_ids || $2::uuid[], folded = folded + 1,
                       updated_at = now()
                WHERE id = $1
                """,
                job.job_id,
                ids,
            )
            await conn.execute(
                """
                UPDATE operations SET job_id = $2, status = 'replying', updated_at = now()
                WHERE id = ANY($1::uuid[])
                """,
                ids,
                job.job_id,
            )
            added = await _messages(conn, ids)
        merged = sorted((*job.messages, *added), key=_platform_order)
        return replace(job, messages=tuple(merged))

    async def record_intent(self, job_id: uuid.UUID, text: str, attempt: int) -> None:
        """Committed before the platform is called: from now on the send may have happened."""
        await self._pool.execute(
            """
            INSERT INTO deliveries (job_id, status, text, attempt, started_at)
            VALUES ($1, 'sending', $2, $3, now())
            ON CONFLICT (job_id) DO UPDATE
            SET status = 'sending', text = EXCLUDED.text, attempt = EXCLUDED.attempt,
                started_at = now(), finished_at = NULL, error = NULL
            """,
            job_id,
            text,
            attempt,
        )

    async def record_delivery(self, job_id: uuid.UUID, status: str, error: str) -> None:
        await self._pool.execute(
            "UPDATE deliveries SET status = $2, error = $3, finished_at = now() WHERE job_id = $1",
            job_id,
            status,
            error[:500],
        )

    async def record_sent(self, job: Job, text: str, platform_message_id: str) -> datetime:
        async with self._pool.acquire() as conn, conn.transaction():
            sent_at: datetime = await conn.fetchval(
                """
                UPDATE reply_jobs SET status = 'sent', reply_text = $2, platform_message_id = $3,
                       sent_at = clock_timestamp(), error_kind = NULL, error_message = NULL, updated_at = now()
                WHERE id = $1 RETURNING sent_at
                """,
                job.job_id,
                text,
                platform_message_id,
            )
            await conn.execute(
                """
                UPDATE deliveries SET status = 'sent', platform_message_id = $2, finished_at = $3, error = NULL
                WHERE job_id = $1
                """,
                job.job_id,
                platform_message_id,
                sent_at,
            )
            received = await conn.fetch(
                """
                UPDATE operations SET status = 'replied', status_reason = NULL, updated_at = $2
                WHERE id = ANY($1::uuid[]) AND status <> 'replied'
                RETURNING received_at
                """,
                job.operation_ids,
                sent_at,
            )
            last = max(job.messages, key=_platform_order)
            await conn.execute(
                UPSERT_LAST_ANSWERED,
                job.chat_key,
                last.sent_at,
                last.message_id,
                sent_at,
                job.job_id,
            )
        for r in received:
            metrics.RECEIPT_TO_REPLY.observe(max((sent_at - r["received_at"]).total_seconds(), 0.0))
        metrics.OPERATIONS.labels(outcome="replied").inc(len(received))
        return sent_at

    async def record_retry(self, job_id: uuid.UUID, kind: str, reason: str) -> None:
        """Back to pending until the retry tier hands it back; the chat stays blocked."""
        await self._pool.execute(
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
        async with self._pool.acquire() as conn, conn.transaction():
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


async def _messages(conn: asyncpg.Connection, ids: list[uuid.UUID]) -> tuple[Message, ...]:
    rows = await conn.fetch(
        f"""
        SELECT id, message_id, text, coalesce(sent_at, received_at) AS sent_at, received_at
        FROM operations WHERE id = ANY($1::uuid[]) ORDER BY {_ORDER}
        """,
        ids,
    )
    return tuple(Message(r["id"], r["message_id"], r["text"], r["sent_at"], r["received_at"]) for r in rows)


def _platform_order(m: Message) -> tuple[datetime, int, str, datetime]:
    return (m.sent_at, len(m.message_id), m.message_id, m.received_at)
