"""The operations aggregate in Postgres, as a person's commands (retry, resolve:
services/receiver/admin/commands.py) change it: ``PgOperationStore`` and its sessions, one
transaction each. Proven against ``fake`` by tests/contract/test_operations.py."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator, Sequence
from datetime import datetime

import asyncpg

from shared.broker.topology import INBOUND_EXCHANGE, inbound_routing_key
from shared.db import Conn
from shared.messages import InboundMessage
from shared.outbox import OutboxMessage, enqueue_many
from shared.state import job as job_state
from shared.state import operation as operation_state
from shared.state.operation import OperationStatus
from stores.operations.protocol import Closing, Locked, OperationSession

#: Each chat's last answered message is the marker behind the history the reply writer sees;
#: it only moves forward in platform order (shared/functions/10_chats.sql).
#: A person answered these operations ($2) of a chat ($1) through job $3: the latest of
#: them in platform order becomes the marker, if later than the current one.
MARK_ANSWERED = """
SELECT chatq_advance_last_answered($1, o.platform, o.sent_at, o.message_id, o.received_at, now(), $3)
FROM operations o WHERE o.id = ANY($2::uuid[])
ORDER BY chatq_order(o.platform, o.sent_at, o.message_id, o.received_at) DESC
LIMIT 1
"""


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
        # The chat's lock first, then the row: the order every writer of a chat's operations
        # takes them in (filing, the seller's message, an echo's settlement), so a person's
        # command never deadlocks with them.
        await self._conn.execute(
            """
            SELECT pg_advisory_xact_lock(hashtextextended(chatq_chat_key(platform, account_id, chat_id), 0))
            FROM operations WHERE id = $1 AND chat_id IS NOT NULL
            """,
            operation_id,
        )
        row = await self._conn.fetchrow(
            """
            SELECT o.status, o.platform, o.account_id, o.chat_id, o.job_id, j.operation_ids, j.chat_key,
                   chatq_shown_status(o.status, o.id, o.platform, o.account_id, o.chat_id) AS shown, o.message_id
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
            row["message_id"],
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
