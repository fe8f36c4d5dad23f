"""Avito as the live API is (issue 38): the message list in both shapes it is known to
come in, the account named by ``/core/v1/accounts/self`` from the first start, refusals
of the account as a whole (401 a fresh token does not cure, 402) paused once with the
reason, a poll that asks little of Avito's per-minute limits and keeps its progress per
chat, and a first connection that answers only what is recent."""

from __future__ import annotations

import time

import asyncpg
import pytest

from shared.settings import Settings
from tests.conftest import replace
from tests.fakes.world import FakeWorld
from tests.support.avito import ME, URL, Stack, known_account
from tests.support.broker import wait_for
from tests.support.pipeline import ADMIN, Pipeline, running_pipeline

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("clean")]


async def status_of(pool: asyncpg.Pool, message_id: str) -> asyncpg.Record | None:
    return await pool.fetchrow(
        "SELECT id, status, status_reason FROM operations WHERE platform = 'avito' AND message_id = $1",
        message_id,
    )


def calls(world: FakeWorld, name: str) -> int:
    return sum(1 for c in world.platform_calls if c.name == name)


# ---- 1. the message list in both shapes ---------------------------------------------------


@pytest.mark.parametrize("shape", ["array", "object"])
async def test_the_poll_finds_a_lost_message_whichever_shape_the_message_list_comes_in(
    shape: str, stack: Stack, world: FakeWorld, pool: asyncpg.Pool
) -> None:
    world.avito_list_shape = shape
    await known_account(stack, world)
    lost = world.avito_buyer_writes(ME, "u2i-lost", "Do you deliver?")
    assert await stack.poll() == 1
    row = await status_of(pool, lost["payload"]["value"]["id"])
    assert row is not None
    assert (await stack.p.settled(str(row["id"])))["status"] == "replied"
    assert len(world.replies_to("u2i-lost")) == 1


@pytest.mark.parametrize("shape", ["array", "object"])
async def test_a_send_whose_answer_was_lost_is_reconciled_whichever_shape_the_list_comes_in(
    shape: str, pipeline: Pipeline, world: FakeWorld
) -> None:
    world.avito_list_shape = shape
    world.fail("avito.send", "lost")
    hook = world.avito_buyer_writes(ME, "u2i-rec", "Is it still available?")
    r = await pipeline.client.post(URL, json=hook)
    doc = await pipeline.settled(r.json()["operation_id"])
    assert doc["status"] == "replied", doc
    assert len(world.replies_to("u2i-rec")) == 1
    assert doc["reply"]["platform_message_id"] == world.avito[0]["id"]


# ---- 8. who the Avito account is -----------------------------------------------------------


async def test_the_environments_avito_account_is_named_by_avito_and_polled_from_the_first_start(
    polling: Settings, world: FakeWorld, pool: asyncpg.Pool
) -> None:
    # A fresh deployment: no webhook has ever come, the inbox is empty. A buyer's message
    # whose webhook is lost is still found at the first start.
    world.avito_self = {"client-1": 4242}
    lost = world.avito_buyer_writes("4242", "u2i-first", "Hello, is it available?")
    async with running_pipeline(polling, pool) as p:
        row = await wait_for(
            lambda: status_of(pool, lost["payload"]["value"]["id"]),
            what="the start-up poll to find the message",
        )
        assert (await p.settled(str(row["id"])))["status"] == "replied"
    account = await pool.fetchrow(
        "SELECT source, name FROM accounts WHERE platform = 'avito' AND account_id = '4242'"
    )
    assert account is not None and account["source"] == "environment"
    assert calls(world, "getUserInfoSelf") >= 1


# ---- 9. refusals of the account as a whole -------------------------------------------------


@pytest.mark.parametrize(
    ("status", "words"),
    [(401, "refuses this application"), (402, "payment required")],
)
async def test_an_avito_refusal_of_the_whole_account_pauses_it_once_with_the_reason(
    status: int, words: str, pipeline: Pipeline, world: FakeWorld, pool: asyncpg.Pool
) -> None:
    world.avito_account_refusals[ME] = status
    hooks = [world.avito_buyer_writes(ME, f"u2i-r{i}", "Is it available?") for i in range(2)]
    ops = [(await pipeline.client.post(URL, json=h)).json()["operation_id"] for h in hooks]

    async def paused() -> asyncpg.Record | None:
        return await pool.fetchrow(
            "SELECT state, state_reason FROM accounts WHERE platform = 'avito' AND account_id = $1"
            " AND state = 'paused_by_platform'",
            ME,
        )

    account = await wait_for(paused, what="the account to be paused")
    assert words in account["state_reason"].lower()
    await wait_for(lambda: any(a["body"]["type"] == "account.paused" for a in world.alerts), what="the alert")
    alerts = [a for a in world.alerts if a["body"]["type"] == "account.paused"]
    assert len(alerts) == 1
    # Nothing failed: both messages wait for the account, not a person.
    for op in ops:
        doc = await pipeline.status(op)
        assert doc["status"] not in ("failed", "needs_review"), doc
    # The account works again: the probe resumes it, both are answered.
    del world.avito_account_refusals[ME]
    await pool.execute("UPDATE accounts SET next_probe_at = now() WHERE platform = 'avito'")
    for op in ops:
        assert (await pipeline.settled(op, within=30))["status"] == "replied"


async def test_a_generic_reply_endpoint_that_refuses_our_signature_pauses_the_account(
    pipeline: Pipeline, world: FakeWorld, pool: asyncpg.Pool
) -> None:
    from tests.conftest import GENERIC_SECRET
    from tests.support.payloads import dumps, generic_message, signed

    world.fail("generic.send", "401")
    body = dumps(generic_message("g-401", chat_id="g-c"))
    r = await pipeline.client.post(
        "/v1/webhooks/generic", content=body, headers=signed(GENERIC_SECRET, body, webhook_id="w-401")
    )
    op = r.json()["operation_id"]

    async def paused() -> asyncpg.Record | None:
        return await pool.fetchrow(
            "SELECT state_reason FROM accounts WHERE platform = 'generic' AND state = 'paused_by_platform'"
        )

    account = await wait_for(paused, what="the generic account to be paused")
    assert "401" in account["state_reason"]
    doc = await pipeline.status(op)
    assert doc["status"] not in ("failed", "needs_review"), doc
    # The endpoint takes our signature again: the probe finds it, the reply goes.
    await pool.execute("UPDATE accounts SET next_probe_at = now() WHERE platform = 'generic'")
    assert (await pipeline.settled(op, within=30))["status"] == "replied"
    assert world.generic_probes and len(world.replies_to("g-c")) == 1


# ---- 10. a poll that respects Avito's limits ---------------------------------------------


def settled_a_while_ago(world: FakeWorld, chat_id: str) -> None:
    """The chat was last updated a minute ago (a round reads again a chat updated within a
    few seconds of it: Avito's times are whole seconds)."""
    world.avito_chats[(ME, chat_id)]["updated"] -= 60


async def many_quiet_chats(world: FakeWorld, n: int) -> None:
    """``n`` chats last written to a day and more ago, newest first in the list."""
    old = int(time.time()) - 2 * 86400
    for i in range(n):
        world.add_avito_chat(ME, f"u2i-quiet-{i}", updated=old - i, unread=False)


async def test_a_round_over_3000_chats_of_which_3_changed_asks_avito_four_times(
    stack: Stack, world: FakeWorld, pool: asyncpg.Pool
) -> None:
    await many_quiet_chats(world, 3000)
    await known_account(stack, world)
    settled_a_while_ago(world, "u2i-known")
    await stack.poll()  # the account's first round
    for i in range(3):
        world.avito_buyer_writes(ME, f"u2i-new-{i}", "Do you deliver?", created=int(time.time()) - 30)
    before = {n: calls(world, n) for n in ("getChatsV2", "getMessagesV3")}
    assert await stack.poll() == 3
    asked = {n: calls(world, n) - before[n] for n in before}
    assert asked == {"getChatsV2": 1, "getMessagesV3": 3}, asked


async def test_a_429_in_the_middle_of_a_round_does_not_send_the_next_round_back_a_day(
    stack: Stack, world: FakeWorld, pool: asyncpg.Pool
) -> None:
    await known_account(stack, world)
    settled_a_while_ago(world, "u2i-known")
    await stack.poll()
    for i in range(5):
        world.avito_buyer_writes(ME, f"u2i-busy-{i}", "Still for sale?", created=int(time.time()) - 30 + i)
    # Avito limits the third message list of the round: it stops there, and every process
    # holds the account's requests for the second Avito asked.
    world.fail("avito.list", "ok", "ok", "429:1")
    before = calls(world, "getMessagesV3")
    await stack.poll()
    assert calls(world, "getMessagesV3") - before == 3
    await pool.execute("UPDATE platform_budgets SET paused_until = now()")  # the second has passed

    async def all_stored() -> bool:
        await stack.poll()
        n = await pool.fetchval(
            "SELECT count(DISTINCT chat_id) FROM operations WHERE chat_id LIKE 'u2i-busy-%'"
        )
        return n == 5

    await wait_for(all_stored, what="the next rounds to read what the broken one did not")
    # The next round read only the three chats the broken one had not finished (the one
    # Avito refused included), not all five again.
    assert calls(world, "getMessagesV3") - before == 3 + 3
    for i in range(5):
        assert await pool.fetchval("SELECT count(*) FROM operations WHERE chat_id = $1", f"u2i-busy-{i}") == 1


# ---- 11. the first connection answers only what is recent ---------------------------------


async def test_connecting_an_account_answers_only_recent_messages_and_leaves_older_ones_to_the_seller(
    polling: Settings, world: FakeWorld, pool: asyncpg.Pool
) -> None:
    settings = replace(polling, avito_backfill_seconds=3600)
    old = world.avito_buyer_writes(
        ME, "u2i-yesterday", "Is it available?", created=int(time.time()) - 5 * 3600
    )
    recent = world.avito_buyer_writes(ME, "u2i-recent", "Do you deliver?", created=int(time.time()) - 600)
    async with running_pipeline(settings, pool) as p:
        found = await wait_for(
            lambda: status_of(pool, recent["payload"]["value"]["id"]), what="the first poll"
        )
        assert (await p.settled(str(found["id"])))["status"] == "replied"
        left = await status_of(pool, old["payload"]["value"]["id"])
        assert left is not None and left["status"] == "ignored"
        assert "CHATQ_AVITO_BACKFILL_SECONDS" in left["status_reason"]
        assert (await p.client.get(f"/v1/operations/{left['id']}", headers=ADMIN)).status_code == 200
    assert world.replies_to("u2i-yesterday") == []
