"""Retention: finished rows older than RETENTION_DAYS are deleted, so tables stay bounded.

What goes, in bounded chunks, each chunk its own transaction:
- operations ``replied`` or ``ignored`` (with their payloads, window membership, coverage
  and event log), untouched for the retention period;
- reply jobs ``sent``, ``failed`` or ``superseded`` that no remaining operation points
  to, with their delivery, coverage and window;
- closed windows left without a job, sandbox replies and recorded dead letters of that age;
- cached chat listings read that long ago (a chat that speaks again reads its listing again).

What stays, whatever its age: every unfinished row (an operation or job still in flight,
an open window), every operation a person must still act on (``failed``,
``needs_review``) and its job, and each chat's last-answered marker (``chats``).
Published outbox rows have their own, shorter rule in the relay.

One replica at a time runs it (a session advisory lock); the others skip the round.
"""

from __future__ import annotations

import logging
from datetime import timedelta

import asyncpg

from shared import metrics

logger = logging.getLogger(__name__)

RETENTION_LOCK_KEY = 0x63686174_70757267  # "chatpurg"

# (table, statement): $1 = cutoff, $2 = chunk size; each returns the rows deleted from
# ``table`` (the status of the last DELETE). Operations and jobs are found by their receipt
# and creation indexes (written once), then checked for updated_at: an updated_at index
# would take an entry at every state change (migration 0024).
_STEPS: tuple[tuple[str, str], ...] = (
    (
        "operations",
        """
        WITH victims AS (
            SELECT id FROM operations
            WHERE status IN ('replied', 'ignored') AND received_at < $1 AND updated_at < $1
            ORDER BY received_at LIMIT $2
            FOR UPDATE SKIP LOCKED
        ), wm AS (
            DELETE FROM window_messages WHERE operation_id IN (SELECT id FROM victims)
        ), rc AS (
            DELETE FROM reply_coverage WHERE operation_id IN (SELECT id FROM victims)
        )
        DELETE FROM operations WHERE id IN (SELECT id FROM victims)
        """,
    ),
    (
        "reply_jobs",
        """
        WITH victims AS (
            SELECT j.id FROM reply_jobs j
            WHERE j.status IN ('sent', 'failed', 'superseded') AND j.created_at < $1 AND j.updated_at < $1
              AND NOT EXISTS (SELECT 1 FROM operations o WHERE o.job_id = j.id)
            ORDER BY j.created_at LIMIT $2
            FOR UPDATE OF j SKIP LOCKED
        ), d AS (
            DELETE FROM deliveries WHERE job_id IN (SELECT id FROM victims)
        ), rc AS (
            DELETE FROM reply_coverage WHERE job_id IN (SELECT id FROM victims)
        )
        DELETE FROM reply_jobs WHERE id IN (SELECT id FROM victims)
        """,
    ),
    (
        "chat_windows",
        """
        DELETE FROM chat_windows w WHERE w.id IN (
            SELECT c.id FROM chat_windows c
            WHERE c.status = 'closed' AND c.closed_at < $1
              AND NOT EXISTS (SELECT 1 FROM reply_jobs j WHERE j.window_id = c.id)
              AND NOT EXISTS (SELECT 1 FROM window_messages wm WHERE wm.window_id = c.id)
            ORDER BY c.closed_at LIMIT $2
            FOR UPDATE OF c SKIP LOCKED)
        """,
    ),
    (
        "sandbox_replies",
        "DELETE FROM sandbox_replies WHERE id IN "
        "(SELECT id FROM sandbox_replies WHERE created_at < $1 ORDER BY created_at LIMIT $2)",
    ),
    (
        "chat_listings",
        "DELETE FROM chat_listings WHERE chat_key IN "
        "(SELECT chat_key FROM chat_listings WHERE fetched_at < $1 ORDER BY fetched_at LIMIT $2)",
    ),
    (
        "dead_letters",
        "DELETE FROM dead_letters WHERE id IN "
        "(SELECT id FROM dead_letters WHERE recorded_at < $1 ORDER BY recorded_at LIMIT $2)",
    ),
    (
        # An echo settles a send of the minutes around it; kept as long as the rest.
        "reply_echoes",
        "DELETE FROM reply_echoes WHERE (chat_key, platform_message_id) IN "
        "(SELECT chat_key, platform_message_id FROM reply_echoes WHERE seen_at < $1 ORDER BY seen_at LIMIT $2)",
    ),
    (
        # A chat not read by the poll since: it is read again if Avito lists it as updated.
        "avito_poll_chats",
        "DELETE FROM avito_poll_chats WHERE (account_id, chat_id) IN "
        "(SELECT account_id, chat_id FROM avito_poll_chats WHERE read_at < $1 ORDER BY read_at LIMIT $2)",
    ),
)


class Retention:
    def __init__(self, pool: asyncpg.Pool, *, keep_seconds: float, chunk: int = 2000) -> None:
        self._pool = pool
        self._keep = timedelta(seconds=keep_seconds)
        self._chunk = chunk

    async def purge(self) -> dict[str, int]:
        """One round: every finished row past the retention period, chunk by chunk.
        Returns rows deleted per table ({} when another replica holds the round)."""
        purged: dict[str, int] = {}
        async with self._pool.acquire() as conn:
            if not await conn.fetchval("SELECT pg_try_advisory_lock($1)", RETENTION_LOCK_KEY):
                return purged
            try:
                cutoff = await conn.fetchval("SELECT now() - $1::interval", self._keep)
                for table, sql in _STEPS:
                    while True:
                        async with conn.transaction():
                            status = await conn.execute(sql, cutoff, self._chunk)
                        n = int(status.split()[-1])
                        if n:
                            purged[table] = purged.get(table, 0) + n
                            metrics.RETENTION_PURGED.labels(table=table).inc(n)
                        if n < self._chunk:
                            break
            finally:
                await conn.execute("SELECT pg_advisory_unlock($1)", RETENTION_LOCK_KEY)
        if purged:
            logger.info(
                "retention: purged %s", ", ".join(f"{n} {table}" for table, n in sorted(purged.items()))
            )
        return purged
