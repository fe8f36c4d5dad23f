"""What a seller would build instead, at equal durability (nothing lost on kill -9), for
the end-to-end comparison in ``bench.pipeline``. Both take the same Telegram webhook and
send one reply per message to the same fake platform.

* Celery: a FastAPI webhook that publishes a task (publisher confirms, persistent, a
  quorum queue), a worker with ``acks_late`` and ``reject_on_worker_lost`` that posts the
  reply. At-least-once, no deduplication, no debounce. Tuned as a careful engineer would
  for short I/O-bound tasks: a threads pool of 16 and a prefetch of 4 a thread
  (``BENCH_CONCURRENCY``, ``BENCH_CELERY_PREFETCH``); the benchmark's "celery-basic" runs
  Celery's defaults for acks_late (8 threads, prefetch 1), as context.
* Polling table: a FastAPI webhook that inserts a row (unique on the message id), a
  worker whose loops each claim up to ``BENCH_BATCH`` (64) rows a statement with ``FOR
  UPDATE SKIP LOCKED``, send them concurrently (aiohttp, one session), and mark the ones
  sent done in one statement of the same transaction. "polling-basic" (context) claims
  one row a statement, as the first version of this peer did.

Run by the benchmark as processes: ``python -m bench.peers polling-receiver|polling-worker|
celery-receiver`` and ``celery -A bench.peers:celery_app worker``; configured by BENCH_*
variables (this is benchmark code, not a service).
"""

from __future__ import annotations

import asyncio
import os
import sys

import httpx
from fastapi import FastAPI, HTTPException, Request

SECRET = os.environ.get("BENCH_SECRET", "bench-secret")
PLATFORM = os.environ.get("BENCH_PLATFORM_URL", "http://127.0.0.1:1")
TOKEN = "4242:bench"
CONCURRENCY = int(os.environ.get("BENCH_CONCURRENCY", "8"))
#: Rows a polling loop claims a statement (1: the basic peer, one row and one send at a time).
BATCH = int(os.environ.get("BENCH_BATCH", "1"))
REPLY = "Thanks for your message! Yes, it is available; we deliver within 2 days."


def _message(update: dict) -> tuple[int, int, str]:
    m = update.get("message") or {}
    try:
        return int(m["chat"]["id"]), int(m["message_id"]), str(m.get("text", ""))
    except (KeyError, TypeError, ValueError) as exc:
        raise HTTPException(400, "not a message update") from exc


# ---- Celery ------------------------------------------------------------------------------

try:
    from celery import Celery
except ImportError:  # the polling peer does not need it
    Celery = None  # type: ignore[assignment,misc]

if Celery is not None:
    celery_app = Celery("chatq_bench_peer", broker=os.environ.get("BENCH_AMQP_URL", "amqp://localhost//"))
    celery_app.conf.update(
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        task_default_queue="bench.replies",
        task_default_queue_type="quorum",
        task_default_delivery_mode="persistent",
        worker_prefetch_multiplier=int(os.environ.get("BENCH_CELERY_PREFETCH", "1")),
        broker_transport_options={"confirm_publish": True},
        broker_connection_retry_on_startup=True,
        task_serializer="json",
        accept_content=["json"],
        task_ignore_result=True,
    )
    _client = httpx.Client(timeout=10)

    @celery_app.task(name="reply", autoretry_for=(httpx.HTTPError,), retry_backoff=1, max_retries=5)
    def reply(chat_id: int, message_id: int, text: str) -> None:
        r = _client.post(f"{PLATFORM}/bot{TOKEN}/sendMessage", json={"chat_id": chat_id, "text": REPLY})
        r.raise_for_status()


def celery_receiver() -> FastAPI:
    app = FastAPI()

    @app.post("/v1/webhooks/telegram")
    def webhook(update: dict, request: Request) -> dict:  # sync: kombu publishes blocking
        if request.headers.get("x-telegram-bot-api-secret-token") != SECRET:
            raise HTTPException(401, "bad secret")
        chat_id, message_id, text = _message(update)
        reply.apply_async(args=(chat_id, message_id, text))
        return {"ok": True}

    return app


# ---- Postgres polling table ----------------------------------------------------------------

POLLING_SCHEMA = """
CREATE TABLE IF NOT EXISTS bench_jobs (
    id         bigserial PRIMARY KEY,
    message_id bigint NOT NULL UNIQUE,
    chat_id    bigint NOT NULL,
    text       text NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    done_at    timestamptz
);
CREATE INDEX IF NOT EXISTS bench_jobs_pending ON bench_jobs (id) WHERE done_at IS NULL;
"""


def polling_receiver() -> FastAPI:
    import asyncpg

    app = FastAPI()
    state: dict[str, asyncpg.Pool] = {}

    @app.on_event("startup")
    async def start() -> None:
        state["pool"] = await asyncpg.create_pool(os.environ["BENCH_DATABASE_URL"], min_size=4, max_size=16)
        await state["pool"].execute(POLLING_SCHEMA)

    @app.post("/v1/webhooks/telegram")
    async def webhook(update: dict, request: Request) -> dict:
        if request.headers.get("x-telegram-bot-api-secret-token") != SECRET:
            raise HTTPException(401, "bad secret")
        chat_id, message_id, text = _message(update)
        await state["pool"].execute(
            "INSERT INTO bench_jobs (message_id, chat_id, text) VALUES ($1, $2, $3) ON CONFLICT DO NOTHING",
            message_id,
            chat_id,
            text,
        )
        return {"ok": True}

    return app


async def polling_worker_batched() -> None:
    """``CONCURRENCY`` loops, each claiming up to ``BATCH`` rows a statement and sending
    them concurrently; a row whose send failed stays for a later claim."""
    import aiohttp
    import asyncpg

    pool = await asyncpg.create_pool(
        os.environ["BENCH_DATABASE_URL"], min_size=CONCURRENCY, max_size=CONCURRENCY
    )
    await pool.execute(POLLING_SCHEMA)
    url = f"{PLATFORM}/bot{TOKEN}/sendMessage"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:

        async def send(chat_id: int) -> bool:
            try:
                async with session.post(url, json={"chat_id": chat_id, "text": REPLY}) as r:
                    await r.read()
                    return r.status < 300
            except (aiohttp.ClientError, TimeoutError):
                return False

        async def loop() -> None:
            while True:
                async with pool.acquire() as conn, conn.transaction():
                    rows = await conn.fetch(
                        "SELECT id, chat_id FROM bench_jobs WHERE done_at IS NULL ORDER BY id "
                        "FOR UPDATE SKIP LOCKED LIMIT $1",
                        BATCH,
                    )
                    if rows:
                        sent = await asyncio.gather(*(send(r["chat_id"]) for r in rows))
                        done = [r["id"] for r, ok in zip(rows, sent, strict=True) if ok]
                        await conn.execute("UPDATE bench_jobs SET done_at = now() WHERE id = ANY($1)", done)
                if not rows:
                    await asyncio.sleep(0.05)

        await asyncio.gather(*(loop() for _ in range(CONCURRENCY)))


async def polling_worker() -> None:
    import asyncpg

    if BATCH > 1:
        await polling_worker_batched()
        return

    pool = await asyncpg.create_pool(
        os.environ["BENCH_DATABASE_URL"], min_size=CONCURRENCY, max_size=CONCURRENCY
    )
    await pool.execute(POLLING_SCHEMA)
    async with httpx.AsyncClient(timeout=10) as client:

        async def loop() -> None:
            while True:
                async with pool.acquire() as conn, conn.transaction():
                    row = await conn.fetchrow(
                        "SELECT id, chat_id FROM bench_jobs WHERE done_at IS NULL ORDER BY id "
                        "FOR UPDATE SKIP LOCKED LIMIT 1"
                    )
                    if row is not None:
                        r = await client.post(
                            f"{PLATFORM}/bot{TOKEN}/sendMessage",
                            json={"chat_id": row["chat_id"], "text": REPLY},
                        )
                        r.raise_for_status()
                        await conn.execute("UPDATE bench_jobs SET done_at = now() WHERE id = $1", row["id"])
                if row is None:
                    await asyncio.sleep(0.05)

        await asyncio.gather(*(loop() for _ in range(CONCURRENCY)))


def main() -> None:
    import uvicorn

    role = sys.argv[1]
    port = int(os.environ.get("BENCH_PORT", "0"))
    if role == "polling-worker":
        asyncio.run(polling_worker())
    elif role in ("polling-receiver", "celery-receiver"):
        app = polling_receiver() if role == "polling-receiver" else celery_receiver()
        uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)
    else:
        sys.exit(f"unknown role {role}")


if __name__ == "__main__":
    main()
