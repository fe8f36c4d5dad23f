"""Postgres connection pool."""

from __future__ import annotations

import json
from typing import Any, TypeAlias

import asyncpg
from asyncpg.pool import PoolConnectionProxy

#: A connection as the state functions take it: one of their own, or one acquired from a
#: pool (asyncpg hands out a proxy, which mypy tells apart from a Connection).
Conn: TypeAlias = "asyncpg.Connection[asyncpg.Record] | PoolConnectionProxy[asyncpg.Record]"


async def _init_connection(conn: asyncpg.Connection) -> None:
    # jsonb columns come and go as Python objects.
    await conn.set_type_codec("jsonb", encoder=json.dumps, decoder=json.loads, schema="pg_catalog")


async def _keep_session(conn: asyncpg.Connection) -> None:
    """Pool release hook that skips asyncpg's default reset query (a round trip per
    release: RESET ALL, UNLISTEN, advisory unlock). Pooled connections here never change
    session state; asyncpg still rolls back any open transaction before this runs.
    Code that needs session state (LISTEN, advisory locks) takes its own connection."""


#: The channel on which the end of reply jobs is announced: the responder after its
#: records commit, the coalescer's scheduler listening (it refills the accounts' fair
#: share at once, not at its next poll).
JOBS_ENDED_CHANNEL = "chatq_jobs_ended"

# A transaction of its own that only notifies, committed without waiting for its WAL flush.
# Postgres serialises the commits of notifying transactions on one lock of the whole
# cluster, held through the commit: sent from the record's own transaction (a trigger on
# the job's end did so at first), every record's flush would wait for the previous one's.
# This one holds the lock for microseconds, and a notification lost to a crash costs one poll.
_ANNOUNCE_JOBS_ENDED = f"SET LOCAL synchronous_commit = off; SELECT pg_notify('{JOBS_ENDED_CHANNEL}', '')"


async def announce_jobs_ended(conn: Conn) -> None:
    """Tell the coalescers that reply jobs ended (their commit is already done). Best
    effort: a failure is the poll's to cover, never the caller's. Never inside a
    transaction: its SET LOCAL would commit that transaction without waiting for its flush."""
    if conn.is_in_transaction():
        raise RuntimeError("announce_jobs_ended runs after the commit, outside any transaction")
    try:
        await conn.execute(_ANNOUNCE_JOBS_ENDED)
    except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError):
        pass


def one(row: asyncpg.Record | None) -> asyncpg.Record:
    """The row of a query that always returns one (an aggregate, a function's result)."""
    if row is None:
        raise LookupError("the query returned no row where it always returns one")
    return row


async def create_pool(dsn: str, *, size: int = 10, **kwargs: Any) -> asyncpg.Pool:
    """Open a pool. Called from a composition root, never at import time."""
    pool = await asyncpg.create_pool(
        dsn,
        min_size=min(2, size),
        max_size=size,
        init=_init_connection,
        command_timeout=30,
        reset=_keep_session,
        **kwargs,
    )
    assert pool is not None
    return pool
