"""The one consumer wrapper. Handlers process a message and raise to signal; they never
ack. This module alone decides what each outcome means for the message, and settles it
in one step per outcome:

=====================================  ==============================================
handler outcome                         what happens to the message
=====================================  ==============================================
returns                                 ack (with ``acks_together``, the acks due in
                                        one turn of the event loop go together: one
                                        ``multiple`` ack for the channel's oldest
                                        outstanding deliveries when all of them are
                                        to be acked, never past one still being
                                        handled or settled otherwise)
raises ``Reject``                       ``on_give_up``, then nack without requeue: the
                                        queue's DLX moves it to ``chatq.*.dead``
raises ``RetryLater``                   a confirmed publish to the retry tier for the
                                        next attempt (header ``chatq-attempt``),
                                        ``on_retry`` (for the record), then
                                        ack; when attempts are exhausted, ``on_give_up``
                                        then dead-letter. ``counts=False`` (waiting for
                                        another holder) republishes on the same attempt
infrastructure error (Postgres or       kept unacked and retried in-process with
network down, serialization failure)    backoff until it works or the process stops;
                                        a stopping process requeues it
anything else (a bug, a poison input)   nack with requeue after a pause; on the last
                                        delivery the quorum queue allows (header
                                        ``x-delivery-count``), ``on_give_up`` then
                                        dead-letter instead
=====================================  ==============================================

**Batches.** A consumer given ``Batching`` gathers the deliveries that arrive together (up
to ``size``, or what arrives within ``wait`` seconds of the first) and hands them to its
batch handler, one batch at a time, in delivery order. The handler returns each
message's outcome (None, or what that message alone raised), settled as above; a batch
whose every message succeeded is acked with one ``multiple`` ack. A batch handler that
raises an infrastructure error is run again on the same batch, with backoff; one that
raises anything else (a row Postgres refuses, a bug) has its batch handed again to the
one-message handler, each message settled by its own outcome: a poison message fails
alone, exactly as without batches.

Settling can fail too. A retry tier that cannot be published to (connection refused,
a nack, a closed channel) resets the publisher and tries again with backoff, the message
still unacked; a give-up hook that cannot reach Postgres is retried the same way; a
stopping process requeues what it could not settle. Only an ack or nack that fails
because our own channel went away is left to the broker, which redelivers the message.
Readiness sees a consumer that stopped making progress: ``oldest_unsettled_seconds``.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import aiormq
import asyncpg
from aio_pika.abc import AbstractChannel, AbstractConnection
from aiormq.abc import DeliveredMessage

from shared.broker.connection import BrokerConnection
from shared.broker.delivery import AmqpDelivery, Delivery
from shared.broker.publisher import ConfirmingPublisher, OutgoingMessage
from shared.broker.topology import RETRY_EXCHANGE, retry_tier_name
from shared.metrics import ACK_MESSAGES, IN_PROCESS_RETRIES, RETRIES
from shared.retry import ATTEMPT_HEADER, ERROR_HEADER, attempt_of, delivery_count_of, next_retry

logger = logging.getLogger(__name__)

#: The longest a shutdown waits on one broker call (a consumer's cancel, a channel's close)
#: or for its cancelled in-flight handlers.
BROKER_CALL_SECONDS = 5.0


class Reject(Exception):
    """This message can never succeed: dead-letter it, with this reason logged."""


class RetryLater(Exception):
    """Try this message again later, through the consumer's retry tiers. ``kind`` labels
    the retry in metrics (no ids); ``retry_after`` is a wait the platform asked for;
    ``counts=False`` when this was not an attempt (another consumer holds the work)."""

    def __init__(
        self, reason: str, *, kind: str = "transient", retry_after: float | None = None, counts: bool = True
    ) -> None:
        super().__init__(reason)
        self.reason = reason
        self.kind = kind
        self.retry_after = retry_after
        self.counts = counts


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


def last_delivery(headers: Mapping[str, object] | None, delivery_limit: int | None) -> bool:
    """Whether a requeue now would make the broker dead-letter the message (its quorum
    queue has seen ``delivery_limit`` unsuccessful deliveries). Pure; unit-tested."""
    return delivery_limit is not None and delivery_count_of(headers) >= delivery_limit


Handler = Callable[[Delivery], Awaitable[None]]
#: Handles the messages delivered together; returns, per message in order, None (done)
#: or the exception that message alone raised; raises when the batch failed as a whole.
BatchHandler = Callable[[Sequence[Delivery]], Awaitable[Sequence[Exception | None]]]


@dataclass(frozen=True)
class Batching:
    """Gather deliveries into batches for ``handler``: up to ``size`` messages, or what
    arrives within ``wait`` seconds of the first (while a batch is being handled, the next
    one gathers what arrives meanwhile and starts as soon as it ends)."""

    handler: BatchHandler
    size: int
    wait: float


#: Called before a message is dead-lettered: (message, "permanent" | "exhausted", reason).
GiveUpHook = Callable[[Delivery, str, str], Awaitable[None]]
#: Called once a retry is in its tier, before the ack: (message, next attempt, delay in
#: seconds, reason). For the record a person reads; its failure is logged, never fatal
#: (the message is in the tier already).
RetryHook = Callable[[Delivery, int, float, str], Awaitable[None]]

#: How a message is settled for one outcome: (message, the handler's error or None).
SettleStep = Callable[[Delivery, Exception | None], Awaitable[None]]

#: Errors of an ack or nack on our own channel: it went away, the broker redelivers.
_CHANNEL_GONE = (aiormq.exceptions.AMQPError, ConnectionError, RuntimeError)


#: A delivery whose ack, nack or reject is being sent.
_SETTLING = object()


def _channel_of(message: Delivery) -> object:
    """The channel a delivery came on: its delivery tag is numbered there."""
    return getattr(message, "channel", None)


class _Backoff:
    """Doubling waits, from ``first`` up to ``most`` seconds."""

    def __init__(self, first: float, most: float) -> None:
        self.seconds, self._most = first, most

    def next(self) -> float:
        """The wait to take now; the next one doubles."""
        seconds = self.seconds
        self.seconds = min(seconds * 2, self._most)
        return seconds


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
        on_retry: RetryHook | None = None,
        delivery_limit: int | None = None,
        requeue_pause: float = 1.0,
        max_backoff: float = 5.0,
        batching: Batching | None = None,
        acks_together: bool = False,
    ) -> None:
        self._broker = broker
        self._queue = queue
        self._handler = handler
        self._prefetch = prefetch
        self._retry = retry
        self._on_give_up = on_give_up
        self._on_retry = on_retry
        self._delivery_limit = delivery_limit
        self._requeue_pause = requeue_pause
        self._max_backoff = max_backoff
        self._stopping = asyncio.Event()
        self._in_flight: dict[asyncio.Task[None], float] = {}
        self._batching = batching
        #: Acks of single deliveries go together where order allows (``_ack``).
        self._acks_together = acks_together
        #: Deliveries waiting for the next batch, with when each arrived.
        self._gathered: list[tuple[Delivery, float]] = []
        self._gather_timer: asyncio.TimerHandle | None = None
        self._batch_task: asyncio.Task[None] | None = None
        self._channel: AbstractChannel | None = None
        self._consumer_tag: str | None = None
        self.consuming = False
        #: Deliveries not yet settled, per channel in delivery order: the message, and the
        #: future its ack waits on once it is to be acked (see ``_ack``).
        self._unsettled: dict[object, dict[int, tuple[Delivery, asyncio.Future[None] | object | None]]] = {}
        self._acks_due = False
        self._flushes: set[asyncio.Task[None]] = set()
        #: Acks sent and the messages they settled (what ``multiple`` achieves).
        self.acks_sent = 0
        self.messages_acked = 0
        #: One settle step per outcome, each taking the message and the handler's error.
        self._settle_steps: dict[Outcome, SettleStep] = {
            Outcome.ACK: self._settle_ack,
            Outcome.DEAD_LETTER: self._settle_dead_letter,
            Outcome.RETRY_TIER: self._settle_retry_tier,
            Outcome.REQUEUE: self._settle_requeue,
        }

    @property
    def queue(self) -> str:
        return self._queue

    def oldest_unsettled_seconds(self) -> float:
        """How long the oldest message this consumer holds has waited to be settled (0 when
        it holds none): a consumer that stopped making progress shows here."""
        since = [*self._in_flight.values(), *(at for _, at in self._gathered[:1])]
        if not since:
            return 0.0
        return time.monotonic() - min(since)

    async def run(self) -> None:
        """Consume until ``stop``; reconnect after broker outages."""
        backoff = 0.2
        while not self._stopping.is_set():
            # The connection this consumer's channel is on: the one a failure resets (the
            # connection is shared; another user may have replaced it already).
            connection: AbstractConnection | None = None
            try:
                connection, channel = await self._broker.open_channel()
                self._channel = channel
                await channel.set_qos(prefetch_count=self._prefetch)
                # On aiormq's channel: handlers get AmqpDelivery, not aio-pika's message
                # (shared/broker/delivery.py says why).
                raw = await channel.get_underlay_channel()
                self._consumer_tag = (await raw.basic_consume(self._queue, self._on_delivered)).consumer_tag
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
                    # Only this channel closed (an unknown delivery tag, the broker's consumer
                    # timeout, a deleted queue): its own channel is opened again on the same
                    # connection, which the other consumers share. A closed connection is
                    # dropped, and the next open makes a new one.
                    if connection is not None and connection.is_closed:
                        logger.warning("connection of %s closed; reconnecting", self._queue)
                        await self._broker.reset(connection)
                    else:
                        logger.warning("channel to %s closed; opening it again", self._queue)
                        await self._pause(backoff)
                        backoff = min(backoff * 2, self._max_backoff)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.consuming = False
                logger.warning(
                    "consumer of %s: %s: %s; retrying in %.1fs", self._queue, type(exc).__name__, exc, backoff
                )
                await self._broker.reset(connection)
                await self._pause(backoff)
                backoff = min(backoff * 2, self._max_backoff)

    async def stop(self, *, drain_seconds: float = 20.0) -> None:
        """Stop taking messages, let in-flight ones finish (and ack), then close."""
        self._stopping.set()
        channel = self._channel
        if channel is not None and not channel.is_closed and self._consumer_tag:
            # Bounded: a broker node gone without closing TCP answers nothing until the
            # heartbeat gives up (three minutes), past Kubernetes' grace period.
            with contextlib.suppress(Exception):
                async with asyncio.timeout(BROKER_CALL_SECONDS):
                    await (await channel.get_underlay_channel()).basic_cancel(self._consumer_tag)
        # What was gathered for a batch goes now; each batch that ends starts the next.
        self._start_batch()
        deadline = time.monotonic() + drain_seconds
        pending: set[asyncio.Task[None]] = set()
        while self._in_flight and (left := deadline - time.monotonic()) > 0:
            _, pending = await asyncio.wait(set(self._in_flight), timeout=left)
        pending = set(self._in_flight)
        for task in pending:
            task.cancel()
        if pending or self._gathered:
            logger.warning(
                "%d message(s) still in flight at shutdown; they will be redelivered",
                len(pending) + len(self._gathered),
            )
        if pending:
            # Their transactions roll back and their connections go back to the pool,
            # which closes after this.
            await asyncio.wait(pending, timeout=BROKER_CALL_SECONDS)
        if channel is not None and not channel.is_closed:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(BROKER_CALL_SECONDS):
                    await channel.close()

    async def _on_delivered(self, message: DeliveredMessage) -> None:
        await self._on_message(AmqpDelivery(message))

    async def _on_message(self, message: Delivery) -> None:
        if self._batching is not None:
            self._gather(message)
            return
        if self._acks_together and message.delivery_tag is not None:
            self._unsettled.setdefault(_channel_of(message), {})[message.delivery_tag] = (message, None)
        task = asyncio.create_task(self.handle_delivery(message))
        self._in_flight[task] = time.monotonic()
        task.add_done_callback(self._settled)

    # ---- batches ------------------------------------------------------------------

    def _gather(self, message: Delivery) -> None:
        assert self._batching is not None
        self._gathered.append((message, time.monotonic()))
        if self._batch_task is not None:
            return  # the batch in hand starts the next when it ends
        if len(self._gathered) >= self._batching.size:
            self._start_batch()
        elif self._gather_timer is None:
            self._gather_timer = asyncio.get_running_loop().call_later(self._batching.wait, self._start_batch)

    def _start_batch(self) -> None:
        """Hand what was gathered (up to the batch size) to the batch handler, unless a
        batch is in hand: batches go one at a time, in delivery order."""
        if self._gather_timer is not None:
            self._gather_timer.cancel()
            self._gather_timer = None
        if self._batching is None or self._batch_task is not None or not self._gathered:
            return
        batch = self._gathered[: self._batching.size]
        del self._gathered[: self._batching.size]
        self._batch_task = task = asyncio.create_task(self.handle_batch([m for m, _ in batch]))
        self._in_flight[task] = batch[0][1]
        task.add_done_callback(self._batch_ended)

    def _batch_ended(self, task: asyncio.Task[None]) -> None:
        self._batch_task = None
        self._settled(task)
        if not task.cancelled():
            # What arrived meanwhile has waited for this batch already: it goes now.
            self._start_batch()

    async def handle_batch(self, messages: Sequence[Delivery]) -> None:
        """Run the batch handler on messages delivered together, then settle each by its
        outcome: the successes with one ack (``multiple`` when they are the whole batch),
        the others through the settle step of their outcome. An infrastructure error of
        the batch runs it again, with backoff, until it works or the process stops (then
        the batch is requeued); any other error hands each message to the one-message
        handler, settled alone (``handle_delivery``)."""
        assert self._batching is not None
        backoff = _Backoff(0.1, self._max_backoff)
        while True:
            try:
                outcomes = await self._batching.handler(messages)
                break
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                error = exc
            if classify(error) is not Outcome.RETRY_IN_PROCESS:
                logger.warning(
                    "a batch of %d message(s) on %s failed (%s: %s): handling each alone",
                    len(messages),
                    self._queue,
                    type(error).__name__,
                    error,
                )
                await asyncio.gather(*(self.handle_delivery(m) for m in messages))
                return
            if self._stopping.is_set():
                for m in messages:
                    await self._nack_requeue(m)
                return
            IN_PROCESS_RETRIES.labels(where=self._queue, error=type(error).__name__).inc(len(messages))
            logger.warning(
                "a batch of %d message(s) on %s: %s: %s; retrying in %.1fs",
                len(messages),
                self._queue,
                type(error).__name__,
                error,
                backoff.seconds,
            )
            await self._pause(backoff.next())
        done = [m for m, e in zip(messages, outcomes, strict=True) if e is None]
        await self._ack_together(done, whole=len(done) == len(messages))
        failed = [(m, e) for m, e in zip(messages, outcomes, strict=True) if e is not None]
        await asyncio.gather(*(self._settle_alone(m, e) for m, e in failed))

    async def _ack_together(self, messages: Sequence[Delivery], *, whole: bool) -> None:
        """Ack a batch's successes. The whole batch takes one ``multiple`` ack of its last
        delivery: batches go one at a time in delivery order, so every delivery before it
        on the channel is settled already or in this batch. A batch with failures acks its
        successes one by one (its failures are settled apart, some after a pause)."""
        if not messages:
            return
        last = messages[-1]
        if whole and all(m.channel is last.channel for m in messages):
            try:
                await last.ack(multiple=True)
            except _CHANNEL_GONE as exc:
                logger.warning("could not ack %d message(s) on %s: %s", len(messages), self._queue, exc)
                return
            ACK_MESSAGES.labels(queue=self._queue).observe(len(messages))
            return
        for m in messages:
            await self._ack(m)

    async def _settle_alone(self, message: Delivery, error: Exception) -> None:
        """One message of a batch that failed alone: settled as the one-message handler's
        outcome would be; an infrastructure error runs the one-message handler on it."""
        outcome = classify(error)
        if outcome is Outcome.RETRY_TIER and self._retry is None:
            outcome = Outcome.RETRY_IN_PROCESS
        if outcome is Outcome.RETRY_IN_PROCESS:
            await self.handle_delivery(message)
            return
        await self._settle_steps[outcome](message, error)

    def _settled(self, task: asyncio.Task[None]) -> None:
        self._in_flight.pop(task, None)
        if not task.cancelled() and task.exception() is not None:
            logger.error("settling a message of %s failed", self._queue, exc_info=task.exception())

    async def _pause(self, seconds: float) -> None:
        """Wait, but no longer than until the consumer is asked to stop."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await self._stopping.wait()

    async def handle_delivery(self, message: Delivery) -> None:
        """Run the handler on one delivery, then settle the message by the outcome
        (``classify``), through the one settle step for that outcome. An infrastructure
        error is not settled: the handler runs again, with backoff, until it works or
        the process stops (then the message is requeued)."""
        backoff = _Backoff(0.1, self._max_backoff)
        while True:
            error = await self._run_handler(message)
            outcome = classify(error)
            if outcome is Outcome.RETRY_TIER and self._retry is None:
                outcome = Outcome.RETRY_IN_PROCESS
            if outcome is not Outcome.RETRY_IN_PROCESS:
                await self._settle_steps[outcome](message, error)
                return
            if self._stopping.is_set():
                await self._nack_requeue(message)
                return
            IN_PROCESS_RETRIES.labels(where=self._queue, error=type(error).__name__).inc()
            logger.warning(
                "message %s on %s: %s: %s; retrying in %.1fs",
                message.message_id,
                self._queue,
                type(error).__name__,
                error,
                backoff.seconds,
                extra={"message_id": message.message_id, "queue": self._queue},
            )
            await self._pause(backoff.next())

    async def _run_handler(self, message: Delivery) -> Exception | None:
        """The handler's outcome: None when it returned, else what it raised."""
        try:
            await self._handler(message)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            return exc
        return None

    # ---- one settle step per outcome ----------------------------------------------

    async def _settle_ack(self, message: Delivery, _: Exception | None) -> None:
        await self._ack(message)

    async def _settle_dead_letter(self, message: Delivery, error: Exception | None) -> None:
        await self._dead_letter(message, "permanent", str(error))

    async def _settle_retry_tier(self, message: Delivery, error: Exception | None) -> None:
        assert isinstance(error, RetryLater)
        await self._retry_tier(message, error)

    async def _settle_requeue(self, message: Delivery, error: Exception | None) -> None:
        """An unexpected error (a bug, a poison input): requeue after a pause, or on the
        last delivery the queue allows, give up and dead-letter."""
        if last_delivery(message.headers, self._delivery_limit):
            await self._dead_letter(
                message,
                "exhausted",
                f"failed on each of {delivery_count_of(message.headers) + 1} deliveries: "
                f"{type(error).__name__}: {error}",
            )
            return
        logger.error(
            "message %s on %s failed; requeued (delivery %d of %s)",
            message.message_id,
            self._queue,
            delivery_count_of(message.headers) + 1,
            self._delivery_limit + 1 if self._delivery_limit is not None else "unlimited",
            exc_info=error,
            extra={"message_id": message.message_id, "queue": self._queue},
        )
        await self._pause(self._requeue_pause)
        await self._nack_requeue(message)

    # ---- the primitives the settle steps share --------------------------------------

    async def _ack(self, message: Delivery) -> None:
        """Ack, together with the other acks due in this turn of the event loop: the
        oldest deliveries of the channel still outstanding, when they are all to be
        acked, go as one ack with ``multiple`` (it settles every outstanding delivery up
        to its tag, so never past one still being handled or settled otherwise); the
        others one by one, at once."""
        pending = self._unsettled.get(_channel_of(message), {})
        tag = getattr(message, "delivery_tag", None)
        if tag not in pending:  # not delivered through this consumer's channel
            await self._send_ack(message, multiple=False, count=1)
            return
        done = asyncio.get_running_loop().create_future()
        pending[tag] = (message, done)
        if not self._acks_due:
            self._acks_due = True
            asyncio.get_running_loop().call_soon(self._start_flush)
        await done

    def _start_flush(self) -> None:
        task = asyncio.ensure_future(self._flush_acks())
        self._flushes.add(task)  # held until done: the loop keeps only a weak reference
        task.add_done_callback(self._flushes.discard)

    async def _flush_acks(self) -> None:
        self._acks_due = False
        for channel, pending in list(self._unsettled.items()):
            tags = list(pending)
            n = 0
            while n < len(tags) and isinstance(pending[tags[n]][1], asyncio.Future):
                n += 1
            due = tags[:n] + [t for t in tags[n:] if isinstance(pending[t][1], asyncio.Future)]
            entries = [pending[t] for t in due]
            for tag in due:  # still outstanding until sent: no other ack reaches past them
                pending[tag] = (pending[tag][0], _SETTLING)
            try:
                if n:
                    await self._send_ack(entries[n - 1][0], multiple=n > 1, count=n)
                for message, _ in entries[n:]:
                    await self._send_ack(message, multiple=False, count=1)
            finally:
                for tag in due:
                    pending.pop(tag, None)
                if not pending and self._unsettled.get(channel) is pending:
                    del self._unsettled[channel]
                for _, done in entries:
                    if isinstance(done, asyncio.Future) and not done.done():
                        done.set_result(None)

    async def _send_ack(self, message: Delivery, *, multiple: bool, count: int) -> None:
        try:
            if multiple:
                await message.ack(multiple=True)
            else:
                await message.ack()
        except _CHANNEL_GONE as exc:
            logger.warning("could not ack %s on %s: %s", message.message_id, self._queue, exc)
            return
        self.acks_sent += 1
        self.messages_acked += count
        ACK_MESSAGES.labels(queue=self._queue).observe(count)

    @contextlib.contextmanager
    def _settling(self, message: Delivery) -> Iterator[None]:
        """A delivery settled otherwise than by an ack (requeued, dead-lettered): no
        ``multiple`` ack reaches past it until that is sent."""
        channel, tag = _channel_of(message), getattr(message, "delivery_tag", None)
        pending = self._unsettled.get(channel)
        if pending is not None and tag in pending:
            pending[tag] = (message, _SETTLING)
        try:
            yield
        finally:
            if pending is not None:
                pending.pop(tag, None)  # type: ignore[arg-type]
                if not pending and self._unsettled.get(channel) is pending:
                    del self._unsettled[channel]

    async def _nack_requeue(self, message: Delivery) -> None:
        try:
            with self._settling(message):
                await message.nack(requeue=True)
        except _CHANNEL_GONE as exc:
            logger.warning("could not requeue %s on %s: %s", message.message_id, self._queue, exc)

    async def _until_done(
        self,
        message: Delivery,
        what: str,
        step: Callable[[], Awaitable[None]],
        *,
        after_error: Callable[[BaseException], Awaitable[bool]],
    ) -> bool:
        """Run a settle step until it works, the message unacked meanwhile, with backoff.
        ``after_error`` returns False to stop retrying (the step is skipped). Returns
        False when the process stops first: the message is requeued."""
        backoff = _Backoff(0.1, self._max_backoff)
        while True:
            try:
                await step()
                return True
            except Exception as exc:
                if not await after_error(exc):
                    return True
                if self._stopping.is_set():
                    await self._nack_requeue(message)
                    return False
                logger.warning(
                    "%s for %s on %s failed (%s: %s); retrying in %.1fs",
                    what,
                    message.message_id,
                    self._queue,
                    type(exc).__name__,
                    exc,
                    backoff.seconds,
                )
                await self._pause(backoff.next())

    async def _dead_letter(self, message: Delivery, kind: str, reason: str) -> None:
        """``on_give_up`` (retried until it works: the record must exist before the message
        leaves), then reject without requeue so the DLX takes it."""
        hook = self._on_give_up
        if hook is not None:

            async def transient(exc: BaseException) -> bool:
                if classify(exc) is Outcome.RETRY_IN_PROCESS:
                    IN_PROCESS_RETRIES.labels(where=self._queue, error=type(exc).__name__).inc()
                    return True
                # A bug in the hook: dead-letter anyway; the dead-letter recorder records
                # the message from the queue.
                logger.error(
                    "give-up hook failed for %s on %s", message.message_id, self._queue, exc_info=exc
                )
                return False

            if not await self._until_done(
                message, "give-up", lambda: hook(message, kind, reason), after_error=transient
            ):
                return
        logger.warning(
            "dead-lettering %s from %s (%s): %s",
            message.message_id,
            self._queue,
            kind,
            reason,
            extra={"message_id": message.message_id, "queue": self._queue},
        )
        try:
            with self._settling(message):
                await message.reject(requeue=False)
        except _CHANNEL_GONE as exc:
            logger.warning("could not dead-letter %s on %s: %s", message.message_id, self._queue, exc)

    async def _retry_tier(self, message: Delivery, error: RetryLater) -> None:
        retry = self._retry
        assert retry is not None
        attempt = attempt_of(message.headers)
        plan = next_retry(
            attempt,
            max_attempts=retry.max_attempts,
            tiers=retry.tiers,
            retry_after=error.retry_after,
            counts=error.counts,
        )
        if plan is None:
            await self._dead_letter(message, "exhausted", f"gave up after {attempt} attempts: {error.reason}")
            return
        outgoing = OutgoingMessage(
            exchange=RETRY_EXCHANGE,
            routing_key=retry_tier_name(plan.delay),
            message_id=message.message_id or "",
            body=message.body,
            headers={
                **{k: v for k, v in (message.headers or {}).items() if not k.startswith("x-")},
                ATTEMPT_HEADER: plan.next_attempt,
                ERROR_HEADER: error.reason[:200],
            },
        )

        async def reset(_: BaseException) -> bool:
            # Not confirmed (connection refused, a nack, a closed channel): a fresh channel
            # next time; the message stays ours, unacked, until the tier has it.
            await retry.publisher.reset()
            return True

        if not await self._until_done(
            message, "publish to the retry tier", lambda: retry.publisher.publish(outgoing), after_error=reset
        ):
            return
        RETRIES.labels(reason=error.kind).inc()
        logger.info(
            "retrying %s in %gs (attempt %d of %d): %s",
            message.message_id,
            plan.delay,
            plan.next_attempt,
            retry.max_attempts,
            error.reason,
            extra={"message_id": message.message_id, "queue": self._queue, "attempt": plan.next_attempt},
        )
        if self._on_retry is not None and error.counts:
            try:
                await self._on_retry(message, plan.next_attempt, plan.delay, error.reason)
            except Exception as exc:
                logger.warning(
                    "could not record the retry of %s: %s: %s", message.message_id, type(exc).__name__, exc
                )
        await self._ack(message)
