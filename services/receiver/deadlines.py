"""Slow clients cannot hold the receiver.

A client that opens a connection and sends its request's headers a byte at a time, or
its body so, holds a socket, a file descriptor and (for the body) a task for as long as
it likes: uvicorn's keep-alive timeout covers only the idle time between requests. Two
deadlines end that:

- the headers (``HeaderDeadlineProtocol``): from the connection's first byte, or the
  next request's, its headers must be complete within HTTP_HEADER_TIMEOUT_SECONDS, else
  the connection is answered 408 and closed; a connection that sends nothing is closed
  after the same time;
- the body (``BodyDeadline``): from the headers, the whole body within
  HTTP_BODY_TIMEOUT_SECONDS, else 408 and the connection closed.

HTTP_LIMIT_CONCURRENCY bounds the connections and requests one server holds: past it a
new request is answered 503 at once (uvicorn's ``limit_concurrency``), and the process's
file descriptor limit is raised to fit it where the hard limit allows
(``fit_file_descriptors``)."""

from __future__ import annotations

import asyncio
import json
import logging
import resource
import time
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from services.receiver.limits import ResponseTracker, answer_unless_started, reject

logger = logging.getLogger(__name__)

_TIMEOUT_408 = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
    b"content-length: %d\r\n\r\n%s"
)
#: File descriptors the process needs beside its HTTP connections: Postgres pools, the
#: broker, the account listener, log files, the platforms' and the alert clients.
OTHER_DESCRIPTORS = 256


def _timeout_body(message: str) -> bytes:
    return json.dumps({"error": {"code": "request_timeout", "message": message}}).encode()


class HeaderDeadlineProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a deadline on each request's headers (the class
    the server is given is ``header_deadline(seconds)``'s subclass)."""

    header_timeout_seconds: float = 10.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        # A connection that never sends a byte holds a descriptor too.
        self._arm_header_deadline()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        # A keep-alive connection's next request: its headers from its first byte (the
        # first request's deadline runs from the connection).
        self._arm_header_deadline()

    def on_headers_complete(self) -> None:
        self._disarm_header_deadline()
        super().on_headers_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_deadline()
        super().connection_lost(exc)

    def _arm_header_deadline(self) -> None:
        if self._header_deadline is None:
            self._header_deadline = self.loop.call_later(self.header_timeout_seconds, self._headers_too_slow)

    def _disarm_header_deadline(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _headers_too_slow(self) -> None:
        self._header_deadline = None
        if self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            return  # a request in progress (pipelined): its own body deadline holds it
        body = _timeout_body(f"the request's headers did not arrive within {self.header_timeout_seconds:g} s")
        self.transport.write(_TIMEOUT_408 % (len(body), body))
        self.transport.close()


def header_deadline(seconds: float) -> type[HeaderDeadlineProtocol]:
    """The protocol class for uvicorn's ``http`` with this header deadline."""
    return type("HeaderDeadlineProtocol", (HeaderDeadlineProtocol,), {"header_timeout_seconds": seconds})


class BodyDeadline:
    """The whole request body within ``seconds`` of the headers, else 408 (the
    connection closed): a body sent a byte at a time holds a task no longer."""

    def __init__(self, app: ASGIApp, seconds: float) -> None:
        self.app = app
        self.seconds = seconds

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        deadline = time.monotonic() + self.seconds
        body_done = False

        async def timed_receive() -> Message:
            nonlocal body_done
            if body_done:
                # After the body, a receive waits for the client to go (a disconnect): not timed.
                return await receive()
            remaining = deadline - time.monotonic()
            try:
                async with asyncio.timeout(max(remaining, 0)):
                    message = await receive()
            except TimeoutError:
                raise _BodyTooSlow from None
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_done = True
            return message

        message = f"the request's body did not arrive within {self.seconds:g} s"
        await answer_unless_started(
            self.app(scope, timed_receive, tracking := ResponseTracker(send)),
            tracking,
            _BodyTooSlow,
            lambda: reject(send, 408, "request_timeout", message),
        )


class _BodyTooSlow(Exception):
    pass


def fit_file_descriptors(connections: int) -> int:
    """Raise this process's soft file descriptor limit (``ulimit -n``) so that
    ``connections`` HTTP connections and the rest fit, as far as the hard limit allows;
    return the soft limit in force. A hard limit below it is logged: past it, accepting a
    connection fails (EMFILE) before HTTP_LIMIT_CONCURRENCY answers 503."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = connections + OTHER_DESCRIPTORS
    if soft != resource.RLIM_INFINITY and soft < wanted:
        target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        if target > soft:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        if soft < wanted:
            logger.warning(
                "the file descriptor limit (ulimit -n) is %d, below the %d that CHATQ_HTTP_LIMIT_CONCURRENCY=%d "
                "connections and the rest need: raise it (docker run --ulimit nofile=...) or lower the setting",
                soft,
                wanted,
                connections,
            )
    return int(soft)
