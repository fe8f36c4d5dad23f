"""The operations aggregate's interface as a person's commands (retry, resolve:
services/receiver/admin/commands.py) need it: ``OperationStore`` and ``OperationSession``
(one transaction), as Protocols, and the values they trade. ``postgres.PgOperationStore``
implements them, ``fake.InMemoryOperations`` in memory under the same transition tables
(shared/state); tests/contract/test_operations.py runs one set of test bodies against
both."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Protocol

from shared.messages import InboundMessage, Platform, chat_key
from shared.state.operation import OperationStatus

#: The keys a message is stored under when the platform gave it no id (platforms/avito/webhook.py).
NAMELESS_PREFIXES = ("evt:", "sha256:")


@dataclass(frozen=True)
class Locked:
    """An operation locked for a person's command, with its reply job's messages."""

    id: uuid.UUID
    status: OperationStatus
    platform: Platform
    account_id: str
    #: None for a message the platform sent without a chat (handed to a person as stored).
    chat_id: str | None
    job_id: uuid.UUID | None
    job_operation_ids: list[uuid.UUID]
    job_chat_key: str | None
    #: The status as a person reads it (chatq_shown_status: 'queued' and 'replying' are
    #: read, not written), for what a refusal says; None: ``status``.
    shown: str | None = None
    #: The platform's message id, or the key it was stored under without one.
    message_id: str | None = None

    @property
    def nameless(self) -> bool:
        """Stored without the platform's id for the message (keyed by its delivery or its
        content): the poll may have stored it again under its real id."""
        return (self.message_id or "").startswith(NAMELESS_PREFIXES)

    @property
    def chat_key(self) -> str:
        return chat_key(self.platform, self.account_id, self.chat_id or "")


@dataclass(frozen=True)
class Closing:
    """A person's resolution: the status it ends in, and who decided what, why."""

    to: OperationStatus
    reason: str
    resolution: str
    by: str
    note: str | None


class OperationSession(Protocol):
    async def lock(self, operation_id: uuid.UUID) -> Locked | None:
        """Lock the operation (None: there is none)."""
        ...

    async def lock_chat(self, chat_key: str) -> None:
        """The chat's lock, the coalescer's filing's: its windows do not move meanwhile."""
        ...

    async def siblings(
        self,
        candidates: Sequence[uuid.UUID],
        status: OperationStatus,
        of: uuid.UUID,
        job_id: uuid.UUID | None,
    ) -> list[uuid.UUID]:
        """Of ``candidates``, those in ``status`` that are ``of`` itself or still the job's."""
        ...

    async def retry(self, ids: Sequence[uuid.UUID]) -> list[InboundMessage]:
        """Back to accepted (failed or needs_review ones only), out of any window and any
        reply's coverage. Returns the messages to publish again."""
        ...

    async def supersede_for_resend(self, job_id: uuid.UUID, by: str) -> None: ...

    async def record(
        self, ids: Sequence[uuid.UUID], kind: str, *, actor: str, detail: str, job_id: uuid.UUID | None
    ) -> None: ...

    async def publish(self, messages: Sequence[InboundMessage]) -> None:
        """Through the outbox, in this transaction."""
        ...

    async def resolve(self, ids: Sequence[uuid.UUID], closing: Closing) -> list[uuid.UUID]:
        """Close the failed or needs_review ones; returns them."""
        ...

    async def mark_answered(self, chat_key: str, ids: Sequence[uuid.UUID], job_id: uuid.UUID) -> None:
        """A person answered these messages: the chat's history knows."""
        ...


class OperationStore(Protocol):
    def transaction(self) -> AbstractAsyncContextManager[OperationSession]: ...
