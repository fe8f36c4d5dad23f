"""Many sellers, one deployment (issue 21): accounts added through the admin API, each
answered with its own credentials on its own webhook, none touching another's; the
environment's single account working as before beside them; credentials never shown."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator

import asyncpg
import httpx
import pytest
from cryptography.fernet import Fernet

from shared.settings import Settings
from stores.accounts.registry import AccountRegistry
from tests.conftest import AVITO_SECRET, GENERIC_SECRET, TELEGRAM_SECRET, replace
from tests.fakes.world import FakeWorld
from tests.support.broker import wait_for
from tests.support.payloads import avito_webhook, dumps, generic_message, signed, telegram_update
from tests.support.pipeline import ADMIN, Pipeline
from tests.support.receiver import running_receiver
from tests.support.services import running_coalescers, running_responders

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("clean")]

KEY = Fernet.generate_key().decode()
SHOP2 = {
    "platform": "avito",
    "account_id": "888",
    "name": "Second shop",
    "credentials": {
        "client_id": "client-2",
        "client_secret": "client-2-secret-value",
        "webhook_secret": "shop2-path-secret-0123456789",
    },
    "overrides": {"facts": "[facts]\nprice, cost: The second shop's price is 500 rub."},
}
BOT2_TOKEN = "5151:AAbot-two-token-0123456789abcdef"
BOT2 = {
    "platform": "telegram",
    "account_id": "5151",
    "name": "Second bot",
    "credentials": {"bot_token": BOT2_TOKEN, "webhook_secret": "bot2-secret-token-0123456789"},
}
SECRETS = [
    SHOP2["credentials"]["client_secret"],
    SHOP2["credentials"]["webhook_secret"],
    BOT2_TOKEN,
    BOT2["credentials"]["webhook_secret"],
]


@pytest.fixture
def keyed(fast: Settings) -> Settings:
    return replace(fast, secrets_key=KEY)


async def operations(pool: asyncpg.Pool) -> int:
    return await pool.fetchval("SELECT count(*) FROM operations")


SHOP2_PATH = f"/v1/webhooks/avito/{SHOP2['credentials']['webhook_secret']}"


@contextlib.asynccontextmanager
async def running(settings: Settings, pool: asyncpg.Pool, *accounts: dict) -> AsyncIterator[Pipeline]:
    """The pipeline in-process, with these accounts added through the admin API."""
    async with (
        running_receiver(settings) as (_, client),
        running_coalescers(settings),
        running_responders(settings),
    ):
        for account in accounts:
            await add(client, account)
        yield Pipeline(client, pool)


async def add(client: httpx.AsyncClient, account: dict) -> dict:
    r = await client.post("/v1/accounts", json=account, headers=ADMIN)
    assert r.status_code == 200, r.text
    return r.json()


async def test_a_second_avito_account_is_answered_with_its_own_credentials_and_facts_beside_the_first(
    keyed: Settings, pool: asyncpg.Pool, world: FakeWorld
) -> None:
    world.avito_accounts = {"777": "client-1", "888": "client-2"}  # each token serves its own account
    async with running(keyed, pool) as p:
        client = p.client
        added = await add(client, SHOP2)
        assert added["created"] and added["state"] == "active" and added["source"] == "admin"
        assert added["webhook_path"] == "/v1/webhooks/avito/***"
        assert added["credentials_set"] == ["client_id", "client_secret", "webhook_secret"]
        second = await client.post(
            SHOP2_PATH, json=avito_webhook("s2-1", user_id=888, chat_id="c", text="price?")
        )
        first = await client.post(
            f"/v1/webhooks/avito/{AVITO_SECRET}", json=avito_webhook("s1-1", user_id=777, chat_id="c")
        )
        for r in (second, first):
            assert (await p.settled(r.json()["operation_id"]))["status"] == "replied"
        stats = (await client.get("/v1/stats", params={"account": "avito:888"}, headers=ADMIN)).json()
    sent = {m["user_id"]: m["text"] for m in world.avito}
    assert "The second shop's price is 500 rub." in sent["888"]
    assert "500 rub" not in sent["777"]  # the first account writes with the global facts
    assert stats["account"] == "avito:888" and stats["last_24h"]["replied"] == 1
    (numbers,) = stats["accounts"]
    assert (numbers["account_id"], numbers["state"], numbers["backlog"]) == ("888", "active", 0)
    assert (
        await pool.fetchval("SELECT source FROM accounts WHERE platform = 'avito' AND account_id = '777'")
        == "environment"
    )


async def test_credentials_are_sealed_in_postgres_and_never_shown_by_the_api_or_the_logs(
    keyed: Settings, pool: asyncpg.Pool, world: FakeWorld, caplog: pytest.LogCaptureFixture
) -> None:
    # What the services log at LOG_LEVEL=DEBUG, libraries as shared.logging sets them.
    caplog.set_level(logging.INFO)
    for ours in ("services", "shared"):
        caplog.set_level(logging.DEBUG, logger=ours)
    caplog.set_level(logging.WARNING, logger="httpx")
    async with running(keyed, pool) as p:
        client = p.client
        shown = [await add(client, SHOP2), await add(client, BOT2)]
        r = await client.post(
            "/v1/webhooks/telegram/5151",
            json=telegram_update(1, chat_id=42, text="hello"),
            headers={"X-Telegram-Bot-Api-Secret-Token": BOT2["credentials"]["webhook_secret"]},
        )
        assert (await p.settled(r.json()["operation_id"]))["status"] == "replied"
        for url in ("/v1/accounts", "/v1/accounts/telegram/5151", "/v1/accounts/avito/888", "/v1/stats"):
            shown.append((await client.get(url, headers=ADMIN)).json())
        bad = await client.post(
            "/v1/accounts", json={**BOT2, "credentials": {"bot_token": "1:" + BOT2_TOKEN}}, headers=ADMIN
        )
        shown.append(bad.json())
    assert bad.status_code == 422
    assert [m["chat_id"] for m in world.telegram] == [42]
    stored = b"".join(r["credentials"] or b"" for r in await pool.fetch("SELECT credentials FROM accounts"))
    text = repr(shown) + caplog.text + repr(stored)
    for secret in SECRETS:
        assert secret not in text


async def test_hostile_ids_across_accounts_are_refused_or_kept_apart(
    keyed: Settings, pool: asyncpg.Pool, world: FakeWorld
) -> None:
    async with running(keyed, pool, SHOP2, BOT2) as p:
        client, own = p.client, SHOP2_PATH
        refused = [
            # Account 888's path, a body for account 777.
            await client.post(own, json=avito_webhook("h-1", user_id=777)),
            # The environment's path, a body for the added account 888.
            await client.post(f"/v1/webhooks/avito/{AVITO_SECRET}", json=avito_webhook("h-2", user_id=888)),
            # Bot 5151's path with the environment bot's secret token.
            await client.post(
                "/v1/webhooks/telegram/5151",
                json=telegram_update(7, chat_id=1),
                headers={"X-Telegram-Bot-Api-Secret-Token": TELEGRAM_SECRET},
            ),
            # A bot nobody added.
            await client.post(
                "/v1/webhooks/telegram/6161",
                json=telegram_update(8, chat_id=1),
                headers={"X-Telegram-Bot-Api-Secret-Token": TELEGRAM_SECRET},
            ),
        ]
        # A bot nobody added answers as a wrong secret token does (issue 39).
        assert [r.status_code for r in refused] == [403, 403, 401, 401]
        assert await operations(pool) == 0
        # The same chat and message ids on two bots, and generic ids that would collide
        # if joined by a separator: four chats, four replies, each on its own account.
        same = telegram_update(9, chat_id=300, text="price?")
        ops = [
            (
                await client.post(
                    "/v1/webhooks/telegram",
                    json=same,
                    headers={"X-Telegram-Bot-Api-Secret-Token": TELEGRAM_SECRET},
                )
            ).json(),
            (
                await client.post(
                    "/v1/webhooks/telegram/5151",
                    json=same,
                    headers={"X-Telegram-Bot-Api-Secret-Token": BOT2["credentials"]["webhook_secret"]},
                )
            ).json(),
        ]
        for n, (account, chat) in enumerate((("a:b", "c"), ("a", "b:c"))):
            body = dumps({**generic_message(f"m-{n}", chat_id=chat), "account_id": account})
            r = await client.post(
                "/v1/webhooks/generic", content=body, headers=signed(GENERIC_SECRET, body, webhook_id=f"w{n}")
            )
            ops.append(r.json())
        assert not any(o["duplicate"] for o in ops)
        for o in ops:
            assert (await p.settled(o["operation_id"]))["status"] == "replied"
    assert await pool.fetchval("SELECT count(DISTINCT chat_key) FROM chats") == 4
    assert await pool.fetchval("SELECT count(*) FROM reply_jobs WHERE status = 'sent'") == 4
    # Chat 300 of each bot, answered by that bot (its own token).
    assert sorted((m["bot"], m["chat_id"]) for m in world.telegram) == [(4242, 300), (5151, 300)]
    assert len(world.generic) == 2


async def test_a_person_paused_account_waits_while_another_is_answered_and_goes_on_when_resumed(
    keyed: Settings, pool: asyncpg.Pool, world: FakeWorld
) -> None:
    async with running(keyed, pool, SHOP2) as p:
        client, own = p.client, SHOP2_PATH
        paused = await client.post(
            "/v1/accounts/avito/888/pause", json={"reason": "holiday", "by": "anna"}, headers=ADMIN
        )
        assert paused.json()["state"] == "paused_by_person" and "holiday" in paused.json()["reason"]
        waiting = (await client.post(own, json=avito_webhook("p-1", user_id=888, chat_id="w"))).json()
        other = await p.telegram(1, 50, "still there?")
        assert (await p.settled(other))["status"] == "replied"
        await wait_for(
            lambda: pool.fetchval(
                "SELECT j.error_kind = 'account' FROM operations o JOIN reply_jobs j ON j.id = o.job_id"
                " WHERE o.id = $1",
                __import__("uuid").UUID(waiting["operation_id"]),
            ),
            what="the paused account's reply waiting",
        )
        assert (await p.status(waiting["operation_id"]))["status"] == "replying"
        resumed = await client.post("/v1/accounts/avito/888/resume", headers=ADMIN)
        assert resumed.json()["state"] == "active"
        assert (await p.settled(waiting["operation_id"], within=30))["status"] == "replied"


async def test_a_removed_account_is_refused_at_its_webhook_and_its_waiting_reply_fails_with_the_reason(
    keyed: Settings, pool: asyncpg.Pool, world: FakeWorld
) -> None:
    async with running(keyed, pool, SHOP2) as p:
        client, own = p.client, SHOP2_PATH
        await client.post("/v1/accounts/avito/888/pause", json={"reason": "closing"}, headers=ADMIN)
        waiting = (await client.post(own, json=avito_webhook("r-1", user_id=888, chat_id="r"))).json()
        await wait_for(
            lambda: pool.fetchval("SELECT count(*) = 1 FROM reply_jobs WHERE error_kind = 'account'"),
            what="the reply waiting",
        )
        removed = await client.delete("/v1/accounts/avito/888", headers=ADMIN)
        assert removed.json()["state"] == "removed" and removed.json()["credentials_set"] == []
        assert (await client.post(own, json=avito_webhook("r-2", user_id=888))).status_code == 401
        await client.post("/v1/accounts/avito/888/resume", headers=ADMIN)  # a removed account stays removed
        await pool.execute("UPDATE accounts SET state = 'active', state_reason = NULL")  # let the job run
        doc = await p.settled(waiting["operation_id"], within=30)
    assert doc["status"] == "failed" and "was removed" in doc["error"]["message"]
    assert await pool.fetchval("SELECT credentials IS NULL FROM accounts WHERE account_id = '888'")
    assert world.avito == []


async def test_todays_environment_configuration_starts_against_the_new_schema_and_answers(
    pipeline: Pipeline, pool: asyncpg.Pool, world: FakeWorld
) -> None:
    """No CHATQ_SECRETS_KEY, no account added: the bot of CHATQ_TELEGRAM_BOT_TOKEN is one
    account, made at start, answered on the single path as before."""
    op = await pipeline.telegram(1, 77, "Is it available?")
    assert (await pipeline.settled(op))["status"] == "replied"
    row = await pool.fetchrow("SELECT source, name, credentials FROM accounts WHERE platform = 'telegram'")
    assert (row["source"], row["name"], row["credentials"]) == ("environment", "environment", None)
    refused = await pipeline.client.post("/v1/accounts", json=SHOP2, headers=ADMIN)
    assert refused.status_code == 409 and "CHATQ_SECRETS_KEY" in refused.json()["error"]["message"]
    listed = (await pipeline.client.get("/v1/accounts", headers=ADMIN)).json()
    assert [(a["platform"], a["account_id"], a["source"]) for a in listed["accounts"]] == [
        ("telegram", "4242", "environment")
    ]


async def test_an_accounts_own_reply_pause_sets_its_windows_and_the_others_keep_the_global_one(
    keyed: Settings, pool: asyncpg.Pool, world: FakeWorld
) -> None:
    paced = {**SHOP2, "overrides": {"reply_delay_min_seconds": 1.5, "reply_delay_max_seconds": 1.5}}
    async with running(keyed, pool, paced) as p:
        slow = (await p.client.post(SHOP2_PATH, json=avito_webhook("d-1", user_id=888, chat_id="d"))).json()
        fast = await p.telegram(1, 60, "hello")
        for op in (slow["operation_id"], fast):
            assert (await p.settled(op))["status"] == "replied"
    delays = dict(await pool.fetch("SELECT platform, delay_seconds FROM chat_windows"))
    assert delays == {"avito": 1.5, "telegram": 0.0}


async def test_rotating_the_secrets_key_reseals_every_account_and_the_old_key_can_go(
    keyed: Settings, pool: asyncpg.Pool, world: FakeWorld
) -> None:
    new = Fernet.generate_key().decode()
    async with running(keyed, pool, SHOP2):
        pass
    rotated = replace(keyed, secrets_key=f"{new},{KEY}")
    async with running(rotated, pool) as p:
        r = await p.client.post("/v1/accounts/rotate-key", headers=ADMIN)
        assert r.json() == {"resealed": 1, "unopened": []}
    async with running(replace(keyed, secrets_key=new), pool) as p:
        r = await p.client.post(SHOP2_PATH, json=avito_webhook("k-1", user_id=888, chat_id="k"))
        assert (await p.settled(r.json()["operation_id"]))["status"] == "replied"


def bot(n: int) -> dict:
    """The n-th Telegram bot of a seller with many."""
    bot_id = str(700_000 + n)
    return {
        "platform": "telegram",
        "account_id": bot_id,
        "name": f"shop {n}",
        "credentials": {
            "bot_token": f"{bot_id}:AAscale-token-{n:06d}-abcdefghij",
            "webhook_secret": f"scale-secret-{n:06d}-abcdefgh",
        },
    }


@contextlib.asynccontextmanager
async def two_processes(settings: Settings, pool: asyncpg.Pool) -> AsyncIterator[Registries]:
    """The receiver (its accounts API and its registry) and another process's registry,
    listening, with no periodic read of every account meanwhile: whatever either knows of
    a change it learnt from that change."""
    quiet = replace(settings, accounts_refresh_seconds=3600)
    other = AccountRegistry.from_settings(pool, quiet)
    async with running_receiver(quiet) as (receiver, client):
        await other.start()
        try:
            yield Registries(client, receiver.public.state.runtime.accounts, other, pool)
        finally:
            await other.stop()


@dataclasses.dataclass
class Registries:
    client: httpx.AsyncClient
    own: AccountRegistry
    other: AccountRegistry
    pool: asyncpg.Pool
    sentinels: int = 0

    def counters(self) -> tuple[int, int, int, int]:
        return (self.own.rows_read, self.own.decrypted, self.other.rows_read, self.other.decrypted)

    async def caught_up(self) -> None:
        """Every change made so far read by both: a row added last (notifications come in
        the order of their commits) is known to both."""
        self.sentinels += 1
        tag = f"sentinel-{self.sentinels}"
        await self.pool.execute("INSERT INTO accounts (platform, account_id) VALUES ('generic', $1)", tag)
        await wait_for(
            lambda: self.own.get("generic", tag) and self.other.get("generic", tag),
            within=5,
            what="both processes to read the accounts' changes",
        )


async def test_adding_an_account_reads_and_decrypts_as_little_with_sixty_accounts_as_with_five(
    keyed: Settings, pool: asyncpg.Pool
) -> None:
    """Issue 21: adding 1,000 accounts took two minutes, as each add made every process read
    and decrypt every account. An add reads that account's row only, in the process that
    made it and in one that hears of it, whatever the number of accounts."""
    async with two_processes(keyed, pool) as r:

        async def cost_of_adding(n: int) -> tuple[int, ...]:
            await r.caught_up()
            before = r.counters()
            await add(r.client, bot(n))
            await r.caught_up()
            return tuple(
                a - b - sentinel for a, b, sentinel in zip(r.counters(), before, (1, 0, 1, 0), strict=True)
            )

        for n in range(4):
            await add(r.client, bot(n))
        few = await cost_of_adding(4)
        for n in range(5, 59):
            await add(r.client, bot(n))
        many = await cost_of_adding(59)
        assert await pool.fetchval("SELECT count(*) FROM accounts") > 60
        # Rows read and credentials decrypted: the adding process reads the new row when it
        # adds it and when it hears of it (decrypting it once); the other reads it once.
        assert few == many == (2, 1, 1, 1)
        assert r.other.get("telegram", bot(59)["account_id"]).credentials == bot(59)["credentials"]
        # The periodic read of every account decrypts none whose credentials did not change.
        rows, decrypted = r.other.rows_read, r.other.decrypted
        await r.other.refresh()
        assert r.other.decrypted == decrypted
        assert r.other.rows_read - rows == await pool.fetchval("SELECT count(*) FROM accounts")


async def test_a_process_whose_notifications_connection_was_cut_listens_again_and_misses_no_change(
    keyed: Settings, pool: asyncpg.Pool
) -> None:
    async with two_processes(keyed, pool) as r:
        assert r.other.listening
        # Postgres unreachable for the other process for a while (it would listen again
        # within milliseconds otherwise), then its connection cut.
        dsn = r.other._dsn
        r.other._dsn = "postgresql://postgres@127.0.0.1:1/unreachable"
        cut = await pool.fetchval(
            "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE datname = current_database() AND query LIKE 'LISTEN%') t"
        )
        assert cut >= 2  # the receiver's and the other process's
        await wait_for(lambda: not r.other.listening, within=5, what="the cut seen")
        # Changed while nobody listened: read when it listens again, not 3,600 s later.
        await add(r.client, SHOP2)
        assert r.other.get("avito", "888") is None
        r.other._dsn = dsn
        await wait_for(lambda: r.other.listening, within=15, what="listening again")
        await wait_for(lambda: r.other.get("avito", "888"), within=5, what="the account added meanwhile")
        # And from then on, notified as before.
        await r.client.post("/v1/accounts/avito/888/pause", json={"reason": "holiday"}, headers=ADMIN)
        await wait_for(
            lambda: r.other.get("avito", "888").state == "paused_by_person", within=5, what="the pause"
        )


async def test_another_process_sees_an_accounts_new_path_secret_pause_and_removal_at_once(
    keyed: Settings, pool: asyncpg.Pool
) -> None:
    async with two_processes(keyed, pool) as r:
        old = SHOP2["credentials"]["webhook_secret"]
        new = "shop2-new-path-secret-987654321"
        await add(r.client, SHOP2)
        shop = await wait_for(lambda: r.other.by_path_secret("avito", old), within=5, what="the new account")
        assert shop.account_id == "888" and shop.credentials["client_id"] == "client-2"
        await add(r.client, {**SHOP2, "credentials": {"webhook_secret": new}})
        await wait_for(lambda: r.other.by_path_secret("avito", new), within=5, what="its new path")
        # The old path answers no more, in either process; the other credentials were kept.
        assert r.other.by_path_secret("avito", old) is None and r.own.by_path_secret("avito", old) is None
        assert r.other.get("avito", "888").credentials["client_secret"] == "client-2-secret-value"
        await r.client.post("/v1/accounts/avito/888/pause", json={"reason": "holiday"}, headers=ADMIN)
        await wait_for(
            lambda: r.other.get("avito", "888").state == "paused_by_person", within=5, what="the pause"
        )
        await r.client.delete("/v1/accounts/avito/888", headers=ADMIN)
        await wait_for(lambda: r.other.get("avito", "888").removed, within=5, what="the removal")
        assert r.other.by_path_secret("avito", new) is None and r.other.get("avito", "888").credentials == {}
