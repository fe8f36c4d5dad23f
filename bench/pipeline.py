"""End-to-end benchmark: webhook -> reply at the fake platform, for chatqueue, for what
a seller would build instead (bench/peers.py: Celery with acks_late, a Postgres polling
table) and for the floor of chatqueue's design (bench/floor.py: its path and nothing
else), on the same machine in the same run, each on a fresh database and vhost.

For each system: wrk posts Telegram updates (one chat per message, so every system sends
exactly one reply per message) for ``--seconds`` at ``--connections``; then we wait until
every accepted message has its reply. Each system first runs the same load for
``--warmup-seconds`` on its fresh database, and its tables are analyzed, as autovacuum
would have done in the first minute of a real deployment: the measured load runs in the
steady state, on plans made for tables of the size it meets, not on the plans a database
made while its tables were empty (``--warmup-seconds 0`` measures that cold start; the
warm-up's own figures are reported as ``cold``). Sustained throughput = replies / (time of the last
reply - start of the load). chatqueue also runs a paced load at half its sustained rate
to read receipt-to-reply p50/p99 from Postgres, and reports each process's peak RSS.
Instant fakes: no debounce or human-like delay, the facts responder (no model call), a
platform that answers at once; every system makes one platform call per message.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import asyncpg
import httpx

from bench import floor
from bench.intake import ROOT, SECRET, lua_file, telegram_script, wrk
from bench.peers import POLLING_SCHEMA
from bench.support import (
    add_infra_arguments,
    add_setting_argument,
    bench_main,
    drop_database,
    fresh_database,
    private_vhost,
)
from shared.settings import Settings
from tests.fakes.platforms import running_fakes
from tests.fakes.world import FakeWorld
from tests.support.processes import Receiver, Worker, free_port

# One chat per message, so every system sends exactly one reply per message.
WRK_SCRIPT = telegram_script(chat="id", text="Is it still available?")


def cpu_seconds(pids: dict[str, int], database: str | None = None) -> dict[int, tuple[str, float]]:
    """CPU seconds (user + system) used so far by each process that counts, with its part:
    the system's own processes (``pids``, by name), Postgres (the server's own processes and
    the backends connected to ``database``: another session's work on the same server is
    not this system's), RabbitMQ (all its processes) and the harness (this process, which
    serves the fake platform, and wrk)."""
    tick = os.sysconf("SC_CLK_TCK")
    own = {pid: name for name, pid in pids.items()}
    out: dict[int, tuple[str, float]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        comm = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        used = (int(fields[11]) + int(fields[12])) / tick
        pid = int(entry.name)
        if pid in own:
            out[pid] = (own[pid], used)
        elif comm == "postgres":
            # A backend's title names its database and client ("... db 127.0.0.1(5432) ...");
            # the server's own processes (checkpointer, WAL writer, ...) name neither.
            client = "(" in cmdline or "[local]" in cmdline
            if database is None or not client or f" {database} " in cmdline:
                out[pid] = ("postgres", used)
        elif comm.startswith(("beam", "erl_child")):
            out[pid] = ("rabbitmq", used)
        elif pid == os.getpid() or comm == "wrk":
            out[pid] = ("harness", used)
    return out


def cpu_used(
    before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]], pids: dict[str, int]
) -> dict[str, float]:
    """CPU seconds each part used between two readings: per process, so a process that
    exits meanwhile drops out (uncounted) instead of making its part's sum go down, and
    one that started meanwhile counts from zero."""
    out = {"services": 0.0, "postgres": 0.0, "rabbitmq": 0.0, "harness": 0.0}
    out.update({name: 0.0 for name in pids})
    for pid, (part, used) in after.items():
        spent = used - before.get(pid, (part, 0.0))[1]
        if part in pids:
            out["services"] += spent
        out[part] += spent
    return out


def database_of(db_url: str) -> str:
    return urlsplit(db_url).path.lstrip("/")


def peak_rss_mb(pid: int) -> float:
    """VmHWM: the most resident memory the process ever had (NaN if it has exited)."""
    path = Path(f"/proc/{pid}/status")
    if not path.exists():
        return float("nan")
    for line in path.read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def replies_done(world: FakeWorld, target: int, *, started: float, within: float) -> float | None:
    """Time (since ``started``) at which the platform had ``target`` replies, or None."""
    deadline = time.monotonic() + within
    last, last_change = -1, time.monotonic()
    while time.monotonic() < deadline:
        n = len(world.telegram)
        if n >= target:
            return time.monotonic() - started
        if n != last:
            last, last_change = n, time.monotonic()
        elif time.monotonic() - last_change > 30:
            return None  # stuck
        await asyncio.sleep(0.05)
    return None


async def load(
    url: str,
    world: FakeWorld,
    args: argparse.Namespace,
    lua: str,
    connections: int | None = None,
    pids: dict[str, int] | None = None,
    seconds: int | None = None,
    database: str | None = None,
) -> dict[str, Any]:
    before = len(world.telegram)
    cpu_before = cpu_seconds(pids or {}, database)
    started = time.monotonic()
    result = await asyncio.to_thread(
        wrk, url, lua, connections or args.connections, seconds if seconds is not None else args.seconds
    )
    during = len(world.telegram) - before
    accepted = result["requests"] - result["non_2xx"]
    done = await replies_done(world, before + accepted, started=started, within=args.drain_seconds)
    replies = len(world.telegram) - before
    used = cpu_used(cpu_before, cpu_seconds(pids or {}, database), pids or {})
    # CPU per reply, from the start of the load to the last reply: what one message costs
    # the machine in each part (a process that exits meanwhile is not counted).
    cpu_ms = {k: 1000 * v / max(replies, 1) for k, v in used.items()}
    return {
        "accepted": accepted,
        "intake_rps": result["rps"],
        "intake_p99_ms": result["p99_ms"],
        "non_2xx": result["non_2xx"],
        "replies": replies,
        "replies_during_load": during,
        "seconds_to_last_reply": done,
        "throughput": replies / done if done else replies / (time.monotonic() - started),
        "complete": done is not None,
        # The total counts each process once: a service's own figure is part of "services".
        "cpu_ms_per_reply": {**cpu_ms, "total": sum(v for k, v in cpu_ms.items() if k not in (pids or {}))},
    }


async def warm_up(
    url: str, db_url: str, world: FakeWorld, args: argparse.Namespace, pids: dict[str, int]
) -> dict[str, Any] | None:
    """The same load for ``--warmup-seconds``, every reply waited for, then ANALYZE of the
    system's database: what autovacuum does once the tables have grown, and what makes
    Postgres plan again every statement it had cached while they were empty. Returns the
    warm-up's own figures (the cold start), or None with no warm-up."""
    if args.warmup_seconds <= 0:
        return None
    cold = await load(
        url,
        world,
        args,
        lua_file(WRK_SCRIPT),
        pids=pids,
        seconds=args.warmup_seconds,
        database=database_of(db_url),
    )
    conn = await asyncpg.connect(db_url)
    try:
        await conn.execute("ANALYZE")
    finally:
        await conn.close()
    return cold


@contextlib.asynccontextmanager
async def fresh(args: argparse.Namespace) -> AsyncIterator[tuple[str, str]]:
    name, db_url = await fresh_database(args.admin_database_url)
    try:
        async with private_vhost(args.amqp_url, args.rabbitmq_api_url) as amqp_url:
            yield db_url, amqp_url
    finally:
        await drop_database(args.admin_database_url, name)


# ---- chatqueue ---------------------------------------------------------------------------


def fake_platform_settings(db_url: str, amqp_url: str, world: FakeWorld, **overrides: Any) -> Settings:
    """chatqueue on the fake Telegram, every other setting the product's default (the
    reply pause, pacing, polls, concurrency, fair share): what a seller runs."""
    values: dict[str, Any] = {
        "database_url": db_url,
        "amqp_url": amqp_url,
        "telegram_webhook_secret": SECRET,
        "telegram_bot_token": "4242:bench",
        "telegram_api_base": world.url,
        "sandbox_enabled": False,
        "log_level": "WARNING",
    }
    return Settings(**{**values, **overrides})


def instant_settings(db_url: str, amqp_url: str, world: FakeWorld, **overrides: Any) -> Settings:
    """chatqueue on the fake Telegram with no debounce, no human-like delay, no pacing and
    the facts responder, every other setting the product's default: every cost left is
    the pipeline's own."""
    instant: dict[str, Any] = {
        "quiet_seconds": 0,
        "reply_delay_min_seconds": 0,
        "reply_delay_max_seconds": 0,
        "max_wait_seconds": 0,
        "platform_rate_per_second": 100000,
    }
    return fake_platform_settings(db_url, amqp_url, world, **{**instant, **overrides})


#: The variants of chatqueue ``run`` knows, as settings on top of ``instant_settings``:
#: the defaults; the polls shortened (what the benchmark set before a job's end woke the
#: scheduler, issue 43); and the fair share off (the reference for the defaults: a lone
#: account's flood should run at the pipeline's speed).
VARIANTS: dict[str, dict[str, Any]] = {
    "chatqueue": {},
    "chatqueue-tuned": {"coalescer_poll_seconds": 0.05, "relay_poll_seconds": 0.2},
    "chatqueue-noshare": {"account_jobs_in_flight": 0},
}


async def started_services(settings: Settings) -> dict[str, Receiver | Worker]:
    """chatqueue's three services as processes on ``settings``, started."""
    procs: dict[str, Receiver | Worker] = {
        "receiver": Receiver(settings),
        "coalescer": Worker("coalescer", settings),
        "responder": Worker("responder", settings),
    }
    for p in procs.values():
        await p.start()
    return procs


async def row_writes(conn: asyncpg.Connection) -> dict[str, Any]:
    """Where Postgres' share of the CPU goes: each table's row writes (inserted, updated and
    how many of those were HOT, deleted) and its indexes, per reply sent, over the whole
    run. A non-HOT update writes a new entry into every index of its table; the count takes
    every index as written (a partial index whose predicate the row misses is not), so it
    is an upper bound."""
    replies = await conn.fetchval("SELECT count(*) FROM reply_jobs WHERE status = 'sent'") or 1
    rows = await conn.fetch(
        """
        SELECT t.relname AS table, t.n_tup_ins AS ins, t.n_tup_upd AS upd, t.n_tup_hot_upd AS hot,
               t.n_tup_del AS del,
               (SELECT count(*) FROM pg_index i WHERE i.indrelid = t.relid) AS indexes
        FROM pg_stat_user_tables t
        WHERE t.n_tup_ins + t.n_tup_upd + t.n_tup_del > 0
        """
    )
    per = {
        r["table"]: {
            "inserted": r["ins"] / replies,
            "updated": r["upd"] / replies,
            "hot": r["hot"] / replies,
            "deleted": r["del"] / replies,
            "indexes": r["indexes"],
            # Index entries written: one per index for an insert and a non-HOT update (at most).
            "index_entries": (r["ins"] + r["upd"] - r["hot"]) * r["indexes"] / replies,
        }
        for r in rows
    }
    return {
        "per_table": dict(sorted(per.items(), key=lambda kv: -kv[1]["index_entries"])),
        "rows_written": sum(t["inserted"] + t["updated"] + t["deleted"] for t in per.values()),
        "index_entries": sum(t["index_entries"] for t in per.values()),
    }


async def chatqueue(args: argparse.Namespace, world: FakeWorld, variant: str = "chatqueue") -> dict[str, Any]:
    async with fresh(args) as (db_url, amqp_url):
        settings = instant_settings(db_url, amqp_url, world, **{**VARIANTS[variant], **dict(args.setting)})
        procs = await started_services(settings)
        try:
            pids = {name: p.proc.pid for name, p in procs.items() if p.proc}
            cold = await warm_up(procs["receiver"].url, db_url, world, args, pids)
            saturated = await load(
                procs["receiver"].url,
                world,
                args,
                lua_file(WRK_SCRIPT),
                pids=pids,
                database=database_of(db_url),
            )
            conn = await asyncpg.connect(db_url)
            latency: dict[str, Any] = {}
            if variant == "chatqueue":
                # Latency at half the sustained rate (paced: each connection waits between
                # requests); the variants are measured for throughput alone.
                rate = max(saturated["throughput"] / 2, 1)
                paced_conns = 4
                since = await conn.fetchval("SELECT now()")
                paced = await load(
                    procs["receiver"].url,
                    world,
                    args,
                    lua_file(WRK_SCRIPT, paced_conns * 1000 / rate),
                    connections=paced_conns,
                )
                row = await conn.fetchrow(
                    """
                    SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM j.sent_at - o.received_at)) AS p50,
                           percentile_cont(0.99) WITHIN GROUP (ORDER BY extract(epoch FROM j.sent_at - o.received_at)) AS p99,
                           count(*) AS n
                    FROM operations o JOIN reply_jobs j ON j.id = o.job_id
                    WHERE o.received_at >= $1 AND j.status = 'sent'
                    """,
                    since,
                )
                latency = {
                    "paced_target_rps": rate,
                    "paced_intake_rps": paced["intake_rps"],
                    "paced_receipt_to_reply_p50_s": row["p50"],
                    "paced_receipt_to_reply_p99_s": row["p99"],
                    "paced_measured": row["n"],
                }
            unanswered = await conn.fetchval(
                "SELECT count(*) FROM operations WHERE status NOT IN ('replied', 'ignored')"
            )
            writes = await row_writes(conn)
            await conn.close()
            rss = {name: peak_rss_mb(p.proc.pid) for name, p in procs.items() if p.proc}
        finally:
            for p in procs.values():
                await p.stop()
        return {
            **saturated,
            **latency,
            "cold": cold,
            "settings": {
                k: getattr(settings, k)
                for k in ("coalescer_poll_seconds", "relay_poll_seconds", "account_jobs_in_flight")
            },
            "unanswered_at_end": unanswered,
            "peak_rss_mb": rss,
            "row_writes": writes,
        }


# ---- peers -------------------------------------------------------------------------------


async def _spawn(cmd: list[str], env: dict[str, str], log: Path) -> asyncio.subprocess.Process:
    fh = open(log, "wb")
    return await asyncio.create_subprocess_exec(
        *cmd, cwd=ROOT, env=env, stdout=fh, stderr=asyncio.subprocess.STDOUT
    )


async def _wait_http(url: str, within: float = 30) -> None:
    deadline = time.monotonic() + within
    async with httpx.AsyncClient(timeout=2) as client:
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if (await client.get(url)).status_code < 500:
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url} did not come up")
            await asyncio.sleep(0.2)


#: Each peer's tuning (bench/peers.py): what a careful engineer would set, and the basic
#: variants the first benchmarks ran (context).
PEERS: dict[str, dict[str, str]] = {
    "celery": {"BENCH_CONCURRENCY": "16", "BENCH_CELERY_PREFETCH": "4"},
    "polling": {"BENCH_CONCURRENCY": "4", "BENCH_BATCH": "64"},
    "floor": {},
    "celery-basic": {"BENCH_CONCURRENCY": "8", "BENCH_CELERY_PREFETCH": "1"},
    "polling-basic": {"BENCH_CONCURRENCY": "8", "BENCH_BATCH": "1"},
}
SYSTEMS = ["chatqueue", "chatqueue-noshare", "chatqueue-tuned", "floor", "celery", "polling", "celery-basic", "polling-basic"]  # fmt: skip


async def peer(system: str, args: argparse.Namespace, world: FakeWorld) -> dict[str, Any]:
    kind = system.removesuffix("-basic")
    async with fresh(args) as (db_url, amqp_url):
        port = free_port()
        env = {
            **os.environ,
            "BENCH_DATABASE_URL": db_url,
            "BENCH_AMQP_URL": amqp_url,
            "BENCH_PLATFORM_URL": world.url,
            "BENCH_SECRET": SECRET,
            "BENCH_PORT": str(port),
            **PEERS[system],
        }
        logs = ROOT / ".pytest_cache"
        logs.mkdir(exist_ok=True)
        py = sys.executable
        if kind == "polling":  # once, before the two processes race on CREATE TABLE IF NOT EXISTS
            conn = await asyncpg.connect(db_url)
            await conn.execute(POLLING_SCHEMA)
            await conn.close()
        if kind == "floor":
            await floor.prepare(db_url)
            cmds = {role: [py, "-m", "bench.floor", role] for role in ("receiver", "coalescer", "responder")}
        elif kind == "celery":
            cmds = {
                "receiver": [py, "-m", "bench.peers", "celery-receiver"],
                "worker": [py, "-m", "celery", "-A", "bench.peers:celery_app", "worker", "--pool", "threads",
                           "-c", env["BENCH_CONCURRENCY"], "--without-gossip", "--without-mingle", "--without-heartbeat",
                           "-l", "WARNING"],
            }  # fmt: skip
        else:
            cmds = {
                "receiver": [py, "-m", "bench.peers", "polling-receiver"],
                "worker": [py, "-m", "bench.peers", "polling-worker"],
            }
        procs = {
            name: await _spawn(cmd, env, logs / f"bench-{system}-{name}.log") for name, cmd in cmds.items()
        }
        try:
            url = f"http://127.0.0.1:{port}"
            await _wait_http(f"{url}/openapi.json")  # the floor answers any GET
            await asyncio.sleep(2)  # let the worker attach to its queue or table
            pids = {n: p.pid for n, p in procs.items()}
            cold = await warm_up(url, db_url, world, args, pids)
            result = await load(
                url, world, args, lua_file(WRK_SCRIPT), pids=pids, database=database_of(db_url)
            )
            result["cold"] = cold
            result["peak_rss_mb"] = {name: peak_rss_mb(p.pid) for name, p in procs.items()}
            return result
        finally:
            for p in procs.values():
                if p.returncode is None:
                    p.terminate()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(p.wait(), 20)
                    if p.returncode is None:
                        p.kill()


async def run(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"connections": args.connections, "seconds": args.seconds}
    async with running_fakes() as world:
        for kind in args.systems:
            print(f"pipeline: {kind} ...", flush=True)
            out[kind] = await (chatqueue(args, world, kind) if kind in VARIANTS else peer(kind, args, world))
            r = out[kind]
            cpu = ", ".join(f"{k} {v:.2f}" for k, v in r["cpu_ms_per_reply"].items())
            print(
                f"  {kind}: {r['accepted']} accepted at {r['intake_rps']:.0f} req/s, {r['replies']} replies, "
                f"sustained {r['throughput']:.0f} msg/s, complete={r['complete']}; CPU ms per reply: {cpu}",
                flush=True,
            )
            if r.get("cold"):
                c = r["cold"]
                print(
                    f"  {kind} cold start (the {args.warmup_seconds:g} s warm-up on a fresh database): "
                    f"sustained {c['throughput']:.0f} msg/s; CPU ms per reply {c['cpu_ms_per_reply']['total']:.2f}",
                    flush=True,
                )
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--connections", type=int, default=16)
    p.add_argument("--seconds", type=int, default=15)
    p.add_argument("--warmup-seconds", type=int, default=5)
    p.add_argument("--drain-seconds", type=float, default=240)
    p.add_argument("--systems", nargs="+", choices=SYSTEMS, default=SYSTEMS)
    add_setting_argument(p)
    add_infra_arguments(p)


def main() -> None:
    bench_main(__doc__, add_arguments, run, "pipeline.json")


if __name__ == "__main__":
    main()
