"""Avito Messenger v3 webhooks. Avito cannot sign deliveries, so the URL carries a random
secret (``/v1/webhooks/avito/{secret}``). Dedupe on (user_id, value.id). Our own sent
messages come back (author_id == user_id) and are stored as ignored, as are system
messages, chats with Avito itself (chat_type a2u) and anything without text.

``message_intake`` is the one rule for an Avito message, whether a webhook brought it or
the poller found it in an unread chat (services/receiver/recovery.py)."""

from __future__ import annotations

import hmac

from pydantic import BaseModel, ConfigDict, ValidationError

from ..errors import ApiError
from ..intake import Intake, epoch_to_datetime


class _Model(BaseModel):
    model_config = ConfigDict(extra="allow")


class AvitoContent(_Model):
    text: str | None = None


class AvitoMessageValue(_Model):
    id: str
    chat_id: str
    user_id: int
    author_id: int
    created: int | None = None
    type: str
    chat_type: str | None = None
    content: AvitoContent | None = None


class AvitoPayload(_Model):
    type: str
    value: dict[str, object] | None = None


class AvitoWebhook(_Model):
    id: str | None = None
    version: str | None = None
    timestamp: int | None = None
    payload: AvitoPayload


def has_payload(data: object) -> bool:
    """Whether a body carries something to store: a JSON object with a ``payload``. Avito's
    subscription check posts ``{}``; that is answered 200 and stored nowhere."""
    return isinstance(data, dict) and "payload" in data


def authenticate(expected: str | None, presented: str) -> None:
    if expected is None:
        raise ApiError(
            404, "platform_not_configured", "Avito webhooks are off: set CHATQ_AVITO_WEBHOOK_SECRET"
        )
    if not hmac.compare_digest(presented.encode(), expected.encode()):
        raise ApiError(401, "bad_path_secret", "wrong secret in the Avito webhook URL")


def normalise(data: object, raw: str) -> Intake:
    try:
        hook = AvitoWebhook.model_validate(data)
        if hook.payload.type != "message":
            # Not a message: nothing identifies it but the delivery id.
            return _ignored_event(hook, raw)
        value = AvitoMessageValue.model_validate(hook.payload.value)
    except ValidationError as exc:
        raise ApiError(
            422,
            "invalid_payload",
            "not an Avito messenger webhook",
            details=[{"loc": list(e["loc"]), "msg": e["msg"]} for e in exc.errors()[:10]],
        ) from None
    if not value.chat_id or not value.id:
        raise ApiError(422, "invalid_payload", "Avito message without chat_id or id")
    return message_intake(
        account_id=str(value.user_id),
        chat_id=value.chat_id,
        message_id=value.id,
        author_id=value.author_id,
        kind=value.type,
        chat_type=value.chat_type,
        text=value.content.text if value.content else None,
        created=value.created,
        raw=raw,
    )


#: Avito's chat type for a chat between the user and Avito itself.
AVITO_CHAT_TYPE = "a2u"


def message_intake(
    *,
    account_id: str,
    chat_id: str,
    message_id: str,
    author_id: int,
    kind: str,
    chat_type: str | None,
    text: str | None,
    created: int | None,
    raw: str,
) -> Intake:
    """An Avito message as the inbox stores it: to answer, or ignored with the reason.
    ``account_id`` is the account's user_id (our side of the chat)."""
    reason: str | None = None
    written_by_account = str(author_id) == account_id and chat_type != AVITO_CHAT_TYPE
    if chat_type == AVITO_CHAT_TYPE:
        reason = "a chat with Avito itself (a2u): not answered"
    elif written_by_account:
        # Our own reply coming back, or the seller answering by hand: decided when stored.
        reason = "written by the account"
    elif kind == "system":
        reason = "Avito system message"
    elif kind != "text" or text is None:
        reason = f"unsupported message type ({kind})"
    elif not text.strip():
        reason = "empty message"
    return Intake(
        platform="avito",
        account_id=account_id,
        event_id=None,
        chat_id=chat_id,
        message_id=message_id,
        author_id=str(author_id),
        text=text,
        sent_at=epoch_to_datetime(created),
        payload=raw,
        ignored_reason=reason,
        written_by_seller=written_by_account,
    )


def _ignored_event(hook: AvitoWebhook, raw: str) -> Intake:
    value = hook.payload.value or {}
    user_id = value.get("user_id")
    kind = hook.payload.type or "unknown"
    return Intake(
        platform="avito",
        account_id=str(user_id) if isinstance(user_id, int) else "unknown",
        event_id=hook.id or None,
        chat_id=None,
        message_id=None,
        author_id=None,
        text=None,
        sent_at=None,
        payload=raw,
        ignored_reason=f"Avito event type {kind} is not answered",
    )
