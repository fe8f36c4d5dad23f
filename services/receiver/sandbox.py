"""The built-in sandbox platform: a chat page where a person types as a buyer and sees
the bot's one coalesced answer arrive after the human-like pause. Messages go through
the real intake (inbox + outbox), RabbitMQ, coalescer and responder; the responder's
sandbox adapter writes replies to ``sandbox_replies``, which this page reads. On in
development, off under the production guards unless CHATQ_SANDBOX_ENABLED=true, never with
CHATQ_ENV=production; it answers requests addressed to a loopback name only."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime
from typing import Any

import asyncpg
from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from platforms.inbound import ApiError, Intake, parse_json
from services.receiver.intake import store
from services.receiver.openapi import json_body
from services.receiver.pages import page
from shared import metrics
from shared.settings import is_loopback

ACCOUNT = "sandbox"

router = APIRouter()


class SandboxMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    chat_id: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    text: str = Field(min_length=1, max_length=4000)


def _require_sandbox(request: Request) -> None:
    """The sandbox is on (never in production), and the request names this machine in its
    Host: a page on another site whose name an attacker re-points at 127.0.0.1 (DNS
    rebinding) reaches the port with its own name, which is refused."""
    if not request.app.state.sandbox_active:
        raise ApiError(404, "sandbox_disabled", "the sandbox chat is off (CHATQ_SANDBOX_ENABLED)")
    if not is_loopback_name(request.headers.get("host", "")):
        raise ApiError(
            403,
            "sandbox_host_refused",
            "the sandbox answers requests addressed to localhost, 127.0.0.1 or [::1] only",
        )


def is_loopback_name(host_header: str) -> bool:
    """Whether a Host header names this machine: localhost (or a name under .localhost,
    which browsers never ask DNS for), 127.0.0.0/8 or ::1, with or without a port."""
    host = host_header.strip()
    if host.startswith("["):
        host = host[1 : host.find("]")] if "]" in host else ""
    elif host.count(":") == 1:
        host = host.split(":", 1)[0]
    name = host.rstrip(".").lower()
    return bool(name) and (is_loopback(name) or name.endswith(".localhost"))


@router.get("/sandbox", response_class=HTMLResponse, include_in_schema=False)
async def sandbox_page(request: Request) -> HTMLResponse:
    _require_sandbox(request)
    return page("sandbox.html")


@router.post("/v1/sandbox/messages", status_code=202, openapi_extra=json_body(SandboxMessage))
async def sandbox_message(request: Request) -> dict[str, Any]:
    _require_sandbox(request)
    # JSON only: a form a foreign page posts (text/plain, form-urlencoded) needs no CORS
    # preflight; application/json does.
    media = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media != "application/json":
        raise ApiError(415, "unsupported_media_type", "send the body as application/json")
    data, _ = parse_json(await request.body())
    try:
        msg = SandboxMessage.model_validate(data)
    except ValidationError as exc:
        metrics.WEBHOOKS.labels(platform="sandbox", outcome="rejected").inc()
        raise ApiError(
            422,
            "invalid_payload",
            "expected {chat_id, text}",
            details=[{"loc": list(e["loc"]), "msg": e["msg"]} for e in exc.errors()[:5]],
        ) from None
    message_id = str(uuid.uuid4())
    now = datetime.now(UTC)
    stored = await store(
        request.app.state.pool,
        Intake(
            platform="sandbox",
            account_id=ACCOUNT,
            event_id=message_id,
            chat_id=msg.chat_id,
            message_id=message_id,
            author_id="buyer",
            text=msg.text,
            sent_at=now,
            payload=json.dumps({"chat_id": msg.chat_id, "text": msg.text}),
        ),
    )
    metrics.WEBHOOKS.labels(platform="sandbox", outcome="accepted").inc()
    runtime = request.app.state.runtime
    if runtime.relay is not None:
        runtime.relay.notify()
    return {"operation_id": str(stored.operation_id), "status": stored.status}


@router.get("/v1/sandbox/chats/{chat_id}/messages")
async def sandbox_messages(chat_id: str, request: Request) -> dict[str, Any]:
    _require_sandbox(request)
    pool: asyncpg.Pool = request.app.state.pool
    rows = await pool.fetch(
        """
        SELECT 'buyer' AS author, text, received_at AS at,
               chatq_shown_status(status, id, platform, account_id, chat_id) AS status,
               id::text AS operation_id FROM operations
        WHERE platform = 'sandbox' AND account_id = $1 AND chat_id = $2
        UNION ALL
        SELECT 'bot', text, created_at, 'sent', NULL FROM sandbox_replies WHERE account_id = $1 AND chat_id = $2
        ORDER BY at
        LIMIT 500
        """,
        ACCOUNT,
        chat_id,
    )
    return {
        "messages": [
            {
                "from": r["author"],
                "text": r["text"],
                "at": r["at"].isoformat(),
                "status": r["status"],
                "operation_id": r["operation_id"],
            }
            for r in rows
        ]
    }
