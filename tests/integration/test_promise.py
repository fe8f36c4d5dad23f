"""The promise under checks that do not share our assumptions (issue 13): a buyer message
is answered or goes to a person with a reason, never "ignored" because a later one was
answered; an unknown outcome never becomes "failed" and a person's retry never answers
twice; a consumer never stalls holding a message; a dead letter never mutes a chat; a
busy copy never spends attempts; a gateway's 502/504 on a send is an unknown outcome.

Each test drives the real services in-process against real Postgres and RabbitMQ and the
fake platforms, and follows the failure until it is exhausted, then what a person does
next."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence

import aio_pika
import asyncpg
import httpx
import pytest

from services.responder.app import build_platforms
from services.responder.handler import Responder
from shared.alerts import Alerter
from shared.broker.connection import BrokerConnection
from shared.broker.consumer import Consumer, RetryLater, RetryTiers
from shared.broker.delivery import Delivery
from shared.broker.publisher import ConfirmingPublisher
from shared.broker.topology import (
    DEAD_EXCHANGE,
    JOB_ROUTING_KEY,
    JOBS_EXCHANGE,
    RESPONDER_DEAD_QUEUE,
    RESPONDER_QUEUE,
    build_topology,
)
from shared.metrics import RETRIES
from shared.ops_http import consumer_readiness
from shared.retry import ATTEMPT_HEADER
from shared.state.job import lock_key
from stores.jobs.postgres import JobStore
from stores.jobs.protocol import Turn
from tests.conftest import AVITO_SECRET, TEST_TOPOLOGY, replace
from tests.fakes.world import FakeWorld
from tests.integration.test_relay import via_proxy
from tests.support.broker import QueueInspector, wait_for
from tests.support.payloads import avito_webhook
from tests.support.pipeline import ADMIN, Pipeline
from tests.support.receiver import running_receiver
from tests.support.services import running_coalescers, running_responders
from tests.support.tcpproxy import TcpProxy

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("clean")]


async def avito(pipeline: Pipeline, message_id: str, chat: str, text: str = "Is it still available?") -> str:
    r = await pipeline.client.post(
        f"/v1/webhooks/avito/{AVITO_SECRET}", json=avito_webhook(message_id, chat_id=chat, text=text)
    )
    assert r.status_code == 200
    return r.json()["operation_id"]


# ---- 2. never "ignored" because a later message was answered first -------------------


async def test_a_persons_retry_of_a_failed_message_after_a_later_one_was_answered_ends_replied(
    pipeline: Pipeline, world: FakeWorld
) -> None:
    world.fail("telegram.send:50", "400")
    first = await pipeline.telegram(501, 50, "Do you deliver?")
    assert (await pipeline.settled(first))["status"] == "failed"
    second = await pipeline.telegram(502, 50, "And the price?")
    assert (await pipeline.settled(second))["status"] == "replied"

    r = await pipeline.client.post(f"/v1/operations/{first}/retry", headers=ADMIN, json={"by": "anna"})
    assert r.status_code == 202, r.text

    async def answered() -> dict | None:
        doc = await pipeline.status(first)
        return doc if doc["status"] not in ("accepted", "queued", "waiting", "replying") else None

    doc = await wait_for(answered, what="the retried message to settle")
    assert doc["status"] == "replied", doc
    assert len(world.replies_to("50")) == 2
    assert (
        doc["reply"]["platform_message_id"] != (await pipeline.status(second))["reply"]["platform_message_id"]
    )


# ---- 3. an unknown outcome is never "failed"; a retry never answers twice ------------


async def test_an_avito_send_whose_outcome_stays_unknown_ends_needs_review_and_keeps_its_claim(
    pipeline: Pipeline, world: FakeWorld, pool: asyncpg.Pool
) -> None:
    # The send went out and its answer was lost; every listing of the chat fails after.
    world.fail("avito.send", "lost")
    world.fail("avito.list", *["503"] * 20)
    op = await avito(pipeline, "u-1", "c-unknown")
    doc = await pipeline.settled(op, within=30)

    assert doc["status"] == "needs_review", doc
    assert doc["owner"] == "on-call"
    assert "may have reached the chat" in doc["status_text"]
    assert (
        await pool.fetchval("SELECT count(*) FROM reply_coverage WHERE operation_id = $1", uuid.UUID(op)) == 1
    )
    assert len(world.replies_to("c-unknown")) == 1

    # A retry without the person's confirmation sends nothing.
    r = await pipeline.client.post(f"/v1/operations/{op}/retry", headers=ADMIN)
    assert r.status_code == 409
    assert r.json()["error"]["code"] == "resend_not_confirmed"
    assert (await pipeline.status(op))["status"] == "needs_review"
    assert len(world.replies_to("c-unknown")) == 1


async def test_a_confirmed_resend_of_a_needs_review_message_is_recorded_and_sends_once_more(
    pipeline: Pipeline, world: FakeWorld, pool: asyncpg.Pool
) -> None:
    world.fail("telegram.send", "hang")  # nothing was sent, but the responder cannot know
    op = await pipeline.telegram(601, 60, "Hello?")
    doc = await pipeline.settled(op)
    assert doc["status"] == "needs_review"
    old_job = doc["job"]["id"]
    assert world.replies_to("60") == []

    r = await pipeline.client.post(
        f"/v1/operations/{op}/retry?resend=true",
        headers=ADMIN,
        json={"by": "anna", "note": "not in the chat"},
    )
    assert r.status_code == 202, r.text
    assert r.json()["resend"] is True
    doc = await pipeline.settled(op)
    assert doc["status"] == "replied"
    assert len(world.replies_to("60")) == 1
    assert (
        await pool.fetchval("SELECT status FROM reply_jobs WHERE id = $1", uuid.UUID(old_job)) == "superseded"
    )
    event = await pool.fetchrow(
        "SELECT kind, actor, detail FROM operation_events WHERE operation_id = $1 AND kind = 'retried'",
        uuid.UUID(op),
    )
    assert dict(event) == {
        "kind": "retried",
        "actor": "anna",
        "detail": "re-send confirmed by anna: not in the chat",
    }


# ---- 4. Avito reconciliation never takes an earlier reply for this one ----------------


async def test_reconciling_an_avito_send_does_not_take_an_earlier_identical_reply_for_it(
    pipeline: Pipeline, world: FakeWorld
) -> None:
    first = await avito(pipeline, "r-1", "c-twice", "Is it still available?")
    first_doc = await pipeline.settled(first)
    assert first_doc["status"] == "replied"
    # The same question again: the facts responder gives the same text. This send hangs
    # and does nothing, so the chat holds only the first reply, with the same text.
    world.fail("avito.send", "hang")
    second = await avito(pipeline, "r-2", "c-twice", "Is it still available?")
    second_doc = await pipeline.settled(second, within=30)

    assert second_doc["status"] == "replied"
    replies = [m for m in world.avito if m["chat_id"] == "c-twice"]
    assert len(replies) == 2, "the second message got a reply of its own"
    assert second_doc["reply"]["platform_message_id"] == replies[1]["id"]
    assert first_doc["reply"]["platform_message_id"] == replies[0]["id"]


# ---- 5. a retry tier that cannot be published to never stalls the consumer -----------


async def test_a_retry_tier_publish_that_fails_keeps_the_message_until_it_goes_and_readiness_shows_it(
    infra, pool: asyncpg.Pool, queues: QueueInspector
) -> None:
    target = infra.amqp_url.split("@", 1)[1].split("/", 1)[0]
    host, port = target.split(":")
    proxy = await TcpProxy(host, int(port)).start()
    # Its own retry tier of 0.3 s, declared here: not left to another test to have declared.
    topology = build_topology((0.3,))
    retry_broker = BrokerConnection(via_proxy(infra.amqp_url, proxy.port), topology, name="retry")
    broker = BrokerConnection(infra.amqp_url, topology, name="consume")
    calls: list[int] = []

    async def handler(message: Delivery) -> None:
        calls.append(int((message.headers or {}).get(ATTEMPT_HEADER, 1)))
        if len(calls) == 1:
            raise RetryLater("the platform is busy")

    consumer = Consumer(
        broker,
        RESPONDER_QUEUE,
        handler,
        prefetch=1,
        retry=RetryTiers(ConfirmingPublisher(retry_broker), [0.3], max_attempts=3),
    )
    ready = consumer_readiness(consumer, pool, stall_seconds=0.5)
    proxy.block()  # the retry publisher's connections are refused
    task = asyncio.create_task(consumer.run())
    try:
        await publish_job(infra.amqp_url, "j-stall")
        await wait_for(lambda: asyncio.sleep(0, consumer.oldest_unsettled_seconds() > 0.6), what="a stall")
        assert (await ready())["progress"].startswith("chatq.responder has held a message unsettled")
        proxy.unblock()
        await wait_for(lambda: asyncio.sleep(0, calls == [1, 2]), within=15, what="the retried delivery")
        await wait_for(lambda: asyncio.sleep(0, consumer.oldest_unsettled_seconds() == 0), what="settled")
        assert (await ready())["progress"] == "ok"
        assert await queues.depth(RESPONDER_QUEUE) == 0
    finally:
        await consumer.stop()
        task.cancel()
        await broker.close()
        await retry_broker.close()
        await proxy.close()


async def publish_job(amqp_url: str, message_id: str, body: bytes = b"{}", **headers: object) -> None:
    connection = await aio_pika.connect(amqp_url)
    try:
        channel = await connection.channel()
        exchange = await channel.get_exchange(JOBS_EXCHANGE)
        await exchange.publish(
            aio_pika.Message(body, message_id=message_id, headers=dict(headers)), routing_key=JOB_ROUTING_KEY
        )
    finally:
        await connection.close()


# ---- 6. no chat is muted by a dead letter ---------------------------------------------


class BrokenWriter:
    """A reply writer with a bug: raises something no failure class covers."""

    async def write(
        self, history: Sequence[Turn], batch: Sequence[str], listing: object = None, writing: object = None
    ) -> str:
        raise ZeroDivisionError("a bug in the reply logic")

    def instructions(self) -> str:
        return ""

    async def aclose(self) -> None:
        return None


async def test_a_job_that_crashes_its_handler_on_every_delivery_is_given_up_before_the_broker_limit(
    fast, infra, pool: asyncpg.Pool, world: FakeWorld
) -> None:
    async with running_receiver(fast) as (_, client), running_coalescers(fast):
        p = Pipeline(client, pool)
        op = await p.telegram(701, 70, "Hello?")
        await wait_for(lambda: queue_has(infra.amqp_url, RESPONDER_QUEUE), what="the job on the broker")
        # A responder whose reply logic has a bug that this job triggers on every delivery.
        broker = BrokerConnection(infra.amqp_url, TEST_TOPOLOGY, name="broken")
        async with httpx.AsyncClient() as http:
            broken = Responder(
                JobStore(pool), build_platforms(fast, http, pool), BrokenWriter(), Alerter(None, None, http)
            )
            consumer = Consumer(
                broker,
                RESPONDER_QUEUE,
                broken.handle,
                prefetch=1,
                on_give_up=broken.give_up,
                delivery_limit=TEST_TOPOLOGY.queue(RESPONDER_QUEUE).delivery_limit,
                requeue_pause=0.05,
            )
            task = asyncio.create_task(consumer.run())
            try:
                doc = await p.settled(op, within=30)
            finally:
                await consumer.stop()
                task.cancel()
                await broker.close()
        assert doc["status"] == "failed", doc
        assert "ZeroDivisionError" in doc["error"]["message"]
        assert doc["owner"] == "on-call"
        # Nothing stays in flight: the chat's next message is answered by a sound responder.
        async with running_responders(fast):
            nxt = await p.telegram(702, 70, "Anyone there?")
            assert (await p.settled(nxt))["status"] == "replied"


async def test_a_job_dead_lettered_without_a_give_up_is_recorded_and_frees_its_chat(
    fast, infra, pool: asyncpg.Pool, world: FakeWorld
) -> None:
    async with running_receiver(fast) as (_, client), running_coalescers(fast):
        p = Pipeline(client, pool)
        # No responder yet: the job waits in chatq.responder. Move it to the dead-letter
        # queue as the broker's delivery limit would after crashes, with no give-up.
        op = await p.telegram(801, 80, "Hello?")
        job_id = await wait_for(lambda: pool.fetchval("SELECT id FROM reply_jobs"), what="the job")
        await wait_for(lambda: queue_has(infra.amqp_url, RESPONDER_QUEUE), what="the job on the broker")
        await move_to_dead(infra.amqp_url)
        async with running_responders(fast):
            doc = await p.settled(op)
            assert doc["status"] == "failed"
            assert "redelivered past the queue's delivery limit" in doc["error"]["message"]
            assert doc["owner"] == "on-call"
            # The chat is not muted: its next message is answered.
            nxt = await p.telegram(802, 80, "Anyone there?")
            assert (await p.settled(nxt))["status"] == "replied"
    dead = await pool.fetchrow("SELECT queue, message_id FROM dead_letters")
    assert dict(dead) == {"queue": RESPONDER_DEAD_QUEUE, "message_id": str(job_id)}


async def queue_has(amqp_url: str, queue: str) -> bool:
    connection = await aio_pika.connect(amqp_url)
    try:
        channel = await connection.channel()
        q = await channel.declare_queue(queue, passive=True)
        return (q.declaration_result.message_count or 0) > 0
    finally:
        await connection.close()


async def move_to_dead(amqp_url: str) -> None:
    """Take the job off chatq.responder and put it on chatq.responder.dead with the headers
    the broker's delivery limit would give it."""
    connection = await aio_pika.connect(amqp_url)
    try:
        channel = await connection.channel()
        queue = await channel.get_queue(RESPONDER_QUEUE)
        message = await queue.get(fail=True)
        dead = await channel.get_exchange(DEAD_EXCHANGE)
        await dead.publish(
            aio_pika.Message(
                message.body,
                message_id=message.message_id,
                headers={"x-death": [{"reason": "delivery_limit", "queue": RESPONDER_QUEUE, "count": 1}]},
            ),
            routing_key="responder",
        )
        await message.ack()
    finally:
        await connection.close()


async def test_a_job_in_flight_that_nobody_holds_past_the_bound_is_published_again_and_answered(
    fast, pool: asyncpg.Pool, infra
) -> None:
    quick = replace(fast, stuck_job_seconds=2, stuck_job_sweep_seconds=0.5)
    async with running_receiver(quick) as (_, client), running_coalescers(quick):
        p = Pipeline(client, pool)
        op = await p.telegram(901, 90, "Hello?")
        await wait_for(lambda: queue_has(infra.amqp_url, RESPONDER_QUEUE), what="the job on the broker")
        # Its message is lost (a purge by hand): the job would hold its chat for ever.
        connection = await aio_pika.connect(infra.amqp_url)
        channel = await connection.channel()
        await (await channel.get_queue(RESPONDER_QUEUE)).purge()
        await connection.close()
        await pool.execute("UPDATE reply_jobs SET updated_at = now() - interval '1 minute'")
        async with running_responders(quick):
            doc = await p.settled(op, within=90)
    assert doc["status"] == "replied"
    job_id = await pool.fetchval("SELECT id::text FROM reply_jobs")
    published = await pool.fetch("SELECT headers FROM outbox WHERE message_id = $1 ORDER BY id", job_id)
    assert [r["headers"] for r in published] == [{}, {ATTEMPT_HEADER: 1}], "emitted, then published again"


# ---- 7. a busy copy spends no attempt -------------------------------------------------


async def test_a_copy_that_finds_the_job_busy_on_its_last_attempt_waits_instead_of_failing_it(
    fast, pool: asyncpg.Pool, infra, world: FakeWorld
) -> None:
    async with running_receiver(fast) as (_, client), running_coalescers(fast):
        p = Pipeline(client, pool)
        op = await p.telegram(1001, 100, "Hello?")
        job_id = await wait_for(lambda: pool.fetchval("SELECT id FROM reply_jobs"), what="the job")
        await wait_for(lambda: queue_has(infra.amqp_url, RESPONDER_QUEUE), what="the job on the broker")
        # Another handler holds the job (its platform call is in progress), and this copy
        # is on the last attempt the settings allow.
        busy_before = RETRIES.labels(reason="busy")._value.get()
        async with pool.acquire() as holder:
            assert await holder.fetchval("SELECT pg_try_advisory_lock($1)", lock_key(job_id))
            await move_to_last_attempt(infra.amqp_url, fast.max_attempts)
            async with running_responders(fast):
                # The copy keeps finding the job busy and waiting on the shortest tier,
                # without giving up on it.
                await wait_for(
                    lambda: asyncio.sleep(0, RETRIES.labels(reason="busy")._value.get() >= busy_before + 3),
                    what="the busy copy to wait three times",
                )
                assert await pool.fetchval("SELECT status FROM reply_jobs WHERE id = $1", job_id) == "pending"
                await holder.execute("SELECT pg_advisory_unlock($1)", lock_key(job_id))
                doc = await p.settled(op, within=30)
    assert doc["status"] == "replied"
    assert len(world.replies_to("100")) == 1


async def move_to_last_attempt(amqp_url: str, attempt: int) -> None:
    connection = await aio_pika.connect(amqp_url)
    try:
        channel = await connection.channel()
        queue = await channel.get_queue(RESPONDER_QUEUE)
        message = await queue.get(fail=True)
        await publish_job(amqp_url, message.message_id or "", message.body, **{ATTEMPT_HEADER: attempt})
        await message.ack()
    finally:
        await connection.close()


# ---- 8. a gateway's 502/504 on a send may have acted ----------------------------------


async def test_a_telegram_502_on_a_send_goes_to_a_person_and_is_not_sent_again(
    pipeline: Pipeline, world: FakeWorld
) -> None:
    world.fail("telegram.send", "502")
    op = await pipeline.telegram(1101, 110, "Hello?")
    doc = await pipeline.settled(op)
    assert doc["status"] == "needs_review"
    assert "may have been sent" in doc["status_text"]
    assert world.replies_to("110") == []


async def test_a_generic_504_on_a_send_is_sent_again_under_the_same_idempotency_key(
    pipeline: Pipeline, world: FakeWorld, pool: asyncpg.Pool
) -> None:
    from tests.conftest import GENERIC_SECRET
    from tests.support.payloads import dumps, generic_message, signed

    world.fail("generic.send", "504")
    body = dumps(generic_message("g-504", chat_id="g-chat", text="Price?"))
    r = await pipeline.client.post(
        "/v1/webhooks/generic", content=body, headers=signed(GENERIC_SECRET, body, webhook_id="wh-504")
    )
    doc = await pipeline.settled(r.json()["operation_id"])
    assert doc["status"] == "replied"
    assert await pool.fetchval("SELECT error_kind FROM reply_jobs") is None
    (reply,) = world.generic
    assert reply["headers"]["idempotency-key"] == doc["job"]["id"]


# ---- what an independent review found next (the same promises, other paths) ----------


async def test_a_generic_send_whose_outcome_was_unknown_once_ends_needs_review_when_later_attempts_fail(
    pipeline: Pipeline, world: FakeWorld, pool: asyncpg.Pool
) -> None:
    # Attempt 1 reached the receiver and its answer was lost; every re-send under the key
    # then fails. A later clear failure must not make the job forget it may have sent.
    from tests.conftest import GENERIC_SECRET
    from tests.support.payloads import dumps, generic_message, signed

    world.fail("generic.send", "lost", "503", "503", "503", "503", "503")
    body = dumps(generic_message("g-u", chat_id="g-unknown", text="Price?"))
    r = await pipeline.client.post(
        "/v1/webhooks/generic", content=body, headers=signed(GENERIC_SECRET, body, webhook_id="wh-u")
    )
    op = r.json()["operation_id"]
    doc = await pipeline.settled(op, within=30)
    assert doc["status"] == "needs_review", doc
    assert (
        await pool.fetchval("SELECT count(*) FROM reply_coverage WHERE operation_id = $1", uuid.UUID(op)) == 1
    )
    refused = await pipeline.client.post(f"/v1/operations/{op}/retry", headers=ADMIN)
    assert refused.status_code == 409
    assert len(world.generic) == 1


async def test_reconciling_never_takes_a_reply_another_job_with_an_unknown_outcome_may_have_sent(
    pipeline: Pipeline, world: FakeWorld, pool: asyncpg.Pool
) -> None:
    # Job 1's send reached Avito but its answer was lost and the chat could not be listed
    # until its attempts ran out: needs_review, its reply in the chat unrecorded. Job 2
    # (same facts answer) hangs and does nothing. Job 2 must not take job 1's reply.
    world.fail("avito.send", "lost")
    world.fail("avito.list", *["503"] * 8)
    first = await avito(pipeline, "k-1", "c-rival", "Do you deliver?")
    assert (await pipeline.settled(first, within=30))["status"] == "needs_review"
    world.fail("avito.send", "hang")
    second = await avito(pipeline, "k-2", "c-rival", "Is delivery possible?")
    doc = await pipeline.settled(second, within=40)

    replies = [m for m in world.avito if m["chat_id"] == "c-rival"]
    if doc["status"] == "replied":
        # Only when the second job sent a reply of its own.
        assert doc["reply"]["platform_message_id"] != replies[0]["id"]
        assert len(replies) == 2
    else:
        assert doc["status"] == "needs_review", doc


async def test_an_avito_send_that_lands_after_the_timeout_is_found_not_sent_again(
    fast, pool: asyncpg.Pool, world: FakeWorld
) -> None:
    # The first send times out (1 s) and lands 4 s after the request: reading the chat right
    # away would find nothing and send the reply a second time.
    async with running_receiver(fast) as (_, client), running_coalescers(fast), running_responders(fast):
        p = Pipeline(client, pool)
        world.fail("avito.send", "late:4")
        op = await avito(p, "l-1", "c-late")
        doc = await p.settled(op, within=40)
        await wait_for(lambda: asyncio.sleep(0, world.pending_actions == 0), what="the late send to land")
    assert doc["status"] == "replied", doc
    replies = [m for m in world.avito if m["chat_id"] == "c-late"]
    assert len(replies) == 1
    assert doc["reply"]["platform_message_id"] == replies[0]["id"]
