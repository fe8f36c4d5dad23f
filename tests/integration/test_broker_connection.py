"""One BrokerConnection shared by several users (the responder's two consumers, a consumer
and its retry publisher, the relay's publisher): after a connection drops, each user
resets what failed under it. A user that notices late must not close the connection
another user has opened since (issue 40, point 4)."""

from __future__ import annotations

import asyncio
import uuid
from urllib.parse import urlsplit

import aio_pika
import pytest

from shared.broker.connection import BrokerConnection
from shared.broker.publisher import ConfirmingPublisher, OutgoingMessage
from tests.conftest import TEST_TOPOLOGY
from tests.integration.test_publisher_failures import via_proxy
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
