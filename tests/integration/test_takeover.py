"""The seller answers: the bot steps back (issue 16). A message the seller writes in person
withdraws every reply not yet sent (its buyer messages end "answered by the seller"),
and the bot stays out of the chat for TAKEOVER_SECONDS: messages meanwhile are stored and
shown, answered only once the hold ends or a person hands the chat back."""

from __future__ import annotations

from collections.abc import AsyncIterator

import asyncpg
import pytest

from shared.settings import Settings
from tests.conftest import AVITO_SECRET, replace
from tests.fakes.world import FakeWorld
from tests.support.broker import wait_for
from tests.support.payloads import avito_webhook
from tests.support.pipeline import ADMIN, Pipeline
from tests.support.receiver import running_receiver
from tests.support.services import running_coalescers, running_responders

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("clean")]

SELLER = 777  # the account's own id: Avito's user_id, the author of the seller's messages
URL = f"/v1/webhooks/avito/{AVITO_SECRET}"


@pytest.fixture
def paused(fast: Settings) -> Settings:
    """A human-like pause long enough for the seller to answer first."""
    return replace(
        fast, reply_delay_min_seconds=3, reply_delay_max_seconds=3, max_wait_seconds=10, quiet_seconds=0
    )


@pytest.fixture
async def stack(paused: Settings, pool: asyncpg.Pool) -> AsyncIterator[Pipeline]:
    async with (
        running_receiver(paused) as (_, client),
        running_coalescers(paused),
        running_responders(paused),
    ):
        yield Pipeline(client, pool)


async def buyer(p: Pipeline, message_id: str, chat: str, text: str = "Is it still available?") -> str:
    r = await p.client.post(URL, json=avito_webhook(message_id, chat_id=chat, text=text))
    assert r.status_code == 200, r.text
    return r.json()["operation_id"]


async def seller(
    p: Pipeline, message_id: str, chat: str, text: str = "Yes, still here. Come by at 5!"
) -> dict:
    r = await p.client.post(URL, json=avito_webhook(message_id, chat_id=chat, author_id=SELLER, text=text))
    assert r.status_code == 200, r.text
    return r.json()


async def test_the_seller_answering_during_the_pause_withdraws_the_bots_reply(
    stack: Pipeline, world: FakeWorld, pool: asyncpg.Pool
) -> None:
    first = await buyer(stack, "b-1", "t1")
    await wait_for(
        lambda: pool.fetchval("SELECT count(*) > 0 FROM chat_windows WHERE status = 'open'"),
        what="the window",
    )
    ack = await seller(stack, "s-1", "t1")
    assert ack["status"] == "ignored"

    doc = await stack.settled(first)
    assert doc["status"] == "replied"
    assert doc["status_text"] == "answered by the seller (message s-1)"
    seller_doc = await stack.status(ack["operation_id"])
    assert seller_doc["status_text"].startswith("not for the bot: written by the seller")
    held = (await stack.client.get("/v1/chats?held=true", headers=ADMIN)).json()["chats"]
    assert [c["chat"] for c in held] == ["avito:777:t1"]
    # Nothing reached the chat from the bot, now or after the pause.
    await wait_for(
        lambda: pool.fetchval("SELECT count(*) = 0 FROM chat_windows WHERE status = 'open'"), what="no window"
    )
    assert world.replies_to("t1") == []


async def test_a_buyer_writing_while_the_seller_holds_the_chat_waits_until_a_person_hands_it_back(
    stack: Pipeline, world: FakeWorld, pool: asyncpg.Pool
) -> None:
    await seller(stack, "s-2", "t2")
    during = await buyer(stack, "b-2", "t2", "And delivery?")
    await wait_for(
        lambda: pool.fetchval("SELECT count(*) > 0 FROM chat_windows WHERE blocked"), what="a held window"
    )
    doc = await stack.status(during)
    assert doc["status"] == "waiting"
    assert doc["status_text"].startswith("held by the seller until")
    assert world.replies_to("t2") == []
    # Waiting on purpose, not late: counted apart, out of the Backlog and its oldest age.
    numbers = (await stack.client.get("/v1/stats", headers=ADMIN)).json()
    assert numbers["backlog"]["held"]["count"] == 1
    assert numbers["backlog"]["waiting"]["count"] == 0
    assert numbers["backlog_total"] == 0 and numbers["oldest_unfinished_age_seconds"] == 0

    r = await stack.client.post("/v1/chats/avito:777:t2/resume", headers=ADMIN)
    assert r.status_code == 200
    assert (await stack.settled(during, within=30))["status"] == "replied"
    assert len(world.replies_to("t2")) == 1
    # The next message is answered as usual.
    nxt = await buyer(stack, "b-3", "t2", "Price?")
    assert (await stack.settled(nxt, within=30))["status"] == "replied"
    again = await stack.client.post("/v1/chats/avito:777:t2/resume", headers=ADMIN)
    assert again.status_code == 409


async def test_a_hold_that_runs_out_hands_the_chat_back_and_its_waiting_messages_are_answered(
    paused: Settings, pool: asyncpg.Pool, world: FakeWorld
) -> None:
    short = replace(paused, takeover_seconds=2)
    async with running_receiver(short) as (_, client), running_coalescers(short), running_responders(short):
        p = Pipeline(client, pool)
        await seller(p, "s-4", "t4")
        waiting = await buyer(p, "b-4", "t4")
        assert (await p.settled(waiting, within=30))["status"] == "replied"
    assert len(world.replies_to("t4")) == 1


async def test_our_own_reply_coming_back_is_an_echo_and_takes_nothing_over(
    stack: Pipeline, world: FakeWorld, pool: asyncpg.Pool
) -> None:
    first = await buyer(stack, "b-5", "t5")
    doc = await stack.settled(first, within=30)
    (reply,) = [m for m in world.avito if m["chat_id"] == "t5"]
    echo = await seller(stack, reply["id"], "t5", reply["text"])
    assert (await stack.status(echo["operation_id"]))[
        "status_text"
    ] == "not for the bot: our own message (echo)"
    assert doc["status"] == "replied"
    assert await pool.fetchval("SELECT count(*) FROM chats WHERE held_until IS NOT NULL") == 0


async def test_a_takeover_of_zero_seconds_withdraws_pending_replies_but_does_not_hold_the_chat(
    paused: Settings, pool: asyncpg.Pool, world: FakeWorld
) -> None:
    off = replace(paused, takeover_seconds=0)
    async with running_receiver(off) as (_, client), running_coalescers(off), running_responders(off):
        p = Pipeline(client, pool)
        first = await buyer(p, "b-6", "t6")
        await wait_for(
            lambda: pool.fetchval("SELECT count(*) > 0 FROM chat_windows WHERE status = 'open'"),
            what="the window",
        )
        await seller(p, "s-6", "t6")
        assert "answered by the seller" in (await p.settled(first))["status_text"]
        after = await buyer(p, "b-7", "t6", "Delivery?")
        assert (await p.settled(after, within=30))["status"] == "replied"
    assert len(world.replies_to("t6")) == 1
