"""Webhooks while Postgres is away (issue 40, point 6). The receiver cannot store, so it
must not answer 2xx; what it answers decides whether the platform sends again. It holds
each delivery while it tries again, as long as the platform waits for an answer
(Telegram about 60 s: WEBHOOK_HOLD_SECONDS, 50; Avito wants one within 2 s: 1.5 s at most),
so an outage shorter than that loses nothing even if the platform never sends again; then
it answers 503 with Retry-After and a JSON error, which every platform sends again. The
receiver stays in rotation meanwhile (/readyz 200, degraded, naming Postgres): taken out,
the load balancer answered the platforms itself, holding nothing. (Before, a store that
failed answered 500 at once, and /readyz took every receiver out.)"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import httpx
import pytest

from shared import metrics
from shared.settings import Settings
from tests.conftest import AVITO_SECRET, GENERIC_SECRET, TELEGRAM_SECRET, replace
from tests.support.broker import wait_for
from tests.support.payloads import avito_webhook, dumps, generic_message, signed, telegram_update
from tests.support.receiver import running_receiver
from tests.support.tcpproxy import TcpProxy, proxy_for, through

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("clean")]

TG = {"X-Telegram-Bot-Api-Secret-Token": TELEGRAM_SECRET}


def held() -> float:
    return sum(
        s.value
        for m in metrics.IN_PROCESS_RETRIES.collect()
        for s in m.samples
        if s.name.endswith("_total") and s.labels["where"] == "intake"
    )


@pytest.fixture
async def away(
    settings: Settings, request: pytest.FixtureRequest
) -> AsyncIterator[tuple[httpx.AsyncClient, TcpProxy, Settings]]:
    """A receiver whose Postgres is behind a proxy (cut with ``block``), holding webhooks
    ``request.param`` seconds (30 unless a test says)."""
    url = settings.database_url.get_secret_value()
    proxy = await proxy_for(url)
    hold = getattr(request, "param", 30)
    behind = replace(
        settings, database_url=through(url, proxy), relay_enabled=False, webhook_hold_seconds=hold
    )
    try:
        async with running_receiver(behind) as (_, client):
            yield client, proxy, behind
    finally:
        await proxy.close()


async def test_a_webhook_that_arrives_while_postgres_is_away_is_held_and_stored_once_it_answers(
    away: tuple[httpx.AsyncClient, TcpProxy, Settings], pool: asyncpg.Pool
) -> None:
    client, proxy, _ = away
    proxy.block()
    before = held()
    delivery = asyncio.ensure_future(
        client.post("/v1/webhooks/telegram", json=telegram_update(9001, chat_id=77), headers=TG, timeout=60)
    )
    await wait_for(lambda: held() > before, what="the delivery held")
    ready = await client.get("/readyz")
    assert (ready.status_code, ready.json()["status"], ready.json()["failing"]) == (
        200,
        "degraded",
        ["postgres"],
    )
    assert not delivery.done()
    proxy.unblock()
    r = await asyncio.wait_for(delivery, 60)
    assert r.status_code == 200, r.text
    assert await pool.fetchval("SELECT count(*) FROM operations") == 1


@pytest.mark.parametrize("away", [3], indirect=True)
async def test_past_its_hold_each_platform_gets_a_503_to_send_again_and_the_next_delivery_is_stored_once(
    away: tuple[httpx.AsyncClient, TcpProxy, Settings], pool: asyncpg.Pool
) -> None:
    client, proxy, _ = away
    body = dumps(generic_message("g-1", chat_id="c-9"))
    deliveries: dict[str, Any] = {
        # Avito waits about 2 s for an answer: a 503 comes before it gives up.
        "avito": lambda: client.post(
            f"/v1/webhooks/avito/{AVITO_SECRET}", json=avito_webhook("a-1", chat_id="c-8"), timeout=2
        ),
        "telegram": lambda: client.post(
            "/v1/webhooks/telegram", json=telegram_update(9002, chat_id=78), headers=TG, timeout=60
        ),
        "generic": lambda: client.post(
            "/v1/webhooks/generic",
            content=body,
            headers=signed(GENERIC_SECRET, body, webhook_id="w-g-1"),
            timeout=60,
        ),
    }
    proxy.block()
    started = time.monotonic()
    answers = dict(zip(deliveries, await asyncio.gather(*(d() for d in deliveries.values())), strict=True))
    waited = time.monotonic() - started
    proxy.unblock()
    for platform, r in answers.items():
        assert r.status_code == 503, (platform, r.status_code, r.text)
        assert r.json()["error"]["code"] == "database_unavailable", r.text
        assert int(r.headers["retry-after"]) > 0
    assert waited >= 3  # Telegram's and the generic sender's were held for WEBHOOK_HOLD_SECONDS
    assert await pool.fetchval("SELECT count(*) FROM operations") == 0
    # The platforms send again; each message is stored once.
    again = [await d() for d in deliveries.values()]
    assert [r.status_code for r in again] == [200, 200, 202], [r.text for r in again]
    assert await pool.fetchval("SELECT count(*) FROM operations") == 3
