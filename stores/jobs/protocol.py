"""The jobs aggregate's interface: ``JobStorage`` (the store) and ``JobSession`` (one job
held for its handling), as Protocols, and the values they trade. ``postgres.JobStore`` and
``postgres.PgJobSession`` implement them on the job functions of
stores/jobs/functions/30_jobs.sql; ``fake.InMemoryJobs`` in memory under the same transition
tables (shared/state). tests/contract/test_jobs.py runs one set of test bodies against
both, so the handler's branches, unit-tested on the fake, hold on Postgres."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol

from shared.messages import Row
from shared.messages import chat_key as make_chat_key
from shared.state.job import DeliveryStatus

__all__ = [
    "AccountStopped",
    "Attempts",
    "Job",
    "JobBusy",
    "JobSession",
    "JobStorage",
    "JobWithdrawn",
    "Message",
    "Part",
    "Reconcile",
    "Row",
    "Settled",
    "Skip",
    "Turn",
]


@dataclass(frozen=True)
class Attempts:
    """A job's sends that may have reached the platform: one text, from the first such
    attempt's start to the latest attempt's start (what a platform's reconcile looks for,
    ``platforms.base.SentQuery``)."""

    text: str
    since: datetime
    latest: datetime


@dataclass(frozen=True)
class Turn:
    role: str  # "buyer" | "bot"
    text: str


@dataclass(frozen=True)
class Message:
    operation_id: uuid.UUID
    message_id: str
    text: str
    sent_at: datetime
    received_at: datetime


@dataclass(frozen=True)
class Job:
    job_id: uuid.UUID
    platform: str
    account_id: str
    chat_id: str
    messages: tuple[Message, ...]
    #: The chat's last turns before this job (buyer messages and our replies), oldest first.
    history: tuple[Turn, ...] = ()
    #: Why the job's account may not send now (paused), or None.
    account_paused: str | None = None
    #: Telegram Business: the connection the reply goes through, or None.
    business_connection_id: str | None = None

    @property
    def chat_key(self) -> str:
        return make_chat_key(self.platform, self.account_id, self.chat_id)

    @property
    def operation_ids(self) -> list[uuid.UUID]:
        return [m.operation_id for m in self.messages]


@dataclass(frozen=True)
class Part:
    """One part of a long reply, as recorded."""

    text: str
    status: DeliveryStatus
    message_id: str | None
    started_at: datetime


@dataclass(frozen=True)
class Skip:
    reason: str


@dataclass(frozen=True)
class Reconcile:
    """A job some attempt of which may have sent: ``text`` is what it sent, from the first
    such attempt (``since``) to the latest (``started_at``)."""

    job: Job
    text: str
    started_at: datetime
    delivery_status: str
    since: datetime


@dataclass(frozen=True)
class Settled:
    """What giving up changed, for alerts and metrics: ``outcome`` is failed or
    needs_review, or busy / final when nothing changed."""

    job_id: uuid.UUID
    outcome: str
    chat_key: str
    operation_ids: list[uuid.UUID]


class JobWithdrawn(Exception):
    """The seller answered the chat in person since the job was built: nothing was sent, and
    the job and its messages are settled (superseded; "answered by the seller")."""


class AccountStopped(Exception):
    """A person paused or removed the job's account since the job was claimed: nothing was
    sent, no intent recorded. ``removed``: the job fails with the reason; else it waits."""

    def __init__(self, reason: str, *, removed: bool) -> None:
        super().__init__(reason)
        self.reason = reason
        self.removed = removed


class JobBusy(Exception):
    """Another handler (a redelivery racing the first) is working on this job now."""


class JobSession(Protocol):
    """A job's state changes while this handler holds it (its lock)."""

    async def claim(self, job_id: uuid.UUID, attempt: int) -> Job | Skip | Reconcile:
        """Decide before any side effect: raises JobBusy (another handler holds it) or
        Reject (no such job); Skip (final, withdrawn, superseded); Reconcile (a send may
        have happened); else the job, processing, with the messages it keeps."""
        ...

    async def before_send(self, job: Job, text: str, attempt: int, *, fold: bool = True) -> Job:
        """The grown job when messages were folded in (write again); else the delivery
        intent is recorded and the same job returned. Raises JobWithdrawn."""
        ...

    async def record_sent(self, job: Job, text: str, platform_message_id: str) -> datetime: ...

    async def recorded_message_ids(self, job: Job, limit: int = 200) -> list[str]: ...

    async def part_intent(self, job_id: uuid.UUID, number: int, text: str) -> None: ...

    async def part_done(
        self, job_id: uuid.UUID, number: int, status: DeliveryStatus, message_id: str | None = None
    ) -> None: ...

    async def delivery_parts(self, job_id: uuid.UUID) -> dict[int, Part]: ...

    async def unknown_rivals(self, job: Job) -> list[Attempts]: ...

    async def record_delivery(self, job_id: uuid.UUID, status: DeliveryStatus, error: str) -> None: ...

    async def record_retry(self, job_id: uuid.UUID, kind: str, reason: str) -> None: ...

    async def give_up(self, job_id: uuid.UUID, kind: str, reason: str, owner: str) -> Settled: ...

    async def record_cut(self, job_id: uuid.UUID, detail: str) -> None:
        """On the record of each of the job's messages: what of the chat the model was not
        given (``llm.bound_prompt``)."""
        ...


class JobStorage(Protocol):
    """Where jobs are held and settled from outside a handling (the consumer's hooks,
    the account probe)."""

    def exclusive(self, job_id: uuid.UUID) -> AbstractAsyncContextManager[JobSession]: ...

    async def give_up(self, job_id: uuid.UUID, kind: str, reason: str, owner: str) -> Settled: ...

    async def retry_scheduled(self, job_id: uuid.UUID, attempt: int, delay: float) -> None: ...

    async def pause_account(self, platform: str, account_id: str, reason: str, probe_in: float) -> bool: ...

    async def resume_account(self, platform: str, account_id: str) -> bool: ...

    async def probe_later(self, platform: str, account_id: str, reason: str, probe_in: float) -> None: ...

    def accounts_to_probe(self, platforms: list[str]) -> AbstractAsyncContextManager[Sequence[Row]]: ...
