"""Jobs in flight together share one Postgres connection, and the statements they all make
(claim, before send, record sent) go as one round trip for every job that asks at that
moment: the group commit of the intake, for the responder.

A ``SharedConnection`` holds one pooled connection for up to RESPONDER_BATCH_JOBS jobs'
sessions at once. Its statements run one at a time (a lock); ``together`` gathers the
calls of one kind made while the connection is busy, or in the same turn of the event
loop, and runs them as one statement through a runner that returns each call's result
(or its own exception: one bad job fails only its own call). ``alone`` is the rest: one
statement for one job, in turn with the others.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

import asyncpg

from shared.db import Conn

Item = TypeVar("Item")
Result = TypeVar("Result")

#: Runs one statement for the calls gathered (their items, in the order they were made)
#: and returns, in that order, each call's result or the exception that call raises.
Runner = Callable[[Conn, Sequence[Item]], Awaitable[Sequence[Result | Exception]]]


class SharedConnection:
    def __init__(self, opening: Awaitable[Conn]) -> None:
        self._opening = asyncio.ensure_future(opening)
        self._lock = asyncio.Lock()
        self._waiting: dict[str, list[tuple[Any, asyncio.Future[Any]]]] = {}
        #: Sessions using it now; the store returns it to the pool when none is left.
        self.members = 0
        #: A lock may have outlived its job here (an unlock that did not complete, a
        #: statement cut short), or the connection was lost: no new session joins, and it
        #: is closed, not pooled.
        self.broken = False
        #: Statements sent and calls they answered (what the batching achieves).
        self.statements = 0
        self.calls = 0

    async def connection(self) -> Conn:
        """The connection, once the pool gave it (raises what acquiring raised)."""
        return await asyncio.shield(self._opening)

    @contextlib.asynccontextmanager
    async def alone(self) -> AsyncIterator[Conn]:
        """The connection for one statement of one job, in turn with the others."""
        conn = await self.connection()
        async with self._lock:
            self.statements += 1
            self.calls += 1
            try:
                yield conn
            finally:
                if lost(conn):
                    self.broken = True  # the jobs that run again go elsewhere

    async def together(self, kind: str, item: Item, runner: Runner[Item, Result]) -> Result:
        """``item``'s result from one statement of ``kind`` for every call of that kind
        made meanwhile: the first caller to hold the connection runs them all."""
        conn = await self.connection()
        future: asyncio.Future[Result] = asyncio.get_running_loop().create_future()
        entry = (item, future)
        self._waiting.setdefault(kind, []).append(entry)
        try:
            await asyncio.sleep(0)  # the other jobs of this turn of the loop join
            async with self._lock:
                if not future.done():
                    await self._run(conn, self._waiting.pop(kind), runner)
        except asyncio.CancelledError:
            waiting = self._waiting.get(kind)
            if waiting is not None and entry in waiting:
                waiting.remove(entry)  # never run for a caller that is gone
            raise
        return future.result()

    async def _run(
        self, conn: Conn, batch: list[tuple[Any, asyncio.Future[Any]]], runner: Runner[Any, Any]
    ) -> None:
        self.statements += 1
        self.calls += len(batch)
        try:
            results = await runner(conn, [item for item, _ in batch])
        except BaseException as exc:
            if isinstance(exc, asyncio.CancelledError) or lost(conn):
                self.broken = True  # a statement cut short (its locks are unknown), or the connection lost
            for _, future in batch:
                if not future.done():
                    future.set_exception(
                        exc if isinstance(exc, Exception) else ConnectionAbortedError(str(exc))
                    )
            raise
        for (_, future), result in zip(batch, results, strict=True):
            if future.done():
                continue
            if isinstance(result, Exception):
                future.set_exception(result)
            else:
                future.set_result(result)


def lost(conn: Conn) -> bool:
    """Whether the connection is gone. A pooled one lost under us is detached from its
    proxy at once, and then every call on it, ``is_closed`` too, raises."""
    try:
        return conn.is_closed()
    except asyncpg.InterfaceError:
        return True
