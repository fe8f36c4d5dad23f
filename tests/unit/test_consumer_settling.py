"""Each outcome's settle step, on a message that records what was done to it: no broker,
milliseconds. The integration tests prove the same against RabbitMQ."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from shared.broker.consumer import Consumer, Reject, RetryLater, RetryTiers
from shared.broker.publisher import OutgoingMessage

pytestmark = pytest.mark.unit


class Delivery:
    """Stands for an incoming message: records its settlement."""

    def __init__(self, headers: dict[str, Any] | None = None) -> None:
        self.message_id = "m-1"
        self.body = b"{}"
        self.headers = headers or {}
        self.settled: list[str] = []

    async def ack(self) -> None:
        self.settled.append("ack")

    async def nack(self, requeue: bool = True) -> None:
        self.settled.append("requeue" if requeue else "nack")

    async def reject(self, requeue: bool = False) -> None:
        self.settled.append("requeue" if requeue else "dead-letter")


class Publisher:
    def __init__(self, failures: int = 0) -> None:
        self.failures = failures
        self.published: list[OutgoingMessage] = []
        self.resets = 0

    async def publish(self, message: OutgoingMessage) -> None:
        if self.failures:
            self.failures -= 1
            raise ConnectionRefusedError("broker away")
        self.published.append(message)

    async def reset(self) -> None:
        self.resets += 1


class Hooks:
    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    async def give_up(self, _message: Any, kind: str, reason: str) -> None:
        self.calls.append(("give_up", kind, reason))

    async def retried(self, _message: Any, attempt: int, delay: float, reason: str) -> None:
        self.calls.append(("retry", attempt, delay, reason))


def consumer(
    handler: Any,
    hooks: Hooks,
    *,
    publisher: Publisher | None = None,
    delivery_limit: int | None = None,
    acks_together: bool = False,
) -> Consumer:
    retry = RetryTiers(publisher, (1, 10), max_attempts=3) if publisher is not None else None  # type: ignore[arg-type]
    return Consumer(
        None,  # type: ignore[arg-type]  # settling a delivery never touches the connection
        "q",
        handler,
        prefetch=1,
        retry=retry,
        on_give_up=hooks.give_up,
        on_retry=hooks.retried,
        delivery_limit=delivery_limit,
        requeue_pause=0,
        acks_together=acks_together,
    )


def raising(*errors: Exception | None) -> Any:
    """A handler that raises each error in turn (None: returns)."""
    queue = list(errors)

    async def handler(_message: Any) -> None:
        error = queue.pop(0)
        if error is not None:
            raise error

    return handler


async def test_a_handler_that_returns_gets_its_message_acked() -> None:
    hooks, message = Hooks(), Delivery()
    await consumer(raising(None), hooks).handle_delivery(message)  # type: ignore[arg-type]
    assert message.settled == ["ack"] and hooks.calls == []


async def test_a_rejected_message_is_given_up_on_then_dead_lettered() -> None:
    hooks, message = Hooks(), Delivery()
    await consumer(raising(Reject("not our schema")), hooks).handle_delivery(message)  # type: ignore[arg-type]
    assert hooks.calls == [("give_up", "permanent", "not our schema")]
    assert message.settled == ["dead-letter"]


async def test_retry_later_publishes_the_next_attempt_to_its_tier_records_it_then_acks() -> None:
    hooks, message, publisher = Hooks(), Delivery({"chatq-attempt": 1, "x-death": []}), Publisher()
    handler = raising(RetryLater("platform 503"))
    await consumer(handler, hooks, publisher=publisher).handle_delivery(message)  # type: ignore[arg-type]
    (out,) = publisher.published
    assert out.routing_key == "1s"
    assert out.headers["chatq-attempt"] == 2 and "x-death" not in out.headers
    assert hooks.calls == [("retry", 2, 1, "platform 503")]
    assert message.settled == ["ack"]


async def test_a_retry_tier_that_refuses_the_publish_is_reset_and_tried_again_before_the_ack() -> None:
    hooks, message, publisher = Hooks(), Delivery(), Publisher(failures=1)
    handler = raising(RetryLater("platform 503"))
    await consumer(handler, hooks, publisher=publisher).handle_delivery(message)  # type: ignore[arg-type]
    assert publisher.resets == 1 and len(publisher.published) == 1
    assert message.settled == ["ack"]


async def test_retry_later_on_the_last_attempt_gives_up_as_exhausted_and_dead_letters() -> None:
    hooks, message, publisher = Hooks(), Delivery({"chatq-attempt": 3}), Publisher()
    handler = raising(RetryLater("platform 503"))
    await consumer(handler, hooks, publisher=publisher).handle_delivery(message)  # type: ignore[arg-type]
    assert publisher.published == []
    assert hooks.calls == [("give_up", "exhausted", "gave up after 3 attempts: platform 503")]
    assert message.settled == ["dead-letter"]


async def test_an_infrastructure_error_runs_the_handler_again_and_settles_only_once_it_works() -> None:
    hooks, message = Hooks(), Delivery()
    await consumer(raising(ConnectionRefusedError(), None), hooks).handle_delivery(message)  # type: ignore[arg-type]
    assert message.settled == ["ack"]


async def test_each_run_again_after_an_infrastructure_error_is_counted_by_queue_and_error() -> None:
    """chatq_in_process_retries_total: a Postgres outage shows as retries in the process,
    not as nothing (the message is held, neither failed nor retried through a tier)."""
    import asyncpg

    from shared.metrics import IN_PROCESS_RETRIES

    def count(error: str) -> float:
        return IN_PROCESS_RETRIES.labels(where="q", error=error)._value.get()

    before = count("ConnectionDoesNotExistError"), count("ConnectionRefusedError")
    lost = asyncpg.exceptions.ConnectionDoesNotExistError("connection was closed in the middle of operation")
    handler = raising(lost, ConnectionRefusedError(), lost, None)
    hooks, message = Hooks(), Delivery()
    await consumer(handler, hooks).handle_delivery(message)  # type: ignore[arg-type]
    assert message.settled == ["ack"]
    assert (count("ConnectionDoesNotExistError"), count("ConnectionRefusedError")) == (
        before[0] + 2,
        before[1] + 1,
    )


async def test_an_infrastructure_error_while_stopping_requeues_the_message() -> None:
    hooks, message = Hooks(), Delivery()
    c = consumer(raising(ConnectionRefusedError()), hooks)
    await c.stop(drain_seconds=0)
    await asyncio.wait_for(c.handle_delivery(message), timeout=2)  # type: ignore[arg-type]
    assert message.settled == ["requeue"] and hooks.calls == []


async def test_an_unexpected_error_requeues_the_message_for_another_delivery() -> None:
    hooks, message = Hooks(), Delivery({"x-delivery-count": 1})
    c = consumer(raising(ValueError("bug")), hooks, delivery_limit=5)
    await c.handle_delivery(message)  # type: ignore[arg-type]
    assert message.settled == ["requeue"] and hooks.calls == []


async def test_an_unexpected_error_on_the_last_delivery_the_queue_allows_is_given_up_on_and_dead_lettered() -> (
    None
):
    hooks, message = Hooks(), Delivery({"x-delivery-count": 5})
    c = consumer(raising(ValueError("bug")), hooks, delivery_limit=5)
    await c.handle_delivery(message)  # type: ignore[arg-type]
    assert hooks.calls == [("give_up", "exhausted", "failed on each of 6 deliveries: ValueError: bug")]
    assert message.settled == ["dead-letter"]


class Channel:
    """Stands for a consumer's channel: records each settlement with its delivery tag, as the
    broker sees it (``multiple`` settles every outstanding tag up to this one)."""

    def __init__(self) -> None:
        self.frames: list[tuple[str, int, bool]] = []


class Tagged(Delivery):
    def __init__(self, channel: Channel, tag: int) -> None:
        super().__init__()
        self.message_id = f"m-{tag}"
        self.channel = channel
        self.delivery_tag = tag

    async def ack(self, multiple: bool = False) -> None:
        self.channel.frames.append(("ack", self.delivery_tag, multiple))

    async def reject(self, requeue: bool = False) -> None:
        self.channel.frames.append(("dead-letter", self.delivery_tag, False))


async def deliver(c: Consumer, messages: list[Tagged]) -> None:
    for m in messages:
        await c._on_message(m)  # type: ignore[arg-type]  # as the channel calls it


async def until(condition: Any, *, within: float = 2.0) -> None:
    """Wait for ``condition()`` to hold, at most ``within`` seconds."""
    for _ in range(int(within / 0.001)):
        if condition():
            return
        await asyncio.sleep(0.001)
    assert condition()


async def settled(c: Consumer) -> None:
    await until(lambda: c.oldest_unsettled_seconds() == 0)


async def test_messages_handled_in_the_same_turn_are_acked_with_one_multiple_ack() -> None:
    channel = Channel()
    c = consumer(raising(None, None, None), Hooks(), acks_together=True)
    await deliver(c, [Tagged(channel, t) for t in (1, 2, 3)])
    await settled(c)
    assert channel.frames == [("ack", 3, True)]
    assert (c.acks_sent, c.messages_acked) == (1, 3)


async def test_an_ack_never_reaches_past_a_message_still_being_handled() -> None:
    channel, slow = Channel(), asyncio.Event()

    async def handler(message: Any) -> None:
        if message.delivery_tag == 1:
            await slow.wait()

    c = consumer(handler, Hooks(), acks_together=True)
    await deliver(c, [Tagged(channel, t) for t in (1, 2, 3)])
    await until(lambda: len(channel.frames) >= 2)
    assert channel.frames == [("ack", 2, False), ("ack", 3, False)]  # 1 is still being handled
    slow.set()
    await settled(c)
    assert channel.frames[2:] == [("ack", 1, False)]


async def test_a_dead_lettered_message_among_acked_ones_is_settled_on_its_own() -> None:
    channel = Channel()
    c = consumer(raising(None, Reject("poison"), None), Hooks(), acks_together=True)
    await deliver(c, [Tagged(channel, t) for t in (1, 2, 3)])
    await settled(c)
    assert ("dead-letter", 2, False) in channel.frames
    acked = {
        t
        for kind, tag, multiple in channel.frames
        if kind == "ack"
        for t in (range(1, tag + 1) if multiple else [tag])
    }
    # Every other message acked, and no ack with multiple covers the dead-lettered one before its reject.
    assert {1, 3} <= acked
    reject_at = channel.frames.index(("dead-letter", 2, False))
    assert not any(
        kind == "ack" and multiple and tag >= 2 for kind, tag, multiple in channel.frames[:reject_at]
    )


async def test_without_acks_together_each_delivery_is_acked_alone() -> None:
    channel = Channel()
    c = consumer(raising(None, None), Hooks())
    await deliver(c, [Tagged(channel, t) for t in (1, 2)])
    await settled(c)
    assert sorted(channel.frames) == [("ack", 1, False), ("ack", 2, False)]
