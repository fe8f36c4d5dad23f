"""What a message carries from our publisher to our consumer's handlers, on a real broker.

The publisher builds its properties itself and the consumer hands handlers aiormq's
delivery through ``AmqpDelivery`` (both were aio-pika's ``Message`` and
``IncomingMessage``, for CPU: shared/broker/delivery.py). These hold that nothing a
handler or the broker relies on changed: the properties are those aio-pika's ``Message``
gave, and a handler reads the body, message id and headers as published, the broker's
own headers after a requeue and a dead-lettering, and settles the delivery it was given."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import aio_pika
import pytest

from shared.broker.connection import BrokerConnection
from shared.broker.consumer import Batching, Consumer, Reject
from shared.broker.delivery import Delivery
from shared.broker.publisher import ConfirmingPublisher, OutgoingMessage
from tests.conftest import TEST_TOPOLOGY
from tests.support.infra import Infra

pytestmark = [pytest.mark.integration]

EXCHANGE = "deliveries-test.x"
HEADERS: dict[str, Any] = {
    "chatq-attempt": 3,
    "chatq-error": "platform 503",
    "flag": True,
    "nested": {"n": 1},
}


@pytest.fixture
async def queues(infra: Infra) -> AsyncIterator[tuple[str, str]]:
    """A work queue that dead-letters (rejected, or past 2 redeliveries) into a dead one."""
    tag = uuid.uuid4().hex[:8]
    work, dead = f"deliveries-test.work.{tag}", f"deliveries-test.dead.{tag}"
    conn = await aio_pika.connect(infra.amqp_url)
    ch = await conn.channel()
    ex = await ch.declare_exchange(EXCHANGE, aio_pika.ExchangeType.DIRECT, durable=True)
    q = await ch.declare_queue(
        work,
        durable=True,
        arguments={
            "x-queue-type": "quorum",
            "x-delivery-limit": 2,
            "x-dead-letter-exchange": EXCHANGE,
            "x-dead-letter-routing-key": dead,
        },
    )
    d = await ch.declare_queue(dead, durable=True, arguments={"x-queue-type": "quorum"})
    await q.bind(ex, routing_key=work)
    await d.bind(ex, routing_key=dead)
    try:
        yield work, dead
    finally:
        await ch.queue_delete(work)
        await ch.queue_delete(dead)
        await conn.close()


def ours(headers: Any) -> dict[str, Any]:
    """The headers we set (a quorum queue adds its own x- ones)."""
    return {k: v for k, v in (headers or {}).items() if not k.startswith("x-")}


async def publish(infra: Infra, key: str, *messages: tuple[str, bytes]) -> None:
    """Publish through our publisher; every one must be confirmed."""
    broker = BrokerConnection(infra.amqp_url, TEST_TOPOLOGY)
    try:
        results = await ConfirmingPublisher(broker).publish_many(
            [OutgoingMessage(EXCHANGE, key, mid, body, headers=HEADERS) for mid, body in messages]
        )
        assert results == [None] * len(messages)
    finally:
        await broker.close()


async def consume_until(
    infra: Infra, queue: str, handler: Any, done: asyncio.Event, **options: Any
) -> Consumer:
    broker = BrokerConnection(infra.amqp_url, TEST_TOPOLOGY)
    consumer = Consumer(broker, queue, handler, prefetch=16, requeue_pause=0, **options)
    task = asyncio.create_task(consumer.run())
    try:
        await asyncio.wait_for(done.wait(), 30)
    finally:
        await consumer.stop(drain_seconds=5)
        task.cancel()
        await broker.close()
    return consumer


async def test_the_publisher_sends_the_properties_aio_pikas_message_gave(
    infra: Infra, queues: tuple[str, str]
) -> None:
    work, _ = queues
    op = uuid.uuid4()
    await publish(infra, work, ("m-1", b'{"a": 1}'), (op, b"{}"), ("", b"{}"))  # type: ignore[arg-type]
    conn = await aio_pika.connect(infra.amqp_url)
    try:
        q = await (await conn.channel()).get_queue(work)
        got = [await q.get(no_ack=True, timeout=10) for _ in range(3)]
    finally:
        await conn.close()
    for message, (mid, body) in zip(got, [("m-1", b'{"a": 1}'), (op, b"{}"), ("", b"{}")], strict=True):
        assert message is not None and message.body == body
        expected = aio_pika.Message(
            body,
            message_id=mid,  # type: ignore[arg-type]
            headers=HEADERS,
            content_type="application/json",
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
        ).properties
        seen = message.properties
        # Every property as aio-pika's Message sent it (the headers apart: the queue adds its own).
        for name in seen.__slots__:
            if name not in ("headers", "message_id"):
                assert getattr(seen, name) == getattr(expected, name), name
        assert ours(seen.headers) == HEADERS
        if mid:
            assert seen.message_id == str(mid)  # a UUID goes out as its text
        else:
            assert seen.message_id  # none given: aiormq names the publish itself, as before


async def test_a_handler_reads_each_delivery_as_published_and_every_one_is_acked(
    infra: Infra, queues: tuple[str, str]
) -> None:
    work, _ = queues
    sent = [(f"m-{i}", f'{{"n": {i}}}'.encode()) for i in range(40)]
    await publish(infra, work, *sent)
    seen: list[tuple[str | None, bytes, dict[str, Any]]] = []
    done = asyncio.Event()

    async def one(message: Delivery) -> None:
        raise AssertionError("every batch succeeds: nothing is handled alone")

    async def batch(messages: list[Delivery]) -> list[Exception | None]:
        seen.extend((m.message_id, m.body, ours(m.headers)) for m in messages)
        if len(seen) >= len(sent):
            done.set()
        return [None] * len(messages)

    await consume_until(infra, work, one, done, batching=Batching(batch, 16, 0.01))  # type: ignore[arg-type]
    assert seen == [(mid, body, HEADERS) for mid, body in sent]
    conn = await aio_pika.connect(infra.amqp_url)
    try:
        q = await (await conn.channel()).declare_queue(work, passive=True)
        assert q.declaration_result.message_count == 0  # every one acked
    finally:
        await conn.close()


async def test_a_handler_sees_the_brokers_delivery_count_and_a_poison_message_is_dead_lettered_alone(
    infra: Infra, queues: tuple[str, str]
) -> None:
    work, dead = queues
    await publish(infra, work, ("poison", b"{}"), ("bad", b"{}"))
    counts: list[tuple[str | None, int]] = []
    done = asyncio.Event()

    async def handle(message: Delivery) -> None:
        counts.append((message.message_id, int(message.headers.get("x-delivery-count", 0))))
        if message.message_id == "bad":
            raise Reject("not ours")
        if len(counts) >= 4:
            done.set()
        raise RuntimeError("a bug: requeued until the delivery limit")

    await consume_until(infra, work, handle, done, delivery_limit=2)  # the queue's own limit
    # The poison message came back with the broker's count each time; the rejected one once.
    assert [c for m, c in counts if m == "poison"][:3] == [0, 1, 2]
    assert [m for m, _ in counts].count("bad") == 1
    dead_letters: list[tuple[str | None, str | None]] = []
    conn = await aio_pika.connect(infra.amqp_url)
    try:
        q = await (await conn.channel()).get_queue(dead)
        for _ in range(50):
            got = await q.get(no_ack=True, fail=False)
            if got is None:
                if len(dead_letters) == 2:
                    break
                await asyncio.sleep(0.1)
                continue
            deaths = got.headers.get("x-death") or [{}]
            dead_letters.append((got.message_id, str(deaths[0].get("reason"))))  # type: ignore[union-attr,index]
    finally:
        await conn.close()
    assert sorted(dead_letters) == [("bad", "rejected"), ("poison", "rejected")]


async def test_a_handler_that_settles_its_own_delivery_leaves_the_others_on_the_channel_alone(
    infra: Infra, queues: tuple[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    """A delivery is settled once: the wrapper's ack after a handler's own is refused, not
    sent (a second ack of a tag makes the broker close the channel and redeliver every
    delivery outstanding on it)."""
    work, _ = queues
    await publish(infra, work, *[(f"m-{i}", b"{}") for i in range(5)])
    handled: list[str | None] = []
    release, done = asyncio.Event(), asyncio.Event()

    async def handle(message: Delivery) -> None:
        handled.append(message.message_id)
        if message.message_id == "m-0":
            await message.ack()  # settles itself, while its neighbours are in flight
            release.set()
            return
        await release.wait()
        if len(handled) >= 5:
            done.set()

    consumer = await consume_until(infra, work, handle, done)
    assert sorted(handled) == [f"m-{i}" for i in range(5)]  # each once: nothing redelivered
    assert "settled already" in caplog.text
    assert "reconnecting" not in caplog.text
    assert consumer.messages_acked >= 4
