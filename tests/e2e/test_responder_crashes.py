"""Every service a real process; the responder killed with SIGKILL at each fault point
around the send. Never a second reply, never a lost one (invariant I5): after a restart
the job ends replied, or needs_review where the platform cannot tell (Telegram)."""

from __future__ import annotations

import signal

import asyncpg
import httpx
import pytest

from tests.conftest import ADMIN_TOKEN, AVITO_SECRET, GENERIC_SECRET, TELEGRAM_SECRET
from tests.fakes.world import FakeWorld
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


async def test_sigterm_in_the_middle_of_a_reply_finishes_it_acks_it_and_exits_cleanly(
    settings, world: FakeWorld, pool: asyncpg.Pool, queues
) -> None:
    """What Kubernetes and compose do on every rollout: SIGTERM while a job is in flight.
    The responder stops taking new jobs, finishes the one it holds (the model answers
    slowly), sends, records and acks it, then exits 0 within the grace period."""
    s = pipeline_settings(settings, world, llm_base_url=f"{world.url}/v1", llm_timeout_seconds=10)
    world.fail("llm", "slow:2")
    receiver = await Receiver(s).start()
    coalescer = await Worker("coalescer", s).start()
    responder = await Worker("responder", s).start()
    try:
        operation_id = await post(receiver, "telegram", 77)
        await wait_for(lambda: world.llm_in_flight == 1 or None, within=30, what="the model call in flight")
        assert await responder.stop(signal.SIGTERM, within=s.shutdown_grace_seconds + 5) == 0, responder.log()
        async with httpx.AsyncClient(timeout=10) as client:
            r = await client.get(
                f"{receiver.url}/v1/operations/{operation_id}",
                headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
            )
        doc = r.json()
    finally:
        await coalescer.stop()
        await receiver.stop()
    assert doc["status"] == "replied", doc
    assert world.replies_to(doc["chat"]["chat_id"]) == [doc["reply"]["text"]]
    assert len(world.llm) == 1
    assert await pool.fetchval("SELECT status FROM reply_jobs") == "sent"
    assert await queues.depth("chatq.responder") == 0, "the finished job was acked, not left for redelivery"


async def test_a_kill_between_the_parts_of_a_long_reply_sends_each_part_once_in_order(
    settings, world: FakeWorld, pool: asyncpg.Pool
) -> None:
    from services.responder.parts import split_reply

    long = " ".join(
        f"Sentence number {n} tells the buyer one more thing about the listing." for n in range(130)
    )
    world.llm_answer = long  # about 9,000 characters: three parts on Telegram
    s = pipeline_settings(settings, world, llm_base_url=f"{world.url}/v1", llm_timeout_seconds=5)
    receiver = await Receiver(s).start()
    coalescer = await Worker("coalescer", s).start()
    try:
        doomed = await Worker("responder", s, CHATQ_FAULT_POINT="responder.between_parts").start()
        operation_id = await post(receiver, "telegram", 401)
        assert await doomed.wait_exit(within=30) == -signal.SIGKILL, doomed.log()
        assert "FAULT POINT responder.between_parts" in doomed.log()
        await doomed.stop()
        assert len(world.replies_to("1301")) == 1  # the first part went out before the kill
        healthy = await Worker("responder", s).start()
        try:
            doc = await settled(receiver, operation_id)
        finally:
            assert await healthy.stop() == 0, healthy.log()
    finally:
        await coalescer.stop()
        await receiver.stop()
    assert doc["status"] == "replied", doc
    assert world.replies_to("1301") == split_reply(long, 4096)
    assert len(world.llm) == 1, "the resumed job sent the rest of the same reply"
