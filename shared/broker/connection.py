"""A broker connection that reconnects on demand, to any node of a cluster.

We do not rely on aio-pika's robust connection: each user (relay, consumer) decides what a
lost connection means for its in-flight work, then asks for a fresh channel here. A
robust connection also reconnects to the one URL it was given, which does not help when
that node is the one that died.

``addresses`` is one AMQP URL or several (a list, or a comma-separated string as
``CHATQ_AMQP_URL`` takes it): each (re)connect tries them in a random order, the address
of the connection just lost last, until one answers and the topology is declared there.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Sequence

import aio_pika
import aiormq.exceptions
from aio_pika.abc import AbstractChannel, AbstractConnection

from shared.broker.declare import declare_topology
from shared.broker.topology import Topology
from shared.logging import redact_url
from shared.settings import amqp_addresses

logger = logging.getLogger(__name__)

#: Refusals that every node would repeat: trying another one does not help.
_SAME_EVERYWHERE = (
    aiormq.exceptions.ChannelPreconditionFailed,
    aiormq.exceptions.ChannelAccessRefused,
    aiormq.exceptions.ProbableAuthenticationError,
)


class BrokerUnreachable(ConnectionError):
    """No address answered; says why for each."""


class BrokerConnection:
    """One AMQP connection with topology declared once per (re)connect."""

    def __init__(
        self,
        addresses: str | Sequence[str],
        topology: Topology,
        *,
        name: str = "chatq",
        connect_timeout: float = 10.0,
    ) -> None:
        self._addresses = amqp_addresses(addresses) if isinstance(addresses, str) else list(addresses)
        if not self._addresses:
            raise ValueError("no AMQP address given")
        self._topology = topology
        self._name = name
        self._connect_timeout = connect_timeout
        self._connection: AbstractConnection | None = None
        self._lock = asyncio.Lock()
        self._rng = random.Random()
        #: The address of the current (or last) connection.
        self.address: str | None = None

    @property
    def is_open(self) -> bool:
        return self._connection is not None and not self._connection.is_closed

    def _order(self) -> list[str]:
        """The addresses in a random order, the last one used (whose node may be the one
        that just went away) at the end."""
        order = list(self._addresses)
        self._rng.shuffle(order)
        if self.address in order and len(order) > 1:
            order.remove(self.address)
            order.append(self.address)
        return order

    async def connect(self) -> AbstractConnection:
        """Return the open connection, opening it (and declaring the topology) if needed."""
        async with self._lock:
            if self._connection is not None and not self._connection.is_closed:
                return self._connection
            await self._discard()
            problems: list[str] = []
            for address in self._order():
                try:
                    connection = await self._open(address)
                except _SAME_EVERYWHERE:
                    raise
                except Exception as exc:
                    problems.append(f"{redact_url(address)}: {type(exc).__name__}: {exc}")
                    continue
                self._connection, self.address = connection, address
                if len(self._addresses) > 1:
                    logger.info("connected to RabbitMQ at %s as %s", redact_url(address), self._name)
                else:
                    logger.info("connected to RabbitMQ as %s", self._name)
                return connection
            raise BrokerUnreachable("no RabbitMQ node answered: " + "; ".join(problems))

    async def _open(self, address: str) -> AbstractConnection:
        connection = await aio_pika.connect(
            address, client_properties={"connection_name": self._name}, timeout=self._connect_timeout
        )
        try:
            channel = await connection.channel()
            await declare_topology(channel, self._topology)
            await channel.close()
        except BaseException:
            await connection.close()
            raise
        return connection

    async def channel(self, *, publisher_confirms: bool = False) -> AbstractChannel:
        return (await self.open_channel(publisher_confirms=publisher_confirms))[1]

    async def open_channel(
        self, *, publisher_confirms: bool = False
    ) -> tuple[AbstractConnection, AbstractChannel]:
        """A new channel and the connection it is on: what the caller hands to ``reset``
        when an error comes through that channel."""
        connection = await self.connect()
        try:
            channel = await connection.channel(
                publisher_confirms=publisher_confirms, on_return_raises=publisher_confirms
            )
        except Exception:
            # A connection that died unnoticed (aio-pika may report it open): dropped
            # here, so the next caller gets a new one instead of the same failure.
            await self.reset(connection)
            raise
        return connection, channel

    async def reset(self, failed: AbstractConnection | None) -> None:
        """Drop ``failed``, the connection an error came through (None: the caller had
        none, its connect failed); the next ``connect`` opens a new one. The connection is
        shared: when another user has already replaced ``failed``, the current one is
        theirs and stays open (a late reset once closed it under them)."""
        async with self._lock:
            if failed is None:
                return
            if failed is self._connection:
                await self._discard()
            else:
                await self._close(failed)

    async def _discard(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            await self._close(connection)

    @staticmethod
    async def _close(connection: AbstractConnection) -> None:
        if not connection.is_closed:
            try:
                async with asyncio.timeout(5):
                    await connection.close()
            except Exception:
                logger.debug("closing a broken connection failed", exc_info=True)

    async def close(self) -> None:
        """Close the current connection (at shutdown)."""
        async with self._lock:
            await self._discard()
