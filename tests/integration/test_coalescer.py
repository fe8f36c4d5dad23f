"""The coalescer against real Postgres and RabbitMQ: one job per burst, in platform order,
one job in flight per chat, redeliveries change nothing, replicas emit each window once."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator

import asyncpg
import pytest
from prometheus_client import REGISTRY

from services.coalescer.app import inbound_consumer, policy_from
from services.coalescer.service import Coalescer, job_id_for
from shared.broker.connection import BrokerConnection
from shared.broker.publisher import ConfirmingPublisher, OutgoingMessage
from shared.broker.topology import (
    COALESCER_DEAD_QUEUE,
    COALESCER_QUEUE,
    INBOUND_EXCHANGE,
    RESPONDER_QUEUE,
    inbound_routing_key,
)
from shared.messages import InboundMessage, ReplyJob
from shared.settings import Settings
from tests.conftest import ADMIN_TOKEN, TELEGRAM_SECRET, TEST_TOPOLOGY, replace
from tests.support.broker import QueueInspector, wait_for
from tests.support.invariants import assert_coalescing_invariants
from tests.support.payloads import telegram_update
from tests.support.receiver import running_receiver
from tests.support.responder_standin import answer_jobs_until_all_covered
from tests.support.services import running_coalescers

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("clean")]

TG = {"X-Telegram-Bot-Api-Secret-Token": TELEGRAM_SECRET}


@pytest.fixture
def quick(settings):
    """Short human-like timing: a burst within 1.5 s is one window."""
    return replace(
        settings,
        quiet_seconds=0.7,
        reply_delay_min_seconds=1.0,
        reply_delay_max_seconds=1.0,
        max_wait_seconds=5.0,
        coalescer_poll_seconds=0.1,
        relay_poll_seconds=0.1,
        metrics_port=0,
        requeue_pause_seconds=0.05,
    )


async def jobs_on_queue(queues: QueueInspector, n: int, *, within: float = 20) -> list[ReplyJob]:
    got: list[ReplyJob] = []

    async def enough() -> bool:
        got.extend(ReplyJob.from_bytes(m.body) for m in await queues.drain(RESPONDER_QUEUE))
        return len(got) >= n

    await wait_for(enough, within=within, what=f"{n} job(s) on {RESPONDER_QUEUE}")
    return got


async def test_a_burst_of_three_messages_in_one_chat_gives_one_job_with_all_three_in_order(
    quick, pool: asyncpg.Pool, queues: QueueInspector
) -> None:
    texts = ["Hello", "Still available?", "Do you deliver?"]
    async with running_receiver(quick) as (_, client), running_coalescers(quick):
        for i, text in enumerate(texts, start=1):
            r = await client.post(
                "/v1/webhooks/telegram", json=telegram_update(100 + i, chat_id=5, text=text), headers=TG
            )
            assert r.status_code == 200
        (job,) = await jobs_on_queue(queues, 1)
        assert [m.text for m in job.messages] == texts
        assert (job.platform, job.chat_id) == ("telegram", "5")
        status = (
            await client.get(
                f"/v1/operations/{job.messages[0].operation_id}",
                headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
            )
        ).json()
        assert status["status"] == "waiting"
        assert status["status_text"] == "waiting for the buyer to finish typing"
        assert status["job"] == {"id": str(job.job_id), "status": "pending"}
    assert job.job_id == job_id_for(job.window_id)
    assert await queues.depth(RESPONDER_QUEUE) == 0
    await assert_coalescing_invariants(pool)


async def test_two_chats_interleaved_give_two_jobs_each_with_its_own_messages(
    quick, pool: asyncpg.Pool, queues: QueueInspector
) -> None:
    async with running_receiver(quick) as (_, client), running_coalescers(quick):
        for i in range(6):
            chat = 1 + i % 2
            await client.post(
                "/v1/webhooks/telegram",
                json=telegram_update(200 + i, chat_id=chat, text=f"c{chat}-m{i}"),
                headers=TG,
            )
        jobs = await jobs_on_queue(queues, 2)
    by_chat = {j.chat_id: [m.text for m in j.messages] for j in jobs}
    assert by_chat == {"1": ["c1-m0", "c1-m2", "c1-m4"], "2": ["c2-m1", "c2-m3", "c2-m5"]}
    await assert_coalescing_invariants(pool)


def inbound(op_id: uuid.UUID, chat: str = "9", n: int = 1) -> InboundMessage:
    from datetime import UTC, datetime

    now = datetime.now(UTC)
    return InboundMessage(
        operation_id=op_id,
        platform="telegram",
        account_id="4242",
        chat_id=chat,
        message_id=str(n),
        author_id="1",
        text=f"m{n}",
        sent_at=now,
        received_at=now,
    )


async def stored(pool: asyncpg.Pool, chat: str, n: int) -> InboundMessage:
    msg = inbound(uuid.uuid4(), chat, n)
    await pool.execute(
        """
        INSERT INTO operations (id, platform, account_id, chat_id, message_id, author_id, text, sent_at,
                                status, received_at, payload)
        VALUES ($1, 'telegram', '4242', $2, $3, '1', $4, $5, 'queued', $5, '{}')
        """,
        msg.operation_id,
        chat,
        msg.message_id,
        msg.text,
        msg.sent_at,
    )
    return msg


async def test_a_message_arriving_while_the_chats_job_is_in_flight_waits_for_that_job_to_end(
    quick, pool: asyncpg.Pool
) -> None:
    zero = replace(
        quick, reply_delay_min_seconds=0, reply_delay_max_seconds=0, quiet_seconds=0, max_wait_seconds=0
    )
    coalescer = Coalescer(pool, policy_from(zero))
    first = await stored(pool, "9", 1)
    await coalescer.file(first)
    assert await coalescer.emit_due() == 1
    second = await stored(pool, "9", 2)
    await coalescer.file(second)
    # Due at once, but the chat's first job is still pending: nothing is emitted.
    assert await coalescer.emit_due() == 0
    await pool.execute("UPDATE reply_jobs SET status = 'processing'")
    assert await coalescer.emit_due() == 0
    await pool.execute("UPDATE reply_jobs SET status = 'sent', reply_text = '(stand-in)', sent_at = now()")
    assert await coalescer.emit_due() == 1
    jobs = await pool.fetch("SELECT operation_ids FROM reply_jobs ORDER BY created_at")
    assert [list(j["operation_ids"]) for j in jobs] == [[first.operation_id], [second.operation_id]]
    await assert_coalescing_invariants(pool)


async def test_a_redelivered_inbound_message_changes_nothing(quick, pool: asyncpg.Pool) -> None:
    coalescer = Coalescer(pool, policy_from(quick))
    msg = await stored(pool, "9", 1)
    filed = await coalescer.file(msg)
    assert filed is not None and filed.opened
    before = await pool.fetchrow("SELECT due_at, message_count FROM chat_windows")
    assert await coalescer.file(msg) is None
    after = await pool.fetchrow("SELECT due_at, message_count FROM chat_windows")
    assert tuple(after) == tuple(before)
    assert await pool.fetchval("SELECT count(*) FROM window_messages") == 1


async def test_a_burst_pushes_due_out_by_quiet_seconds_but_never_past_max_wait(
    quick, pool: asyncpg.Pool
) -> None:
    policy = replace(
        quick, quiet_seconds=10, reply_delay_min_seconds=0, reply_delay_max_seconds=0, max_wait_seconds=15
    )
    coalescer = Coalescer(pool, policy_from(policy))
    a = await coalescer.file(await stored(pool, "9", 1))
    b = await coalescer.file(await stored(pool, "9", 2))
    assert a and b and a.window_id == b.window_id
    assert b.due_at > a.due_at
    row = await pool.fetchrow("SELECT first_at, due_at, deadline_at FROM chat_windows")
    assert (row["deadline_at"] - row["first_at"]).total_seconds() == 15
    assert row["due_at"] <= row["deadline_at"]


async def test_two_coalescer_replicas_emit_every_window_exactly_once(
    quick, pool: asyncpg.Pool, queues: QueueInspector
) -> None:
    fast = replace(
        quick, quiet_seconds=0.3, reply_delay_min_seconds=0.2, reply_delay_max_seconds=0.6, max_wait_seconds=2
    )
    chats, per_chat = 40, 3
    async with running_receiver(fast) as (_, client), running_coalescers(fast, replicas=2):
        posts = [
            client.post(
                "/v1/webhooks/telegram",
                json=telegram_update(1000 + c * 10 + m, chat_id=500 + c, message_id=m + 1, text=f"{c}/{m}"),
                headers=TG,
            )
            for m in range(per_chat)
            for c in range(chats)
        ]
        for r in await asyncio.gather(*posts):
            assert r.status_code == 200
        jobs = await answer_jobs_until_all_covered(pool, queues, within=30)
    assert len({j.job_id for j in jobs}) == len(jobs), "a job was published twice"
    covered = [m.operation_id for j in jobs for m in j.messages]
    assert len(covered) == len(set(covered)) == chats * per_chat
    assert await pool.fetchval("SELECT count(*) FROM reply_jobs") == await pool.fetchval(
        "SELECT count(*) FROM chat_windows WHERE status = 'closed'"
    )
    # Within every job, messages are in the chat's order.
    for j in jobs:
        numbers = [int(m.message_id) for m in j.messages]
        assert numbers == sorted(numbers)
    await assert_coalescing_invariants(pool)


async def test_a_malformed_message_on_the_inbound_queue_is_dead_lettered_and_recorded(
    quick, infra, pool
) -> None:
    import aio_pika

    from shared.broker.topology import COALESCER_DEAD_QUEUE, INBOUND_EXCHANGE

    async with running_coalescers(quick):
        connection = await aio_pika.connect(infra.amqp_url)
        channel = await connection.channel()
        exchange = await channel.get_exchange(INBOUND_EXCHANGE)
        await exchange.publish(
            aio_pika.Message(b'{"schema": "nope"}', message_id="bad-1"), routing_key="inbound.x"
        )
        await connection.close()
        dead = await wait_for(
            lambda: pool.fetch(
                "SELECT message_id, reason, body FROM dead_letters WHERE queue = $1", COALESCER_DEAD_QUEUE
            ),
            what="the message recorded from chatq.coalescer.dead",
        )
    assert [(d["message_id"], d["body"]) for d in dead] == [("bad-1", b'{"schema": "nope"}')]
    assert dead[0]["reason"].startswith("rejected in chatq.coalescer")


async def received(pool: asyncpg.Pool, message_id: str, status: str, age: float) -> uuid.UUID:
    """An operation of chat telegram:bot:9 received ``age`` seconds ago."""
    op = uuid.uuid4()
    await pool.execute(
        """
        INSERT INTO operations (id, platform, account_id, chat_id, message_id, text, sent_at, status,
                                received_at, payload)
        VALUES ($1, 'telegram', 'bot', '9', $2, 'hi', now(), $3, now() - make_interval(secs => $4), '{}')
        """,
        op,
        message_id,
        status,
        age,
    )
    return op


async def window_of(pool: asyncpg.Pool, *, last_age: float, due_age: float) -> uuid.UUID:
    """An open window of chat telegram:bot:9 whose last message came ``last_age`` seconds
    ago and which fell due ``due_age`` seconds ago."""
    window = uuid.uuid4()
    await pool.execute(
        """
        INSERT INTO chat_windows (id, chat_key, platform, account_id, chat_id, status, first_at, last_at,
                                  deadline_at, due_at, delay_seconds, message_count)
        VALUES ($1, 'telegram:bot:9', 'telegram', 'bot', '9', 'open', now() - make_interval(secs => $2),
                now() - make_interval(secs => $2), now(), now() - make_interval(secs => $3), 1, 1)
        """,
        window,
        last_age,
        due_age,
    )
    return window


async def filed(pool: asyncpg.Pool, op: uuid.UUID, window: uuid.UUID) -> None:
    await pool.execute("UPDATE operations SET status = 'waiting' WHERE id = $1", op)
    await pool.execute("INSERT INTO window_messages (operation_id, window_id) VALUES ($1, $2)", op, window)


async def test_a_window_filed_behind_a_backlog_waits_for_the_rest_of_its_burst_in_transit(
    quick, pool
) -> None:
    """Both messages arrived 0.1 s apart 30 s ago; the first was filed late (its window due
    long since), the second is still queued: one reply must cover both."""
    coalescer = Coalescer(pool, policy_from(quick))
    first = await received(pool, "1", "queued", 30.0)
    second = await received(pool, "2", "queued", 29.9)
    await received(pool, "3", "queued", 5.0)  # received after the window fell due: not awaited
    window = await window_of(pool, last_age=30.0, due_age=29.0)
    await filed(pool, first, window)

    assert await coalescer.emit_due() == 0, "message 2 of the burst is on its way to this window"
    await filed(pool, second, window)
    assert await coalescer.emit_due() == 1
    assert await pool.fetchval("SELECT operation_ids FROM reply_jobs") == [first, second]


async def test_a_due_window_waits_while_an_earlier_message_of_its_chat_is_in_transit(quick, pool) -> None:
    coalescer = Coalescer(pool, policy_from(quick))
    early = await received(pool, "1", "queued", 3)
    late = await received(pool, "2", "queued", 1)
    window = await window_of(pool, last_age=0, due_age=0)
    await filed(pool, late, window)

    assert await coalescer.emit_due() == 0, "message 1 is still on its way to this window"
    assert await coalescer.seconds_to_next_due() is None  # and the scheduler does not spin on it
    await filed(pool, early, window)
    assert await coalescer.emit_due() == 1
    job = await pool.fetchval("SELECT operation_ids FROM reply_jobs")
    assert job == [early, late]


# ---- filing in batches -------------------------------------------------------------------


@contextlib.asynccontextmanager
async def consuming_inbound(settings: Settings, pool: asyncpg.Pool) -> AsyncIterator[None]:
    """The coalescer's inbound consumer, as its composition root builds it, on its own
    connection; stopped (what it holds unacked goes back to the queue) on the way out."""
    broker = BrokerConnection(settings.amqp_url.get_secret_value(), TEST_TOPOLOGY, name="test-coalescer")
    coalescer = Coalescer(pool, policy_from(settings))
    consumer = inbound_consumer(broker, coalescer, settings, TEST_TOPOLOGY)
    task = asyncio.create_task(consumer.run())
    try:
        yield
    finally:
        await consumer.stop(drain_seconds=5)
        await asyncio.wait_for(task, timeout=10)
        await broker.close()


async def publish_inbound(settings: Settings, messages: list[InboundMessage]) -> None:
    broker = BrokerConnection(settings.amqp_url.get_secret_value(), TEST_TOPOLOGY, name="test-publisher")
    errors = await ConfirmingPublisher(broker).publish_many(
        [
            OutgoingMessage(
                INBOUND_EXCHANGE, inbound_routing_key(m.platform), str(m.operation_id), m.to_bytes()
            )
            for m in messages
        ]
    )
    await broker.close()
    assert errors == [None] * len(messages)


def histogram(name: str, **labels: str) -> tuple[float, float]:
    """(observations, their sum) of a histogram of this process so far."""
    count = REGISTRY.get_sample_value(f"{name}_count", labels) or 0.0
    return count, REGISTRY.get_sample_value(f"{name}_sum", labels) or 0.0


async def test_a_batch_of_messages_from_several_chats_is_filed_in_one_transaction_and_acked_with_one_ack(
    quick, pool: asyncpg.Pool, queues: QueueInspector
) -> None:
    batched = replace(quick, coalescer_file_batch_messages=6, coalescer_file_batch_wait_ms=50)
    chats = ["31", "32", "31", "33", "32", "31"]
    messages = [await stored(pool, chat, n) for n, chat in enumerate(chats, start=1)]
    await publish_inbound(batched, messages)
    commits_before = histogram("chatq_coalescer_batch_messages")
    acks_before = histogram("chatq_consumer_ack_messages", queue=COALESCER_QUEUE)
    async with consuming_inbound(batched, pool):
        await wait_for(
            lambda: histogram("chatq_consumer_ack_messages", queue=COALESCER_QUEUE) != acks_before,
            what="the batch acked",
        )
    commits_after = histogram("chatq_coalescer_batch_messages")
    acks_after = histogram("chatq_consumer_ack_messages", queue=COALESCER_QUEUE)
    # One committed transaction filed all six; one ack settled all six.
    assert (commits_after[0] - commits_before[0], commits_after[1] - commits_before[1]) == (1, 6)
    assert (acks_after[0] - acks_before[0], acks_after[1] - acks_before[1]) == (1, 6)
    assert await queues.depth(COALESCER_QUEUE) == 0, "a message of the batch went back to the queue"
    windows = {
        r["chat_id"]: r
        for r in await pool.fetch("SELECT chat_id, first_at, last_at, message_count FROM chat_windows")
    }
    assert {chat: w["message_count"] for chat, w in windows.items()} == {"31": 3, "32": 2, "33": 1}
    # A chat's messages folded in delivery order: its window opened with the first.
    assert windows["31"]["first_at"] == messages[0].received_at
    assert windows["31"]["last_at"] == messages[5].received_at
    statuses = await pool.fetch("SELECT DISTINCT status FROM operations")
    assert [r["status"] for r in statuses] == ["waiting"]
    events = await pool.fetch("SELECT kind, count(*) AS n FROM operation_events GROUP BY kind")
    assert [(r["kind"], r["n"]) for r in events] == [("filed", 6)]
    await assert_coalescing_invariants(pool)


async def test_a_poison_message_in_a_batch_is_dead_lettered_alone_and_the_others_are_filed(
    quick, pool: asyncpg.Pool, queues: QueueInspector
) -> None:
    batched = replace(quick, coalescer_file_batch_messages=3, coalescer_file_batch_wait_ms=50)
    first, poison, last = [await stored(pool, chat, n) for n, chat in enumerate(["41", "42", "41"], start=1)]
    # Its operation is in the inbox, but the message names a chat Postgres cannot store
    # (a NUL): filing it fails with a data error, and with it the batch's statement.
    poison = poison.model_copy(update={"chat_id": "42\x00"})
    await publish_inbound(batched, [first, poison, last])
    async with consuming_inbound(batched, pool):
        await wait_for(
            lambda: pool.fetchval("SELECT count(*) = 2 FROM window_messages"), what="the good messages filed"
        )
        # The poison message is redelivered alone until its queue's delivery limit, then
        # given up on (its operation fails, with the reason, for a person) and dead-lettered.
        failed = await wait_for(
            lambda: pool.fetchrow(
                "SELECT status, status_reason FROM operations WHERE id = $1 AND status = 'failed'",
                poison.operation_id,
            ),
            within=60,
            what="the poison message given up on",
        )
    assert "CharacterNotInRepertoireError" in failed["status_reason"]
    assert await pool.fetchval("SELECT message_count FROM chat_windows WHERE chat_id = '41'") == 2
    statuses = await pool.fetch("SELECT id, status FROM operations ORDER BY received_at")
    assert [(r["id"], r["status"]) for r in statuses] == [
        (first.operation_id, "waiting"),
        (poison.operation_id, "failed"),
        (last.operation_id, "waiting"),
    ]
    assert await queues.depth(COALESCER_QUEUE) == 0
    await wait_for(lambda: queues.depth(COALESCER_DEAD_QUEUE), what="the poison message dead-lettered")
    (dead,) = await queues.drain(COALESCER_DEAD_QUEUE)
    assert dead.message_id == str(poison.operation_id)


async def test_a_redelivered_batch_files_nothing_twice(
    quick, pool: asyncpg.Pool, queues: QueueInspector
) -> None:
    batched = replace(quick, coalescer_file_batch_messages=8, coalescer_file_batch_wait_ms=50)
    messages = [await stored(pool, chat, n) for n, chat in enumerate(["51", "52", "51"], start=1)]
    # The relay publishes at least once: each message twice, the copies in the same batch.
    await publish_inbound(batched, messages + messages)
    async with consuming_inbound(batched, pool):
        await wait_for(
            lambda: pool.fetchval("SELECT count(*) = 3 FROM window_messages"), what="the batch filed"
        )
        before = await pool.fetch("SELECT id, due_at, message_count FROM chat_windows ORDER BY id")
        # And the whole batch once more, after it was filed.
        acks = histogram("chatq_consumer_ack_messages", queue=COALESCER_QUEUE)
        await publish_inbound(batched, messages)
        await wait_for(
            lambda: histogram("chatq_consumer_ack_messages", queue=COALESCER_QUEUE)[1] >= acks[1] + 3,
            what="the redelivered batch acked",
        )
    assert await pool.fetch("SELECT id, due_at, message_count FROM chat_windows ORDER BY id") == before
    assert sorted(r["message_count"] for r in before) == [1, 2]
    assert await pool.fetchval("SELECT count(*) FROM window_messages") == 3
    events = await pool.fetch("SELECT kind, count(*) AS n FROM operation_events GROUP BY kind")
    assert [(r["kind"], r["n"]) for r in events] == [("filed", 3)]
    assert await queues.depth(COALESCER_QUEUE) == 0
    await assert_coalescing_invariants(pool)


# ---- a claim racing a filing -------------------------------------------------------------

#: The advisory lock a claim waits for between its snapshot and its row locks.
CLAIM_PAUSE_KEY = 0x63686174_70617573  # "chatpaus"


@contextlib.asynccontextmanager
async def claims_paused_before_their_locks(pool: asyncpg.Pool) -> AsyncIterator[asyncpg.Connection]:
    """Holds every claim of due windows between its statement's snapshot and its window
    locks, until the yielded connection releases CLAIM_PAUSE_KEY: the in-transit check the
    claim runs for each placed window (chatq_earlier_in_transit) first waits for that lock.
    The function is put back on the way out."""
    signature = "chatq_earlier_in_transit(text, text, text, timestamptz)"
    async with pool.acquire() as conn:
        original = await conn.fetchval("SELECT pg_get_functiondef($1::regprocedure)", signature)
        await conn.execute(
            f"""
            CREATE OR REPLACE FUNCTION chatq_earlier_in_transit(
                p_platform text, p_account_id text, p_chat_id text, p_before timestamptz
            ) RETURNS boolean LANGUAGE plpgsql VOLATILE AS $$
            BEGIN
                PERFORM pg_advisory_xact_lock_shared({CLAIM_PAUSE_KEY});
                RETURN EXISTS (
                    SELECT 1 FROM operations t
                    WHERE t.platform = p_platform AND t.account_id = p_account_id AND t.chat_id = p_chat_id
                      AND t.status IN ('accepted', 'queued') AND t.received_at < p_before
                      AND t.received_at > clock_timestamp() - interval '60 seconds');
            END
            $$
            """
        )
        await conn.execute("SELECT pg_advisory_lock($1)", CLAIM_PAUSE_KEY)
        try:
            yield conn
        finally:
            await conn.execute("SELECT pg_advisory_unlock_all()")
            await conn.execute(original)


async def a_claim_waits_for_the_pause(pool: asyncpg.Pool) -> bool:
    return bool(
        await pool.fetchval(
            """
            SELECT count(*) FROM pg_stat_activity
            WHERE datname = current_database() AND wait_event_type = 'Lock' AND wait_event = 'advisory'
            """
        )
    )


async def test_a_message_filed_into_a_due_window_while_it_is_being_claimed_is_in_its_job(
    quick, pool: asyncpg.Pool
) -> None:
    """A window past its deadline stays due while the buyer writes on (its account at its
    fair share, the scheduler behind): a message filed into it commits after a claim's
    snapshot but before the claim locks the window. The claim then locks the window as the
    filing left it, and its job must carry that message too: the window closes with it."""
    zero = replace(
        quick, reply_delay_min_seconds=0, reply_delay_max_seconds=0, quiet_seconds=0, max_wait_seconds=0
    )
    coalescer = Coalescer(pool, policy_from(zero))
    first = await stored(pool, "9", 1)
    await coalescer.file(first)
    async with claims_paused_before_their_locks(pool) as pause:
        emitting = asyncio.create_task(coalescer.emit_due())
        await wait_for(lambda: a_claim_waits_for_the_pause(pool), within=10, what="the claim to pause")
        second = await stored(pool, "9", 2)
        filed_second = await coalescer.file(second)
        assert filed_second is not None and not filed_second.opened, "the message joins the due window"
        await pause.execute("SELECT pg_advisory_unlock($1)", CLAIM_PAUSE_KEY)
        assert await asyncio.wait_for(emitting, timeout=10) == 1
    assert await pool.fetchval("SELECT operation_ids FROM reply_jobs") == [
        first.operation_id,
        second.operation_id,
    ]
    await assert_coalescing_invariants(pool)
