"""A broker connection that reconnects on demand.

We do not rely on aio-pika's robust connection: each user (relay, consumer) decides what a
lost connection means for its in-flight work, then asks for a fresh channel here.
"""

from __future__ import annotations

import asyncio
import logging

import aio_pika
from aio_pika.abc import AbstractChannel, AbstractConnection

from shared.broker.declare import declare_topology
from shared.broker.topology import Topology

logger = logging.getLogger(__name__)


class BrokerConnection:
    """One AMQP connection with topology declared once per (re)connect."""

    def __init__(self, url: str, topology: Topology, *, name: str = "chatq") -> None:
        self._url = url
        self._topology = topology
        self._name = name
        self._connection: AbstractConnection | None = None
        self._lock = asyncio.Lock()

    @property
    def is_open(self) -> bool:
        return self._connection is not None and not self._connection.is_closed

    async def connect(self) -> AbstractConnection:
        """Return the open connection, opening it (and declaring the topology) if needed."""
        async with self._lock:
            if self._connection is not None and not self._connection.is_closed:
                return self._connection
            await self._discard()
            connection = await aio_pika.connect(
                self._url, client_properties={"connection_name": self._name}, timeout=10
            )
            try:
                channel = await connection.channel()
                await declare_topology(channel, self._topology)
                await channel.close()
            except BaseException:
                await connection.close()
                raise
            self._connection = connection
            logger.info("connected to RabbitMQ as %s", self._name)
            return connection

    async def channel(self, *, publisher_confirms: bool = False) -> AbstractChannel:
        connection = await self.connect()
        return await connection.channel(
            publisher_confirms=publisher_confirms, on_return_raises=publisher_confirms
        )

    async def reset(self) -> None:
        """Drop the connection after an error; the next ``connect`` opens a new one."""
        async with self._lock:
            await self._discard()

    async def _discard(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None and not connection.is_closed:
            try:
                await asyncio.wait_for(connection.close(), timeout=5)
            except Exception:
                logger.debug("closing a broken connection failed", exc_info=True)

    async def close(self) -> None:
        await self.reset()
