"""The admin API's read side: an operation's status in words a person reads."""

from __future__ import annotations

import hmac
import uuid
from datetime import UTC, datetime
from typing import Any

import asyncpg
from fastapi import APIRouter, Request

from .errors import ApiError

STATUS_TEXT = {
    "accepted": "received and stored; about to be handed to the bot",
    "queued": "stored and queued for the bot",
    "waiting": "waiting for the buyer to finish typing",
    "replying": "the bot is writing the reply",
    "replied": "reply sent",
    "failed": "gave up",
    "needs_review": "send outcome unknown — check the chat and resolve",
    "ignored": "not for the bot",
}


def status_text(status: str, reason: str | None, replied_at: datetime | None = None) -> str:
    if status == "replied" and replied_at is not None:
        return f"reply sent at {replied_at.astimezone(UTC):%H:%M} UTC"
    text = STATUS_TEXT.get(status, status)
    return f"{text}: {reason}" if reason else text


def require_admin(request: Request) -> None:
    """Bearer ADMIN_TOKEN, compared in constant time. No token configured: API off."""
    expected: str | None = request.app.state.admin_token
    if expected is None:
        raise ApiError(404, "admin_api_disabled", "the admin API is off: set CHATQ_ADMIN_TOKEN")
    header = request.headers.get("authorization", "")
    scheme, _, presented = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(presented.strip().encode(), expected.encode()):
        raise ApiError(401, "unauthorized", "missing or wrong bearer token")


router = APIRouter()


@router.get("/v1/operations/{operation_id}")
async def get_operation(operation_id: str, request: Request) -> dict[str, Any]:
    require_admin(request)
    try:
        op_id = uuid.UUID(operation_id)
    except ValueError:
        raise ApiError(400, "bad_operation_id", "operation ids are UUIDs") from None
    pool: asyncpg.Pool = request.app.state.pool
    row = await pool.fetchrow(
        """
        SELECT o.id, o.platform, o.account_id, o.chat_id, o.message_id, o.author_id, o.text, o.sent_at,
               o.status, o.status_reason, o.received_at, o.updated_at,
               j.id AS job_id, j.status AS job_status, j.attempts, j.reply_text, j.platform_message_id,
               j.sent_at AS reply_sent_at, j.error_kind, j.error_message, j.owner
        FROM operations o LEFT JOIN reply_jobs j ON j.id = o.job_id
        WHERE o.id = $1
        """,
        op_id,
    )
    if row is None:
        raise ApiError(404, "operation_not_found", f"no operation {op_id}")
    return operation_document(row)


def operation_document(row: asyncpg.Record) -> dict[str, Any]:
    now = datetime.now(UTC)
    status = row["status"]
    reason = row["status_reason"]
    error = None
    if status in ("failed", "needs_review") or (row["error_message"] and status != "replied"):
        error = {
            "kind": row["error_kind"] or status,
            "message": row["error_message"] or reason,
            "attempts": row["attempts"],
        }
    reply = None
    if row["reply_text"] is not None and row["job_status"] == "sent":
        reply = {
            "text": row["reply_text"],
            "platform_message_id": row["platform_message_id"],
            "sent_at": _iso(row["reply_sent_at"]),
        }
    return {
        "id": str(row["id"]),
        "platform": row["platform"],
        "chat": {"account_id": row["account_id"], "chat_id": row["chat_id"]},
        "message": {
            "id": row["message_id"],
            "author_id": row["author_id"],
            "text": row["text"],
            "sent_at": _iso(row["sent_at"]),
        },
        "status": status,
        "status_text": status_text(status, reason, row["reply_sent_at"] if reply else None),
        "received_at": _iso(row["received_at"]),
        "updated_at": _iso(row["updated_at"]),
        "age_seconds": round((now - row["received_at"]).total_seconds(), 3),
        "job": {"id": str(row["job_id"]), "status": row["job_status"]} if row["job_id"] else None,
        "reply": reply,
        "error": error,
        "owner": row["owner"] if status == "needs_review" else None,
    }


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value else None
