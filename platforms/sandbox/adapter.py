"""The built-in sandbox platform: a chat page served by the receiver (/sandbox) where a
person types as a buyer. "Sending" a reply writes it to ``sandbox_replies`` (one row per
job, so a re-send is a no-op and a lost answer can be looked up), where the page reads
it. It goes through the real receiver, RabbitMQ, coalescer and responder."""

from __future__ import annotations

import asyncpg

from platforms.base import Sent, SentQuery
from platforms.failures import Failure, Kind


class SandboxPlatform:
    name = "sandbox"
    max_text = 1_000_000  # our own page: one part, whatever the length
    idempotent = True
    can_reconcile = True

    def __init__(self, pool: asyncpg.Pool) -> None:
        self._pool = pool

    async def send(
        self, account_id: str, chat_id: str, text: str, *, key: str, business_connection_id: str | None = None
    ) -> Sent:
        try:
            row_id = await self._pool.fetchval(
                """
                WITH ins AS (
                    INSERT INTO sandbox_replies (job_id, account_id, chat_id, text) VALUES ($1, $2, $3, $4)
                    ON CONFLICT (job_id) DO NOTHING RETURNING id)
                SELECT id FROM ins UNION ALL SELECT id FROM sandbox_replies WHERE job_id = $1 LIMIT 1
                """,
                key,
                account_id,
                chat_id,
                text,
            )
        except (OSError, asyncpg.PostgresConnectionError) as exc:
            raise Failure(Kind.TRANSIENT, f"sandbox store unreachable ({type(exc).__name__})") from None
        return Sent(f"sb-{row_id}")

    async def probe(self, account_id: str) -> None:
        """Nothing to pause: no account the receiver can refuse as a whole."""
        return None

    async def find_sent(self, query: SentQuery) -> Sent | None:
        """The sandbox keeps one reply per job: look it up by the job."""
        row_id = await self._pool.fetchval("SELECT id FROM sandbox_replies WHERE job_id = $1", query.key)
        return Sent(f"sb-{row_id}") if row_id else None

    async def aclose(self) -> None:
        return None
