"""One deployment, many sellers, no way across (issue 39, points 1, 2, 6, 8 and 9): a
reply goes only where its own account says, a bad key file fails closed and loud, secrets
are checked when they are set, an unknown account answers as a known one does, and an
Avito token is a credential of its account."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import statistics
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import httpx
import pytest
from cryptography.fernet import Fernet
from standardwebhooks.webhooks import Webhook, WebhookVerificationError

from platforms.avito.adapter import AvitoToken, token_key
from shared import metrics
from shared.secretbox import SecretBox
from shared.settings import Settings
from stores.accounts.registry import AccountRegistry
from tests.conftest import AVITO_SECRET, GENERIC_SECRET, TELEGRAM_SECRET, replace
from tests.fakes.world import FakeWorld
from tests.integration.test_many_accounts import BOT2, KEY, SHOP2, SHOP2_PATH, add, running
from tests.support.broker import wait_for
from tests.support.payloads import avito_webhook, dumps, generic_message, signed, telegram_update
from tests.support.pipeline import ADMIN, Pipeline

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("clean")]


def whsec(seed: bytes) -> str:
    return "whsec_" + base64.b64encode(seed.ljust(32, b"-")).decode()


SHOP3_WEBHOOK = whsec(b"shop-3 signs its messages")
SHOP3_REPLY = whsec(b"shop-3 checks our replies")
SHOP3 = {
    "platform": "generic",
    "account_id": "shop-3",
    "name": "Third shop",
    "credentials": {"webhook_secret": SHOP3_WEBHOOK, "reply_secret": SHOP3_REPLY},
}
BOT2_SECRET = {"X-Telegram-Bot-Api-Secret-Token": BOT2["credentials"]["webhook_secret"]}


@pytest.fixture
def keyed(fast: Settings) -> Settings:
    return replace(fast, secrets_key=KEY)


def shop3(world: FakeWorld) -> dict:
    return {**SHOP3, "credentials": {**SHOP3["credentials"], "reply_url": f"{world.url}/generic/replies"}}


def shop3_message(n: int) -> tuple[bytes, dict[str, str]]:
    body = dumps({**generic_message(f"s3-{n}", text="price?"), "account_id": "shop-3"})
    return body, signed(SHOP3_WEBHOOK, body, webhook_id=f"s3-{n}")


async def operations(pool: asyncpg.Pool) -> int:
    return await pool.fetchval("SELECT count(*) FROM operations")


def signed_by(secret: str, sent: dict) -> bool:
    try:
        Webhook(secret).verify(sent["raw"], sent["headers"])
    except WebhookVerificationError:
        return False
    return True


async def shop3_replied(p: Pipeline) -> None:
    body, headers = shop3_message(1)
    r = await p.client.post("/v1/webhooks/generic/shop-3", content=body, headers=headers)
    assert r.status_code == 202, r.text
    assert (await p.settled(r.json()["operation_id"]))["status"] == "replied"


def assert_sent_by_shop3_only(world: FakeWorld) -> None:
    """One reply, to shop-3's own reply_url, signed with its reply_secret, never with
    CHATQ_GENERIC_REPLY_SECRET (which the account could replay into the environment's endpoint)."""
    [sent] = world.generic
    assert sent["account_id"] == "shop-3"
    assert signed_by(SHOP3_REPLY, sent), "the reply is not signed with the account's own reply_secret"
    assert not signed_by(GENERIC_SECRET, sent), "the reply carries the environment's signature"


async def insert_added(
    pool: asyncpg.Pool, platform: str, account_id: str, credentials: dict[str, str]
) -> None:
    """An added account's row as an earlier release wrote it (credentials it did not check)."""
    await pool.execute(
        "INSERT INTO accounts (platform, account_id, name, source, credentials) VALUES ($1, $2, 'old', 'admin', $3)",
        platform,
        account_id,
        SecretBox(KEY).seal(credentials),
    )


# -- 1. A reply goes only where its own account says ----------------------------------------


@pytest.mark.parametrize(
    ("given", "named"),
    [
        ({}, "reply_url, reply_secret"),
        ({"reply_url": "https://shop-3.example/replies"}, "reply_secret"),
        ({"reply_secret": SHOP3_REPLY, "reply_url": None}, "reply_url"),
    ],
    ids=["neither", "a url without a secret", "a secret without a url"],
)
async def test_a_generic_account_without_its_own_reply_url_and_reply_secret_is_refused_with_the_reason(
    keyed: Settings, pool: asyncpg.Pool, given: dict, named: str
) -> None:
    """On 0074a8b these were added (200) and replied to CHATQ_GENERIC_REPLY_URL, or signed
    with CHATQ_GENERIC_REPLY_SECRET: a tenant could replay a genuine signature into the
    environment's endpoint."""
    credentials = {k: v for k, v in {"webhook_secret": SHOP3_WEBHOOK, **given}.items() if v is not None}
    async with running(keyed, pool) as p:
        refused = await p.client.post(
            "/v1/accounts", json={**SHOP3, "credentials": credentials}, headers=ADMIN
        )
    assert refused.status_code == 422, refused.text
    error = refused.json()["error"]
    assert error["code"] == "invalid_credentials"
    assert f"needs webhook_secret, {named}" in error["message"] or f"needs {named}" in error["message"]
    assert "CHATQ_GENERIC_REPLY_URL" in error["message"]
    assert await pool.fetchval("SELECT count(*) FROM accounts WHERE account_id = 'shop-3'") == 0


async def test_a_generic_accounts_reply_goes_to_its_own_url_signed_with_its_own_secret_only(
    keyed: Settings, pool: asyncpg.Pool, world: FakeWorld
) -> None:
    # The environment's generic replies go nowhere reachable: a fallback to them fails the reply.
    elsewhere = replace(keyed, generic_reply_url=f"{world.url}/nowhere")
    async with running(elsewhere, pool, shop3(world)) as p:
        await shop3_replied(p)
    assert_sent_by_shop3_only(world)


async def test_an_added_generic_accounts_reply_goes_to_its_own_url_even_before_the_responder_hears_it_was_added(
    keyed: Settings, pool: asyncpg.Pool, world: FakeWorld, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its notification lost or late (a blip of the listening connection, a pooling proxy,
    or the job outrunning the NOTIFY): on main the responder's registry did not know shop-3,
    took it for the environment's and signed its reply with CHATQ_GENERIC_REPLY_SECRET."""
    monkeypatch.setattr(AccountRegistry, "_notified", lambda *a: None)  # no process hears of a change
    deaf = replace(keyed, accounts_refresh_seconds=3600)
    async with running(deaf, pool) as p:
        # Every service is up and has read the accounts (the environment's sender replied).
        env = dumps({**generic_message("w-1", text="hi"), "account_id": "shop-1"})
        r = await p.client.post(
            "/v1/webhooks/generic", content=env, headers=signed(GENERIC_SECRET, env, webhook_id="w-1")
        )
        assert (await p.settled(r.json()["operation_id"]))["status"] == "replied"
        world.generic.clear()
        await add(p.client, shop3(world))  # the receiver reads its own change itself
        await shop3_replied(p)
    assert_sent_by_shop3_only(world)


async def test_an_added_generic_account_from_before_without_its_own_reply_settings_is_paused_at_start_and_not_resumed_until_it_has_them(
    keyed: Settings, pool: asyncpg.Pool, world: FakeWorld
) -> None:
    """A row an earlier release accepted (no reply_url, no reply_secret) is paused with the
    reason and the fix when the services start; its message is stored and its reply waits,
    sent nowhere, until a person gives it its own and resumes it (resuming it before is
    refused with what it lacks)."""
    await insert_added(pool, "generic", "shop-3", {"webhook_secret": SHOP3_WEBHOOK})
    async with running(keyed, pool) as p:
        row = await pool.fetchrow("SELECT state, state_reason FROM accounts WHERE account_id = 'shop-3'")
        assert row["state"] == "paused_by_person"
        assert "no reply_url of its own" in row["state_reason"]
        assert "no reply_secret of its own" in row["state_reason"]
        assert "never uses the environment's" in row["state_reason"]
        body, headers = shop3_message(1)
        r = await p.client.post("/v1/webhooks/generic/shop-3", content=body, headers=headers)
        assert r.status_code == 202, r.text
        op = uuid.UUID(r.json()["operation_id"])
        await wait_for(
            lambda: pool.fetchval(
                "SELECT r.error_kind = 'account' FROM operations o JOIN reply_jobs r ON r.id = o.job_id"
                " WHERE o.id = $1",
                op,
            ),
            within=15,
            what="the reply waiting for its paused account",
        )
        assert world.generic == [], "a reply went to the environment's endpoint"
        assert (await p.status(str(op)))["status"] == "replying"
        # Resumed before it has them: on main a 200, and the waiting reply failed for good.
        early = await p.client.post("/v1/accounts/generic/shop-3/resume", headers=ADMIN)
        assert early.status_code == 409, early.text
        assert early.json()["error"]["code"] == "incomplete_account"
        assert "no reply_url of its own" in early.text and "no reply_secret of its own" in early.text
        assert (
            await pool.fetchval("SELECT state FROM accounts WHERE account_id = 'shop-3'")
            == "paused_by_person"
        )
        await add(p.client, shop3(world))
        resumed = await p.client.post("/v1/accounts/generic/shop-3/resume", headers=ADMIN)
        assert resumed.json()["state"] == "active"
        assert (await p.settled(str(op), within=30))["status"] == "replied"
    [sent] = world.generic
    assert signed_by(SHOP3_REPLY, sent) and not signed_by(GENERIC_SECRET, sent)


async def test_an_added_account_whose_credentials_no_key_opens_is_not_resumed(
    keyed: Settings, pool: asyncpg.Pool, world: FakeWorld
) -> None:
    """Paused by a person, its credentials sealed under a key no service has: on main the
    resume answered 200 and its waiting replies then failed for good."""
    await pool.execute(
        "INSERT INTO accounts (platform, account_id, name, source, credentials, state, state_reason)"
        " VALUES ('generic', 'shop-3', 'old', 'admin', $1, 'paused_by_person', 'paused by admin: r')",
        SecretBox(Fernet.generate_key().decode()).seal(shop3(world)["credentials"]),
    )
    async with running(keyed, pool) as p:
        refused = await p.client.post("/v1/accounts/generic/shop-3/resume", headers=ADMIN)
    assert refused.status_code == 409, refused.text
    assert refused.json()["error"]["code"] == "sealed_credentials"
    assert await pool.fetchval("SELECT state FROM accounts WHERE account_id = 'shop-3'") == "paused_by_person"


async def test_a_removed_tenants_id_is_not_handed_to_another_tenant_with_its_chats(
    keyed: Settings, pool: asyncpg.Pool, world: FakeWorld
) -> None:
    """On main tenant B, added as generic shop-3 after tenant A's removal, continued A's
    chat c1: B's model call was given A's "my card ends 4242"."""
    async with running(keyed, pool, shop3(world)) as p:
        a = dumps(
            {
                **generic_message("a-1", text="tenant A: my card ends 4242", chat_id="c1"),
                "account_id": "shop-3",
            }
        )
        r = await p.client.post(
            "/v1/webhooks/generic/shop-3", content=a, headers=signed(SHOP3_WEBHOOK, a, webhook_id="a-1")
        )
        assert (await p.settled(r.json()["operation_id"]))["status"] == "replied"
        assert (await p.client.delete("/v1/accounts/generic/shop-3", headers=ADMIN)).status_code == 200
        tenant_b = {
            **shop3(world),
            "name": "Tenant B",
            "credentials": {
                "webhook_secret": whsec(b"tenant B's own webhook key"),
                "reply_secret": whsec(b"tenant B's own reply key"),
                "reply_url": f"{world.url}/generic/replies",
            },
        }
        refused = await p.client.post("/v1/accounts", json=tenant_b, headers=ADMIN)
        assert refused.status_code == 409, refused.text
        assert refused.json()["error"]["code"] == "account_has_history"
        assert "was removed" in refused.text and "continue_history" in refused.text
        assert (await p.client.get("/v1/accounts/generic/shop-3", headers=ADMIN)).json()["state"] == "removed"
        # The same seller coming back says so, and gets its chats back.
        back = await p.client.post(
            "/v1/accounts", json={**shop3(world), "continue_history": True}, headers=ADMIN
        )
        assert back.status_code == 200, back.text
        assert back.json()["created"] is True and back.json()["state"] == "active"


async def test_an_environment_senders_id_is_not_handed_to_an_added_account_with_its_chats(
    keyed: Settings, pool: asyncpg.Pool, world: FakeWorld
) -> None:
    """On main an added generic shop-1 (its own secrets) took over the environment's sender
    shop-1: the row turned 'admin' and the tenant's chat c1 continued the environment's."""
    async with running(keyed, pool) as p:
        env = dumps(
            {**generic_message("e-1", text="my order is SECRET-4711", chat_id="c1"), "account_id": "shop-1"}
        )
        r = await p.client.post(
            "/v1/webhooks/generic", content=env, headers=signed(GENERIC_SECRET, env, webhook_id="e-1")
        )
        assert (await p.settled(r.json()["operation_id"]))["status"] == "replied"
        refused = await p.client.post(
            "/v1/accounts", json={**shop3(world), "account_id": "shop-1"}, headers=ADMIN
        )
    assert refused.status_code == 409, refused.text
    assert "is the environment's" in refused.json()["error"]["message"]
    row = await pool.fetchrow("SELECT source, credentials FROM accounts WHERE account_id = 'shop-1'")
    assert (row["source"], row["credentials"]) == ("environment", None)


ENV_REPLY_SECRET = whsec(b"the environment's reply key")


@pytest.mark.parametrize(
    ("platform", "credential", "value", "named"),
    [
        ("generic", "reply_secret", ENV_REPLY_SECRET, "CHATQ_GENERIC_REPLY_SECRET"),
        ("generic", "reply_secret", GENERIC_SECRET, "CHATQ_GENERIC_WEBHOOK_SECRET"),
        ("generic", "webhook_secret", GENERIC_SECRET, "CHATQ_GENERIC_WEBHOOK_SECRET"),
        ("generic", "webhook_secret", ENV_REPLY_SECRET, "CHATQ_GENERIC_REPLY_SECRET"),
        ("telegram", "webhook_secret", TELEGRAM_SECRET, "CHATQ_TELEGRAM_WEBHOOK_SECRET"),
    ],
    ids=[
        "reply_secret",
        "reply_secret of the webhooks",
        "webhook_secret",
        "webhook_secret of the replies",
        "telegram",
    ],
)
async def test_an_added_account_cannot_be_given_a_secret_of_the_environments(
    keyed: Settings,
    pool: asyncpg.Pool,
    world: FakeWorld,
    platform: str,
    credential: str,
    value: str,
    named: str,
) -> None:
    """On main these were added (200): with CHATQ_GENERIC_REPLY_SECRET a tenant's replies
    carried signatures the environment's endpoint takes (point 1's replay), and an
    environment's webhook key opened the tenant's path too."""
    good = {"generic": shop3(world), "telegram": BOT2}[platform]
    account = {**good, "credentials": {**good["credentials"], credential: value}}
    async with running(replace(keyed, generic_reply_secret=ENV_REPLY_SECRET), pool) as p:
        refused = await p.client.post("/v1/accounts", json=account, headers=ADMIN)
    assert refused.status_code == 409, refused.text
    assert refused.json()["error"]["code"] == "secret_taken"
    assert named in refused.text and value not in refused.text
    assert await pool.fetchval("SELECT count(*) FROM accounts WHERE source = 'admin'") == 0


async def test_two_added_accounts_cannot_share_a_secret(
    keyed: Settings, pool: asyncpg.Pool, world: FakeWorld
) -> None:
    """On main shop-4 could be given shop-3's reply_secret as its webhook key: replies
    signed for shop-3 then opened shop-4's path."""
    shop4 = {**shop3(world), "account_id": "shop-4", "name": "Fourth shop"}
    async with running(keyed, pool, shop3(world)) as p:
        taken = await p.client.post(
            "/v1/accounts",
            json={
                **shop4,
                "credentials": {
                    **shop4["credentials"],
                    "webhook_secret": SHOP3_REPLY,
                    "reply_secret": whsec(b"4"),
                },
            },
            headers=ADMIN,
        )
        own = await p.client.post(
            "/v1/accounts",
            json={
                **shop4,
                "credentials": {
                    **shop4["credentials"],
                    "webhook_secret": whsec(b"4w"),
                    "reply_secret": whsec(b"4r"),
                },
            },
            headers=ADMIN,
        )
        again = await p.client.post(
            "/v1/accounts", json=shop3(world), headers=ADMIN
        )  # shop-3 updated: its own
    assert taken.status_code == 409 and "another account's secret" in taken.text, taken.text
    assert own.status_code == 200, own.text
    assert again.status_code == 200, again.text


# -- 6. Secrets are checked when they are set -----------------------------------------------

BAD_CREDENTIALS = [
    # The issue's own: 34 characters of a URL-safe token; the library dropped - and _ and
    # decoded what was left to 3 bytes, and every request to the account answered 500.
    ("generic", {"webhook_secret": "whsec_ab-cd_ef-gh_ij-kl_mn-op_qr-st"}, "webhook_secret: after whsec_"),
    (
        "generic",
        {"webhook_secret": "a-plain-random-secret-0123456789"},
        "webhook_secret: must start with whsec_",
    ),
    (
        "generic",
        {"webhook_secret": "whsec_" + base64.b64encode(b"sixteen-byte-key").decode()},
        "decodes to 16",
    ),
    ("generic", {"webhook_secret": "whsec_QUJD=REVG" + "QUJD" * 8}, "webhook_secret: after whsec_"),
    (
        "generic",
        {"reply_secret": "not-a-standard-webhooks-key-at-all"},
        "reply_secret: must start with whsec_",
    ),
    (
        "generic",
        {"reply_url": "ftp://shop-3.example/replies"},
        "reply_url: must be an http:// or https:// URL",
    ),
    ("generic", {"reply_url": "https://user:pw@shop-3.example/r"}, "reply_url: must not carry a user"),
    ("generic", {"reply_url": "https:///replies"}, "reply_url: must name a host"),
    ("telegram", {"bot_token": "5151:short"}, "bot_token: must be a Telegram bot token"),
    # A pasted line break: on main re.match's $ took it (and Telegram refused it far from here).
    (
        "telegram",
        {"bot_token": BOT2["credentials"]["bot_token"] + "\n"},
        "bot_token: must be a Telegram bot token",
    ),
    ("avito", {"client_secret": "client-2-secret\n"}, "client_secret: must be non-empty printable ASCII"),
    ("telegram", {"bot_token": "6161:AAbot-two-token-0123456789abcdef"}, "bot_token: is another bot's"),
    ("telegram", {"webhook_secret": "has spaces in it 0123456789"}, "webhook_secret: 16-256 characters"),
    ("avito", {"client_id": "client 2"}, "client_id: must be non-empty printable ASCII"),
    ("avito", {"client_secret": "secret\twith a tab"}, "client_secret: must be non-empty printable ASCII"),
    ("avito", {"webhook_secret": "a/path/with/slashes/0123"}, "webhook_secret: 16-128 characters"),
]


@pytest.mark.parametrize(("platform", "bad", "reason"), BAD_CREDENTIALS, ids=[r for *_, r in BAD_CREDENTIALS])
async def test_a_credential_without_its_format_is_refused_when_it_is_set_with_the_reason_and_not_the_value(
    keyed: Settings, pool: asyncpg.Pool, world: FakeWorld, platform: str, bad: dict, reason: str
) -> None:
    good = {"generic": shop3(world), "telegram": BOT2, "avito": SHOP2}[platform]
    account = {**good, "credentials": {**good["credentials"], **bad}}
    async with running(keyed, pool) as p:
        refused = await p.client.post("/v1/accounts", json=account, headers=ADMIN)
    assert refused.status_code == 422, refused.text
    assert reason in refused.text
    for value in bad.values():
        assert value not in refused.text
    assert await pool.fetchval("SELECT count(*) FROM accounts WHERE source = 'admin'") == 0


async def test_an_added_generic_account_whose_old_secret_is_no_key_answers_401_not_500_and_is_paused(
    keyed: Settings, pool: asyncpg.Pool, world: FakeWorld
) -> None:
    """A row from before the check, whose webhook secret the library cannot read: on
    0074a8b every delivery to it answered 500 with a traceback."""
    bad = "whsec_ab-cd_ef-gh_ij-kl_mn-op_qr-st"
    await insert_added(
        pool,
        "generic",
        "shop-3",
        {"webhook_secret": bad, "reply_url": f"{world.url}/generic/replies", "reply_secret": SHOP3_REPLY},
    )
    async with running(keyed, pool) as p:
        row = await pool.fetchrow("SELECT state, state_reason FROM accounts WHERE account_id = 'shop-3'")
        assert row["state"] == "paused_by_person" and "webhook_secret: after whsec_" in row["state_reason"]
        body = dumps({**generic_message("s3-1"), "account_id": "shop-3"})
        headers = {
            "webhook-id": "s3-1",
            "webhook-timestamp": str(int(time.time())),
            "webhook-signature": "v1,AAAA",
            "content-type": "application/json",
        }
        r = await p.client.post("/v1/webhooks/generic/shop-3", content=body, headers=headers)
    assert r.status_code == 401, r.text
    assert await operations(pool) == 0


# -- 8. Unknown and known accounts answer alike ---------------------------------------------


def _answer(r: httpx.Response) -> tuple[int, str]:
    return r.status_code, r.text


async def test_unknown_removed_and_known_accounts_answer_alike_on_their_own_webhook_paths(
    keyed: Settings, pool: asyncpg.Pool, world: FakeWorld
) -> None:
    """On 0074a8b a bot or generic account nobody added answered 404 account_not_found and
    a known one 401: anyone could list the deployment's tenants."""
    gone = {
        **BOT2,
        "account_id": "7171",
        # Its own webhook secret: two accounts may not share one.
        "credentials": {"bot_token": "7171:" + "A" * 35, "webhook_secret": "bot-7171-own-secret-0123"},
    }
    async with running(keyed, pool, BOT2, shop3(world), gone) as p:
        client = p.client
        await client.delete("/v1/accounts/telegram/7171", headers=ADMIN)
        wrong = {"X-Telegram-Bot-Api-Secret-Token": "a-guess-at-the-secret-token"}
        telegram = [
            _answer(await client.post(f"/v1/webhooks/telegram/{bot}", json=telegram_update(1), headers=wrong))
            for bot in ("5151", "6161", "7171")
        ]
        assert telegram[0][0] == 401
        assert telegram == [telegram[0]] * 3, telegram

        def forged(account: str) -> tuple[bytes, dict[str, str]]:
            body = dumps({**generic_message("f-1"), "account_id": account})
            return body, signed(whsec(b"an attacker's own key"), body, webhook_id="f-1")

        generic = []
        for account in ("shop-3", "shop-4", "shop-1"):
            body, headers = forged(account)
            generic.append(
                _answer(await client.post(f"/v1/webhooks/generic/{account}", content=body, headers=headers))
            )
        assert generic[0][0] == 401
        assert generic == [generic[0]] * 3, generic

        # A removed Avito account's path is an unknown one's.
        await add(client, SHOP2)
        await client.delete("/v1/accounts/avito/888", headers=ADMIN)
        avito = [
            _answer(await client.post(path, json=avito_webhook("a-1", user_id=888)))
            for path in (SHOP2_PATH, "/v1/webhooks/avito/a-path-nobody-has-0123")
        ]
        assert avito[0][0] == 401 and avito == [avito[0]] * 2, avito
    assert await operations(pool) == 0


async def test_a_known_and_an_unknown_generic_account_take_about_as_long_to_refuse(
    keyed: Settings, pool: asyncpg.Pool, world: FakeWorld
) -> None:
    """The same check runs for both (on 0074a8b the unknown one was refused before its
    body was read or its signature computed): with a large body, interleaved, the median
    times stay within a factor of each other."""
    async with running(keyed, pool, shop3(world)) as p:
        text = "x" * 100_000
        times: dict[str, list[float]] = {"shop-3": [], "shop-4": []}
        for n in range(15):
            for account in times:
                body = dumps({**generic_message(f"t-{n}", text=text), "account_id": account})
                headers = signed(whsec(b"an attacker's own key"), body, webhook_id=f"t-{n}")
                started = time.perf_counter()
                r = await p.client.post(f"/v1/webhooks/generic/{account}", content=body, headers=headers)
                times[account].append(time.perf_counter() - started)
                assert r.status_code == 401
    known, unknown = (statistics.median(times[a]) for a in ("shop-3", "shop-4"))
    assert 0.5 < unknown / known < 2.0, (known, unknown)


async def test_a_known_generic_accounts_verifier_is_built_once_not_at_every_request(
    keyed: Settings, pool: asyncpg.Pool, world: FakeWorld, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On main each request to a known account checked its key's format and built its
    verifier (some microseconds the decoy of an unknown account does not spend)."""
    from platforms.generic import webhook as generic

    built: list[str | None] = []
    build = generic.verifier
    monkeypatch.setattr(generic, "verifier", lambda secret: (built.append(secret), build(secret))[1])
    async with running(keyed, pool, shop3(world)) as p:
        built.clear()
        for n in range(3):
            body = dumps({**generic_message(f"f-{n}"), "account_id": "shop-3"})
            forged = signed(whsec(b"an attacker's own key"), body, webhook_id=f"f-{n}")
            r = await p.client.post("/v1/webhooks/generic/shop-3", content=body, headers=forged)
            assert r.status_code == 401, r.text
    assert built == [SHOP3_WEBHOOK]


# -- 2. A bad key file fails closed and loud ------------------------------------------------


@contextlib.asynccontextmanager
async def keys_from_a_file(fast: Settings, pool: asyncpg.Pool, key_file: Path) -> AsyncIterator[Pipeline]:
    """The pipeline with bot 5151, its key in ``key_file`` (KEY; read again every 0.2 s), every
    service up (a reply went through all three) before the test spoils the file: a process
    that starts with no good keys at all refuses to start instead."""
    settings = replace(fast, secrets_key_file=str(key_file), accounts_refresh_seconds=0.2)
    async with running(settings, pool, BOT2) as p:
        first = await p.client.post(
            "/v1/webhooks/telegram/5151", json=telegram_update(1, chat_id=5), headers=BOT2_SECRET
        )
        assert (await p.settled(first.json()["operation_id"]))["status"] == "replied"
        yield p


async def test_an_unparseable_key_file_keeps_the_last_good_keys_alerts_once_and_removals_still_apply(
    fast: Settings, pool: asyncpg.Pool, world: FakeWorld, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """On 0074a8b a bad edit of the key file stopped every process re-reading accounts: a
    removed bot's webhooks were still accepted and removing it answered 500."""
    caplog.set_level(logging.INFO)
    key_file = tmp_path / "secrets.key"
    key_file.write_text(KEY)
    async with keys_from_a_file(fast, pool, key_file) as p:
        key_file.write_text(f"{Fernet.generate_key().decode()},not-a-key")
        await wait_for(
            lambda: metrics.SECRETS_KEY_FILE_INVALID._value.get() == 1, within=10, what="the key file refused"
        )
        # Every process refreshes several times meanwhile; each says it once.
        ok = await p.client.post(
            "/v1/webhooks/telegram/5151", json=telegram_update(2, chat_id=5), headers=BOT2_SECRET
        )
        assert ok.status_code == 200, "the keys read before were dropped"
        paused = await p.client.post("/v1/accounts/telegram/5151/pause", json={"reason": "r"}, headers=ADMIN)
        assert paused.status_code == 200 and paused.json()["state"] == "paused_by_person"
        removed = await p.client.delete("/v1/accounts/telegram/5151", headers=ADMIN)
        assert removed.status_code == 200, removed.text
        assert removed.json()["state"] == "removed"
        refused = await p.client.post(
            "/v1/webhooks/telegram/5151", json=telegram_update(3, chat_id=5), headers=BOT2_SECRET
        )
        assert refused.status_code == 401, "a removed bot's webhook is still accepted"
        rotate = await p.client.post("/v1/accounts/rotate-key", headers=ADMIN)
        assert rotate.status_code == 409 and rotate.json()["error"]["code"] == "secrets_key_file_invalid"
        logged = [r for r in caplog.records if "SECRETS_KEY_FILE cannot be used" in r.getMessage()]
        registries = 3  # the receiver's, the coalescer's and the responder's
        assert 1 <= len(logged) <= registries, [r.getMessage() for r in logged]
        assert all(
            r.levelno == logging.ERROR and "key 2 is not a Fernet key" in r.getMessage() for r in logged
        )
        assert "not-a-key" not in caplog.text
        key_file.write_text(KEY)
        await wait_for(
            lambda: metrics.SECRETS_KEY_FILE_INVALID._value.get() == 0,
            within=10,
            what="the key file good again",
        )
        rotate = await p.client.post("/v1/accounts/rotate-key", headers=ADMIN)
        assert rotate.status_code == 200, rotate.text


async def test_a_key_file_that_cannot_be_read_is_reported_and_rotate_key_refuses_until_it_can(
    fast: Settings, pool: asyncpg.Pool, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """On main a key file replaced by one the service cannot read (here a directory; in life
    a root-only file, a broken symlink) was ignored: no alert, and rotate-key answered 200
    sealing every account again under the keys of before."""
    key_file = tmp_path / "secrets.key"
    key_file.write_text(KEY)
    async with keys_from_a_file(fast, pool, key_file) as p:
        key_file.unlink()
        key_file.mkdir()
        await wait_for(
            lambda: metrics.SECRETS_KEY_FILE_INVALID._value.get() == 1,
            within=10,
            what="the key file reported",
        )
        ok = await p.client.post(
            "/v1/webhooks/telegram/5151", json=telegram_update(2, chat_id=5), headers=BOT2_SECRET
        )
        assert ok.status_code == 200, "the keys read before were dropped"
        rotate = await p.client.post("/v1/accounts/rotate-key", headers=ADMIN)
        assert rotate.status_code == 409, rotate.text
        assert "cannot read SECRETS_KEY_FILE: Is a directory" in rotate.json()["error"]["message"]
        logged = [r for r in caplog.records if "cannot read SECRETS_KEY_FILE" in r.getMessage()]
        assert 1 <= len(logged) <= 3, "said more than once by each process"  # receiver, coalescer, responder
        key_file.rmdir()
        key_file.write_text(KEY)
        await wait_for(
            lambda: metrics.SECRETS_KEY_FILE_INVALID._value.get() == 0,
            within=10,
            what="the key file good again",
        )
        assert (await p.client.post("/v1/accounts/rotate-key", headers=ADMIN)).status_code == 200


async def test_a_key_file_whose_keys_open_no_account_keeps_the_keys_in_use_and_is_reported(
    fast: Settings, pool: asyncpg.Pool, tmp_path: Path
) -> None:
    """The operator pastes the new key and drops the old one before rotate-key: on main the
    file was taken in silence and every account's credentials stopped opening (its webhooks
    answered 401, its replies failed)."""
    key_file = tmp_path / "secrets.key"
    key_file.write_text(KEY)
    async with keys_from_a_file(fast, pool, key_file) as p:
        key_file.write_text(Fernet.generate_key().decode())
        await wait_for(
            lambda: metrics.SECRETS_KEY_FILE_INVALID._value.get() == 1, within=10, what="the key file refused"
        )
        after = await p.client.post(
            "/v1/webhooks/telegram/5151", json=telegram_update(2, chat_id=5), headers=BOT2_SECRET
        )
        assert after.status_code == 200, "the keys in use were dropped for ones that open no account"
        assert (await p.settled(after.json()["operation_id"]))["status"] == "replied"
        rotate = await p.client.post("/v1/accounts/rotate-key", headers=ADMIN)
        assert rotate.status_code == 409 and "open none of the 1 account(s)" in rotate.text, rotate.text
        # The new key put first and the old one kept: taken, and rotate-key goes on.
        key_file.write_text(f"{Fernet.generate_key().decode()},{KEY}")
        await wait_for(
            lambda: metrics.SECRETS_KEY_FILE_INVALID._value.get() == 0, within=10, what="the key file taken"
        )
        assert (await p.client.post("/v1/accounts/rotate-key", headers=ADMIN)).status_code == 200


# -- 9. Avito tokens are credentials --------------------------------------------------------


async def test_an_avito_token_is_sealed_keyed_by_its_account_never_reused_with_a_wrong_secret_and_deleted_with_it(
    keyed: Settings, pool: asyncpg.Pool, world: FakeWorld
) -> None:
    """On 0074a8b the token was stored in clear, keyed by the client id alone: an account
    added with another's client id and a wrong secret sent with that account's token."""
    world.avito_client_secret = SHOP2["credentials"]["client_secret"]
    world.avito_accounts = {"888": "client-2", "999": "client-2"}
    impostor = {
        **SHOP2,
        "account_id": "999",
        "name": "Impostor",
        "credentials": {
            **SHOP2["credentials"],
            "client_secret": "a-wrong-secret",
            "webhook_secret": "impostor-path-0123456789",
        },
    }
    # What the previous release stored: the token in clear, keyed by the client id alone.
    await pool.execute(
        "INSERT INTO platform_tokens (platform, credential, token, expires_at)"
        " VALUES ('avito', 'client-2', 'tok-in-clear', now() + interval '1 day')"
    )
    async with running(keyed, pool, SHOP2, impostor) as p:
        r = await p.client.post(
            SHOP2_PATH, json=avito_webhook("s2-1", user_id=888, chat_id="c", text="price?")
        )
        assert (await p.settled(r.json()["operation_id"]))["status"] == "replied"
        rows = await pool.fetch("SELECT credential, account_id, token, sealed FROM platform_tokens")
        [row] = rows
        issued = set(world.avito_tokens)
        assert row["account_id"] == "888" and row["token"] is None
        assert row["credential"].startswith("888:") and "client-2" not in row["credential"]
        assert not any(t.encode() in bytes(row["sealed"]) for t in issued)
        assert Fernet(KEY.encode()).decrypt(bytes(row["sealed"])).decode() in issued
        sent_before = len(world.avito)

        r = await p.client.post(
            "/v1/webhooks/avito/impostor-path-0123456789",
            json=avito_webhook("i-1", user_id=999, chat_id="c9", text="price?"),
        )
        op = uuid.UUID(r.json()["operation_id"])
        await wait_for(
            lambda: pool.fetchval(
                "SELECT state = 'paused_by_platform' FROM accounts WHERE account_id = '999'"
            ),
            within=20,
            what="the impostor refused by Avito",
        )
        assert not [c for c in world.avito_callers if c[1] == "999" and c[0] == "postSendMessage"], (
            "the impostor sent with another account's token"
        )
        assert (await p.status(str(op)))["status"] != "replied"
        assert len(world.avito) == sent_before
        removed = await p.client.delete("/v1/accounts/avito/888", headers=ADMIN)
        assert removed.status_code == 200
        assert await pool.fetchval("SELECT count(*) FROM platform_tokens WHERE account_id = '888'") == 0


async def test_after_a_key_rotation_a_new_avito_token_is_sealed_with_the_new_key_not_the_retired_one(
    pool: asyncpg.Pool, world: FakeWorld, tmp_path: Path
) -> None:
    """On main AvitoToken kept the keys of its construction: after the rotation the README
    describes (new key first, rotate-key, old key dropped) it went on sealing new tokens
    with the retired key, so a process started with only the new key could open none."""
    old, new = KEY, Fernet.generate_key().decode()
    key_file = tmp_path / "k"
    key_file.write_text(old)
    box = SecretBox(None, str(key_file))
    async with httpx.AsyncClient(timeout=5) as http:
        token = AvitoToken(world.url, "client-2", "s", http, pool, account="888", box=box)
        first = await token.get()
        key_file.write_text(f"{new},{old}")
        box.reload()
        key_file.write_text(new)
        box.reload()
        world.expire_avito_tokens()
        second = await token.get(stale=first)
    assert second != first
    sealed = bytes(await pool.fetchval("SELECT sealed FROM platform_tokens WHERE account_id = '888'"))
    assert Fernet(new.encode()).decrypt(sealed).decode() == second


async def test_rotate_key_seals_the_stored_avito_tokens_again_under_the_new_key(
    fast: Settings, pool: asyncpg.Pool, world: FakeWorld, tmp_path: Path
) -> None:
    """On main rotate-key left every Avito token sealed under the old key: once it was
    dropped, a token still in its life could not be opened (and a copy of the table opened
    with the old key still gave live tokens)."""
    new = Fernet.generate_key().decode()
    key_file = tmp_path / "secrets.key"
    key_file.write_text(KEY)
    async with running(replace(fast, secrets_key_file=str(key_file)), pool, SHOP2) as p:
        await pool.execute(
            "INSERT INTO platform_tokens (platform, credential, account_id, sealed, expires_at)"
            " VALUES ('avito', '888:x', '888', $1, now() + interval '1 day'),"
            " ('avito', '777:y', '777', $2, now() + interval '1 day')",
            Fernet(KEY.encode()).encrypt(b"tok-888"),
            Fernet(Fernet.generate_key()).encrypt(b"tok-under-no-key-of-ours"),
        )
        key_file.write_text(f"{new},{KEY}")
        assert (await p.client.post("/v1/accounts/rotate-key", headers=ADMIN)).status_code == 200
    rows = await pool.fetch("SELECT account_id, sealed FROM platform_tokens ORDER BY account_id")
    assert [r["account_id"] for r in rows] == ["888"], "a token no key opens was kept"
    assert Fernet(new.encode()).decrypt(bytes(rows[0]["sealed"])) == b"tok-888"


async def test_a_token_being_fetched_when_its_account_is_removed_is_not_stored_after_the_removal(
    pool: asyncpg.Pool,
) -> None:
    """On main the removal deleted the account's tokens while its token was being asked of
    Avito, and the token was then stored after it, and stayed."""
    entered, release = asyncio.Event(), asyncio.Event()

    async def avito(request: httpx.Request) -> httpx.Response:
        entered.set()
        await release.wait()
        return httpx.Response(200, json={"access_token": "tok-" + uuid.uuid4().hex, "expires_in": 86400})

    await pool.execute(
        "INSERT INTO accounts (platform, account_id, name, source) VALUES ('avito', '888', 'shop', 'environment')"
    )
    async with httpx.AsyncClient(transport=httpx.MockTransport(avito), timeout=5) as http:
        token = AvitoToken(
            "http://avito.test", "client-2", "s", http, pool, account="888", box=SecretBox(KEY)
        )
        fetching = asyncio.create_task(token.get())
        await asyncio.wait_for(entered.wait(), 5)
        # DELETE /v1/accounts/avito/888 meanwhile (its statements: services/receiver/accounts_api.py).
        async with pool.acquire() as conn, conn.transaction():
            await conn.execute("UPDATE accounts SET removed_at = now() WHERE account_id = '888'")
            await conn.execute("DELETE FROM platform_tokens WHERE platform = 'avito' AND account_id = '888'")
        release.set()
        assert (await fetching).startswith("tok-")
    assert await pool.fetchval("SELECT count(*) FROM platform_tokens WHERE account_id = '888'") == 0


def test_a_token_row_is_keyed_by_account_and_credentials_and_names_neither_client_id_nor_secret() -> None:
    key = token_key("888", "client-2", "client-2-secret-value")
    assert key.startswith("888:") and "client-2" not in key and "secret" not in key
    assert token_key("999", "client-2", "other") != key != token_key("888", "client-2", "other")


async def test_every_webhook_path_refuses_every_other_accounts_credentials_and_stores_nothing(
    keyed: Settings, pool: asyncpg.Pool, world: FakeWorld
) -> None:
    """The cross-tenant matrix: each account's webhook (the environment's bot, Avito account
    and generic sender on their single paths, and an added one of each on its own) posted
    a message for that account with every other account's credential: all refused."""
    bots = {"4242": TELEGRAM_SECRET, "5151": BOT2["credentials"]["webhook_secret"]}
    shops = {777: AVITO_SECRET, 888: SHOP2["credentials"]["webhook_secret"]}
    senders = {"shop-1": GENERIC_SECRET, "shop-3": SHOP3_WEBHOOK}
    every = [*bots.values(), *shops.values(), *senders.values()]
    async with running(keyed, pool, BOT2, SHOP2, shop3(world)) as p:
        client, answers = p.client, []
        for bot, own in bots.items():
            for path in ("/v1/webhooks/telegram", f"/v1/webhooks/telegram/{bot}"):
                if path == "/v1/webhooks/telegram" and bot != "4242":
                    continue  # the single path is the environment's bot's only
                for other in every:
                    if other != own:
                        header = {"X-Telegram-Bot-Api-Secret-Token": other}
                        r = await client.post(path, json=telegram_update(1, chat_id=3), headers=header)
                        answers.append((path, "telegram secret", r.status_code))
        for user, own in shops.items():
            for other in every:
                if other != own:
                    r = await client.post(
                        f"/v1/webhooks/avito/{other}", json=avito_webhook("x", user_id=user)
                    )
                    answers.append((f"avito {user}", "path secret", r.status_code))
        for account, own in senders.items():
            body = dumps({**generic_message("x-1"), "account_id": account})
            for path in ("/v1/webhooks/generic", *(f"/v1/webhooks/generic/{a}" for a in senders)):
                for other in every:
                    if other != own and other.startswith("whsec_"):
                        headers = signed(other, body, webhook_id="x-1")
                        r = await client.post(path, content=body, headers=headers)
                        answers.append((path, f"generic for {account}", r.status_code))
    assert len(answers) == 3 * 5 + 2 * 5 + 2 * 3  # telegram paths, Avito accounts, generic senders x paths
    assert all(status in (401, 403) for *_, status in answers), [a for a in answers if a[2] not in (401, 403)]
    assert await operations(pool) == 0
