"""A stand-in for the responder in coalescer tests: takes each job off chatq.responder
and ends it, which frees the chat's next window."""

from __future__ import annotations

import asyncpg

from shared.broker.topology import RESPONDER_QUEUE
from shared.messages import ReplyJob
from tests.support.broker import QueueInspector, wait_for


async def answer_jobs_until_all_covered(
    pool: asyncpg.Pool, queues: QueueInspector, *, within: float = 40
) -> list[ReplyJob]:
    """End every job as it arrives until every stored message is in an ended job."""
    jobs: list[ReplyJob] = []

    async def all_covered() -> bool:
        taken = [ReplyJob.from_bytes(m.body) for m in await queues.drain(RESPONDER_QUEUE)]
        jobs.extend(taken)
        ids = [j.job_id for j in taken]
        async with pool.acquire() as conn, conn.transaction():
            # The responder's path: claimed (processing), then sent.
            await conn.execute("UPDATE reply_jobs SET status = 'processing' WHERE id = ANY($1::uuid[])", ids)
            await conn.execute(
                "UPDATE reply_jobs SET status = 'sent', reply_text = '(stand-in)', sent_at = now()"
                " WHERE id = ANY($1::uuid[])",
                ids,
            )
        uncovered = await pool.fetchval("SELECT count(*) FROM operations WHERE job_id IS NULL")
        pending = await pool.fetchval("SELECT count(*) FROM reply_jobs WHERE status = 'pending'")
        return uncovered == 0 and pending == 0 and not taken

    await wait_for(all_covered, within=within, interval=0.2, what="every message covered by a published job")
    return jobs
