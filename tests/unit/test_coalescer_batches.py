"""The coalescer filing in batches, through the one consumer wrapper, on the in-memory store
(stores/windows/fake.py) and deliveries that record how they were settled: a batch of
several chats in one transaction and one ack, a poison message failing alone, redeliveries
filing nothing twice, and how the consumer gathers deliveries into batches. The same
against Postgres and RabbitMQ: tests/integration/test_coalescer.py."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import pytest

from services.coalescer.app import inbound_consumer
from services.coalescer.service import Coalescer
from shared.broker.consumer import BatchHandler, Batching, Consumer
from shared.broker.topology import build_topology
from shared.messages import InboundMessage
from shared.settings import Settings
from shared.state.operation import OperationStatus
from stores.windows.fake import InMemoryWindows
from stores.windows.window import WindowPolicy

pytestmark = pytest.mark.unit

POLICY = WindowPolicy(quiet=2, delay_min=5, delay_max=5, max_wait=8)
CHANNEL = object()  # the channel the deliveries came on
DELIVERY_LIMIT = 10


class Delivery:
    """Stands for an incoming message on one channel: records how it was settled."""

    def __init__(self, body: bytes, message_id: str, tag: int, *, deliveries: int = 0) -> None:
        self.body = body
        self.message_id = message_id
        self.delivery_tag = tag
        self.channel = CHANNEL
        self.headers: dict[str, Any] = {"x-delivery-count": deliveries} if deliveries else {}
        self.settled: list[str] = []

    async def ack(self, multiple: bool = False) -> None:
        self.settled.append("ack multiple" if multiple else "ack")

    async def nack(self, requeue: bool = True) -> None:
        self.settled.append("requeue" if requeue else "nack")

    async def reject(self, requeue: bool = False) -> None:
        self.settled.append("requeue" if requeue else "dead-letter")


def deliveries(
    messages: Sequence[InboundMessage], *, first_tag: int = 1, deliveries: int = 0
) -> list[Delivery]:
    return [
        Delivery(m.to_bytes(), str(m.operation_id), first_tag + i, deliveries=deliveries)
        for i, m in enumerate(messages)
    ]


def consumer(coalescer: Coalescer, handler: BatchHandler | None = None) -> Consumer:
    return Consumer(
        None,  # type: ignore[arg-type]  # settling a delivery never touches the connection
        "chatq.coalescer",
        coalescer.handle,
        prefetch=128,
        on_give_up=coalescer.give_up,
        delivery_limit=DELIVERY_LIMIT,
        requeue_pause=0,
        batching=Batching(handler or coalescer.handle_batch, size=64, wait=0.002),
    )


@pytest.fixture
def store() -> InMemoryWindows:
    return InMemoryWindows()


@pytest.fixture
def coalescer(store: InMemoryWindows) -> Coalescer:
    return Coalescer(store, POLICY, draw=lambda: 0.0)


async def test_a_batch_of_messages_from_several_chats_is_filed_in_one_transaction_and_acked_with_one_ack(
    store: InMemoryWindows, coalescer: Coalescer
) -> None:
    a1, b1, a2, c1 = (
        store.receive(chat, text) for chat, text in [("a", "1"), ("b", "1"), ("a", "2"), ("c", "1")]
    )
    store.advance(4)
    a3 = store.receive("a", "3")
    batch = deliveries([a1, b1, a2, c1, a3])
    await consumer(coalescer).handle_batch(batch)  # type: ignore[arg-type]
    assert store.committed_filings == [5]
    assert [d.settled for d in batch] == [[], [], [], [], ["ack multiple"]]
    # The chat's three messages fold into one window, in delivery order: it opened with
    # the first, and the third, 4 s later, pushed it out to quiet seconds after itself.
    window = store.open_window(a1.chat_key)
    assert window is not None and window.window.message_count == 3
    assert window.window.first_at == a1.received_at and window.window.last_at == a3.received_at
    assert window.window.due_at == a3.received_at + timedelta(seconds=POLICY.quiet)
    assert {store.state.filed[m.operation_id] for m in (a1, a2, a3)} == {window.id}
    assert all(store.open_window(m.chat_key).window.message_count == 1 for m in (b1, c1))  # type: ignore[union-attr]
    assert all(store.operation(m).status == OperationStatus.WAITING for m in (a1, b1, a2, c1, a3))


async def test_a_poison_message_in_a_batch_is_dead_lettered_alone_and_the_others_are_filed(
    store: InMemoryWindows, coalescer: Coalescer
) -> None:
    good = [store.receive("a", "1"), store.receive("b", "1"), store.receive("a", "2")]
    # Postgres stores no NUL: filing this message fails with a data error, and so its batch.
    poison = store.receive("c\x00", "x")
    batch = deliveries([good[0], poison, good[1], good[2]], deliveries=DELIVERY_LIMIT)
    await consumer(coalescer).handle_batch(batch)  # type: ignore[arg-type]
    # Each message again alone: the good ones filed and acked one by one, in the chats'
    # order; the poison one, on the last delivery its queue allows, given up on (its
    # operation fails, with the reason, for a person) and dead-lettered.
    assert [d.settled for d in batch] == [["ack"], ["dead-letter"], ["ack"], ["ack"]]
    assert sorted(store.committed_filings) == [1, 1, 1]
    assert all(store.operation(m).status == OperationStatus.WAITING for m in good)
    assert store.open_window(good[0].chat_key).window.message_count == 2  # type: ignore[union-attr]
    failed = store.operation(poison)
    assert failed.status == OperationStatus.FAILED
    assert failed.reason and "CharacterNotInRepertoireError" in failed.reason


async def test_a_poison_message_before_its_last_delivery_is_requeued_alone(
    store: InMemoryWindows, coalescer: Coalescer
) -> None:
    good, poison = store.receive("a"), store.receive("c\x00")
    batch = deliveries([poison, good])
    await consumer(coalescer).handle_batch(batch)  # type: ignore[arg-type]
    assert [d.settled for d in batch] == [["requeue"], ["ack"]]
    assert store.operation(poison).status == OperationStatus.QUEUED
    assert store.operation(good).status == OperationStatus.WAITING


async def test_a_message_not_ours_or_not_in_the_inbox_is_dead_lettered_and_the_rest_of_its_batch_filed_together(
    store: InMemoryWindows, coalescer: Coalescer
) -> None:
    a, b = store.receive("a"), store.receive("b")
    stranger = InMemoryWindows().receive("s")  # in another inbox
    batch = [
        Delivery(b'{"schema": "nope"}', "bad-1", 1),
        *deliveries([a, stranger, b], first_tag=2),
    ]
    await consumer(coalescer).handle_batch(batch)  # type: ignore[arg-type]
    assert [d.settled for d in batch] == [["dead-letter"], ["ack"], ["dead-letter"], ["ack"]]
    assert store.committed_filings == [2]


async def test_a_redelivered_batch_files_nothing_twice(store: InMemoryWindows, coalescer: Coalescer) -> None:
    messages = [store.receive("a", "1"), store.receive("b", "1"), store.receive("a", "2")]
    # The relay publishes at least once: the same message twice in one batch files once.
    first = deliveries([*messages, messages[1]])
    await consumer(coalescer).handle_batch(first)  # type: ignore[arg-type]
    again = deliveries(messages, first_tag=10)
    await consumer(coalescer).handle_batch(again)  # type: ignore[arg-type]
    assert store.committed_filings == [3]
    assert all(store.events(m) == ["filed"] for m in messages)
    assert store.open_window(messages[0].chat_key).window.message_count == 2  # type: ignore[union-attr]
    assert first[-1].settled == ["ack multiple"] and again[-1].settled == ["ack multiple"]


async def test_a_batch_whose_database_is_away_is_filed_again_whole_once_it_is_back(
    store: InMemoryWindows, coalescer: Coalescer
) -> None:
    messages = [store.receive("a"), store.receive("b")]
    calls = 0

    async def database_away_once(batch: Sequence[Any]) -> Sequence[Exception | None]:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise ConnectionRefusedError("Postgres is restarting")
        return await coalescer.handle_batch(batch)

    batch = deliveries(messages)
    await consumer(coalescer, database_away_once).handle_batch(batch)  # type: ignore[arg-type]
    assert calls == 2 and store.committed_filings == [2]
    assert [d.settled for d in batch] == [[], ["ack multiple"]]


async def wait_until(condition: Any, what: str, within: float = 5.0) -> None:
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.001)


class Recorder:
    """A batch handler that records each batch it is handed (by message id) and, until
    ``release`` is set, holds it."""

    def __init__(self) -> None:
        self.handed: list[list[str]] = []
        self.release = asyncio.Event()
        self.release.set()

    async def __call__(self, batch: Sequence[Any]) -> list[Exception | None]:
        self.handed.append([m.message_id for m in batch])
        await self.release.wait()
        return [None] * len(batch)

    def consumer(self, *, size: int, wait: float) -> Consumer:
        return Consumer(None, "q", self, prefetch=10, batching=Batching(self, size=size, wait=wait))  # type: ignore[arg-type]


async def test_the_consumer_gathers_deliveries_into_batches_of_at_most_the_size_one_at_a_time_in_order() -> (
    None
):
    handler = Recorder()
    handler.release.clear()
    c = handler.consumer(size=3, wait=60)
    sent = [Delivery(b"{}", str(i), i) for i in range(1, 8)]
    for d in sent[:4]:
        await c._on_message(d)  # type: ignore[arg-type]
    # Three make a batch at once; the fourth waits while it is in hand.
    await wait_until(lambda: handler.handed == [["1", "2", "3"]], "the first batch")
    for d in sent[4:]:
        await c._on_message(d)  # type: ignore[arg-type]
    assert c.oldest_unsettled_seconds() > 0
    handler.release.set()
    # When a batch ends, what arrived meanwhile goes at once, in order, at most three.
    await wait_until(lambda: c.oldest_unsettled_seconds() == 0, "every batch settled")
    assert handler.handed == [["1", "2", "3"], ["4", "5", "6"], ["7"]]
    assert [d.settled for d in sent] == [[], [], ["ack multiple"], [], [], ["ack multiple"], ["ack multiple"]]


async def test_a_lone_delivery_waits_the_gathering_time_for_others_to_join_it() -> None:
    handler = Recorder()
    c = handler.consumer(size=64, wait=0.05)
    await c._on_message(Delivery(b"{}", "1", 1))  # type: ignore[arg-type]
    await asyncio.sleep(0)
    assert handler.handed == []
    await c._on_message(Delivery(b"{}", "2", 2))  # type: ignore[arg-type]
    await wait_until(lambda: handler.handed, "the batch")
    assert handler.handed == [["1", "2"]]


async def test_stopping_hands_what_was_gathered_to_the_handler_before_closing() -> None:
    handler = Recorder()
    c = handler.consumer(size=64, wait=60)
    d = Delivery(b"{}", "1", 1)
    await c._on_message(d)  # type: ignore[arg-type]
    await c.stop(drain_seconds=5)
    assert handler.handed == [["1"]] and d.settled == ["ack multiple"]


async def test_a_batch_size_of_one_files_and_acks_each_message_alone(
    store: InMemoryWindows, coalescer: Coalescer
) -> None:
    settings = Settings(_env_file=None, coalescer_file_batch_messages=1)  # type: ignore[call-arg]
    c = inbound_consumer(None, coalescer, settings, build_topology())  # type: ignore[arg-type]
    sent = deliveries([store.receive("a", "1"), store.receive("a", "2")])
    for d in sent:
        await c._on_message(d)  # type: ignore[arg-type]
    await wait_until(lambda: c.oldest_unsettled_seconds() == 0 and all(d.settled for d in sent), "both acked")
    assert [d.settled for d in sent] == [["ack"], ["ack"]]
    assert store.committed_filings == [1, 1]
