"""Generic signed JSON webhooks (Standard Webhooks): any system can post a buyer message
as ``{account_id, chat_id, message_id, author_id, text, sent_at}``. The signature covers
``webhook-id.webhook-timestamp.body``; the timestamp must be within five minutes."""

from __future__ import annotations

import binascii

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, ValidationError, field_validator
from standardwebhooks.webhooks import Webhook, WebhookVerificationError

from platforms.inbound import ApiError, Intake


class GenericMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    account_id: str = Field(min_length=1, max_length=200)
    chat_id: str = Field(min_length=1, max_length=200)
    message_id: str = Field(min_length=1, max_length=200)
    author_id: str | None = Field(default=None, max_length=200)
    text: str = Field(min_length=1)
    #: With a time zone (a naive time would be read in whatever zone the host is in).
    sent_at: AwareDatetime

    @field_validator("account_id", "chat_id", "message_id", "author_id", mode="before")
    @classmethod
    def _ids_as_text(cls, v: object) -> object:
        # Many systems use numeric ids; they are identifiers, not numbers.
        if isinstance(v, int) and not isinstance(v, bool):
            return str(v)
        return v


def verifier(secret: str | None) -> Webhook | None:
    if secret is None:
        return None
    return Webhook(secret)


def authenticate(webhook: Webhook | None, body: bytes, headers: dict[str, str]) -> str:
    """Verify the signature; return the webhook-id."""
    if webhook is None:
        raise ApiError(
            404, "platform_not_configured", "generic webhooks are off: set CHATQ_GENERIC_WEBHOOK_SECRET"
        )
    try:
        webhook.verify(body, headers, json_parse=False)
    except WebhookVerificationError as exc:
        raise ApiError(401, "bad_signature", f"Standard Webhooks verification failed: {exc}") from None
    except (ValueError, binascii.Error, UnicodeDecodeError):
        raise ApiError(401, "bad_signature", "malformed webhook signature headers") from None
    return headers["webhook-id"]


def normalise(data: object, raw: str, webhook_id: str) -> Intake:
    try:
        msg = GenericMessage.model_validate(data)
    except ValidationError as exc:
        raise ApiError(
            422,
            "invalid_payload",
            "expected {account_id, chat_id, message_id, author_id, text, sent_at}",
            details=[{"loc": list(e["loc"]), "msg": e["msg"]} for e in exc.errors()[:10]],
        ) from None
    return Intake(
        platform="generic",
        account_id=msg.account_id,
        event_id=webhook_id,
        chat_id=msg.chat_id,
        message_id=msg.message_id,
        author_id=msg.author_id,
        text=msg.text,
        sent_at=msg.sent_at,
        payload=raw,
        ignored_reason=None if msg.text.strip() else "empty message",
    )
