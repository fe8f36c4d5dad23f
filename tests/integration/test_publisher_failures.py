"""publish_many on aiormq's channel with ``wait=False``: a result is None only for a message
the broker confirmed, each error stands at its own message's index, the queue holds the
messages in the order given, and a connection cut, a channel closed by the broker or a
confirm timeout mid-batch never reports as confirmed a message that is not in the queue.

(Written by a review that tried to break the change; the relay marks a row published only
on None, so a false None is a lost message.)"""

from __future__ import annotations

import asyncio
import random
import uuid
from urllib.parse import urlsplit, urlunsplit

import aio_pika
import aiormq
import pytest
from aio_pika.abc import AbstractConnection

from shared.broker.connection import BrokerConnection
from shared.broker.publisher import ConfirmingPublisher, OutgoingMessage
from tests.conftest import TEST_TOPOLOGY
from tests.support.infra import Infra
from tests.support.tcpproxy import TcpProxy

pytestmark = [pytest.mark.integration]

EXCHANGE = "publisher-test.x"


def via_proxy(amqp_url: str, port: int) -> str:
    parts = urlsplit(amqp_url)
    return urlunsplit(
        (parts.scheme, f"{parts.username}:{parts.password}@127.0.0.1:{port}", parts.path, "", "")
    )


async def declare(url: str) -> tuple[AbstractConnection, str, str]:
    """A direct exchange with a queue bound at ``ok.<tag>`` and one capped at 5 messages that
    rejects the rest (the broker nacks them) at ``cap.<tag>``; returns the connection, the
    two queues' names."""
    conn = await aio_pika.connect(url)
    ch = await conn.channel()
    ex = await ch.declare_exchange(EXCHANGE, aio_pika.ExchangeType.DIRECT, durable=True)
    tag = uuid.uuid4().hex[:8]
    ok = await ch.declare_queue(f"publisher-test.ok.{tag}", durable=True)
    cap = await ch.declare_queue(
        f"publisher-test.cap.{tag}",
        durable=True,
        arguments={"x-max-length": 5, "x-overflow": "reject-publish"},
    )
    await ok.bind(ex, routing_key=f"ok.{tag}")
    await cap.bind(ex, routing_key=f"cap.{tag}")
    await ch.close()
    return conn, ok.name, cap.name


async def drain(conn: AbstractConnection, queue: str) -> list[str]:
    """The message ids in ``queue``, in its order; the queue is deleted."""
    ch = await conn.channel()
    q = await ch.declare_queue(queue, passive=True)
    out = []
    while (m := await q.get(no_ack=True, fail=False)) is not None:
        assert m.message_id is not None
        out.append(m.message_id)
    await q.delete(if_unused=False, if_empty=False)
    await ch.close()
    return out


def in_order_given(messages: list[OutgoingMessage], arrived: list[str]) -> bool:
    place = {m.message_id: i for i, m in enumerate(messages)}
    return [place[a] for a in arrived] == sorted(place[a] for a in arrived)


async def test_each_result_is_its_own_messages_confirm_nack_or_return_and_the_queue_keeps_the_order_given(
    infra: Infra,
) -> None:
    conn, okq, capq = await declare(infra.amqp_url)
    tag = okq.rsplit(".", 1)[1]
    broker = BrokerConnection(infra.amqp_url, TEST_TOPOLOGY)
    publisher = ConfirmingPublisher(broker)
    try:
        rnd = random.Random(7)
        kinds = [rnd.choice(["ok", "nowhere", "cap"]) for _ in range(400)]
        messages = [
            OutgoingMessage(EXCHANGE, f"{k}.{tag}", f"m{i}", b"x" * rnd.randint(0, 200_000), headers={"i": i})
            for i, k in enumerate(kinds)
        ]
        results = await publisher.publish_many(messages)
        capped = 0
        for i, (kind, result) in enumerate(zip(kinds, results, strict=True)):
            if kind == "ok":
                assert result is None, (i, result)
            elif kind == "nowhere":
                assert isinstance(result, aiormq.exceptions.PublishError), (i, result)
            else:
                if capped < 5:
                    assert result is None, (i, result)
                else:
                    assert isinstance(result, aiormq.exceptions.DeliveryError), (i, result)
                capped += 1
        assert await drain(conn, okq) == [
            m.message_id for m, k in zip(messages, kinds, strict=True) if k == "ok"
        ]
        assert (
            await drain(conn, capq)
            == [m.message_id for m, k in zip(messages, kinds, strict=True) if k == "cap"][:5]
        )
    finally:
        await publisher.reset()
        await broker.close()
        await conn.close()


@pytest.mark.parametrize("settled", [0, 5, 300, 1490])
async def test_a_connection_cut_mid_batch_reports_confirmed_only_what_is_in_the_queue(
    infra: Infra, settled: int
) -> None:
    conn, okq, _ = await declare(infra.amqp_url)
    tag = okq.rsplit(".", 1)[1]
    proxy = await TcpProxy("127.0.0.1", urlsplit(infra.amqp_url).port or 5672).start()
    broker = BrokerConnection(via_proxy(infra.amqp_url, proxy.port), TEST_TOPOLOGY)
    publisher = ConfirmingPublisher(broker, confirm_timeout=10)
    try:
        await publisher.ensure_ready()
        messages = [OutgoingMessage(EXCHANGE, f"ok.{tag}", f"c{i}", b"y" * 20_000) for i in range(1500)]
        task = asyncio.ensure_future(publisher.publish_many(messages))
        # Cut once about ``settled`` publishes have been confirmed or returned.
        channel = await publisher._ensure_channel()
        underlay = await channel.get_underlay_channel()
        assert isinstance(underlay, aiormq.Channel)
        # Polled each turn of the loop: the point is a count inside aiormq, with no event.
        while not task.done() and underlay.delivery_tag - len(underlay.confirmations) < settled:  # noqa: ASYNC110
            await asyncio.sleep(0)
        proxy.block()
        results = await asyncio.wait_for(task, 20)
        confirmed = {m.message_id for m, r in zip(messages, results, strict=True) if r is None}
        arrived = await drain(conn, okq)
        assert confirmed <= set(arrived), sorted(confirmed - set(arrived))[:5]
        assert in_order_given(messages, arrived)
    finally:
        await publisher.reset()
        await broker.close()
        await proxy.close()
        await conn.close()


async def test_a_channel_the_broker_closes_mid_batch_fails_every_publish_after_it_and_a_reset_recovers(
    infra: Infra,
) -> None:
    conn, okq, _ = await declare(infra.amqp_url)
    tag = okq.rsplit(".", 1)[1]
    broker = BrokerConnection(infra.amqp_url, TEST_TOPOLOGY)
    publisher = ConfirmingPublisher(broker)
    try:
        messages = [OutgoingMessage(EXCHANGE, f"ok.{tag}", f"d{i}", b"z" * 1000) for i in range(300)]
        messages[150] = OutgoingMessage("publisher-test.no-such-exchange", "k", "bad", b"")
        results = await publisher.publish_many(messages)
        confirmed = {m.message_id for m, r in zip(messages, results, strict=True) if r is None}
        assert all(isinstance(r, BaseException) for r in results[150:])
        # The relay resets after any error; the next batch goes through.
        await publisher.reset()
        assert await publisher.publish_many([OutgoingMessage(EXCHANGE, f"ok.{tag}", "after", b"")]) == [None]
        arrived = await drain(conn, okq)
        assert confirmed | {"after"} <= set(arrived)
        assert in_order_given([*messages, OutgoingMessage(EXCHANGE, "", "after", b"")], arrived)
    finally:
        await publisher.reset()
        await broker.close()
        await conn.close()


@pytest.mark.parametrize("confirm_timeout", [0.001, 0.1])
async def test_a_confirm_timeout_mid_batch_reports_confirmed_only_what_is_in_the_queue(
    infra: Infra, confirm_timeout: float
) -> None:
    conn, okq, _ = await declare(infra.amqp_url)
    tag = okq.rsplit(".", 1)[1]
    broker = BrokerConnection(infra.amqp_url, TEST_TOPOLOGY)
    publisher = ConfirmingPublisher(broker, confirm_timeout=confirm_timeout)
    try:
        await publisher.ensure_ready()
        messages = [OutgoingMessage(EXCHANGE, f"ok.{tag}", f"t{i}", b"w" * 50_000) for i in range(800)]
        results = await publisher.publish_many(messages)
        confirmed = {m.message_id for m, r in zip(messages, results, strict=True) if r is None}
        assert any(r is not None for r in results) or confirm_timeout > 0.01, (
            "a 1 ms confirm timeout timed nothing out"
        )
        arrived = await drain(conn, okq)
        assert confirmed <= set(arrived)
        assert in_order_given(messages, arrived)
    finally:
        await publisher.reset()
        await broker.close()
        await conn.close()
