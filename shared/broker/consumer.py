"""The one consumer wrapper. Handlers process a message and raise to signal; they never
ack. This module alone decides what each outcome means for the message:

=====================================  ==============================================
handler outcome                         what happens to the message
=====================================  ==============================================
returns                                 ack
raises ``Reject``                       ``on_give_up``, then nack without requeue: the
                                        queue's DLX moves it to ``chatq.*.dead``
raises ``RetryLater``                   a confirmed publish to the retry tier for the
                                        next attempt (header ``chatq-attempt``), then
                                        ack; when attempts are exhausted, ``on_give_up``
                                        then dead-letter
infrastructure error (Postgres or       kept unacked and retried in-process with
network down, serialization failure)    backoff until it works or the process stops;
                                        a stopping process requeues it
anything else (a bug, a poison input)   nack with requeue after a pause; the quorum
                                        queue's delivery-limit dead-letters a message
                                        that keeps failing
=====================================  ==============================================
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import aiormq
import asyncpg
from aio_pika.abc import AbstractChannel, AbstractIncomingMessage
from aio_pika.exceptions import DeliveryError

from shared.broker.connection import BrokerConnection
from shared.broker.publisher import ConfirmingPublisher, OutgoingMessage
from shared.broker.topology import RETRY_EXCHANGE, retry_tier_name
from shared.metrics import RETRIES
from shared.retry import ATTEMPT_HEADER, ERROR_HEADER, attempt_of, next_retry

logger = logging.getLogger(__name__)


class Reject(Exception):
    """This message can never succeed: dead-letter it, with this reason logged."""


class RetryLater(Exception):
    """Try this message again later, through the consumer's retry tiers. ``kind`` labels
    the retry in metrics (no ids); ``retry_after`` is a wait the platform asked for."""

    def __init__(self, reason: str, *, kind: str = "transient", retry_after: float | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.kind = kind
        self.retry_after = retry_after


@dataclass(frozen=True)
class RetryTiers:
    """Where RetryLater sends a message: the topology's TTL tiers, via confirmed publish."""

    publisher: ConfirmingPublisher
    tiers: Sequence[float]
    max_attempts: int


class Outcome(enum.Enum):
    ACK = "ack"
    DEAD_LETTER = "dead_letter"
    RETRY_TIER = "retry_tier"
    RETRY_IN_PROCESS = "retry_in_process"
    REQUEUE = "requeue"


_TRANSIENT_SQLSTATE_CLASSES = ("08", "53", "57", "40")  # connection, resources, shutdown, tx rollback


def classify(exc: BaseException | None) -> Outcome:
    """Map a handler's outcome to what happens to its message. Pure; unit-tested."""
    if exc is None:
        return Outcome.ACK
    if isinstance(exc, Reject):
        return Outcome.DEAD_LETTER
    if isinstance(exc, RetryLater):
        return Outcome.RETRY_TIER
    if isinstance(exc, asyncpg.PostgresError):
        sqlstate = getattr(exc, "sqlstate", None) or ""
        if sqlstate[:2] in _TRANSIENT_SQLSTATE_CLASSES:
            return Outcome.RETRY_IN_PROCESS
        return Outcome.REQUEUE
    if isinstance(
        exc,
        OSError | TimeoutError | asyncpg.InterfaceError | asyncpg.exceptions.ConnectionDoesNotExistError,
    ):
        return Outcome.RETRY_IN_PROCESS
    return Outcome.REQUEUE


Handler = Callable[[AbstractIncomingMessage], Awaitable[None]]
#: Called before a message is dead-lettered: (message, "permanent" | "exhausted", reason).
GiveUpHook = Callable[[AbstractIncomingMessage, str, str], Awaitable[None]]


class Consumer:
    def __init__(
        self,
        broker: BrokerConnection,
        queue: str,
        handler: Handler,
        *,
        prefetch: int,
        retry: RetryTiers | None = None,
        on_give_up: GiveUpHook | None = None,
        requeue_pause: float = 1.0,
        max_backoff: float = 5.0,
    ) -> None:
        self._broker = broker
        self._queue = queue
        self._handler = handler
        self._prefetch = prefetch
        self._retry = retry
        self._on_give_up = on_give_up
        self._requeue_pause = requeue_pause
        self._max_backoff = max_backoff
        self._stopping = asyncio.Event()
        self._in_flight: set[asyncio.Task[None]] = set()
        self._channel: AbstractChannel | None = None
        self._consumer_tag: str | None = None
        self.consuming = False

    async def run(self) -> None:
        """Consume until ``stop``; reconnect after broker outages."""
        backoff = 0.2
        while not self._stopping.is_set():
            try:
                channel = await self._broker.channel()
                self._channel = channel
                await channel.set_qos(prefetch_count=self._prefetch)
                queue = await channel.get_queue(self._queue, ensure=False)
                self._consumer_tag = await queue.consume(self._on_message)
                self.consuming = True
                logger.info("consuming %s (prefetch %d)", self._queue, self._prefetch)
                backoff = 0.2
                stop = asyncio.ensure_future(self._stopping.wait())
                closed = asyncio.ensure_future(channel.closed())
                await asyncio.wait({stop, closed}, return_when=asyncio.FIRST_COMPLETED)
                for f in (stop, closed):
                    f.cancel()
                self.consuming = False
                if not self._stopping.is_set():
                    logger.warning("channel to %s closed; reconnecting", self._queue)
                    await self._broker.reset()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.consuming = False
                logger.warning(
                    "consumer of %s: %s: %s; retrying in %.1fs", self._queue, type(exc).__name__, exc, backoff
                )
                await self._broker.reset()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stopping.wait(), timeout=backoff)
                backoff = min(backoff * 2, self._max_backoff)

    async def stop(self, *, drain_seconds: float = 20.0) -> None:
        """Stop taking messages, let in-flight ones finish (and ack), then close."""
        self._stopping.set()
        channel = self._channel
        if channel is not None and not channel.is_closed and self._consumer_tag:
            with contextlib.suppress(Exception):
                queue = await channel.get_queue(self._queue, ensure=False)
                await queue.cancel(self._consumer_tag)
        if self._in_flight:
            _, pending = await asyncio.wait(self._in_flight, timeout=drain_seconds)
            for task in pending:
                task.cancel()
            if pending:
                logger.warning(
                    "%d message(s) still in flight at shutdown; they will be redelivered", len(pending)
                )
        if channel is not None and not channel.is_closed:
            with contextlib.suppress(Exception):
                await channel.close()

    async def _on_message(self, message: AbstractIncomingMessage) -> None:
        task = asyncio.create_task(self._process(message))
        self._in_flight.add(task)
        task.add_done_callback(self._in_flight.discard)

    async def _process(self, message: AbstractIncomingMessage) -> None:
        backoff = 0.1
        while True:
            error: BaseException | None = None
            try:
                await self._handler(message)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                error = exc
            outcome = classify(error)
            if outcome is Outcome.RETRY_TIER and self._retry is None:
                outcome = Outcome.RETRY_IN_PROCESS
            try:
                if outcome is Outcome.ACK:
                    await message.ack()
                elif outcome is Outcome.DEAD_LETTER:
                    await self._dead_letter(message, "permanent", str(error))
                elif outcome is Outcome.RETRY_TIER:
                    assert isinstance(error, RetryLater) and self._retry is not None
                    attempt = attempt_of(message.headers)
                    plan = next_retry(
                        attempt,
                        max_attempts=self._retry.max_attempts,
                        tiers=self._retry.tiers,
                        retry_after=error.retry_after,
                    )
                    if plan is None:
                        await self._dead_letter(
                            message, "exhausted", f"gave up after {attempt} attempts: {error.reason}"
                        )
                    else:
                        await self._retry.publisher.publish(
                            OutgoingMessage(
                                exchange=RETRY_EXCHANGE,
                                routing_key=retry_tier_name(plan.delay),
                                message_id=message.message_id or "",
                                body=message.body,
                                headers={
                                    **(message.headers or {}),
                                    ATTEMPT_HEADER: plan.next_attempt,
                                    ERROR_HEADER: error.reason[:200],
                                },
                            )
                        )
                        RETRIES.labels(reason=error.kind).inc()
                        logger.info(
                            "retrying %s in %gs (attempt %d of %d): %s",
                            message.message_id,
                            plan.delay,
                            plan.next_attempt,
                            self._retry.max_attempts,
                            error.reason,
                        )
                        await message.ack()
                elif outcome is Outcome.RETRY_IN_PROCESS:
                    if self._stopping.is_set():
                        await message.nack(requeue=True)
                        return
                    logger.warning(
                        "message %s on %s: %s: %s; retrying in %.1fs",
                        message.message_id,
                        self._queue,
                        type(error).__name__,
                        error,
                        backoff,
                    )
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._stopping.wait(), timeout=backoff)
                    backoff = min(backoff * 2, self._max_backoff)
                    continue
                else:
                    logger.error(
                        "message %s on %s failed; requeued (the delivery limit dead-letters it if it keeps failing)",
                        message.message_id,
                        self._queue,
                        exc_info=error,
                    )
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._stopping.wait(), timeout=self._requeue_pause)
                    await message.nack(requeue=True)
            except (aiormq.exceptions.AMQPError, ConnectionError, RuntimeError) as exc:
                # The channel went away: the broker redelivers the message to someone.
                logger.warning("could not settle %s on %s: %s", message.message_id, self._queue, exc)
            except Exception as exc:
                # A give-up hook or retry publish failed (Postgres or the broker away):
                # keep the message and decide again once they answer.
                if classify(exc) is not Outcome.RETRY_IN_PROCESS and not isinstance(exc, DeliveryError):
                    raise
                logger.warning(
                    "settling %s failed (%s: %s); retrying", message.message_id, type(exc).__name__, exc
                )
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stopping.wait(), timeout=backoff)
                backoff = min(backoff * 2, self._max_backoff)
                if self._stopping.is_set():
                    with contextlib.suppress(Exception):
                        await message.nack(requeue=True)
                    return
                continue
            return

    async def _dead_letter(self, message: AbstractIncomingMessage, kind: str, reason: str) -> None:
        if self._on_give_up is not None:
            await self._on_give_up(message, kind, reason)
        logger.warning("dead-lettering %s from %s (%s): %s", message.message_id, self._queue, kind, reason)
        await message.reject(requeue=False)
