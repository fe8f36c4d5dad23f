"""The responder's state in memory: an implementation of ``stores.jobs.protocol``
that takes the decisions of stores/jobs/functions/30_jobs.sql (claim, before send, record,
give up) on dicts, and moves every status through the same transition tables as
Postgres (shared/state: a move they refuse raises TransitionNotAllowed). The handler's
branches run on it in milliseconds; tests/contract/test_jobs.py runs the same bodies on
it and on Postgres, so the two cannot drift apart unseen."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta

from shared.broker.consumer import Reject
from shared.messages import chat_key
from shared.state import job as job_state
from shared.state import operation as operation_state
from shared.state.account import AccountState
from shared.state.job import DeliveryStatus, JobStatus
from shared.state.operation import OperationStatus
from stores.accounts.fake import InMemoryAccountStates
from stores.jobs.protocol import (
    Attempts,
    Job,
    JobBusy,
    JobWithdrawn,
    Message,
    Part,
    Reconcile,
    Row,
    Settled,
    Skip,
)

T0 = datetime(2026, 11, 1, 12, 0, tzinfo=UTC)
_ANSWERABLE = (
    OperationStatus.ACCEPTED,
    OperationStatus.QUEUED,
    OperationStatus.WAITING,
    OperationStatus.REPLYING,
)


@dataclass
class FakeOperation:
    id: uuid.UUID
    message_id: str
    text: str
    sent_at: datetime
    status: OperationStatus = OperationStatus.WAITING
    job_id: uuid.UUID | None = None

    def move(self, to: OperationStatus) -> None:
        operation_state.LIFECYCLE.check(self.status, to)
        self.status = to


@dataclass
class FakeDelivery:
    status: DeliveryStatus
    text: str
    started_at: datetime
    maybe_sent: bool = False
    maybe_since: datetime | None = None

    def move(self, to: DeliveryStatus) -> None:
        job_state.DELIVERY.check(self.status, to)
        self.status = to


@dataclass
class FakeJob:
    id: uuid.UUID
    platform: str
    account_id: str
    chat_id: str
    operation_ids: list[uuid.UUID]
    status: JobStatus = JobStatus.PENDING
    attempts: int = 0
    delivery: FakeDelivery | None = None
    sent_text: str | None = None
    platform_message_id: str | None = None
    retries: list[tuple[str, str]] = field(default_factory=list)

    def move(self, to: JobStatus) -> None:
        job_state.LIFECYCLE.check(self.status, to)
        self.status = to

    @property
    def chat_key(self) -> str:
        return chat_key(self.platform, self.account_id, self.chat_id)


class InMemoryJobs:
    """Jobs, their operations and deliveries, which job holds which message (coverage),
    each chat's open window (messages a reply may fold in), and the locks held."""

    def __init__(self) -> None:
        self.jobs: dict[uuid.UUID, FakeJob] = {}
        self.operations: dict[uuid.UUID, FakeOperation] = {}
        self.coverage: dict[uuid.UUID, uuid.UUID] = {}
        self.windows: dict[str, list[uuid.UUID]] = {}
        self.locked: set[uuid.UUID] = set()
        #: Whether the bot may send on each account (the accounts aggregate's fake).
        self.accounts = InMemoryAccountStates()
        self._clock = T0

    def now(self) -> datetime:
        self._clock += timedelta(milliseconds=1)
        return self._clock

    # ---- seeding ------------------------------------------------------------------

    def message(
        self,
        message_id: str,
        text: str | None = None,
        *,
        at: datetime | None = None,
        status: OperationStatus = OperationStatus.WAITING,
    ) -> uuid.UUID:
        """A buyer message, sent ``at`` (the store's clock when not given)."""
        op = FakeOperation(
            uuid.uuid4(), message_id, text or f"message {message_id}", at or self.now(), status
        )
        self.operations[op.id] = op
        return op.id

    def job(
        self,
        *ops: uuid.UUID,
        platform: str = "telegram",
        chat_id: str = "77",
        status: JobStatus = JobStatus.PENDING,
    ) -> uuid.UUID:
        job = FakeJob(uuid.uuid4(), platform, "bot", chat_id, list(ops), status=status)
        self.jobs[job.id] = job
        for op in ops:
            self.operations[op].job_id = job.id
        return job.id

    def hold(self, op_id: uuid.UUID, job_id: uuid.UUID) -> None:
        """The job holds the message: no other reply may take it (reply_coverage), and it
        reads as being replied to, as its claim would have left it."""
        self.coverage[op_id] = job_id
        op = self.operations[op_id]
        if op.status in _ANSWERABLE and op.status is not OperationStatus.REPLYING:
            op.move(OperationStatus.REPLYING)

    def arrive_in_window(self, job_id: uuid.UUID, *ops: uuid.UUID) -> None:
        """Messages of the job's chat that arrived after it was built (its open window)."""
        self.windows.setdefault(self.jobs[job_id].chat_key, []).extend(ops)

    # ---- the store ------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def exclusive(self, job_id: uuid.UUID) -> AsyncIterator[InMemorySession]:
        session = InMemorySession(self, job_id)
        try:
            yield session
        finally:
            session.release()

    async def give_up(self, job_id: uuid.UUID, kind: str, reason: str, owner: str) -> Settled:
        async with self.exclusive(job_id) as session:
            return await session.give_up(job_id, kind, reason, owner)

    async def retry_scheduled(self, job_id: uuid.UUID, attempt: int, delay: float) -> None:
        self.jobs[job_id].retries.append(("scheduled", f"attempt {attempt} after {delay:g}s"))

    async def pause_account(self, platform: str, account_id: str, reason: str, probe_in: float) -> bool:
        return await self.accounts.pause_by_platform(platform, account_id, reason, probe_in)

    async def resume_account(self, platform: str, account_id: str) -> bool:
        return await self.accounts.resume(platform, account_id)

    async def probe_later(self, platform: str, account_id: str, reason: str, probe_in: float) -> None:
        await self.accounts.probe_later(platform, account_id, reason, probe_in)

    @contextlib.asynccontextmanager
    async def accounts_to_probe(self, platforms: list[str]) -> AsyncIterator[Sequence[Row]]:
        yield await self.accounts.due_for_probe(platforms)

    def paused_reason(self, platform: str, account_id: str) -> str | None:
        """Why the account may not send now (paused), or None."""
        account = self.accounts.accounts.get((platform, account_id))
        return None if account is None or account.state is AccountState.ACTIVE else account.reason


class InMemorySession:
    """One job held: the same decisions as the job functions, in the same order."""

    def __init__(self, store: InMemoryJobs, job_id: uuid.UUID) -> None:
        self._store = store
        self._job_id = job_id
        self._holds = False

    def release(self) -> None:
        if self._holds:
            self._store.locked.discard(self._job_id)
            self._holds = False

    def _messages(self, job: FakeJob, ids: Sequence[uuid.UUID]) -> tuple[Message, ...]:
        ops = sorted(
            (self._store.operations[i] for i in ids),
            key=lambda o: (o.sent_at, len(o.message_id), o.message_id),
        )
        return tuple(Message(o.id, o.message_id, o.text, o.sent_at, o.sent_at) for o in ops)

    async def claim(self, job_id: uuid.UUID, attempt: int) -> Job | Skip | Reconcile:
        store = self._store
        if job_id in store.locked:
            raise JobBusy(f"job {job_id} is being handled by another consumer")
        store.locked.add(job_id)
        self._holds = True
        job = store.jobs.get(job_id)
        if job is None:
            raise Reject(f"job {job_id} is not in the database")
        if job.status not in job_state.IN_FLIGHT:
            return Skip(f"job already {job.status}")
        d = job.delivery
        reconciling = d is not None and job_state.may_have_sent(d.status, d.maybe_sent)
        if job.status is not JobStatus.PROCESSING:
            job.move(JobStatus.PROCESSING)
        job.attempts = attempt
        if reconciling:
            ids = list(job.operation_ids)
        else:
            ids = []
            for op_id in job.operation_ids:
                holder = store.coverage.get(op_id)
                if holder is not None and holder != job_id:
                    continue
                if store.operations[op_id].status not in _ANSWERABLE:
                    continue
                ids.append(op_id)
            if not ids:
                job.move(JobStatus.SUPERSEDED)
                return Skip("every message is answered or held by another reply")
            for op_id in ids:
                store.coverage[op_id] = job_id
                op = store.operations[op_id]
                if op.status is not OperationStatus.REPLYING:
                    op.move(OperationStatus.REPLYING)
            job.operation_ids = ids
        claimed = Job(
            job_id,
            job.platform,
            job.account_id,
            job.chat_id,
            self._messages(job, ids),
            account_paused=store.paused_reason(job.platform, job.account_id),
        )
        if reconciling:
            assert d is not None
            status = d.status.value if d.status in job_state.MAY_HAVE_SENT else "unknown"
            return Reconcile(claimed, d.text, d.started_at, status, d.maybe_since or d.started_at)
        return claimed

    async def before_send(self, job: Job, text: str, attempt: int, *, fold: bool = True) -> Job:
        store = self._store
        held = store.jobs[job.job_id]
        waiting = store.windows.pop(job.chat_key, []) if fold else []
        if waiting:
            for op_id in waiting:
                store.coverage[op_id] = job.job_id
                store.operations[op_id].job_id = job.job_id
                store.operations[op_id].move(OperationStatus.REPLYING)
            held.operation_ids = [*held.operation_ids, *waiting]
            return replace(job, messages=self._messages(held, held.operation_ids))
        if held.status is not JobStatus.PROCESSING:
            raise JobWithdrawn(f"job {job.job_id} withdrawn")
        now = store.now()
        d = held.delivery
        if d is None:
            held.delivery = FakeDelivery(DeliveryStatus.SENDING, text, now)
        else:
            may_have = job_state.may_have_sent(d.status, d.maybe_sent)
            since = d.maybe_since if d.maybe_sent else (d.started_at if may_have else None)
            if d.status is not DeliveryStatus.SENDING:
                d.move(DeliveryStatus.SENDING)
            d.text, d.started_at, d.maybe_sent, d.maybe_since = text, now, may_have, since
        return job

    async def record_sent(self, job: Job, text: str, platform_message_id: str) -> datetime:
        held = self._store.jobs[job.job_id]
        if held.status not in job_state.IN_FLIGHT:
            raise AssertionError(f"job {job.job_id} is not in flight: a reply cannot be recorded for it")
        if held.status is JobStatus.PENDING:
            held.move(JobStatus.PROCESSING)
        held.move(JobStatus.SENT)
        held.sent_text, held.platform_message_id = text, platform_message_id
        if held.delivery is not None and held.delivery.status is not DeliveryStatus.SENT:
            held.delivery.move(DeliveryStatus.SENT)
        for op_id in held.operation_ids:
            op = self._store.operations[op_id]
            if op.status in _ANSWERABLE:
                op.move(OperationStatus.REPLIED)
                op.job_id = job.job_id
        self.release()
        return self._store.now()

    async def recorded_message_ids(self, job: Job, limit: int = 200) -> list[str]:
        return [
            j.platform_message_id
            for j in self._store.jobs.values()
            if j.chat_key == job.chat_key and j.id != job.job_id and j.platform_message_id
        ][:limit]

    async def part_intent(self, job_id: uuid.UUID, number: int, text: str) -> None:
        raise NotImplementedError("replies in parts are proven by tests/integration/test_reply_parts.py")

    async def part_done(
        self, job_id: uuid.UUID, number: int, status: DeliveryStatus, message_id: str | None = None
    ) -> None:
        raise NotImplementedError("replies in parts are proven by tests/integration/test_reply_parts.py")

    async def delivery_parts(self, job_id: uuid.UUID) -> dict[int, Part]:
        return {}

    async def unknown_rivals(self, job: Job) -> list[Attempts]:
        return [
            Attempts(j.delivery.text, j.delivery.maybe_since or j.delivery.started_at, j.delivery.started_at)
            for j in self._store.jobs.values()
            if j.chat_key == job.chat_key
            and j.status is JobStatus.NEEDS_REVIEW
            and j.id != job.job_id
            and j.delivery is not None
        ]

    async def record_delivery(self, job_id: uuid.UUID, status: DeliveryStatus, error: str) -> None:
        d = self._store.jobs[job_id].delivery
        if d is not None and job_state.DELIVERY.allowed(d.status, status):
            d.move(status)

    async def record_retry(self, job_id: uuid.UUID, kind: str, reason: str) -> None:
        job = self._store.jobs[job_id]
        if job_state.LIFECYCLE.allowed(job.status, JobStatus.PENDING):
            job.move(JobStatus.PENDING)
            job.retries.append((kind, reason))

    async def give_up(self, job_id: uuid.UUID, kind: str, reason: str, owner: str) -> Settled:
        store = self._store
        if job_id in store.locked and not self._holds:
            return Settled(job_id, "busy", "", [])
        job = store.jobs.get(job_id)
        if job is None or job.status not in job_state.IN_FLIGHT:
            return Settled(job_id, "final", job.chat_key if job else "", [])
        d = job.delivery
        may_have = d is not None and job_state.may_have_sent(d.status, d.maybe_sent)
        target = JobStatus.NEEDS_REVIEW if may_have else JobStatus.FAILED
        if not may_have:
            for op_id in [o for o, holder in store.coverage.items() if holder == job_id]:
                del store.coverage[op_id]
        job.move(target)
        changed = []
        for op_id in job.operation_ids:
            op = store.operations[op_id]
            if op.job_id == job_id and op.status in _ANSWERABLE:
                op.move(OperationStatus(target.value))
                changed.append(op_id)
        return Settled(job_id, target.value, job.chat_key, changed)
