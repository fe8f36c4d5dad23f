"""The coalescer as a real process, killed with SIGKILL at each named fault point:
nothing is lost, nothing is emitted twice, and a restart resumes open windows at their
original due time (invariants I4, I5)."""

from __future__ import annotations

import signal

import asyncpg
import httpx
import pytest

from tests.conftest import TELEGRAM_SECRET, replace
from tests.support.broker import QueueInspector, wait_for
from tests.support.invariants import assert_coalescing_invariants
from tests.support.payloads import telegram_update
from tests.support.processes import Receiver, Worker
from tests.support.responder_standin import answer_jobs_until_all_covered

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("clean")]

TG = {"X-Telegram-Bot-Api-Secret-Token": TELEGRAM_SECRET}


@pytest.fixture
def timing(settings):
    return replace(
        settings,
        quiet_seconds=0.5,
        reply_delay_min_seconds=1.0,
        reply_delay_max_seconds=1.0,
        max_wait_seconds=3.0,
        coalescer_poll_seconds=0.1,
        relay_poll_seconds=0.1,
    )


async def post_bursts(receiver: Receiver, chats: int, per_chat: int) -> None:
    async with httpx.AsyncClient(timeout=10) as client:
        for m in range(per_chat):
            for c in range(chats):
                update = telegram_update(
                    10_000 + c * 100 + m, chat_id=700 + c, message_id=m + 1, text=f"{c}/{m}"
                )
                r = await client.post(f"{receiver.url}/v1/webhooks/telegram", json=update, headers=TG)
                assert r.status_code == 200


@pytest.mark.parametrize(
    "point", ["coalescer.before_commit", "coalescer.after_commit", "coalescer.after_emit"]
)
async def test_a_kill_at_each_coalescer_fault_point_loses_nothing_and_emits_nothing_twice(
    point: str, timing, pool: asyncpg.Pool, queues: QueueInspector
) -> None:
    receiver = await Receiver(timing).start()
    try:
        await post_bursts(receiver, chats=4, per_chat=3)
        doomed = await Worker("coalescer", timing, CHATQ_FAULT_POINT=point).start(wait_healthy=False)
        assert await doomed.wait_exit(within=30) == -signal.SIGKILL
        assert f"FAULT POINT {point}" in doomed.log()
        await doomed.stop()
        healthy = await Worker("coalescer", timing).start()
        try:
            jobs = await answer_jobs_until_all_covered(pool, queues)
        finally:
            assert await healthy.stop() == 0, healthy.log()
    finally:
        await receiver.stop()
    # The relay is at-least-once: a kill between a publish and its mark (the doomed
    # process's relay may be mid-publish when the kill lands) sends a job again. A repeat
    # is the same job, id and content, which the responder skips; no window is emitted as
    # two jobs.
    distinct = {j.job_id: j for j in jobs}
    assert all(j == distinct[j.job_id] for j in jobs), "a repeated job differs from the first copy"
    assert len(distinct) == await pool.fetchval("SELECT count(*) FROM reply_jobs")
    covered = sorted(str(m.operation_id) for j in distinct.values() for m in j.messages)
    stored = sorted(r["id"] for r in await pool.fetch("SELECT id::text FROM operations"))
    assert covered == stored, "every message is in exactly one published job"
    await assert_coalescing_invariants(pool)


async def test_a_restart_resumes_an_open_window_at_its_original_due_time(timing, pool: asyncpg.Pool) -> None:
    slow = replace(timing, reply_delay_min_seconds=4.0, reply_delay_max_seconds=4.0, max_wait_seconds=10)
    receiver = await Receiver(slow).start()
    try:
        first = await Worker("coalescer", slow).start()
        await post_bursts(receiver, chats=1, per_chat=1)
        await wait_for(lambda: pool.fetchval("SELECT count(*) FROM chat_windows"), what="a window")
        due_before = await pool.fetchval("SELECT due_at FROM chat_windows")
        assert await first.stop(signal.SIGTERM) == 0, first.log()
        assert await pool.fetchval("SELECT status FROM chat_windows") == "open"
        second = await Worker("coalescer", slow).start()
        try:
            await wait_for(
                lambda: pool.fetchval("SELECT status = 'closed' FROM chat_windows"),
                within=20,
                what="window emitted",
            )
        finally:
            await second.stop()
    finally:
        await receiver.stop()
    row = await pool.fetchrow("SELECT due_at, closed_at FROM chat_windows")
    assert row["due_at"] == due_before
    assert row["closed_at"] >= row["due_at"]
