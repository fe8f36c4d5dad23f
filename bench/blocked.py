"""The scheduler when many chats wait behind a reply in flight: 10,000 chats each with a
job pending and a next window already due (what a burst with a slow model, or a
responder outage, looks like).

Usage: python -m bench.blocked [--chats 10000] [--seconds 20] [--rate 30]

Measured in one run, on one seeded database, for two ways of finding due windows:
- **before** (the scheduler of 3eb3d69): the claim and the next-due query scan open
  windows by due time and drop, per window, those whose chat has a job in flight (an
  anti-join on reply_jobs), every poll (0.5 s) even when idle;
- **after**: windows carry ``blocked`` (set at filing, cleared by a trigger when the
  chat's job ends), and both queries read only ready windows from a partial index.
For each: the claim's and the next-due query's execution time (median of 20 runs), and
the CPU the scheduler costs (this process plus Postgres' backends, from /proc) for
``--seconds`` idle, then for ``--seconds`` while messages of new chats (windows due 20 s
later) are filed at ``--rate`` per second: before, every filed message woke the
scheduler; after, only one due before its next look does.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path

import asyncpg

from bench.support import RESULTS, add_infra_arguments, drop_database, fresh_database
from services.coalescer.service import Coalescer
from shared.db import create_pool
from shared.messages import InboundMessage
from stores.windows.postgres import _CLAIM_DUE, _NEXT_DUE
from stores.windows.window import WindowPolicy

SEED = """
INSERT INTO operations (id, platform, account_id, chat_id, message_id, author_id, text, sent_at, status,
                        received_at, payload)
SELECT md5('op' || g || k)::uuid, 'telegram', '4242', g::text, k::text, g::text, 'Hello?', now(),
       CASE k WHEN 1 THEN 'replying' ELSE 'waiting' END, now() - interval '1 hour', '{}'
FROM generate_series(1, $1) g, generate_series(1, 2) k;

INSERT INTO chat_windows (id, chat_key, platform, account_id, chat_id, status, first_at, last_at,
                          deadline_at, due_at, delay_seconds, message_count, closed_at, job_id)
SELECT md5('w1' || g)::uuid, 'telegram:4242:' || g, 'telegram', '4242', g::text, 'closed', now(), now(),
       now(), now(), 0, 1, now(), md5('j' || g)::uuid
FROM generate_series(1, $1) g;

INSERT INTO reply_jobs (id, window_id, chat_key, platform, account_id, chat_id, status, operation_ids)
SELECT md5('j' || g)::uuid, md5('w1' || g)::uuid, 'telegram:4242:' || g, 'telegram', '4242', g::text, 'pending',
       ARRAY[md5('op' || g || 1)::uuid]
FROM generate_series(1, $1) g;

-- The next window of every chat, due already, blocked by the job in flight.
INSERT INTO chat_windows (id, chat_key, platform, account_id, chat_id, status, first_at, last_at,
                          deadline_at, due_at, delay_seconds, message_count, blocked)
SELECT md5('w2' || g)::uuid, 'telegram:4242:' || g, 'telegram', '4242', g::text, 'open',
       now() - interval '10 minutes', now() - interval '10 minutes', now(), now() - interval '1 minute', 0, 1, true
FROM generate_series(1, $1) g;

INSERT INTO window_messages (operation_id, window_id)
SELECT md5('op' || g || 2)::uuid, md5('w2' || g)::uuid FROM generate_series(1, $1) g;

-- What the claim scanned before: open windows by due time.
CREATE INDEX bench_chat_windows_due ON chat_windows (due_at) WHERE status = 'open';
ANALYZE;
"""

# The scheduler's two queries as of 3eb3d69.
BEFORE_CLAIM = """
SELECT w.id, w.chat_key, w.platform, w.account_id, w.chat_id, w.due_at
FROM chat_windows w
WHERE w.status = 'open'
  AND w.due_at <= clock_timestamp()
  AND NOT EXISTS (
      SELECT 1 FROM reply_jobs j
      WHERE j.chat_key = w.chat_key AND j.status IN ('pending', 'processing'))
ORDER BY w.due_at
LIMIT $1
FOR UPDATE OF w SKIP LOCKED
"""
BEFORE_NEXT_DUE = """
SELECT extract(epoch FROM w.due_at - clock_timestamp())::float8
FROM chat_windows w
WHERE w.status = 'open'
  AND NOT EXISTS (
      SELECT 1 FROM reply_jobs j
      WHERE j.chat_key = w.chat_key AND j.status IN ('pending', 'processing'))
ORDER BY w.due_at
LIMIT 1
"""


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU of these processes so far (clock ticks from /proc)."""
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


async def query_ms(conn: asyncpg.Connection, sql: str, *args: object, runs: int = 20) -> float:
    times = []
    for _ in range(runs):
        async with conn.transaction():  # the claim locks what it returns until the end
            started = time.perf_counter()
            await conn.fetch(sql, *args)
            times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


async def idle_cpu(pool: asyncpg.Pool, seconds: float, step: object) -> float:
    """CPU per second of wall time spent by this process and Postgres while ``step`` runs."""
    pg_pids = [
        r["pid"]
        for r in await pool.fetch("SELECT pid FROM pg_stat_activity WHERE datname = current_database()")
    ]
    me = [os.getpid()]
    before = cpu_seconds(me) + cpu_seconds(pg_pids)
    started = time.monotonic()
    await step  # type: ignore[misc]
    wall = time.monotonic() - started
    return (cpu_seconds(me) + cpu_seconds(pg_pids) - before) / wall


async def before_scheduler(pool: asyncpg.Pool, seconds: float, poll: float = 0.5, batch: int = 200) -> None:
    """The old scheduler's idle loop: the claim (nothing emittable) and the next-due query
    every poll."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        async with pool.acquire() as conn, conn.transaction():
            await conn.execute("SET LOCAL plan_cache_mode = force_custom_plan")
            await conn.fetch(BEFORE_CLAIM, batch)
        async with pool.acquire() as conn, conn.transaction():
            await conn.execute("SET LOCAL plan_cache_mode = force_custom_plan")
            wait = await conn.fetchval(BEFORE_NEXT_DUE)
        await asyncio.sleep(poll if wait is None else min(max(wait, 0.0), poll))


async def after_scheduler(pool: asyncpg.Pool, seconds: float, rate: float = 0, start: int = 0) -> None:
    coalescer = Coalescer(pool, WindowPolicy(quiet=8, delay_min=20, delay_max=20, max_wait=120))
    task = asyncio.create_task(coalescer.run_scheduler(poll_seconds=0.5))
    await file_messages(pool, coalescer, seconds, rate, start)
    coalescer.stop()
    await task


async def before_with_wakes(pool: asyncpg.Pool, seconds: float, rate: float, start: int) -> None:
    """The old scheduler under load: every filed message woke it for a claim and a next-due."""
    coalescer = Coalescer(pool, WindowPolicy(quiet=8, delay_min=20, delay_max=20, max_wait=120))
    wake = asyncio.Event()
    stop = asyncio.Event()

    async def scheduler() -> None:
        while not stop.is_set():
            wake.clear()
            async with pool.acquire() as conn, conn.transaction():
                await conn.execute("SET LOCAL plan_cache_mode = force_custom_plan")
                await conn.fetch(BEFORE_CLAIM, 200)
            async with pool.acquire() as conn, conn.transaction():
                await conn.execute("SET LOCAL plan_cache_mode = force_custom_plan")
                wait = await conn.fetchval(BEFORE_NEXT_DUE)
            timeout = 0.5 if wait is None else min(max(wait, 0.0), 0.5)
            try:
                await asyncio.wait_for(wake.wait(), timeout=timeout)
            except TimeoutError:
                pass

    task = asyncio.create_task(scheduler())
    await file_messages(pool, coalescer, seconds, rate, start, on_filed=wake.set)
    stop.set()
    wake.set()
    await task


async def file_messages(
    pool: asyncpg.Pool, coalescer: Coalescer, seconds: float, rate: float, start: int, on_filed: object = None
) -> None:
    """File one message of a new chat every 1/rate s (windows due 20 s later); or just wait."""
    if rate <= 0:
        await asyncio.sleep(seconds)
        return
    n = 0
    started = time.monotonic()
    while (elapsed := time.monotonic() - started) < seconds:
        while n < elapsed * rate:
            n += 1
            op = uuid.uuid4()
            now = datetime.now(UTC)
            chat = f"load-{start + n}"
            await pool.execute(
                """
                INSERT INTO operations (id, platform, account_id, chat_id, message_id, text, sent_at, status,
                                        received_at, payload)
                VALUES ($1, 'telegram', '4242', $2, '1', 'Hello?', $3, 'queued', $3, '{}')
                """,
                op,
                chat,
                now,
            )
            await coalescer.file(
                InboundMessage(
                    operation_id=op, platform="telegram", account_id="4242", chat_id=chat, message_id="1",
                    author_id=None, text="Hello?", sent_at=now, received_at=now,
                )
            )  # fmt: skip
            if on_filed is not None:
                on_filed()  # type: ignore[operator]
        await asyncio.sleep(0.01)


async def run(args: argparse.Namespace) -> dict[str, object]:
    name, db_url = await fresh_database(args.admin_database_url)
    try:
        pool = await create_pool(db_url, size=4)
        try:
            await pool.execute(SEED.replace("$1", str(args.chats)))
            async with pool.acquire() as conn:
                result = {
                    "chats": args.chats,
                    "before_claim_ms": await query_ms(conn, BEFORE_CLAIM, 200),
                    "before_next_due_ms": await query_ms(conn, BEFORE_NEXT_DUE),
                    "after_claim_ms": await query_ms(conn, _CLAIM_DUE, 200, 0, 0),
                    "after_next_due_ms": await query_ms(conn, _NEXT_DUE),
                }
            result["before_cpu_share"] = await idle_cpu(
                pool, args.seconds, before_scheduler(pool, args.seconds)
            )
            result["after_cpu_share"] = await idle_cpu(
                pool, args.seconds, after_scheduler(pool, args.seconds)
            )
            result["rate"] = args.rate
            result["before_loaded_cpu_share"] = await idle_cpu(
                pool, args.seconds, before_with_wakes(pool, args.seconds, args.rate, 0)
            )
            result["after_loaded_cpu_share"] = await idle_cpu(
                pool, args.seconds, after_scheduler(pool, args.seconds, args.rate, 1_000_000)
            )
            # The seeded chats' next windows stayed behind their jobs (the load's new chats
            # may have had theirs emitted).
            emitted = await pool.fetchval("SELECT count(*) FROM reply_jobs WHERE chat_id NOT LIKE 'load-%'")
            result["blocked_windows_emitted"] = emitted - args.chats  # must stay 0
            return result
        finally:
            await pool.close()
    finally:
        await drop_database(args.admin_database_url, name)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--chats", type=int, default=10_000)
    parser.add_argument("--seconds", type=float, default=20)
    parser.add_argument("--rate", type=float, default=30)
    add_infra_arguments(parser)
    args = parser.parse_args()
    r = asyncio.run(run(args))
    print(
        f"scheduler with {r['chats']} chats each blocked by a job in flight, a due window waiting behind it"
    )
    print(
        f"  claim query:    before {r['before_claim_ms']:.2f} ms, after {r['after_claim_ms']:.3f} ms (median of 20)"
    )
    print(f"  next-due query: before {r['before_next_due_ms']:.2f} ms, after {r['after_next_due_ms']:.3f} ms")
    print(
        f"  idle scheduler CPU (process + Postgres): before {r['before_cpu_share'] * 100:.1f} % of a core, "
        f"after {r['after_cpu_share'] * 100:.1f} %"
    )
    print(
        f"  scheduler CPU while filing {r['rate']:g} msg/s of new chats: before {r['before_loaded_cpu_share'] * 100:.1f} % "
        f"of a core, after {r['after_loaded_cpu_share'] * 100:.1f} % (filing included in both)"
    )
    print(f"  blocked windows emitted: {r['blocked_windows_emitted']} (must be 0)")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "blocked.json").write_text(json.dumps(r, indent=2))


if __name__ == "__main__":
    main()
