"""Many accounts (issue 21): ``--accounts`` Telegram bots added through the admin API, each
with ``--chats`` chats, every chat a burst of ``--burst`` messages, all arriving together
(chats interleaved across accounts). Goals: every burst answered once (one reply a chat,
by its own bot; a chat whose messages the loaded receiver stored further apart than the
quiet time is two bursts by the rule, counted apart as split at the door); fairness: the
worst account's p99 receipt-to-reply within 2x the median account's; each service's peak
RSS. Also measured: emission lag (each window's closing after its due time, both as
Postgres recorded them in chat_windows) and receipt-to-reply. bench.burst runs the same
with the real reply pause. Writes bench/results/accounts.json."""

from __future__ import annotations

import argparse
import asyncio
import bisect
import os
import statistics
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import aiohttp
import asyncpg
import httpx
from cryptography.fernet import Fernet

from bench.pipeline import (
    cpu_seconds,
    cpu_used,
    database_of,
    fresh,
    instant_settings,
    peak_rss_mb,
    started_services,
)
from bench.support import add_infra_arguments, add_setting_argument, bench_main
from shared.settings import Settings
from tests.fakes.platforms import running_fakes
from tests.support.processes import Receiver

ADMIN_TOKEN = "bench-admin-token-0123456789"
FIRST_BOT = 700_000


def bot(n: int) -> tuple[str, str, str]:
    """The n-th account: its bot id, token and webhook secret token."""
    bot_id = str(FIRST_BOT + n)
    return bot_id, f"{bot_id}:AAbench-token-{n:06d}-abcdefghij", f"bench-secret-{n:06d}-abcdefgh"


def update(update_id: int, chat: int, text: str) -> dict[str, Any]:
    return {
        "update_id": update_id,
        "message": {
            "message_id": update_id,
            "date": int(time.time()),
            "chat": {"id": chat, "type": "private"},
            "from": {"id": chat, "is_bot": False, "first_name": "Buyer"},
            "text": text,
        },
    }


async def add_accounts(client: httpx.AsyncClient, accounts: int) -> list[float]:
    """The bots added through the admin API, 16 at a time. Returns each add's latency in
    the order they were made: the first tenth's against the last tenth's says whether an
    add costs more as accounts grow."""
    gate = asyncio.Semaphore(16)
    add_ms: list[float] = []

    async def add(n: int) -> None:
        bot_id, token, secret = bot(n)
        async with gate:
            sent = time.monotonic()
            r = await client.post(
                "/v1/accounts",
                headers={"authorization": f"Bearer {ADMIN_TOKEN}"},
                json={
                    "platform": "telegram",
                    "account_id": bot_id,
                    "name": f"shop {n}",
                    "credentials": {"bot_token": token, "webhook_secret": secret},
                },
            )
            r.raise_for_status()
            add_ms.append((time.monotonic() - sent) * 1000)

    await asyncio.gather(*(add(n) for n in range(accounts)))
    return add_ms


async def post_bursts(url: str, accounts: int, chats: int, burst: int) -> None:
    """Every chat's burst through the receiver's webhook of its bot, the burst's messages
    together, 32 chats at a time, chats interleaved across accounts. Posted with aiohttp:
    httpx's client saturates long before the receiver does (../shared/measurements.md)."""
    gate = asyncio.Semaphore(32)
    async with aiohttp.ClientSession(
        url, timeout=aiohttp.ClientTimeout(total=60), connector=aiohttp.TCPConnector(limit=32 * burst)
    ) as session:

        async def post(bot_id: str, secret: str, body: dict[str, Any]) -> None:
            headers = {"X-Telegram-Bot-Api-Secret-Token": secret}
            async with session.post(f"/v1/webhooks/telegram/{bot_id}", json=body, headers=headers) as r:
                r.raise_for_status()

        async def chat_burst(n: int, chat: int) -> None:
            bot_id, _, secret = bot(n)
            async with gate:  # the burst's messages together
                await asyncio.gather(
                    *(post(bot_id, secret, update(chat * 100 + m, chat, f"question {m}: is it available?"))
                      for m in range(burst))
                )  # fmt: skip

        await asyncio.gather(*(chat_burst(n, 1000 + c) for c in range(chats) for n in range(accounts)))


# What could still make a reply: a message not yet answered (or with a person), an open
# window, a job not finished, an outbox row not yet published.
UNFINISHED_WORK = """
SELECT (SELECT count(*) FROM operations WHERE status IN ('accepted', 'queued', 'waiting', 'replying'))
     + (SELECT count(*) FROM chat_windows WHERE status = 'open')
     + (SELECT count(*) FROM reply_jobs WHERE status IN ('pending', 'processing'))
     + (SELECT count(*) FROM outbox WHERE published_at IS NULL)
"""


async def settled(conn: asyncpg.Connection, *, quiet_for: float, within: float) -> bool:
    """Wait until nothing is left that could send a reply, for ``quiet_for`` seconds on end
    (a second answer to a burst would have come by then). False if not within ``within``."""
    deadline = time.monotonic() + within
    idle_since: float | None = None
    while time.monotonic() < deadline:
        if await conn.fetchval(UNFINISHED_WORK):
            idle_since = None
        elif idle_since is None:
            idle_since = time.monotonic()
        elif time.monotonic() - idle_since >= quiet_for:
            return True
        await asyncio.sleep(0.5)
    return False


def pause(args: argparse.Namespace) -> tuple[float, float]:
    """The reply delay's range: --delay-min/--delay-max, else the quiet time to twice it."""
    low = args.quiet if args.delay_min is None else args.delay_min
    return low, args.quiet * 2 if args.delay_max is None else args.delay_max


# Each window's emission after its due time (closed_at and due_at, both Postgres' clock, as
# the coalescer's chatq_coalescer_emission_lag_seconds observes them), and receipt to reply.
LATENCIES = """
SELECT (SELECT count(*) FROM chat_windows WHERE status = 'closed') AS emitted,
       (SELECT count(*) FROM chat_windows WHERE status = 'closed' AND closed_at - due_at > interval '1 second')
           AS emitted_over_1s,
       (SELECT percentile_cont(ARRAY[0.5, 0.99]) WITHIN GROUP (ORDER BY extract(epoch FROM closed_at - due_at))
        FROM chat_windows WHERE status = 'closed') AS emission_lag,
       (SELECT max(extract(epoch FROM closed_at - due_at))::float8 FROM chat_windows WHERE status = 'closed')
           AS emission_lag_max,
       (SELECT percentile_cont(ARRAY[0.5, 0.99]) WITHIN GROUP (ORDER BY extract(epoch FROM j.sent_at - o.received_at))
        FROM operations o JOIN reply_jobs j ON j.id = o.job_id WHERE j.status = 'sent') AS receipt_to_reply,
       (SELECT percentile_cont(ARRAY[0.5, 0.99]) WITHIN GROUP (ORDER BY extract(epoch FROM e.at - o.received_at))
        FROM operation_events e JOIN operations o ON o.id = e.operation_id WHERE e.kind = 'filed') AS receipt_to_filing
"""

# The latest windows: when their messages were received and filed, and how many jobs of
# their account were unfinished when they fell due (the fair share lets 16 out).
LATEST = """
SELECT w.chat_key, w.due_at, w.closed_at, extract(epoch FROM w.closed_at - w.due_at)::float8 AS lag,
       (SELECT array_agg(o.received_at ORDER BY o.received_at) FROM window_messages m
        JOIN operations o ON o.id = m.operation_id WHERE m.window_id = w.id) AS received,
       (SELECT array_agg(e.at ORDER BY e.at) FROM window_messages m
        JOIN operation_events e ON e.operation_id = m.operation_id AND e.kind = 'filed'
        WHERE m.window_id = w.id) AS filed,
       (SELECT count(*) FROM reply_jobs r WHERE r.platform = w.platform AND r.account_id = w.account_id
          AND r.created_at <= w.due_at AND coalesce(r.sent_at, 'infinity') > w.due_at) AS account_jobs_unfinished_at_due
FROM chat_windows w WHERE w.status = 'closed' ORDER BY w.closed_at - w.due_at DESC LIMIT 10
"""


# Per 10 s since the first message was received: messages received and filed, windows
# falling due and emitted, jobs taken by the responder (their first attempt) and sent.
TIMELINE = """
WITH t0 AS (SELECT min(received_at) AS t FROM operations), at AS (
    SELECT 'received' AS what, received_at AS at FROM operations
    UNION ALL SELECT 'filed', at FROM operation_events WHERE kind = 'filed'
    UNION ALL SELECT 'due', due_at FROM chat_windows WHERE status = 'closed'
    UNION ALL SELECT 'emitted', closed_at FROM chat_windows WHERE status = 'closed'
    UNION ALL SELECT 'taken', min(at) FROM operation_events WHERE kind = 'attempt' GROUP BY job_id
    UNION ALL SELECT 'sent', sent_at FROM reply_jobs WHERE status = 'sent'
)
SELECT (floor(extract(epoch FROM at.at - t0.t) / 10) * 10)::int AS t, what, count(*) AS n
FROM at, t0 GROUP BY 1, 2 ORDER BY 1
"""


def pct(xs: list[float], p: float) -> float | None:
    return sorted(xs)[min(len(xs) - 1, int(p * len(xs)))] if xs else None


async def share_waits(conn: asyncpg.Connection, share: int) -> dict[str, Any]:
    """The emission lag split by whether the fair share held the window: at its due time
    its account's unfinished jobs and its windows due before it and still waiting filled
    the share (``ACCOUNT_JOBS_IN_FLIGHT``; 0: none is held). The lag of the others is the
    scheduler's own lateness; a held window waits for its account's jobs to finish."""
    windows = await conn.fetch(
        "SELECT platform, account_id, due_at, closed_at FROM chat_windows WHERE status = 'closed'"
    )
    jobs = await conn.fetch(
        "SELECT platform, account_id, created_at, coalesce(sent_at, updated_at) AS done FROM reply_jobs"
    )
    by: dict[tuple[str, str], dict[str, list[Any]]] = {}
    for j in jobs:
        a = by.setdefault(
            (j["platform"], j["account_id"]), {"created": [], "done": [], "due": [], "closed": []}
        )
        a["created"].append(j["created_at"])
        a["done"].append(j["done"])
    for w in windows:
        a = by.setdefault(
            (w["platform"], w["account_id"]), {"created": [], "done": [], "due": [], "closed": []}
        )
        a["due"].append(w["due_at"])
        a["closed"].append(w["closed_at"])
    for a in by.values():
        for k in a:
            a[k].sort()
    held: list[float] = []
    free: list[float] = []
    for w in windows:
        a, t = by[(w["platform"], w["account_id"])], w["due_at"]
        unfinished = bisect.bisect_right(a["created"], t) - bisect.bisect_right(a["done"], t)
        waiting = bisect.bisect_left(a["due"], t) - bisect.bisect_right(a["closed"], t)
        lag = (w["closed_at"] - t).total_seconds()
        (held if share and unfinished + waiting >= share else free).append(lag)
    return {
        "windows_held_by_share": len(held),
        "held_lag_p50_s": pct(held, 0.5),
        "held_lag_max_s": max(held, default=None),
        "free_lag_p50_s": pct(free, 0.5),
        "free_lag_p99_s": pct(free, 0.99),
        "free_lag_max_s": max(free, default=None),
    }


async def run_with(
    args: argparse.Namespace, base: Callable[..., Settings], **overrides: Any
) -> dict[str, Any]:
    """The step on ``base(db_url, amqp_url, world, ...)``'s settings with ``overrides``."""
    delay_min, delay_max = pause(args)
    async with running_fakes() as world, fresh(args) as (db_url, amqp_url):
        settings = base(db_url, amqp_url, world, admin_token=ADMIN_TOKEN,
                        secrets_key=Fernet.generate_key().decode(), **{**overrides, **dict(args.setting)})  # fmt: skip
        procs = await started_services(settings)
        receiver = procs["receiver"]
        assert isinstance(receiver, Receiver)
        conn = await asyncpg.connect(db_url)
        try:
            started = time.monotonic()
            async with httpx.AsyncClient(base_url=receiver.url, timeout=30) as client:
                add_ms = await add_accounts(client, args.accounts)
            added_s = time.monotonic() - started
            pids = {name: p.proc.pid for name, p in procs.items() if p.proc}
            cpu_before, load_before = cpu_seconds(pids, database_of(db_url)), os.getloadavg()[0]
            load_started = time.monotonic()
            await post_bursts(receiver.url, args.accounts, args.chats, args.burst)
            posted_s = time.monotonic() - load_started
            chats = args.accounts * args.chats
            deadline = time.monotonic() + args.within
            while (answered := len({(m["bot"], m["chat_id"]) for m in world.telegram})) < chats:
                if time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.5)
            answered_s = time.monotonic() - load_started if answered == chats else None
            # Then until nothing is left that could answer again.
            quiet = await settled(conn, quiet_for=5, within=max(deadline - time.monotonic(), 0) + delay_max)
            settled_s = time.monotonic() - load_started
            # CPU seconds while the load ran (Postgres: the server's own processes and this
            # bench's backends; RabbitMQ: all of it, other sessions' too) and the load
            # average before and after: a shared machine says so.
            cpu = cpu_used(cpu_before, cpu_seconds(pids, database_of(db_url)), pids)
            load_after = os.getloadavg()[0]
            rss = {name: peak_rss_mb(p.proc.pid) for name, p in procs.items() if p.proc}
            rows = await conn.fetch(
                """
                SELECT o.account_id,
                       percentile_cont(0.99) WITHIN GROUP (ORDER BY extract(epoch FROM e.at - o.received_at)) AS p99
                FROM operation_events e JOIN operations o ON o.id = e.operation_id
                WHERE e.kind = 'replied' GROUP BY 1
                """
            )
            jobs = await conn.fetchval("SELECT count(*) FROM reply_jobs WHERE status = 'sent'")
            latencies = await conn.fetchrow(LATENCIES)
            assert latencies is not None
            latest = await conn.fetch(LATEST)
            timeline: dict[int, dict[str, int]] = {}
            for r in await conn.fetch(TIMELINE):
                timeline.setdefault(r["t"], {})[r["what"]] = r["n"]
            waits = await share_waits(conn, settings.account_jobs_in_flight)
            # Per chat: how far apart the receiver stored its burst's messages. A burst the
            # buyer sent at once but the receiver stored further apart than the quiet time
            # is two bursts by the rule (a pause of QUIET_SECONDS ends a burst), so its two
            # answers are counted apart from a burst answered twice.
            spreads = {
                r["chat_key"]: r["spread"]
                for r in await conn.fetch(
                    """
                    SELECT chatq_chat_key(platform, account_id, chat_id) AS chat_key,
                           extract(epoch FROM max(received_at) - min(received_at))::float8 AS spread
                    FROM operations GROUP BY platform, account_id, chat_id
                    """
                )
            }
            # A chat answered more than once: each job's messages, when they were received
            # and filed, and when the job was made (what split the burst).
            twice = await conn.fetch(
                """
                SELECT j.chat_key, j.id AS job, j.created_at AS job_at,
                       array_agg(o.message_id ORDER BY o.received_at) AS messages,
                       array_agg(o.received_at ORDER BY o.received_at) AS received,
                       array_agg((SELECT min(e.at) FROM operation_events e
                                  WHERE e.operation_id = o.id AND e.kind = 'filed')
                                 ORDER BY o.received_at) AS filed
                FROM reply_jobs j CROSS JOIN LATERAL unnest(j.operation_ids) AS x(id)
                JOIN operations o ON o.id = x.id
                WHERE j.chat_key IN (SELECT chat_key FROM reply_jobs GROUP BY 1 HAVING count(*) > 1)
                GROUP BY 1, 2, 3 ORDER BY 1, 3 LIMIT 40
                """
            )
        finally:
            await conn.close()
            for p in procs.values():
                await p.stop()
    replies = Counter((m["bot"], m["chat_id"]) for m in world.telegram)
    repeated = [f"telegram:{b}:{c}" for (b, c), n in replies.items() if n > 1]
    # Answered twice although the receiver stored its messages within the quiet time: a
    # burst answered twice (the defect). The rest were stored further apart than a pause.
    twice_in_one_burst = sum(1 for k in repeated if spreads.get(k, 0.0) <= args.quiet)
    p99s = sorted(r["p99"] for r in rows)
    median = statistics.median(p99s) if p99s else None
    worst = p99s[-1] if p99s else None
    lag = latencies["emission_lag"] or [None, None]
    r2r = latencies["receipt_to_reply"] or [None, None]
    r2f = latencies["receipt_to_filing"] or [None, None]
    return {
        "accounts": args.accounts,
        "chats": chats,
        "messages": chats * args.burst,
        "quiet_seconds": args.quiet,
        "reply_delay_seconds": [delay_min, delay_max],
        "settings": {k: v for k, v in settings.model_dump().items() if k in SHOWN_SETTINGS},
        "accounts_added_s": added_s,
        "add_ms_median_first_tenth": statistics.median(add_ms[: max(1, len(add_ms) // 10)]),
        "add_ms_median_last_tenth": statistics.median(add_ms[-max(1, len(add_ms) // 10) :]),
        "posted_s": posted_s,
        "answered_s": answered_s,
        "settled_s": settled_s,
        "settled": quiet,
        "chats_answered": len(replies),
        "chats_answered_twice": len(repeated),
        "bursts_answered_twice": twice_in_one_burst,
        "bursts_split_at_the_door": len(repeated) - twice_in_one_burst,
        "burst_receipt_spread_max_s": max(spreads.values(), default=0.0),
        "bursts_stored_apart": sum(1 for v in spreads.values() if v > args.quiet),
        "jobs_sent": jobs,
        "answered_once": len(replies) == chats and twice_in_one_burst == 0,
        "account_p99_median_s": median,
        "account_p99_worst_s": worst,
        "fairness_ratio": worst / median if median else None,
        "windows_emitted": latencies["emitted"],
        "windows_emitted_over_1s": latencies["emitted_over_1s"],
        "emission_lag_p50_s": lag[0],
        "emission_lag_p99_s": lag[1],
        "emission_lag_max_s": latencies["emission_lag_max"],
        "receipt_to_reply_p50_s": r2r[0],
        "receipt_to_reply_p99_s": r2r[1],
        # How far the coalescer's filing ran behind the receiver (a window then waits the
        # quiet time from its filing, so this delay is not in the emission lag).
        "receipt_to_filing_p50_s": r2f[0],
        "receipt_to_filing_p99_s": r2f[1],
        **waits,
        "peak_rss_mb": rss,
        "cpu_seconds_during_load": cpu,
        "load_average_before_after": [load_before, load_after],
        "timeline_10s": timeline,
        "latest_windows": [dict(r) for r in latest],
        "answered_twice_detail": [dict(r) for r in twice],
    }


#: The settings a result records: what shapes the pause, the pacing and the fair share.
SHOWN_SETTINGS = (
    "quiet_seconds", "reply_delay_min_seconds", "reply_delay_max_seconds", "max_wait_seconds",
    "coalescer_poll_seconds", "relay_poll_seconds", "platform_rate_per_second", "responder_concurrency",
    "account_jobs_in_flight",
)  # fmt: skip


async def run(args: argparse.Namespace) -> dict[str, Any]:
    delay_min, delay_max = pause(args)
    return await run_with(
        args,
        instant_settings,
        # A burst is one answer: the window waits for the buyer to pause.
        quiet_seconds=args.quiet,
        reply_delay_min_seconds=delay_min,
        reply_delay_max_seconds=delay_max,
        max_wait_seconds=args.quiet * 20,
        responder_concurrency=16,
    )


def arguments(p: argparse.ArgumentParser) -> None:
    add_infra_arguments(p)
    p.add_argument("--accounts", type=int, default=1000)
    p.add_argument("--chats", type=int, default=10, help="chats per account")
    p.add_argument("--burst", type=int, default=2, help="messages a chat, sent together")
    p.add_argument("--quiet", type=float, default=5.0, help="seconds a buyer pauses before the answer")
    p.add_argument("--delay-min", type=float, help="shortest reply delay (default: --quiet)")
    p.add_argument("--delay-max", type=float, help="longest reply delay (default: twice --quiet)")
    p.add_argument("--within", type=float, default=600, help="give up waiting for the answers after this")
    add_setting_argument(p)


if __name__ == "__main__":
    bench_main(__doc__, arguments, run, "accounts.json")
