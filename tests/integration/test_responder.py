"""The whole pipeline in-process against real Postgres and RabbitMQ and the fake
platforms: one reply per burst through Telegram, Avito and generic webhooks, retries
through the TTL tiers, dead letters, unknown outcomes, token expiry, folding."""

from __future__ import annotations

import asyncio

import aio_pika
import asyncpg
import pytest
from standardwebhooks.webhooks import Webhook

from shared.broker.connection import BrokerConnection
from shared.broker.consumer import Consumer
from shared.broker.topology import JOB_ROUTING_KEY, JOBS_EXCHANGE, RESPONDER_DEAD_QUEUE, RESPONDER_QUEUE
from tests.conftest import AVITO_SECRET, GENERIC_SECRET, TEST_TOPOLOGY, replace
from tests.fakes.world import FakeWorld
from tests.support.broker import QueueInspector, wait_for
from tests.support.payloads import avito_webhook, dumps, generic_message, signed
from tests.support.pipeline import Pipeline
from tests.support.receiver import running_receiver
from tests.support.services import running_coalescers, running_responders

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("clean")]


async def test_a_telegram_message_gets_one_reply_from_the_built_in_facts(
    pipeline: Pipeline, world: FakeWorld
) -> None:
    op = await pipeline.telegram(1, 42, "Hi! Do you deliver to Kazan?")
    doc = await pipeline.settled(op)
    assert doc["status"] == "replied"
    assert world.replies_to("42") == ["Hello! We ship across the country; delivery takes 2-5 days."]
    assert doc["reply"]["text"] == world.replies_to("42")[0]
    assert doc["reply"]["platform_message_id"] == str(world.telegram[0]["message_id"])
    assert doc["status_text"].startswith("reply sent at ")
    assert doc["job"]["status"] == "sent"


async def test_an_avito_message_is_answered_with_an_oauth_token_fetched_once(
    pipeline: Pipeline, world: FakeWorld
) -> None:
    url = f"/v1/webhooks/avito/{AVITO_SECRET}"
    ops = []
    for i, chat in enumerate(("c-1", "c-2")):
        r = await pipeline.client.post(
            url, json=avito_webhook(f"m-{i}", chat_id=chat, text="Is it still available?")
        )
        ops.append(r.json()["operation_id"])
    for op in ops:
        assert (await pipeline.settled(op))["status"] == "replied"
    assert sorted(m["chat_id"] for m in world.avito) == ["c-1", "c-2"]
    assert {m["user_id"] for m in world.avito} == {"777"}
    assert world.avito_token_requests == 1


async def test_a_generic_reply_is_signed_and_carries_an_idempotency_key(
    pipeline: Pipeline, world: FakeWorld, pool
) -> None:
    body = dumps(generic_message("g-1", chat_id="gc", text="What is the price?"))
    r = await pipeline.client.post(
        "/v1/webhooks/generic", content=body, headers=signed(GENERIC_SECRET, body, webhook_id="msg-g1")
    )
    doc = await pipeline.settled(r.json()["operation_id"])
    assert doc["status"] == "replied"
    (reply,) = world.generic
    assert reply["text"] == "Hello! The price in the listing is final."
    job_id = await pool.fetchval("SELECT id::text FROM reply_jobs")
    assert reply["headers"]["idempotency-key"] == job_id
    Webhook(GENERIC_SECRET).verify(reply["raw"], reply["headers"], json_parse=False)


async def test_two_5xx_then_success_give_exactly_one_reply_after_two_retries(
    pipeline: Pipeline, world: FakeWorld, pool
) -> None:
    world.fail("avito.send", "503", "500")
    r = await pipeline.client.post(
        f"/v1/webhooks/avito/{AVITO_SECRET}",
        json=avito_webhook("m-43", chat_id="c-43", text="Still available?"),
    )
    doc = await pipeline.settled(r.json()["operation_id"])
    assert doc["status"] == "replied"
    assert len(world.replies_to("c-43")) == 1
    assert await pool.fetchval("SELECT attempts FROM reply_jobs") == 3


async def test_a_telegram_5xx_on_a_send_goes_to_a_person_instead_of_a_blind_resend(
    pipeline: Pipeline, world: FakeWorld
) -> None:
    # Telegram has no idempotency key and no way to list a bot's messages: only failures
    # before the request reached it, and 429s, are retried (docs/platforms.md).
    world.fail("telegram.send", "503")
    op = await pipeline.telegram(2, 43, "Still available?")
    doc = await pipeline.settled(op)
    assert doc["status"] == "needs_review"
    assert world.replies_to("43") == []


async def dead_letters(pool: asyncpg.Pool, queue: str) -> list[asyncpg.Record]:
    return await pool.fetch("SELECT message_id, reason FROM dead_letters WHERE queue = $1 ORDER BY id", queue)


async def test_a_platform_that_always_fails_ends_failed_and_its_dead_letter_is_recorded_with_the_reason(
    pipeline: Pipeline, world: FakeWorld, pool: asyncpg.Pool
) -> None:
    world.fail("avito.send", *["503"] * 10)
    r = await pipeline.client.post(
        f"/v1/webhooks/avito/{AVITO_SECRET}", json=avito_webhook("m-44", chat_id="c-44")
    )
    doc = await pipeline.settled(r.json()["operation_id"], within=30)
    assert doc["status"] == "failed"
    assert "gave up after 4 attempts" in doc["error"]["message"]
    assert "HTTP 503" in doc["error"]["message"]
    assert doc["error"]["attempts"] == 4
    assert world.replies_to("c-44") == []
    dead = await wait_for(lambda: dead_letters(pool, RESPONDER_DEAD_QUEUE), what="the job's dead letter")
    assert [d["message_id"] for d in dead] == [doc["job"]["id"]]
    assert "rejected in chatq.responder" in dead[0]["reason"]
    await wait_for(
        lambda: [a for a in world.alerts if a["body"]["type"] == "operation.failed"], what="an alert"
    )


async def test_a_400_goes_straight_to_the_dead_letter_queue(
    pipeline: Pipeline, world: FakeWorld, pool
) -> None:
    world.fail("telegram.send", "400")
    op = await pipeline.telegram(4, 45, "Hello?")
    doc = await pipeline.settled(op)
    assert doc["status"] == "failed"
    assert "HTTP 400" in doc["error"]["message"]
    assert await pool.fetchval("SELECT attempts FROM reply_jobs") == 1
    assert len(await wait_for(lambda: dead_letters(pool, RESPONDER_DEAD_QUEUE), what="dead letter")) == 1


async def test_a_429_waits_at_least_its_retry_after_before_the_next_attempt(
    pipeline: Pipeline, world: FakeWorld, pool
) -> None:
    world.fail("telegram.send", "429:1")
    op = await pipeline.telegram(5, 46, "Hello?")
    doc = await pipeline.settled(op)
    assert doc["status"] == "replied"
    assert len(world.replies_to("46")) == 1
    first_try, replied = await pool.fetchrow("SELECT created_at, sent_at FROM reply_jobs")
    # Tiers are 0.3, 0.6 and 1.2 s: retry-after 1 s must pick the 1.2 s tier.
    assert (replied - first_try).total_seconds() >= 1.2


async def test_an_unknown_send_outcome_on_avito_is_reconciled_to_replied_without_a_second_send(
    pipeline: Pipeline, world: FakeWorld
) -> None:
    world.fail("avito.send", "lost")
    r = await pipeline.client.post(
        f"/v1/webhooks/avito/{AVITO_SECRET}", json=avito_webhook("m-9", chat_id="c-9")
    )
    doc = await pipeline.settled(r.json()["operation_id"])
    assert doc["status"] == "replied"
    assert len(world.replies_to("c-9")) == 1
    assert doc["reply"]["platform_message_id"] == world.avito[0]["id"]


async def test_an_unknown_send_outcome_on_telegram_needs_review_with_an_owner_and_is_never_resent(
    pipeline: Pipeline, world: FakeWorld
) -> None:
    world.fail("telegram.send", "lost")
    op = await pipeline.telegram(6, 47, "Hello?")
    doc = await pipeline.settled(op)
    assert doc["status"] == "needs_review"
    assert doc["owner"] == "on-call"
    assert "check the chat" in doc["status_text"]
    assert len(world.replies_to("47")) == 1
    alert = await wait_for(
        lambda: [a for a in world.alerts if a["body"]["type"] == "operation.needs_review"], what="alert"
    )
    assert alert[0]["body"]["owner"] == "on-call"
    assert alert[0]["body"]["operations"] == [op]
    Webhook(GENERIC_SECRET).verify(alert[0]["raw"], alert[0]["headers"], json_parse=False)


async def test_an_expired_avito_token_mid_run_is_refreshed_once_and_the_reply_goes_out(
    pipeline: Pipeline, world: FakeWorld
) -> None:
    url = f"/v1/webhooks/avito/{AVITO_SECRET}"
    r1 = await pipeline.client.post(url, json=avito_webhook("t-1", chat_id="t-1"))
    assert (await pipeline.settled(r1.json()["operation_id"]))["status"] == "replied"
    world.expire_avito_tokens()
    r2 = await pipeline.client.post(url, json=avito_webhook("t-2", chat_id="t-2"))
    assert (await pipeline.settled(r2.json()["operation_id"]))["status"] == "replied"
    assert world.avito_token_requests == 2
    assert len(world.avito) == 2


async def test_a_message_arriving_during_generation_is_folded_into_the_one_reply(
    fast, pool: asyncpg.Pool, world: FakeWorld
) -> None:
    with_llm = replace(fast, llm_base_url=f"{world.url}/v1", llm_timeout_seconds=5)
    world.fail("llm", "slow:1.5")
    async with (
        running_receiver(with_llm) as (_, client),
        running_coalescers(with_llm),
        running_responders(with_llm),
    ):
        p = Pipeline(client, pool)
        first = await p.telegram(10, 48, "Hello")
        await wait_for(lambda: world.llm_in_flight, what="the model to be generating")
        second = await p.telegram(11, 48, "Do you deliver?")
        a, b = await p.settled(first), await p.settled(second)
    assert a["status"] == b["status"] == "replied"
    assert a["job"]["id"] == b["job"]["id"]
    assert world.replies_to("48") == ["Answer to: Hello | Do you deliver?"]
    assert len(world.llm) == 2  # generated, then regenerated with the folded message
    assert await pool.fetchval("SELECT folded FROM reply_jobs") == 1


async def test_a_burst_of_chats_never_runs_more_model_calls_than_the_concurrency_limit(
    fast, pool: asyncpg.Pool, world: FakeWorld
) -> None:
    limited = replace(fast, llm_base_url=f"{world.url}/v1", responder_concurrency=3)
    world.fail("llm", *["slow:0.3"] * 15)
    async with (
        running_receiver(limited) as (_, client),
        running_coalescers(limited),
        running_responders(limited),
    ):
        p = Pipeline(client, pool)
        ops = [await p.telegram(100 + i, 600 + i, f"question {i}") for i in range(15)]
        for op in ops:
            assert (await p.settled(op))["status"] == "replied"
    assert world.llm_max_in_flight <= 3
    assert world.llm_max_in_flight >= 2  # it did run in parallel


async def test_a_job_that_keeps_crashing_its_handler_is_dead_lettered_by_the_delivery_limit(
    infra, queues: QueueInspector
) -> None:
    broker = BrokerConnection(infra.amqp_url, TEST_TOPOLOGY)
    calls = 0

    async def crashing(_message) -> None:
        nonlocal calls
        calls += 1
        raise ValueError("a bug that this message triggers every time")

    consumer = Consumer(broker, RESPONDER_QUEUE, crashing, prefetch=1, requeue_pause=0.05)
    task = asyncio.create_task(consumer.run())
    try:
        connection = await aio_pika.connect(infra.amqp_url)
        channel = await connection.channel()
        exchange = await channel.get_exchange(JOBS_EXCHANGE)
        await exchange.publish(aio_pika.Message(b"{}", message_id="poison-1"), routing_key=JOB_ROUTING_KEY)
        await connection.close()
        dead = await wait_for(
            lambda: queues.drain(RESPONDER_DEAD_QUEUE), within=30, what="the poison message dead-lettered"
        )
    finally:
        await consumer.stop()
        task.cancel()
        await broker.close()
    assert [m.message_id for m in dead] == ["poison-1"]
    assert calls >= 5  # the quorum queue's delivery limit for chatq.responder
