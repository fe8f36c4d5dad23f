"""Webhook bodies and headers as the platforms send them."""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime
from typing import Any

from standardwebhooks.webhooks import Webhook


def telegram_update(
    update_id: int,
    *,
    chat_id: int = 1001,
    message_id: int | None = None,
    text: str | None = "Hello",
    **extra: Any,
) -> dict[str, Any]:
    message: dict[str, Any] = {
        "message_id": message_id if message_id is not None else update_id,
        "from": {"id": chat_id, "is_bot": False, "first_name": "Buyer"},
        "chat": {"id": chat_id, "type": "private"},
        "date": int(time.time()),
    }
    if text is not None:
        message["text"] = text
    message.update(extra)
    return {"update_id": update_id, "message": message}


def avito_webhook(
    message_id: str,
    *,
    user_id: int = 777,
    author_id: int = 555,
    chat_id: str = "u2i-chat-1",
    text: str | None = "Still available?",
    type_: str = "text",
) -> dict[str, Any]:
    content: dict[str, Any] = {"text": text} if text is not None else {}
    return {
        "id": f"evt-{message_id}",
        "version": "v3.0.0",
        "timestamp": int(time.time()),
        "payload": {
            "type": "message",
            "value": {
                "id": message_id,
                "chat_id": chat_id,
                "user_id": user_id,
                "author_id": author_id,
                "created": int(time.time()),
                "type": type_,
                "chat_type": "u2i",
                "content": content,
                "item_id": 42,
                "published_at": datetime.now(UTC).isoformat(),
            },
        },
    }


def generic_message(message_id: str, *, chat_id: str = "c1", text: str = "Do you deliver?") -> dict[str, Any]:
    return {
        "account_id": "shop-1",
        "chat_id": chat_id,
        "message_id": message_id,
        "author_id": "buyer-1",
        "text": text,
        "sent_at": datetime.now(UTC).isoformat(),
    }


def signed(secret: str, body: bytes, *, webhook_id: str, timestamp: float | None = None) -> dict[str, str]:
    ts = datetime.fromtimestamp(timestamp if timestamp is not None else time.time(), UTC)
    signature = Webhook(secret).sign(webhook_id, ts, body.decode())
    return {
        "webhook-id": webhook_id,
        "webhook-timestamp": str(int(ts.timestamp())),
        "webhook-signature": signature,
        "content-type": "application/json",
    }


def dumps(data: Any) -> bytes:
    return json.dumps(data).encode()
