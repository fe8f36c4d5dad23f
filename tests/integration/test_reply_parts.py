"""A reply longer than the platform takes reaches the chat as ordered parts, each once,
also when a part fails on the way and the job resumes."""

from __future__ import annotations

import asyncpg
import pytest

from services.responder.parts import split_reply
from shared.settings import Settings
from tests.conftest import replace
from tests.fakes.world import FakeWorld
from tests.support.pipeline import Pipeline
from tests.support.receiver import running_receiver
from tests.support.services import running_coalescers, running_responders

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("clean")]

LONG = " ".join(f"Sentence number {n} tells the buyer one more thing about the listing." for n in range(130))


@pytest.fixture
def model(fast: Settings, world: FakeWorld) -> Settings:
    world.llm_answer = LONG  # about 9,000 characters
    return replace(fast, llm_base_url=f"{world.url}/v1", llm_timeout_seconds=5)


def telegram_texts(world: FakeWorld, chat: int) -> list[str]:
    return [m["text"] for m in world.telegram if str(m["chat_id"]) == str(chat)]


async def test_a_reply_of_9000_characters_reaches_telegram_as_ordered_parts_each_once(
    model: Settings, pool: asyncpg.Pool, world: FakeWorld
) -> None:
    assert len(LONG) > 8500
    async with running_receiver(model) as (_, client), running_coalescers(model), running_responders(model):
        p = Pipeline(client, pool)
        doc = await p.settled(await p.telegram(1, 91, "Tell me everything"))
    assert doc["status"] == "replied"
    parts = split_reply(LONG, 4096)
    assert len(parts) == 3
    assert telegram_texts(world, 91) == parts
    recorded = await pool.fetch("SELECT part, status FROM delivery_parts ORDER BY part")
    assert [(r["part"], r["status"]) for r in recorded] == [(1, "sent"), (2, "sent"), (3, "sent")]


async def test_a_part_refused_for_a_while_is_sent_later_and_the_parts_before_it_are_not_sent_again(
    model: Settings, pool: asyncpg.Pool, world: FakeWorld
) -> None:
    async with running_receiver(model) as (_, client), running_coalescers(model), running_responders(model):
        p = Pipeline(client, pool)
        # The first part goes; the second meets a 429 (Telegram's limit) and the job waits.
        world.fail("telegram.send:92", "slow:0", "429:1")
        doc = await p.settled(await p.telegram(2, 92, "Tell me everything"), within=40)
    assert doc["status"] == "replied"
    assert telegram_texts(world, 92) == split_reply(LONG, 4096)
    assert len(world.llm) == 1  # resumed from the text already half sent, never written anew
