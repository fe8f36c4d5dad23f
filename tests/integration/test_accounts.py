"""Keep platform accounts working (issue 15): an account the platform refuses as a whole is
paused with one alert and its replies wait, none failing, until a probe finds it working
again; a refusal about one chat stays that job's failure; one Avito token serves every
replica; Avito's subscription check gets its 200."""

from __future__ import annotations

import asyncio

import asyncpg
import httpx
import pytest

from platforms.avito.adapter import AvitoToken
from shared.settings import Settings
from tests.conftest import AVITO_SECRET, replace
from tests.fakes.world import FakeWorld
from tests.support.broker import wait_for
from tests.support.payloads import avito_webhook
from tests.support.pipeline import ADMIN, Pipeline
from tests.support.receiver import running_receiver
from tests.support.services import running_coalescers, running_responders

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("clean")]

TOKEN = "4242:test-token"  # tests.conftest.make_settings' bot token


@pytest.fixture
def probing(fast: Settings) -> Settings:
    return replace(fast, account_probe_seconds=1)


def alerts(world: FakeWorld, kind: str) -> list[dict]:
    return [a["body"] for a in world.alerts if a["body"]["type"] == kind]


async def statuses(pool: asyncpg.Pool) -> dict[str, int]:
    return {
        r["status"]: r["n"]
        for r in await pool.fetch("SELECT status, count(*) AS n FROM operations GROUP BY 1")
    }


async def test_a_revoked_bot_token_pauses_the_account_once_and_every_reply_goes_out_once_it_is_fixed(
    probing: Settings, pool: asyncpg.Pool, world: FakeWorld
) -> None:
    world.revoke_telegram_token(TOKEN)
    async with (
        running_receiver(probing) as (_, client),
        running_coalescers(probing),
        running_responders(probing),
    ):
        p = Pipeline(client, pool)
        ops = [await p.telegram(3000 + n, 300 + n % 10, f"question {n}") for n in range(50)]
        await wait_for(
            lambda: pool.fetchval(
                "SELECT state = 'paused_by_platform' FROM accounts WHERE platform = 'telegram'"
            ),
            what="the account paused",
        )
        # The replies wait; none fails, whatever the retry tiers did meanwhile: each is in a
        # job held for the account, or (filed after its chat's job was emitted) in the
        # chat's window behind that job.
        await wait_for(
            lambda: pool.fetchval(
                "SELECT count(*) = 50 FROM operations o LEFT JOIN reply_jobs j ON j.id = o.job_id"
                " WHERE j.error_kind = 'account' OR (o.job_id IS NULL AND o.status = 'waiting'"
                "   AND EXISTS (SELECT 1 FROM reply_jobs b WHERE b.chat_key = chatq_chat_key(o.platform,"
                "               o.account_id, o.chat_id) AND b.error_kind = 'account'))"
            ),
            within=30,
            what="all 50 waiting for the account",
        )
        stats = (await client.get("/v1/stats", headers=ADMIN)).json()
        (paused,) = stats["paused_accounts"]
        assert (paused["platform"], paused["state"]) == ("telegram", "paused_by_platform")
        assert "revoked or mistyped" in paused["reason"]
        assert "failed" not in await statuses(pool) and "needs_review" not in await statuses(pool)

        world.telegram_revoked.clear()  # the seller put the right token back
        for op in ops:
            assert (await p.settled(op, within=60))["status"] == "replied"
    assert await statuses(pool) == {"replied": 50}
    assert {str(m["chat_id"]) for m in world.telegram} == {str(300 + n) for n in range(10)}
    assert len(alerts(world, "account.paused")) == 1
    assert len(alerts(world, "account.resumed")) == 1
    assert await pool.fetchval("SELECT state FROM accounts WHERE platform = 'telegram'") == "active"


async def test_an_avito_account_without_the_messenger_plan_is_paused_with_that_reason_and_resumes(
    probing: Settings, pool: asyncpg.Pool, world: FakeWorld
) -> None:
    world.avito_messenger_plan = False
    async with (
        running_receiver(probing) as (_, client),
        running_coalescers(probing),
        running_responders(probing),
    ):
        p = Pipeline(client, pool)
        r = await client.post(f"/v1/webhooks/avito/{AVITO_SECRET}", json=avito_webhook("np-1", chat_id="np"))
        op = r.json()["operation_id"]
        reason = await wait_for(
            lambda: pool.fetchval(
                "SELECT state_reason FROM accounts WHERE platform = 'avito' AND state <> 'active'"
            ),
            what="the account paused",
        )
        assert "no paid Messenger plan" in reason
        assert (await p.status(op))["status"] == "replying"
        world.avito_messenger_plan = True
        assert (await p.settled(op, within=60))["status"] == "replied"
    assert [a["account_id"] for a in alerts(world, "account.paused")] == ["777"]


async def test_wrong_avito_client_credentials_pause_the_account_instead_of_failing_replies(
    probing: Settings, pool: asyncpg.Pool, world: FakeWorld
) -> None:
    world.avito_client_secret = "the-right-secret"
    async with (
        running_receiver(probing) as (_, client),
        running_coalescers(probing),
        running_responders(probing),
    ):
        await client.post(f"/v1/webhooks/avito/{AVITO_SECRET}", json=avito_webhook("wc-1", chat_id="wc"))
        reason = await wait_for(
            lambda: pool.fetchval(
                "SELECT state_reason FROM accounts WHERE platform = 'avito' AND state <> 'active'"
            ),
            what="the account paused",
        )
    assert "refused the client credentials" in reason
    assert "failed" not in await statuses(pool)


async def test_a_403_about_one_avito_chat_fails_that_job_and_pauses_nothing(
    pipeline: Pipeline, pool: asyncpg.Pool, world: FakeWorld
) -> None:
    world.fail("avito.send", "403", "403")  # the first send and its retry with a fresh token
    r = await pipeline.client.post(
        f"/v1/webhooks/avito/{AVITO_SECRET}", json=avito_webhook("c4-1", chat_id="c403")
    )
    doc = await pipeline.settled(r.json()["operation_id"])
    assert doc["status"] == "failed"
    assert "HTTP 403" in doc["error"]["message"]
    assert await pool.fetchval("SELECT count(*) FROM accounts WHERE state <> 'active'") == 0


async def test_replicas_share_one_avito_token_and_one_refresh(pool: asyncpg.Pool, world: FakeWorld) -> None:
    async with httpx.AsyncClient(timeout=5) as http:
        replicas = [AvitoToken(world.url, "client-1", "client-secret", http, pool) for _ in range(3)]
        tokens = await asyncio.gather(*(r.get() for r in replicas))
        assert len(set(tokens)) == 1
        assert world.avito_token_requests == 1
        # Avito refused the token (it expired early): one replica refreshes, the others
        # read the new one instead of fetching (and invalidating) their own.
        fresh = await asyncio.gather(*(r.get(stale=tokens[0]) for r in replicas))
        assert len(set(fresh)) == 1 and fresh[0] != tokens[0]
        assert world.avito_token_requests == 2


async def test_avitos_subscription_check_gets_a_200_and_stores_nothing(
    settings: Settings, pool: asyncpg.Pool
) -> None:
    async with running_receiver(replace(settings, relay_enabled=False)) as (_, client):
        # What `curl -d '{}'` sends: a form content type and no payload.
        r = await client.post(
            f"/v1/webhooks/avito/{AVITO_SECRET}",
            content=b"{}",
            headers={"content-type": "application/x-www-form-urlencoded"},
        )
        assert r.status_code == 200
        assert r.json() == {"ok": True, "ignored": "no message payload: nothing to store"}
        wrong = await client.post("/v1/webhooks/avito/not-the-secret", content=b"{}")
        assert wrong.status_code == 401
        garbage = await client.post(f"/v1/webhooks/avito/{AVITO_SECRET}", content=b"not json")
        assert garbage.status_code == 400
    assert await pool.fetchval("SELECT count(*) FROM operations") == 0
