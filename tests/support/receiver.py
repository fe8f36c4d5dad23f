"""The receiver in-process, for integration tests: the real apps, runtime and relay,
called through httpx's ASGI transport."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import httpx
from fastapi import FastAPI

from services.receiver.app import ReceiverApps, create_app
from shared.settings import Settings
from tests.support.service_roles import as_service


def client_of(app: FastAPI, host: str = "receiver") -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=f"http://{host}")


@contextlib.asynccontextmanager
async def running_receiver(
    settings: Settings, *, host: str = "receiver"
) -> AsyncIterator[tuple[ReceiverApps, httpx.AsyncClient]]:
    """The receiver running, and a client of the app on HTTP_PORT (everything, unless
    ADMIN_PORT is set; then ``client_of(receiver.admin)`` reaches the admin app), sending
    ``host`` as its Host (the sandbox answers "localhost" and loopback addresses only)."""
    receiver = create_app(as_service(settings, "receiver"))
    async with receiver.running(), client_of(receiver.public, host) as client:
        yield receiver, client
