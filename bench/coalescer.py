"""Coalescer benchmark: the claim query's plan with many open windows, and how late
windows are emitted after their due time.

Usage: python -m bench.coalescer [--open 100000] [--due 10000] [--spread 10]

Open windows are written straight into a fresh database (``--open`` of them, ``--due`` of
those falling due evenly over the next ``--spread`` seconds, the rest hours away); then
the real scheduler (``Coalescer.run_scheduler``, its relay publishing the jobs to a
private vhost) runs until every due window is emitted. Lag = closed_at - due_at, both
from Postgres' clock.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

from bench.support import RESULTS, add_infra_arguments, drop_database, fresh_database, private_vhost
from services.coalescer.service import Coalescer
from services.coalescer.stores import _CLAIM_DUE
from services.coalescer.windows import WindowPolicy
from shared.broker.connection import BrokerConnection
from shared.broker.publisher import ConfirmingPublisher
from shared.broker.topology import JOBS_EXCHANGE, build_topology
from shared.db import create_pool
from shared.outbox import Relay

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
    name, db_url = await fresh_database(args.admin_database_url)
    try:
        async with private_vhost(args.amqp_url, args.rabbitmq_api_url) as amqp_url:
            return await measure(args, db_url, amqp_url)
    finally:
        await drop_database(args.admin_database_url, name)


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
        )
        plan_text = "\n".join(
            r[0]
            for r in await conn.fetch(
                "EXPLAIN (ANALYZE, BUFFERS) "
                + _CLAIM_DUE.replace("clock_timestamp()", "now() + interval '3 hours'"),
                args.batch,
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
    add_infra_arguments(parser)
    args = parser.parse_args()
    r = asyncio.run(run(args))
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
