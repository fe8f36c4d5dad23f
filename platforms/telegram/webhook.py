"""Telegram Bot API webhooks: ``X-Telegram-Bot-Api-Secret-Token`` authenticates the call
(Telegram has no body signature). A message is deduplicated by (chat.id, message_id);
an update that carries no message by its ``update_id``.

What is answered: messages in the chat types CHATQ_TELEGRAM_CHAT_TYPES allows (private
chats by default; channel posts need ``channel``), whatever they carry: text, or a photo,
voice note, location, contact, sticker, file... as a typed placeholder before its caption
(``webhooks/media.py``; one the bot cannot read alone, a voice note without a caption,
goes to a person or is answered as the account's CHATQ_UNREADABLE_MESSAGES says); a
business account's customers' messages (Telegram Business), answered through its
connection; a message in a topic, answered in that topic (its chat is keyed
``<chat id>#<thread id>``); and edits of those, while a reply to the chat is still
pending. Everything else is stored as ignored with the reason: a business owner's own
messages ("written by the seller"), the business's automatic away, greeting and scheduled
messages (``is_from_offline``: no one took the chat over), our own replies echoed back,
bots, service messages, other update kinds. ``business_connection`` updates say whether
the bot may answer a connection's chats (``BusinessConnectionState``)."""

from __future__ import annotations

import hmac

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from platforms.inbound import (
    MAX_ID_LENGTH,
    ApiError,
    BusinessConnectionState,
    Intake,
    check_storable,
    epoch_to_datetime,
)
from platforms.media import telegram_media, telegram_service

SECRET_HEADER = "x-telegram-bot-api-secret-token"

#: The chat types answered unless CHATQ_TELEGRAM_CHAT_TYPES says otherwise.
DEFAULT_CHAT_TYPES = frozenset({"private"})

#: Update kinds that carry a Message the bot may answer, with the chat types their
#: messages come from: a channel's are channel posts, and business messages come from the
#: private chats of a business account connected to the bot (Telegram Business).
_MESSAGE_KINDS = {
    "message": frozenset({"private", "group", "supergroup"}),
    "edited_message": frozenset({"private", "group", "supergroup"}),
    "channel_post": frozenset({"channel"}),
    "edited_channel_post": frozenset({"channel"}),
    "business_message": frozenset({"private"}),
    "edited_business_message": frozenset({"private"}),
}
_BUSINESS_KINDS = ("business_message", "edited_business_message")


def answered_updates(chat_types: frozenset[str] = DEFAULT_CHAT_TYPES) -> tuple[str, ...]:
    """The update kinds ``normalise`` answers with these chat types, and with business
    messages the ``business_connection`` updates that say whether they may be answered:
    what ``chatq connect telegram`` asks Telegram to deliver (setWebhook's
    allowed_updates), so nothing else costs a delivery."""
    kinds = tuple(kind for kind, types in _MESSAGE_KINDS.items() if types & chat_types)
    return (*kinds, "business_connection") if "business_message" in kinds else kinds


#: ``answered_updates`` with the default chat types (private chats only).
ANSWERED_UPDATES = answered_updates()

#: Update kinds that carry no message the bot answers, named in the ignored reason.
_KNOWN_KINDS = (
    "deleted_business_messages",
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
WRITTEN_BY_SELLER = "written by the seller"
#: A business message our bot sent on the business's behalf: our own reply, echoed.
OURS = "sent by the bot on the business's behalf (our own reply)"
#: A business's automatic message, sent by Telegram on the owner's behalf.
OFFLINE = (
    "the business's automatic message (away, greeting or scheduled: is_from_offline): "
    "not the seller taking over"
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
    sender_chat: TelegramChat | None = None
    text: str | None = None
    caption: str | None = None
    edit_date: int | None = None
    business_connection_id: str | None = None
    sender_business_bot: TelegramUser | None = None
    is_from_offline: bool | None = None
    message_thread_id: int | None = None
    is_topic_message: bool | None = None


class TelegramBusinessRights(_Model):
    can_reply: bool | None = None


class TelegramBusinessConnection(_Model):
    id: str
    user: TelegramUser
    user_chat_id: int
    date: int
    is_enabled: bool
    rights: TelegramBusinessRights | None = None


class TelegramUpdate(_Model):
    update_id: int
    message: TelegramMessage | None = None
    edited_message: TelegramMessage | None = None
    channel_post: TelegramMessage | None = None
    edited_channel_post: TelegramMessage | None = None
    business_message: TelegramMessage | None = None
    edited_business_message: TelegramMessage | None = None
    business_connection: TelegramBusinessConnection | None = None


def authenticate(expected: str | None, presented: str | None) -> None:
    if expected is None:
        raise ApiError(
            404,
            "platform_not_configured",
            "Telegram webhooks are off: set CHATQ_TELEGRAM_WEBHOOK_SECRET",
        )
    if presented is None or not hmac.compare_digest(presented.encode(), expected.encode()):
        raise ApiError(401, "bad_secret_token", "missing or wrong X-Telegram-Bot-Api-Secret-Token")


def normalise(
    data: object, raw: str, account_id: str, chat_types: frozenset[str] = DEFAULT_CHAT_TYPES
) -> Intake:
    try:
        update = TelegramUpdate.model_validate(data)
    except ValidationError as exc:
        raise ApiError(422, "invalid_payload", "not a Telegram Update", details=_errors(exc)) from None
    if update.business_connection is not None:
        return _connection_intake(update.update_id, update.business_connection, raw, account_id)
    kind, message = next(
        ((k, m) for k in _MESSAGE_KINDS if (m := getattr(update, k)) is not None), (None, None)
    )
    if kind is None or message is None:
        known = next((k for k in _KNOWN_KINDS if k in (data if isinstance(data, dict) else {})), None)
        reason = f"update kind {known} is not answered" if known else "update carries no message"
        return Intake(
            "telegram", account_id, str(update.update_id), None, None, None, None, None, raw, reason
        )
    edit = kind.startswith("edited_")
    business = kind in _BUSINESS_KINDS
    connection = (message.business_connection_id or None) if business else None
    chat_id = str(message.chat.id)
    thread = topic_of(message)
    if thread is not None:
        # A topic is a conversation of its own: answered in it, keyed apart from the chat's
        # other topics (and its General one).
        chat_id = f"{chat_id}#{thread}"
    if connection is not None:
        # A business account's chat is not the bot's own chat with the same person, though
        # Telegram gives both the same id (and message ids of their own): keyed apart.
        chat_id = f"{chat_id}@{connection}"
    message_id = str(message.message_id)
    sent_at = epoch_to_datetime(message.date)
    if edit:
        # Its own key, so an edit never collides with the message it changes (or another
        # edit of it); it is answered only with a reply still pending (``intake.store``).
        edited = message.edit_date if message.edit_date is not None else f"u{update.update_id}"
        message_id = f"{message_id}:edit:{edited}"
        sent_at = epoch_to_datetime(message.edit_date) or sent_at
    author = message.from_
    author_id = str(author.id) if author else (str(message.sender_chat.id) if message.sender_chat else None)
    media = telegram_media(_extra(message)) if message.text is None else None
    text = media.text(message.caption) if media is not None else message.text
    ignored = _ignored(message, text, chat_types, business=business, connection=connection, edit=edit)
    unreadable = media.unreadable(message.caption) if media is not None and ignored is None else None
    # A message is deduplicated by (chat, message id) alone, never by update_id: Telegram
    # may hand out update_ids again after a week without updates, and a repeated update_id
    # must never drop a different message.
    return Intake(
        "telegram",
        account_id,
        None,
        chat_id,
        message_id,
        author_id,
        text,
        sent_at,
        raw,
        ignored,
        business_connection_id=connection,
        is_edit=edit,
        written_by_seller=ignored == WRITTEN_BY_SELLER,
        ours=ignored == OURS,
        unreadable=unreadable,
    )


def topic_of(message: TelegramMessage) -> int | None:
    """The topic a message was written in, to answer it there: a forum supergroup's topic
    (``is_topic_message``), or a private chat's with topics on. A reply thread in a group
    without topics also has a ``message_thread_id``; a reply sent to it would be refused."""
    if message.message_thread_id is None:
        return None
    if message.is_topic_message or message.chat.type == "private":
        return message.message_thread_id
    return None


def _connection_intake(
    update_id: int, connection: TelegramBusinessConnection, raw: str, account_id: str
) -> Intake:
    """A business_connection update: stored as ignored (for the record), and the
    connection's state for the receiver to keep."""
    check_storable("business_connection.id", connection.id)
    if len(connection.id) > MAX_ID_LENGTH:
        raise ApiError(
            422, "invalid_payload", f"business_connection.id is longer than {MAX_ID_LENGTH} characters"
        )
    if not connection.id:
        return Intake(
            "telegram", account_id, str(update_id), None, None, None, None, None, raw,
            "business_connection update without a connection id: nothing to follow",
        )  # fmt: skip
    can_reply = bool(connection.rights and connection.rights.can_reply)
    state = BusinessConnectionState(connection.id, str(connection.user.id), connection.is_enabled, can_reply)
    return Intake(
        "telegram",
        account_id,
        str(update_id),
        None,
        None,
        None,
        None,
        None,
        raw,
        f"Telegram Business connection {connection.id}: {state.described}",
        business_connection=state,
    )


def _ignored(
    message: TelegramMessage,
    text: str | None,
    chat_types: frozenset[str],
    *,
    business: bool,
    connection: str | None,
    edit: bool,
) -> str | None:
    """Why the bot does not answer this message, or None when it does."""
    author = message.from_
    if message.chat.type not in chat_types:
        allowed = ", ".join(sorted(chat_types))
        return f"{message.chat.type} chats are not answered (CHATQ_TELEGRAM_CHAT_TYPES: {allowed})"
    if business and connection is None:
        return "business message without a business_connection_id: no way to answer it"
    if business and message.sender_business_bot is not None:
        return OURS
    if business and author is not None and author.id != message.chat.id:
        # In a business chat the customer is the chat: anyone else is the business account.
        if message.is_from_offline:
            # Telegram sent it for the owner (an away, greeting or scheduled message):
            # nobody took the chat over.
            return OFFLINE
        # The owner, writing by hand: a person taking over.
        return "edited by the seller" if edit else WRITTEN_BY_SELLER
    if author is not None and author.is_bot:
        return "message from a bot"
    if text is None:
        service = telegram_service(_extra(message)) or "no content"
        return f"a service message ({service}): not a buyer's message"
    if not text.strip():
        return "empty message"
    return None


def _extra(message: TelegramMessage) -> dict[str, object]:
    return message.model_extra or {}


def _errors(exc: ValidationError) -> list[dict[str, object]]:
    return [{"loc": list(e["loc"]), "msg": e["msg"]} for e in exc.errors()[:10]]
