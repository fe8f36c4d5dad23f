"""Rows seeded directly in Postgres (the contract suites, tests/integration/test_job_claim.py), so
each situation is exact: a buyer message in a given status, a reply job over messages."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from datetime import UTC, datetime

import asyncpg

T0 = datetime(2026, 11, 1, 12, 0, tzinfo=UTC)


async def operation(
    pool: asyncpg.Pool, message_id: str, *, at: datetime = T0, status: str = "waiting", chat: str = "77"
) -> uuid.UUID:
    op = uuid.uuid4()
    await pool.execute(
        """
        INSERT INTO operations (id, platform, account_id, event_id, chat_id, message_id, author_id, text,
                                sent_at, status, received_at, payload, owner, status_reason)
        VALUES ($1, 'telegram', 'bot', $2, $6, $2, 'buyer', $3, $4::timestamptz, $5,
                $4::timestamptz + interval '1 second', '{}',
                CASE WHEN $5 IN ('failed', 'needs_review') THEN 'on-call' END,
                CASE WHEN $5 IN ('failed', 'needs_review', 'ignored') THEN 'seeded so' END)
        """,
        op,
        message_id,
        f"message {message_id}",
        at,
        status,
        chat,
    )
    return op


async def job(
    pool: asyncpg.Pool, ops: Sequence[uuid.UUID], *, status: str = "pending", chat: str = "77"
) -> uuid.UUID:
    """A reply job over ``ops`` (its window closed), each operation pointing at it."""
    window, job_id = uuid.uuid4(), uuid.uuid4()
    await pool.execute(
        """
        INSERT INTO chat_windows (id, chat_key, platform, account_id, chat_id, status, first_at, last_at,
                                  deadline_at, due_at, delay_seconds, message_count, closed_at, job_id)
        VALUES ($1, $2, 'telegram', 'bot', $5, 'closed', $3, $3, $3, $3, 0, 1, $3, $4)
        """,
        window,
        f"telegram:bot:{chat}",
        T0,
        job_id,
        chat,
    )
    await pool.execute(
        """
        INSERT INTO reply_jobs (id, window_id, chat_key, platform, account_id, chat_id, status,
                                operation_ids, reply_text, sent_at, owner, error_message)
        VALUES ($1, $2, $3, 'telegram', 'bot', $6, $4::text, $5,
                CASE WHEN $4 = 'sent' THEN 'an earlier reply' END, CASE WHEN $4 = 'sent' THEN now() END,
                CASE WHEN $4 IN ('failed', 'needs_review') THEN 'on-call' END,
                CASE WHEN $4 IN ('failed', 'needs_review') THEN 'seeded so' END)
        """,
        job_id,
        window,
        f"telegram:bot:{chat}",
        status,
        list(ops),
        chat,
    )
    await pool.execute("UPDATE operations SET job_id = $1 WHERE id = ANY($2::uuid[])", job_id, list(ops))
    return job_id
