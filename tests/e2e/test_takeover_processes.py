"""The seller answers and the bot steps back (issue 16), with every service a real process,
the fake Avito and the fake model: the seller's message during the pause withdraws the
bot's reply, a buyer writing during the hold is stored and shown but not answered, and
`chatq chats resume` hands the chat back so the next message is answered."""

from __future__ import annotations

import subprocess
from collections.abc import AsyncIterator

import asyncpg
import httpx
import pytest

from tests.conftest import ADMIN_TOKEN, AVITO_SECRET
from tests.fakes.world import FakeWorld
from tests.support.broker import wait_for
from tests.support.payloads import avito_webhook
from tests.support.pipeline import pipeline_settings
from tests.support.processes import Receiver, Worker, run_chatq

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("clean")]

ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
SELLER = 777  # the Avito account's own user_id: the author of the seller's messages
CHAT = "e2e-hold"


@pytest.fixture
async def stack(settings, world: FakeWorld) -> AsyncIterator[Receiver]:
    # A human-like pause long enough for the seller to answer first.
    s = pipeline_settings(
        settings,
        world,
        reply_delay_min_seconds=4,
        reply_delay_max_seconds=4,
        max_wait_seconds=15,
        quiet_seconds=0,
    )
    receiver = await Receiver(s).start()
    coalescer = await Worker("coalescer", s).start()
    responder = await Worker("responder", s).start()
    try:
        yield receiver
    finally:
        for p in (responder, coalescer, receiver):
            await p.stop()


async def post(receiver: Receiver, message_id: str, *, author: int | None = None, text: str) -> dict:
    body = avito_webhook(message_id, chat_id=CHAT, text=text, **({"author_id": author} if author else {}))
    async with httpx.AsyncClient(timeout=10) as client:
        r = await client.post(f"{receiver.url}/v1/webhooks/avito/{AVITO_SECRET}", json=body)
    assert r.status_code == 200, r.text
    return r.json()


async def status(receiver: Receiver, operation_id: str) -> dict:
    async with httpx.AsyncClient(timeout=10) as client:
        return (await client.get(f"{receiver.url}/v1/operations/{operation_id}", headers=ADMIN)).json()


async def reaches(receiver: Receiver, operation_id: str, wanted: str, within: float = 30) -> dict:
    async def check() -> dict | None:
        doc = await status(receiver, operation_id)
        return doc if doc["status"] == wanted else None

    return await wait_for(check, within=within, what=f"{operation_id} to be {wanted}")  # type: ignore[return-value]


async def chatq(receiver: Receiver, *args: str) -> subprocess.CompletedProcess[str]:
    return await run_chatq(receiver, *args, token=ADMIN_TOKEN)


async def test_the_seller_writing_in_the_pause_silences_the_bot_until_chatq_hands_the_chat_back(
    stack: Receiver, world: FakeWorld, pool: asyncpg.Pool
) -> None:
    first = (await post(stack, "b-1", text="Is it still available?"))["operation_id"]
    await wait_for(
        lambda: pool.fetchval("SELECT count(*) > 0 FROM chat_windows WHERE status = 'open'"),
        what="the buyer's window, still in its pause",
    )
    seller = await post(stack, "s-1", author=SELLER, text="Yes, come by at 5!")
    assert seller["status"] == "ignored"

    doc = await reaches(stack, first, "replied")
    assert doc["status_text"] == "answered by the seller (message s-1)"
    assert "answered_by_seller" in [e["kind"] for e in doc["timeline"]]

    # A buyer writing while the seller holds the chat: stored and shown, not answered.
    during = (await post(stack, "b-2", text="And delivery?"))["operation_id"]
    held = await reaches(stack, during, "waiting")
    assert held["status_text"].startswith("held by the seller until")
    listed = await chatq(stack, "chats", "list")
    assert listed.returncode == 0 and f"avito:{SELLER}:{CHAT}" in listed.stdout, listed.stdout + listed.stderr
    mine = await chatq(stack, "chats", "list", "--account", f"avito:{SELLER}")
    assert f"avito:{SELLER}:{CHAT}" in mine.stdout, mine.stdout + mine.stderr
    others = await chatq(stack, "chats", "list", "--account", f"avito:{SELLER}0")
    assert others.returncode == 0 and "0 chat(s) of account" in others.stdout, others.stdout + others.stderr
    # Past the time the pause would have ended, the bot still has not written.
    paused_until = await pool.fetchval("SELECT now() + interval '5 seconds'")
    await wait_for(
        lambda: pool.fetchval("SELECT now() > $1", paused_until), within=15, what="the pause to pass"
    )
    assert world.replies_to(CHAT) == []
    assert (await status(stack, during))["status"] == "waiting"

    # A person hands the chat back: the waiting message is answered, once.
    resumed = await chatq(stack, "chats", "resume", f"avito:{SELLER}:{CHAT}")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    await reaches(stack, during, "replied")
    assert len(world.replies_to(CHAT)) == 1

    # And the next message is answered as usual.
    nxt = (await post(stack, "b-3", text="What is the price?"))["operation_id"]
    await reaches(stack, nxt, "replied")
    assert len(world.replies_to(CHAT)) == 2
