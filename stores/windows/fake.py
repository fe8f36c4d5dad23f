"""The coalescer's state in memory: an implementation of ``stores.windows.protocol`` that
takes the decisions of its Postgres side (the chat's lock and what it reads, the claim of
due windows, platform order, the writes of an emission, setting a window aside) on dicts,
and moves every operation through the same transition table as Postgres (shared/state: a
move it refuses raises TransitionNotAllowed). A transaction that raises leaves nothing
behind. The coalescer's filing and emission decisions run on it in milliseconds;
tests/contract/test_windows.py runs the same bodies on it and on Postgres."""

from __future__ import annotations

import contextlib
import copy
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import asyncpg

from shared.messages import InboundMessage, JobMessage, Platform, ReplyJob, chat_key
from shared.state import operation as operation_state
from shared.state.operation import OperationStatus
from stores.windows.protocol import ChatState, DueWindow, Filing, Listed, Refused, WindowSession
from stores.windows.window import Window

T0 = datetime(2026, 11, 1, 12, 0, tzinfo=UTC)
S = OperationStatus
_UNFILED = (S.ACCEPTED, S.QUEUED)


@dataclass
class FakeOperation:
    inbound: InboundMessage
    status: OperationStatus = S.QUEUED
    job_id: uuid.UUID | None = None
    reason: str | None = None
    owner: str | None = None

    def move(self, to: OperationStatus) -> None:
        operation_state.LIFECYCLE.check(self.status, to)
        self.status = to


@dataclass
class FakeWindow:
    id: uuid.UUID
    chat_key: str
    platform: Platform
    account_id: str
    chat_id: str
    window: Window
    blocked: bool
    status: str = "open"
    job_id: uuid.UUID | None = None


@dataclass
class _State:
    operations: dict[uuid.UUID, FakeOperation]
    windows: dict[uuid.UUID, FakeWindow]
    #: window_messages: operation -> its window
    filed: dict[uuid.UUID, uuid.UUID]
    #: reply jobs by id, and whether each is still in flight
    jobs: dict[uuid.UUID, ReplyJob]
    in_flight: set[uuid.UUID]
    outbox: list[ReplyJob]
    events: list[tuple[uuid.UUID, str, uuid.UUID | None]]


class InMemoryWindows:
    """Operations, windows, jobs, the outbox and each operation's record; chats the seller
    holds; chats whose rows the store refuses (a data error, say a constraint)."""

    def __init__(self) -> None:
        self.state = _State({}, {}, {}, {}, set(), [], [])
        self.held: set[str] = set()
        self.refuse: set[str] = set()
        self.clock = T0
        #: The messages filed by each committed transaction that filed any.
        self.committed_filings: list[int] = []

    # ---- seeding and reading ----------------------------------------------------------

    def advance(self, seconds: float) -> None:
        self.clock += timedelta(seconds=seconds)

    def receive(
        self,
        chat_id: str = "c1",
        text: str = "hello",
        *,
        platform: Platform = "telegram",
        account_id: str = "bot",
        message_id: str | None = None,
        sent_at: datetime | None = None,
    ) -> InboundMessage:
        """A buyer message stored and queued (the intake's part); returns what the broker
        delivers to the coalescer."""
        n = len(self.state.operations) + 1
        inbound = InboundMessage(
            operation_id=uuid.uuid4(),
            platform=platform,
            account_id=account_id,
            chat_id=chat_id,
            message_id=message_id or str(n),
            author_id="buyer",
            text=text,
            sent_at=sent_at or self.clock,
            received_at=self.clock,
        )
        self.state.operations[inbound.operation_id] = FakeOperation(inbound)
        return inbound

    def operation(self, inbound: InboundMessage) -> FakeOperation:
        return self.state.operations[inbound.operation_id]

    def open_window(self, key: str) -> FakeWindow | None:
        return next(
            (w for w in self.state.windows.values() if w.chat_key == key and w.status == "open"), None
        )

    def events(self, inbound: InboundMessage) -> list[str]:
        return [kind for op, kind, _ in self.state.events if op == inbound.operation_id]

    def end_job(self, job_id: uuid.UUID) -> None:
        """The responder settled the job: its chat's open window goes on."""
        self.state.in_flight.discard(job_id)
        key = self.state.jobs[job_id].chat_key
        if (w := self.open_window(key)) is not None:
            w.blocked = self._blocked(key)

    def _blocked(self, key: str) -> bool:
        return key in self.held or any(self.state.jobs[j].chat_key == key for j in self.state.in_flight)

    # ---- the store ---------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def transaction(self) -> AsyncIterator[WindowSession]:
        saved = copy.deepcopy(self.state)
        session = _Session(self)
        try:
            yield session
        except BaseException:
            self.state = saved
            raise
        if session.filed:
            self.committed_filings.append(session.filed)

    async def fail_unfiled(self, operation_id: uuid.UUID, reason: str, owner: str) -> bool:
        op = self.state.operations.get(operation_id)
        if op is None or op.status not in _UNFILED:
            return False
        _fail(self.state, op, reason, owner)
        return True

    async def unblock_expired_holds(self) -> None:
        return None

    async def seconds_to_next_due(self) -> float | None:
        # Windows due already but not emitted are looked at again at the next poll.
        ready = [w for w in self._claimable() if w.window.due_at > self.clock]
        if not ready:
            return None
        return (min(w.window.due_at for w in ready) - self.clock).total_seconds()

    async def open_windows(self) -> int:
        return sum(w.status == "open" for w in self.state.windows.values())

    def _claimable(self) -> list[FakeWindow]:
        """Open, not blocked, and no message of the chat in transit that it must wait for
        (received before the window falls due, not yet filed, within 60 s)."""
        return [
            w
            for w in self.state.windows.values()
            if w.status == "open" and not w.blocked and not self._awaits_in_transit(w)
        ]

    def _awaits_in_transit(self, w: FakeWindow) -> bool:
        return any(
            chat_key(o.inbound.platform, o.inbound.account_id, o.inbound.chat_id) == w.chat_key
            and o.status in _UNFILED
            and o.inbound.operation_id not in self.state.filed
            and w.window.due_at > o.inbound.received_at > self.clock - timedelta(seconds=60)
            for o in self.state.operations.values()
        )


def _fail(state: _State, op: FakeOperation, reason: str, owner: str) -> None:
    op.move(S.FAILED)
    op.reason, op.owner = reason[:500], owner
    state.events.append((op.inbound.operation_id, "failed", None))


def _order(m: InboundMessage) -> tuple[datetime, int, str, datetime, str]:
    """Platform order (chatq_order): the platform's time; Telegram's ids as numbers; then
    receipt."""
    telegram = m.platform == "telegram"
    return (
        m.sent_at,
        len(m.message_id) if telegram else 0,
        m.message_id if telegram else "",
        m.received_at,
        m.message_id,
    )


def _refuse_unstorable(text: str) -> None:
    """Postgres stores no NUL in text: the statement fails with a data error, as there."""
    if "\x00" in text:
        raise asyncpg.CharacterNotInRepertoireError('invalid byte sequence for encoding "UTF8": 0x00')


class _Session:
    def __init__(self, store: InMemoryWindows) -> None:
        self._store = store
        self._s = store.state
        self.filed = 0

    async def lock_chats(self, messages: Sequence[tuple[str, uuid.UUID]]) -> list[ChatState]:
        for key, _ in messages:
            _refuse_unstorable(key)
        states = []
        for key, operation_id in messages:
            op = self._s.operations.get(operation_id)
            w = self._store.open_window(key)
            states.append(
                ChatState(
                    duplicate=(op is not None and op.status not in _UNFILED) or operation_id in self._s.filed,
                    known=op is not None,
                    now=self._store.clock,
                    window_id=w.id if w else None,
                    window=w.window if w else None,
                )
            )
        return states

    async def file(self, filings: Sequence[Filing]) -> None:
        self.filed += len(filings)
        for f in filings:
            inbound, key = f.inbound, f.inbound.chat_key
            if f.opened:
                self._s.windows[f.window_id] = FakeWindow(
                    f.window_id,
                    key,
                    inbound.platform,
                    inbound.account_id,
                    inbound.chat_id,
                    f.window,
                    blocked=self._store._blocked(key),
                )
            else:
                self._s.windows[f.window_id].window = f.window
            self._s.filed[inbound.operation_id] = f.window_id
            op = self._s.operations[inbound.operation_id]
            if op.status in _UNFILED:
                op.move(S.WAITING)
            kind = "held" if key in self._store.held else "filed"
            self._s.events.append((inbound.operation_id, kind, None))

    async def claim_due(self, limit: int, account_jobs: int, alone_jobs: int = 0) -> list[DueWindow]:
        # As _CLAIM_DUE: the share is decided over every due, unblocked window (one that
        # waits for a message of its chat in transit included: it is due, and holds its
        # place), and only the windows placed are checked for messages in transit.
        due = sorted(
            (
                w
                for w in self._store.state.windows.values()
                if w.status == "open" and not w.blocked and w.window.due_at <= self._store.clock
            ),
            key=lambda w: w.window.due_at,
        )
        if account_jobs > 0:
            # Fair share: an account's unfinished jobs, then its earliest due windows,
            # fill its places; the rest wait. An account alone (no other with a window
            # due or a job unfinished) has ``alone_jobs`` places.
            places: dict[tuple[str, str], int] = {}
            for j in self._s.in_flight:
                account = (self._s.jobs[j].platform, self._s.jobs[j].account_id)
                places[account] = places.get(account, 0) + 1
            active = {(w.platform, w.account_id) for w in due} | set(places)
            share = account_jobs
            if alone_jobs > account_jobs and len(active) == 1:
                share = alone_jobs
            fair = []
            for w in due:
                account = (w.platform, w.account_id)
                places[account] = places.get(account, 0) + 1
                if places[account] <= share:
                    fair.append(w)
            due = fair
        due = [w for w in due if not self._store._awaits_in_transit(w)]
        return [
            DueWindow(w.id, w.chat_key, w.platform, w.account_id, w.chat_id, w.window.due_at) for w in due
        ][:limit]

    async def messages(self, window_ids: Sequence[uuid.UUID]) -> list[Listed]:
        listed = []
        for wid in window_ids:
            ops = sorted(
                (self._s.operations[o].inbound for o, w in self._s.filed.items() if w == wid), key=_order
            )
            chars = 0
            for n, m in enumerate(ops, 1):
                chars += len(m.text)
                message = JobMessage(
                    operation_id=m.operation_id,
                    message_id=m.message_id,
                    author_id=m.author_id,
                    text=m.text,
                    sent_at=m.sent_at,
                    received_at=m.received_at,
                )
                listed.append(Listed(wid, message, n, chars))
        return listed

    async def now(self) -> datetime:
        return self._store.clock

    async def drop(self, window_ids: Sequence[uuid.UUID]) -> None:
        for wid in window_ids:
            del self._s.windows[wid]

    async def write_jobs(
        self, jobs: Sequence[ReplyJob], split: Mapping[uuid.UUID, uuid.UUID], now: datetime
    ) -> None:
        refused = [j.chat_key for j in jobs if j.chat_key in self._store.refuse]
        if refused:
            raise Refused(ValueError(f"the store refuses the rows of {refused[0]}"))
        for j in jobs:
            if j.window_id in split:
                origin = self._s.windows[split[j.window_id]]
                kept = len(j.messages)
                self._s.windows[j.window_id] = FakeWindow(
                    j.window_id,
                    origin.chat_key,
                    origin.platform,
                    origin.account_id,
                    origin.chat_id,
                    Window(
                        origin.window.first_at,
                        origin.window.last_at,
                        origin.window.deadline_at,
                        origin.window.due_at,
                        origin.window.delay_seconds,
                        kept,
                    ),
                    blocked=False,
                    status="closed",
                    job_id=j.job_id,
                )
                for m in j.messages:
                    self._s.filed[m.operation_id] = j.window_id
                w = origin.window
                origin.window = Window(
                    w.first_at,
                    w.last_at,
                    max(w.deadline_at, now),
                    now,
                    w.delay_seconds,
                    w.message_count - kept,
                )
                origin.blocked = True
            else:
                window = self._s.windows[j.window_id]
                window.status, window.job_id = "closed", j.job_id
            self._s.jobs[j.job_id] = j
            self._s.in_flight.add(j.job_id)
            for m in j.messages:
                self._s.operations[m.operation_id].job_id = j.job_id
                self._s.events.append((m.operation_id, "emitted", j.job_id))
            self._s.outbox.append(j)

    async def set_aside(self, job: ReplyJob, reason: str, owner: str) -> list[uuid.UUID]:
        ids = [m.operation_id for m in job.messages]
        for i in ids:
            self._s.filed.pop(i, None)
        if job.window_id in self._s.windows and job.window_id not in self._s.filed.values():
            del self._s.windows[job.window_id]
        failed = []
        for i in ids:
            op = self._s.operations[i]
            if operation_state.LIFECYCLE.allowed(op.status, S.FAILED):
                _fail(self._s, op, reason, owner)
                failed.append(i)
        return failed
