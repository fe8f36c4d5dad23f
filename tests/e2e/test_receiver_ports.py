"""The receiver as a process with CHATQ_ADMIN_PORT: two HTTP servers in one event loop,
the chatq CLI finding the admin one by default, and SIGTERM draining both."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import asyncpg
import httpx
import pytest

from tests.conftest import ADMIN_TOKEN, TELEGRAM_SECRET, replace
from tests.support.payloads import dumps, telegram_update
from tests.support.processes import ROOT, Receiver, free_port

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("clean")]


@pytest.fixture
async def receiver(settings):
    r = await Receiver(replace(settings, relay_enabled=False), admin_port=free_port()).start()
    yield r
    await r.stop()


async def test_the_ports_split_the_webhooks_from_the_admin_surface_and_the_cli_finds_the_admin_port(
    receiver: Receiver,
) -> None:
    async with httpx.AsyncClient(timeout=10) as client:
        r = await client.post(
            f"{receiver.url}/v1/webhooks/telegram",
            json=telegram_update(1),
            headers={"X-Telegram-Bot-Api-Secret-Token": TELEGRAM_SECRET},
        )
        assert r.status_code == 200
        for path in ("/v1/stats", "/metrics/", "/ops", "/sandbox", "/openapi.json"):
            refused = await client.get(f"{receiver.url}{path}")
            assert refused.status_code == 404, path
            assert refused.json()["error"]["code"] == "not_found"
            assert (await client.get(f"{receiver.admin_url}{path}")).status_code in (200, 401), path
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHATQ_")}
    env.update(
        CHATQ_HTTP_PORT=str(receiver.port),
        CHATQ_ADMIN_PORT=str(receiver.admin_port),
        CHATQ_ADMIN_TOKEN=ADMIN_TOKEN,
    )
    stats = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "chatq.cli", "--env-file", os.devnull, "stats", "--json"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=60,
    )
    assert stats.returncode == 0, stats.stderr
    assert json.loads(stats.stdout)["last_24h"]["received"] == 1


async def expect_continue(
    port: int, path: str, body: bytes
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Send a request's headers with ``Expect: 100-continue`` and wait for the 100: from
    then on the request is in flight (the app is reading its body)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head = (
        f"POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
        f"X-Telegram-Bot-Api-Secret-Token: {TELEGRAM_SECRET}\r\n"
        f"Content-Length: {len(body)}\r\nExpect: 100-continue\r\n\r\n"
    )
    writer.write(head.encode())
    await writer.drain()
    interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=10)
    assert interim.startswith(b"HTTP/1.1 100"), interim
    return reader, writer


async def refuses_connections(port: int, *, within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    while True:
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
        except ConnectionRefusedError:
            return
        writer.close()
        if time.monotonic() > deadline:
            raise AssertionError(f"port {port} still accepts connections after SIGTERM")
        await asyncio.sleep(0.05)


async def finish(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, body: bytes) -> int:
    writer.write(body)
    await writer.drain()
    response = await asyncio.wait_for(reader.read(65536), timeout=10)
    writer.close()
    return int(response.split(b" ", 2)[1])


async def test_sigterm_stops_both_ports_accepting_and_lets_requests_in_flight_on_each_finish(
    receiver: Receiver, pool: asyncpg.Pool
) -> None:
    webhook = dumps(telegram_update(7, chat_id=4242, text="in flight"))
    sandbox = json.dumps({"chat_id": "drain", "text": "in flight too"}).encode()
    public = await expect_continue(receiver.port, "/v1/webhooks/telegram", webhook)
    assert receiver.admin_port is not None
    admin = await expect_continue(receiver.admin_port, "/v1/sandbox/messages", sandbox)
    assert receiver.proc is not None
    receiver.proc.send_signal(signal.SIGTERM)
    await refuses_connections(receiver.port)
    await refuses_connections(receiver.admin_port)
    assert await finish(*public, webhook) == 200
    assert await finish(*admin, sandbox) == 202
    assert await receiver.wait_exit(within=20) == 0, receiver.log()
    texts = {r["text"] for r in await pool.fetch("SELECT text FROM operations")}
    assert texts == {"in flight", "in flight too"}
    assert "receiver stopped" in receiver.log()


async def test_in_production_a_receiver_without_an_admin_port_refuses_to_start_and_says_why(settings) -> None:
    production = replace(
        settings, env="production", amqp_url="amqp://chatq:Hs8dJ3kq0PzX5nVb@127.0.0.1:1/", relay_enabled=False
    )
    receiver = await Receiver(production).start(wait_healthy=False)
    try:
        assert await receiver.wait_exit(within=30) == 1, receiver.log()
        assert "settings refused: the production guards require CHATQ_ADMIN_PORT" in receiver.log()
        assert "Traceback" not in receiver.log()
    finally:
        await receiver.stop()
