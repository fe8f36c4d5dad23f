"""``make soak``: steady load for minutes, memory of every process and the size of every
table sampled; reports whether anything grew without bound and whether the backlog stayed
flat. Not in CI.

Usage: python -m chaos.soak [--minutes 5] [--rate N] [--retention-seconds 60]
--rate defaults to half the receiver's intake limit measured by the last
``python -m bench.intake`` (bench/results/intake.json), else 200 messages/s.
--retention-seconds is how long finished rows (and published outbox rows) are kept, so
that a run of minutes shows the tables reaching a plateau instead of growing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import asyncpg
import httpx

from bench.support import drop_database, fresh_database, private_vhost
from chaos.runner import AVITO_SECRET, GENERIC_SECRET, TG_SECRET, Cluster
from shared.settings import Settings
from tests.fakes.platforms import running_fakes
from tests.support.payloads import telegram_update
from tests.support.processes import free_port

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results"
#: Tables that hold one or more rows per message: they must plateau under retention.
TABLES = (
    "operations",
    "outbox",
    "chat_windows",
    "window_messages",
    "reply_jobs",
    "reply_coverage",
    "deliveries",
)


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def slope_per_minute(samples: list[tuple[float, float]]) -> float:
    if len(samples) < 3:
        return 0.0
    xs = [t / 60 for t, _ in samples]
    ys = [v for _, v in samples]
    return statistics.linear_regression(xs, ys).slope


async def main(args: argparse.Namespace) -> int:
    rate = args.rate
    if rate is None:
        intake = RESULTS / "intake.json"
        rate = json.loads(intake.read_text())["receiver_rps_median"] / 2 if intake.exists() else 200.0
    name, db_url = await fresh_database(args.admin_database_url)
    try:
        async with private_vhost(args.amqp_url, args.rabbitmq_api_url) as amqp_url, running_fakes() as world:
            settings = Settings(
                database_url=db_url,
                amqp_url=amqp_url,
                telegram_webhook_secret=TG_SECRET,
                telegram_bot_token="4242:soak",
                telegram_api_base=world.url,
                avito_webhook_secret=AVITO_SECRET,
                generic_webhook_secret=GENERIC_SECRET,
                quiet_seconds=0.5,
                reply_delay_min_seconds=0.5,
                reply_delay_max_seconds=1.0,
                max_wait_seconds=3,
                coalescer_poll_seconds=0.2,
                relay_poll_seconds=0.2,
                responder_concurrency=16,
                log_level="WARNING",
                platform_rate_per_second=1000,  # the fake has no limit; pacing is not under test
                retention_days=args.retention_seconds / 86400,
                retention_interval_seconds=max(1.0, args.retention_seconds / 6),
                relay_retention_seconds=args.retention_seconds,
                relay_purge_interval_seconds=max(1.0, args.retention_seconds / 6),
            )
            cluster = Cluster(settings, [free_port()])
            await cluster.start_all()
            pool = await asyncpg.create_pool(db_url, min_size=1, max_size=2)
            memory: dict[str, list[tuple[float, float]]] = {n: [] for n in cluster.procs}
            backlog: list[tuple[float, int]] = []
            sizes: dict[str, list[tuple[float, float]]] = {t: [] for t in TABLES}
            sent = acked = 0
            started = time.monotonic()
            duration = args.minutes * 60

            async def sampler() -> None:
                while time.monotonic() - started < duration:
                    t = time.monotonic() - started
                    for n, p in cluster.procs.items():
                        assert p.proc is not None
                        memory[n].append((t, rss_mb(p.proc.pid)))
                    backlog.append(
                        (
                            t,
                            await pool.fetchval(
                                "SELECT count(*) FROM operations WHERE status NOT IN ('replied','failed','needs_review','ignored')"
                            ),
                        )
                    )
                    for table in TABLES:
                        sizes[table].append((t, float(await pool.fetchval(f"SELECT count(*) FROM {table}"))))
                    await asyncio.sleep(5)

            async def post(client: httpx.AsyncClient, n: int) -> None:
                nonlocal acked
                # Round robin over 2000 chats: a chat's messages are far apart, so the
                # generator's own queueing cannot deliver them out of order.
                chat = n % 2000
                try:
                    r = await client.post(
                        "/v1/webhooks/telegram",
                        json=telegram_update(n, chat_id=chat, text="Still available?"),
                        headers={"X-Telegram-Bot-Api-Secret-Token": TG_SECRET},
                    )
                    acked += r.is_success
                except httpx.HTTPError:
                    pass

            sampling = asyncio.create_task(sampler())
            async with httpx.AsyncClient(
                base_url=f"http://127.0.0.1:{cluster.receiver_port}",
                timeout=10,
                limits=httpx.Limits(max_connections=64),
            ) as client:
                inflight: set[asyncio.Task[None]] = set()
                while (elapsed := time.monotonic() - started) < duration:
                    due = int(elapsed * rate)
                    # Bound the generator's own queue (httpx slows down with many waiting
                    # requests): if it falls behind, the shortfall shows as sent < rate x time.
                    while sent < due and len(inflight) < 256:
                        sent += 1
                        task = asyncio.create_task(post(client, sent))
                        inflight.add(task)
                        task.add_done_callback(inflight.discard)
                    await asyncio.sleep(0.01)
                await asyncio.gather(*inflight)
            await sampling
            states = {
                r["status"]: r["n"]
                for r in await pool.fetch("SELECT status, count(*) AS n FROM operations GROUP BY 1")
            }
            await pool.close()
            await cluster.stop_all()
    finally:
        await drop_database(args.admin_database_url, name)
    warm = 60.0 if duration > 180 else duration / 3
    report: dict[str, object] = {
        "minutes": args.minutes,
        "rate": rate,
        "sent": sent,
        "acked": acked,
        "processes": {},
    }
    ok = True
    print(f"soak: {args.minutes} min at {rate:.0f} messages/s: {sent} sent, {acked} acknowledged")
    for n, samples in memory.items():
        after = [(t, v) for t, v in samples if t >= warm]
        growth = slope_per_minute(after)
        first, last, peak = after[0][1], after[-1][1], max(v for _, v in samples)
        grew = growth > 2.0 and last > first * 1.2
        ok &= not grew
        report["processes"][n] = {
            "rss_after_warmup_mb": first,
            "rss_end_mb": last,
            "rss_peak_mb": peak,  # type: ignore[index]
            "slope_mb_per_min": growth,
        }
        print(
            f"  {n:10s} RSS {first:6.1f} MB after warm-up -> {last:6.1f} MB at the end (peak {peak:.1f}), "
            f"trend {growth:+.2f} MB/min {'GROWING' if grew else 'flat'}"
        )
    levels = [v for t, v in backlog if t >= warm]
    # Flat: after warm-up the backlog trends up by less than 5% of a minute's arrivals.
    trend = slope_per_minute([(t, float(v)) for t, v in backlog if t >= warm])
    flat = trend < 0.05 * rate * 60
    ok &= flat
    report["backlog"] = (
        {"min": min(levels), "max": max(levels), "last": levels[-1], "trend_per_min": trend} if levels else {}
    )
    print(
        f"  backlog after warm-up: min {min(levels)}, max {max(levels)}, last {levels[-1]}, trend {trend:+.0f}/min ({'flat' if flat else 'GROWING'})"
    )
    # Tables: once finished rows start leaving (retention + one purge round), a table's
    # row count must stop growing; its trend after that counts like the backlog's.
    settled = min(duration / 2, args.retention_seconds * 1.5 + warm)
    report["tables"] = {}
    for table, samples in sizes.items():
        tail = [(t, v) for t, v in samples if t >= settled]
        if not tail:
            continue
        trend = slope_per_minute(tail)
        bounded = trend < 0.05 * rate * 60
        ok &= bounded
        start = next((v for t, v in samples if t >= warm), samples[0][1])
        report["tables"][table] = {  # type: ignore[index]
            "rows_after_warmup": start,
            "rows_end": tail[-1][1],
            "rows_peak": max(v for _, v in samples),
            "trend_per_min_after_retention": trend,
        }
        print(
            f"  {table:16s} rows {start:8.0f} after warm-up -> {tail[-1][1]:8.0f} at the end "
            f"(peak {max(v for _, v in samples):.0f}), trend {trend:+.0f}/min {'bounded' if bounded else 'GROWING'}"
        )
    print(f"  operations by state at the end: {states}")
    report["states"] = states
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "soak.json").write_text(json.dumps(report, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=5)
    p.add_argument("--rate", type=float)
    p.add_argument(
        "--retention-seconds",
        type=float,
        default=60,
        help="how long finished rows are kept (the product: 30 days)",
    )
    p.add_argument("--admin-database-url", default="postgresql://postgres@127.0.0.1:5432/postgres")
    p.add_argument("--amqp-url", default="amqp://guest:guest@127.0.0.1:5672/")
    p.add_argument("--rabbitmq-api-url", default="http://guest:guest@127.0.0.1:15672/api")
    sys.exit(asyncio.run(main(p.parse_args())))
