"""Design section 3's invariants, checked against the database after a scenario."""

from __future__ import annotations

import asyncpg


async def assert_coalescing_invariants(pool: asyncpg.Pool) -> None:
    # Every answerable message is in exactly one window (the primary key enforces at
    # most one; here: at least one).
    unfiled = await pool.fetchval(
        """
        SELECT count(*) FROM operations o
        WHERE o.status NOT IN ('ignored', 'accepted', 'queued')
          AND NOT EXISTS (SELECT 1 FROM window_messages wm WHERE wm.operation_id = o.id)
        """
    )
    assert unfiled == 0, f"{unfiled} operation(s) past 'queued' are in no window"
    # No message is covered by two jobs.
    doubled = await pool.fetchval(
        """
        SELECT count(*) FROM (
            SELECT op FROM reply_jobs, unnest(operation_ids) AS op GROUP BY op HAVING count(*) > 1) d
        """
    )
    assert doubled == 0, f"{doubled} operation(s) are in two reply jobs"
    # A closed window has exactly its own messages in its job.
    mismatched = await pool.fetchval(
        """
        SELECT count(*) FROM chat_windows w JOIN reply_jobs j ON j.window_id = w.id
        WHERE (SELECT array_agg(operation_id ORDER BY operation_id) FROM window_messages WHERE window_id = w.id)
           <> (SELECT array_agg(x ORDER BY x) FROM unnest(j.operation_ids) x)
        """
    )
    assert mismatched == 0, f"{mismatched} job(s) do not hold exactly their window's messages"
    # At most one job in flight per chat (also a unique index) and one open window per chat.
    busy = await pool.fetchval(
        """
        SELECT count(*) FROM (SELECT chat_key FROM reply_jobs WHERE status IN ('pending', 'processing')
                              GROUP BY chat_key HAVING count(*) > 1) b
        """
    )
    assert busy == 0
    # Every operation with a job points to the job that covers it.
    wrong_job = await pool.fetchval(
        """
        SELECT count(*) FROM operations o JOIN reply_jobs j ON j.id = o.job_id
        WHERE NOT (o.id = ANY(j.operation_ids))
        """
    )
    assert wrong_job == 0
