"""Lost Avito webhooks, through real processes and the fake Avito (issue 16): a buyer
message whose webhook never came is found by the receiver's poll and answered exactly
once; a webhook that comes after the poll, before or after the reply, is a duplicate of
the same operation and never makes a second reply."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import httpx
import pytest

from shared.settings import Settings
from tests.conftest import ADMIN_TOKEN, AVITO_SECRET
from tests.fakes.world import FakeWorld
from tests.support.broker import wait_for
from tests.support.pipeline import pipeline_settings
from tests.support.processes import Receiver, Worker

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("clean")]

ME = "777"
POLL_SECONDS = 2.0
#: The pause before a reply, counted from the buyer's message (the coalescer's window).
PAUSE_SECONDS = 5.0


class Running:
    def __init__(self, receiver: Receiver, world: FakeWorld, pool: asyncpg.Pool) -> None:
        self.receiver, self.world, self.pool = receiver, world, pool
        self.http = httpx.AsyncClient(base_url=receiver.url, timeout=10)

    async def webhook(self, body: dict[str, Any]) -> dict[str, Any]:
        r = await self.http.post(f"/v1/webhooks/avito/{AVITO_SECRET}", json=body)
        assert r.status_code == 200, r.text
        return r.json()

    async def status(self, operation_id: str) -> dict[str, Any]:
        r = await self.http.get(
            f"/v1/operations/{operation_id}", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}
        )
        return r.json()

    async def stored(self, message_id: str) -> str:
        found = await wait_for(
            lambda: self.pool.fetchval("SELECT id::text FROM operations WHERE message_id = $1", message_id),
            within=3 * POLL_SECONDS + 10,
            what=f"message {message_id} in the inbox",
        )
        return str(found)

    async def replied(self, chat: str, n: int = 1) -> None:
        async def arrived() -> bool:
            return len(self.world.replies_to(chat)) >= n

        await wait_for(arrived, within=3 * POLL_SECONDS + 20, what=f"{n} reply(ies) in {chat}")

    async def polls_later(self, rounds: int = 2) -> None:
        """Wait until the poller has read the unread chats ``rounds`` more times."""
        seen = self._polls()

        async def done() -> bool:
            return self._polls() >= seen + rounds

        await wait_for(done, within=rounds * POLL_SECONDS + 15, what=f"{rounds} more poll rounds")

    def _polls(self) -> int:
        return sum(1 for c in self.world.platform_calls if c.name == "getChatsV2")


@pytest.fixture
async def running(settings: Settings, world: FakeWorld, pool: asyncpg.Pool) -> AsyncIterator[Running]:
    # A pause before each reply, so a late webhook can come while the reply waits.
    s = pipeline_settings(
        settings,
        world,
        avito_poll_seconds=POLL_SECONDS,
        reply_delay_min_seconds=PAUSE_SECONDS,
        reply_delay_max_seconds=PAUSE_SECONDS,
        max_wait_seconds=PAUSE_SECONDS,
    )
    receiver = await Receiver(s).start()
    workers = [await Worker("coalescer", s).start(), await Worker("responder", s).start()]
    r = Running(receiver, world, pool)
    try:
        # The account speaks once through its webhook: the inbox knows it from then on.
        known = world.avito_buyer_writes(ME, "known", "Is it still available?")
        await r.webhook(known)
        await r.replied("known")
        yield r
    finally:
        await r.http.aclose()
        for process in (*workers, receiver):
            await process.stop()


async def test_an_avito_message_whose_webhook_was_never_delivered_is_answered_after_the_poll_once(
    running: Running, world: FakeWorld
) -> None:
    written = time.monotonic()
    lost = world.avito_buyer_writes(ME, "lost", "Do you deliver?")  # its webhook never comes
    operation_id = await running.stored(lost["payload"]["value"]["id"])
    polled = time.monotonic()
    await running.replied("lost")
    answered = time.monotonic()
    doc = await running.status(operation_id)
    assert doc["status"] == "replied"
    assert [e["kind"] for e in doc["timeline"]][:2] == ["recovered", "received"]
    print(
        f"\nwritten -> stored by the poll {polled - written:.2f}s, poll -> answered {answered - polled:.2f}s, "
        f"written -> answered {answered - written:.2f}s (poll every {POLL_SECONDS:g}s, pause {PAUSE_SECONDS:g}s)"
    )
    # Within one poll interval plus the pause (and the pipeline's own steps).
    assert answered - written < POLL_SECONDS + PAUSE_SECONDS + 5
    # More rounds find nothing new; the webhook, delivered now at last, is a duplicate.
    await running.polls_later()
    late = await running.webhook(lost)
    assert (late["operation_id"], late["duplicate"]) == (operation_id, True)
    await running.polls_later()
    assert world.replies_to("lost") == [
        "Hello! About “Bicycle” (12 000 ₽): We ship across the country; delivery takes 2-5 days."
    ]
    assert await running.pool.fetchval("SELECT count(*) FROM operations WHERE chat_id = 'lost'") == 1


async def test_a_webhook_that_comes_after_the_poll_but_before_the_reply_makes_no_second_operation(
    running: Running, world: FakeWorld
) -> None:
    lost = world.avito_buyer_writes(ME, "late", "Какая цена?")
    operation_id = await running.stored(lost["payload"]["value"]["id"])
    assert world.replies_to("late") == []  # the reply is still in its pause
    late = await running.webhook(lost)
    assert (late["operation_id"], late["duplicate"]) == (operation_id, True)
    await running.replied("late")
    await running.polls_later()
    assert world.replies_to("late") == [
        "Здравствуйте! По объявлению «Bicycle» (12 000 ₽): Цена в объявлении окончательная."
    ]
    doc = await running.status(operation_id)
    assert doc["status"] == "replied"
    assert [e["kind"] for e in doc["timeline"]].count("duplicate") == 1
