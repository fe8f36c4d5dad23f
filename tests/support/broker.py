"""Looking at queues from tests, through AMQP only (no management API needed)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import aio_pika
from aio_pika.abc import AbstractIncomingMessage


class QueueInspector:
    def __init__(self, amqp_url: str) -> None:
        self._url = amqp_url
        self._connection: aio_pika.abc.AbstractConnection | None = None

    async def _channel(self) -> aio_pika.abc.AbstractChannel:
        if self._connection is None or self._connection.is_closed:
            self._connection = await aio_pika.connect(self._url)
        return await self._connection.channel()

    async def depth(self, queue: str) -> int:
        channel = await self._channel()
        try:
            q = await channel.declare_queue(queue, passive=True)
            return q.declaration_result.message_count or 0
        finally:
            await channel.close()

    async def drain(self, queue: str) -> list[AbstractIncomingMessage]:
        """Take every message currently in the queue (acknowledged, so they are gone)."""
        channel = await self._channel()
        out: list[AbstractIncomingMessage] = []
        try:
            q = await channel.declare_queue(queue, passive=True)
            while True:
                message = await q.get(no_ack=True, fail=False)
                if message is None:
                    break
                out.append(message)
        finally:
            await channel.close()
        return out

    async def purge(self, *queues: str) -> None:
        channel = await self._channel()
        try:
            for name in queues:
                q = await channel.declare_queue(name, passive=True)
                await q.purge()
        finally:
            await channel.close()

    async def close(self) -> None:
        if self._connection is not None:
            await self._connection.close()


async def wait_for(
    condition: Callable[[], object], *, within: float = 15.0, interval: float = 0.05, what: str = "condition"
) -> object:
    """Poll ``condition`` (sync or async) until it returns something truthy, or fail."""
    deadline = time.monotonic() + within
    last: object = None
    while True:
        result = condition()
        if asyncio.iscoroutine(result):
            result = await result
        last = result
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {within}s waiting for {what} (last: {last!r})")
        await asyncio.sleep(interval)
