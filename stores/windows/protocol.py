"""The windows aggregate's interface: ``WindowStore`` (the store) and ``WindowSession``
(one transaction: filing the messages delivered together, or emitting due windows), as
Protocols, and the values they trade. ``postgres.PgWindowStore`` implements them on
stores/windows/functions/20_windows.sql, ``fake.InMemoryWindows`` in memory under the same
operation transition table (shared/state); tests/contract/test_windows.py runs one set of
test bodies against both. The debounce rule itself is ``window`` (pure)."""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol

from shared.messages import InboundMessage, JobMessage, Platform, ReplyJob
from stores.windows.window import Window


@dataclass(frozen=True)
class ChatState:
    """What filing reads under the chat's lock: whether the message is a duplicate for
    the coalescer (filed already, or past queued), whether it is in the inbox, the
    database clock, and the chat's open window (None when there is none)."""

    duplicate: bool
    known: bool
    now: datetime
    window_id: uuid.UUID | None
    window: Window | None


@dataclass(frozen=True)
class Filing:
    """One message filed: its window as it stands after the message, and whether the
    message opened it (the window is new; later messages of a batch add to it)."""

    window_id: uuid.UUID
    inbound: InboundMessage
    window: Window
    opened: bool


@dataclass(frozen=True)
class DueWindow:
    id: uuid.UUID
    chat_key: str
    platform: Platform
    account_id: str
    chat_id: str
    due_at: datetime


@dataclass(frozen=True)
class Listed:
    """A due window's message in platform order, with the window's running count and
    text length up to it (for the cap on what one job carries)."""

    window_id: uuid.UUID
    message: JobMessage
    n: int
    chars: int


class Refused(Exception):
    """The store refused one batch of jobs for its data (a constraint a window's rows
    break, a value they hold), not for the database or the connection. Nothing of the
    batch was written."""

    def __init__(self, error: Exception) -> None:
        super().__init__(f"{type(error).__name__}: {error}")
        self.error = error


class WindowSession(Protocol):
    """One transaction of the coalescer's."""

    async def lock_chats(self, messages: Sequence[tuple[str, uuid.UUID]]) -> list[ChatState]:
        """Take the locks of the chats of these (chat key, operation id) pairs, in one order
        whatever the batch (a chat's messages are filed one batch at a time across
        replicas, and two batches never wait for each other in a cycle); then what filing
        reads under them, one ``ChatState`` per pair in order (the chat's window as it
        stands before the batch)."""
        ...

    async def file(self, filings: Sequence[Filing]) -> None:
        """Write the filings of a batch, in the order of their messages: each window once,
        as its last filing leaves it (opened by the batch, or moved on), each message in
        it, and each operation waiting."""
        ...

    async def claim_due(self, limit: int, account_jobs: int, alone_jobs: int = 0) -> list[DueWindow]:
        """Due, unblocked windows no message of their chat received before they fell due
        is in transit for,
        locked (other replicas skip them). ``account_jobs`` > 0: an account's share, the
        most unfinished reply jobs it may have (its earliest due windows fill its free
        places; the rest wait); ``alone_jobs`` (if larger) the share of an account alone:
        no other account has a window due or a job unfinished."""
        ...

    async def messages(self, window_ids: Sequence[uuid.UUID]) -> list[Listed]: ...

    async def now(self) -> datetime: ...

    async def drop(self, window_ids: Sequence[uuid.UUID]) -> None:
        """Windows left empty close without a job."""
        ...

    async def write_jobs(
        self, jobs: Sequence[ReplyJob], split: Mapping[uuid.UUID, uuid.UUID], now: datetime
    ) -> None:
        """The jobs, their windows closed, their operations pointed at them, their outbox
        rows; all or nothing (raises Refused). A job in ``split`` (its window id -> the
        window it came from) answers part of a window past the cap: its part gets a
        closed window of its own, and the window it came from stays open with the rest,
        due now and blocked by this job."""
        ...

    async def set_aside(self, job: ReplyJob, reason: str, owner: str) -> list[uuid.UUID]:
        """A job whose rows were refused: its messages fail with the reason (for a person)
        and its window goes. Returns the operations that failed."""
        ...


class WindowStore(Protocol):
    def transaction(self) -> AbstractAsyncContextManager[WindowSession]: ...

    async def fail_unfiled(self, operation_id: uuid.UUID, reason: str, owner: str) -> bool: ...

    async def unblock_expired_holds(self) -> None: ...

    async def seconds_to_next_due(self) -> float | None: ...

    async def open_windows(self) -> int: ...
