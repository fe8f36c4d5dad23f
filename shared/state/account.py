"""A platform account (a Telegram bot, an Avito account, a generic sender): whether the
bot may send on it.

    active <-> paused_by_platform   the platform refused the account as a whole (a revoked
                                    token, wrong credentials, no paid plan): its jobs wait,
                                    a probe resumes it once the platform accepts it again
    active <-> paused_by_person     a person paused it (nothing resumes it but a person)

A refusal about one chat (the buyer blocked the bot, the chat is gone) is not about the
account: that job fails alone.
"""

from __future__ import annotations

import enum

import asyncpg

from shared.db import Conn

from .machine import Lifecycle


class AccountState(enum.StrEnum):
    ACTIVE = "active"
    PAUSED_BY_PLATFORM = "paused_by_platform"
    PAUSED_BY_PERSON = "paused_by_person"


A = AccountState

LIFECYCLE = Lifecycle(
    "account",
    AccountState,
    {
        A.ACTIVE: frozenset({A.PAUSED_BY_PLATFORM, A.PAUSED_BY_PERSON}),
        A.PAUSED_BY_PLATFORM: frozenset({A.ACTIVE, A.PAUSED_BY_PERSON}),
        A.PAUSED_BY_PERSON: frozenset({A.ACTIVE}),
    },
)


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


async def resume(conn: Conn, platform: str, account_id: str) -> bool:
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


async def due_for_probe(conn: Conn, platforms: list[str]) -> list[asyncpg.Record]:
    """Accounts the platform paused whose probe is due, on these platforms."""
    return await conn.fetch(
        """
        SELECT platform, account_id, state_reason FROM accounts
        WHERE state = 'paused_by_platform' AND next_probe_at <= now() AND platform = ANY($1::text[])
        ORDER BY next_probe_at
        """,
        platforms,
    )


async def probe_later(conn: Conn, platform: str, account_id: str, reason: str, probe_in: float) -> None:
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
