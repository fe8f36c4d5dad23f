"""Telegram Business connections, as Telegram last described them (the receiver keeps what
``business_connection`` updates say; a send Telegram refuses for a connection says it too):
while one is turned off, or does not let the bot reply, its chats' replies wait, without
spending attempts, until Telegram says it works again (a ``business_connection`` update,
or getBusinessConnection, asked every ACCOUNT_PROBE_SECONDS). The table is
``telegram_business_connections`` (migration 0030)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import asyncpg

#: One connection prober at a time across responder replicas.
PROBE_LOCK_KEY = 0x63686174_62697A70  # "chatbizp"


class BusinessConnections:
    def __init__(self, pool: asyncpg.Pool) -> None:
        self._pool = pool

    async def paused(self, account_id: str, connection_id: str) -> tuple[str | None, bool]:
        """Why the connection's replies wait now (None: they may go), and whether it is gone
        for good (Telegram no longer knows it: they never will)."""
        row = await self._pool.fetchrow(
            "SELECT paused_reason, removed FROM telegram_business_connections"
            " WHERE account_id = $1 AND connection_id = $2",
            account_id,
            connection_id,
        )
        return (None, False) if row is None else (row["paused_reason"], row["removed"])

    async def remove(self, account_id: str, connection_id: str, reason: str) -> None:
        """Telegram no longer knows the connection (the business account deleted the bot):
        its replies go to a person instead of waiting."""
        await self._pool.execute(
            """
            UPDATE telegram_business_connections
            SET removed = true, paused_reason = $3, next_probe_at = NULL, updated_at = now()
            WHERE account_id = $1 AND connection_id = $2
            """,
            account_id,
            connection_id,
            reason,
        )

    async def pause(self, account_id: str, connection_id: str, reason: str, probe_in: float) -> bool:
        """Telegram refused a send through the connection. True for the one caller that
        paused it (tell a person once): the row is paused only where it was not, or made
        paused, so of two sends refused at once (two replicas, two jobs) one finds it
        active. (Reading the old state first let both find it active: two alerts.)"""
        return bool(
            await self._pool.fetchval(
                """
                WITH up AS (
                    UPDATE telegram_business_connections
                    SET paused_reason = $3, next_probe_at = now() + make_interval(secs => $4), updated_at = now()
                    WHERE account_id = $1 AND connection_id = $2 AND paused_reason IS NULL
                    RETURNING 1
                ), made AS (
                    INSERT INTO telegram_business_connections
                        (account_id, connection_id, is_enabled, can_reply, paused_reason, next_probe_at)
                    SELECT $1, $2, true, false, $3, now() + make_interval(secs => $4)
                    WHERE NOT EXISTS (SELECT 1 FROM up)
                    ON CONFLICT (account_id, connection_id) DO NOTHING
                    RETURNING 1
                )
                SELECT EXISTS (SELECT 1 FROM up) OR EXISTS (SELECT 1 FROM made)
                """,
                account_id,
                connection_id,
                reason,
                probe_in,
            )
        )

    async def resume(self, account_id: str, connection_id: str) -> bool:
        """Telegram says the connection works: its replies go. True when it was paused."""
        return bool(
            await self._pool.fetchval(
                """
                UPDATE telegram_business_connections
                SET paused_reason = NULL, next_probe_at = NULL, is_enabled = true, can_reply = true,
                    updated_at = now()
                WHERE account_id = $1 AND connection_id = $2 AND paused_reason IS NOT NULL
                RETURNING true
                """,
                account_id,
                connection_id,
            )
        )

    async def probe_later(self, account_id: str, connection_id: str, probe_in: float) -> None:
        await self._pool.execute(
            """
            UPDATE telegram_business_connections SET next_probe_at = now() + make_interval(secs => $3)
            WHERE account_id = $1 AND connection_id = $2 AND paused_reason IS NOT NULL
            """,
            account_id,
            connection_id,
            probe_in,
        )

    @contextlib.asynccontextmanager
    async def due_for_probe(self) -> AsyncIterator[list[asyncpg.Record]]:
        """The paused connections due for a probe, to one replica at a time."""
        async with self._pool.acquire() as conn:
            if not await conn.fetchval("SELECT pg_try_advisory_lock($1)", PROBE_LOCK_KEY):
                yield []
                return
            try:
                yield await conn.fetch(
                    """
                    SELECT account_id, connection_id, paused_reason FROM telegram_business_connections
                    WHERE paused_reason IS NOT NULL AND NOT removed AND next_probe_at <= now()
                    ORDER BY next_probe_at LIMIT 100
                    """
                )
            finally:
                await conn.execute("SELECT pg_advisory_unlock($1)", PROBE_LOCK_KEY)
