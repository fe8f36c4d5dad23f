"""Webhook intake against real Postgres and RabbitMQ: durable before 2xx, deduplicated,
ignored events recorded with a reason, and published once with message_id = operation id."""

from __future__ import annotations

import asyncio
import uuid

import asyncpg
import pytest

from shared.broker.topology import COALESCER_QUEUE
from shared.messages import InboundMessage
from tests.conftest import ADMIN_TOKEN, AVITO_SECRET, GENERIC_SECRET, TELEGRAM_SECRET, replace
from tests.support.broker import QueueInspector, wait_for
from tests.support.payloads import avito_webhook, dumps, generic_message, signed, telegram_update
from tests.support.receiver import running_receiver

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("clean")]

TG = {"X-Telegram-Bot-Api-Secret-Token": TELEGRAM_SECRET}
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


async def test_the_same_telegram_update_posted_50_times_concurrently_is_one_operation_and_one_message(
    settings, pool: asyncpg.Pool, queues: QueueInspector
) -> None:
    update = telegram_update(5001, chat_id=31, text="Is it still available?")
    async with running_receiver(settings) as (_, client):
        responses = await asyncio.gather(
            *(client.post("/v1/webhooks/telegram", json=update, headers=TG) for _ in range(50))
        )
        assert {r.status_code for r in responses} == {200}
        operation_ids = {r.json()["operation_id"] for r in responses}
        assert len(operation_ids) == 1
        assert sum(not r.json()["duplicate"] for r in responses) == 1
        (operation_id,) = operation_ids
        await wait_for(
            lambda: pool.fetchval(
                "SELECT chatq_shown_status(status, id, platform, account_id, chat_id) = 'queued' FROM operations WHERE id = $1",
                uuid.UUID(operation_id),
            ),
            what="operation queued",
        )
    assert await pool.fetchval("SELECT count(*) FROM operations") == 1
    assert await pool.fetchval("SELECT count(*) FROM outbox") == 1
    messages = await queues.drain(COALESCER_QUEUE)
    assert [m.message_id for m in messages] == [operation_id]
    inbound = InboundMessage.from_bytes(messages[0].body)
    assert (inbound.platform, inbound.chat_id, inbound.message_id, inbound.text) == (
        "telegram",
        "31",
        "5001",
        "Is it still available?",
    )
    assert messages[0].delivery_mode == 2  # persistent


async def test_a_telegram_message_repeated_under_a_new_update_id_is_still_one_operation(
    settings, pool: asyncpg.Pool
) -> None:
    async with running_receiver(replace(settings, relay_enabled=False)) as (_, client):
        first = await client.post("/v1/webhooks/telegram", json=telegram_update(10, message_id=7), headers=TG)
        again = await client.post("/v1/webhooks/telegram", json=telegram_update(11, message_id=7), headers=TG)
    assert first.json()["operation_id"] == again.json()["operation_id"]
    assert again.json()["duplicate"] is True
    assert await pool.fetchval("SELECT count(*) FROM operations") == 1


async def test_a_repeat_is_answered_with_the_status_a_person_reads_not_the_stored_one(
    settings, pool: asyncpg.Pool
) -> None:
    async with running_receiver(replace(settings, relay_enabled=False)) as (_, client):
        first = await client.post("/v1/webhooks/telegram", json=telegram_update(10, message_id=7), headers=TG)
        await pool.execute("UPDATE outbox SET published_at = clock_timestamp()")  # as a relay does
        again = await client.post("/v1/webhooks/telegram", json=telegram_update(11, message_id=7), headers=TG)
    assert first.json()["status"] == "accepted"
    assert await pool.fetchval("SELECT status FROM operations") == "accepted", "the stored status"
    assert again.json()["status"] == "queued", "what the status API shows once the message is published"


async def test_an_avito_message_is_stored_its_repeat_is_a_duplicate_and_one_the_account_wrote_is_the_sellers(
    settings, pool: asyncpg.Pool
) -> None:
    url = f"/v1/webhooks/avito/{AVITO_SECRET}"
    async with running_receiver(replace(settings, relay_enabled=False)) as (_, client):
        buyer = await client.post(url, json=avito_webhook("m-1"))
        repeat = await client.post(url, json=avito_webhook("m-1"))
        # Written by the account itself and no reply of the bot's: the seller answered by hand.
        echo = await client.post(url, json=avito_webhook("m-2", author_id=777))
        system = await client.post(url, json=avito_webhook("m-3", type_="system", author_id=0))
        image = await client.post(url, json=avito_webhook("m-4", type_="image", text=None))
    assert [r.status_code for r in (buyer, repeat, echo, system, image)] == [200] * 5
    assert repeat.json()["operation_id"] == buyer.json()["operation_id"]
    rows = await pool.fetch("SELECT message_id, status, status_reason FROM operations ORDER BY message_id")
    assert [(r["message_id"], r["status"], r["status_reason"]) for r in rows] == [
        ("m-1", "replied", "answered by the seller (message m-2)"),
        (
            "m-2",
            "ignored",
            "written by the seller: the replies not yet sent are withdrawn and the bot steps back from this "
            "chat for 60 min",
        ),
        ("m-3", "ignored", "Avito system message"),
        ("m-4", "accepted", None),  # a buyer's photo: answered through its placeholder
    ]
    # The buyer's messages go to the bot.
    assert await pool.fetchval("SELECT count(*) FROM outbox") == 2
    assert (
        await pool.fetchval("SELECT text FROM operations WHERE message_id = 'm-4'")
        == "[the buyer sent a photo]"
    )


async def test_a_signed_generic_webhook_gets_202_with_a_status_url_that_reads_the_operation(
    settings, pool: asyncpg.Pool
) -> None:
    body = dumps(generic_message("g-1"))
    async with running_receiver(settings) as (_, client):
        response = await client.post(
            "/v1/webhooks/generic", content=body, headers=signed(GENERIC_SECRET, body, webhook_id="msg_1")
        )
        assert response.status_code == 202
        doc = response.json()
        assert doc["status"] == "accepted"
        assert doc["status_url"] == f"/v1/operations/{doc['operation_id']}"

        async def queued() -> bool:
            status = await client.get(doc["status_url"], headers=ADMIN)
            return status.json()["status"] == "queued"

        await wait_for(queued, what="status queued")
        status = (await client.get(doc["status_url"], headers=ADMIN)).json()
        assert status["platform"] == "generic"
        assert status["chat"] == {"account_id": "shop-1", "chat_id": "c1"}
        assert status["message"]["text"] == "Do you deliver?"
        assert status["status_text"] == "stored and queued for the bot"
        # Listed by the status it reads, not the 'accepted' its row holds.
        listed = (await client.get("/v1/operations?status=queued", headers=ADMIN)).json()
        assert [o["id"] for o in listed["operations"]] == [doc["operation_id"]]
        listed = (await client.get("/v1/operations?status=accepted", headers=ADMIN)).json()
        assert listed["operations"] == []
        assert status["age_seconds"] >= 0
        # Redelivery of the same webhook-id is answered with the same operation.
        again = await client.post(
            "/v1/webhooks/generic", content=body, headers=signed(GENERIC_SECRET, body, webhook_id="msg_1")
        )
        assert again.json()["operation_id"] == doc["operation_id"]


async def test_unknown_telegram_update_kinds_get_200_and_are_stored_as_ignored(
    settings, pool: asyncpg.Pool
) -> None:
    callback = {"update_id": 900, "callback_query": {"id": "q1", "from": {"id": 5, "is_bot": False}}}
    pinned = telegram_update(
        901, text=None, pinned_message={"message_id": 3, "date": 0, "chat": {"id": 1, "type": "private"}}
    )
    async with running_receiver(replace(settings, relay_enabled=False)) as (_, client):
        r1 = await client.post("/v1/webhooks/telegram", json=callback, headers=TG)
        r2 = await client.post("/v1/webhooks/telegram", json=pinned, headers=TG)
        r3 = await client.post("/v1/webhooks/telegram", json=callback, headers=TG)
    assert [r.status_code for r in (r1, r2, r3)] == [200, 200, 200]
    assert r3.json()["duplicate"] is True
    rows = await pool.fetch(
        "SELECT event_id, message_id, status, status_reason FROM operations ORDER BY event_id NULLS LAST"
    )
    # An update without a message is keyed by its update_id; a message by (chat, message id).
    assert [tuple(r) for r in rows] == [
        ("900", None, "ignored", "update kind callback_query is not answered"),
        (None, "901", "ignored", "a service message (pinned_message): not a buyer's message"),
    ]
    assert await pool.fetchval("SELECT count(*) FROM outbox") == 0


async def test_the_operation_api_needs_the_admin_token_and_is_off_without_one(settings, pool) -> None:
    async with running_receiver(replace(settings, relay_enabled=False)) as (_, client):
        stored = await client.post("/v1/webhooks/telegram", json=telegram_update(1), headers=TG)
        url = f"/v1/operations/{stored.json()['operation_id']}"
        assert (await client.get(url)).status_code == 401
        assert (await client.get(url, headers={"Authorization": "Bearer wrong"})).status_code == 401
        assert (await client.get(url, headers=ADMIN)).json()["status"] == "accepted"
        missing = await client.get(f"/v1/operations/{uuid.uuid4()}", headers=ADMIN)
        assert missing.status_code == 404
        assert missing.json()["error"]["code"] == "operation_not_found"
    async with running_receiver(replace(settings, relay_enabled=False, admin_token=None)) as (
        _,
        client,
    ):
        off = await client.get(url, headers=ADMIN)
        assert off.status_code == 404
        assert off.json()["error"]["code"] == "admin_api_disabled"


async def test_the_body_is_kept_verbatim_for_forensics(settings, pool: asyncpg.Pool) -> None:
    raw = b'{"update_id": 3,   "message": {"message_id": 3, "date": 1, "chat": {"id": 9, "type": "private"}, "text": "hi"}}'
    async with running_receiver(replace(settings, relay_enabled=False)) as (_, client):
        r = await client.post(
            "/v1/webhooks/telegram", content=raw, headers={**TG, "content-type": "application/json"}
        )
    assert r.status_code == 200
    assert await pool.fetchval("SELECT payload::text FROM operations") == raw.decode()


async def test_health_readiness_and_metrics_answer(settings) -> None:
    async with running_receiver(settings) as (_, client):
        assert (await client.get("/healthz")).json() == {"status": "ok"}
        await wait_for(lambda: _ready(client), what="ready")
        await client.post("/v1/webhooks/telegram", json=telegram_update(77), headers=TG)
        text = (await client.get("/metrics/")).text
        assert 'chatq_webhooks_total{outcome="accepted",platform="telegram"}' in text
        assert "chatq_outbox_pending" in text


async def _ready(client) -> bool:
    doc = (await client.get("/readyz")).json()
    return doc["status"] == "ok"


async def test_concurrent_webhooks_are_committed_together_and_each_gets_its_own_operation(
    settings, pool: asyncpg.Pool
) -> None:
    updates = [telegram_update(7000 + n, chat_id=100 + n % 5, message_id=n + 1) for n in range(40)]
    async with running_receiver(replace(settings, relay_enabled=False)) as (receiver, client):
        # The 41st is a repeat of the first, in the same burst.
        responses = await asyncio.gather(
            *(client.post("/v1/webhooks/telegram", json=u, headers=TG) for u in [*updates, updates[0]])
        )
        intake = receiver.public.state.runtime.intake
    assert [r.status_code for r in responses] == [200] * 41
    docs = [r.json() for r in responses]
    assert len({d["operation_id"] for d in docs[:40]}) == 40
    assert docs[40]["operation_id"] == docs[0]["operation_id"]
    assert sorted([docs[0]["duplicate"], docs[40]["duplicate"]]) == [False, True]
    assert not any(d["duplicate"] for d in docs[1:40])
    # Each answer names the operation of its own message.
    stored = dict(await pool.fetch("SELECT id::text, message_id FROM operations"))
    assert {d["operation_id"]: stored[d["operation_id"]] for d in docs[:40]} == {
        d["operation_id"]: str(n + 1) for n, d in enumerate(docs[:40])
    }
    assert await pool.fetchval("SELECT count(*) FROM outbox") == 40
    assert await pool.fetchval("SELECT count(*) FROM operation_events WHERE kind = 'received'") == 40
    # The outbox, which the relay publishes in id order, follows the order of receipt.
    assert await pool.fetchval(
        "SELECT array_agg(o.operation_id ORDER BY o.id) = array_agg(o.operation_id ORDER BY t.received_at)"
        " FROM outbox o JOIN operations t ON t.id = o.operation_id"
    )
    assert intake.rows == 41
    assert intake.batches < intake.rows / 4, "the burst was written in a few statements, not one each"


async def test_a_row_postgres_refuses_fails_only_its_own_request_not_the_rest_of_its_batch(
    settings, pool: asyncpg.Pool
) -> None:
    await pool.execute(
        "ALTER TABLE operations ADD CONSTRAINT test_poison CHECK (text IS DISTINCT FROM 'poison') NOT VALID"
    )
    updates = [
        telegram_update(8000 + n, chat_id=200 + n, text="poison" if n == 5 else "fine") for n in range(12)
    ]
    try:
        # A wide window: the twelve surely share a batch.
        wide = replace(settings, relay_enabled=False, intake_batch_window_ms=50)
        async with running_receiver(wide) as (receiver, client):
            results = await asyncio.gather(
                *(client.post("/v1/webhooks/telegram", json=u, headers=TG) for u in updates),
                return_exceptions=True,
            )
            intake = receiver.public.state.runtime.intake
    finally:
        await pool.execute("ALTER TABLE operations DROP CONSTRAINT test_poison")
    poison = results.pop(5)
    # The in-process transport re-raises what the app answered with a 500.
    assert isinstance(poison, asyncpg.CheckViolationError) or poison.status_code == 500
    assert [r.status_code for r in results] == [200] * 11
    assert not any(r.json()["duplicate"] for r in results)
    assert await pool.fetchval("SELECT array_agg(DISTINCT text) FROM operations") == ["fine"]
    assert await pool.fetchval("SELECT count(*) FROM operations") == 11
    assert await pool.fetchval("SELECT count(*) FROM outbox") == 11
    assert intake.batches == 0, "the failed batch committed nothing; its rows were stored one by one"
