"""One supervisor for every service: start-up and drain in one place.

A service declares its parts on a :class:`Supervisor` (its pool, its broker connections,
its clients, the tasks it runs and how each one stops); :func:`serve` runs them until
SIGTERM and then unwinds them in reverse, the way an ``AsyncExitStack`` does, because
that is what it is: what started last stops first. So a service that declares its pool,
then its brokers, then its relay, then its consumers drains the consumers (their
in-flight messages finish and are acked) while the relay still publishes, then stops
the relay, then closes the brokers and last the pool.

Each part's stop runs in a ``finally``: a failing step is logged and the next one still
runs. A part that ends before SIGTERM stops the service, which exits 1 once drained."""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable, Coroutine
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import asyncpg

from shared.broker.connection import BrokerConnection
from shared.broker.topology import Topology, build_topology
from shared.db import create_pool
from shared.lifecycle import cancel_and_wait, every, freeze_startup_heap
from shared.migrate import migrate_dsn
from shared.settings import Settings

logger = logging.getLogger(__name__)

#: How a part stops: called once the service drains; may be a coroutine function.
StopStep = Callable[[], Awaitable[object] | None]


class _Closable(Protocol):
    async def aclose(self) -> None: ...


Closable = TypeVar("Closable", bound=_Closable)


@dataclass
class _Part:
    name: str
    task: asyncio.Task[Any]
    stop: StopStep | None
    wait: float | None
    reported: bool = False


@dataclass
class Supervisor:
    """What a running service is made of. Everything declared here is undone when the
    service stops, in the reverse order it was declared."""

    name: str
    settings: Settings
    stack: AsyncExitStack
    _parts: list[_Part] = field(default_factory=list)
    _topology: Topology | None = None

    @property
    def topology(self) -> Topology:
        """The broker topology every connection of this service declares."""
        if self._topology is None:
            self._topology = build_topology(self.settings.retry_delays())
        return self._topology

    async def database(self, size: int) -> asyncpg.Pool:
        """The schema brought up to date (when MIGRATE_ON_START asks), then a pool on it,
        closed last."""
        dsn = self.settings.database_url.get_secret_value()
        if self.settings.migrate_on_start:
            await migrate_dsn(dsn)
        pool = await create_pool(dsn, size=size)
        self.stack.push_async_callback(self._close, "postgres pool", lambda: _close_pool(pool))
        return pool

    def broker(self, name: str) -> BrokerConnection:
        """A connection of its own to RabbitMQ (one per role: a consumer's flow control
        never blocks another connection's publishes), closed after the parts that use it."""
        broker = BrokerConnection(self.settings.amqp_urls(), self.topology, name=name)
        self.stack.push_async_callback(self._close, f"broker connection {name}", broker.close)
        return broker

    def closing(self, name: str, resource: Closable) -> Closable:
        """An HTTP client (or anything with ``aclose``), closed after the parts that use it."""
        self.stack.push_async_callback(self._close, name, resource.aclose)
        return resource

    def run(
        self,
        name: str,
        work: Coroutine[Any, Any, object],
        *,
        stop: StopStep | None = None,
        wait: float | None = 5.0,
    ) -> asyncio.Task[Any]:
        """A part that runs until the service stops; if it ends before, the service
        stops. On the way out, ``stop`` is called, then the part gets ``wait`` seconds
        to finish (None: as long as it takes) before it is cancelled."""
        task = asyncio.create_task(work, name=name)
        part = _Part(name, task, stop, wait)
        self._parts.append(part)
        self.stack.push_async_callback(self._stop_part, part)
        return task

    def every(self, seconds: float, name: str, step: Callable[[], Awaitable[object]]) -> None:
        """A step repeated every ``seconds`` (gauges, sweeps, probes), its failures logged
        and the next round run as planned; cancelled on the way out."""
        task = asyncio.create_task(every(seconds, name, step), name=name)
        self.stack.push_async_callback(cancel_and_wait, task)

    async def wait(self, stop: asyncio.Event) -> bool:
        """Until ``stop`` is set or a part ends. True when a part ended first (a failure:
        parts run until told to stop)."""
        stopper = asyncio.create_task(stop.wait(), name="stop")
        try:
            done, _ = await asyncio.wait(
                {stopper, *(p.task for p in self._parts)}, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            stopper.cancel()
        failed = False
        for part in self._parts:
            if part.task in done:
                failed = part.reported = True
                error = None if part.task.cancelled() else part.task.exception()
                logger.error("%s: %s stopped unexpectedly", self.name, part.name, exc_info=error)
        return failed

    async def _stop_part(self, part: _Part) -> None:
        try:
            if part.stop is not None:
                result = part.stop()
                if inspect.isawaitable(result):
                    await result
        except Exception:
            logger.exception("%s: stopping %s failed", self.name, part.name)
        finally:
            try:
                if part.wait is None:
                    done, _ = await asyncio.wait({part.task})
                else:
                    done, _ = await asyncio.wait({part.task}, timeout=part.wait)
                if not done:
                    logger.warning(
                        "%s: %s did not finish within %.0fs; cancelled", self.name, part.name, part.wait
                    )
                elif not part.reported and not part.task.cancelled() and part.task.exception() is not None:
                    logger.error(
                        "%s: %s failed as it stopped", self.name, part.name, exc_info=part.task.exception()
                    )
            finally:
                # Also when the drain itself is cancelled: the part never outlives it.
                await cancel_and_wait(part.task)

    async def _close(self, name: str, close: Callable[[], Awaitable[object]]) -> None:
        try:
            await close()
        except Exception:
            logger.exception("%s: closing the %s failed", self.name, name)


#: How long the pool's close waits for connections still in use before it cuts them.
POOL_CLOSE_SECONDS = 10.0


async def _close_pool(pool: asyncpg.Pool) -> None:
    """asyncpg's close waits until every connection in use is released: for ever, if a
    task that holds one never ends. Cut (terminated) after POOL_CLOSE_SECONDS instead:
    what those connections had not committed rolls back, as after a crash."""
    try:
        async with asyncio.timeout(POOL_CLOSE_SECONDS):
            await pool.close()
    except TimeoutError:
        pool.terminate()
        logger.warning(
            "postgres pool: connections still in use %.0fs into its close; cut", POOL_CLOSE_SECONDS
        )


async def serve(
    name: str, settings: Settings, stop: asyncio.Event, declare: Callable[[Supervisor], Awaitable[None]]
) -> int:
    """Start the service ``declare`` describes, run it until ``stop`` is set, drain it,
    and return the process's exit status (1 when a part ended on its own)."""
    async with AsyncExitStack() as stack:
        supervisor = Supervisor(name, settings, stack)
        await declare(supervisor)
        freeze_startup_heap()
        failed = await supervisor.wait(stop)
        logger.info("%s draining", name)
    logger.info("%s stopped", name)
    return 1 if failed else 0
