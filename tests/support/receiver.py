"""The receiver in-process, for integration tests: the real app, lifespan and relay,
called through httpx's ASGI transport."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import httpx
from fastapi import FastAPI

from services.receiver.app import create_app
from shared.settings import Settings


@contextlib.asynccontextmanager
async def running_receiver(settings: Settings) -> AsyncIterator[tuple[FastAPI, httpx.AsyncClient]]:
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://receiver") as client:
            yield app, client
