"""The outbox relay against real Postgres and RabbitMQ."""

from __future__ import annotations

import asyncio
import json
import uuid
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest

from shared import metrics
from shared.broker.connection import BrokerConnection
from shared.broker.publisher import ConfirmingPublisher
from shared.broker.topology import COALESCER_QUEUE, INBOUND_EXCHANGE, JOBS_EXCHANGE, RESPONDER_QUEUE
from shared.outbox import OutboxMessage, PublishFailed, Relay, enqueue
from tests.conftest import TELEGRAM_SECRET, TEST_TOPOLOGY, replace
from tests.support.broker import QueueInspector, wait_for
from tests.support.payloads import telegram_update
from tests.support.receiver import running_receiver
from tests.support.tcpproxy import TcpProxy, proxy_for, through

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("clean")]

TG = {"X-Telegram-Bot-Api-Secret-Token": TELEGRAM_SECRET}


def row(message_id: str, ordering_key: str, *, exchange: str = INBOUND_EXCHANGE, rk: str = "inbound.test"):
    return OutboxMessage(
        exchange=exchange,
        routing_key=rk,
        message_id=message_id,
        ordering_key=ordering_key,
        body=json.dumps({"id": message_id}).encode(),
    )


async def add(pool: asyncpg.Pool, *messages: OutboxMessage) -> None:
    async with pool.acquire() as conn, conn.transaction():
        for m in messages:
            await enqueue(conn, m)


def via_proxy(amqp_url: str, port: int) -> str:
    parts = urlsplit(amqp_url)
    netloc = f"{parts.username}:{parts.password}@127.0.0.1:{port}"
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


async def test_enqueue_refuses_to_run_outside_a_transaction(pool: asyncpg.Pool) -> None:
    async with pool.acquire() as conn:
        with pytest.raises(RuntimeError, match="inside the caller's transaction"):
            await enqueue(conn, row("x", "k"))


async def test_an_unroutable_message_is_an_error_and_later_rows_of_its_chat_wait_behind_it(
    infra, pool: asyncpg.Pool, queues: QueueInspector
) -> None:
    # a1 cannot be routed (no queue is bound to chatq.inbound under "nowhere"); a2 is behind
    # it in the same chat; b1 is in another chat.
    await add(
        pool,
        row("a1", "chat-a", rk="nowhere"),
        row("a2", "chat-a"),
        row("b1", "chat-b"),
    )
    broker = BrokerConnection(infra.amqp_url, TEST_TOPOLOGY)
    relay = Relay(pool, ConfirmingPublisher(broker), [INBOUND_EXCHANGE])
    try:
        with pytest.raises(PublishFailed, match="1 of 2"):
            await relay.run_once()
    finally:
        await broker.close()
    rows = await pool.fetch(
        "SELECT message_id, published_at IS NOT NULL AS done, last_error FROM outbox ORDER BY id"
    )
    assert [(r["message_id"], r["done"]) for r in rows] == [("a1", False), ("a2", False), ("b1", True)]
    assert "NO_ROUTE" in rows[0]["last_error"]
    # Only b1 reached the broker: a2 waits until a1, the earlier message of its chat, is out.
    assert [m.message_id for m in await queues.drain(COALESCER_QUEUE)] == ["b1"]


async def test_the_operation_reads_queued_only_after_the_broker_confirmed_and_no_update_writes_it(
    settings, pool: asyncpg.Pool, queues: QueueInspector
) -> None:
    async with running_receiver(replace(settings, relay_enabled=False)) as (_, client):
        r = await client.post("/v1/webhooks/telegram", json=telegram_update(1), headers=TG)
    op = uuid.UUID(r.json()["operation_id"])
    shown = (
        "SELECT chatq_shown_status(status, id, platform, account_id, chat_id) FROM operations WHERE id = $1"
    )
    assert await pool.fetchval(shown, op) == "accepted"
    # Any update writes a new version of the row, by another transaction: another xmin.
    version = "SELECT xmin::text FROM operations WHERE id = $1"
    before = await pool.fetchval(version, op)
    broker = BrokerConnection(settings.amqp_url.get_secret_value(), TEST_TOPOLOGY)
    try:
        assert await Relay(pool, ConfirmingPublisher(broker), [INBOUND_EXCHANGE]).run_once() == 1
    finally:
        await broker.close()
    assert await pool.fetchval(shown, op) == "queued"
    assert await pool.fetchval("SELECT status FROM operations WHERE id = $1", op) == "accepted"
    assert await pool.fetchval(version, op) == before, "publishing does not update the operation's row"
    assert [m.message_id for m in await queues.drain(COALESCER_QUEUE)] == [str(op)]


async def test_webhooks_are_accepted_while_rabbitmq_is_unreachable_and_published_in_order_when_it_returns(
    settings, infra, pool: asyncpg.Pool, queues: QueueInspector
) -> None:
    target = urlsplit(infra.amqp_url)
    proxy = await TcpProxy(target.hostname or "127.0.0.1", target.port or 5672).start()
    proxy.block()
    behind_proxy = replace(settings, amqp_url=via_proxy(infra.amqp_url, proxy.port), relay_poll_seconds=0.1)
    try:
        async with running_receiver(behind_proxy) as (_, client):
            for i in range(1, 21):
                r = await client.post(
                    "/v1/webhooks/telegram", json=telegram_update(i, chat_id=1 + i % 2), headers=TG
                )
                assert r.status_code == 200
            ready = (await client.get("/readyz")).json()
            assert ready["status"] == "degraded"
            assert ready["checks"]["rabbitmq"] == "unreachable"
            assert await pool.fetchval("SELECT count(*) FROM outbox WHERE published_at IS NULL") == 20
            proxy.unblock()
            await wait_for(
                lambda: pool.fetchval("SELECT count(*) = 0 FROM outbox WHERE published_at IS NULL"),
                what="outbox drained",
            )
            # A broker restart in the middle of a stream: cut everything while posting.
            for i in range(21, 61):
                if i == 40:
                    proxy.block()
                if i == 45:
                    proxy.unblock()
                r = await client.post(
                    "/v1/webhooks/telegram", json=telegram_update(i, chat_id=1 + i % 2), headers=TG
                )
                assert r.status_code == 200
            await wait_for(
                lambda: pool.fetchval("SELECT count(*) = 0 FROM outbox WHERE published_at IS NULL"),
                within=30,
                what="outbox drained after the cut",
            )
            assert (
                await pool.fetchval(
                    "SELECT count(*) FROM operations"
                    " WHERE chatq_shown_status(status, id, platform, account_id, chat_id) = 'queued'"
                )
                == 60
            )
    finally:
        await proxy.close()
    messages = await queues.drain(COALESCER_QUEUE)
    ids = await pool.fetch("SELECT id::text, message_id, chat_id FROM operations")
    by_op = {r["id"]: (r["chat_id"], int(r["message_id"])) for r in ids}
    assert {m.message_id for m in messages} == set(by_op), "every stored message reached the broker"
    # Within a chat, first arrivals are in the order the messages were received.
    for chat in ("1", "2"):
        seen: list[int] = []
        for m in messages:
            c, n = by_op[m.message_id]
            if c == chat and n not in seen:
                seen.append(n)
        assert seen == sorted(seen), f"chat {chat} reordered: {seen}"


async def test_the_outbox_lag_gauge_keeps_rising_while_the_broker_is_down(infra, pool: asyncpg.Pool) -> None:
    await add(pool, row("stuck", "chat-lag"))
    await pool.execute("UPDATE outbox SET created_at = now() - interval '90 seconds'")
    target = urlsplit(infra.amqp_url)
    proxy = await TcpProxy(target.hostname or "127.0.0.1", target.port or 5672).start()
    proxy.block()
    broker = BrokerConnection(via_proxy(infra.amqp_url, proxy.port), TEST_TOPOLOGY)
    metrics.OUTBOX_LAG.set(0)
    relay = Relay(
        pool, ConfirmingPublisher(broker), [INBOUND_EXCHANGE], poll_seconds=0.1, stats_interval_seconds=0.1
    )
    task = asyncio.create_task(relay.run())
    try:
        # No publish pass succeeds, yet the gauge follows the oldest pending row.
        await wait_for(lambda: metrics.OUTBOX_LAG._value.get() >= 90, what="lag gauge refreshed")
        first = metrics.OUTBOX_LAG._value.get()
        await wait_for(lambda: metrics.OUTBOX_LAG._value.get() > first, what="lag gauge rising")
        assert metrics.OUTBOX_PENDING._value.get() == 1
        assert await pool.fetchval("SELECT count(*) FROM outbox WHERE published_at IS NULL") == 1
    finally:
        relay.stop()
        await asyncio.wait_for(task, timeout=10)
        await broker.close()
        await proxy.close()


async def test_published_rows_are_purged_after_the_retention_period_and_pending_rows_never(
    infra, pool: asyncpg.Pool
) -> None:
    await add(pool, row("old", "k"), row("recent", "k"), row("pending", "k"))
    await pool.execute(
        """
        UPDATE outbox SET created_at = now() - interval '3 hours', published_at = now() - interval '2 hours'
        WHERE message_id = 'old';
        UPDATE outbox SET published_at = clock_timestamp() WHERE message_id = 'recent';
        """
    )
    broker = BrokerConnection(infra.amqp_url, TEST_TOPOLOGY)
    relay = Relay(pool, ConfirmingPublisher(broker), [INBOUND_EXCHANGE], retention_seconds=3600)
    assert await relay.purge() == 1
    assert sorted(r["message_id"] for r in await pool.fetch("SELECT message_id FROM outbox")) == [
        "pending",
        "recent",
    ]
    pending, lag = await relay.refresh_stats()
    assert pending == 1
    assert lag >= 0
    await broker.close()


async def test_two_relays_publish_every_row_exactly_once_between_them(
    infra, pool: asyncpg.Pool, queues: QueueInspector
) -> None:
    await add(pool, *(row(f"m{i}", f"chat-{i % 7}") for i in range(500)))
    brokers = [BrokerConnection(infra.amqp_url, TEST_TOPOLOGY, name=f"relay-{i}") for i in range(2)]
    relays = [Relay(pool, ConfirmingPublisher(b), [INBOUND_EXCHANGE], batch_size=50) for b in brokers]

    async def drain(relay: Relay) -> int:
        total = 0
        while n := await relay.run_once():
            total += n
        return total

    try:
        counts = await asyncio.gather(*(drain(r) for r in relays))
    finally:
        for b in brokers:
            await b.close()
    assert sum(counts) == 500
    messages = await queues.drain(COALESCER_QUEUE)
    assert len(messages) == 500
    assert len({m.message_id for m in messages}) == 500


async def test_a_chat_whose_head_row_another_relay_holds_publishes_nothing_until_it_is_confirmed(
    infra, pool: asyncpg.Pool, queues: QueueInspector
) -> None:
    # Relay R has claimed x1 and is awaiting its confirm (its row lock is held); relay C
    # runs meanwhile. C must not publish x2 or x3 ahead of x1, but other chats go on.
    await add(pool, row("x1", "chat-x"), row("x2", "chat-x"), row("x3", "chat-x"), row("y1", "chat-y"))
    broker = BrokerConnection(infra.amqp_url, TEST_TOPOLOGY)
    relay_c = Relay(pool, ConfirmingPublisher(broker), [INBOUND_EXCHANGE])
    try:
        async with pool.acquire() as holder, holder.transaction():
            await holder.execute("SELECT 1 FROM outbox WHERE message_id = 'x1' FOR UPDATE")
            assert await relay_c.run_once() == 1
            assert [m.message_id for m in await queues.drain(COALESCER_QUEUE)] == ["y1"]
        # R let go of x1 unpublished (say its connection dropped): the chat goes on in order.
        published = []
        while n := await relay_c.run_once():
            assert n == 1, "a chat has at most one row in flight"
            published += [m.message_id for m in await queues.drain(COALESCER_QUEUE)]
        assert published == ["x1", "x2", "x3"]
    finally:
        await broker.close()


async def test_a_relay_publishes_only_the_exchanges_it_owns(
    infra, pool: asyncpg.Pool, queues: QueueInspector
) -> None:
    await add(pool, row("in-1", "chat-1"), row("job-1", "chat-1", exchange=JOBS_EXCHANGE, rk="reply"))
    broker = BrokerConnection(infra.amqp_url, TEST_TOPOLOGY)
    try:
        assert await Relay(pool, ConfirmingPublisher(broker), [JOBS_EXCHANGE]).run_once() == 1
    finally:
        await broker.close()
    pending = await pool.fetch("SELECT message_id FROM outbox WHERE published_at IS NULL")
    assert [r["message_id"] for r in pending] == ["in-1"]
    assert [m.message_id for m in await queues.drain(RESPONDER_QUEUE)] == ["job-1"]


async def test_a_chat_with_a_long_backlog_takes_one_row_of_a_batch_and_the_other_chats_go_with_it(
    infra, pool: asyncpg.Pool, queues: QueueInspector
) -> None:
    await add(pool, *(row(f"hot-{i}", "chat-hot") for i in range(300)))
    await add(pool, *(row(f"other-{i}", f"chat-{i}") for i in range(50)))
    broker = BrokerConnection(infra.amqp_url, TEST_TOPOLOGY)
    try:
        assert (
            await Relay(pool, ConfirmingPublisher(broker), [INBOUND_EXCHANGE], batch_size=200).run_once()
            == 51
        )
    finally:
        await broker.close()
    published = [m.message_id for m in await queues.drain(COALESCER_QUEUE)]
    assert sorted(published) == sorted(["hot-0", *(f"other-{i}" for i in range(50))])


async def test_a_relay_of_several_exchanges_takes_the_oldest_rows_of_them_all_batch_by_batch(
    infra, pool: asyncpg.Pool, queues: QueueInspector
) -> None:
    # Interleaved ids: in-0, job-0, in-1, job-1, ...; a batch of 3 takes the three oldest,
    # whichever exchange they are on, and the rows it does not take wait for the next.
    for i in range(4):
        await add(pool, row(f"in-{i}", f"chat-in-{i}"))
        await add(pool, row(f"job-{i}", f"chat-job-{i}", exchange=JOBS_EXCHANGE, rk="reply"))
    broker = BrokerConnection(infra.amqp_url, TEST_TOPOLOGY)
    relay = Relay(pool, ConfirmingPublisher(broker), [JOBS_EXCHANGE, INBOUND_EXCHANGE], batch_size=3)
    batches = []
    try:
        while await relay.run_once():
            batches.append(
                [
                    r["message_id"]
                    for r in await pool.fetch(
                        "SELECT message_id FROM outbox WHERE published_at IS NOT NULL AND NOT (message_id = ANY($1))"
                        " ORDER BY id",
                        [m for b in batches for m in b],
                    )
                ]
            )
    finally:
        await broker.close()
    assert batches == [["in-0", "job-0", "in-1"], ["job-1", "in-2", "job-2"], ["in-3", "job-3"]]
    assert sorted(m.message_id for m in await queues.drain(COALESCER_QUEUE)) == [f"in-{i}" for i in range(4)]
    assert sorted(m.message_id for m in await queues.drain(RESPONDER_QUEUE)) == [f"job-{i}" for i in range(4)]


async def test_a_relay_given_one_exchange_twice_publishes_each_row_once(
    infra, pool: asyncpg.Pool, queues: QueueInspector
) -> None:
    await add(pool, row("a1", "chat-a"), row("b1", "chat-b"))
    broker = BrokerConnection(infra.amqp_url, TEST_TOPOLOGY)
    try:
        relay = Relay(pool, ConfirmingPublisher(broker), [INBOUND_EXCHANGE, INBOUND_EXCHANGE])
        assert await relay.run_once() == 2
        assert await relay.run_once() == 0
    finally:
        await broker.close()
    assert sorted(m.message_id for m in await queues.drain(COALESCER_QUEUE)) == ["a1", "b1"]


async def test_a_postgres_outage_leaves_the_relays_broker_connection_alone_and_readiness_names_postgres_alone(
    settings, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 40, point 5: the relay dropped its broker connection after every failed pass,
    whatever failed (35 reconnects in 65 s while Postgres was away), so the receiver's
    /readyz blamed RabbitMQ too."""
    database_url = settings.database_url.get_secret_value()
    proxy = await proxy_for(database_url)
    behind = replace(settings, database_url=through(database_url, proxy), relay_poll_seconds=0.1)
    try:
        async with running_receiver(behind) as (receiver, client):
            runtime = receiver.public.state.runtime
            await wait_for(lambda: runtime.broker.is_open, what="the relay's broker connection")
            first = await runtime.broker.connect()
            proxy.block()  # Postgres away (every connection cut, new ones refused)
            await wait_for(
                lambda: (
                    sum(r.name == "shared.outbox" and r.levelname == "WARNING" for r in caplog.records) >= 4
                ),
                what="four failed relay passes",
            )
            assert not first.is_closed, "the relay closed its broker connection over a Postgres error"
            assert await runtime.broker.connect() is first
            doc = await client.get("/readyz")
            assert (doc.status_code, doc.json()["status"]) == (
                200,
                "degraded",
            )  # in rotation: it holds webhooks
            assert doc.json()["failing"] == ["postgres"], doc.json()
            assert doc.json()["checks"]["rabbitmq"] == "ok"
            text = (await client.get("/metrics")).text
            assert 'chatq_ready{check="postgres"} 0.0' in text
            assert 'chatq_ready{check="rabbitmq"} 1.0' in text
            assert "chatq_in_process_retries_total{error=" in text and 'where="outbox-relay"' in text
            assert 'chatq_gauges_refreshed_timestamp_seconds{gauges="backlog"}' in text
            proxy.unblock()
            await wait_for(_ready_again(client), what="ready again")
    finally:
        await proxy.close()


def _ready_again(client):
    async def ready() -> bool:
        return (await client.get("/readyz")).json()["status"] == "ok"

    return ready
