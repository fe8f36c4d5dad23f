"""Request body cap, enforced before anything parses the body.

A declared Content-Length over the cap is refused at once; a body that streams past the
cap (chunked, or a Content-Length that lies) is cut off as soon as it does."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send


class BodySizeLimit:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    await reject(send, 400, "bad_request", "Content-Length is not a number")
                    return
                if declared > self.max_bytes:
                    await reject(send, 413, "body_too_large", self._too_large())
                    return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise _BodyTooLarge
            return message

        await answer_unless_started(
            self.app(scope, limited_receive, tracking := ResponseTracker(send)),
            tracking,
            _BodyTooLarge,
            lambda: reject(send, 413, "body_too_large", self._too_large()),
        )

    def _too_large(self) -> str:
        return f"request body is larger than {self.max_bytes} bytes"


class _BodyTooLarge(Exception):
    pass


class ResponseTracker:
    """An ASGI ``send`` that notes whether the response has started."""

    def __init__(self, send: Send) -> None:
        self.send = send
        self.started = False

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.started = True
        await self.send(message)


async def answer_unless_started(
    call: Awaitable[None],
    tracker: ResponseTracker,
    refusal: type[Exception],
    answer: Callable[[], Awaitable[None]],
) -> None:
    """Run the app; when it raises ``refusal`` before its response started, ``answer``
    instead (after it started, nothing more can be said: the server cuts the response)."""
    try:
        await call
    except refusal:
        if not tracker.started:
            await answer()


async def reject(send: Send, status: int, code: str, message: str) -> None:
    """A JSON error, and the connection closed after it."""
    body = json.dumps({"error": {"code": code, "message": message}}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
