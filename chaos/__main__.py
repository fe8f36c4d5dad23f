"""``make chaos``: every scenario of the fault campaign, then the accounting table.

Usage: python -m chaos [--short] [--messages N] [--chats N] [--only NAME]

The scenarios named "RabbitMQ cluster: ..." start a local three-node RabbitMQ cluster
(chaos.cluster) of their own beside the machine's RabbitMQ and remove it afterwards.
Exit status 1 when any scenario lost, duplicated or reordered a message.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from dataclasses import asdict
from pathlib import Path

from .runner import FULL, NODE_KILLED_ONCE, SHORT, Infra, run_scenario, table

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results"


async def main(args: argparse.Namespace) -> int:
    infra = Infra(args.admin_database_url, args.amqp_url, args.rabbitmq_api_url)
    scenarios = SHORT if args.short else FULL
    if args.only:  # any scenario, the short cluster one (inside make test) too
        scenarios = [s for s in [*FULL, NODE_KILLED_ONCE] if args.only in s.name]
    verdicts = []
    for scenario in scenarios:
        print(
            f"scenario: {scenario.name} ({args.messages} messages over {args.chats} chats in "
            f"{max(args.seconds, scenario.min_seconds):.0f} s)",
            flush=True,
        )
        v = await run_scenario(
            scenario, infra, messages=args.messages, chats=args.chats, duration=args.seconds
        )
        print(
            f"  {'pass' if v.ok else 'FAIL'}: lost {v.lost}, duplicated {v.duplicated}, out of order {v.out_of_order}",
            flush=True,
        )
        verdicts.append(v)
    print()
    print(table(verdicts))
    out = RESULTS
    out.mkdir(parents=True, exist_ok=True)
    (out / ("chaos-short.json" if args.short else "chaos.json")).write_text(
        json.dumps([asdict(v) for v in verdicts], indent=2)
    )
    return 0 if all(v.ok for v in verdicts) else 1


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--short", action="store_true", help="the variant that runs inside make test")
    p.add_argument("--messages", type=int, default=2000)
    p.add_argument("--chats", type=int, default=300)
    p.add_argument("--seconds", type=float, default=90, help="how long the load of each scenario lasts")
    p.add_argument("--only", help="run only scenarios whose name contains this")
    p.add_argument("--admin-database-url", default="postgresql://postgres@127.0.0.1:5432/postgres")
    p.add_argument("--amqp-url", default="amqp://guest:guest@127.0.0.1:5672/")
    p.add_argument("--rabbitmq-api-url", default="http://guest:guest@127.0.0.1:15672/api")
    sys.exit(asyncio.run(main(p.parse_args())))
