"""The floor of chatqueue's design: the path ``../shared/design.md`` draws for a message,
and nothing else, written as lean as we know how, for ``bench.pipeline`` to measure next
to chatqueue and its peers in the same run. It answers "how fast could any implementation
of this design be here": chatqueue's gap to the floor is its own bookkeeping, the floor's
gap to a peer is the design's.

What it keeps of the design, each step batched the way issue 20 asks:

* receiver: a Telegram webhook stored before its 2xx, an inbox row (unique on the
  platform's message id) and an outbox row in one transaction, concurrent webhooks group
  committed (what arrives while a batch commits joins the next, up to 64 rows);
* a relay in each writing process: outbox rows claimed with ``FOR UPDATE SKIP LOCKED``,
  published persistent to a quorum queue with publisher confirms (all of a claim in
  flight together), deleted once confirmed;
* hop one (the coalescer's place): a consumer with manual acks and prefetch that writes a
  job row and its outbox row for each message delivered together, in one transaction, then
  one ``multiple`` ack;
* hop two (the responder's place): a consumer that makes one platform call per job
  (aiohttp, concurrently for the jobs delivered together), records them in one statement,
  then one ``multiple`` ack.

What it leaves out is everything chatqueue does besides: windows and their pause, the
scheduler, the fair share, chat locks and order, the delivery intent before a send,
coverage (one reply per message), statuses and their record, the fold-in, retries,
dead letters, metrics. The webhook is a bare ASGI app (no framework), leaner than the
peers' FastAPI. So the floor is an upper bound on what chatqueue can reach, not a system
anyone should run: a crash between a send and its record sends again.

Run by the benchmark as processes: ``python -m bench.floor receiver|coalescer|responder``,
configured by BENCH_* variables like bench.peers (this is benchmark code, not a service).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import aio_pika
import aiohttp
import asyncpg
from aio_pika.abc import AbstractIncomingMessage

SECRET = os.environ.get("BENCH_SECRET", "bench-secret")
PLATFORM = os.environ.get("BENCH_PLATFORM_URL", "http://127.0.0.1:1")
TOKEN = "4242:bench"
REPLY = "Thanks for your message! Yes, it is available; we deliver within 2 days."
BATCH = 64
PREFETCH = 128
INBOUND, JOBS = "floor.inbound", "floor.jobs"

SCHEMA = """
CREATE TABLE IF NOT EXISTS floor_inbox (
    id          bigserial PRIMARY KEY,
    message_id  bigint NOT NULL UNIQUE,
    chat_id     bigint NOT NULL,
    text        text NOT NULL,
    received_at timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS floor_jobs (
    id         bigserial PRIMARY KEY,
    message_id bigint NOT NULL UNIQUE,
    chat_id    bigint NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    sent_at    timestamptz
);
CREATE TABLE IF NOT EXISTS floor_outbox (
    id    bigserial PRIMARY KEY,
    queue text NOT NULL,
    body  bytea NOT NULL
);
CREATE INDEX IF NOT EXISTS floor_outbox_queue ON floor_outbox (queue, id);
"""

# Stored and put in the outbox in one statement, so one round trip and one transaction.
_INTAKE = """
WITH ins AS (
    INSERT INTO floor_inbox (message_id, chat_id, text)
    SELECT * FROM unnest($1::bigint[], $2::bigint[], $3::text[])
    ON CONFLICT (message_id) DO NOTHING
    RETURNING message_id, chat_id
)
INSERT INTO floor_outbox (queue, body)
SELECT $4, convert_to(json_build_object('message_id', message_id, 'chat_id', chat_id)::text, 'UTF8') FROM ins
"""
_FILE = """
WITH ins AS (
    INSERT INTO floor_jobs (message_id, chat_id)
    SELECT * FROM unnest($1::bigint[], $2::bigint[])
    ON CONFLICT (message_id) DO NOTHING
    RETURNING message_id, chat_id
)
INSERT INTO floor_outbox (queue, body)
SELECT $3, convert_to(json_build_object('message_id', message_id, 'chat_id', chat_id)::text, 'UTF8') FROM ins
"""
_RECORD = "UPDATE floor_jobs SET sent_at = now() WHERE message_id = ANY($1::bigint[])"
_CLAIM = "SELECT id, body FROM floor_outbox WHERE queue = $1 ORDER BY id LIMIT 200 FOR UPDATE SKIP LOCKED"


async def _broker() -> tuple[aio_pika.abc.AbstractRobustConnection, aio_pika.abc.AbstractChannel]:
    connection = await aio_pika.connect_robust(os.environ["BENCH_AMQP_URL"])
    channel = await connection.channel(publisher_confirms=True)
    await channel.set_qos(prefetch_count=PREFETCH)
    for name in (INBOUND, JOBS):
        await channel.declare_queue(name, durable=True, arguments={"x-queue-type": "quorum"})
    return connection, channel


class Relay:
    """Publish one queue's committed outbox rows: claim, publish with confirms, delete."""

    def __init__(self, pool: asyncpg.Pool, channel: aio_pika.abc.AbstractChannel, queue: str) -> None:
        self._pool, self._channel, self._queue = pool, channel, queue
        self._wake = asyncio.Event()

    def notify(self) -> None:
        self._wake.set()

    async def run(self) -> None:
        exchange = self._channel.default_exchange
        while True:
            self._wake.clear()
            while True:
                async with self._pool.acquire() as conn, conn.transaction():
                    rows = await conn.fetch(_CLAIM, self._queue)
                    if not rows:
                        break
                    await asyncio.gather(
                        *(
                            exchange.publish(
                                aio_pika.Message(
                                    r["body"],
                                    message_id=str(r["id"]),
                                    delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                                ),
                                routing_key=self._queue,
                            )
                            for r in rows
                        )
                    )
                    await conn.execute(
                        "DELETE FROM floor_outbox WHERE id = ANY($1::bigint[])", [r["id"] for r in rows]
                    )
            try:
                await asyncio.wait_for(self._wake.wait(), 0.2)
            except TimeoutError:
                pass


class Batches:
    """Run ``handle`` on the items queued together (up to BATCH, what arrives within 2 ms of
    the first); one batch at a time, so what arrives meanwhile forms the next."""

    def __init__(self, handle: Callable[[list[Any]], Awaitable[None]]) -> None:
        self._handle = handle
        self._items: asyncio.Queue[Any] = asyncio.Queue()

    def put(self, item: Any) -> None:
        self._items.put_nowait(item)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = [await self._items.get()]
            deadline = loop.time() + 0.002
            while len(batch) < BATCH:
                if self._items.empty():
                    remaining = deadline - loop.time()
                    if remaining <= 0:
                        break
                    try:
                        batch.append(await asyncio.wait_for(self._items.get(), remaining))
                    except TimeoutError:
                        break
                else:
                    batch.append(self._items.get_nowait())
            await self._handle(batch)


# ---- receiver --------------------------------------------------------------------------


def receiver_app(state: dict[str, Any]) -> Callable[..., Awaitable[None]]:
    async def respond(send: Callable[..., Awaitable[None]], status: int, body: bytes) -> None:
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})  # fmt: skip
        await send({"type": "http.response.body", "body": body})

    async def app(scope: dict[str, Any], receive: Callable[..., Awaitable[Any]], send: Callable[..., Awaitable[None]]) -> None:  # fmt: skip
        if scope["type"] == "lifespan":
            while True:
                kind = (await receive())["type"]
                await send({"type": kind + ".complete"})  # lifespan.startup / lifespan.shutdown
                if kind == "lifespan.shutdown":
                    return
        if scope["method"] != "POST" or scope["path"] != "/v1/webhooks/telegram":
            await respond(send, 200 if scope["method"] == "GET" else 404, b"{}")
            return
        if dict(scope["headers"]).get(b"x-telegram-bot-api-secret-token") != SECRET.encode():
            await respond(send, 401, b'{"ok":false}')
            return
        body = b""
        while True:
            event = await receive()
            body += event.get("body", b"")
            if not event.get("more_body"):
                break
        try:
            m = json.loads(body)["message"]
            row = (int(m["message_id"]), int(m["chat"]["id"]), str(m.get("text", "")))
        except (ValueError, KeyError, TypeError):
            await respond(send, 400, b'{"ok":false}')
            return
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        state["intake"].put((row, done))
        await done
        await respond(send, 200, b'{"ok":true}')

    return app


async def receiver() -> None:
    import uvicorn

    pool = await asyncpg.create_pool(os.environ["BENCH_DATABASE_URL"], min_size=2, max_size=4)
    _, channel = await _broker()
    relay = Relay(pool, channel, INBOUND)

    async def store(batch: list[tuple[tuple[int, int, str], asyncio.Future[None]]]) -> None:
        rows = [row for row, _ in batch]
        try:
            await pool.execute(
                _INTAKE, [r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows], INBOUND
            )
        except Exception as exc:  # the batch's requests fail with it (a 500 each)
            for _, done in batch:
                done.set_exception(exc)
            return
        relay.notify()
        for _, done in batch:
            done.set_result(None)

    intake = Batches(store)
    tasks = [asyncio.create_task(intake.run()), asyncio.create_task(relay.run())]
    config = uvicorn.Config(receiver_app({"intake": intake}), host="127.0.0.1", port=int(os.environ["BENCH_PORT"]),
                            log_level="warning", access_log=False)  # fmt: skip
    await uvicorn.Server(config).serve()
    for t in tasks:
        t.cancel()


# ---- the two hops ------------------------------------------------------------------------


async def consume(
    queue: str,
    handle: Callable[[asyncpg.Pool, list[AbstractIncomingMessage]], Awaitable[None]],
    relay_to: str | None = None,
) -> None:
    """Consume ``queue`` in batches: ``handle`` each (its writes committed), then one
    ``multiple`` ack. With ``relay_to``, a relay publishes that queue's outbox rows, woken
    after each batch."""
    pool = await asyncpg.create_pool(os.environ["BENCH_DATABASE_URL"], min_size=2, max_size=4)
    _, channel = await _broker()
    relay = Relay(pool, channel, relay_to) if relay_to else None
    relay_task = asyncio.create_task(relay.run()) if relay else None

    async def each(batch: list[AbstractIncomingMessage]) -> None:
        await handle(pool, batch)
        if relay:
            relay.notify()
        await batch[-1].ack(multiple=True)  # one batch at a time, in delivery order

    batches = Batches(each)
    await (await channel.get_queue(queue)).consume(batches.put)
    try:
        await batches.run()
    finally:
        if relay_task:
            relay_task.cancel()


async def coalescer() -> None:
    async def file(pool: asyncpg.Pool, batch: list[AbstractIncomingMessage]) -> None:
        rows = [json.loads(m.body) for m in batch]
        await pool.execute(_FILE, [r["message_id"] for r in rows], [r["chat_id"] for r in rows], JOBS)

    await consume(INBOUND, file, relay_to=JOBS)


async def responder() -> None:
    session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))
    url = f"{PLATFORM}/bot{TOKEN}/sendMessage"

    async def send(chat_id: int) -> None:
        async with session.post(url, json={"chat_id": chat_id, "text": REPLY}) as r:
            r.raise_for_status()
            await r.read()

    async def reply(pool: asyncpg.Pool, batch: list[AbstractIncomingMessage]) -> None:
        rows = [json.loads(m.body) for m in batch]
        await asyncio.gather(*(send(r["chat_id"]) for r in rows))
        await pool.execute(_RECORD, [r["message_id"] for r in rows])

    await consume(JOBS, reply)


async def prepare(db_url: str) -> None:
    """The floor's tables, once, before its processes start."""
    conn = await asyncpg.connect(db_url)
    try:
        await conn.execute(SCHEMA)
    finally:
        await conn.close()


def main() -> None:
    import uvloop

    roles = {"receiver": receiver, "coalescer": coalescer, "responder": responder}
    role = sys.argv[1] if len(sys.argv) > 1 else ""
    if role not in roles:
        sys.exit(f"usage: python -m bench.floor {'|'.join(roles)}")
    uvloop.run(roles[role]())


if __name__ == "__main__":
    main()
