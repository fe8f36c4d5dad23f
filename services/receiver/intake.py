"""Durable intake: one statement writes the inbox row and, for a message the bot will
answer, its outbox row. One statement is one transaction, and one round trip.

A repeat of an event already stored (same platform event id, or same platform message)
writes nothing and returns the stored operation.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime

import asyncpg

from shared.broker.topology import INBOUND_EXCHANGE, inbound_routing_key
from shared.messages import InboundMessage, chat_key

from .errors import ApiError


@dataclass(frozen=True)
class Intake:
    """A webhook normalised: either a message to answer, or an event to record as ignored."""

    platform: str
    account_id: str
    event_id: str | None
    chat_id: str | None
    message_id: str | None
    author_id: str | None
    text: str | None
    sent_at: datetime | None
    payload: str  # the body as received, verbatim
    ignored_reason: str | None = None

    def __post_init__(self) -> None:
        for name in ("account_id", "event_id", "chat_id", "message_id", "author_id", "text"):
            check_storable(name, getattr(self, name))
        if self.ignored_reason is None and (
            self.chat_id is None or self.message_id is None or self.text is None
        ):
            raise ValueError("an answerable message needs chat_id, message_id and text")


def check_storable(field: str, value: str | None) -> None:
    """Postgres text holds neither NUL nor lone surrogates: refuse them as bad input."""
    if value is None:
        return
    if "\x00" in value:
        raise ApiError(422, "invalid_payload", f"{field} contains a NUL character")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError(422, "invalid_payload", f"{field} is not valid Unicode") from None


@dataclass(frozen=True)
class Stored:
    operation_id: uuid.UUID
    status: str
    duplicate: bool


_STORE_SQL = """
WITH op AS (
    INSERT INTO operations (id, platform, account_id, event_id, chat_id, message_id,
                            author_id, text, sent_at, status, status_reason, received_at, payload)
    VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13::text::json)
    ON CONFLICT DO NOTHING
    RETURNING id, status
), ob AS (
    INSERT INTO outbox (exchange, routing_key, message_id, ordering_key, operation_id, body)
    SELECT $14, $15, $16, $17, op.id, $18 FROM op WHERE op.status = 'accepted'
)
SELECT id, status FROM op
"""

_EXISTING_SQL = """
SELECT id, status FROM operations
WHERE platform = $1 AND account_id = $2
  AND (event_id = $3 OR (chat_id = $4 AND message_id = $5))
LIMIT 1
"""


async def store(pool: asyncpg.Pool, intake: Intake) -> Stored:
    operation_id = uuid.uuid4()
    received_at = datetime.now(UTC)
    status = "ignored" if intake.ignored_reason else "accepted"
    body = b""
    routing_key = inbound_routing_key(intake.platform)
    ordering = ""
    if status == "accepted":
        assert intake.chat_id and intake.message_id and intake.text is not None
        message = InboundMessage(
            operation_id=operation_id,
            platform=intake.platform,  # type: ignore[arg-type]
            account_id=intake.account_id,
            chat_id=intake.chat_id,
            message_id=intake.message_id,
            author_id=intake.author_id,
            text=intake.text,
            sent_at=intake.sent_at or received_at,
            received_at=received_at,
        )
        body = message.to_bytes()
        ordering = chat_key(intake.platform, intake.account_id, intake.chat_id)
    try:
        row = await pool.fetchrow(
            _STORE_SQL,
            operation_id,
            intake.platform,
            intake.account_id,
            intake.event_id,
            intake.chat_id,
            intake.message_id,
            intake.author_id,
            intake.text,
            intake.sent_at,
            status,
            intake.ignored_reason,
            received_at,
            intake.payload,
            INBOUND_EXCHANGE,
            routing_key,
            str(operation_id),
            ordering,
            body,
        )
    except (asyncpg.DataError, asyncpg.InvalidTextRepresentationError) as exc:
        # E.g. a JSON escape Postgres cannot store (\u0000, a lone surrogate).
        raise ApiError(422, "invalid_payload", f"the body cannot be stored: {exc}") from None
    if row is not None:
        return Stored(row["id"], row["status"], duplicate=False)
    existing = await pool.fetchrow(
        _EXISTING_SQL,
        intake.platform,
        intake.account_id,
        intake.event_id,
        intake.chat_id,
        intake.message_id,
    )
    if existing is None:  # pragma: no cover - a conflict implies a committed row
        raise RuntimeError("insert conflicted but no stored operation was found")
    return Stored(existing["id"], existing["status"], duplicate=True)


def parse_json(body: bytes) -> tuple[object, str]:
    """Decode a JSON body strictly: UTF-8 and valid JSON, or a clear 400."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        raise ApiError(400, "invalid_utf8", "the body is not valid UTF-8") from None
    try:
        return json.loads(text), text
    except (json.JSONDecodeError, RecursionError):
        raise ApiError(400, "malformed_json", "the body is not valid JSON") from None


def epoch_to_datetime(seconds: float | int | None) -> datetime | None:
    if seconds is None:
        return None
    try:
        return datetime.fromtimestamp(seconds, UTC)
    except (OverflowError, OSError, ValueError):
        raise ApiError(422, "invalid_payload", "timestamp out of range") from None
