"""Whatever reaches a dead-letter queue is recorded where a person sees it (invariant I8).

Each service consumes its own ``chatq.<service>.dead`` queue: the message is written to
``dead_letters`` (queue, message id, why, headers, body), counted, and handed to the
service's hook, which settles what the message stood for (the responder gives the job up
to a person; the coalescer fails the operation it could not file), so no chat waits on
a message nobody will process. Hooks are idempotent: a message usually got its give-up
before it was dead-lettered, and a recorder may see a message twice.
"""

from __future__ import annotations

import base64
import datetime as dt
import decimal
import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import asyncpg

from shared import metrics
from shared.broker.delivery import Delivery
from shared.retry import ERROR_HEADER

logger = logging.getLogger(__name__)

#: (message, reason in words) -> settle what the message stood for.
DeadHook = Callable[[Delivery, str], Awaitable[None]]


def dead_reason(headers: Mapping[str, Any] | None) -> str:
    """Why the broker dead-lettered a message, in words: its latest death (rejected,
    delivery_limit, expired) and where, plus the last error our consumer recorded.
    ``x-death`` lists deaths most recent first (a retry tier's expiry is one, too)."""
    headers = headers or {}
    deaths = headers.get("x-death")
    latest = deaths[0] if isinstance(deaths, list) and deaths and isinstance(deaths[0], dict) else {}
    why = _text(latest.get("reason") or headers.get("x-first-death-reason")) or "dead-lettered"
    queue = _text(latest.get("queue") or headers.get("x-first-death-queue"))
    reason = {"delivery_limit": "redelivered past the queue's delivery limit", "rejected": "rejected"}.get(
        why, why
    )
    text = f"{reason} in {queue}" if queue else reason
    last = _text(headers.get(ERROR_HEADER))
    return f"{text} (last error: {last})" if last else text


class DeadLetterRecorder:
    def __init__(self, pool: asyncpg.Pool, queue: str, on_dead: DeadHook | None = None) -> None:
        self._pool = pool
        self._queue = queue
        self._on_dead = on_dead

    async def handle(self, message: Delivery) -> None:
        """Consumer handler for a ``.dead`` queue."""
        reason = dead_reason(message.headers)
        if self._on_dead is not None:
            await self._on_dead(message, reason)
        await self._pool.execute(
            """
            INSERT INTO dead_letters (queue, message_id, reason, headers, body)
            VALUES ($1, $2, $3, $4::text::jsonb, $5)
            """,
            self._queue,
            message.message_id,
            reason[:1000],
            json.dumps(jsonable(dict(message.headers or {}))),
            message.body,
        )
        metrics.DEAD_LETTERS.labels(queue=self._queue).inc()
        logger.warning(
            "dead letter %s recorded from %s: %s",
            message.message_id,
            self._queue,
            reason,
            extra={"message_id": message.message_id, "queue": self._queue},
        )


def jsonable(value: Any) -> Any:
    """AMQP header values (bytes, timestamps, nested tables) as JSON."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            return base64.b64encode(value).decode()
    if isinstance(value, dt.datetime | dt.date):
        return value.isoformat()
    if isinstance(value, decimal.Decimal):
        return str(value)
    if value is None or isinstance(value, str | int | float | bool):
        return value
    return str(value)


def _text(value: Any) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return "" if value is None else str(value)
