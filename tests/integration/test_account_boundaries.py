"""Trying to break the promise of "Many accounts" (issue 21) where its edges are: an
account of the environment removed, an added account's webhook secret that is the
environment's, a key rotation run the moment the key file changed, and a pause or a
removal while a reply is being written."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import pytest
from cryptography.fernet import Fernet, InvalidToken

from shared.settings import Settings
from tests.conftest import AVITO_SECRET, GENERIC_SECRET, replace
from tests.fakes.world import FakeWorld
from tests.integration.test_many_accounts import BOT2, KEY, SHOP2, running
from tests.support.broker import wait_for
from tests.support.payloads import avito_webhook, dumps, generic_message, signed, telegram_update
from tests.support.pipeline import ADMIN, TG, Pipeline

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("clean")]

BOT2_SECRET = {"X-Telegram-Bot-Api-Secret-Token": BOT2["credentials"]["webhook_secret"]}


@pytest.fixture
def keyed(fast: Settings) -> Settings:
    return replace(fast, secrets_key=KEY)


async def operations(pool: asyncpg.Pool) -> int:
    return await pool.fetchval("SELECT count(*) FROM operations")


async def test_a_removed_account_of_the_environment_is_refused_on_the_single_paths_too(
    pipeline: Pipeline, pool: asyncpg.Pool, world: FakeWorld
) -> None:
    """The environment's bot, Avito account and generic sender, each removed by a person:
    their single paths answer 404, the bot's own path 401 as for a bot never added, and
    nothing is stored."""
    client = pipeline.client
    avito_path = f"/v1/webhooks/avito/{AVITO_SECRET}"

    def generic(n: int) -> tuple[bytes, dict[str, str]]:
        body = dumps(generic_message(f"g-{n}"))
        return body, signed(GENERIC_SECRET, body, webhook_id=f"gw-{n}")

    # The Avito and generic accounts get their rows with their first message.
    first = [
        (await client.post(avito_path, json=avito_webhook("a-1", user_id=777))).json()["operation_id"],
    ]
    body, headers = generic(1)
    first.append(
        (await client.post("/v1/webhooks/generic", content=body, headers=headers)).json()["operation_id"]
    )
    for op in first:
        assert (await pipeline.settled(op))["status"] == "replied"
    for account in ("telegram/4242", "avito/777", "generic/shop-1"):
        removed = await client.delete(f"/v1/accounts/{account}", headers=ADMIN)
        assert removed.json()["state"] == "removed", removed.text
    before = await operations(pool)
    body, headers = generic(2)
    answers = [
        await client.post("/v1/webhooks/telegram", json=telegram_update(5, chat_id=9), headers=TG),
        await client.post("/v1/webhooks/telegram/4242", json=telegram_update(6, chat_id=9), headers=TG),
        await client.post(avito_path, json=avito_webhook("a-2", user_id=777)),
        await client.post("/v1/webhooks/generic", content=body, headers=headers),
    ]
    # The bot's own path answers as for a bot never added (issue 39: no 404/401 oracle).
    assert [r.status_code for r in answers] == [404, 401, 404, 404], [r.text for r in answers]
    assert await operations(pool) == before


async def test_an_added_avito_account_cannot_take_the_environments_path_secret(
    keyed: Settings, pool: asyncpg.Pool, world: FakeWorld
) -> None:
    """Two accounts with one Avito path: every delivery of the environment's account
    would be taken for the added one's and refused (403). The add is refused instead."""
    clash = {**SHOP2, "credentials": {**SHOP2["credentials"], "webhook_secret": AVITO_SECRET}}
    async with running(keyed, pool) as p:
        refused = await p.client.post("/v1/accounts", json=clash, headers=ADMIN)
        assert refused.status_code == 409, refused.text
        assert refused.json()["error"]["code"] == "webhook_secret_taken"
        assert AVITO_SECRET not in refused.text
        r = await p.client.post(f"/v1/webhooks/avito/{AVITO_SECRET}", json=avito_webhook("e-1", user_id=777))
        assert r.status_code == 200, r.text
        assert (await p.settled(r.json()["operation_id"]))["status"] == "replied"


async def test_rotate_key_reads_the_key_file_first_so_the_old_key_can_really_go(
    fast: Settings, pool: asyncpg.Pool, world: FakeWorld, tmp_path: Path
) -> None:
    """README: put the new key first in the key file, run rotate-key, drop the old key.
    Run at once after the file changed (before the periodic read), rotate-key must seal
    under the new key, not again under the old one it still had in memory."""
    key_file = tmp_path / "secrets.key"
    key_file.write_text(KEY)
    new = Fernet.generate_key().decode()
    settings = replace(fast, secrets_key_file=str(key_file), accounts_refresh_seconds=3600)
    async with running(settings, pool, SHOP2) as p:
        key_file.write_text(f"{new},{KEY}")
        rotated = await p.client.post("/v1/accounts/rotate-key", headers=ADMIN)
        assert rotated.json() == {"resealed": 1, "unopened": []}
    token = await pool.fetchval("SELECT credentials FROM accounts WHERE account_id = '888'")
    try:
        Fernet(new.encode()).decrypt(bytes(token))
    except InvalidToken:
        pytest.fail("rotate-key sealed the credentials under the old key: dropping it now loses them")


@contextlib.asynccontextmanager
async def reply_being_written(
    keyed: Settings, pool: asyncpg.Pool, world: FakeWorld, chat: int
) -> AsyncIterator[tuple[Pipeline, str]]:
    """Bot 5151's pipeline, and a buyer message whose reply the model takes three seconds
    to write: the job is claimed and no send recorded yet. Yields (pipeline, operation)."""
    writing = replace(keyed, llm_base_url=f"{world.url}/v1", llm_timeout_seconds=5)
    async with running(writing, pool, BOT2) as p:
        world.fail("llm", "slow:3")
        r = await p.client.post(
            "/v1/webhooks/telegram/5151",
            json=telegram_update(1, chat_id=chat, text="price?"),
            headers=BOT2_SECRET,
        )
        op = r.json()["operation_id"]
        await wait_for(
            lambda: pool.fetchval(
                "SELECT r.status = 'processing' AND d.job_id IS NULL FROM operations o JOIN reply_jobs r"
                " ON r.id = o.job_id LEFT JOIN deliveries d ON d.job_id = r.id WHERE o.id = $1",
                uuid.UUID(op),
            ),
            within=10,
            what="the reply being written",
        )
        yield p, op


async def test_an_account_paused_while_its_reply_is_being_written_sends_nothing_until_resumed(
    keyed: Settings, pool: asyncpg.Pool, world: FakeWorld
) -> None:
    async with reply_being_written(keyed, pool, world, chat=31) as (p, op):
        paused = await p.client.post(
            "/v1/accounts/telegram/5151/pause", json={"reason": "holiday"}, headers=ADMIN
        )
        assert paused.json()["state"] == "paused_by_person"
        await wait_for(
            lambda: (
                world.telegram
                or pool.fetchval("SELECT count(*) = 1 FROM reply_jobs WHERE error_kind = 'account'")
            ),
            within=15,
            what="the reply sent or waiting for the account",
        )
        assert world.telegram == [], "a paused account sent a reply"
        assert (await p.status(op))["status"] == "replying"
        resumed = await p.client.post("/v1/accounts/telegram/5151/resume", headers=ADMIN)
        assert resumed.json()["state"] == "active"
        assert (await p.settled(op, within=30))["status"] == "replied"
    assert [(m["bot"], m["chat_id"]) for m in world.telegram] == [(5151, 31)]


async def test_an_account_removed_while_its_reply_is_being_written_sends_nothing_and_fails_it(
    keyed: Settings, pool: asyncpg.Pool, world: FakeWorld
) -> None:
    async with reply_being_written(keyed, pool, world, chat=32) as (p, op):
        removed = await p.client.delete("/v1/accounts/telegram/5151", headers=ADMIN)
        assert removed.json()["state"] == "removed"
        doc = await p.settled(op, within=20)
    assert world.telegram == [], "a removed account's reply was sent with its wiped credentials"
    assert doc["status"] == "failed" and "was removed" in doc["error"]["message"]


async def test_a_generic_account_whose_id_has_a_slash_can_be_shown_paused_and_removed(
    pipeline: Pipeline, pool: asyncpg.Pool, world: FakeWorld
) -> None:
    """The generic webhook takes any account id (a slash too); the admin API must still
    reach that account (``chatq`` sends the slash as %2F)."""
    body = dumps({**generic_message("s-1"), "account_id": "shop/1"})
    r = await pipeline.client.post(
        "/v1/webhooks/generic", content=body, headers=signed(GENERIC_SECRET, body, webhook_id="s-1")
    )
    assert (await pipeline.settled(r.json()["operation_id"]))["status"] == "replied"
    path = "/v1/accounts/generic/shop%2F1"
    shown = await pipeline.client.get(path, headers=ADMIN)
    assert shown.status_code == 200, shown.text
    assert shown.json()["account_id"] == "shop/1" and shown.json()["numbers"]["failed_share"] == 0.0
    paused = await pipeline.client.post(f"{path}/pause", json={"reason": "closing"}, headers=ADMIN)
    assert paused.json()["state"] == "paused_by_person", paused.text
    assert (await pipeline.client.delete(path, headers=ADMIN)).json()["state"] == "removed"


async def test_an_accounts_facts_file_cannot_name_a_file_of_the_services_host(
    keyed: Settings, pool: asyncpg.Pool, world: FakeWorld, tmp_path: Path
) -> None:
    """The admin token must not read the services' files (their environment, the secrets
    key file) through an account's replies: a facts file is a plain name in FACTS_DIR."""
    async with running(keyed, pool) as p:
        r = await p.client.post(
            "/v1/accounts", json={**BOT2, "overrides": {"facts_file": "facts.txt"}}, headers=ADMIN
        )
        assert r.status_code == 422 and "CHATQ_FACTS_DIR" in r.text, r.text
    async with running(replace(keyed, facts_dir=str(tmp_path)), pool) as p:
        for path in ("/proc/self/environ", "../../etc/passwd", "..", ".env", "a/b.txt"):
            r = await p.client.post(
                "/v1/accounts", json={**BOT2, "overrides": {"facts_file": path}}, headers=ADMIN
            )
            assert r.status_code == 422, r.text
    assert await pool.fetchval("SELECT count(*) FROM accounts WHERE account_id = '5151'") == 0


async def test_an_accounts_facts_file_in_the_facts_folder_writes_its_replies(
    keyed: Settings, pool: asyncpg.Pool, world: FakeWorld, tmp_path: Path
) -> None:
    (tmp_path / "bot2.txt").write_text("[facts]\nprice, cost: Bot two sells it for 700 rub.\n")
    bot2 = {**BOT2, "overrides": {"facts_file": "bot2.txt"}}
    async with running(replace(keyed, facts_dir=str(tmp_path)), pool, bot2) as p:
        r = await p.client.post(
            "/v1/webhooks/telegram/5151",
            json=telegram_update(1, chat_id=7, text="price?"),
            headers=BOT2_SECRET,
        )
        assert (await p.settled(r.json()["operation_id"]))["status"] == "replied"
    (sent,) = [m["text"] for m in world.telegram if str(m["bot"]) == "5151"]
    assert "700 rub" in sent


async def test_text_postgres_cannot_hold_is_refused_by_the_accounts_api_never_a_500(
    keyed: Settings, pool: asyncpg.Pool, world: FakeWorld
) -> None:
    """Postgres text holds no NUL character: one in an override, a pause reason or the
    account id of the path is a 4xx that says so, not a database error."""
    async with running(keyed, pool, BOT2) as p:
        answers = [
            await p.client.post("/v1/accounts", json={**BOT2, "overrides": {field: "a\x00b"}}, headers=ADMIN)
            for field in ("facts", "facts_file", "llm_model", "prompt")
        ]
        answers.append(
            await p.client.post("/v1/accounts/telegram/5151/pause", json={"reason": "a\x00b"}, headers=ADMIN)
        )
        for method, path in [
            ("GET", ""),
            ("POST", "/pause"),
            ("POST", "/resume"),
            ("DELETE", ""),
        ]:
            for bad in ("%00", "a%00b"):
                body = {"reason": "r"} if path == "/pause" else None
                answers.append(
                    await p.client.request(
                        method, f"/v1/accounts/telegram/{bad}{path}", json=body, headers=ADMIN
                    )
                )
        assert [r.status_code // 100 for r in answers] == [4] * len(answers), [r.text for r in answers]
        assert (await p.client.get("/v1/accounts/telegram/5151", headers=ADMIN)).json()["state"] == "active"
