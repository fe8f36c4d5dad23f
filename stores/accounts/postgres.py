"""The accounts aggregate's states in Postgres: whether the bot may send on an account
(shared/state/account.py's lifecycle). ``PgAccountStates`` is the store; the functions
below take a connection, so the jobs store (stores/jobs/postgres.py) changes an account
in the same place it handles a job. Proven against ``fake.InMemoryAccountStates`` by
tests/contract/test_accounts.py."""

from __future__ import annotations

from collections.abc import Sequence

import asyncpg

from shared.db import Conn
from shared.messages import Row


class PgAccountStates:
    def __init__(self, pool: asyncpg.Pool) -> None:
        self._pool = pool

    async def pause_by_platform(self, platform: str, account_id: str, reason: str, probe_in: float) -> bool:
        async with self._pool.acquire() as conn:
            return await pause_by_platform(conn, platform, account_id, reason, probe_in)

    async def pause_by_person(self, platform: str, account_id: str, reason: str) -> bool:
        return await pause_by_person(self._pool, platform, account_id, reason)

    async def resume_by_person(self, platform: str, account_id: str) -> None:
        await resume_by_person(self._pool, platform, account_id)

    async def resume(self, platform: str, account_id: str) -> bool:
        return await resume(self._pool, platform, account_id)

    async def probe_later(self, platform: str, account_id: str, reason: str, probe_in: float) -> None:
        await probe_later(self._pool, platform, account_id, reason, probe_in)

    async def due_for_probe(self, platforms: list[str]) -> Sequence[Row]:
        return await due_for_probe(self._pool, platforms)

    async def paused(self) -> Sequence[Row]:
        return await paused(self._pool)


async def pause_by_platform(conn: Conn, platform: str, account_id: str, reason: str, probe_in: float) -> bool:
    """The platform refused the account: pause it (or keep it paused with the latest
    reason) and schedule a probe. Returns True for the one caller that moved it from active
    (so it is announced once, however many jobs met the refusal at the same moment)."""
    async with conn.transaction():
        await conn.execute(
            "INSERT INTO accounts (platform, account_id) VALUES ($1, $2) ON CONFLICT DO NOTHING",
            platform,
            account_id,
        )
        # Concurrent callers queue on the row; only the first still finds it active.
        moved = await conn.fetchval(
            """
            UPDATE accounts SET state = 'paused_by_platform', state_reason = $3, state_since = now(),
                   next_probe_at = now() + make_interval(secs => $4)
            WHERE platform = $1 AND account_id = $2 AND state = 'active'
            RETURNING true
            """,
            platform,
            account_id,
            reason[:500],
            probe_in,
        )
        if not moved:
            await probe_later(conn, platform, account_id, reason, probe_in)
    return bool(moved)


async def resume(conn: Conn | asyncpg.Pool, platform: str, account_id: str) -> bool:
    """The platform accepts the account again (a probe succeeded). Returns True when it was
    paused by the platform until now. A person's pause stays."""
    status = await conn.execute(
        """
        UPDATE accounts SET state = 'active', state_reason = NULL, state_since = now(), next_probe_at = NULL
        WHERE platform = $1 AND account_id = $2 AND state = 'paused_by_platform'
        """,
        platform,
        account_id,
    )
    return status.endswith(" 1")


async def due_for_probe(conn: Conn | asyncpg.Pool, platforms: list[str]) -> list[asyncpg.Record]:
    """Accounts the platform paused whose probe is due, on these platforms."""
    return await conn.fetch(
        """
        SELECT platform, account_id, state_reason FROM accounts
        WHERE state = 'paused_by_platform' AND next_probe_at <= now() AND platform = ANY($1::text[])
        ORDER BY next_probe_at
        """,
        platforms,
    )


async def probe_later(
    conn: Conn | asyncpg.Pool, platform: str, account_id: str, reason: str, probe_in: float
) -> None:
    await conn.execute(
        """
        UPDATE accounts SET state_reason = $3, next_probe_at = now() + make_interval(secs => $4)
        WHERE platform = $1 AND account_id = $2 AND state = 'paused_by_platform'
        """,
        platform,
        account_id,
        reason[:500],
        probe_in,
    )


async def paused(conn: Conn | asyncpg.Pool) -> list[asyncpg.Record]:
    """Every account that is not active, for a person (ops page, stats, doctor)."""
    return await conn.fetch(
        "SELECT platform, account_id, state, state_reason, state_since FROM accounts WHERE state <> 'active'"
        " ORDER BY state_since"
    )


async def pause_by_person(conn: Conn | asyncpg.Pool, platform: str, account_id: str, reason: str) -> bool:
    """A person pauses the account (or start-up does, for one whose credentials will not
    do): its replies wait, none fails, no probe resumes it. True when this moved it (a
    removed account, or one a person paused already, is left as it is)."""
    moved = await conn.fetchval(
        """
        UPDATE accounts SET state = 'paused_by_person', state_reason = $3, state_since = now(),
               next_probe_at = NULL, updated_at = now()
        WHERE platform = $1 AND account_id = $2 AND removed_at IS NULL AND state <> 'paused_by_person'
        RETURNING true
        """,
        platform,
        account_id,
        reason,
    )
    return bool(moved)


async def resume_by_person(conn: Conn | asyncpg.Pool, platform: str, account_id: str) -> None:
    """A person's resume: their own pause ends at once; a platform's is probed now (it ends
    when the platform accepts the account again)."""
    await conn.execute(
        """
        UPDATE accounts SET state = CASE WHEN state = 'paused_by_person' THEN 'active' ELSE state END,
               state_reason = CASE WHEN state = 'paused_by_person' THEN NULL ELSE state_reason END,
               state_since = CASE WHEN state = 'paused_by_person' THEN now() ELSE state_since END,
               next_probe_at = CASE WHEN state = 'paused_by_platform' THEN now() ELSE next_probe_at END,
               updated_at = now()
        WHERE platform = $1 AND account_id = $2 AND state <> 'active' AND removed_at IS NULL
        """,
        platform,
        account_id,
    )
