"""Every service a real process; the responder killed with SIGKILL at each fault point
around the send. Never a second reply, never a lost one (invariant I5): after a restart
the job ends replied, or needs_review where the platform cannot tell (Telegram)."""

from __future__ import annotations

import signal

import asyncpg
import httpx
import pytest

from tests.conftest import ADMIN_TOKEN, AVITO_SECRET, GENERIC_SECRET, TELEGRAM_SECRET
from tests.fakes.platforms import FakeWorld
from tests.support.broker import wait_for
from tests.support.payloads import avito_webhook, dumps, generic_message, signed, telegram_update
from tests.support.pipeline import pipeline_settings
from tests.support.processes import Receiver, Worker

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("clean")]


async def post(receiver: Receiver, platform: str, n: int) -> str:
    async with httpx.AsyncClient(timeout=10) as client:
        if platform == "telegram":
            r = await client.post(
                f"{receiver.url}/v1/webhooks/telegram",
                json=telegram_update(n, chat_id=900 + n, text="Do you deliver?"),
                headers={"X-Telegram-Bot-Api-Secret-Token": TELEGRAM_SECRET},
            )
        elif platform == "avito":
            r = await client.post(
                f"{receiver.url}/v1/webhooks/avito/{AVITO_SECRET}",
                json=avito_webhook(f"k{n}", chat_id=f"{900 + n}"),
            )
        else:
            body = dumps(generic_message(f"k{n}", chat_id=f"{900 + n}"))
            r = await client.post(
                f"{receiver.url}/v1/webhooks/generic",
                content=body,
                headers=signed(GENERIC_SECRET, body, webhook_id=f"w{n}"),
            )
        assert r.is_success, r.text
        return r.json()["operation_id"]


async def settled(receiver: Receiver, operation_id: str) -> dict:
    async with httpx.AsyncClient(timeout=10) as client:

        async def final() -> dict | None:
            doc = (
                await client.get(
                    f"{receiver.url}/v1/operations/{operation_id}",
                    headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
                )
            ).json()
            return doc if doc["status"] in ("replied", "failed", "needs_review") else None

        return await wait_for(final, within=40, what="the operation to settle")  # type: ignore[return-value]


CASES = [
    ("telegram", "responder.after_generate", "replied"),
    ("telegram", "responder.after_send", "needs_review"),
    ("telegram", "responder.after_record", "replied"),
    ("avito", "responder.after_send", "replied"),
    ("avito", "responder.after_record", "replied"),
    ("generic", "responder.after_send", "replied"),
]


@pytest.mark.parametrize(("platform", "point", "expected"), CASES, ids=[f"{p}-{f}" for p, f, _ in CASES])
async def test_a_kill_around_the_send_never_yields_a_second_reply_and_never_loses_one(
    platform: str, point: str, expected: str, settings, world: FakeWorld, pool: asyncpg.Pool
) -> None:
    s = pipeline_settings(settings, world)
    receiver = await Receiver(s).start()
    coalescer = await Worker("coalescer", s).start()
    try:
        doomed = await Worker("responder", s, CHATQ_FAULT_POINT=point).start()
        operation_id = await post(receiver, platform, len(point))
        assert await doomed.wait_exit(within=30) == -signal.SIGKILL, doomed.log()
        assert f"FAULT POINT {point}" in doomed.log()
        await doomed.stop()
        healthy = await Worker("responder", s).start()
        try:
            doc = await settled(receiver, operation_id)
        finally:
            assert await healthy.stop() == 0, healthy.log()
    finally:
        await coalescer.stop()
        await receiver.stop()
    assert doc["status"] == expected, doc
    chat = doc["chat"]["chat_id"]
    assert len(world.replies_to(chat)) == 1, f"{platform} received {world.replies_to(chat)}"
    if expected == "needs_review":
        assert doc["owner"] == "on-call"
    else:
        assert doc["reply"]["text"] == world.replies_to(chat)[0]
    assert await pool.fetchval("SELECT count(*) FROM reply_jobs") == 1
