"""Avito manners (issue 16): a buyer message whose webhook never came is found by the poll
and answered once, whatever the webhook does later, for every active Avito account with
its own credentials (issue 21), never for one removed or paused; an answered chat is
marked read (a failure there fails nothing); the reply writer knows the chat's listing and
answers in the buyer's language; chats with Avito itself are not answered."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import asyncpg
import pytest
from prometheus_client import REGISTRY

from services.receiver.recovery import POLL_LOCK_KEY
from shared.settings import Settings
from tests.conftest import replace
from tests.fakes.world import FakeWorld
from tests.support.avito import ME, URL, Stack, known_account
from tests.support.broker import wait_for
from tests.support.payloads import avito_webhook
from tests.support.pipeline import ADMIN, running_pipeline
from tests.support.receiver import running_receiver

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("clean")]

DELIVERY = "Hello! About “Bicycle” (12 000 ₽): We ship across the country; delivery takes 2-5 days."


def shop(account_id: str) -> dict:
    """An Avito account added as data, with client credentials of its own."""
    return {
        "platform": "avito",
        "account_id": account_id,
        "name": f"Shop {account_id}",
        "credentials": {
            "client_id": f"client-{account_id}",
            "client_secret": f"client-{account_id}-secret-value",
            "webhook_secret": f"shop-{account_id}-path-secret-0123456789",
        },
    }


def recovered_total() -> float:
    return REGISTRY.get_sample_value("chatq_recovered_messages_total", {"platform": "avito"}) or 0.0


def read_failures() -> float:
    return REGISTRY.get_sample_value("chatq_chat_read_failures_total", {"platform": "avito"}) or 0.0


async def operation_of(pool: asyncpg.Pool, message_id: str) -> asyncpg.Record:
    return await pool.fetchrow(
        "SELECT id, status, status_reason FROM operations WHERE platform = 'avito' AND message_id = $1",
        message_id,
    )


async def test_a_message_whose_webhook_never_came_is_found_by_the_poll_and_answered_once(
    stack: Stack, world: FakeWorld, pool: asyncpg.Pool
) -> None:
    await known_account(stack, world)
    before = recovered_total()
    lost = world.avito_buyer_writes(ME, "u2i-lost", "Do you deliver?")
    assert await stack.poll() == 1
    op = await operation_of(pool, lost["payload"]["value"]["id"])
    doc = await stack.p.settled(str(op["id"]))
    assert doc["status"] == "replied"
    assert world.replies_to("u2i-lost") == [DELIVERY]
    assert recovered_total() == before + 1
    kinds = [e["kind"] for e in doc["timeline"]]
    assert kinds[:2] == ["recovered", "received"]
    assert doc["timeline"][0]["event"] == "recovered by poll: the platform's webhook never brought it"
    # The answered chat is read in the seller's app now; the next poll finds nothing.
    assert (ME, "u2i-lost") in world.avito_reads
    assert await stack.poll() == 0

    # The webhook comes after all: the same operation, a duplicate, no second reply.
    late = await stack.p.client.post(URL, json=lost)
    assert late.json() == {"ok": True, "operation_id": str(op["id"]), "status": "replied", "duplicate": True}
    assert world.replies_to("u2i-lost") == [DELIVERY]
    assert await pool.fetchval("SELECT count(*) FROM operations WHERE chat_id = 'u2i-lost'") == 1


async def test_a_message_the_webhook_brought_is_not_stored_again_by_the_poll(
    stack: Stack, world: FakeWorld, pool: asyncpg.Pool
) -> None:
    # The chat stays unread: marking it read fails after the reply.
    world.fail("avito.read", "503")
    failures = read_failures()
    await known_account(stack, world)
    assert read_failures() == failures + 1  # the reply stands; the failure is counted
    world.avito_buyer_writes(ME, "u2i-known", "And the price?")  # a second one, its webhook lost
    assert await stack.poll() == 1
    assert await stack.poll() == 0
    events = await pool.fetchval("SELECT count(*) FROM operation_events WHERE kind = 'duplicate'")
    assert events == 0  # a poll that finds what is stored writes nothing
    assert await pool.fetchval("SELECT count(*) FROM operations WHERE chat_id = 'u2i-known'") == 2


async def test_what_came_before_the_accounts_latest_message_is_answered_already(
    stack: Stack, world: FakeWorld, pool: asyncpg.Pool
) -> None:
    await known_account(stack, world)
    world.avito_buyer_writes(ME, "u2i-old", "Hello?")  # answered by our reply below
    world.avito.append(
        {"id": "av-900", "user_id": ME, "chat_id": "u2i-old", "text": "Hi! Yes.", "created": 2**31 - 1}
    )
    assert await stack.poll() == 0
    assert await pool.fetchval("SELECT count(*) FROM operations WHERE chat_id = 'u2i-old'") == 0


async def test_a_lost_message_before_our_reply_to_a_later_one_is_still_found_and_answered(
    stack: Stack, world: FakeWorld, pool: asyncpg.Pool
) -> None:
    # Two buyer messages; only the first one's webhook comes. Our reply to it covers only
    # what the inbox held, and marks the chat read: neither may hide the lost one.
    first = world.avito_buyer_writes(ME, "u2i-pair", "Is it available?")
    lost = world.avito_buyer_writes(ME, "u2i-pair", "And do you deliver to Kazan?")
    r = await stack.p.client.post(URL, json=first)
    assert (await stack.p.settled(r.json()["operation_id"]))["status"] == "replied"
    assert (ME, "u2i-pair") in world.avito_reads
    assert len(world.replies_to("u2i-pair")) == 1

    assert await stack.poll() == 1
    op = await operation_of(pool, lost["payload"]["value"]["id"])
    assert (await stack.p.settled(str(op["id"])))["status"] == "replied"
    assert len(world.replies_to("u2i-pair")) == 2
    assert await stack.poll() == 0  # found once


async def test_a_chat_the_seller_only_opened_in_the_app_is_still_searched(
    stack: Stack, world: FakeWorld, pool: asyncpg.Pool
) -> None:
    await known_account(stack, world)
    lost = world.avito_buyer_writes(ME, "u2i-opened", "Can I pick it up today?")
    world.avito_chats[(ME, "u2i-opened")]["unread"] = False  # read in the app, not answered
    assert await stack.poll() == 1
    op = await operation_of(pool, lost["payload"]["value"]["id"])
    assert (await stack.p.settled(str(op["id"])))["status"] == "replied"
    assert len(world.replies_to("u2i-opened")) == 1


async def test_an_error_polling_one_account_does_not_stop_the_round_for_the_others(
    stack: Stack, world: FakeWorld, pool: asyncpg.Pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    await known_account(stack, world)
    world.avito_buyer_writes(ME, "u2i-after-boom", "Still for sale?")
    poller = stack.runtime.recovery
    assert poller is not None
    monkeypatch.setattr(poller, "accounts", lambda: ["1", ME])
    polled = poller._account

    async def breaks_on_the_first(account_id: str) -> int:
        if account_id == "1":
            raise RuntimeError("an answer nobody expected")
        return await polled(account_id)

    monkeypatch.setattr(poller, "_account", breaks_on_the_first)
    assert await stack.poll() == 1  # account 1 broke; 777's lost message was still found


def chat_lists_read(world: FakeWorld) -> dict[str, set[str | None]]:
    """Per Avito account whose chat list was read: the client ids whose tokens read it."""
    read: dict[str, set[str | None]] = {}
    for operation, user_id, client in world.avito_callers:
        if operation == "getChatsV2" and user_id is not None:
            read.setdefault(user_id, set()).add(client)
    return read


async def test_an_avito_account_added_as_data_has_its_lost_message_found_with_its_own_credentials(
    stack: Stack, world: FakeWorld, pool: asyncpg.Pool
) -> None:
    # Each account's Messenger API takes only its own client's tokens, as on Avito.
    world.avito_accounts = {ME: "client-1", "888": "client-888"}
    await known_account(stack, world)
    # Added while the receiver runs: the next round reads it, no restart.
    await stack.add(shop("888"))
    lost = world.avito_buyer_writes("888", "u2i-shop2-lost", "Do you deliver?")
    world.avito_buyer_writes(ME, "u2i-env-lost", "Is it still for sale?")
    assert await stack.poll() == 2
    op = await pool.fetchrow(
        "SELECT id, account_id FROM operations WHERE platform = 'avito' AND message_id = $1",
        lost["payload"]["value"]["id"],
    )
    assert op["account_id"] == "888"
    assert (await stack.p.settled(str(op["id"])))["status"] == "replied"
    assert world.replies_to("u2i-shop2-lost") == [DELIVERY]
    assert [m["user_id"] for m in world.avito if m["chat_id"] == "u2i-shop2-lost"] == ["888"]
    # Each account was read with its own token, and the environment's with the environment's.
    assert chat_lists_read(world) == {ME: {"client-1"}, "888": {"client-888"}}
    messages_read = {(u, c) for o, u, c in world.avito_callers if o == "getMessagesV3"}
    assert ("888", "client-888") in messages_read and ("888", "client-1") not in messages_read


async def test_a_removed_or_paused_avito_account_is_not_polled_and_a_resumed_one_is_again(
    stack: Stack, world: FakeWorld, pool: asyncpg.Pool
) -> None:
    await known_account(stack, world)
    for account in ("888", "999", "555000"):
        added = shop(account)
        await stack.add(added)
        # The inbox knows each: one message through the account's own webhook, answered.
        hook = world.avito_buyer_writes(account, f"u2i-known-{account}", "Is it still available?")
        r = await stack.p.client.post(
            f"/v1/webhooks/avito/{added['credentials']['webhook_secret']}", json=hook
        )
        assert (await stack.p.settled(r.json()["operation_id"]))["status"] == "replied"
        world.avito_buyer_writes(account, f"u2i-lost-{account}", "Do you deliver?")
    client = stack.p.client
    paused = await client.post("/v1/accounts/avito/888/pause", json={"reason": "holiday"}, headers=ADMIN)
    assert paused.json()["state"] == "paused_by_person"
    removed = await client.delete("/v1/accounts/avito/999", headers=ADMIN)
    assert removed.json()["state"] == "removed"
    # The platform refuses the third (no Messenger plan): the responder paused it, its
    # probe resumes it; the poll leaves it alone meanwhile.
    await pool.execute(
        "UPDATE accounts SET state = 'paused_by_platform', state_reason = 'no Messenger plan',"
        " next_probe_at = now() + interval '1 hour' WHERE account_id = '555000'"
    )
    registry = stack.runtime.accounts

    async def platform_pause_known() -> bool:
        account = registry.get("avito", "555000")
        return account is not None and account.state == "paused_by_platform"

    await wait_for(platform_pause_known, what="the receiver to learn of the platform's pause")
    world.avito_callers.clear()
    world.avito_buyer_writes(ME, "u2i-env-lost", "Is it still for sale?")
    assert await stack.poll() == 1  # the environment's account only
    assert set(chat_lists_read(world)) == {ME}
    for account in ("888", "999", "555000"):
        chat = f"u2i-lost-{account}"
        assert await pool.fetchval("SELECT count(*) FROM operations WHERE chat_id = $1", chat) == 0

    resumed = await client.post("/v1/accounts/avito/888/resume", headers=ADMIN)
    assert resumed.json()["state"] == "active"
    assert await stack.poll() == 1  # what came while it was paused
    assert await pool.fetchval("SELECT account_id FROM operations WHERE chat_id = 'u2i-lost-888'") == "888"
    assert set(chat_lists_read(world)) == {ME, "888"}


async def test_the_poll_reads_accounts_added_as_data_without_the_environments_avito_credentials(
    polling: Settings, world: FakeWorld, pool: asyncpg.Pool
) -> None:
    settings = replace(polling, avito_client_id=None, avito_client_secret=None)
    async with running_pipeline(settings, pool) as p:
        assert p.receiver is not None
        stack = Stack(p, p.receiver.public.state.runtime)
        assert await stack.poll() == 0  # no Avito account yet: nothing asked
        assert world.avito_callers == [] and world.avito_token_requests == 0
        await stack.add(shop("888"))
        lost = world.avito_buyer_writes("888", "u2i-only-shop", "Hello, is it available?")
        assert await stack.poll() == 1
        op = await operation_of(pool, lost["payload"]["value"]["id"])
        assert (await p.settled(str(op["id"])))["status"] == "replied"
    assert chat_lists_read(world) == {"888": {"client-888"}}


async def test_an_avito_account_the_inbox_knew_before_accounts_were_data_is_polled_after_the_upgrade(
    polling: Settings, world: FakeWorld, pool: asyncpg.Pool
) -> None:
    async def from_before_accounts_were_data() -> None:
        # A deployment from before the accounts table held every account: messages, no row.
        await pool.execute("DELETE FROM accounts")

    await found_at_the_next_start(polling, world, pool, "u2i-while-upgrading", from_before_accounts_were_data)
    row = await pool.fetchrow(
        "SELECT source, state FROM accounts WHERE platform = 'avito' AND account_id = $1", ME
    )
    assert (row["source"], row["state"]) == ("environment", "active")


async def test_only_one_replica_polls_at_a_time(stack: Stack, world: FakeWorld, pool: asyncpg.Pool) -> None:
    await known_account(stack, world)
    world.avito_buyer_writes(ME, "u2i-lost", "Do you deliver?")
    async with pool.acquire() as other_replica:
        assert await other_replica.fetchval("SELECT pg_try_advisory_lock($1)", POLL_LOCK_KEY)
        try:
            calls = len(world.platform_calls)
            assert await stack.poll() == 0
            assert len(world.platform_calls) == calls  # it did not ask Avito anything
        finally:
            await other_replica.execute("SELECT pg_advisory_unlock($1)", POLL_LOCK_KEY)
    assert await stack.poll() == 1


async def found_at_the_next_start(
    polling: Settings,
    world: FakeWorld,
    pool: asyncpg.Pool,
    chat: str,
    meanwhile: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """The receiver hears the account once and stops; (``meanwhile`` runs;) a buyer writes
    while it is down; the start-up poll of the next receiver stores that message."""
    async with running_receiver(polling) as (_, client):
        hook = world.avito_buyer_writes(ME, "u2i-known", "Is it still available?")
        assert (await client.post(URL, json=hook)).status_code == 200
    if meanwhile is not None:
        await meanwhile()
    world.avito_buyer_writes(ME, chat, "Hello, do you deliver?")
    async with running_receiver(polling):
        await wait_for(
            lambda: pool.fetchval("SELECT count(*) = 1 FROM operations WHERE chat_id = $1", chat),
            what="the start-up poll to store the message",
        )


async def test_the_poll_runs_at_start_up_for_what_arrived_while_the_service_was_down(
    polling: Settings, world: FakeWorld, pool: asyncpg.Pool
) -> None:
    await found_at_the_next_start(polling, world, pool, "u2i-while-down")


async def test_the_reply_writer_knows_the_listing_and_a_russian_buyer_is_answered_in_russian(
    stack: Stack, world: FakeWorld, pool: asyncpg.Pool
) -> None:
    world.add_avito_chat(ME, "u2i-bike", title="Велосипед Stels", price="12 000 ₽")
    hook = world.avito_buyer_writes(ME, "u2i-bike", "Здравствуйте! Велосипед ещё продаёте? Какая цена?")
    r = await stack.p.client.post(URL, json=hook)
    assert (await stack.p.settled(r.json()["operation_id"]))["status"] == "replied"
    assert world.replies_to("u2i-bike") == [
        "Здравствуйте! По объявлению «Велосипед Stels» (12 000 ₽): Да, в наличии. Цена в объявлении окончательная."
    ]
    cached = await pool.fetchval("SELECT listing FROM chat_listings WHERE chat_key = 'avito:777:u2i-bike'")
    assert cached == {
        "title": "Велосипед Stels",
        "price": "12 000 ₽",
        "url": "https://www.avito.ru/moskva/velosipedy/u2i-bike",
    }
    # The next reply of the chat reads the cached listing, not Avito.
    asked = sum(1 for c in world.platform_calls if c.name == "getChatByIdV2")
    hook = world.avito_buyer_writes(ME, "u2i-bike", "А доставка есть?")
    r = await stack.p.client.post(URL, json=hook)
    assert (await stack.p.settled(r.json()["operation_id"]))["status"] == "replied"
    assert world.replies_to("u2i-bike")[-1].startswith("Здравствуйте! По объявлению «Велосипед Stels»")
    assert sum(1 for c in world.platform_calls if c.name == "getChatByIdV2") == asked


async def test_the_model_is_told_the_listing_and_the_buyers_language(
    fast: Settings, world: FakeWorld, pool: asyncpg.Pool
) -> None:
    s = replace(fast, llm_base_url=f"{world.url}/v1")
    world.add_avito_chat(ME, "u2i-car", title="Mazda 3 2008", price="300 000 ₽")
    async with running_pipeline(s, pool) as p:
        hook = world.avito_buyer_writes(ME, "u2i-car", "Is it still available?")
        r = await p.client.post(URL, json=hook)
        assert (await p.settled(r.json()["operation_id"]))["status"] == "replied"
    system = world.llm[-1]["messages"][0]["content"]
    assert "in the buyer's language" in system
    assert system.endswith(
        "The buyer writes about this listing: “Mazda 3 2008”, 300 000 ₽, "
        "https://www.avito.ru/moskva/velosipedy/u2i-car"
    )


async def test_a_chat_with_avito_itself_is_stored_as_ignored_with_the_reason(
    stack: Stack, world: FakeWorld, pool: asyncpg.Pool
) -> None:
    body = avito_webhook("sys-1", chat_id="a2u-1", author_id=0, text="Ваше объявление опубликовано")
    body["payload"]["value"]["chat_type"] = "a2u"
    r = await stack.p.client.post(URL, json=body)
    assert r.json()["status"] == "ignored"
    doc = await stack.p.status(r.json()["operation_id"])
    assert doc["status_text"] == "not for the bot: a chat with Avito itself (a2u): not answered"
    system = avito_webhook(
        "sys-2", chat_id="u2i-9", author_id=0, type_="system", text="Покупатель оплатил заказ"
    )
    r = await stack.p.client.post(URL, json=system)
    assert (await stack.p.status(r.json()["operation_id"]))[
        "status_text"
    ] == "not for the bot: Avito system message"
