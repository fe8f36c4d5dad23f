"""Wire models: what travels on RabbitMQ between the services.

Each message is JSON with a ``schema`` version so a consumer can refuse what it does not
understand instead of guessing.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal, Protocol, Self
from uuid import UUID

from pydantic import BaseModel, ConfigDict, Field

Platform = Literal["telegram", "avito", "generic", "sandbox"]


class WireModel(BaseModel):
    """A message body on the broker: frozen, strict about unknown fields, JSON bytes."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    def to_bytes(self) -> bytes:
        return self.model_dump_json(by_alias=True).encode()

    @classmethod
    def from_bytes(cls, body: bytes) -> Self:
        return cls.model_validate_json(body)


class InboundMessage(WireModel):
    """One buyer message, normalised from any platform. Published to chatq.inbound with
    AMQP message_id = operation_id."""

    schema_: Literal["chatq.inbound.v1"] = Field(default="chatq.inbound.v1", alias="schema")
    operation_id: UUID
    platform: Platform
    account_id: str
    chat_id: str
    message_id: str
    author_id: str | None
    text: str
    sent_at: datetime
    received_at: datetime

    @property
    def chat_key(self) -> str:
        """One chat across platforms and accounts; the ordering and coalescing key."""
        return chat_key(self.platform, self.account_id, self.chat_id)


def chat_key(platform: str, account_id: str, chat_id: str) -> str:
    """``platform:account:chat`` with ``%`` and ``:`` escaped in the parts (``%25``, ``%3A``),
    so two chats never share a key, whatever their ids hold: (account ``shop:1``, chat
    ``42``) and (account ``shop``, chat ``1:42``) are two chats. Ids without those
    characters read as themselves. The same rule in SQL: ``chatq_chat_key``."""
    return f"{platform}:{_escape(account_id)}:{_escape(chat_id)}"


def _escape(part: str) -> str:
    return part.replace("%", "%25").replace(":", "%3A")


class Row(Protocol):
    """A row read by column name (an asyncpg Record, a dict)."""

    def __getitem__(self, key: str, /) -> Any: ...


class JobMessage(BaseModel):
    """One buyer message inside a reply job, in platform order."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    operation_id: UUID
    message_id: str
    author_id: str | None
    text: str
    sent_at: datetime
    received_at: datetime

    @classmethod
    def from_row(cls, row: Row) -> JobMessage:
        """From a row of ``operations`` (its ``id`` is the operation id)."""
        return cls(
            operation_id=row["id"],
            **{k: row[k] for k in ("message_id", "author_id", "text", "sent_at", "received_at")},
        )


class ReplyJob(WireModel):
    """One reply to write for one chat window. Published to chatq.jobs with AMQP
    message_id = job_id; the job id is derived from the window, so re-emitting the same
    window yields the same job."""

    schema_: Literal["chatq.job.v1"] = Field(default="chatq.job.v1", alias="schema")
    job_id: UUID
    window_id: UUID
    platform: Platform
    account_id: str
    chat_id: str
    messages: tuple[JobMessage, ...]
    created_at: datetime

    @property
    def chat_key(self) -> str:
        return chat_key(self.platform, self.account_id, self.chat_id)


@dataclass(frozen=True)
class PromptBounds:
    """How much of a chat reaches the model, in characters (LLM_MAX_TURN_CHARS,
    LLM_MAX_HISTORY_CHARS, LLM_MAX_PROMPT_CHARS): each turn (a history turn, a buyer
    message), the history, the whole prompt (``services.responder.llm.bound_prompt``)."""

    turn: int = 4000
    history: int = 8000
    prompt: int = 32000


@dataclass(frozen=True)
class JobCaps:
    """The most one reply job carries (JOB_MAX_MESSAGES, JOB_MAX_TEXT_CHARS). A window that
    grew past it while its chat waited (a slow model, a retrying job) is answered in
    parts, in order, one job after the other; a fold-in that would pass it waits for the
    next job. A job's first message always goes."""

    messages: int = 50
    chars: int = 8000
