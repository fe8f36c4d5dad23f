"""An added generic account's reply_url cannot reach inside the deployment (issue 39,
point 3): refused when the account is added (422 with the reason, nothing written), and
again at the send, so a row that points inside (added before the check, or a name that
resolves inside now) sends nothing there: the account is paused with a short reason."""

from __future__ import annotations

import asyncpg
import pytest
from cryptography.fernet import Fernet

from shared.settings import Settings
from tests.conftest import replace
from tests.fakes.world import FakeWorld
from tests.support.broker import wait_for
from tests.support.payloads import dumps, generic_message, signed
from tests.support.pipeline import ADMIN, running_pipeline

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("clean")]

SHOP_SECRET = "whsec_" + "c2hvcC0xLXdlYmhvb2stc2VjcmV0LWZvci10ZXN0cw=="


@pytest.fixture
def outside_only(fast: Settings) -> Settings:
    """The pipeline with accounts of their own, and no reply_url allowed inside."""
    return replace(fast, secrets_key=Fernet.generate_key().decode(), reply_url_allow_hosts="")


def shop(reply_url: str) -> dict:
    return {
        "platform": "generic",
        "account_id": "shop-1",
        "name": "Shop 1",
        "credentials": {"webhook_secret": SHOP_SECRET, "reply_url": reply_url, "reply_secret": SHOP_SECRET},
    }


async def added_while_allowed(settings: Settings, world: FakeWorld, pool: asyncpg.Pool, message_id: str):  # type: ignore[no-untyped-def]
    """Add shop-1 with the fake as its reply_url while the operator allows 127.0.0.1; the
    running pipeline of ``settings`` then gets a buyer's message for it: its answer."""
    allowed = replace(settings, reply_url_allow_hosts="127.0.0.1")
    async with running_pipeline(allowed, pool) as p:
        r = await p.client.post("/v1/accounts", json=shop(f"{world.url}/generic/replies"), headers=ADMIN)
        assert r.status_code == 200, r.text
    body = dumps(generic_message(message_id))
    return body, signed(SHOP_SECRET, body, webhook_id=message_id)


@pytest.mark.parametrize(
    ("host", "why"),
    [
        ("127.0.0.1", "its host 127.0.0.1 is a loopback address"),
        ("localhost", "its host localhost resolves to "),
        ("169.254.169.254", "its host 169.254.169.254 is a cloud metadata address"),
        ("[fd00:ec2::254]", "its host fd00:ec2::254 is a cloud metadata address"),
    ],
)
async def test_adding_a_generic_account_whose_reply_url_reaches_inside_is_refused_with_the_reason(
    outside_only: Settings, world: FakeWorld, pool: asyncpg.Pool, host: str, why: str
) -> None:
    port = world.url.rsplit(":", 1)[1]
    async with running_pipeline(outside_only, pool) as p:
        r = await p.client.post(
            "/v1/accounts", json=shop(f"http://{host}:{port}/generic/replies"), headers=ADMIN
        )
    assert r.status_code == 422
    error = r.json()["error"]
    assert error["code"] == "invalid_reply_url"
    assert error["message"].startswith(f"reply_url is refused: {why}")
    assert await pool.fetchval("SELECT count(*) FROM accounts WHERE platform = 'generic'") == 0


async def test_an_operator_allowed_host_may_be_a_reply_url_inside(
    outside_only: Settings, world: FakeWorld, pool: asyncpg.Pool
) -> None:
    body, headers = await added_while_allowed(outside_only, world, pool, "g-1")
    async with running_pipeline(replace(outside_only, reply_url_allow_hosts="127.0.0.1"), pool) as p:
        op = await p.client.post("/v1/webhooks/generic/shop-1", content=body, headers=headers)
        assert (await p.settled(op.json()["operation_id"]))["status"] == "replied"
    assert [g["chat_id"] for g in world.generic] == ["c1"]


async def test_an_account_whose_reply_url_points_inside_sends_nothing_there_and_waits_paused(
    outside_only: Settings, world: FakeWorld, pool: asyncpg.Pool
) -> None:
    # Added while the operator allowed it (or before the check existed); now it is not.
    body, headers = await added_while_allowed(outside_only, world, pool, "g-2")
    async with running_pipeline(outside_only, pool) as p:
        op = await p.client.post("/v1/webhooks/generic/shop-1", content=body, headers=headers)
        assert op.status_code == 202, op.text
        reason = await wait_for(
            lambda: pool.fetchval(
                "SELECT state_reason FROM accounts WHERE platform = 'generic' AND account_id = 'shop-1'"
                " AND state = 'paused_by_platform'"
            ),
            what="the account to be paused",
        )
        doc = await p.status(op.json()["operation_id"])
    assert reason == (
        "the account's reply_url is refused: its host 127.0.0.1 is a loopback address; an operator can "
        "allow it with CHATQ_REPLY_URL_ALLOW_HOSTS or CHATQ_REPLY_URL_ALLOW_NETWORKS"
    )
    assert doc["status"] != "replied"
    assert world.generic == [] and world.generic_probes == []
