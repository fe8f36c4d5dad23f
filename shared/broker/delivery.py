"""A message as the broker delivered it to one of our consumers: what handlers read and
what the consumer wrapper settles.

The wrapper consumes on aiormq's channel and hands handlers an ``AmqpDelivery``, a view
of aiormq's own delivered message, instead of aio-pika's ``IncomingMessage``. aio-pika
built that object for every delivery (each of a dozen properties copied and converted
through a checking ``__setattr__``) and ran the callback in a task of its own, beside
the one aiormq already runs it in. Through this wrapper, 20,000 deliveries cost 288
microseconds of CPU each in batches and 330 one at a time with aio-pika's message, 210
and 230 with this view. Every inbound message and every reply job is delivered once at
least, so the coalescer and the responder each paid it per message.

Handlers and tests depend on ``Delivery``, the few things they use; the fakes in the
unit tests implement it too.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import aiormq
from aiormq.abc import DeliveredMessage


class Delivery(Protocol):
    """One delivery: its body and properties, and its settlement on its own channel (an
    ack with ``multiple`` settles every earlier outstanding delivery of that channel)."""

    @property
    def body(self) -> bytes: ...

    @property
    def message_id(self) -> str | None: ...

    @property
    def headers(self) -> Mapping[str, Any]: ...

    @property
    def delivery_tag(self) -> int | None: ...

    @property
    def channel(self) -> object: ...

    async def ack(self, multiple: bool = False) -> None: ...

    async def nack(self, requeue: bool = True) -> None: ...

    async def reject(self, requeue: bool = False) -> None: ...


class AlreadySettled(RuntimeError):
    """A delivery was acked, nacked or rejected already. Sending a second settlement would
    name a delivery tag the broker has forgotten, and the broker would close the channel
    and redeliver every other delivery outstanding on it; this refuses it instead, as
    aio-pika's message did (the consumer logs it and goes on)."""


class AmqpDelivery:
    """A delivery on an aiormq channel, settled at most once. Settling it on a channel that
    has closed raises aiormq's ``ChannelInvalidStateError`` (the broker redelivers the
    message)."""

    __slots__ = ("_properties", "_settled", "body", "channel", "delivery_tag", "message_id")

    def __init__(self, message: DeliveredMessage) -> None:
        properties = message.header.properties
        self.body: bytes = message.body
        self.channel: aiormq.abc.AbstractChannel = message.channel
        self.delivery_tag: int | None = message.delivery_tag
        # As aio-pika read it: an empty id is no id.
        self.message_id: str | None = properties.message_id or None
        self._properties = properties
        self._settled = False

    @property
    def headers(self) -> Mapping[str, Any]:
        return self._properties.headers or {}

    def _settle(self) -> int | None:
        """The tag to settle, once: a second settlement raises ``AlreadySettled``."""
        if self._settled:
            raise AlreadySettled(f"delivery {self.delivery_tag} ({self.message_id}) is settled already")
        self._settled = True
        return self.delivery_tag

    async def ack(self, multiple: bool = False) -> None:
        if (tag := self._settle()) is not None:
            await self.channel.basic_ack(tag, multiple=multiple)

    async def nack(self, requeue: bool = True) -> None:
        if (tag := self._settle()) is not None:
            await self.channel.basic_nack(tag, requeue=requeue)

    async def reject(self, requeue: bool = False) -> None:
        if (tag := self._settle()) is not None:
            await self.channel.basic_reject(tag, requeue=requeue)
