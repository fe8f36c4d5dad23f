"""Crash safety of intake and relay: the receiver as a real process, killed with SIGKILL
at named fault points (invariants I1, I2, I5)."""

from __future__ import annotations

import signal
import uuid

import asyncpg
import httpx
import pytest

from platforms.inbound import Intake
from services.receiver.intake import store
from shared.broker.topology import COALESCER_QUEUE
from tests.conftest import TELEGRAM_SECRET, replace
from tests.support.broker import QueueInspector, wait_for
from tests.support.payloads import dumps, telegram_update
from tests.support.processes import Receiver

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("clean")]

TG = {"X-Telegram-Bot-Api-Secret-Token": TELEGRAM_SECRET}


async def test_a_kill_after_commit_before_the_response_is_answered_2xx_on_retry_and_stored_once(
    settings, pool: asyncpg.Pool, queues: QueueInspector
) -> None:
    update = telegram_update(42, chat_id=7, text="Is the bike still for sale?")
    doomed = await Receiver(settings, CHATQ_FAULT_POINT="receiver.after_commit").start()
    try:
        async with httpx.AsyncClient(timeout=10) as client:
            with pytest.raises(httpx.TransportError):
                await client.post(f"{doomed.url}/v1/webhooks/telegram", json=update, headers=TG)
        assert await doomed.wait_exit() == -signal.SIGKILL
        assert "FAULT POINT receiver.after_commit" in doomed.log()
    finally:
        await doomed.stop()
    # The platform saw no answer, so it retries, against a healthy receiver.
    healthy = await Receiver(settings).start()
    try:
        async with httpx.AsyncClient(timeout=10) as client:
            retry = await client.post(f"{healthy.url}/v1/webhooks/telegram", json=update, headers=TG)
        assert retry.status_code == 200
        assert retry.json()["duplicate"] is True
        operation_id = retry.json()["operation_id"]
        await wait_for(
            lambda: pool.fetchval(
                "SELECT chatq_shown_status(status, id, platform, account_id, chat_id) = 'queued' FROM operations WHERE id = $1",
                uuid.UUID(operation_id),
            ),
            what="the stored message to be published",
        )
    finally:
        await healthy.stop()
    assert await pool.fetchval("SELECT count(*) FROM operations") == 1
    assert await pool.fetchval("SELECT count(*) FROM outbox") == 1
    assert [m.message_id for m in await queues.drain(COALESCER_QUEUE)] == [operation_id]


async def test_a_kill_after_publish_before_marking_publishes_again_with_the_same_message_id(
    settings, pool: asyncpg.Pool, queues: QueueInspector
) -> None:
    stored = await store(
        pool,
        Intake("telegram", "4242", "77", "9", "77", "9", "Hello", None, dumps(telegram_update(77)).decode()),
    )
    # The relay claims the row at start-up and dies between the confirm and the mark.
    doomed = await Receiver(settings, CHATQ_FAULT_POINT="relay.after_publish").start(wait_healthy=False)
    try:
        assert await doomed.wait_exit() == -signal.SIGKILL
        assert "FAULT POINT relay.after_publish" in doomed.log()
    finally:
        await doomed.stop()
    # The broker has the message, the outbox still says unpublished.
    first = await queues.drain(COALESCER_QUEUE)
    assert [m.message_id for m in first] == [str(stored.operation_id)]
    assert await pool.fetchval("SELECT published_at IS NULL FROM outbox") is True
    assert await pool.fetchval("SELECT status FROM operations") == "accepted"

    healthy = await Receiver(replace(settings, relay_poll_seconds=0.1)).start()
    try:
        await wait_for(
            lambda: pool.fetchval("SELECT published_at IS NOT NULL FROM outbox"), what="row marked published"
        )
    finally:
        await healthy.stop()
    second = await queues.drain(COALESCER_QUEUE)
    assert [m.message_id for m in second] == [str(stored.operation_id)]
    assert (
        await pool.fetchval(
            "SELECT chatq_shown_status(status, id, platform, account_id, chat_id) FROM operations"
        )
        == "queued"
    )
