"""``make bench``: every benchmark in one run on this machine, then one table of each
figure next to its reference measured in the same run, the ratio, and the goal.

Runs, in order, each as its own process writing bench/results/<name>.json: bench.intake
(receiver vs pgbench), bench.relay (relay vs raw aio-pika publisher), bench.responder
(responder vs bare consumer), bench.coalescer (filing a backlog of 20,000 inbound messages;
emission among 100,000 open windows), bench.blocked
(10,000 chats behind a job in flight, the scheduler before and after), bench.pipeline
(end to end: chatqueue on its default settings, with the polls shortened and with the fair
share off; Celery and a Postgres polling table as a careful engineer tunes them, and their
basic variants as context; and the floor of chatqueue's design, bench/floor.py, which the
goal is a ratio to), bench.accounts (1,000 accounts
x 10 chats, bursts together: answered once, fairness between accounts), bench.burst (10,000
chats bursting at once with the real reply pause, 20-60 s: answered once, emission lag). The
table and every figure go to bench/results/bench.json. Machines are shared and noisy: read the ratios.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from typing import Any

from bench.support import RESULTS

STEPS = {
    "intake": ["bench.intake"],
    "relay": ["bench.relay"],
    "responder": ["bench.responder"],
    "coalescer": ["bench.coalescer", "--open", "100000", "--due", "10000"],
    "blocked": ["bench.blocked", "--chats", "10000"],
    "pipeline": ["bench.pipeline"],
    "accounts": ["bench.accounts", "--accounts", "1000", "--chats", "10"],
    "burst": ["bench.burst", "--accounts", "100", "--chats", "100"],
}


def load(name: str) -> dict[str, Any] | None:
    path = RESULTS / name
    return json.loads(path.read_text()) if path.exists() else None


def rows() -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []

    def row(stage: str, figure: str, value: float | None, reference: str, ref_value: float | None,
            goal: str, ok: bool | None, unit: str = "", ratio: float | None = None) -> None:  # fmt: skip
        if ratio is None and value is not None and ref_value:
            ratio = value / ref_value
        out.append({"stage": stage, "figure": figure, "value": value, "unit": unit, "reference": reference,
                    "reference_value": ref_value, "ratio": ratio, "goal": goal, "met": ok})  # fmt: skip

    intake = load("intake.json")
    if intake:
        r = intake["ratio_median"]
        row("intake", f"receiver req/s at {intake['connections']} conns", intake["receiver_rps_median"],
            "pgbench tps, same one-row transaction", intake["pgbench_tps_median"], "ratio >= 1.0", r >= 1.0,
            "req/s", ratio=r)  # median of the rounds' ratios  # fmt: skip
        if "rows_per_commit_median" in intake:
            row("intake", "webhook rows per commit (group commit)", intake["rows_per_commit_median"], "", None,
                "(context)", None, "rows")  # fmt: skip
        half = intake.get("light_share_median") or intake["light_rps_median"] / intake["receiver_rps_median"]
        row("intake", f"p99 paced at {half:.2f}x max rate ({intake['light_connections']} conns)", intake["light_p99_ms_median"],
            "", None, "p99 <= 20 ms at ~0.5x max", intake["light_p99_ms_median"] <= 20, "ms")  # fmt: skip
    relay = load("relay.json")
    if relay:
        row("relay", f"rows/s from a pre-filled outbox ({relay['rows']})", relay["relay_rows_per_s_median"],
            f"raw aio-pika publisher, {relay['window']} confirms in flight", relay["raw_msgs_per_s_median"],
            "ratio >= 0.7", relay["ratio_median"] >= 0.7, "rows/s", ratio=relay["ratio_median"])  # fmt: skip
        s = relay["steady"]
        row("relay", f"outbox-to-broker lag p99 at {s['achieved_rate']:.0f} rows/s", s["lag_p99_ms"], "", None,
            "p99 <= 100 ms at 1,000 rows/s", s["lag_p99_ms"] <= 100, "ms")  # fmt: skip
    responder = load("responder.json")
    if responder:
        row("responder", f"jobs/s ({responder['jobs']} jobs, instant fakes)", responder["responder_jobs_per_s"],
            "bare aio-pika consumer, 1 INSERT + ack each", responder["bare_jobs_per_s"], "ratio >= 0.6",
            responder["ratio"] >= 0.6, "jobs/s")  # fmt: skip
        if "bare_with_send_jobs_per_s" in responder:  # where the gap is: the reply's HTTP call
            row("responder", "jobs/s, same run", responder["responder_jobs_per_s"],
                "bare consumer + the same platform call", responder["bare_with_send_jobs_per_s"],
                "(context)", None, "jobs/s")  # fmt: skip
        if "responder_cpu_ms_per_job" in responder:  # what a job costs, and in how many round trips
            row("responder", "CPU ms per job, responder process", responder["responder_cpu_ms_per_job"], "", None,
                "(context)", None, "ms")  # fmt: skip
            row("responder", "CPU ms per job, its Postgres backends", responder["postgres_cpu_ms_per_job"], "", None,
                "(context)", None, "ms")  # fmt: skip
            row("responder", "Postgres transactions (round trips) per job", responder["transactions_per_job"],
                "", None, "(context)", None, "")  # fmt: skip
    coalescer = load("coalescer-100000.json")
    if coalescer and "filing" in coalescer:
        f = coalescer["filing"]
        row("coalescer", f"filing msg/s, a backlog of {f['messages']:,} messages of {f['chats']:,} chats",
            f["messages_per_s"], "", None, "(context)", None, "msg/s")  # fmt: skip
        row("coalescer", "messages filed per commit", f["messages_per_commit"], "", None, "(context)", None,
            "msgs")  # fmt: skip
        if "messages_per_ack" in f:
            row("coalescer", "inbound messages per broker ack", f["messages_per_ack"], "", None, "(context)",
                None, "msgs")  # fmt: skip
    if coalescer:
        row("coalescer", "emission lag p99, 100,000 open windows", coalescer["lag_p99_ms"], "", None,
            "p99 <= 1 s", coalescer["lag_p99_ms"] <= 1000, "ms")  # fmt: skip
    blocked = load("blocked.json")
    if blocked:
        row("coalescer", f"claim query, {blocked['chats']:,} chats blocked by a job in flight", blocked["after_claim_ms"],
            "the same query before (anti-join scan)", blocked["before_claim_ms"], "ratio <= 0.1",
            blocked["after_claim_ms"] <= 0.1 * blocked["before_claim_ms"], "ms")  # fmt: skip
        row("coalescer", "idle scheduler CPU with them (process + Postgres)", blocked["after_cpu_share"] * 100,
            "the same before", blocked["before_cpu_share"] * 100, "(context)", None, "% core")  # fmt: skip
        row("coalescer", f"scheduler + filing CPU at {blocked['rate']:g} msg/s of new chats, with them",
            blocked["after_loaded_cpu_share"] * 100, "the same before", blocked["before_loaded_cpu_share"] * 100,
            "ratio <= 0.5", blocked["after_loaded_cpu_share"] <= 0.5 * blocked["before_loaded_cpu_share"],
            "% core")  # fmt: skip
    pipe = load("pipeline.json")
    if pipe and "chatqueue" in pipe:
        cq = pipe["chatqueue"]
        limit = intake["receiver_rps_median"] if intake else None
        row("end to end", "sustained msg/s, webhook -> reply", cq["throughput"], "intake limit (receiver req/s)",
            limit, "ratio >= 0.35", limit is not None and cq["throughput"] / limit >= 0.35, "msg/s")  # fmt: skip
        p99 = cq.get("paced_receipt_to_reply_p99_s")
        row("end to end", f"receipt-to-reply p99 at {cq['paced_intake_rps']:.0f} msg/s (p50 {cq['paced_receipt_to_reply_p50_s'] or 0:.3f} s)",
            p99, "", None, "p99 <= 1 s", p99 is not None and p99 <= 1.0, "s")  # fmt: skip

        def machine_ms(r: dict[str, Any]) -> float | None:  # services + Postgres + RabbitMQ
            cpu = r.get("cpu_ms_per_reply")
            return cpu and cpu["services"] + cpu["postgres"] + cpu["rabbitmq"]

        floor_run = pipe.get("floor")
        if floor_run:
            # The design's floor (bench/floor.py): its path and nothing else, the physical
            # limit of this architecture on this machine. chatqueue's gap to it is its own work.
            ratio = cq["throughput"] / floor_run["throughput"]
            row("floor", "chatqueue end-to-end msg/s (default settings) vs the floor of its design", cq["throughput"],
                "the floor (bench/floor.py)", floor_run["throughput"], "ratio >= 0.8", ratio >= 0.8, "msg/s")  # fmt: skip
        noshare = pipe.get("chatqueue-noshare")
        if noshare:
            ratio = cq["throughput"] / noshare["throughput"]
            row("end to end", "a lone account's flood, default settings, vs the fair share off", cq["throughput"],
                "ACCOUNT_JOBS_IN_FLIGHT=0", noshare["throughput"], "ratio >= 0.9", ratio >= 0.9, "msg/s")  # fmt: skip
        tuned = pipe.get("chatqueue-tuned")
        if tuned:
            row("end to end", "default settings vs the polls shortened", cq["throughput"],
                "COALESCER_POLL_SECONDS=0.05, RELAY_POLL_SECONDS=0.2", tuned["throughput"], "(context)", None,
                "msg/s")  # fmt: skip
        peers = (
            ("celery", "Celery, acks_late, confirms, 16 threads, prefetch 4", "ratio >= 1.5"),
            (
                "polling",
                "Postgres polling table, 64-row SKIP LOCKED claims, concurrent sends",
                "ratio >= 1.5",
            ),
            ("celery-basic", "Celery, acks_late, confirms, 8 threads, prefetch 1", "(context)"),
            ("polling-basic", "Postgres polling table, one row a claim", "(context)"),
        )
        for peer, label, goal in peers:
            if peer in pipe:
                ref = pipe[peer]["throughput"]
                met = cq["throughput"] / ref >= 1.5 if goal != "(context)" else None
                row("peers", f"chatqueue end-to-end msg/s vs {peer}", cq["throughput"], label, ref, goal, met,
                    "msg/s")  # fmt: skip
                mine, theirs = machine_ms(cq), machine_ms(pipe[peer])
                if mine and theirs:
                    # The goal is against the polling table; the others are context.
                    goal, met = ("ratio <= 1.0", mine <= theirs) if peer == "polling" else ("(context)", None)
                    row("peers", f"CPU ms per reply (services, Postgres, RabbitMQ) vs {peer}", mine,
                        label, theirs, goal, met, "ms")  # fmt: skip
        if floor_run:
            for peer in ("celery", "polling"):
                if peer in pipe:
                    row("floor", f"the floor's end-to-end msg/s vs {peer}", floor_run["throughput"], peer,
                        pipe[peer]["throughput"], "(context)", None, "msg/s")  # fmt: skip
            mine, floors = cq["cpu_ms_per_reply"], floor_run["cpu_ms_per_reply"]
            for part in ("receiver", "coalescer", "responder", "postgres", "rabbitmq", "harness"):
                if part in mine and part in floors:
                    row("floor", f"CPU ms per reply, {part}: chatqueue vs the floor", mine[part], "the floor",
                        floors[part], "(context)", None, "ms")  # fmt: skip
        writes = cq.get("row_writes")
        if writes:
            top = ", ".join(f"{t} {w['index_entries']:.1f}" for t, w in list(writes["per_table"].items())[:4])
            row("end to end", f"Postgres index entries written per reply, at most (most: {top})", writes["index_entries"],
                "", None, "(context)", None, "entries")  # fmt: skip
            row("end to end", "Postgres rows written per reply (inserted, updated, deleted)", writes["rows_written"],
                "", None, "(context)", None, "rows")  # fmt: skip
        for name, mb in cq["peak_rss_mb"].items():
            row(
                "memory", f"{name} peak RSS under end-to-end load", mb, "", None, "<= 150 MB", mb <= 150, "MB"
            )
    accounts = load("accounts.json")
    if accounts:
        row("accounts", f"{accounts['accounts']:,} accounts x {accounts['chats'] // accounts['accounts']} chats: bursts answered once",
            accounts["chats_answered"], "chats", accounts["chats"], "every one, once", accounts["answered_once"], "chats")  # fmt: skip
        row("accounts", "bursts answered twice (stored within the quiet time; "
            f"{accounts['bursts_split_at_the_door']} stored further apart got two)", accounts["bursts_answered_twice"],
            "", None, "0", accounts["bursts_answered_twice"] == 0, "bursts")  # fmt: skip
        row("accounts", "worst account's p99 receipt-to-reply", accounts["account_p99_worst_s"],
            "median account's p99", accounts["account_p99_median_s"], "ratio <= 2",
            accounts["fairness_ratio"] is not None and accounts["fairness_ratio"] <= 2, "s")  # fmt: skip
        for name, mb in accounts["peak_rss_mb"].items():
            row("accounts", f"{name} peak RSS with {accounts['accounts']:,} accounts", mb, "", None, "<= 150 MB",
                mb <= 150, "MB")  # fmt: skip
    burst = load("burst.json")
    if burst:
        low, high = burst["reply_delay_seconds"]
        row("burst", f"{burst['chats']:,} chats at once ({burst['accounts']} bots), pause {low:g}-{high:g} s: bursts answered",
            burst["chats_answered"], "chats", burst["chats"], "every one, once", burst["answered_once"], "chats")  # fmt: skip
        row("burst", f"bursts answered twice ({burst['bursts_split_at_the_door']} stored further apart got two)",
            burst["bursts_answered_twice"], "", None, "0", burst["bursts_answered_twice"] == 0, "bursts")  # fmt: skip
        lag = burst["emission_lag_p99_s"]
        row("burst", f"emission lag p99 (p50 {burst['emission_lag_p50_s']:.3f} s, max {burst['emission_lag_max_s']:.3f} s)",
            lag, "", None, "p99 <= 1 s", lag is not None and lag <= 1.0, "s")  # fmt: skip
        if "receipt_to_filing_p99_s" in burst:  # the lag's cause: the scheduler, or an account's full share
            row("burst", f"windows due while their account had {burst['settings']['account_jobs_in_flight']} jobs unfinished (held)",
                burst["windows_held_by_share"], "windows emitted", burst["windows_emitted"], "(context)", None,
                "windows")  # fmt: skip
            row("burst", "emission lag p99 of the windows not held (the scheduler's own)", burst["free_lag_p99_s"],
                "", None, "(context)", None, "s")  # fmt: skip
            row("burst", f"receipt-to-filing p99 (p50 {burst['receipt_to_filing_p50_s']:.1f} s), not in the lag",
                burst["receipt_to_filing_p99_s"], "", None, "(context)", None, "s")  # fmt: skip
        row("burst", f"receipt-to-reply p99 (p50 {burst['receipt_to_reply_p50_s']:.1f} s), the pause included",
            burst["receipt_to_reply_p99_s"], "", None, "(context)", None, "s")  # fmt: skip
        row("burst", f"seconds to post the {burst['messages']:,} messages", burst["posted_s"], "", None, "(context)",
            None, "s")  # fmt: skip
        for name, mb in burst["peak_rss_mb"].items():
            row("burst", f"{name} peak RSS", mb, "", None, "<= 150 MB", mb <= 150, "MB")
    return out


def table(items: list[dict[str, Any]]) -> str:
    def fmt(v: float | None) -> str:
        if v is None:
            return "-"
        return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"

    head = ("stage", "figure", "value", "reference (same run)", "ref", "ratio", "goal", "met")
    lines = [
        (
            i["stage"],
            i["figure"],
            f"{fmt(i['value'])} {i['unit']}".strip(),
            i["reference"] or "-",
            fmt(i["reference_value"]),
            f"{i['ratio']:.2f}" if i["ratio"] is not None else "-",
            i["goal"],
            {True: "yes", False: "NO", None: "-"}[i["met"]],
        )
        for i in items
    ]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *lines, strict=True)]
    render = ["  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)) for r in [head, *lines]]
    render.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(render)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--only",
        nargs="+",
        choices=list(STEPS),
        help="run only these (the table uses the last results of the rest)",
    )
    p.add_argument("--table-only", action="store_true", help="print the table from the last results")
    args = p.parse_args()
    failed = []
    if not args.table_only:
        for name, cmd in STEPS.items():
            if args.only and name not in args.only:
                continue
            print(f"== {name}", flush=True)
            started = time.monotonic()
            rc = subprocess.run([sys.executable, "-m", *cmd]).returncode
            print(f"   ({time.monotonic() - started:.0f} s, exit {rc})", flush=True)
            if rc:
                failed.append(name)
    items = rows()
    print()
    print(table(items))
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "bench.json").write_text(json.dumps({"rows": items, "failed_steps": failed}, indent=2))
    if failed:
        print(f"steps that failed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
