"""Relay benchmark: rows/s from a pre-filled outbox, next to a raw aio-pika publisher with
the same confirm window (the relay's batch: ``RELAY_BATCH_SIZE`` messages with confirms in
flight together), alternating rounds in one run; then the outbox-to-broker lag while rows
arrive at a steady 1,000/s (each insert batch wakes the relay, as the receiver's commit
does). Fresh database and private vhost; the rows go to chatq.inbound -> chatq.coalescer.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

import aio_pika
import asyncpg

from bench.support import add_infra_arguments, bench_main, drop_database, fresh_database, private_vhost
from shared.broker.connection import BrokerConnection
from shared.broker.topology import COALESCER_QUEUE, INBOUND_EXCHANGE, build_topology
from shared.db import create_pool
from shared.outbox import Relay
from shared.settings import Settings

BODY = (
    b'{"schema":"chatq.inbound.v1","operation_id":"00000000-0000-0000-0000-000000000000","platform":"telegram",'
    b'"account_id":"4242","chat_id":"123456","message_id":"987654","author_id":"123456",'
    b'"text":"Hello! Is the bike still available, and do you deliver to Kazan?",'
    b'"sent_at":"2026-11-29T07:00:00Z","received_at":"2026-11-29T07:00:00Z"}'
)
# Each row in a chat of its own, as a flood of buyers is: the relay publishes a chat's
# rows in order, one a claim, so rows of one chat queue behind each other (the steady
# phase once named its 10 rows a batch after 10 chats, each sent 100 messages a second:
# a claim took 10 rows, and the lag swung from 9 ms to 38 s with the machine's speed).
FILL_SQL = """
INSERT INTO outbox (exchange, routing_key, message_id, ordering_key, body)
SELECT 'chatq.inbound', 'inbound.telegram', 'bench-' || $2 || '-' || g, 'telegram:4242:' || $2 || '-' || g, $1
FROM generate_series(1, $3) g
"""


async def purge(amqp_url: str) -> None:
    connection = await aio_pika.connect(amqp_url)
    async with connection:
        channel = await connection.channel()
        queue = await channel.get_queue(COALESCER_QUEUE)
        await queue.purge()


async def relay_round(
    pool: asyncpg.Pool, broker: BrokerConnection, settings: Settings, rows: int, tag: str
) -> float:
    await pool.execute(FILL_SQL, BODY, tag, rows)
    relay = Relay.from_settings(pool, broker, settings, [INBOUND_EXCHANGE])
    started = time.perf_counter()
    published = 0
    while published < rows:
        published += await relay.run_once()
    return rows / (time.perf_counter() - started)


async def raw_round(amqp_url: str, rows: int, window: int) -> float:
    connection = await aio_pika.connect(amqp_url)
    async with connection:
        channel = await connection.channel(publisher_confirms=True)
        exchange = await channel.get_exchange(INBOUND_EXCHANGE)
        started = time.perf_counter()
        for start in range(0, rows, window):
            await asyncio.gather(
                *(
                    exchange.publish(
                        aio_pika.Message(
                            BODY, message_id=f"raw-{i}", delivery_mode=aio_pika.DeliveryMode.PERSISTENT
                        ),
                        routing_key="inbound.telegram",
                        mandatory=True,
                    )
                    for i in range(start, min(start + window, rows))
                )
            )
        return rows / (time.perf_counter() - started)


async def steady_lag(
    pool: asyncpg.Pool, broker: BrokerConnection, settings: Settings, rate: int, seconds: float
) -> dict[str, float]:
    relay = Relay.from_settings(pool, broker, settings, [INBOUND_EXCHANGE])
    task = asyncio.create_task(relay.run())
    since = await pool.fetchval("SELECT clock_timestamp()")
    batch = max(rate // 100, 1)  # every 10 ms
    started = time.perf_counter()
    sent = 0
    try:
        while time.perf_counter() - started < seconds:
            target = int((time.perf_counter() - started) * rate)
            if sent < target:
                n = min(batch, target - sent)
                await pool.execute(FILL_SQL, BODY, f"steady-{sent}", n)
                relay.notify()
                sent += n
            await asyncio.sleep(0.005)
        deadline = time.perf_counter() + 30
        while time.perf_counter() < deadline:  # until the relay has published everything
            if not await pool.fetchval("SELECT count(*) FROM outbox WHERE published_at IS NULL"):
                break
            await asyncio.sleep(0.1)
    finally:
        relay.stop()
        await asyncio.wait_for(task, 10)
    lags = [
        r["lag"]
        for r in await pool.fetch(
            "SELECT extract(epoch FROM published_at - created_at)::float8 * 1000 AS lag FROM outbox WHERE created_at >= $1 AND published_at IS NOT NULL",
            since,
        )
    ]
    lags.sort()
    return {
        "rows": sent,
        "achieved_rate": sent / seconds,
        "published": len(lags),
        "lag_p50_ms": lags[len(lags) // 2],
        "lag_p99_ms": lags[int(len(lags) * 0.99) - 1],
        "lag_max_ms": lags[-1],
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    name, db_url = await fresh_database(args.admin_database_url)
    try:
        async with private_vhost(args.amqp_url, args.rabbitmq_api_url) as amqp_url:
            settings = Settings(database_url=db_url, amqp_url=amqp_url, log_level="WARNING")
            pool = await create_pool(db_url, size=4)
            broker = BrokerConnection(amqp_url, build_topology(), name="bench-relay")
            try:
                await broker.connect()
                rounds = []
                await raw_round(amqp_url, 1000, settings.relay_batch_size)  # warm-up
                for i in range(args.rounds):
                    await purge(amqp_url)
                    relay = await relay_round(pool, broker, settings, args.rows, f"r{i}")
                    await purge(amqp_url)
                    raw = await raw_round(amqp_url, args.rows, settings.relay_batch_size)
                    rounds.append({"relay_rows_per_s": relay, "raw_msgs_per_s": raw, "ratio": relay / raw})
                    print(
                        f"  round {i + 1}: relay {relay:.0f} rows/s, raw aio-pika {raw:.0f} msg/s, ratio {relay / raw:.2f}",
                        flush=True,
                    )
                await purge(amqp_url)
                lag = await steady_lag(pool, broker, settings, args.rate, args.lag_seconds)
                print(
                    f"  steady {args.rate}/s for {args.lag_seconds:.0f}s: lag p50 {lag['lag_p50_ms']:.1f} ms, p99 {lag['lag_p99_ms']:.1f} ms",
                    flush=True,
                )
            finally:
                await broker.close()
                await pool.close()
    finally:
        await drop_database(args.admin_database_url, name)
    return {
        "rows": args.rows,
        "window": settings.relay_batch_size,
        "rounds": rounds,
        "relay_rows_per_s_median": statistics.median(r["relay_rows_per_s"] for r in rounds),
        "raw_msgs_per_s_median": statistics.median(r["raw_msgs_per_s"] for r in rounds),
        "ratio_median": statistics.median(r["ratio"] for r in rounds),
        "steady": lag,
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rows", type=int, default=20000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--rate", type=int, default=1000)
    p.add_argument("--lag-seconds", type=float, default=15)
    add_infra_arguments(p)


def main() -> None:
    bench_main(__doc__, add_arguments, run, "relay.json")


if __name__ == "__main__":
    main()
