"""Operations a person acts on, in memory: an implementation of
``stores.operations.protocol`` that moves every operation and job through the same
transition tables as Postgres (shared/state: a move they refuse raises
TransitionNotAllowed), and leaves nothing behind when a transaction raises. A person's
commands (services/receiver/admin/commands.py) run on it in milliseconds;
tests/contract/test_operations.py runs the same bodies on it and on Postgres."""

from __future__ import annotations

import contextlib
import copy
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from shared.messages import InboundMessage
from shared.state import job as job_state
from shared.state import operation as operation_state
from shared.state.job import JobStatus
from shared.state.operation import OperationStatus
from stores.operations.protocol import Closing, Locked, OperationSession

T0 = datetime(2026, 11, 1, 12, 0, tzinfo=UTC)
S = OperationStatus


@dataclass
class FakeOperation:
    message: InboundMessage
    status: OperationStatus
    job_id: uuid.UUID | None = None
    reason: str | None = None
    resolution: str | None = None
    resolved_by: str | None = None
    note: str | None = None
    retries: int = 0

    def move(self, to: OperationStatus) -> None:
        operation_state.LIFECYCLE.check(self.status, to)
        self.status = to


@dataclass
class FakeJob:
    id: uuid.UUID
    chat_key: str
    operation_ids: list[uuid.UUID]
    status: JobStatus
    error: str = ""

    def move(self, to: JobStatus) -> None:
        job_state.LIFECYCLE.check(self.status, to)
        self.status = to


@dataclass
class _State:
    operations: dict[uuid.UUID, FakeOperation] = field(default_factory=dict)
    jobs: dict[uuid.UUID, FakeJob] = field(default_factory=dict)
    #: window_messages and reply_coverage: the operations in a window, covered by a reply
    in_window: set[uuid.UUID] = field(default_factory=set)
    covered: set[uuid.UUID] = field(default_factory=set)
    events: list[tuple[uuid.UUID, str, str, uuid.UUID | None]] = field(default_factory=list)
    outbox: list[InboundMessage] = field(default_factory=list)
    answered: list[tuple[str, list[uuid.UUID], uuid.UUID]] = field(default_factory=list)


class InMemoryOperations:
    def __init__(self) -> None:
        self.state = _State()

    # ---- seeding -----------------------------------------------------------------------

    def message(self, status: OperationStatus, chat_id: str = "c1") -> uuid.UUID:
        n = len(self.state.operations) + 1
        m = InboundMessage(
            operation_id=uuid.uuid4(),
            platform="telegram",
            account_id="bot",
            chat_id=chat_id,
            message_id=str(n),
            author_id="buyer",
            text=f"message {n}",
            sent_at=T0 + timedelta(seconds=n),
            received_at=T0 + timedelta(seconds=n),
        )
        self.state.operations[m.operation_id] = FakeOperation(m, status)
        return m.operation_id

    def job(self, status: JobStatus, *ops: uuid.UUID) -> uuid.UUID:
        first = self.state.operations[ops[0]].message
        job = FakeJob(uuid.uuid4(), first.chat_key, list(ops), status)
        self.state.jobs[job.id] = job
        for op in ops:
            self.state.operations[op].job_id = job.id
        return job.id

    def op(self, op_id: uuid.UUID) -> FakeOperation:
        return self.state.operations[op_id]

    def events(self, op_id: uuid.UUID) -> list[str]:
        return [detail for op, _, detail, _ in self.state.events if op == op_id]

    # ---- the store ---------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def transaction(self) -> AsyncIterator[OperationSession]:
        saved = copy.deepcopy(self.state)
        try:
            yield _Session(self.state)
        except BaseException:
            self.state = saved
            raise


class _Session:
    def __init__(self, state: _State) -> None:
        self._s = state

    async def lock(self, operation_id: uuid.UUID) -> Locked | None:
        op = self._s.operations.get(operation_id)
        if op is None:
            return None
        job = self._s.jobs.get(op.job_id) if op.job_id else None
        m = op.message
        return Locked(
            operation_id,
            op.status,
            m.platform,
            m.account_id,
            m.chat_id,
            op.job_id,
            list(job.operation_ids) if job else [],
            job.chat_key if job else None,
            message_id=m.message_id,
        )

    async def lock_chat(self, chat_key: str) -> None:
        return None

    async def siblings(
        self,
        candidates: Sequence[uuid.UUID],
        status: OperationStatus,
        of: uuid.UUID,
        job_id: uuid.UUID | None,
    ) -> list[uuid.UUID]:
        return [
            i
            for i in candidates
            if (op := self._s.operations.get(i)) is not None
            and op.status == status
            and (i == of or (job_id is not None and op.job_id == job_id))
        ]

    async def retry(self, ids: Sequence[uuid.UUID]) -> list[InboundMessage]:
        back = []
        for i in ids:
            op = self._s.operations[i]
            if op.status not in operation_state.ACTIONABLE:
                continue
            op.move(S.ACCEPTED)
            op.job_id, op.reason, op.retries = None, None, op.retries + 1
            self._s.in_window.discard(i)
            self._s.covered.discard(i)
            back.append(op.message)
        return back

    async def supersede_for_resend(self, job_id: uuid.UUID, by: str) -> None:
        job = self._s.jobs[job_id]
        if job.status == JobStatus.NEEDS_REVIEW:
            job.move(JobStatus.SUPERSEDED)
            job.error += f"; re-send confirmed by {by}"

    async def record(
        self, ids: Sequence[uuid.UUID], kind: str, *, actor: str, detail: str, job_id: uuid.UUID | None
    ) -> None:
        self._s.events.extend((i, kind, detail, job_id) for i in ids)

    async def publish(self, messages: Sequence[InboundMessage]) -> None:
        self._s.outbox.extend(messages)

    async def resolve(self, ids: Sequence[uuid.UUID], closing: Closing) -> list[uuid.UUID]:
        done = []
        for i in ids:
            op = self._s.operations[i]
            if op.status not in operation_state.ACTIONABLE:
                continue
            op.move(closing.to)
            c = closing
            op.reason, op.resolution, op.resolved_by, op.note = c.reason, c.resolution, c.by, c.note
            done.append(i)
        return done

    async def mark_answered(self, chat_key: str, ids: Sequence[uuid.UUID], job_id: uuid.UUID) -> None:
        self._s.answered.append((chat_key, list(ids), job_id))
