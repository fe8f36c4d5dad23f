"""Every buyer message gets an answer or a person (issue 38), through the whole pipeline on
real Postgres and RabbitMQ against the fake platforms: a photo, a location or a listing is
answered through its typed placeholder, a voice note alone goes to a person (or is
answered, as the account chooses), a message Avito sends without a field is stored and
answered; a business's away message is not a takeover, a business connection turned off
pauses its chats; our reply's echo settles a send whose answer was lost; a topic is
answered in its topic."""

from __future__ import annotations

import asyncio
import copy
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest

from shared.settings import Settings
from tests.conftest import GENERIC_SECRET, replace
from tests.fakes.world import FakeWorld
from tests.support.avito import ME, URL, Stack, known_account
from tests.support.broker import wait_for
from tests.support.payloads import (
    avito_content,
    dumps,
    generic_message,
    signed,
    telegram_business_update,
    telegram_update,
)
from tests.support.pipeline import ADMIN, TG, Pipeline, running_pipeline

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("clean")]

BOT = {"id": 4242, "is_bot": True, "first_name": "Shop bot"}


@pytest.fixture
def with_model(fast: Settings, world: FakeWorld) -> Settings:
    """The pipeline with an OpenAI-compatible model (the fake), whose answer says what it read."""
    return replace(fast, llm_base_url=f"{world.url}/v1")


@pytest.fixture
async def modelled(with_model: Settings, pool: asyncpg.Pool) -> AsyncIterator[Pipeline]:
    async with running_pipeline(with_model, pool) as p:
        yield p


async def avito_says(p: Pipeline, world: FakeWorld, chat: str, kind: str, **content: Any) -> dict:
    """A buyer's message of ``kind`` in an Avito chat, through its webhook; its settled status."""
    hook = world.avito_buyer_writes(ME, chat, None, kind=kind, content=content or avito_content(kind))
    r = await p.client.post(URL, json=hook)
    assert r.status_code == 200, r.text
    return await p.settled(r.json()["operation_id"])


def last_model_input(world: FakeWorld) -> str:
    return world.llm[-1]["messages"][-1]["content"]


async def test_a_photo_a_voice_note_and_a_question_get_an_answer_or_a_person_each(
    modelled: Pipeline, world: FakeWorld, pool: asyncpg.Pool
) -> None:
    transcript: list[str] = []
    photo = await avito_says(modelled, world, "u2i-media", "image")
    assert photo["status"] == "replied"
    assert last_model_input(world) == "[the buyer sent a photo]"
    transcript.append(f"buyer: {photo['message']['text']}\nbot: {world.replies_to('u2i-media')[-1]}")

    voice = await avito_says(modelled, world, "u2i-media", "voice")
    assert voice["status"] == "needs_review"
    assert voice["error"]["message"].startswith("voice message: the bot cannot listen to it")
    assert voice["owner"] == "on-call"
    assert len(world.replies_to("u2i-media")) == 1  # nothing was said for the voice note
    alerts = await wait_for(
        lambda: [a for a in world.alerts if a["body"]["type"] == "operation.needs_review"] or None,
        what="the needs_review alert",
    )
    assert alerts[0]["body"]["operations"] == [voice["id"]]
    transcript.append(f"buyer: {voice['message']['text']}\n-> a person: {voice['error']['message']}")

    hook = world.avito_buyer_writes(ME, "u2i-media", "Do you deliver to Kazan?")
    r = await modelled.client.post(URL, json=hook)
    question = await modelled.settled(r.json()["operation_id"])
    assert question["status"] == "replied"
    transcript.append(f"buyer: {question['message']['text']}\nbot: {world.replies_to('u2i-media')[-1]}")

    # The operations page lists the voice note for a person, with the reason.
    listed = await modelled.client.get("/v1/operations?status=needs_review", headers=ADMIN)
    assert [o["id"] for o in listed.json()["operations"]] == [voice["id"]]
    print("\n\n".join(transcript))


async def test_a_person_can_hand_a_voice_note_back_to_the_bot_without_a_resend_confirmation(
    modelled: Pipeline, world: FakeWorld
) -> None:
    voice = await avito_says(modelled, world, "u2i-back", "voice")
    assert voice["status"] == "needs_review"
    r = await modelled.client.post(f"/v1/operations/{voice['id']}/retry", json={"by": "anna"}, headers=ADMIN)
    assert r.status_code == 202, r.text
    assert r.json()["resend"] is False
    assert (await modelled.settled(voice["id"]))["status"] == "replied"
    assert last_model_input(world) == "[voice message]"


async def test_an_account_that_chose_answer_has_its_voice_notes_answered_by_the_bot(
    with_model: Settings, world: FakeWorld, pool: asyncpg.Pool
) -> None:
    async with running_pipeline(replace(with_model, unreadable_messages="answer"), pool) as p:
        voice = await avito_says(p, world, "u2i-answer", "voice")
        assert voice["status"] == "replied"
        assert last_model_input(world) == "[voice message]"


async def test_a_location_a_listing_and_a_link_are_answered_from_their_placeholders(
    modelled: Pipeline, world: FakeWorld
) -> None:
    assert (await avito_says(modelled, world, "u2i-loc", "location"))["status"] == "replied"
    assert last_model_input(world) == "[location: Москва, Варшавское шоссе (55.5998, 37.60395)]"
    assert (await avito_says(modelled, world, "u2i-item", "item"))["status"] == "replied"
    assert last_model_input(world) == "[listing: Велосипед, 12 000 ₽, https://avito.ru/item_url]"
    link = {"link": {"text": "Is this one the same?", "url": "https://avito.ru/other"}}
    assert (await avito_says(modelled, world, "u2i-link", "link", **link))["status"] == "replied"
    assert last_model_input(world) == "[link: https://avito.ru/other] Is this one the same?"


async def test_an_avito_message_without_author_or_type_is_answered_and_its_record_says_so(
    pipeline: Pipeline, world: FakeWorld
) -> None:
    hook = world.avito_buyer_writes(ME, "u2i-bare", "Is it still available?")
    del hook["payload"]["value"]["author_id"], hook["payload"]["value"]["type"]
    r = await pipeline.client.post(URL, json=hook)
    assert r.status_code == 200, r.text
    doc = await pipeline.settled(r.json()["operation_id"])
    assert doc["status"] == "replied"
    received = next(e for e in doc["timeline"] if e["kind"] == "received")
    assert received["event"] == (
        "received and stored; defaults: author_id missing: taken as the buyer's; "
        "type missing: read as text from its content"
    )


async def test_a_telegram_voice_note_goes_to_a_person_and_a_location_is_answered(
    pipeline: Pipeline, world: FakeWorld
) -> None:
    voice = {"file_id": "v1", "file_unique_id": "v1u", "duration": 12}
    doc = await pipeline.settled(
        (await pipeline.post_telegram(telegram_update(1, text=None, voice=voice)))["operation_id"]
    )
    assert doc["status"] == "needs_review"
    assert doc["message"]["text"] == "[voice message, 12 s]"
    location = {"latitude": 55.75, "longitude": 37.61}
    sent = await pipeline.post_telegram(telegram_update(2, chat_id=2002, text=None, location=location))
    assert (await pipeline.settled(sent["operation_id"]))["status"] == "replied"
    assert world.replies_to("1001") == []
    assert len(world.replies_to("2002")) == 1


# ---- 5. the account's own automatic messages --------------------------------------------


async def test_an_autoresponders_message_under_the_sellers_id_does_not_step_the_bot_back(
    pipeline: Pipeline, world: FakeWorld, pool: asyncpg.Pool
) -> None:
    auto = world.avito_buyer_writes(
        ME, "u2i-auto", None, author_id=int(ME), kind="system", content=avito_content("system")
    )
    r = await pipeline.client.post(URL, json=auto)
    assert r.json()["status"] == "ignored"
    image = world.avito_buyer_writes(
        ME, "u2i-auto", None, author_id=int(ME), kind="image", content=avito_content("image")
    )
    r = await pipeline.client.post(URL, json=image)
    assert r.json()["status"] == "ignored"
    assert await pool.fetchval("SELECT held_until FROM chats WHERE chat_key = 'avito:777:u2i-auto'") is None
    hook = world.avito_buyer_writes(ME, "u2i-auto", "Is it still available?")
    r = await pipeline.client.post(URL, json=hook)
    assert (await pipeline.settled(r.json()["operation_id"]))["status"] == "replied"


# ---- 4. Telegram Business manners -------------------------------------------------------


async def test_a_business_away_message_does_not_make_the_bot_step_back_from_new_customers(
    pipeline: Pipeline, world: FakeWorld, pool: asyncpg.Pool
) -> None:
    away = telegram_business_update(
        1, customer=3003, author=9009, text="We are away until 10:00", is_from_offline=True
    )
    assert (await pipeline.post_telegram(away))["status"] == "ignored"
    asked = await pipeline.post_telegram(telegram_business_update(2, customer=3003, text="Is it available?"))
    assert (await pipeline.settled(asked["operation_id"]))["status"] == "replied"
    assert await pool.fetchval("SELECT count(*) FROM chats WHERE held_until IS NOT NULL") == 0


async def test_a_business_connection_turned_off_pauses_its_chats_until_it_is_on_again(
    pipeline: Pipeline, world: FakeWorld, pool: asyncpg.Pool
) -> None:
    off = {"update_id": 10, "business_connection": world.business_connection("biz-off", enabled=False)}
    assert (await pipeline.post_telegram(off))["status"] == "ignored"
    asked = await pipeline.post_telegram(telegram_business_update(11, connection="biz-off", customer=3004))

    async def waiting() -> bool:
        doc = await pipeline.status(asked["operation_id"])
        return doc["status"] in ("waiting", "replying") and doc["job"] is not None

    await wait_for(waiting, what="the customer's reply to wait")
    doc = await pipeline.status(asked["operation_id"])
    assert doc["status"] not in ("failed", "needs_review") and world.telegram == []
    on = {"update_id": 12, "business_connection": world.business_connection("biz-off", enabled=True)}
    await pipeline.post_telegram(on)
    assert (await pipeline.settled(asked["operation_id"], within=30))["status"] == "replied"


async def test_a_send_refused_for_its_business_connection_pauses_it_once_and_a_probe_resumes_it(
    pipeline: Pipeline, world: FakeWorld, pool: asyncpg.Pool
) -> None:
    world.business_connection("biz-mute", can_reply=False)  # Telegram knows; no update came
    ops = [
        (
            await pipeline.post_telegram(
                telegram_business_update(20 + i, connection="biz-mute", customer=3100 + i)
            )
        )["operation_id"]
        for i in range(2)
    ]
    reason = await wait_for(
        lambda: pool.fetchval(
            "SELECT paused_reason FROM telegram_business_connections WHERE connection_id = 'biz-mute'"
        ),
        what="the connection to be paused",
    )
    assert "BUSINESS_CONNECTION_NOT_ALLOWED" in reason
    # The alert goes out after the pause commits, over HTTP: waited for, not read at once.
    await wait_for(
        lambda: any(a["body"]["type"] == "business_connection.paused" for a in world.alerts),
        what="the alert",
    )
    paused = [a for a in world.alerts if a["body"]["type"] == "business_connection.paused"]
    assert len(paused) == 1
    for op in ops:
        assert (await pipeline.status(op))["status"] not in ("failed", "needs_review")
    world.business_connection("biz-mute", can_reply=True)
    await pool.execute("UPDATE telegram_business_connections SET next_probe_at = now()")
    for op in ops:
        assert (await pipeline.settled(op, within=30))["status"] == "replied"
    assert len([a for a in world.alerts if a["body"]["type"] == "business_connection.paused"]) == 1, (
        "paused once"
    )


@pytest.mark.parametrize("known", [False, True], ids=["no update came", "an update came"])
async def test_sends_refused_at_once_for_one_business_connection_pause_it_for_exactly_one_of_them(
    pool: asyncpg.Pool, known: bool
) -> None:
    """Eight sends through one connection refused at the same moment (jobs of two replicas):
    exactly one pauses it and tells a person (each read the connection active first, and
    each announced: two alerts, found by CI)."""
    from services.responder.connections import BusinessConnections

    if known:
        await pool.execute(
            "INSERT INTO telegram_business_connections (account_id, connection_id, is_enabled, can_reply)"
            " VALUES ('acc', 'biz-race', true, true)"
        )
    connections = BusinessConnections(pool)
    firsts = await asyncio.gather(
        *(connections.pause("acc", "biz-race", "BUSINESS_CONNECTION_NOT_ALLOWED", 60) for _ in range(8))
    )
    assert sorted(firsts) == [False] * 7 + [True]
    assert (await connections.paused("acc", "biz-race"))[0] == "BUSINESS_CONNECTION_NOT_ALLOWED"
    assert not await connections.pause("acc", "biz-race", "again", 60)


# ---- 6. echoes of our own replies --------------------------------------------------------


async def test_an_avito_echo_before_the_lost_answer_settles_the_send_without_asking_avito(
    pipeline: Pipeline, world: FakeWorld
) -> None:
    async def echo_back(echo: dict) -> None:
        # Avito gives our reply back with its line endings and spaces changed.
        content = echo["payload"]["value"]["content"]
        content["text"] = "  " + content["text"].replace(" ", "  ") + "\r\n"
        r = await pipeline.client.post(URL, json=echo)
        assert r.json()["status"] == "ignored"

    world.avito_echo = echo_back
    world.fail("avito.send", "lost")
    hook = world.avito_buyer_writes(ME, "u2i-echo", "Is it still available?")
    r = await pipeline.client.post(URL, json=hook)
    doc = await pipeline.settled(r.json()["operation_id"])
    assert doc["status"] == "replied"
    assert doc["reply"]["platform_message_id"] == world.avito[0]["id"]
    assert len(world.replies_to("u2i-echo")) == 1
    assert not any(c.name == "getMessagesV3" for c in world.platform_calls)  # the echo said so


async def test_a_telegram_business_echo_settles_a_lost_send_instead_of_a_person(
    pipeline: Pipeline, world: FakeWorld
) -> None:
    world.fail("telegram.send", "lost")
    asked = await pipeline.post_telegram(telegram_business_update(30, connection="biz-e", customer=3200))
    sent = await wait_for(lambda: world.telegram or None, what="the send to reach Telegram")
    echo = telegram_business_update(
        31,
        connection="biz-e",
        customer=3200,
        author=9009,
        text=sent[0]["text"] + "\n",
        sender_business_bot=BOT,
        message_id=sent[0]["message_id"],
    )
    assert (await pipeline.post_telegram(echo))["status"] == "ignored"
    doc = await pipeline.settled(asked["operation_id"])
    assert doc["status"] == "replied", doc
    assert len(world.telegram) == 1


async def test_an_echo_that_comes_after_a_person_was_asked_settles_the_reply_as_sent(
    pipeline: Pipeline, world: FakeWorld
) -> None:
    world.fail("telegram.send", "lost")
    asked = await pipeline.post_telegram(telegram_business_update(40, connection="biz-late", customer=3300))
    doc = await pipeline.settled(asked["operation_id"], within=30)
    assert doc["status"] == "needs_review"
    echo = telegram_business_update(
        41,
        connection="biz-late",
        customer=3300,
        author=9009,
        text=world.telegram[0]["text"],
        sender_business_bot=BOT,
        message_id=world.telegram[0]["message_id"],
    )
    await pipeline.post_telegram(echo)
    doc = await pipeline.status(asked["operation_id"])
    assert doc["status"] == "replied"
    assert doc["job"]["status"] == "sent"
    assert any("echoed the reply back" in (e["event"] or "") for e in doc["timeline"])


# ---- 7. topics -------------------------------------------------------------------------


async def test_a_message_in_a_topic_is_answered_in_that_topic(
    fast: Settings, world: FakeWorld, pool: asyncpg.Pool
) -> None:
    async with running_pipeline(replace(fast, telegram_chat_types="private,supergroup"), pool) as p:
        update = telegram_update(
            50,
            chat_id=-100600,
            chat_type="supergroup",
            from_id=42,
            message_thread_id=17,
            is_topic_message=True,
            text="Do you deliver?",
        )
        r = await p.client.post("/v1/webhooks/telegram", json=update, headers=TG)
        assert (await p.settled(r.json()["operation_id"]))["status"] == "replied"
    (reply,) = world.telegram
    assert (reply["chat_id"], reply["message_thread_id"]) == (-100600, 17)


async def test_an_echo_that_could_be_either_of_two_lost_replies_settles_neither(
    pipeline: Pipeline, world: FakeWorld
) -> None:
    # Two replies of one chat with the same words, both lost on the way back: an echo of
    # those words proves one went out, not which. Neither is taken for sent.
    ops = []
    for n in range(2):
        world.fail("telegram.send", "lost")
        asked = await pipeline.post_telegram(
            telegram_business_update(60 + n, connection="biz-two", customer=3400, text="Is it available?")
        )
        ops.append(asked["operation_id"])
        assert (await pipeline.settled(asked["operation_id"], within=30))["status"] == "needs_review"
    assert world.telegram[0]["text"] == world.telegram[1]["text"]
    echo = telegram_business_update(
        62,
        connection="biz-two",
        customer=3400,
        author=9009,
        text=world.telegram[1]["text"],
        sender_business_bot=BOT,
        message_id=world.telegram[1]["message_id"],
    )
    await pipeline.post_telegram(echo)
    for op in ops:
        assert (await pipeline.status(op))["status"] == "needs_review"


# ---- found by a review that tried to break the promise -----------------------------------


async def test_our_echo_that_names_no_account_is_still_our_own_and_not_answered(
    pipeline: Pipeline, world: FakeWorld
) -> None:
    hook = world.avito_buyer_writes(ME, "u2i-r1", "Is it still available?")
    r = await pipeline.client.post(URL, json=hook)
    assert (await pipeline.settled(r.json()["operation_id"]))["status"] == "replied"
    echo = copy.deepcopy(world.avito_echoes[-1])
    del echo["payload"]["value"]["user_id"]  # the document marks no field required
    r = await pipeline.client.post(URL, json=echo)
    assert r.json()["status"] == "ignored"
    doc = await pipeline.status(r.json()["operation_id"])
    assert doc["status_text"] == "not for the bot: our own message (echo)"
    assert len(world.replies_to("u2i-r1")) == 1


async def test_a_message_avito_sent_without_its_id_is_stored_once_and_never_answered_twice(
    stack: Stack, world: FakeWorld, pool: asyncpg.Pool
) -> None:
    await known_account(stack, world)
    hook = world.avito_buyer_writes(ME, "u2i-r2", "Do you deliver to Kazan?")
    real_id = hook["payload"]["value"]["id"]
    del hook["payload"]["value"]["id"]
    r = await stack.p.client.post(URL, json=hook)
    nameless = r.json()["operation_id"]
    assert (await stack.p.settled(nameless))["status"] == "needs_review"
    await stack.poll()  # finds the same message under its real id: stored already
    assert await pool.fetchval("SELECT count(*) FROM operations WHERE message_id = $1", real_id) == 0
    retry = await stack.p.client.post(f"/v1/operations/{nameless}/retry", json={"by": "anna"}, headers=ADMIN)
    assert retry.status_code == 409 and retry.json()["error"]["code"] == "not_answerable_by_the_bot"
    assert world.replies_to("u2i-r2") == []


async def test_a_generic_403_about_one_chat_fails_that_reply_alone_instead_of_pausing_for_ever(
    fast: Settings, world: FakeWorld, pool: asyncpg.Pool
) -> None:
    # The endpoint refuses replies to one chat (403) and accepts the signed probe.
    world.fail("generic.send", *(["403", "ok"] * 12))
    async with running_pipeline(replace(fast, account_probe_seconds=0.5), pool) as p:
        body = dumps(generic_message("g-r3", chat_id="blocked-chat"))
        r = await p.client.post(
            "/v1/webhooks/generic", content=body, headers=signed(GENERIC_SECRET, body, webhook_id="w-r3")
        )
        doc = await p.settled(r.json()["operation_id"], within=30)
    assert doc["status"] == "failed"
    assert "refused again for this reply after the account was found working" in doc["error"]["message"]
    kinds = [a["body"]["type"] for a in world.alerts]
    assert kinds.count("account.paused") == 1


async def test_a_chat_avito_will_not_list_does_not_hide_the_accounts_newer_chats(
    stack: Stack, world: FakeWorld, pool: asyncpg.Pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.fakes import avito as fakes

    await known_account(stack, world)
    await stack.poll()
    now = int(time.time())
    world.avito_buyer_writes(ME, "u2i-old", "Old question", created=now - 20)
    lost = world.avito_buyer_writes(ME, "u2i-new", "Do you deliver?", created=now - 10)
    target, handler = fakes.AVITO_OPERATIONS["getMessagesV3"]
    read: list[str] = []

    async def one_chat_broken(w: FakeWorld, check: Any, b: str | None) -> Any:
        read.append(str(check.path_params["chat_id"]))
        if read[-1] == "u2i-old":
            return fakes.avito_error(500)  # every time
        return await handler(w, check, b)

    monkeypatch.setitem(fakes.AVITO_OPERATIONS, "getMessagesV3", (target, one_chat_broken))
    assert await stack.poll() == 1
    assert (
        await pool.fetchval(
            "SELECT count(*) FROM operations WHERE message_id = $1", lost["payload"]["value"]["id"]
        )
        == 1
    )
    assert read.index("u2i-old") < read.index("u2i-new")  # oldest first; the failure stopped nothing
    # The chat it could not read is read again next round; the one it read is not.
    read.clear()
    await stack.poll()
    assert "u2i-old" in read and "u2i-new" not in read


async def test_an_avito_echo_long_after_its_reply_went_to_a_person_settles_it_and_is_no_takeover(
    fast: Settings, world: FakeWorld, pool: asyncpg.Pool
) -> None:
    async with running_pipeline(fast, pool) as p:
        world.fail("avito.send", "lost")
        world.fail("avito.list", *(["500"] * 20))  # the reconciliation cannot read the chat
        hook = world.avito_buyer_writes(ME, "u2i-r5", "Is it still available?")
        op = (await p.client.post(URL, json=hook)).json()["operation_id"]
        assert (await p.settled(op, within=60))["status"] == "needs_review"
        world.faults["avito.list"].clear()
        # Avito's webhook of that reply comes 11 minutes after the send.
        await pool.execute("UPDATE deliveries SET started_at = started_at - interval '11 minutes'")
        r = await p.client.post(URL, json=world.avito_echoes[-1])
        assert (await p.status(r.json()["operation_id"]))[
            "status_text"
        ] == "not for the bot: our own message (echo)"
        assert (await p.status(op))["status"] == "replied"
        assert await pool.fetchval("SELECT held_until FROM chats WHERE chat_key = 'avito:777:u2i-r5'") is None


async def test_a_persons_command_and_an_echo_of_the_same_chat_take_their_locks_in_one_order(
    pipeline: Pipeline, world: FakeWorld, pool: asyncpg.Pool
) -> None:
    from stores.operations.postgres import PgOperationStore

    world.fail("telegram.send", "lost")
    asked = await pipeline.post_telegram(telegram_business_update(80, connection="biz-r7", customer=3600))
    assert (await pipeline.settled(asked["operation_id"], within=30))["status"] == "needs_review"
    chat_key = await pool.fetchval("SELECT chat_key FROM reply_jobs WHERE status = 'needs_review'")
    async with PgOperationStore(pool).transaction() as tx:
        # A person's command holds the operation (and, first, its chat)...
        assert await tx.lock(uuid.UUID(asked["operation_id"])) is not None
        echo = asyncio.create_task(
            pool.fetchval("SELECT chatq_record_echo($1, $2, $3)", chat_key, "9999", world.telegram[0]["text"])
        )
        await asyncio.sleep(0.3)
        assert not echo.done()  # ...and the echo waits for the chat, holding nothing it needs
    assert await asyncio.wait_for(echo, 10) is not None  # then settles the reply
    assert (await pipeline.status(asked["operation_id"]))["status"] == "replied"


async def test_a_business_connection_telegram_no_longer_knows_hands_its_waiting_replies_to_a_person(
    pipeline: Pipeline, world: FakeWorld, pool: asyncpg.Pool
) -> None:
    off = {"update_id": 90, "business_connection": world.business_connection("biz-gone", enabled=False)}
    await pipeline.post_telegram(off)
    asked = await pipeline.post_telegram(telegram_business_update(91, connection="biz-gone", customer=3700))
    await wait_for(
        lambda: pool.fetchval(
            "SELECT count(*) = 1 FROM reply_jobs WHERE status IN ('pending', 'processing')"
        ),
        what="the reply to wait for the connection",
    )
    del world.telegram_business["biz-gone"]  # the business account deleted the bot
    await pool.execute("UPDATE telegram_business_connections SET next_probe_at = now()")
    doc = await pipeline.settled(asked["operation_id"], within=30)
    assert doc["status"] == "failed" and "is gone" in doc["error"]["message"]
    assert world.telegram == []
