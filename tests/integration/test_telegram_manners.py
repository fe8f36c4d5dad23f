"""Telegram manners through the whole pipeline in-process (real Postgres and RabbitMQ, the
fake Bot API and model): commands are greeted without the model, captions are answered,
an edit joins a pending reply or is left alone after it, group chats are answered only
when allowed, and a business account's customer is answered through its connection."""

from __future__ import annotations

import asyncio

import asyncpg
import pytest

from tests.conftest import replace
from tests.fakes.world import FakeWorld
from tests.support.broker import wait_for
from tests.support.payloads import (
    bot_command,
    telegram_business_update,
    telegram_edit,
    telegram_photo,
    telegram_update,
)
from tests.support.pipeline import Pipeline, running_pipeline
from tests.support.receiver import running_receiver
from tests.support.services import running_coalescers

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("clean")]

EDITED_AFTER_REPLY = "edited after the reply; not answered again"


def with_model(fast, world: FakeWorld, **changes: object):
    return replace(fast, llm_base_url=f"{world.url}/v1", llm_timeout_seconds=5, **changes)


async def one_reply_while_the_model_writes(
    fast, pool: asyncpg.Pool, world: FakeWorld, first: dict, then: dict
) -> dict:
    """Post ``first``; while the (slow) model writes its reply, post ``then``; check that
    one reply covered both. Returns the receiver's answer to ``then``."""
    settings = with_model(fast, world)
    world.fail("llm", "slow:1.5")
    async with running_pipeline(settings, pool) as p:
        a = await p.post_telegram(first)
        await wait_for(lambda: world.llm_in_flight, what="the model to be writing")
        b = await p.post_telegram(then)
        docs = [await p.settled(a["operation_id"]), await p.settled(b["operation_id"])]
    assert [d["status"] for d in docs] == ["replied", "replied"]
    assert docs[0]["job"]["id"] == docs[1]["job"]["id"]
    return b


async def test_start_gets_the_configured_greeting_without_a_model_call(
    fast, pool: asyncpg.Pool, world: FakeWorld
) -> None:
    settings = with_model(fast, world, greeting="Hi! Ask me about the bike.")
    async with running_pipeline(settings, pool) as p:
        sent = await p.post_telegram(telegram_update(1, chat_id=71, text="/start", **bot_command("/start")))
        doc = await p.settled(sent["operation_id"])
    assert doc["status"] == "replied"
    assert world.replies_to("71") == ["Hi! Ask me about the bike."]
    assert doc["reply"]["text"] == "Hi! Ask me about the bike."
    assert world.llm == []
    # The greeting went the way of every reply: a job, its delivery intent, its record.
    assert await pool.fetchval("SELECT status FROM deliveries") == "sent"


async def test_a_command_folded_in_with_a_question_is_left_out_of_what_the_model_reads(
    fast, pool: asyncpg.Pool, world: FakeWorld
) -> None:
    question = telegram_update(1, chat_id=72, text="Do you deliver?")
    command = telegram_update(2, chat_id=72, text="/help", **bot_command("/help"))
    await one_reply_while_the_model_writes(fast, pool, world, question, command)
    assert world.replies_to("72") == ["Answer to: Do you deliver?"]
    # Written, then written again once the command was folded in: it never reached the model.
    assert [call["messages"][-1]["content"] for call in world.llm] == ["Do you deliver?", "Do you deliver?"]


async def test_a_photo_with_a_caption_is_answered_from_its_caption(
    pipeline: Pipeline, world: FakeWorld
) -> None:
    update = telegram_update(
        1, chat_id=73, text=None, caption="Is this one still available?", photo=telegram_photo()
    )
    doc = await pipeline.settled((await pipeline.post_telegram(update))["operation_id"])
    assert doc["status"] == "replied"
    assert doc["message"]["text"] == "[the buyer sent a photo] Is this one still available?"
    assert world.replies_to("73") == ["Hello! Yes, it is available."]


async def test_an_edit_while_the_reply_is_being_written_is_folded_into_that_one_reply(
    fast, pool: asyncpg.Pool, world: FakeWorld
) -> None:
    original = telegram_update(1, chat_id=74, message_id=5, text="Hello")
    edited = telegram_edit(2, chat_id=74, message_id=5, text="Hello, do you ship to Kazan?")
    edit = await one_reply_while_the_model_writes(fast, pool, world, original, edited)
    assert edit["status"] == "accepted"
    assert world.replies_to("74") == ["Answer to: Hello | Hello, do you ship to Kazan?"]
    message_id = await pool.fetchval("SELECT message_id FROM operations WHERE id = $1", edit["operation_id"])
    assert message_id.startswith("5:edit:")


async def test_edits_after_the_reply_are_stored_as_ignored_and_never_answered_again(
    pipeline: Pipeline, pool: asyncpg.Pool, world: FakeWorld
) -> None:
    sent = await pipeline.post_telegram(telegram_update(1, chat_id=75, message_id=5, text="Hello"))
    assert (await pipeline.settled(sent["operation_id"]))["status"] == "replied"
    first = telegram_edit(2, chat_id=75, message_id=5, text="Hello, do you deliver?", edit_date=1_900_000_000)
    second = telegram_edit(
        3, chat_id=75, message_id=5, text="Hello, do you deliver to Kazan?", edit_date=1_900_000_060
    )
    answers = await asyncio.gather(*(pipeline.post_telegram(u) for u in (first, second, first)))
    assert [a["status"] for a in answers] == ["ignored"] * 3
    assert len({a["operation_id"] for a in answers}) == 2  # the repeat is the same operation
    for answer in answers:
        doc = await pipeline.status(answer["operation_id"])
        assert doc["status_text"].endswith(EDITED_AFTER_REPLY)
    assert world.replies_to("75") == ["Thank you for your message! The seller will get back to you shortly."]
    assert (
        await pool.fetchval("SELECT count(*) FROM outbox WHERE operation_id <> $1", sent["operation_id"]) == 0
    )


async def test_racing_edits_during_the_pause_are_each_kept_once_for_the_pending_reply(
    fast, pool: asyncpg.Pool, world: FakeWorld
) -> None:
    # A human-like pause keeps the chat's window open while the buyer edits twice, both
    # edits delivered at once, one of them twice.
    paused = replace(fast, reply_delay_min_seconds=30, reply_delay_max_seconds=30, max_wait_seconds=60)
    async with running_receiver(paused) as (_, client), running_coalescers(paused):
        p = Pipeline(client, pool)
        sent = await p.post_telegram(telegram_update(1, chat_id=76, message_id=5, text="Hello"))

        async def waiting() -> bool:
            return (await p.status(sent["operation_id"]))["status"] == "waiting"

        await wait_for(waiting, what="the message to wait in its chat's window")
        first = telegram_edit(
            2, chat_id=76, message_id=5, text="Hello, do you deliver?", edit_date=1_900_000_000
        )
        second = telegram_edit(3, chat_id=76, message_id=5, text="Hello, to Kazan?", edit_date=1_900_000_060)
        answers = await asyncio.gather(*(p.post_telegram(u) for u in (first, second, first)))

        async def filed() -> bool:
            return await pool.fetchval("SELECT count(*) FROM window_messages") == 3

        await wait_for(filed, what="both edits to join the window")
    # Both kept for the reply (a repeat answers with the stored operation, by now maybe
    # further along: queued, or waiting in the window).
    assert [a["status"] for a in answers if not a["duplicate"]] == ["accepted"] * 2
    assert (
        answers[0]["operation_id"] == answers[2]["operation_id"]
        and answers[1]["operation_id"] != answers[0]["operation_id"]
    )
    rows = await pool.fetch("SELECT message_id FROM operations WHERE chat_id = '76' ORDER BY message_id")
    assert [r["message_id"] for r in rows] == ["5", "5:edit:1900000000", "5:edit:1900000060"]
    assert world.telegram == []  # still in the pause: nothing sent yet


async def test_an_edit_waits_for_a_message_of_its_chat_still_in_transit_and_is_ignored_in_a_quiet_chat(
    settings, pool: asyncpg.Pool
) -> None:
    # The relay is off: the chat's first message stays on its way to a window.
    async with running_receiver(replace(settings, relay_enabled=False)) as (_, client):
        p = Pipeline(client, pool)
        await p.post_telegram(telegram_update(1, chat_id=77, message_id=5, text="Hello"))
        in_transit = await p.post_telegram(telegram_edit(2, chat_id=77, message_id=5, text="Hello!"))
        quiet = await p.post_telegram(telegram_edit(3, chat_id=78, message_id=9, text="Hi!"))
    assert (in_transit["status"], quiet["status"]) == ("accepted", "ignored")
    reason = await pool.fetchval("SELECT status_reason FROM operations WHERE id = $1", quiet["operation_id"])
    assert reason == EDITED_AFTER_REPLY


async def test_a_group_message_is_stored_as_ignored_with_the_reason_by_default(
    settings, pool: asyncpg.Pool
) -> None:
    async with running_receiver(replace(settings, relay_enabled=False)) as (_, client):
        p = Pipeline(client, pool)
        sent = await p.post_telegram(telegram_update(1, chat_id=-500123, chat_type="group", from_id=42))
        doc = await p.status(sent["operation_id"])
    assert sent["status"] == "ignored"
    assert doc["status_text"].endswith("group chats are not answered (CHATQ_TELEGRAM_CHAT_TYPES: private)")
    assert await pool.fetchval("SELECT count(*) FROM outbox") == 0


async def test_a_group_message_is_answered_in_the_group_when_groups_are_allowed(
    fast, pool: asyncpg.Pool, world: FakeWorld
) -> None:
    groups = replace(fast, telegram_chat_types="private,group")
    async with running_pipeline(groups, pool) as p:
        sent = await p.post_telegram(
            telegram_update(1, chat_id=-500123, chat_type="group", from_id=42, text="Do you deliver?")
        )
        doc = await p.settled(sent["operation_id"])
    assert doc["status"] == "replied"
    assert [(m["chat_id"], m["text"]) for m in world.telegram] == [
        (-500123, "Hello! We ship across the country; delivery takes 2-5 days.")
    ]


async def test_a_business_customer_is_answered_through_the_connection_and_the_sellers_own_words_are_not(
    pipeline: Pipeline, pool: asyncpg.Pool, world: FakeWorld
) -> None:
    customer = await pipeline.post_telegram(
        telegram_business_update(1, connection="biz-conn-1", customer=3003)
    )
    doc = await pipeline.settled(customer["operation_id"])
    assert doc["status"] == "replied"
    (reply,) = world.telegram
    assert (reply["chat_id"], reply["business_connection_id"]) == (3003, "biz-conn-1")
    assert reply["text"] == "Hello! Yes, it is available."
    # The bot's own chat with the same person (same chat id, same message id) is another
    # chat: answered on its own, as the bot.
    own = await pipeline.post_telegram(telegram_update(1, chat_id=3003, text="Do you deliver?"))
    assert own["duplicate"] is False
    assert (await pipeline.settled(own["operation_id"]))["status"] == "replied"
    assert "business_connection_id" not in world.telegram[1] and world.telegram[1]["chat_id"] == 3003

    seller = await pipeline.post_telegram(
        telegram_business_update(2, connection="biz-conn-1", customer=3003, author=9009, text="I'll call you")
    )
    bot = {"id": 4242, "is_bot": True, "first_name": "Shop bot"}
    echo = await pipeline.post_telegram(
        telegram_business_update(3, customer=3003, author=9009, text=reply["text"], sender_business_bot=bot)
    )
    rows = await pool.fetch(
        "SELECT id::text, status, status_reason, business_connection_id FROM operations WHERE id = ANY($1::uuid[])",
        [seller["operation_id"], echo["operation_id"]],
    )
    found = {r["id"]: (r["status"], r["status_reason"], r["business_connection_id"]) for r in rows}
    assert found == {
        seller["operation_id"]: (
            "ignored",
            "written by the seller: the replies not yet sent are withdrawn and the bot steps back "
            "from this chat for 60 min",
            "biz-conn-1",
        ),
        echo["operation_id"]: ("ignored", "our own message (echo)", "biz-conn-1"),
    }
    assert len(world.telegram) == 2
