"""The backstop for a reply job nobody will process (invariant I8: no chat muted).

A job in flight (pending or processing) holds its chat: the chat's next window waits for
it. Its message is on the broker (in chatq.responder, a retry tier, or unacked with a
responder) until the job ends, so a job untouched past ``stuck_seconds`` (longer than the
longest retry tier plus a job's handling) that no responder holds has lost its message
(a broker restore, a purge by hand). One coalescer replica at a time publishes such a job
again through the outbox, on its next attempt; the responder's claim decides the rest
as for any redelivery, and attempts still run out into a person's hands.
"""

from __future__ import annotations

import logging
import uuid

import asyncpg

from shared import metrics
from shared.broker.topology import JOB_ROUTING_KEY, JOBS_EXCHANGE
from shared.messages import JobMessage, ReplyJob
from shared.outbox import OutboxMessage, enqueue_many
from shared.retry import ATTEMPT_HEADER
from shared.state.job import lock_key

logger = logging.getLogger(__name__)

#: One sweeper at a time across replicas (a transaction-level advisory lock).
SWEEP_LOCK_KEY = 0x63686174_73776570  # "chatswep"

_STUCK = """
SELECT j.id, j.window_id, j.chat_key, j.platform, j.account_id, j.chat_id, j.operation_ids, j.attempts,
       j.created_at
FROM reply_jobs j
WHERE j.status IN ('pending', 'processing') AND j.updated_at < clock_timestamp() - make_interval(secs => $1)
ORDER BY j.updated_at
LIMIT $2
FOR UPDATE OF j SKIP LOCKED
"""

_MESSAGES = """
SELECT o.id, o.message_id, o.author_id, o.text, o.sent_at, o.received_at
FROM operations o WHERE o.id = ANY($1::uuid[])
ORDER BY chatq_order(o.platform, o.sent_at, o.message_id, o.received_at)
"""


class JobSweeper:
    def __init__(self, pool: asyncpg.Pool, *, stuck_seconds: float, batch: int = 100) -> None:
        self._pool = pool
        self._stuck_seconds = stuck_seconds
        self._batch = batch

    async def sweep(self) -> int:
        """Publish again the stuck jobs nobody holds; returns how many. Also unblock any
        window whose chat has no job in flight (a backstop for the trigger)."""
        unblocked = await self._pool.fetchval("SELECT chatq_unblock_orphan_windows()")
        if unblocked:
            logger.warning("unblocked %d window(s) whose chat had no job in flight", unblocked)
        async with self._pool.acquire() as conn, conn.transaction():
            if not await conn.fetchval("SELECT pg_try_advisory_xact_lock($1)", SWEEP_LOCK_KEY):
                return 0
            redriven: list[OutboxMessage] = []
            for job in await conn.fetch(_STUCK, self._stuck_seconds, self._batch):
                key = lock_key(job["id"])
                if not await conn.fetchval("SELECT pg_try_advisory_lock($1)", key):
                    continue  # a responder is working on it right now
                await conn.execute("SELECT pg_advisory_unlock($1)", key)
                messages = tuple(
                    JobMessage.from_row(m) for m in await conn.fetch(_MESSAGES, job["operation_ids"])
                )
                wire = ReplyJob(
                    job_id=job["id"],
                    window_id=job["window_id"],
                    platform=job["platform"],
                    account_id=job["account_id"],
                    chat_id=job["chat_id"],
                    messages=messages,
                    created_at=job["created_at"],
                )
                redriven.append(
                    OutboxMessage(
                        exchange=JOBS_EXCHANGE,
                        routing_key=JOB_ROUTING_KEY,
                        message_id=str(job["id"]),
                        ordering_key=job["chat_key"],
                        body=wire.to_bytes(),
                        headers={ATTEMPT_HEADER: job["attempts"] + 1},
                    )
                )
            if not redriven:
                return 0
            await conn.execute(
                "UPDATE reply_jobs SET updated_at = now() WHERE id = ANY($1::uuid[])",
                [uuid.UUID(m.message_id) for m in redriven],
            )
            await enqueue_many(conn, redriven)
        metrics.JOBS_REDRIVEN.inc(len(redriven))
        for m in redriven:
            logger.warning(
                "job %s was in flight for over %.0fs with nobody holding it; published again",
                m.message_id,
                self._stuck_seconds,
            )
        return len(redriven)
