"""What a person's commands (retry, resolve: ``commands.py``) need from the state, as
Protocols: ``OperationStore`` and ``OperationSession`` (one transaction). ``PgOperationStore``
is the Postgres implementation, proven by tests/integration/test_admin_api.py and
test_event_record.py; ``tests/fakes/operations.py`` is an in-memory one under the same
transition tables (shared/state), on which the commands' branches run as unit tests."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol

import asyncpg

from shared.answered import MARK_ANSWERED
from shared.broker.topology import INBOUND_EXCHANGE, inbound_routing_key
from shared.db import Conn
from shared.messages import InboundMessage, Platform, chat_key
from shared.outbox import OutboxMessage, enqueue_many
from shared.state import job as job_state
from shared.state import operation as operation_state
from shared.state.operation import OperationStatus


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


class PgOperationStore:
    def __init__(self, pool: asyncpg.Pool) -> None:
        self._pool = pool

    @contextlib.asynccontextmanager
    async def transaction(self) -> AsyncIterator[OperationSession]:
        async with self._pool.acquire() as conn, conn.transaction():
            yield PgOperationSession(conn)


class PgOperationSession:
    def __init__(self, conn: Conn) -> None:
        self._conn = conn

    async def lock(self, operation_id: uuid.UUID) -> Locked | None:
        row = await self._conn.fetchrow(
            """
            SELECT o.status, o.platform, o.account_id, o.chat_id, o.job_id, j.operation_ids, j.chat_key,
                   chatq_shown_status(o.status, o.id, o.platform, o.account_id, o.chat_id) AS shown
            FROM operations o LEFT JOIN reply_jobs j ON j.id = o.job_id
            WHERE o.id = $1 FOR UPDATE OF o
            """,
            operation_id,
        )
        if row is None:
            return None
        return Locked(
            operation_id,
            OperationStatus(row["status"]),
            row["platform"],
            row["account_id"],
            row["chat_id"],
            row["job_id"],
            list(row["operation_ids"] or ()),
            row["chat_key"],
            row["shown"],
        )

    async def lock_chat(self, chat_key: str) -> None:
        await self._conn.execute("SELECT pg_advisory_xact_lock(hashtextextended($1, 0))", chat_key)

    async def siblings(
        self,
        candidates: Sequence[uuid.UUID],
        status: OperationStatus,
        of: uuid.UUID,
        job_id: uuid.UUID | None,
    ) -> list[uuid.UUID]:
        rows = await self._conn.fetch(
            """
            SELECT id FROM operations
            WHERE id = ANY($1::uuid[]) AND status = $2 AND (id = $3 OR job_id = $4)
            """,
            list(candidates),
            status.value,
            of,
            job_id,
        )
        return [r["id"] for r in rows]

    async def retry(self, ids: Sequence[uuid.UUID]) -> list[InboundMessage]:
        retried = await operation_state.retry(self._conn, ids)
        back = [r["id"] for r in retried]
        await self._conn.execute("DELETE FROM window_messages WHERE operation_id = ANY($1::uuid[])", back)
        # A failed job gave its messages back already; a needs_review job kept them until
        # this confirmed re-send, which supersedes it.
        await self._conn.execute("DELETE FROM reply_coverage WHERE operation_id = ANY($1::uuid[])", back)
        return [
            InboundMessage(
                operation_id=r["id"],
                platform=r["platform"],
                account_id=r["account_id"],
                chat_id=r["chat_id"],
                message_id=r["message_id"],
                author_id=r["author_id"],
                text=r["text"],
                sent_at=_sent_at(r["sent_at"], r["received_at"]),
                received_at=r["received_at"],
            )
            for r in retried
        ]

    async def supersede_for_resend(self, job_id: uuid.UUID, by: str) -> None:
        await job_state.supersede_for_resend(self._conn, job_id, by)

    async def record(
        self, ids: Sequence[uuid.UUID], kind: str, *, actor: str, detail: str, job_id: uuid.UUID | None
    ) -> None:
        await operation_state.record_event(self._conn, ids, kind, actor=actor, detail=detail, job_id=job_id)

    async def publish(self, messages: Sequence[InboundMessage]) -> None:
        await enqueue_many(
            self._conn,
            [
                OutboxMessage(
                    exchange=INBOUND_EXCHANGE,
                    routing_key=inbound_routing_key(m.platform),
                    message_id=str(m.operation_id),
                    ordering_key=m.chat_key,
                    operation_id=m.operation_id,
                    body=m.to_bytes(),
                )
                for m in messages
            ],
        )

    async def resolve(self, ids: Sequence[uuid.UUID], closing: Closing) -> list[uuid.UUID]:
        c = closing
        rows = await operation_state.resolve(
            self._conn, ids, c.to, reason=c.reason, resolution=c.resolution, by=c.by, note=c.note
        )
        return [r["id"] for r in rows]

    async def mark_answered(self, chat_key: str, ids: Sequence[uuid.UUID], job_id: uuid.UUID) -> None:
        await self._conn.execute(MARK_ANSWERED, chat_key, list(ids), job_id)


def _sent_at(sent_at: datetime | None, received_at: datetime) -> datetime:
    return sent_at or received_at
