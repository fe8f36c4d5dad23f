"""Coalescer benchmark: how fast inbound messages are filed into windows, the claim
query's plan with many open windows, and how late windows are emitted after their due time.

Usage: python -m bench.coalescer [--file-messages 20000] [--file-chats 5000] [--open 100000]
                                 [--due 10000] [--spread 10] [--file-batch N]

Filing: ``--file-messages`` inbound messages of ``--file-chats`` chats (interleaved, as
bursts arrive) are stored as the receiver stores them and published to the coalescer's
queue in a private vhost; then the real consumer (services/coalescer/app.py's, with the
default prefetch and batch settings) drains that backlog. Reported: messages/s,
messages filed per Postgres commit (pg_stat_database of the fresh database), messages per
broker ack, and the CPU of this process and of Postgres' backends per message.

Open windows are written straight into a fresh database (``--open`` of them, ``--due`` of
those falling due evenly over the next ``--spread`` seconds, the rest hours away); then
the real scheduler (``Coalescer.run_scheduler``, its relay publishing the jobs to a
private vhost) runs until every due window is emitted. Lag = closed_at - due_at, both
from Postgres' clock.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import time
import uuid
from datetime import UTC, datetime, timedelta

import asyncpg

from bench.blocked import cpu_seconds
from bench.support import RESULTS, add_infra_arguments, drop_database, fresh_database, private_vhost
from services.coalescer.app import inbound_consumer
from services.coalescer.service import Coalescer
from shared.broker.connection import BrokerConnection
from shared.broker.publisher import ConfirmingPublisher, OutgoingMessage
from shared.broker.topology import (
    COALESCER_QUEUE,
    INBOUND_EXCHANGE,
    JOBS_EXCHANGE,
    build_topology,
    inbound_routing_key,
)
from shared.db import create_pool
from shared.messages import InboundMessage
from shared.metrics import ACK_MESSAGES
from shared.outbox import Relay
from shared.settings import Settings
from stores.windows.postgres import _CLAIM_DUE
from stores.windows.window import WindowPolicy

SEED = """
INSERT INTO operations (id, platform, account_id, chat_id, message_id, author_id, text, sent_at, status,
                        received_at, payload)
SELECT md5('op' || g)::uuid, 'telegram', '4242', g::text, '1', g::text, 'Hello, is it available?', now(),
       'waiting', now(), '{}'
FROM generate_series(1, $1) g;

INSERT INTO chat_windows (id, chat_key, platform, account_id, chat_id, status, first_at, last_at,
                          deadline_at, due_at, delay_seconds, message_count)
SELECT md5('w' || g)::uuid, 'telegram:4242:' || g, 'telegram', '4242', g::text, 'open', now(), now(),
       now() + interval '3 hours', now() + interval '2 hours',
       30, 1
FROM generate_series(1, $1) g;

INSERT INTO window_messages (operation_id, window_id)
SELECT md5('op' || g)::uuid, md5('w' || g)::uuid FROM generate_series(1, $1) g;

ANALYZE operations; ANALYZE chat_windows; ANALYZE window_messages; ANALYZE reply_jobs;
"""

# Run right before the scheduler starts, so seeding time never counts as lag.
MAKE_DUE = """
UPDATE chat_windows
SET due_at = clock_timestamp() + make_interval(secs => 1 + $2 * chat_id::int::float8 / $1),
    deadline_at = clock_timestamp() + interval '1 hour'
WHERE chat_id::int <= $1
"""


async def run(args: argparse.Namespace) -> dict[str, object]:
    result: dict[str, object] = {}
    if args.file_messages:
        name, db_url = await fresh_database(args.admin_database_url)
        try:
            async with private_vhost(args.amqp_url, args.rabbitmq_api_url) as amqp_url:
                result["filing"] = await measure_filing(args, db_url, amqp_url)
        finally:
            await drop_database(args.admin_database_url, name)
    name, db_url = await fresh_database(args.admin_database_url)
    try:
        async with private_vhost(args.amqp_url, args.rabbitmq_api_url) as amqp_url:
            return {**await measure(args, db_url, amqp_url), **result}
    finally:
        await drop_database(args.admin_database_url, name)


STORE_INBOUND = """
INSERT INTO operations (id, platform, account_id, chat_id, message_id, author_id, text, sent_at, status,
                        received_at, payload)
SELECT v.id, 'telegram', '777', v.chat_id, v.message_id, 'buyer', 'Hello, is it available?', v.at, 'queued',
       v.at, '{}'
FROM unnest($1::uuid[], $2::text[], $3::text[], $4::timestamptz[]) AS v(id, chat_id, message_id, at)
"""


async def commits(db_url: str) -> int:
    """Transactions committed in the database so far. Read from a new connection after the
    others closed: a backend reports its counts at the latest when it exits."""
    await asyncio.sleep(0.5)
    conn = await asyncpg.connect(db_url)
    try:
        n: int = await conn.fetchval(
            "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()"
        )
        return n
    finally:
        await conn.close()


def filing_settings(args: argparse.Namespace) -> Settings:
    """The coalescer's settings: the defaults, with the batch size asked for."""
    overrides = {} if args.file_batch is None else {"coalescer_file_batch_messages": args.file_batch}
    return Settings(_env_file=None, **overrides)  # type: ignore[call-arg]


def acked_messages(acks: object) -> float:
    """Messages per ack so far: the histogram's sum over its count."""
    values = {s.name: s.value for m in acks.collect() for s in m.samples}  # type: ignore[attr-defined]
    count = values.get("chatq_consumer_ack_messages_count", 0)
    return values.get("chatq_consumer_ack_messages_sum", 0) / count if count else float("nan")


async def measure_filing(args: argparse.Namespace, db_url: str, amqp_url: str) -> dict[str, object]:
    """Drain a backlog of inbound messages through the real consumer and coalescer."""
    now = datetime.now(UTC)
    messages = [
        InboundMessage(
            operation_id=uuid.uuid4(), platform="telegram", account_id="777", chat_id=str(i % args.file_chats),
            message_id=str(i + 1), author_id="buyer", text="Hello, is it available?",
            sent_at=now + timedelta(microseconds=i), received_at=now + timedelta(microseconds=i),
        )
        for i in range(args.file_messages)
    ]  # fmt: skip
    settings = filing_settings(args)
    pool = await create_pool(db_url, size=settings.database_pool_size)
    await pool.execute(
        STORE_INBOUND,
        [m.operation_id for m in messages],
        [m.chat_id for m in messages],
        [m.message_id for m in messages],
        [m.received_at for m in messages],
    )
    broker = BrokerConnection(amqp_url, build_topology(), name="bench-coalescer-filing")
    publisher = ConfirmingPublisher(broker)
    for start in range(0, len(messages), 1000):
        errors = await publisher.publish_many(
            [
                OutgoingMessage(INBOUND_EXCHANGE, inbound_routing_key(m.platform), str(m.operation_id), m.to_bytes())
                for m in messages[start : start + 1000]
            ]
        )  # fmt: skip
        if any(errors):
            raise RuntimeError(f"publishing the backlog failed: {next(e for e in errors if e)}")
    await pool.close()
    before = await commits(db_url)
    pool = await create_pool(db_url, size=settings.database_pool_size)
    # Long pauses: nothing falls due while the backlog drains (the scheduler is not run).
    coalescer = Coalescer(pool, WindowPolicy(quiet=600, delay_min=600, delay_max=600, max_wait=1200))
    consumer = inbound_consumer(broker, coalescer, settings, build_topology())
    pg_pids = [
        r[0] for r in await pool.fetch("SELECT pid FROM pg_stat_activity WHERE datname = current_database()")
    ]
    cpu_before = cpu_seconds([os.getpid()]) + cpu_seconds(pg_pids)
    started = time.perf_counter()
    task = asyncio.create_task(consumer.run())
    polls = 0
    while (filed := await pool.fetchval("SELECT count(*) FROM window_messages")) < len(messages):
        polls += 1
        if time.perf_counter() - started > 600:
            raise RuntimeError(f"only {filed} of {len(messages)} messages filed in 600 s")
        await asyncio.sleep(0.05)
    elapsed = time.perf_counter() - started
    pg_pids = [
        r[0] for r in await pool.fetch("SELECT pid FROM pg_stat_activity WHERE datname = current_database()")
    ]
    cpu = cpu_seconds([os.getpid()]) + cpu_seconds(pg_pids) - cpu_before
    await consumer.stop(drain_seconds=10)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    windows = await pool.fetchval("SELECT count(*) FROM chat_windows WHERE status = 'open'")
    await pool.close()
    await broker.close()
    # The bench's own polls and the two statements around them are transactions too.
    filing_commits = await commits(db_url) - before - polls - 4
    acks = ACK_MESSAGES.labels(queue=COALESCER_QUEUE)
    return {
        "batch_messages": settings.coalescer_file_batch_messages,
        "prefetch": settings.coalescer_prefetch,
        "messages_per_ack": acked_messages(acks),
        "messages": len(messages),
        "chats": args.file_chats,
        "windows": windows,
        "seconds": round(elapsed, 3),
        "messages_per_s": len(messages) / elapsed,
        "commits": filing_commits,
        "messages_per_commit": len(messages) / max(filing_commits, 1),
        "cpu_ms_per_message": cpu * 1000 / len(messages),
    }


async def measure(args: argparse.Namespace, db_url: str, amqp_url: str) -> dict[str, object]:
    pool = await create_pool(db_url, size=4)
    async with pool.acquire() as conn:
        started = time.perf_counter()
        await conn.execute(SEED.replace("$1", str(args.open)))
        seed_seconds = time.perf_counter() - started
        plan = await conn.fetchval(
            "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) "
            + _CLAIM_DUE.replace("clock_timestamp()", "now() + interval '3 hours'"),
            args.batch,
            0,  # no fair share
            0,
        )
        plan_text = "\n".join(
            r[0]
            for r in await conn.fetch(
                "EXPLAIN (ANALYZE, BUFFERS) "
                + _CLAIM_DUE.replace("clock_timestamp()", "now() + interval '3 hours'"),
                args.batch,
                0,
                0,
            )
        )
        await conn.execute(MAKE_DUE, args.due, args.spread)
    broker = BrokerConnection(amqp_url, build_topology(), name="bench-coalescer-relay")
    relay = Relay(pool, ConfirmingPublisher(broker), [JOBS_EXCHANGE], poll_seconds=0.2)
    coalescer = Coalescer(pool, WindowPolicy(0, 0, 0, 0), on_jobs_emitted=relay.notify)
    relay_task = asyncio.create_task(relay.run())
    scheduler = asyncio.create_task(coalescer.run_scheduler(poll_seconds=0.5, batch=args.batch))
    deadline = time.monotonic() + args.spread + 60
    while time.monotonic() < deadline:
        if await pool.fetchval("SELECT count(*) FROM chat_windows WHERE status = 'closed'") >= args.due:
            break
        await asyncio.sleep(0.5)
    coalescer.stop()
    await scheduler
    while await pool.fetchval("SELECT count(*) FROM outbox WHERE published_at IS NULL"):  # noqa: ASYNC110
        await asyncio.sleep(0.2)
    relay.stop()
    await relay_task
    lags = [
        r[0]
        for r in await pool.fetch(
            "SELECT extract(epoch FROM closed_at - due_at)::float8 FROM chat_windows WHERE status = 'closed'"
        )
    ]
    publish = [
        r[0]
        for r in await pool.fetch(
            """
            SELECT extract(epoch FROM o.published_at - w.due_at)::float8
            FROM outbox o JOIN reply_jobs j ON j.id::text = o.message_id JOIN chat_windows w ON w.id = j.window_id
            """
        )
    ]
    await broker.close()
    await pool.close()
    lags.sort()
    publish.sort()

    def pct(xs: list[float], p: float) -> float:
        return xs[min(len(xs) - 1, int(p * len(xs)))] if xs else float("nan")

    root = plan[0] if isinstance(plan, list) else json.loads(plan)[0]
    return {
        "open_windows": args.open,
        "due_windows": args.due,
        "spread_seconds": args.spread,
        "seed_seconds": round(seed_seconds, 1),
        "emitted": len(lags),
        "lag_p50_ms": pct(lags, 0.5) * 1000,
        "lag_p99_ms": pct(lags, 0.99) * 1000,
        "lag_max_ms": (lags[-1] if lags else float("nan")) * 1000,
        "lag_mean_ms": statistics.fmean(lags) * 1000 if lags else float("nan"),
        "due_to_published_p50_ms": pct(publish, 0.5) * 1000,
        "due_to_published_p99_ms": pct(publish, 0.99) * 1000,
        "claim_plan_total_cost": root["Plan"]["Total Cost"],
        "claim_execution_ms": root["Execution Time"],
        "claim_plan": plan_text,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--open", type=int, default=100_000)
    parser.add_argument("--due", type=int, default=10_000)
    parser.add_argument("--spread", type=float, default=10.0)
    parser.add_argument("--batch", type=int, default=200)
    parser.add_argument("--file-messages", type=int, default=20_000, help="0: no filing phase")
    parser.add_argument("--file-chats", type=int, default=5_000)
    parser.add_argument(
        "--file-batch",
        type=int,
        help="CHATQ_COALESCER_FILE_BATCH_MESSAGES (default: the setting's; 1: one each)",
    )
    add_infra_arguments(parser)
    args = parser.parse_args()
    r = asyncio.run(run(args))
    if "filing" in r:
        f = r["filing"]
        print(
            f"coalescer filing: {f['messages']} messages of {f['chats']} chats in {f['seconds']:.1f} s: "
            f"{f['messages_per_s']:.0f} msg/s, {f['messages_per_commit']:.1f} messages per commit, "
            f"{f['messages_per_ack']:.1f} per ack (batches of up to {f['batch_messages']}, prefetch {f['prefetch']}), "
            f"{f['cpu_ms_per_message']:.2f} ms CPU per message (this process + Postgres)"
        )
    print(
        f"coalescer: {r['open_windows']} open windows, {r['due_windows']} falling due over {r['spread_seconds']}s"
    )
    print(
        f"  emission lag behind due: p50 {r['lag_p50_ms']:.1f} ms, p99 {r['lag_p99_ms']:.1f} ms, "
        f"max {r['lag_max_ms']:.1f} ms ({r['emitted']} emitted)"
    )
    print(
        f"  due to job confirmed by RabbitMQ: p50 {r['due_to_published_p50_ms']:.1f} ms, "
        f"p99 {r['due_to_published_p99_ms']:.1f} ms"
    )
    print(
        f"  claim query (LIMIT {args.batch}) with {r['open_windows']} open windows, all of them due: "
        f"cost {r['claim_plan_total_cost']:.0f}, {r['claim_execution_ms']:.2f} ms"
    )
    print("  " + r["claim_plan"].replace("\n", "\n  "))
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"coalescer-{r['open_windows']}.json").write_text(json.dumps(r, indent=2))


if __name__ == "__main__":
    main()
