"""Bad input that only a raw socket can send: lying Content-Length and chunked bodies
over the cap. Each gets a 4xx (or the connection closes), never a 5xx, and nothing is
written."""

from __future__ import annotations

import asyncio

import asyncpg
import pytest

from tests.conftest import TELEGRAM_SECRET, replace
from tests.support.processes import Receiver

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("clean")]

BODY = b'{"update_id": 1, "message": {"message_id": 1, "date": 1, "chat": {"id": 1, "type": "private"}, "text": "hi"}}'


def request(headers: dict[str, str], body: bytes) -> bytes:
    lines = [
        "POST /v1/webhooks/telegram HTTP/1.1",
        "Host: receiver",
        f"X-Telegram-Bot-Api-Secret-Token: {TELEGRAM_SECRET}",
        "Content-Type: application/json",
        *(f"{k}: {v}" for k, v in headers.items()),
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


async def exchange(port: int, data: bytes, *, half_close: bool = False) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    if half_close:
        writer.write_eof()
    try:
        return await asyncio.wait_for(reader.read(65536), timeout=10)
    except TimeoutError:
        return b""
    finally:
        writer.close()


def status_of(response: bytes) -> int | None:
    return int(response.split(b" ", 2)[1]) if response.startswith(b"HTTP/1.1 ") else None


@pytest.fixture
async def receiver(settings):
    r = await Receiver(replace(settings, relay_enabled=False, max_body_bytes=4096)).start()
    yield r
    await r.stop()


async def test_a_content_length_shorter_than_the_body_is_a_4xx_and_writes_nothing(
    receiver, pool: asyncpg.Pool
) -> None:
    response = await exchange(receiver.port, request({"Content-Length": "20"}, BODY))
    # The surplus bytes make the stream invalid HTTP: uvicorn refuses it before our code.
    assert status_of(response) == 400
    assert await pool.fetchval("SELECT count(*) FROM operations") == 0


async def test_a_content_length_longer_than_the_body_never_reaches_the_inbox(
    receiver, pool: asyncpg.Pool
) -> None:
    response = await exchange(receiver.port, request({"Content-Length": "500"}, BODY), half_close=True)
    status = status_of(response)
    assert status is None or 400 <= status < 500
    assert await pool.fetchval("SELECT count(*) FROM operations") == 0


async def test_a_chunked_body_over_the_cap_is_cut_off_with_413(receiver, pool: asyncpg.Pool) -> None:
    chunk = b"x" * 2048
    chunked = b"".join(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n" for _ in range(4)) + b"0\r\n\r\n"
    response = await exchange(receiver.port, request({"Transfer-Encoding": "chunked"}, chunked))
    assert status_of(response) == 413
    assert await pool.fetchval("SELECT count(*) FROM operations") == 0


async def test_a_declared_length_over_the_cap_is_refused_before_the_body_is_read(
    receiver, pool: asyncpg.Pool
) -> None:
    response = await exchange(receiver.port, request({"Content-Length": "999999"}, b"{"))
    assert status_of(response) == 413
    assert await pool.fetchval("SELECT count(*) FROM operations") == 0
