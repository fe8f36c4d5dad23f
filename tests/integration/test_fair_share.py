"""Fair share (issue 21): one account's flood of 5,000 messages does not delay another
account's single message beyond its usual time.

Two mechanisms, chosen from measurements (README "Many accounts"): the coalescer keeps at
most ACCOUNT_JOBS_IN_FLIGHT reply jobs of one account emitted and unfinished (the rest of
its due windows wait in Postgres, so another account's job never queues behind
thousands), and a window's times count from the message's receipt, so a message filed
late behind the flood in the inbound queue waits that much less."""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid

import asyncpg
import pytest

from shared.db import JOBS_ENDED_CHANNEL, announce_jobs_ended
from shared.secretbox import SecretBox
from shared.settings import Settings
from stores.accounts.registry import AccountRegistry
from tests.conftest import AVITO_SECRET, replace
from tests.fakes.world import FakeWorld
from tests.support.broker import wait_for
from tests.support.infra import Infra
from tests.support.payloads import avito_webhook, telegram_update
from tests.support.pipeline import TG, Pipeline
from tests.support.receiver import running_receiver
from tests.support.services import running_coalescers, running_responders

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("clean")]

FLOOD = 5000
#: The human-like pause before a reply (the usual time is about this).
PAUSE = 20.0


async def account_b_message(p: Pipeline, n: int) -> dict[str, float]:
    """One message to account B (the Avito account): when each step happened, in seconds
    after its receipt (filed, emitted, attempt, replied)."""
    r = await p.client.post(
        f"/v1/webhooks/avito/{AVITO_SECRET}", json=avito_webhook(f"b-{n}", chat_id=f"b-{n}", text="price?")
    )
    op = r.json()["operation_id"]
    assert (await p.settled(op, within=PAUSE + 90))["status"] == "replied"
    steps = await p.pool.fetch(
        "SELECT e.kind, extract(epoch FROM e.at - o.received_at)::float8 AS t FROM operation_events e"
        " JOIN operations o ON o.id = e.operation_id WHERE o.id = $1 ORDER BY e.id",
        uuid.UUID(op),
    )
    print(f"\nB's message {n}: " + ", ".join(f"{s['kind']} +{s['t']:.1f}s" for s in steps))
    return {s["kind"]: s["t"] for s in steps}


async def flood(p: Pipeline, count: int) -> None:
    """``count`` messages to account A (the Telegram bot), each in a chat of its own."""
    gate = asyncio.Semaphore(32)

    async def post(n: int) -> None:
        async with gate:
            r = await p.client.post(
                "/v1/webhooks/telegram", json=telegram_update(100_000 + n, chat_id=10_000 + n), headers=TG
            )
            assert r.status_code == 200

    await asyncio.gather(*(post(n) for n in range(count)))


@pytest.mark.slow
async def test_one_accounts_flood_of_5000_does_not_delay_another_accounts_single_message(
    fast: Settings, pool: asyncpg.Pool, world: FakeWorld
) -> None:
    settings = replace(
        fast,
        reply_delay_min_seconds=PAUSE,
        reply_delay_max_seconds=PAUSE,
        max_wait_seconds=PAUSE * 3,
        platform_rate_per_second=20.0,  # the platforms' pace: A's flood takes minutes to answer
    )
    async with (
        running_receiver(settings) as (_, client),
        running_coalescers(settings),
        running_responders(settings),
    ):
        p = Pipeline(client, pool)
        usual = await account_b_message(p, 0)
        started = time.monotonic()
        await flood(p, FLOOD)
        posted = time.monotonic() - started
        flooded = await account_b_message(p, 1)
        unanswered = await pool.fetchval(
            "SELECT count(*) FROM operations WHERE platform = 'telegram' AND status <> 'replied'"
        )
        in_flight = await pool.fetchval(
            "SELECT count(*) FROM reply_jobs WHERE platform = 'telegram' AND status IN ('pending', 'processing')"
        )
    print(
        f"\nfair share: B alone {usual['replied']:.2f}s; {FLOOD} messages to A posted in {posted:.1f}s; "
        f"B right after {flooded['replied']:.2f}s (filed +{flooded['filed']:.1f}s); A then had {unanswered} "
        f"unanswered, {in_flight} jobs in flight (ACCOUNT_JOBS_IN_FLIGHT={settings.account_jobs_in_flight})"
    )
    assert unanswered > FLOOD // 2, "A's flood was still being answered when B was"
    assert in_flight <= settings.account_jobs_in_flight
    # B's job waits behind at most ACCOUNT_JOBS_IN_FLIGHT of A's in the responders' queue.
    assert flooded["attempt"] - flooded["emitted"] <= 2.0
    # Its pause counts from receipt: answered in its usual time, unless the inbound queue
    # (FIFO, shared by every account) took longer than the pause to file it behind the
    # flood; then soon after it was filed (one emission round under this load).
    assert flooded["replied"] <= max(usual["replied"], flooded["filed"]) + 10.0


async def test_a_jobs_end_refills_its_accounts_share_at_once_not_at_the_schedulers_next_poll(
    fast: Settings, pool: asyncpg.Pool, world: FakeWorld
) -> None:
    """Issue 43: a lone account's flood ran at its share a poll (16 jobs every 0.5 s, about
    160 replies a second) however fast the pipeline was. Now a job's end is notified
    (NOTIFY chatq_jobs_ended) and the scheduler refills the share at once. With a share of
    one and a poll of 30 s, three messages of one account are answered one after another,
    each job emitted right after the previous one ended; at the poll's pace the second
    would wait up to 30 s."""
    settings = replace(
        fast,
        account_jobs_in_flight=1,
        platform_rate_per_second=1.0,  # its alone share is 1 too (Settings.account_jobs_alone)
        coalescer_poll_seconds=30.0,
    )
    assert settings.account_jobs_alone() == 1
    async with (
        running_receiver(settings) as (_, client),
        running_coalescers(settings),
        running_responders(settings),
    ):
        p = Pipeline(client, pool)
        ops = []
        for n in range(3):
            r = await client.post(
                "/v1/webhooks/telegram", json=telegram_update(900 + n, chat_id=9_000 + n), headers=TG
            )
            ops.append(r.json()["operation_id"])
        for op in ops:
            assert (await p.settled(op, within=20))["status"] == "replied"
    jobs = await pool.fetch(
        "SELECT j.created_at, j.updated_at FROM reply_jobs j WHERE j.status = 'sent' ORDER BY j.created_at"
    )
    assert len(jobs) == 3
    for before, after in itertools.pairwise(jobs):
        # Held by the share of one until the previous job ended, then emitted at once.
        assert after["created_at"] >= before["updated_at"]
        gap = (after["created_at"] - before["updated_at"]).total_seconds()
        assert gap < 2.0, f"the next job was emitted {gap:.1f} s after the previous one ended"


async def test_the_coalescer_hears_jobs_end_again_after_its_listening_connection_was_cut(
    infra: Infra, pool: asyncpg.Pool
) -> None:
    """The notification rides on the connection that listens for account changes: when
    Postgres cuts it (a restart, a proxy), the scheduler is woken as it listens again (what
    ended meanwhile went unheard) and hears the next end on the new connection."""
    wakes: list[int] = []
    registry = AccountRegistry(
        pool,
        SecretBox(None, None),
        dsn=infra.database_url,
        credentials=False,
        also_listen={JOBS_ENDED_CHANNEL: lambda: wakes.append(1)},
    )
    await registry.start()
    try:
        assert len(wakes) == 1  # listening from the start: a round at once
        async with pool.acquire() as conn:
            await announce_jobs_ended(conn)
        await wait_for(lambda: len(wakes) == 2, within=5, what="the end of a job heard")
        listener = registry._listener
        assert listener is not None
        cut = listener.get_server_pid()
        await pool.fetchval("SELECT pg_terminate_backend($1)", cut)
        await wait_for(lambda: len(wakes) == 3, within=15, what="a wake as it listens again")
        assert registry._listener is not None and registry._listener.get_server_pid() != cut
        async with pool.acquire() as conn:
            await announce_jobs_ended(conn)
        await wait_for(lambda: len(wakes) == 4, within=5, what="the next end heard on the new connection")
    finally:
        await registry.stop()


async def test_announcing_jobs_ended_inside_a_transaction_is_refused_and_leaves_its_commit_durable(
    pool: asyncpg.Pool,
) -> None:
    """The announcement commits without waiting for its WAL flush (SET LOCAL): run inside
    a caller's transaction, it would make that transaction's commit lose its durability."""
    async with pool.acquire() as conn, conn.transaction():
        with pytest.raises(RuntimeError, match="outside any transaction"):
            await announce_jobs_ended(conn)
        assert await conn.fetchval("SHOW synchronous_commit") == "on"
