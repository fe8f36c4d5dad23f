"""Settings that point every service at the fake platforms, with immediate coalescing
and short retry tiers."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import asyncpg

from services.receiver.app import ReceiverApps
from shared.settings import Settings
from tests.conftest import ADMIN_TOKEN, GENERIC_SECRET, TELEGRAM_SECRET, replace
from tests.fakes.spec import telegram_spec
from tests.fakes.world import FakeWorld
from tests.support.broker import wait_for
from tests.support.payloads import telegram_update
from tests.support.receiver import running_receiver
from tests.support.services import running_coalescers, running_responders

TG = {"X-Telegram-Bot-Api-Secret-Token": TELEGRAM_SECRET}
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def pipeline_settings(settings: Settings, world: FakeWorld, **overrides: object) -> Settings:
    values: dict[str, object] = {
        "quiet_seconds": 0,
        "reply_delay_min_seconds": 0,
        "reply_delay_max_seconds": 0,
        "max_wait_seconds": 0,
        "coalescer_poll_seconds": 0.1,
        "relay_poll_seconds": 0.1,
        "metrics_port": 0,
        "avito_poll_seconds": 0,
        "telegram_api_base": world.url,
        "avito_client_id": "client-1",
        "avito_client_secret": "client-secret",
        "avito_api_base": world.url,
        "generic_reply_url": f"{world.url}/generic/replies",
        "generic_reply_secret": GENERIC_SECRET,
        # The fakes listen on 127.0.0.1: an added generic account's reply_url may name them
        # (loopback is refused otherwise; tests of that refusal set this to "").
        "reply_url_allow_hosts": "127.0.0.1",
        "alert_webhook_url": f"{world.url}/alerts",
        "alert_webhook_secret": GENERIC_SECRET,
        "platform_timeout_seconds": 1.0,
        "retry_delays_seconds": "0.3,0.6,1.2",
        "max_attempts": 4,
        # A handler's crash is requeued after 1 s in production, up to 10 deliveries: 50 ms here.
        "requeue_pause_seconds": 0.05,
        "responder_concurrency": 4,
        "echo_wait_seconds": 1.0,
        # Avito's per-minute budget is held by its own tests (test_avito_as_it_is.py).
        "avito_requests_per_minute": 100_000,
    }
    values.update(overrides)
    return replace(settings, **values)


class Pipeline:
    def __init__(self, client, pool: asyncpg.Pool, receiver: ReceiverApps | None = None) -> None:
        self.client = client
        self.pool = pool
        #: The receiver's apps (``running_pipeline``): its runtime is ``receiver.public.state.runtime``.
        self.receiver = receiver

    async def telegram(self, update_id: int, chat: int, text: str) -> str:
        r = await self.client.post(
            "/v1/webhooks/telegram", json=telegram_update(update_id, chat_id=chat, text=text), headers=TG
        )
        assert r.status_code == 200
        return r.json()["operation_id"]

    async def post_telegram(self, update: dict) -> dict:
        """Post an update as Telegram would (one the Bot API documents: checked first) and
        return the receiver's answer: operation_id, status, duplicate."""
        problems = telegram_spec().check_type("Update", update)
        assert problems == [], f"Telegram never sends this update: {problems}"
        r = await self.client.post("/v1/webhooks/telegram", json=update, headers=TG)
        assert r.status_code == 200, r.text
        return r.json()

    async def status(self, operation_id: str) -> dict:
        return (await self.client.get(f"/v1/operations/{operation_id}", headers=ADMIN)).json()

    async def settled(self, operation_id: str, *, within: float = 20) -> dict:
        async def final() -> dict | None:
            doc = await self.status(operation_id)
            return doc if doc["status"] in ("replied", "failed", "needs_review", "ignored") else None

        return await wait_for(final, within=within, what=f"operation {operation_id} to settle")  # type: ignore[return-value]


@contextlib.asynccontextmanager
async def running_pipeline(settings: Settings, pool: asyncpg.Pool) -> AsyncIterator[Pipeline]:
    """Receiver, coalescer and responder running in-process on ``settings``."""
    async with (
        running_receiver(settings) as (receiver, client),
        running_coalescers(settings),
        running_responders(settings),
    ):
        yield Pipeline(client, pool, receiver)
