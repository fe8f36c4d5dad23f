"""The responder's aiohttp client against real sockets on loopback: what a platform's
answer, or its absence, means for a job is the same as it was through httpx."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import httpx
import pytest

from platforms.base import call
from platforms.failures import Failure, Kind
from platforms.generic.adapter import GenericPlatform
from platforms.http import PlatformHttp
from platforms.ratelimit import AccountRateLimiter
from platforms.telegram.adapter import TelegramPlatform

pytestmark = pytest.mark.unit

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@asynccontextmanager
async def server(handle: Handler) -> AsyncIterator[str]:
    """A raw HTTP server on a free loopback port: its base URL."""
    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.close()


async def read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        (
            int(line.split(b":")[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length")
        ),
        0,
    )
    return await reader.readexactly(length)


def answering(status: int, body: object, headers: dict[str, str] | None = None) -> Handler:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                await read_request(reader)
            except (asyncio.IncompleteReadError, ConnectionError):
                break
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
            writer.write(
                f"HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {len(data)}\r\n"
                f"{extra}\r\n".encode()
                + data
            )
            await writer.drain()
        writer.close()

    return handle


def client(read: float = 2.0) -> PlatformHttp:
    return PlatformHttp(httpx.Timeout(read, connect=1.0), max_connections=8)


async def failure_of(send: Awaitable[object]) -> Failure:
    with pytest.raises(Failure) as raised:
        await send
    return raised.value


async def failure_of_a_call(handle: Handler, *, read: float = 2.0) -> Failure:
    """The failure of one platform call to a server that handles it with ``handle``."""
    async with server(handle) as url:
        http = client(read=read)
        try:
            return await failure_of(call(http, None, "generic", "a", "POST", f"{url}/x", json={"a": 1}))
        finally:
            await http.aclose()


async def test_a_telegram_send_through_aiohttp_returns_the_platforms_message_id() -> None:
    async with server(answering(200, {"ok": True, "result": {"message_id": 77}})) as url:
        http = client()
        try:
            sent = await TelegramPlatform(url, "1:x", http, AccountRateLimiter(1000)).send(
                "1", "42", "hi", key="j"
            )
        finally:
            await http.aclose()
    assert sent.message_id == "77"


async def test_a_platform_nobody_listens_on_is_transient_nothing_was_sent() -> None:
    async with server(answering(200, {})) as url:
        pass  # closed: the port refuses connections now
    http = client()
    try:
        failure = await failure_of(call(http, None, "generic", "a", "POST", f"{url}/x", json={}))
    finally:
        await http.aclose()
    assert failure.kind is Kind.TRANSIENT


async def test_a_connection_closed_after_the_request_was_sent_is_unknown() -> None:
    async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.close()

    failure = await failure_of_a_call(hang_up)
    assert failure.kind is Kind.UNKNOWN
    assert "answer was lost" in failure.reason


async def test_an_answer_later_than_the_read_timeout_is_unknown() -> None:
    async def slow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await asyncio.sleep(2)
        writer.close()

    failure = await failure_of_a_call(slow, read=0.2)
    assert failure.kind is Kind.UNKNOWN


async def test_a_429_pauses_the_account_for_its_retry_after_and_is_transient() -> None:
    limiter = AccountRateLimiter(1000)
    answer = answering(429, {"error": "slow down"}, {"Retry-After": "7"})
    async with server(answer) as url:
        http = client()
        try:
            failure = await failure_of(
                GenericPlatform(f"{url}/r", None, http, limiter).send("a", "c", "hi", key="j")
            )
        finally:
            await http.aclose()
    assert failure.kind is Kind.TRANSIENT and failure.retry_after == 7
    assert 6 < limiter.delay("generic:a") <= 7


@pytest.mark.parametrize(
    ("status", "kind"), [(500, Kind.TRANSIENT), (503, Kind.TRANSIENT), (502, Kind.UNKNOWN)]
)
async def test_a_server_error_on_a_send_is_transient_and_a_gateways_is_unknown(
    status: int, kind: Kind
) -> None:
    async with server(answering(status, b"oops")) as url:
        http = client()
        try:
            platform = GenericPlatform(f"{url}/r", None, http, AccountRateLimiter(1000))
            failure = await failure_of(platform.send("a", "c", "hi", key="j"))
        finally:
            await http.aclose()
    assert failure.kind is kind
