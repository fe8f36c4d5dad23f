"""One BrokerConnection shared by several users (the responder's two consumers, a consumer
and its retry publisher, the relay's publisher): after a connection drops, each user
resets what failed under it. A user that notices late must not close the connection
another user has opened since (issue 40, point 4)."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any
from urllib.parse import urlsplit

import aio_pika
import pytest

from shared.broker.connection import BrokerConnection
from shared.broker.consumer import Consumer
from shared.broker.delivery import Delivery
from shared.broker.publisher import ConfirmingPublisher, OutgoingMessage
from tests.conftest import TEST_TOPOLOGY
from tests.integration.test_publisher_failures import via_proxy
from tests.support.broker import wait_for
from tests.support.infra import Infra
from tests.support.tcpproxy import TcpProxy

pytestmark = [pytest.mark.integration]


async def test_a_late_reset_by_one_user_leaves_the_connection_another_user_opened_since(infra: Infra) -> None:
    admin = await aio_pika.connect(infra.amqp_url)
    ch = await admin.channel()
    queue = await ch.declare_queue(f"broker-connection-test.{uuid.uuid4().hex[:8]}", durable=True)
    proxy = await TcpProxy("127.0.0.1", urlsplit(infra.amqp_url).port or 5672).start()
    broker = BrokerConnection(via_proxy(infra.amqp_url, proxy.port), TEST_TOPOLOGY, name="shared")
    early, late = ConfirmingPublisher(broker), ConfirmingPublisher(broker)
    to = lambda n: OutgoingMessage("", queue.name, f"m{n}", b"x")  # noqa: E731
    try:
        await early.ensure_ready()
        await late.ensure_ready()  # both on the same connection
        proxy.block()  # the connection drops under both
        proxy.unblock()
        # One user notices first (its publish fails): it resets and reconnects.
        with pytest.raises(Exception):  # noqa: B017 - whatever the cut raised
            await asyncio.wait_for(early.publish(to(0)), 10)
        await early.reset()
        await early.publish(to(1))
        reopened = await broker.connect()
        # The other notices now, and resets what failed under it.
        await late.reset()
        assert not reopened.is_closed, "the late reset closed the connection opened since"
        assert await broker.connect() is reopened
        await early.publish(to(2))
        await late.publish(to(3))
        assert (await ch.declare_queue(queue.name, passive=True)).declaration_result.message_count == 3
    finally:
        await early.reset()
        await late.reset()
        await broker.close()
        await proxy.close()
        await queue.delete(if_unused=False, if_empty=False)
        await admin.close()


async def test_a_connection_that_died_unnoticed_is_dropped_when_a_channel_cannot_be_opened_on_it(
    infra: Infra,
) -> None:
    """A reset needs the connection that failed; a caller whose channel could not even be
    opened has none to give, so opening the channel drops it (else every caller would be
    handed the same dead connection, again and again)."""
    proxy = await TcpProxy("127.0.0.1", urlsplit(infra.amqp_url).port or 5672).start()
    broker = BrokerConnection(via_proxy(infra.amqp_url, proxy.port), TEST_TOPOLOGY, name="unnoticed")
    try:
        first = await broker.connect()
        proxy.block()
        proxy.unblock()
        with pytest.raises(Exception):  # noqa: B017 - whatever the dead connection raises
            await asyncio.wait_for(broker.channel(), 10)
        channel = await asyncio.wait_for(broker.channel(), 10)
        assert not channel.is_closed
        assert await broker.connect() is not first
    finally:
        await broker.close()
        await proxy.close()


async def test_a_channel_the_broker_closes_is_opened_again_on_the_connection_the_other_consumer_shares(
    infra: Infra,
) -> None:
    """One consumer's channel is closed by the broker (here a 404 on it; in life an unknown
    delivery tag or the consumer timeout): that consumer opens its channel again on the same
    connection, and the other consumer's channel, on that connection, is never cut (a
    channel-only close reset the shared connection, under both: found by the review of
    issue 40)."""
    admin = await aio_pika.connect(infra.amqp_url)
    ch = await admin.channel()
    names = [f"broker-connection-test.{uuid.uuid4().hex[:8]}" for _ in range(2)]
    for name in names:
        await ch.declare_queue(name, durable=True)
    broker = BrokerConnection(infra.amqp_url, TEST_TOPOLOGY, name="shared-consumers")
    got: dict[str, list[bytes]] = {name: [] for name in names}

    def handler(name: str) -> Any:
        async def handle(message: Delivery) -> None:
            got[name].append(message.body)

        return handle

    first, second = (Consumer(broker, n, handler(n), prefetch=4, max_backoff=0.5) for n in names)
    tasks = [asyncio.create_task(c.run()) for c in (first, second)]
    try:
        await wait_for(lambda: first.consuming and second.consuming, what="both consuming")
        shared = await broker.connect()
        other_channel = second._channel
        assert first._channel is not None and other_channel is not None
        with pytest.raises(aio_pika.exceptions.ChannelClosed):
            await first._channel.declare_queue(f"no-such-queue-{uuid.uuid4().hex}", passive=True)
        await wait_for(lambda: first.consuming and first._channel is not None and not first._channel.is_closed,
                       what="the first consumer's channel opened again")  # fmt: skip
        assert await broker.connect() is shared and not shared.is_closed
        assert not other_channel.is_closed, "the other consumer's channel was cut"
        for name in names:
            await ch.default_exchange.publish(aio_pika.Message(name.encode()), routing_key=name)
        await wait_for(
            lambda: all(got[n] == [n.encode()] for n in names), what="both consumers handle a message"
        )
    finally:
        for c in (first, second):
            await c.stop(drain_seconds=2)
        for t in tasks:
            t.cancel()
        await broker.close()
        for name in names:
            await ch.queue_delete(name)
        await admin.close()
