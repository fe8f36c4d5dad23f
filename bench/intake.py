"""Intake benchmark: the receiver under wrk on loopback, next to pgbench running the
identical inbox+outbox statement at the same concurrency, in the same run; then, each
round, the receiver's latency under a paced load at half the maximum it just reached.

Usage: python -m bench.intake [--connections 32] [--seconds 15]
Needs wrk and pgbench on PATH (``make bench`` installs wrk). Absolute figures drift on
shared machines; the ratio to pgbench in the same run is the figure to read.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from urllib.parse import urlsplit

import asyncpg
import httpx

from bench.support import RESULTS, add_infra_arguments, drop_database, fresh_database, private_vhost
from shared.settings import Settings
from tests.support.processes import Receiver

ROOT = Path(__file__).resolve().parents[1]
SECRET = "bench-secret"
TEXT = "Hello! Is the bike still available, and do you deliver to Kazan?"

_WRK_TEMPLATE = r"""
local counter = 0
local threads = 0
-- Every run and thread gets its own id range, so no request repeats an earlier one.
local run_base = (os.time() % 1000000) * 1000000000
setup = function(thread)
  thread:set("tid", threads)
  thread:set("base", run_base)
  threads = threads + 1
end
request = function()
  counter = counter + 1
  local id = base + tid * 100000000 + counter
  local chat = CHAT
  local body = string.format('{"update_id":%d,"message":{"message_id":%d,"from":{"id":%d,"is_bot":false,"first_name":"Buyer"},"chat":{"id":%d,"type":"private"},"date":1764400000,"text":"TEXT"}}', id, id, chat, chat)
  return wrk.format("POST", "/v1/webhooks/telegram", {["Content-Type"]="application/json", ["X-Telegram-Bot-Api-Secret-Token"]="SECRET"}, body)
end
"""


def telegram_script(*, chat: str, text: str) -> str:
    """A wrk script posting Telegram updates with unique ids; ``chat`` is a Lua expression
    of ``id`` (``"id"``: a chat per message)."""
    return _WRK_TEMPLATE.replace("CHAT", chat).replace("TEXT", text).replace("SECRET", SECRET)


WRK_SCRIPT = telegram_script(chat="id % 5000", text=TEXT)

# The receiver's one-row statement (services/receiver/intake.py: the operation, its
# event and its outbox row in one transaction), with pgbench variables.
PGBENCH_SCRIPT = """
\\set id random(1, 9000000000000)
\\set chat random(1, 5000)
WITH op AS (
    INSERT INTO operations (id, platform, account_id, event_id, chat_id, message_id,
                            author_id, text, sent_at, status, status_reason, received_at, payload)
    VALUES (gen_random_uuid(), 'telegram', '4242', :id::text, :chat::text, :id::text, :chat::text,
            'TEXT', now(), 'accepted', NULL, now(),
            ('{"update_id":' || :id || ',"message":{"message_id":' || :id || ',"from":{"id":' || :chat || ',"is_bot":false,"first_name":"Buyer"},"chat":{"id":' || :chat || ',"type":"private"},"date":1764400000,"text":"TEXT"}}')::json)
    ON CONFLICT DO NOTHING
    RETURNING id, status
), ev AS (
    INSERT INTO operation_events (operation_id, kind, detail)
    SELECT op.id, 'received', 'received and stored' FROM op
), ob AS (
    INSERT INTO outbox (exchange, routing_key, message_id, ordering_key, operation_id, body)
    SELECT 'chatq.inbound', 'inbound.telegram', op.id::text, 'telegram:4242:' || :chat, op.id,
           convert_to('{"schema":"chatq.inbound.v1","operation_id":"' || op.id || '","platform":"telegram","account_id":"4242","chat_id":"' || :chat || '","message_id":"' || :id || '","author_id":"' || :chat || '","text":"TEXT","sent_at":"2026-11-29T07:00:00Z","received_at":"2026-11-29T07:00:00Z"}', 'UTF8')
    FROM op WHERE op.status = 'accepted'
)
SELECT id, status FROM op;
""".replace("TEXT", TEXT)


def parse_wrk(out: str) -> dict[str, float]:
    def ms(value: str, unit: str) -> float:
        return float(value) * {"us": 0.001, "ms": 1.0, "s": 1000.0}[unit]

    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out)[1])  # type: ignore[index]
    lat = {p: ms(v, u) for p, v, u in re.findall(r"\s(50|75|90|99)%\s+([\d.]+)(us|ms|s)", out)}
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    errors = re.search(r"Socket errors: (.*)", out)
    total = re.search(r"(\d+) requests in", out)
    return {
        "rps": rps,
        "requests": int(total[1]) if total else 0,
        "p50_ms": lat.get("50", float("nan")),
        "p99_ms": lat.get("99", float("nan")),
        "non_2xx": int(non2xx[1]) if non2xx else 0,
        "socket_errors": errors[1] if errors else "",
    }


def parse_pgbench(out: str) -> dict[str, float]:
    tps = float(re.search(r"tps = ([\d.]+)", out)[1])  # type: ignore[index]
    lat = re.search(r"latency average = ([\d.]+) ms", out)
    return {"tps": tps, "latency_avg_ms": float(lat[1]) if lat else float("nan")}


async def batch_rows(receiver_url: str) -> tuple[float, float]:
    """The receiver's intake group commit so far: (rows, committed statements)."""
    async with httpx.AsyncClient() as client:
        text = (await client.get(f"{receiver_url}/metrics/")).text
    found = dict(re.findall(r"^chatq_intake_batch_rows_(sum|count) ([\d.e+]+)$", text, re.M))
    return float(found.get("sum", 0)), float(found.get("count", 0))


async def truncate(url: str) -> None:
    conn = await asyncpg.connect(url)
    await conn.execute("TRUNCATE operations, outbox")
    await conn.execute("VACUUM ANALYZE operations")
    await conn.execute("VACUUM ANALYZE outbox")
    await conn.close()


def pgbench(db_url: str, name: str, script: str, connections: int, seconds: int) -> dict[str, float]:
    pg = urlsplit(db_url)
    out = subprocess.run(
        [
            "pgbench",
            "-n",
            "-h",
            pg.hostname or "127.0.0.1",
            "-p",
            str(pg.port or 5432),
            "-U",
            pg.username or "postgres",
            "-c",
            str(connections),
            "-j",
            "2",
            "-T",
            str(seconds),
            # A rare deadlock between two inserts of the same random id must not abort the run.
            "--max-tries",
            "5",
            "-f",
            script,
            name,
        ],
        capture_output=True,
        text=True,
    )
    if out.returncode:
        raise RuntimeError(f"pgbench failed: {out.stderr[-1500:]}")
    return parse_pgbench(out.stdout)


def lua_file(script: str, delay_ms: float | None = None) -> str:
    """The wrk script in a file, with a pause of ``delay_ms`` before each request of a
    connection when given."""
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
        f.write(script)
        if delay_ms is not None:
            f.write(f"\ndelay = function() return {delay_ms:.2f} end\n")
        return f.name


def wrk(url: str, lua: str, connections: int, seconds: int, threads: int = 2) -> dict[str, float]:
    out = subprocess.run(
        [
            "wrk",
            f"-t{min(threads, connections)}",
            f"-c{connections}",
            "--latency",
            "-s",
            lua,
            f"-d{seconds}s",
            url,
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return parse_wrk(out)


async def run(args: argparse.Namespace) -> dict[str, object]:
    for tool in ("wrk", "pgbench"):
        if not shutil.which(tool):
            sys.exit(f"{tool} is not on PATH (make bench installs wrk; pgbench comes with PostgreSQL)")
    # Two databases of the same schema: pgbench's rows must not become work for the
    # receiver's relay.
    name, db_url = await fresh_database(args.admin_database_url)
    pg_name, pg_url = await fresh_database(args.admin_database_url)
    try:
        async with private_vhost(args.amqp_url, args.rabbitmq_api_url) as amqp_url:
            return await measure(args, db_url, amqp_url, pg_url, pg_name)
    finally:
        await drop_database(args.admin_database_url, name)
        await drop_database(args.admin_database_url, pg_name)


async def measure(
    args: argparse.Namespace, db_url: str, amqp_url: str, pg_url: str, pg_name: str
) -> dict[str, object]:
    lua = lua_file(WRK_SCRIPT)
    with tempfile.NamedTemporaryFile("w", suffix=".sql", delete=False) as f:
        f.write(PGBENCH_SCRIPT)
        script = f.name
    light_conn = max(1, args.connections // 4)
    rounds: list[dict[str, dict[str, float]]] = []
    settings = Settings(
        database_url=db_url,
        amqp_url=amqp_url,
        telegram_webhook_secret=SECRET,
        telegram_bot_token="4242:bench",
        database_pool_size=args.connections,
        log_level="WARNING",
        **({"intake_batch_rows": args.batch_rows} if args.batch_rows else {}),
    )
    receiver = await Receiver(settings).start()
    try:
        wrk(receiver.url, lua, 4, 2)  # warm-up
        # Alternate the two sides so that the machine's drift hits both alike.
        for _ in range(args.rounds):
            rows_before, commits_before = await batch_rows(receiver.url)
            full = wrk(receiver.url, lua, args.connections, args.seconds)
            rows_after, commits_after = await batch_rows(receiver.url)
            full["rows_per_commit"] = (rows_after - rows_before) / max(commits_after - commits_before, 1)
            bench_pg = pgbench(pg_url, pg_name, script, args.connections, args.seconds)
            # Latency at half this round's maximum: paced, each connection pausing between
            # requests so that together they offer about 0.5x the rate just measured.
            target = full["rps"] / 2
            delay = light_conn * 1000 / target
            # Each connection's cycle is its pause plus the response time: short trials
            # scale the pause until the offered rate is about the target.
            for _ in range(2):  # two short trials: the response time grows with the rate
                trial = wrk(receiver.url, lua_file(WRK_SCRIPT, delay), light_conn, 3, threads=2)
                delay = max(delay * trial["rps"] / target, 0.0)
            light = wrk(receiver.url, lua_file(WRK_SCRIPT, delay), light_conn, args.seconds, threads=2)
            rounds.append(
                {"receiver": full, "pgbench": bench_pg, "receiver_light": {**light, "target_rps": target}}
            )
    finally:
        await receiver.stop()
    conn = await asyncpg.connect(db_url)
    unpublished = await conn.fetchval("SELECT count(*) FROM outbox WHERE published_at IS NULL")
    await conn.close()
    ratios = sorted(r["receiver"]["rps"] / r["pgbench"]["tps"] for r in rounds)
    return {
        "connections": args.connections,
        "light_connections": light_conn,
        "seconds": args.seconds,
        "rounds": rounds,
        "ratio_median": statistics.median(ratios),
        "receiver_rps_median": statistics.median(r["receiver"]["rps"] for r in rounds),
        "receiver_p99_ms_median": statistics.median(r["receiver"]["p99_ms"] for r in rounds),
        "pgbench_tps_median": statistics.median(r["pgbench"]["tps"] for r in rounds),
        "rows_per_commit_median": statistics.median(r["receiver"]["rows_per_commit"] for r in rounds),
        "light_rps_median": statistics.median(r["receiver_light"]["rps"] for r in rounds),
        "light_share_median": statistics.median(
            r["receiver_light"]["rps"] / r["receiver"]["rps"] for r in rounds
        ),
        "light_p99_ms_median": statistics.median(r["receiver_light"]["p99_ms"] for r in rounds),
        "non_2xx": sum(r["receiver"]["non_2xx"] + r["receiver_light"]["non_2xx"] for r in rounds),
        "unpublished_at_stop": unpublished,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--seconds", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-rows", type=int, help="CHATQ_INTAKE_BATCH_ROWS (1: no group commit)")
    add_infra_arguments(parser)
    args = parser.parse_args()
    result = asyncio.run(run(args))
    print(f"intake: {args.rounds} alternating rounds of {args.seconds}s, same machine, same run (medians)")
    for i, r in enumerate(result["rounds"], 1):
        rc, pg, lt = r["receiver"], r["pgbench"], r["receiver_light"]
        print(
            f"  round {i}: receiver {rc['rps']:7.0f} req/s p99 {rc['p99_ms']:6.1f} ms | pgbench {pg['tps']:7.0f} tps"
            f" | ratio {rc['rps'] / pg['tps']:.2f} | {rc['rows_per_commit']:.1f} rows/commit | paced, {result['light_connections']} conns: {lt['rps']:6.0f} req/s"
            f" p99 {lt['p99_ms']:5.1f} ms"
        )
    print(
        f"  median: receiver {result['receiver_rps_median']:.0f} req/s at {args.connections} connections "
        f"(p99 {result['receiver_p99_ms_median']:.1f} ms), pgbench {result['pgbench_tps_median']:.0f} tps, "
        f"ratio {result['ratio_median']:.2f}; non-2xx {result['non_2xx']}, unpublished at stop {result['unpublished_at_stop']}"
    )
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "intake.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
