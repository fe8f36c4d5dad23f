"""Publishing with publisher confirms, many in flight at once.

Every message is persistent, mandatory (an unroutable message is an error, not silence)
and carries its message_id. ``publish_many`` returns one result per message, in order:
``None`` when the broker confirmed it, or the exception that says why not.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import aio_pika
import aiormq
from aio_pika.abc import AbstractChannel, AbstractConnection

from shared.broker.connection import BrokerConnection


@dataclass(frozen=True)
class OutgoingMessage:
    exchange: str
    routing_key: str
    message_id: str
    body: bytes
    headers: Mapping[str, Any] = field(default_factory=dict)
    content_type: str = "application/json"


def _properties(m: OutgoingMessage) -> aiormq.spec.Basic.Properties:
    """The properties aio-pika's ``Message`` would give ``m`` (persistent, priority 0),
    built directly: the ``Message`` itself, a checked attribute at a time, was 15% of the
    CPU a publish cost."""
    return aiormq.spec.Basic.Properties(
        content_type=m.content_type,
        delivery_mode=aio_pika.DeliveryMode.PERSISTENT.value,
        headers=dict(m.headers),
        # As aio-pika's Message took it: text, and an empty id is none (aiormq gives the
        # publish one of its own).
        message_id=str(m.message_id) if m.message_id else None,
        priority=0,
    )


class ConfirmingPublisher:
    def __init__(self, broker: BrokerConnection, *, confirm_timeout: float = 15.0) -> None:
        self._broker = broker
        self._confirm_timeout = confirm_timeout
        self._channel: AbstractChannel | None = None
        #: The connection ``_channel`` is on: what ``reset`` drops.
        self._connection: AbstractConnection | None = None

    async def _ensure_channel(self) -> AbstractChannel:
        if self._channel is None or self._channel.is_closed:
            self._connection, self._channel = await self._broker.open_channel(publisher_confirms=True)
        return self._channel

    async def ensure_ready(self) -> None:
        """Open the connection and channel now rather than at the first publish, so an
        outage shows in readiness and logs before any message waits on it."""
        await self._ensure_channel()

    async def publish_many(self, messages: Sequence[OutgoingMessage]) -> list[BaseException | None]:
        """Publish all messages with their confirms in flight together.

        Each is handed to aiormq's channel with ``wait=False``: its frames are queued for
        the connection's writer and the call waits for the broker's confirm, not for the
        frames to drain. (``Exchange.publish`` waits for the drain while holding the
        channel's lock, so the publishes of a batch went out one at a time, each a turn of
        the event loop and a socket write of its own before the next was queued.) What a
        result means is unchanged: the same channel (confirms, ``on_return_raises``) turns
        a nack into ``DeliveryError`` and an unroutable message into ``PublishError``, and
        a closed channel or a timeout fails every publish not yet confirmed."""
        channel = await self._ensure_channel()
        # aio-pika's abstract type hides ``wait``; the channel it hands out is aiormq's.
        raw = await channel.get_underlay_channel()
        if not isinstance(raw, aiormq.Channel):
            raise TypeError(f"expected an aiormq channel under aio-pika's, got {type(raw)!r}")

        async def one(m: OutgoingMessage) -> None:
            await raw.basic_publish(
                m.body,
                exchange=m.exchange,
                routing_key=m.routing_key,
                properties=_properties(m),
                mandatory=True,
                timeout=self._confirm_timeout,
                wait=False,
            )

        results = await asyncio.gather(*(one(m) for m in messages), return_exceptions=True)
        return [r if isinstance(r, BaseException) else None for r in results]

    async def publish(self, message: OutgoingMessage) -> None:
        (error,) = await self.publish_many([message])
        if error is not None:
            raise error

    async def reset(self) -> None:
        """Forget the channel and its connection after an error; the next publish
        reconnects. (aio-pika may report a dropped connection as open.) Only the
        connection this publisher's channel was on is dropped: another user of the
        shared connection may have opened a new one since."""
        channel, self._channel = self._channel, None
        connection, self._connection = self._connection, None
        if channel is not None and not channel.is_closed:
            try:
                async with asyncio.timeout(5):
                    await channel.close()
            except Exception:
                pass
        await self._broker.reset(connection)
