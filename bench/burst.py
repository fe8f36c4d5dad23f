"""10,000 chats bursting at once with the real reply pause (issue 20): ``--accounts``
Telegram bots x ``--chats`` chats (100 x 100), every chat a burst of 2 messages sent
together through the receiver, on the product's defaults but for the pause a seller sets:
CHATQ_QUIET_SECONDS 20, CHATQ_REPLY_DELAY_MIN_SECONDS 20 and _MAX_SECONDS 60 (pacing at
20 replies/s a bot, 16 jobs in flight an account, the scheduler's 0.5 s poll). The chats
are spread over 100 bots because one bot could not answer them in a pause: the platform
paces a bot to 20 replies/s and the fair share lets 16 of its jobs out at a time, so its
windows would wait in Postgres for minutes and the lag would measure that pacing, not the
coalescer. Goals: every burst answered once; emission lag (each window's closing after
its due time, as Postgres recorded both) p99 <= 1 s. Also: receipt-to-reply, the time
to post, each service's peak RSS. The measurement is bench.accounts'. Writes
bench/results/burst.json."""

from __future__ import annotations

import argparse
from typing import Any

from bench import accounts
from bench.pipeline import fake_platform_settings
from bench.support import bench_main


async def run(args: argparse.Namespace) -> dict[str, Any]:
    delay_min, delay_max = accounts.pause(args)
    return await accounts.run_with(
        args,
        fake_platform_settings,
        quiet_seconds=args.quiet,
        reply_delay_min_seconds=delay_min,
        reply_delay_max_seconds=delay_max,
    )


def arguments(p: argparse.ArgumentParser) -> None:
    accounts.arguments(p)
    p.set_defaults(accounts=100, chats=100, quiet=20.0, delay_min=20.0, delay_max=60.0)


if __name__ == "__main__":
    bench_main(__doc__, arguments, run, "burst.json")
