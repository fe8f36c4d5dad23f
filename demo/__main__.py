"""A scripted run of the whole pipeline (receiver, coalescer, responder as real
processes, on the local Postgres and RabbitMQ, in a throw-away database and vhost) with
short human-like delays, against in-repo fake platforms. It shows:

1. a burst of three messages answered once, after the pause (sandbox chat);
2. a duplicate webhook delivery stored once and answered once (Telegram);
3. a platform failure (503) retried and recovered (Telegram);
4. a permanent failure (400) shown as failed, with its reason (Telegram);

then prints a summary table and exits non-zero if any scenario did not end as expected.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from dataclasses import dataclass

import httpx

from bench.support import drop_database, fresh_database, private_vhost
from shared.settings import Settings
from tests.fakes.platforms import running_fakes
from tests.fakes.world import FakeWorld
from tests.support.payloads import telegram_update
from tests.support.processes import Receiver, Worker

TG_SECRET = "demo-telegram-secret"
ADMIN = "demo-admin-token"


@dataclass
class Outcome:
    scenario: str
    webhooks: int
    operations: int
    replies: int
    status: str
    detail: str
    ok: bool


def say(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


async def settle(client: httpx.AsyncClient, ops: list[str], deadline: float) -> list[dict]:
    while True:
        docs = [(await client.get(f"/v1/operations/{op}")).json() for op in ops]
        if (
            all(d["status"] in ("replied", "failed", "needs_review", "ignored") for d in docs)
            or time.monotonic() > deadline
        ):
            return docs
        await asyncio.sleep(0.3)


async def scenarios(receiver: Receiver, world: FakeWorld) -> list[Outcome]:
    deadline = time.monotonic() + 45
    headers = {"authorization": f"Bearer {ADMIN}"}
    tg = {"X-Telegram-Bot-Api-Secret-Token": TG_SECRET}
    out: list[Outcome] = []
    async with httpx.AsyncClient(base_url=receiver.url, headers=headers, timeout=10) as client:
        say("1. a buyer writes three messages in a row in the sandbox chat")
        burst = []
        for text in ("Hello!", "Is it still available?", "Do you deliver?"):
            r = await client.post("/v1/sandbox/messages", json={"chat_id": "demo-burst", "text": text})
            burst.append(r.json()["operation_id"])
            say(f"   buyer: {text}")
            await asyncio.sleep(0.3)

        say("2. Telegram delivers the same update twice")
        update = telegram_update(7001, chat_id=7001, text="What is the price?")
        dup = [(await client.post("/v1/webhooks/telegram", json=update, headers=tg)).json() for _ in range(2)]
        say(
            f"   first delivery: stored as {dup[0]['operation_id'][:8]}; second: duplicate={dup[1]['duplicate']}"
        )

        say("3. Telegram answers 429 (too many requests) once to the reply; the responder waits and retries")
        world.fail("telegram.send:7002", "429:1")
        r = await client.post(
            "/v1/webhooks/telegram",
            json=telegram_update(7002, chat_id=7002, text="Can I pick it up?"),
            headers=tg,
        )
        flaky = r.json()["operation_id"]

        say("4. Telegram refuses the reply for good (400 chat not found)")
        world.fail("telegram.send:7003", "400")
        r = await client.post(
            "/v1/webhooks/telegram", json=telegram_update(7003, chat_id=7003, text="Hello?"), headers=tg
        )
        broken = r.json()["operation_id"]

        say("waiting for the human-like pause and the replies…")
        b = await settle(client, burst, deadline)
        replies = [
            m
            for m in (await client.get("/v1/sandbox/chats/demo-burst/messages")).json()["messages"]
            if m["from"] == "bot"
        ]
        out.append(
            Outcome(
                "burst of 3 answered once",
                3,
                len({d["id"] for d in b}),
                len(replies),
                ",".join(sorted({d["status"] for d in b})),
                replies[0]["text"] if replies else "",
                len(replies) == 1
                and all(d["status"] == "replied" for d in b)
                and len({d["job"]["id"] for d in b}) == 1,
            )
        )
        (d,) = await settle(client, [dup[0]["operation_id"]], deadline)
        n = len(world.replies_to("7001"))
        out.append(
            Outcome(
                "duplicate delivery ignored",
                2,
                1 if dup[0]["operation_id"] == dup[1]["operation_id"] else 2,
                n,
                d["status"],
                "second delivery answered 200 as a duplicate",
                n == 1 and d["status"] == "replied" and dup[1]["duplicate"],
            )
        )
        (d,) = await settle(client, [flaky], deadline)
        n = len(world.replies_to("7002"))
        out.append(
            Outcome(
                "platform 429 retried, recovered",
                1,
                1,
                n,
                d["status"],
                "429 on the first send, retried after its retry-after",
                n == 1 and d["status"] == "replied",
            )
        )
        (d,) = await settle(client, [broken], deadline)
        out.append(
            Outcome(
                "permanent failure shown",
                1,
                1,
                len(world.replies_to("7003")),
                d["status"],
                d["status_text"],
                d["status"] == "failed" and "400" in d["status_text"],
            )
        )
    return out


def print_table(rows: list[Outcome]) -> None:
    headers = ("scenario", "webhooks", "operations", "replies", "status", "detail", "as expected")
    cells = [list(headers)] + [
        [
            r.scenario,
            str(r.webhooks),
            str(r.operations),
            str(r.replies),
            r.status,
            r.detail[:60],
            "yes" if r.ok else "NO",
        ]
        for r in rows
    ]
    widths = [max(len(c[i]) for c in cells) for i in range(len(headers))]
    for i, c in enumerate(cells):
        print("  ".join(v.ljust(w) for v, w in zip(c, widths, strict=True)).rstrip())
        if i == 0:
            print("  ".join("-" * w for w in widths))


async def main(args: argparse.Namespace) -> int:
    started = time.monotonic()
    name, db_url = await fresh_database(args.admin_database_url)
    try:
        async with private_vhost(args.amqp_url, args.rabbitmq_api_url) as amqp_url, running_fakes() as world:
            settings = Settings(
                database_url=db_url,
                amqp_url=amqp_url,
                telegram_webhook_secret=TG_SECRET,
                telegram_bot_token="4242:demo",
                telegram_api_base=world.url,
                admin_token=ADMIN,
                quiet_seconds=1.0,
                reply_delay_min_seconds=2.0,
                reply_delay_max_seconds=3.0,
                max_wait_seconds=6.0,
                retry_delays_seconds="1,2",
                max_attempts=3,
                coalescer_poll_seconds=0.2,
                relay_poll_seconds=0.2,
                platform_timeout_seconds=2.0,
                log_level="WARNING",
            )
            say("starting receiver, coalescer and responder (real processes) against fake platforms")
            receiver = await Receiver(settings).start()
            workers = [
                await Worker("coalescer", settings).start(),
                await Worker("responder", settings).start(),
            ]
            try:
                rows = await scenarios(receiver, world)
            finally:
                for p in (*workers, receiver):
                    await p.stop()
    finally:
        await drop_database(args.admin_database_url, name)
    print()
    print_table(rows)
    good = sum(r.ok for r in rows)
    print(f"\n{good} of {len(rows)} scenarios as expected in {time.monotonic() - started:.0f} s")
    return 0 if good == len(rows) else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--admin-database-url", default="postgresql://postgres@127.0.0.1:5432/postgres")
    parser.add_argument("--amqp-url", default="amqp://guest:guest@127.0.0.1:5672/")
    parser.add_argument("--rabbitmq-api-url", default="http://guest:guest@127.0.0.1:15672/api")
    sys.exit(asyncio.run(main(parser.parse_args())))
