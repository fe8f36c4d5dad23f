"""Responder benchmark: jobs/s of the responder with instant fakes (facts writer, a
platform that answers at once, no pacing), next to a bare aio-pika consumer doing the
same single Postgres write per message with manual acks and the same prefetch.

The jobs are real: the receiver and the coalescer (no debounce) turn N webhooks of N
chats into N reply jobs waiting in chatq.responder; then the responder starts and we
time it from its first reply to its last (its start-up is reported apart). The bare
consumer then drains N messages of the same size from a queue of the same type,
inserting one row per message; a second bare run also makes the responder's one
platform call per message (the same httpx POST to the same fake Telegram), which shows
how much of the gap is the reply's required HTTP call rather than our bookkeeping.

What a job costs, from the first reply to the last: the responder process's CPU and its
Postgres backends' CPU (from /proc; nothing else runs on the benchmark's database then),
and the Postgres transactions the responder committed or rolled back per job (every
statement it sends outside an explicit transaction is one, so this counts its round
trips; from pg_stat_database, read after the responder exited and flushed its counters,
start-up and shutdown included).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

import aio_pika
import asyncpg
import httpx

from bench.blocked import cpu_seconds
from bench.intake import lua_file, wrk
from bench.pipeline import WRK_SCRIPT, fresh, instant_settings
from bench.support import add_infra_arguments, bench_main
from shared.broker.topology import RESPONDER_QUEUE
from shared.settings import Settings
from tests.fakes.platforms import running_fakes
from tests.fakes.world import FakeWorld
from tests.support.processes import Receiver, Worker


async def queue_depth(amqp_url: str, queue: str) -> int:
    connection = await aio_pika.connect(amqp_url)
    async with connection:
        q = await (await connection.channel()).declare_queue(queue, passive=True)
        return q.declaration_result.message_count or 0


async def responder_round(args: argparse.Namespace, world: FakeWorld) -> dict[str, Any]:
    async with fresh(args) as (db_url, amqp_url):
        concurrency = args.concurrency or Settings.model_fields["responder_concurrency"].default
        # Every job queued before the responder starts: no fair-share cap on the one account.
        settings = instant_settings(
            db_url, amqp_url, world, responder_concurrency=concurrency, account_jobs_in_flight=0
        )
        receiver = await Receiver(settings).start()
        coalescer = await Worker("coalescer", settings).start()
        try:
            result = await asyncio.to_thread(wrk, receiver.url, lua_file(WRK_SCRIPT), 8, args.fill_seconds)
            accepted = result["requests"] - result["non_2xx"]
            deadline = time.monotonic() + 300
            while (depth := await queue_depth(amqp_url, RESPONDER_QUEUE)) < accepted:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"only {depth} of {accepted} jobs reached {RESPONDER_QUEUE}")
                await asyncio.sleep(0.2)
        finally:
            await coalescer.stop()
            await receiver.stop()
        conn = await asyncpg.connect(db_url)
        xacts_before = await transactions(conn)
        before = len(world.telegram)
        responder = Worker("responder", settings)
        started = time.monotonic()
        await responder.start(wait_healthy=False)
        assert responder.proc is not None
        first: float | None = None
        cpu_first = pg_first = 0.0
        done_first, pg_pids = 0, list[int]()
        try:
            while (n := len(world.telegram) - before) < accepted:
                if first is None and n > 0:
                    first = time.monotonic()
                    cpu_first, done_first = cpu_seconds([responder.proc.pid]), n
                    pg_pids = await backends(conn)
                    pg_first = cpu_seconds(pg_pids)
                if time.monotonic() - started > 300:
                    raise RuntimeError("the responder did not finish")
                await asyncio.sleep(0.01)
            last = time.monotonic()
            cpu_last = cpu_seconds([responder.proc.pid])
            # Backends opened after the first reply count from zero.
            pg_last = cpu_seconds(sorted(set(pg_pids) | set(await backends(conn))))
        finally:
            await responder.stop()
        first = first or last
        replied = await conn.fetchval("SELECT count(*) FROM operations WHERE status = 'replied'")
        xacts = await transactions(conn, settle=True) - xacts_before
        await conn.close()
        measured = max(accepted - done_first, 1)
        # Bare consumer on the same broker and database: one INSERT per message, manual ack;
        # then the same plus the responder's one platform call per message.
        prefetch = settings.responder_concurrency
        bare = await bare_consumer(db_url, amqp_url, accepted, prefetch=prefetch)
        bare_send = await bare_consumer(db_url, amqp_url, accepted, prefetch=prefetch, send_to=world.url)
    rate = (accepted - 1) / (last - first) if last > first else float("nan")
    return {
        "jobs": accepted,
        "replied": replied,
        "responder_startup_seconds": first - started,
        "responder_seconds": last - first,
        "responder_jobs_per_s": rate,
        "bare_jobs_per_s": bare,
        "bare_with_send_jobs_per_s": bare_send,
        "ratio": rate / bare,
        "ratio_to_bare_with_send": rate / bare_send,
        "responder_cpu_ms_per_job": 1000 * (cpu_last - cpu_first) / measured,
        "postgres_cpu_ms_per_job": 1000 * (pg_last - pg_first) / measured,
        "transactions_per_job": xacts / max(accepted, 1),
    }


async def backends(conn: asyncpg.Connection) -> list[int]:
    """The server processes of the other sessions on this database (the responder's)."""
    rows = await conn.fetch(
        "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"
    )
    return [r["pid"] for r in rows]


async def transactions(conn: asyncpg.Connection, *, settle: bool = False) -> int:
    """Transactions committed and rolled back on this database, as flushed so far (a session
    flushes its counters at least every few seconds and when it exits; this session's few
    reads are noise). With ``settle``, first wait until the other sessions are gone, so
    every one of theirs is counted."""
    if settle:
        for _ in range(300):  # 30 s at most
            if not await backends(conn):
                break
            await asyncio.sleep(0.1)
    total = await conn.fetchval(
        "SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = current_database()"
    )
    return int(total)


async def bare_consumer(
    db_url: str, amqp_url: str, n: int, *, prefetch: int, send_to: str | None = None
) -> float:
    """Messages/s of a bare aio-pika consumer: one INSERT per message and a manual ack (and,
    with ``send_to``, first the platform call the responder makes for a reply)."""
    pool = await asyncpg.create_pool(db_url, min_size=prefetch, max_size=prefetch)
    await pool.execute("DROP TABLE IF EXISTS bench_bare")
    await pool.execute("CREATE TABLE bench_bare (message_id text PRIMARY KEY, body bytea NOT NULL)")
    client = httpx.AsyncClient(timeout=10, limits=httpx.Limits(max_connections=prefetch * 2))
    connection = await aio_pika.connect(amqp_url)
    async with connection:
        channel = await connection.channel(publisher_confirms=True)
        queue = await channel.declare_queue("bench.bare", durable=True, arguments={"x-queue-type": "quorum"})
        body = b"x" * 600
        for start in range(0, n, 200):
            await asyncio.gather(
                *(
                    channel.default_exchange.publish(
                        aio_pika.Message(
                            body, message_id=f"m{i}", delivery_mode=aio_pika.DeliveryMode.PERSISTENT
                        ),
                        routing_key="bench.bare",
                    )
                    for i in range(start, min(start + 200, n))
                )
            )
        consume = await connection.channel()
        await consume.set_qos(prefetch_count=prefetch)
        q = await consume.get_queue("bench.bare")
        done = asyncio.Event()
        count = 0

        async def handle(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            nonlocal count
            if send_to:
                r = await client.post(
                    f"{send_to}/bot4242:bench/sendMessage", json={"chat_id": count, "text": "a reply"}
                )
                r.raise_for_status()
            await pool.execute(
                "INSERT INTO bench_bare (message_id, body) VALUES ($1, $2) ON CONFLICT DO NOTHING",
                message.message_id,
                message.body,
            )
            await message.ack()
            count += 1
            if count >= n:
                done.set()

        started = time.monotonic()
        tag = await q.consume(handle)
        await asyncio.wait_for(done.wait(), 300)
        elapsed = time.monotonic() - started
        await q.cancel(tag)
        await queue.delete(if_unused=False, if_empty=False)
    await pool.close()
    await client.aclose()
    return n / elapsed


async def run(args: argparse.Namespace) -> dict[str, Any]:
    async with running_fakes() as world:
        result = await responder_round(args, world)
    print(
        f"  responder {result['responder_jobs_per_s']:.0f} jobs/s ({result['jobs']} jobs), bare consumer "
        f"{result['bare_jobs_per_s']:.0f} msg/s (ratio {result['ratio']:.2f}), bare consumer with the "
        f"platform call {result['bare_with_send_jobs_per_s']:.0f} msg/s "
        f"(ratio {result['ratio_to_bare_with_send']:.2f})",
        flush=True,
    )
    print(
        f"  per job: responder CPU {result['responder_cpu_ms_per_job']:.2f} ms, its Postgres backends' CPU "
        f"{result['postgres_cpu_ms_per_job']:.2f} ms, {result['transactions_per_job']:.2f} Postgres "
        "transactions (round trips)",
        flush=True,
    )
    return result


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--fill-seconds", type=int, default=8)
    p.add_argument("--concurrency", type=int, help="RESPONDER_CONCURRENCY (default: the setting's default)")
    add_infra_arguments(p)


def main() -> None:
    bench_main(__doc__, add_arguments, run, "responder.json")


if __name__ == "__main__":
    main()
