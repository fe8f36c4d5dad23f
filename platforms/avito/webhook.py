"""Avito Messenger v3 webhooks. Avito cannot sign deliveries, so the URL carries a random
secret (``/v1/webhooks/avito/{secret}``). Dedupe on (user_id, value.id).

Every message Avito's document allows is stored and answered 200: the document marks no
field of a message's ``value`` required, so a missing one gets an explicit default that
the operation's record shows (``Intake.notes``), never a 422 that would lose the message.
Our own sent messages come back (author_id == user_id): an echo, or the seller answering
by hand (decided at storage), unless it is no one's typing (a system message, any
non-text message the account sent: an autoresponder's, Avito's on its behalf), which is
stored as ignored and steps nothing back. System messages, chats with Avito itself
(chat_type a2u) and deleted messages are stored as ignored. A buyer's photo, voice note,
location, listing or link is answered through its typed placeholder, or handed to a
person (``webhooks/media.py``).

``message_intake`` is the one rule for an Avito message, whether a webhook brought it or
the poller found it in a chat (services/receiver/recovery.py)."""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import uuid
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from platforms.inbound import ApiError, Intake, epoch_to_datetime
from platforms.media import AVITO_CONTENT_KEYS, avito_media


class _Model(BaseModel):
    model_config = ConfigDict(extra="allow")


class AvitoPayload(_Model):
    type: str | None = None
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


#: The account a message names no account for: the path's, or the environment's, decides.
UNKNOWN_ACCOUNT = "unknown"


def normalise(data: object, raw: str, account_hint: str | None = None) -> Intake:
    """The webhook as the inbox stores it. ``account_hint``: the account a message that
    names none is taken for (the webhook path's, or the environment's one Avito account),
    decided before anything else, so our own echo or the seller's message without a
    user_id is still known for the account's."""
    try:
        hook = AvitoWebhook.model_validate(data)
    except ValidationError as exc:
        raise ApiError(
            422,
            "invalid_payload",
            "not an Avito messenger webhook",
            details=[{"loc": list(e["loc"]), "msg": e["msg"]} for e in exc.errors()[:10]],
        ) from None
    if (hook.payload.type or "message") != "message" or not isinstance(hook.payload.value, dict):
        # Not a message: nothing identifies it but the delivery id.
        return _ignored_event(hook, raw, account_hint)
    value = hook.payload.value
    notes: list[str] = []
    if hook.payload.type is None:
        notes.append("payload.type missing: read as a message (it has a message's value)")
    user_id = _id(value.get("user_id"))
    if user_id is None and account_hint is not None:
        user_id = account_hint
        notes.append(f"user_id missing: taken as account {account_hint}, the webhook path's")
    chat_id = _id(value.get("chat_id"))
    message_id = _id(value.get("id"))
    nameless = message_id is None
    if message_id is None:
        if hook.id:
            message_id = f"evt:{hook.id}"
            notes.append("value.id missing: keyed by the delivery's id")
        else:
            # The message and when Avito says it sent the delivery: a copy of this delivery
            # is one message, two alike sent apart are two. (No time at all: each delivery
            # is its own; a person, who gets every nameless message, sees a copy twice
            # rather than a message never.)
            stamp = hook.timestamp if hook.timestamp is not None else uuid.uuid4().hex
            keyed = json.dumps([value, stamp], sort_keys=True, default=str)
            message_id = f"sha256:{hashlib.sha256(keyed.encode()).hexdigest()[:32]}"
            notes.append("value.id and the delivery's id missing: keyed by the message's content and time")
    author = value.get("author_id")
    author_id = author if isinstance(author, int) and not isinstance(author, bool) else None
    if author_id is None:
        notes.append("author_id missing: taken as the buyer's")
    content = value.get("content") if isinstance(value.get("content"), Mapping) else {}
    assert isinstance(content, Mapping)
    kind = value.get("type")
    if not isinstance(kind, str) or not kind:
        kind = next((k for k in AVITO_CONTENT_KEYS if isinstance(content.get(k), Mapping)), None) or (
            "text" if isinstance(content.get("text"), str) else "unknown"
        )
        notes.append(f"type missing: read as {kind} from its content")
    created = value.get("created")
    if not isinstance(created, int | float) or isinstance(created, bool):
        created = None
        notes.append("created missing: the time of receipt")
    chat_type = value.get("chat_type")
    intake = message_intake(
        account_id=user_id or UNKNOWN_ACCOUNT,
        chat_id=chat_id,
        message_id=message_id,
        author_id=author_id,
        kind=kind,
        chat_type=chat_type if isinstance(chat_type, str) else None,
        content=content,
        created=created,
        raw=raw,
        notes=tuple(notes),
    )
    if user_id is None and intake.ignored_reason is None:
        # No account to answer as: the environment has no single Avito account to take it for.
        return dataclasses.replace(
            intake,
            unreadable="Avito's message names no account (user_id missing): the bot cannot answer it",
            person_only=True,
        )
    if nameless and intake.ignored_reason is None and intake.chat_id is not None:
        # The poll, or a copy of it, would find it under its real id: never answered twice,
        # it goes to a person.
        return dataclasses.replace(
            intake,
            unreadable="Avito sent this message without its id: the bot cannot tell it from a copy of it",
            person_only=True,
        )
    return intake


def _id(value: object) -> str | None:
    """An id as Avito sends it (text, or a number): as text; None when missing or empty."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, str | int):
        return str(value) or None
    return None


#: Avito's chat type for a chat between the user and Avito itself.
AVITO_CHAT_TYPE = "a2u"
#: Why an account's message that is no one's typing does not step the bot back.
NOT_TYPED = "written for the account, not typed by the seller ({kind}): the bot does not step back"


def message_intake(
    *,
    account_id: str,
    chat_id: str | None,
    message_id: str,
    author_id: int | None,
    kind: str,
    chat_type: str | None,
    content: Mapping[str, Any],
    created: float | None,
    raw: str,
    notes: tuple[str, ...] = (),
) -> Intake:
    """An Avito message as the inbox stores it: to answer, ignored with the reason, or
    (``Intake.unreadable``) one the bot cannot answer alone. ``account_id`` is the account's
    user_id (our side of the chat)."""
    words = content.get("text") if isinstance(content.get("text"), str) else None
    described = avito_media(kind, content)
    media, link_words = described if described is not None else (None, None)
    text = media.text(link_words) if media is not None else words
    reason: str | None = None
    unreadable: str | None = None
    by_account = author_id is not None and str(author_id) == account_id and chat_type != AVITO_CHAT_TYPE
    # A takeover is of a chat: a message that names none cannot be one.
    written_by_account = by_account and kind == "text" and chat_id is not None
    if chat_type == AVITO_CHAT_TYPE:
        reason = "a chat with Avito itself (a2u): not answered"
    elif by_account and kind != "text":
        # An autoresponder's message, Avito's on the account's behalf, a file sent from a
        # CRM: the account's, but not the seller taking the chat over.
        reason = NOT_TYPED.format(kind=kind)
    elif by_account and chat_id is None:
        reason = "written by the account, in no chat it names"
    elif written_by_account:
        # Our own reply coming back, or the seller answering by hand: decided when stored.
        reason = "written by the account"
    elif kind == "system":
        reason = "Avito system message"
    elif kind == "deleted":
        reason = "deleted by its author"
    elif media is None and (text is None or not text.strip()):
        reason = "empty message"
    elif media is not None:
        unreadable = media.unreadable(link_words)
    person_only = chat_id is None and reason is None
    if person_only:
        unreadable = "Avito's message names no chat (chat_id missing): the bot cannot answer it"
    return Intake(
        platform="avito",
        account_id=account_id,
        event_id=None,
        chat_id=chat_id,
        message_id=message_id,
        author_id=str(author_id) if author_id is not None else None,
        text=text,
        sent_at=epoch_to_datetime(created),
        payload=raw,
        ignored_reason=reason,
        written_by_seller=written_by_account,
        unreadable=unreadable,
        person_only=person_only,
        notes=notes,
    )


def _ignored_event(hook: AvitoWebhook, raw: str, account_hint: str | None) -> Intake:
    value = hook.payload.value if isinstance(hook.payload.value, dict) else {}
    user_id = _id(value.get("user_id")) or account_hint
    kind = hook.payload.type or "unknown"
    return Intake(
        platform="avito",
        account_id=user_id or UNKNOWN_ACCOUNT,
        event_id=hook.id or None,
        chat_id=None,
        message_id=None,
        author_id=None,
        text=None,
        sent_at=None,
        payload=raw,
        ignored_reason=f"Avito event type {kind} is not answered",
    )
