"""Telegram Bot API webhooks: ``X-Telegram-Bot-Api-Secret-Token`` authenticates the call
(Telegram has no body signature). A message is deduplicated by (chat.id, message_id);
an update that carries no message by its ``update_id``."""

from __future__ import annotations

import hmac

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..errors import ApiError
from ..intake import Intake, epoch_to_datetime

SECRET_HEADER = "x-telegram-bot-api-secret-token"

#: The update kinds ``normalise`` answers: what ``chatq connect telegram`` asks Telegram to
#: deliver (setWebhook's allowed_updates), so nothing else costs a delivery.
ANSWERED_UPDATES = ("message",)

#: Update kinds that carry something; only ``message`` with text is answered.
_KNOWN_KINDS = (
    "edited_message",
    "channel_post",
    "edited_channel_post",
    "business_message",
    "callback_query",
    "inline_query",
    "my_chat_member",
    "chat_member",
    "chat_join_request",
    "message_reaction",
    "poll",
    "poll_answer",
    "pre_checkout_query",
    "shipping_query",
)
_MEDIA_KINDS = (
    "photo",
    "sticker",
    "voice",
    "video",
    "video_note",
    "audio",
    "document",
    "animation",
    "location",
    "contact",
    "poll",
    "dice",
    "venue",
)


class _Model(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class TelegramUser(_Model):
    id: int
    is_bot: bool = False


class TelegramChat(_Model):
    id: int
    type: str


class TelegramMessage(_Model):
    message_id: int
    date: int
    chat: TelegramChat
    from_: TelegramUser | None = Field(default=None, alias="from")
    text: str | None = None


class TelegramUpdate(_Model):
    update_id: int
    message: TelegramMessage | None = None


def authenticate(expected: str | None, presented: str | None) -> None:
    if expected is None:
        raise ApiError(
            404,
            "platform_not_configured",
            "Telegram webhooks are off: set CHATQ_TELEGRAM_WEBHOOK_SECRET",
        )
    if presented is None or not hmac.compare_digest(presented.encode(), expected.encode()):
        raise ApiError(401, "bad_secret_token", "missing or wrong X-Telegram-Bot-Api-Secret-Token")


def normalise(data: object, raw: str, account_id: str) -> Intake:
    try:
        update = TelegramUpdate.model_validate(data)
    except ValidationError as exc:
        raise ApiError(422, "invalid_payload", "not a Telegram Update", details=_errors(exc)) from None
    message = update.message
    if message is None:
        kind = next((k for k in _KNOWN_KINDS if k in (data if isinstance(data, dict) else {})), None)
        reason = f"update kind {kind} is not answered" if kind else "update carries no message"
        return Intake(
            "telegram", account_id, str(update.update_id), None, None, None, None, None, raw, reason
        )
    chat_id = str(message.chat.id)
    message_id = str(message.message_id)
    author = message.from_
    author_id = str(author.id) if author else None
    sent_at = epoch_to_datetime(message.date)
    reason = None
    if author is not None and author.is_bot:
        reason = "message from a bot"
    elif message.text is None:
        extra = message.model_extra or {}
        kind = next((k for k in _MEDIA_KINDS if k in extra), "non-text")
        reason = f"unsupported message type ({kind})"
    elif not message.text.strip():
        reason = "empty message"
    # A message is deduplicated by (chat, message id) alone, never by update_id: Telegram
    # may hand out update_ids again after a week without updates, and a repeated update_id
    # must never drop a different message.
    return Intake(
        "telegram", account_id, None, chat_id, message_id, author_id, message.text, sent_at, raw, reason
    )


def _errors(exc: ValidationError) -> list[dict[str, object]]:
    return [{"loc": list(e["loc"]), "msg": e["msg"]} for e in exc.errors()[:10]]
