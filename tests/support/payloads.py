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
    kind: str = "message",
    chat_type: str | None = None,
    from_id: int | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """An Update carrying a message of ``kind`` (message, edited_message, channel_post,
    business_message, ...). The sender is the chat itself in a private chat, another user
    in a group (``from_id``), and nobody in a channel (the channel is ``sender_chat``)."""
    chat_type = chat_type or ("private" if chat_id > 0 else "supergroup")
    chat: dict[str, Any] = {"id": chat_id, "type": chat_type}
    message: dict[str, Any] = {
        "message_id": message_id if message_id is not None else update_id,
        "from": {"id": from_id or (chat_id if chat_id > 0 else 555), "is_bot": False, "first_name": "Buyer"},
        "chat": chat,
        "date": int(time.time()),
    }
    if chat_type == "channel":
        del message["from"]
        message["sender_chat"] = chat
    if text is not None:
        message["text"] = text
    message.update(extra)
    return {"update_id": update_id, kind: message}


def telegram_edit(
    update_id: int,
    *,
    message_id: int,
    chat_id: int = 1001,
    text: str = "Hello",
    edit_date: int | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """An ``edited_message`` update: message ``message_id`` of the chat, now reading ``text``."""
    return telegram_update(
        update_id,
        chat_id=chat_id,
        message_id=message_id,
        text=text,
        kind=extra.pop("kind", "edited_message"),
        edit_date=edit_date if edit_date is not None else int(time.time()),
        **extra,
    )


def telegram_business_update(
    update_id: int,
    *,
    connection: str = "biz-conn-1",
    customer: int = 3003,
    author: int | None = None,
    text: str | None = "Is it still available?",
    kind: str = "business_message",
    **extra: Any,
) -> dict[str, Any]:
    """A ``business_message`` in a business account's chat with ``customer``, written by the
    customer, or by ``author`` (the business account's owner)."""
    return telegram_update(
        update_id,
        chat_id=customer,
        from_id=author or customer,
        text=text,
        kind=kind,
        business_connection_id=connection,
        **extra,
    )


def telegram_photo(file_id: str = "ph-1") -> list[dict[str, Any]]:
    """A photo as Telegram sends it: its sizes, smallest first."""
    return [
        {"file_id": f"{file_id}-s", "file_unique_id": f"{file_id}-su", "width": 90, "height": 67},
        {
            "file_id": file_id,
            "file_unique_id": f"{file_id}-u",
            "width": 1280,
            "height": 960,
            "file_size": 98_000,
        },
    ]


def telegram_document(file_id: str = "doc-1") -> dict[str, Any]:
    return {
        "file_id": file_id,
        "file_unique_id": f"{file_id}-u",
        "file_name": "specs.pdf",
        "mime_type": "application/pdf",
    }


def bot_command(text: str) -> dict[str, Any]:
    """A command's ``entities`` as Telegram marks them: a bot_command at offset 0."""
    return {"entities": [{"type": "bot_command", "offset": 0, "length": len(text.split()[0])}]}


def avito_content(kind: str) -> dict[str, Any]:
    """A message's ``content`` as Avito's document gives it for ``kind`` (MessageContent):
    file, video, appCall and deleted messages come with an empty object."""
    sizes = {
        size: f"https://img.k.avito.ru/chat/{size}/5083651369.jpg"
        for size in ("1280x960", "640x480", "140x105")
    }
    contents: dict[str, dict[str, Any]] = {
        "text": {"text": "Is it still available?"},
        "image": {"image": {"sizes": sizes}},
        "voice": {"voice": {"voice_id": "voice-1"}},
        "location": {
            "location": {
                "kind": "street",
                "lat": 55.599799,
                "lon": 37.603954,
                "text": "Москва, Варшавское шоссе",
                "title": "Москва, Варшавское шоссе",
            }
        },
        "item": {
            "item": {
                "image_url": "https://avito.ru/image_url.webp",
                "item_url": "https://avito.ru/item_url",
                "price_string": "12 000 ₽",
                "title": "Велосипед",
            }
        },
        "link": {"link": {"text": "habr.com", "url": "habr.com"}},
        "call": {"call": {"status": "missed", "target_user_id": 777}},
        "system": {"text": "Покупатель оплатил заказ", "flow_id": "seller_audience_discount"},
    }
    return contents.get(kind, {})


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
