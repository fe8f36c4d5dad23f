"""What every platform's webhook parses into: an ``Intake``, the one normalised inbound
event the receiver stores (``services.receiver.intake.store``), and the ``ApiError`` a
webhook refuses bad input with (a clear 4xx, nothing written). The platform packages'
``webhook`` modules produce these; the receiver stores them."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from platforms.media import PERSON_HINT


class ApiError(Exception):
    def __init__(
        self, status: int, code: str, message: str, *, headers: dict[str, str] | None = None, **details: Any
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.headers = headers
        self.details = details


#: Longest id (account, chat, message, author, event) we store: far above any platform's
#: (Telegram's are 64-bit integers, Avito's and generic ones short strings), far below
#: what a btree index entry can hold.
MAX_ID_LENGTH = 256


@dataclass(frozen=True)
class BusinessConnectionState:
    """A Telegram Business connection as a ``business_connection`` update describes it."""

    connection_id: str
    owner_id: str
    is_enabled: bool
    can_reply: bool

    @property
    def paused_reason(self) -> str | None:
        """Why the bot may not answer its chats now (None: it may)."""
        if not self.is_enabled:
            return (
                f"the business account turned the bot off for Telegram Business connection {self.connection_id} "
                "(Settings > Telegram Business > Chatbots): replies wait until it is on again"
            )
        if not self.can_reply:
            return (
                f"Telegram Business connection {self.connection_id} does not let the bot reply "
                "(the business account's chatbot settings: allow it to reply to messages): replies wait"
            )
        return None

    @property
    def described(self) -> str:
        return (
            "enabled, can reply"
            if self.paused_reason is None
            else ("turned off" if not self.is_enabled else "enabled, may not reply")
        )


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
    #: Telegram Business: the connection a reply to this chat goes through.
    business_connection_id: str | None = None
    #: An edit of an earlier message: answered only when a reply to its chat is still
    #: pending (an open window, or a job not yet past its delivery intent), else stored as
    #: ignored. ``store`` decides, in the statement that stores it.
    is_edit: bool = False
    #: Written by the account itself (the seller, or our own reply coming back): decided
    #: at storage (chatq_is_echo); the seller's message makes the bot step back.
    written_by_seller: bool = False
    #: Why the bot cannot answer this message alone (a voice note, a file without words;
    #: a message naming no chat): the account's CHATQ_UNREADABLE_MESSAGES decides whether
    #: the bot answers its placeholder or a person gets it (``for_a_person``).
    unreadable: str | None = None
    #: Known to be our own reply coming back (a Telegram business message our bot sent):
    #: stored as an echo, which settles a send whose answer was lost.
    ours: bool = False
    #: A person's whatever the policy: the bot cannot answer it safely (no chat to answer
    #: in; no id of its own, so a copy of it could not be told apart and answered twice).
    person_only: bool = False
    #: Defaults taken for fields the platform left out, as the record shows them.
    notes: tuple[str, ...] = ()
    #: Handed to a person as it is stored (needs_review), with this reason.
    review: str | None = None
    #: A Telegram business_connection update: the connection's state, for the receiver to
    #: keep (its replies pause while it is off or may not reply).
    business_connection: BusinessConnectionState | None = None

    def for_a_person(self, policy: str) -> Intake:
        """This message as the account's CHATQ_UNREADABLE_MESSAGES (``policy``) takes it:
        an unreadable one goes to a person under ``person`` (and always when it names no
        chat: nothing can answer it), else it is answered like any other."""
        if self.unreadable is None or self.ignored_reason is not None:
            return self
        if policy == "answer" and not self.person_only:
            return self
        return dataclasses.replace(self, review=f"{self.unreadable}: {PERSON_HINT}")

    @property
    def status(self) -> str:
        """What it is stored as."""
        if self.ignored_reason:
            return "ignored"
        return "needs_review" if self.review else "accepted"

    @property
    def received_detail(self) -> str | None:
        """What the 'received' event adds: the defaults taken (None: none)."""
        return "defaults: " + "; ".join(self.notes) if self.notes else None

    def __post_init__(self) -> None:
        ids = ("account_id", "event_id", "chat_id", "message_id", "author_id", "business_connection_id")
        for name in (*ids, "text"):
            check_storable(name, getattr(self, name))
        for name in ids:
            value = getattr(self, name)
            if value is not None and len(value) > MAX_ID_LENGTH:
                raise ApiError(
                    422,
                    "invalid_payload",
                    f"{name} is longer than {MAX_ID_LENGTH} characters: not a platform id",
                )
        if self.sent_at is not None and self.sent_at.tzinfo is None:
            raise ApiError(422, "invalid_payload", "sent_at has no time zone")
        if self.ignored_reason is None and (
            (self.chat_id is None and self.unreadable is None) or self.message_id is None or self.text is None
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


def parse_json(body: bytes) -> tuple[object, str]:
    """Decode a JSON body strictly: UTF-8 and valid JSON, or a clear 4xx."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        raise ApiError(400, "invalid_utf8", "the body is not valid UTF-8") from None
    try:
        return json.loads(text), text
    except (json.JSONDecodeError, RecursionError):
        raise ApiError(400, "malformed_json", "the body is not valid JSON") from None
    except ValueError:
        # Valid JSON Python refuses to read, such as an integer of over 4,300 digits.
        raise ApiError(422, "invalid_payload", "a number in the body is too large") from None


def epoch_to_datetime(seconds: float | int | None) -> datetime | None:
    if seconds is None:
        return None
    try:
        return datetime.fromtimestamp(seconds, UTC)
    except (OverflowError, OSError, ValueError):
        raise ApiError(422, "invalid_payload", "timestamp out of range") from None
