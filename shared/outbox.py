"""The transactional outbox: write a message in the caller's transaction; a relay
publishes committed rows to RabbitMQ with publisher confirms.

Where the relay runs: inside every process that writes outbox rows (the receiver for
inbound messages, the coalescer for reply jobs), woken in-process right after each
commit and polling as the fallback. Several relays (replicas) share the table safely:
each claims a batch with ``FOR UPDATE SKIP LOCKED``, so a row is published by one relay
at a time, and a relay that dies releases its claim with its connection. Delivery is
at-least-once: a kill between the confirm and the mark publishes the row again, with the
same message_id, and consumers deduplicate on it.

Order: a relay claims only a chat's head row, the first unpublished row of its ordering
key on its exchange (an index makes that a probe), and a later row becomes the head only
once the earlier one is confirmed and marked. So a chat has at most one row in flight
across every relay, and its rows reach the broker in id order, whatever the number of
relays and however connections drop. A batch holds one row per chat, so a chat with a
long backlog cannot fill batches and starve the others.

Each process's relay publishes only the exchanges it owns (the receiver: inbound
messages; the coalescer: reply jobs), so one service being down never holds the other's
rows, and two services never race on one chat's rows.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar
from uuid import UUID

import asyncpg

from shared import metrics
from shared.broker.connection import BrokerConnection
from shared.broker.publisher import ConfirmingPublisher, OutgoingMessage
from shared.db import Conn
from shared.faults import fault_point
from shared.lifecycle import every
from shared.settings import Settings

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class OutboxMessage:
    exchange: str
    routing_key: str
    message_id: str
    ordering_key: str
    body: bytes
    headers: Mapping[str, Any] = field(default_factory=dict)
    operation_id: UUID | None = None


INSERT_SQL = """
INSERT INTO outbox (exchange, routing_key, message_id, ordering_key, operation_id, headers, body)
VALUES ($1, $2, $3, $4, $5, $6::text::jsonb, $7)
"""


def insert_args(message: OutboxMessage) -> tuple[Any, ...]:
    return (
        message.exchange,
        message.routing_key,
        message.message_id,
        message.ordering_key,
        message.operation_id,
        json.dumps(dict(message.headers)),
        message.body,
    )


async def enqueue(conn: Conn, message: OutboxMessage) -> None:
    """Add a message to the outbox. Must run inside the caller's transaction, so the
    message exists if and only if the caller's state change committed."""
    if not conn.is_in_transaction():
        raise RuntimeError("outbox.enqueue must run inside the caller's transaction")
    await conn.execute(INSERT_SQL, *insert_args(message))


async def enqueue_many(conn: Conn, messages: list[OutboxMessage]) -> None:
    """``enqueue`` for several messages, in one round trip."""
    if not conn.is_in_transaction():
        raise RuntimeError("outbox.enqueue_many must run inside the caller's transaction")
    await conn.executemany(INSERT_SQL, [insert_args(m) for m in messages])


class BrokerFailed(RuntimeError):
    """The broker failed the relay (no channel, a publish that raised): the one kind of
    error after which the relay drops its broker connection. A Postgres error leaves it
    alone (a database outage once cost 35 reconnects in 65 s, and a receiver reported as
    unable to reach RabbitMQ)."""


class PublishFailed(BrokerFailed):
    """Some rows of a batch were not confirmed; they stay pending and are retried."""


# The heads of their chats on the relay's exchanges, oldest first. A head another relay
# holds is skipped (SKIP LOCKED), and so are the rows behind it (not heads). Each exchange
# is read from its own part of outbox_unpublished_by_exchange (migrations 0025, 0028) in id
# order, so a relay never walks the rows of another relay's exchange (the coalescer's relay
# once stepped over 2,600 inbound rows the receiver's relay had not yet published, 1.8 ms a
# claim), and whether a row is its chat's head is one probe of outbox_unpublished_head: a
# subquery run per row with the row's key as its parameters. (Written as NOT EXISTS, the
# planner made it an anti join, which a plan made while the table was small ran as a scan
# of the exchange's unpublished rows for every row: 80 ms a claim of 200 behind a burst.)
# The index by exchange holds only rows with "id > 0" (every row): only a query that says
# so, this walk, can use it. Before 0028 a plan made on statistics taken while every row
# was published probed by exchange and id and filtered the key: n^2/2 rows for a claim of
# n (tests/integration/test_outbox_cost.py).
#
# A relay of one exchange (each service's) names it as a scalar: over an array, whose length
# a cached plan cannot know, the generic plan always looked dearer than a custom one, so
# Postgres planned the claim again on every call (as long as running it, under
# bench.pipeline); with a scalar it keeps one plan after the fifth call.
_CLAIM_SQL = """
SELECT c.* FROM {exchanges} AS x(exchange) CROSS JOIN LATERAL (
    SELECT o.id, o.exchange, o.routing_key, o.message_id, o.ordering_key, o.headers, o.body
    FROM outbox o
    WHERE o.published_at IS NULL AND o.id > 0  -- the index by exchange serves only this walk (0028)
      AND o.exchange = x.exchange
      AND (SELECT p.id FROM outbox p
           WHERE p.published_at IS NULL AND p.exchange = o.exchange AND p.ordering_key = o.ordering_key
             AND p.id < o.id
           LIMIT 1) IS NULL
    ORDER BY o.id
    LIMIT $1
    FOR UPDATE OF o SKIP LOCKED
) c
ORDER BY c.id
LIMIT $1
"""
_CLAIM_ONE_SQL = _CLAIM_SQL.format(exchanges="(VALUES ($2::text))")
_CLAIM_MANY_SQL = _CLAIM_SQL.format(exchanges="unnest($2::text[])")


class Relay:
    def __init__(
        self,
        pool: asyncpg.Pool,
        publisher: ConfirmingPublisher,
        exchanges: Sequence[str],
        *,
        batch_size: int = 200,
        poll_seconds: float = 1.0,
        retention_seconds: float = 24 * 3600,
        purge_interval_seconds: float = 60.0,
        stats_interval_seconds: float = 5.0,
    ) -> None:
        if not exchanges:
            raise ValueError("a relay publishes at least one exchange")
        self._pool = pool
        self._publisher = publisher
        # Each once: the claim reads each exchange it is given, and a row it read twice
        # would be locked (by this relay) and published twice.
        self._exchanges = list(dict.fromkeys(exchanges))
        self._batch_size = batch_size
        self._poll_seconds = poll_seconds
        self._retention = retention_seconds
        self._purge_interval = purge_interval_seconds
        self._stats_interval = stats_interval_seconds
        self._wake = asyncio.Event()
        self._stopping = False
        self._last_purge = 0.0

    @classmethod
    def from_settings(
        cls, pool: asyncpg.Pool, broker: BrokerConnection, settings: Settings, exchanges: Sequence[str]
    ) -> Relay:
        return cls(
            pool,
            ConfirmingPublisher(broker),
            exchanges,
            batch_size=settings.relay_batch_size,
            poll_seconds=settings.relay_poll_seconds,
            retention_seconds=settings.relay_retention_seconds,
            purge_interval_seconds=settings.relay_purge_interval_seconds,
        )

    def notify(self) -> None:
        """Wake the relay: a row was just committed. Cheap; call after every commit."""
        self._wake.set()

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()

    async def run(self) -> None:
        """Publish until stopped, surviving broker and database outages. The pending and
        lag gauges are refreshed on a timer of their own: while the broker is down no
        publish pass succeeds, and that is when the lag must keep rising for the alert."""
        stats = asyncio.create_task(
            every(self._stats_interval, "outbox stats", self.refresh_stats), name="outbox-stats"
        )
        try:
            await self._publish_until_stopped()
        finally:
            stats.cancel()

    async def _publish_until_stopped(self) -> None:
        backoff = 0.1
        while not self._stopping:
            self._wake.clear()
            try:
                await _from_the_broker(self._publisher.ensure_ready())
                while not self._stopping and await self.run_once() > 0:
                    pass
                backoff = 0.1
                await self._housekeeping()
            except asyncio.CancelledError:
                raise
            except BrokerFailed as exc:
                logger.warning("relay: %s; reconnecting in %.1fs", _describe(exc.__cause__ or exc), backoff)
                await self._publisher.reset()
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)
                continue
            except Exception as exc:
                # Postgres (or a bug): the broker connection is fine and stays.
                metrics.IN_PROCESS_RETRIES.labels(where="outbox-relay", error=type(exc).__name__).inc()
                logger.warning("relay: %s; retrying in %.1fs", _describe(exc), backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)
                continue
            try:
                async with asyncio.timeout(self._poll_seconds):
                    await self._wake.wait()
            except TimeoutError:
                pass

    async def run_once(self) -> int:
        """Claim one batch, publish it, mark what was confirmed. Returns rows published."""
        async with self._pool.acquire() as conn, conn.transaction():
            if len(self._exchanges) == 1:
                rows = await conn.fetch(_CLAIM_ONE_SQL, self._batch_size, self._exchanges[0])
            else:
                rows = await conn.fetch(_CLAIM_MANY_SQL, self._batch_size, self._exchanges)
            if not rows:
                return 0
            results = await _from_the_broker(
                self._publisher.publish_many(
                    [
                        OutgoingMessage(
                            exchange=r["exchange"],
                            routing_key=r["routing_key"],
                            message_id=r["message_id"],
                            body=r["body"],
                            headers=r["headers"],
                        )
                        for r in rows
                    ]
                )
            )
            fault_point("relay.after_publish")
            confirmed = [row for row, error in zip(rows, results, strict=True) if error is None]
            if confirmed:
                delays = await conn.fetch(
                    """
                    UPDATE outbox SET published_at = clock_timestamp()
                    WHERE id = ANY($1::bigint[])
                    RETURNING extract(epoch FROM published_at - created_at)::float8 AS delay
                    """,
                    [r["id"] for r in confirmed],
                )
                for d in delays:
                    metrics.OUTBOX_PUBLISH_DELAY.observe(max(d["delay"], 0.0))
                metrics.OUTBOX_PUBLISHED.inc(len(confirmed))
            errors = [(row, e) for row, e in zip(rows, results, strict=True) if e is not None]
            if errors:
                await conn.execute(
                    """
                    UPDATE outbox SET publish_attempts = publish_attempts + 1, last_error = $2
                    WHERE id = ANY($1::bigint[])
                    """,
                    [row["id"] for row, _ in errors],
                    _describe(errors[0][1])[:500],
                )
                for _, e in errors:
                    metrics.OUTBOX_PUBLISH_ERRORS.labels(reason=type(e).__name__).inc()
            fault_point("relay.after_mark")
        if errors:
            raise PublishFailed(
                f"{len(errors)} of {len(rows)} outbox rows not confirmed (first: {_describe(errors[0][1])})"
            )
        return len(confirmed)

    async def _housekeeping(self) -> None:
        now = time.monotonic()
        if now - self._last_purge >= self._purge_interval:
            self._last_purge = now
            await self.purge()

    async def refresh_stats(self) -> tuple[int, float]:
        row = await self._pool.fetchrow(
            """
            SELECT count(*) AS pending,
                   coalesce(extract(epoch FROM clock_timestamp() - min(created_at)), 0)::float8 AS lag
            FROM outbox WHERE published_at IS NULL
            """
        )
        assert row is not None
        metrics.OUTBOX_PENDING.set(row["pending"])
        metrics.OUTBOX_LAG.set(row["lag"])
        metrics.GAUGES_REFRESHED.labels(gauges="outbox").set_to_current_time()
        return row["pending"], row["lag"]

    async def purge(self) -> int:
        """Delete published rows older than the retention period, in bounded chunks."""
        total = 0
        while True:
            status = await self._pool.execute(
                """
                DELETE FROM outbox WHERE id IN (
                    SELECT id FROM outbox
                    WHERE published_at IS NOT NULL
                      AND published_at < clock_timestamp() - make_interval(secs => $1)
                    LIMIT 5000)
                """,
                self._retention,
            )
            n = int(status.split()[-1])
            total += n
            if n < 5000:
                break
        if total:
            logger.info("relay: purged %d published outbox rows", total)
        return total


async def _from_the_broker(step: Awaitable[T]) -> T:
    """``step``'s result; whatever it raises is the broker's failure (BrokerFailed)."""
    try:
        return await step
    except Exception as exc:
        raise BrokerFailed(_describe(exc)) from exc


def _describe(exc: BaseException) -> str:
    text = str(exc) or repr(exc)
    return f"{type(exc).__name__}: {text}"
