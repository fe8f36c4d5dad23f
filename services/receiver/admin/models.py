"""The admin API's responses as pydantic models: /openapi.json documents what a user
scripts against. Every model forbids keys it does not declare, so a document that grows a
field without its model fails the tests instead of losing the field. Times are ISO 8601
strings, as the documents have always carried them."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class _Doc(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


# ---- an operation -----------------------------------------------------------------------


class Chat(_Doc):
    account_id: str
    #: None only on an ignored event that was not a chat's message.
    chat_id: str | None


class Message(_Doc):
    """The buyer's message (an ignored event may have no chat, id or text)."""

    id: str | None
    author_id: str | None
    text: str | None
    sent_at: str | None


class JobRef(_Doc):
    id: str
    status: str | None


class Reply(_Doc):
    text: str
    platform_message_id: str | None
    sent_at: str | None


class Error(_Doc):
    kind: str
    message: str | None
    attempts: int | None


class ResolutionDoc(_Doc):
    resolution: str
    by: str | None
    at: str | None
    note: str | None


class Operation(_Doc):
    """One inbound message and what became of it."""

    id: str
    platform: str
    chat: Chat
    message: Message
    status: str = Field(
        description="accepted, queued, waiting, replying, replied, failed, needs_review, ignored"
    )
    status_text: str = Field(description="the status in words a person reads")
    received_at: str | None
    updated_at: str | None
    age_seconds: float
    job: JobRef | None
    reply: Reply | None
    error: Error | None
    owner: str | None = Field(description="who a failed or needs_review operation is handed to")
    resolution: ResolutionDoc | None
    retries: int


class TimelineEvent(_Doc):
    at: str | None
    kind: str
    event: str
    by: str | None
    for_: str | None = Field(alias="for")
    job_id: str | None


class OperationWithTimeline(Operation):
    timeline: list[TimelineEvent] = Field(description="the operation's record, oldest first")


class OperationList(_Doc):
    operations: list[Operation]
    count: int


# ---- a person's commands ----------------------------------------------------------------


class Retried(_Doc):
    operation_id: str
    status: str
    retried: list[str] = Field(description="every operation put back to work (the job's others too)")
    resend: bool = Field(description="a needs_review operation sent again on the person's confirmation")


class Resolved(_Doc):
    operation_id: str
    status: str
    resolved: list[str]


# ---- chats --------------------------------------------------------------------------------


class HeldChat(_Doc):
    chat: str
    seller_wrote_at: str | None
    seller_message_id: str | None
    held_until: str | None
    waiting_messages: int


class HeldChats(_Doc):
    chats: list[HeldChat]
    count: int


class Resumed(_Doc):
    chat: str
    held: bool


# ---- the seller's numbers -----------------------------------------------------------------


class PausedAccount(_Doc):
    platform: str
    account_id: str
    state: str
    reason: str | None
    since: str | None


class Backlog(_Doc):
    count: int
    oldest_age_seconds: float


class Last24h(_Doc):
    received: int
    ignored: int
    duplicates: int
    replied: int
    answered_by_seller: int
    failed: int
    needs_review: int
    resolved: int
    failed_share: float
    retries: int
    automatic_retries: int
    person_retries: int
    receipt_to_reply_p50_seconds: float | None
    receipt_to_reply_p95_seconds: float | None


class AccountNumbers(_Doc):
    platform: str
    account_id: str
    name: str | None
    state: str
    reason: str | None
    backlog: int
    oldest_unfinished_age_seconds: float
    receipt_to_reply_p50_seconds: float | None
    receipt_to_reply_p95_seconds: float | None
    failed_share: float
    retries: int


class Stats(_Doc):
    paused_accounts: list[PausedAccount]
    backlog: dict[str, Backlog] = Field(
        description="unfinished and actionable operations by status, and held"
    )
    backlog_total: int
    oldest_unfinished_age_seconds: float
    last_24h: Last24h
    accounts: list[AccountNumbers] = Field(description="the accounts busiest by backlog")
    accounts_total: int
    account: str | None = Field(default=None, description="the account asked for (account=PLATFORM:ID)")
