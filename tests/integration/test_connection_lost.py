"""The responder's Postgres connection lost while it records replies the platform took
(issue 40, point 3). The jobs in flight share one connection and record their replies in
one statement; when that connection drops, every handler of the batch runs again. The
process still holds the platform's message ids: the record is made again with them before
anything else, and no delivered reply goes to a person. (Each job claimed again instead,
found its delivery 'sending' and, on Telegram, which cannot be asked, ended needs_review:
one Postgres blip could hand up to RESPONDER_BATCH_JOBS delivered replies to a person.)"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest

from services.responder.parts import split_reply
from shared.settings import Settings
from tests.conftest import replace
from tests.fakes.world import FakeWorld
from tests.support.broker import wait_for
from tests.support.pipeline import Pipeline
from tests.support.receiver import running_receiver
from tests.support.services import running_coalescers, running_responders
from tests.support.tcpproxy import proxy_for, through

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("clean")]

CHATS = 5


@contextlib.asynccontextmanager
async def responder_behind_a_proxy(
    settings: Settings, pool: asyncpg.Pool, **changes: Any
) -> AsyncIterator[Pipeline]:
    """The pipeline, its responder reaching Postgres through a proxy that ``cut_when``
    cuts."""
    url = settings.database_url.get_secret_value()
    proxy = await proxy_for(url)
    responder = replace(settings, database_url=through(url, proxy), **changes)
    try:
        async with (
            running_receiver(settings) as (_, client),
            running_coalescers(settings),
            running_responders(responder),
        ):
            p = Pipeline(client, pool)
            p.proxy = proxy  # type: ignore[attr-defined]
            yield p
    finally:
        await proxy.close()


async def cut_when(p: Pipeline, condition: str, what: str) -> None:
    """Once ``condition`` (a query) holds, the responder's connections drop; Postgres
    answers again at once."""
    await wait_for(lambda: p.pool.fetchval(condition), what=what)
    p.proxy.block()  # type: ignore[attr-defined]
    p.proxy.unblock()  # type: ignore[attr-defined]


async def test_replies_sent_while_the_responders_connection_drops_are_recorded_with_their_ids_not_handed_to_a_person(
    fast: Settings, pool: asyncpg.Pool, world: FakeWorld
) -> None:
    # Each send takes a while (under the 1 s timeout): the cut comes meanwhile.
    world.fail("telegram.send", *["slow:0.7"] * CHATS)
    async with responder_behind_a_proxy(fast, pool, responder_concurrency=8) as p:
        ops = [await p.telegram(100 + n, 500 + n, f"question {n}") for n in range(CHATS)]
        await cut_when(
            p,
            f"SELECT count(*) = {CHATS} FROM deliveries WHERE status = 'sending'",
            "every reply on its way to Telegram",
        )
        docs = [await p.settled(op, within=30) for op in ops]
    assert [d["status"] for d in docs] == ["replied"] * CHATS, [d["status_text"] for d in docs]
    assert [d["status_text"].startswith("reply sent") for d in docs] == [True] * CHATS
    # The ids recorded are the ones Telegram gave, each reply once.
    sent = {str(m["message_id"]) for m in world.telegram}
    assert len(world.telegram) == CHATS
    assert {d["reply"]["platform_message_id"] for d in docs} == sent


async def test_a_part_sent_while_the_connection_drops_is_recorded_with_its_id_and_the_reply_goes_on(
    fast: Settings, pool: asyncpg.Pool, world: FakeWorld
) -> None:
    """The same for a reply in parts: part 2 went out while the connection dropped; its
    record is made again with Telegram's id, and part 3 follows (each part once)."""
    from tests.integration.test_reply_parts import LONG

    world.llm_answer = LONG
    world.fail("telegram.send", "slow:0", "slow:0.7")  # part 2 takes a while: the cut comes meanwhile
    with_model = replace(fast, llm_base_url=f"{world.url}/v1", llm_timeout_seconds=5)
    async with responder_behind_a_proxy(with_model, pool) as p:
        op = await p.telegram(200, 600, "Tell me everything")
        await cut_when(
            p,
            "SELECT count(*) = 1 FROM delivery_parts WHERE part = 2 AND status = 'sending'",
            "part 2 on its way to Telegram",
        )
        doc = await p.settled(op, within=30)
    assert doc["status"] == "replied", doc["status_text"]
    assert [m["text"] for m in world.telegram] == split_reply(LONG, 4096)
    parts = await pool.fetch("SELECT part, status, platform_message_id FROM delivery_parts ORDER BY part")
    assert [(r["part"], r["status"]) for r in parts] == [(1, "sent"), (2, "sent"), (3, "sent")]
    assert [r["platform_message_id"] for r in parts] == [str(m["message_id"]) for m in world.telegram]
