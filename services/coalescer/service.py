"""The coalescer's I/O shell: consume inbound messages into per-chat windows in
Postgres, and emit one reply job per due window.

Time: every timestamp comes from Postgres (``clock_timestamp()``), the one clock all
replicas share. A message counts from when the coalescer files it, so a backlog after an
outage delays a burst's answer but never splits the burst into several answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import random
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import asyncpg
from prometheus_client import Counter, Gauge, Histogram
from pydantic import ValidationError

from shared import metrics
from shared.alerts import Alerter
from shared.broker.consumer import Reject
from shared.broker.delivery import Delivery
from shared.faults import fault_point
from shared.ids import derived_id, new_id
from shared.messages import InboundMessage, JobCaps, JobMessage, ReplyJob
from stores.windows.postgres import PgWindowStore
from stores.windows.protocol import Filing, Refused, WindowSession, WindowStore
from stores.windows.window import Window, WindowPolicy, on_message

logger = logging.getLogger(__name__)

OPEN_WINDOWS = Gauge("chatq_coalescer_open_windows", "Open chat windows (bursts being gathered).")
EMISSION_LAG = Histogram(
    "chatq_coalescer_emission_lag_seconds",
    "How late a window was emitted after its due time.",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
JOBS_EMITTED = Counter("chatq_coalescer_jobs_emitted_total", "Reply jobs emitted.")
MESSAGES_FILED = Counter(
    "chatq_coalescer_messages_total", "Inbound messages handled, by outcome (filed, duplicate).", ["outcome"]
)
BATCH_MESSAGES = Histogram(
    "chatq_coalescer_batch_messages",
    "Inbound messages filed by one committed transaction.",
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
)

#: Job ids are derived from window ids: emitting a window twice would give the same job.
JOB_NAMESPACE = uuid.UUID("6f1d3c2e-8a43-4e0b-9f55-3c1a2b7d9e10")


def job_id_for(window_id: uuid.UUID) -> uuid.UUID:
    return derived_id(window_id, JOB_NAMESPACE)


def _parse(message: Delivery) -> InboundMessage:
    try:
        return InboundMessage.from_bytes(message.body)
    except ValidationError as exc:
        raise Reject(f"not a chatq.inbound.v1 message: {exc.error_count()} error(s)") from None


@dataclass(frozen=True)
class Filed:
    window_id: uuid.UUID
    due_at: datetime
    opened: bool


class KeyedLocks:
    """One FIFO lock per key, dropped when nobody holds or waits for it."""

    def __init__(self) -> None:
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}

    @contextlib.asynccontextmanager
    async def hold(self, key: str) -> AsyncIterator[None]:
        lock, users = self._locks.get(key, (asyncio.Lock(), 0))
        self._locks[key] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._locks[key]
            if users <= 1:
                del self._locks[key]
            else:
                self._locks[key] = (lock, users - 1)


#: The least time between two rounds of the scheduler. Woken at every job's end, it ran a
#: round for each responder's batch of records: about 80 rounds a second at 400 replies a
#: second, a third more of the coalescer's CPU a reply (bench.pipeline). Gathering the ends
#: of 50 ms (alternating pairs against 25 ms: Postgres CPU a reply 1.16 ms against 1.45,
#: 440-453 msg/s against 360-388) is far inside the time an account's share of jobs in
#: flight takes to send, and nothing next to a reply's human-like pause.
ROUND_GAP_SECONDS = 0.05


class Coalescer:
    def __init__(
        self,
        store: asyncpg.Pool | WindowStore,
        policy: WindowPolicy,
        *,
        draw: Callable[[], float] | None = None,
        on_jobs_emitted: Callable[[], None] = lambda: None,
        alerter: Alerter | None = None,
        owner: str = "on-call",
        caps: JobCaps | None = None,
        policy_for: Callable[[str, str], WindowPolicy] | None = None,
        account_jobs: int = 0,
        alone_jobs: int = 0,
    ) -> None:
        #: Fair share: the most unfinished reply jobs one account has emitted (0: no limit),
        #: and (if larger) the most of an account alone (no other with a window due or a
        #: job unfinished).
        self._account_jobs = account_jobs
        self._alone_jobs = alone_jobs
        #: A pool is the Postgres store; the unit tests give the in-memory one.
        self._store: WindowStore = PgWindowStore(store) if isinstance(store, asyncpg.Pool) else store
        self._policy = policy
        # An account's own reply pause (its override), else ``policy``.
        self._policy_for = policy_for or (lambda _platform, _account: policy)
        self._alerter = alerter
        self._owner = owner
        self._draw = draw or random.SystemRandom().random
        self._on_jobs_emitted = on_jobs_emitted
        self._caps = caps or JobCaps()
        self._wake = asyncio.Event()
        self._stop_requested = asyncio.Event()
        #: When the scheduler looks again unless woken (None: now, or it is backing off).
        self._sleep_until: datetime | None = None
        self._stopping = False
        self._chat_locks = KeyedLocks()

    # ---- consuming -------------------------------------------------------------

    async def handle(self, message: Delivery) -> None:
        """Consumer handler: file one inbound message into its chat's window. The consumer
        runs it when a batch could not be filed as a whole (each message settles alone)."""
        inbound = _parse(message)
        # Messages of one chat are filed in the order they were delivered: the consumer
        # runs deliveries concurrently, and an asyncio.Lock wakes its waiters in FIFO order.
        async with self._chat_locks.hold(inbound.chat_key):
            filed = await self.file(inbound)
        fault_point("coalescer.after_commit")
        self._wake_for([filed])

    async def handle_batch(self, messages: Sequence[Delivery]) -> list[Exception | None]:
        """Consumer batch handler: file the inbound messages delivered together, in delivery
        order, in one transaction. Returns, per message, None (filed, or a redelivery) or
        what that message alone raised (``Reject``: not our schema, or not in the inbox);
        raises when the batch fails as a whole, and the consumer then hands each message
        to ``handle``. The consumer gives one batch at a time, so a chat's messages are
        filed in the order they were delivered without the per-chat locks of ``handle``."""
        outcomes: list[Exception | None] = [None] * len(messages)
        parsed: list[tuple[int, InboundMessage]] = []
        for i, message in enumerate(messages):
            try:
                parsed.append((i, _parse(message)))
            except Reject as exc:
                outcomes[i] = exc
        filed = await self.file_many([inbound for _, inbound in parsed])
        fault_point("coalescer.after_commit")
        for (i, _), result in zip(parsed, filed, strict=True):
            if isinstance(result, Reject):
                outcomes[i] = result
        self._wake_for(filed)
        return outcomes

    def _wake_for(self, filed: Sequence[Filed | Reject | None]) -> None:
        """Wake the scheduler only for a window due before it means to look again (a burst
        of messages pushing their windows out does not spin it)."""
        due = [f.due_at for f in filed if isinstance(f, Filed)]
        if due and (self._sleep_until is None or min(due) < self._sleep_until):
            self._wake.set()

    async def file(self, inbound: InboundMessage) -> Filed | None:
        """Add the message to its chat's open window (opening one if needed), in one
        transaction. Returns None for a message already filed (a redelivery)."""
        (result,) = await self.file_many([inbound])
        if isinstance(result, Reject):
            raise result
        return result

    async def file_many(self, inbound: Sequence[InboundMessage]) -> list[Filed | Reject | None]:
        """Add the messages, in this order, to their chats' open windows (opening them as
        needed), in one transaction. Per message: where it was filed, None when it was
        filed already (a redelivery, also within the batch), or ``Reject`` when its
        operation is not in the inbox (nothing of it is written)."""
        results: list[Filed | Reject | None] = []
        filings: list[Filing] = []
        async with self._store.transaction() as tx:
            # The chats' locks serialise their messages across replicas (windows of other
            # chats proceed in parallel); the rest is read under them.
            chats = await tx.lock_chats([(m.chat_key, m.operation_id) for m in inbound])
            # Each chat's window as the batch leaves it so far (its id is None until it opens).
            windows: dict[str, tuple[uuid.UUID | None, Window | None]] = {}
            seen: set[uuid.UUID] = set()
            for m, chat in zip(inbound, chats, strict=True):
                if chat.duplicate or m.operation_id in seen:
                    results.append(None)
                    continue
                if not chat.known:
                    results.append(Reject(f"operation {m.operation_id} is not in the inbox"))
                    continue
                seen.add(m.operation_id)
                window_id, before = windows.get(m.chat_key, (chat.window_id, chat.window))
                window = self._moved_on(before, m, chat.now)
                opened = window_id is None
                window_id = new_id() if window_id is None else window_id
                windows[m.chat_key] = (window_id, window)
                filings.append(Filing(window_id, m, window, opened=opened))
                results.append(Filed(window_id, window.due_at, opened=opened))
            await tx.file(filings)
            fault_point("coalescer.before_commit")
        MESSAGES_FILED.labels(outcome="filed").inc(len(filings))
        MESSAGES_FILED.labels(outcome="duplicate").inc(results.count(None))
        if filings:
            BATCH_MESSAGES.observe(len(filings))
        for f in filings:
            logger.info(
                "filed %s in window %s of %s (%d message(s), due %s)",
                f.inbound.operation_id,
                f.window_id,
                f.inbound.chat_key,
                f.window.message_count,
                f.window.due_at.isoformat(timespec="milliseconds"),
            )
        return results

    def _moved_on(self, window: Window | None, inbound: InboundMessage, now: datetime) -> Window:
        """The chat's window after this message (``windows.on_message`` decides), at the
        database clock ``now`` read under the chat's lock."""
        policy = self._policy_for(inbound.platform, inbound.account_id)
        # The window's pause counts from the message's receipt (Postgres' clock, as
        # ``now``), not from this filing: a message filed late (behind another account's
        # flood in the inbound queue) waits that much less.
        at = min(now, inbound.received_at)
        window = on_message(window, at, policy, self._draw)
        # Yet it waits QUIET_SECONDS after this filing (never past its deadline): the
        # buyer's next messages, right behind this one in a backlog, join it.
        floor = min(now + timedelta(seconds=policy.quiet), window.deadline_at)
        if window.due_at < floor:
            window = dataclasses.replace(window, due_at=floor)
        return window

    async def give_up(self, message: Delivery, kind: str, reason: str) -> None:
        """Consumer hook before an inbound message is dead-lettered, and the dead-letter
        recorder's: an operation that was never filed fails, with the reason and an owner,
        for a person to retry. One already in a window is left to its reply."""
        try:
            operation_id = uuid.UUID(message.message_id or "")
        except ValueError:
            return
        why = f"could not be filed in its chat's window ({kind}): {reason}"
        changed = await self._store.fail_unfiled(operation_id, why, self._owner)
        if not changed:
            return
        metrics.OPERATIONS.labels(outcome="failed").inc()
        logger.warning(
            "operation %s failed (owner %s): %s",
            operation_id,
            self._owner,
            why,
            extra={"operation_id": operation_id},
        )
        if self._alerter is not None:
            await self._alerter.announce(
                "operation.failed",
                {"operations": [str(operation_id)], "reason": why, "kind": kind, "owner": self._owner},
            )

    async def dead_lettered(self, message: Delivery, reason: str) -> None:
        await self.give_up(message, "exhausted", reason)

    # ---- emitting --------------------------------------------------------------

    async def emit_due(self, limit: int = 200) -> int:
        """Close due, unblocked windows; for each, write its reply job and the job's outbox
        row, all in one transaction. Returns jobs emitted.

        A window left empty (its messages went to a reply's fold-in or back to a person)
        closes without a job. A window holding more than one job may carry (JOB_MAX_*)
        gives the rest of its messages, in order, to the chat's next window. One window
        whose rows Postgres refuses (a constraint it breaks) is set aside alone: its
        messages fail with the reason, for a person, and the other windows go out."""
        async with self._store.transaction() as tx:
            due = await tx.claim_due(limit, self._account_jobs, self._alone_jobs)
            if not due:
                return 0
            ids = [w.id for w in due]
            messages: dict[uuid.UUID, list[JobMessage]] = {i: [] for i in ids}
            overflow: dict[uuid.UUID, list[uuid.UUID]] = {}
            for m in await tx.messages(ids):
                if m.n > 1 and (m.n > self._caps.messages or m.chars > self._caps.chars):
                    overflow.setdefault(m.window_id, []).append(m.message.operation_id)
                    continue
                messages[m.window_id].append(m.message)
            now = await tx.now()
            empty = [w.id for w in due if not messages[w.id]]
            if empty:
                await tx.drop(empty)
                logger.info("closed %d empty window(s) without a job", len(empty))
            # A window past the cap keeps the rest of its messages and stays open (blocked
            # by this job); the part answered now gets a closed window of its own.
            parts = {w.id: new_id() if w.id in overflow else w.id for w in due}
            jobs = [
                ReplyJob(
                    job_id=job_id_for(parts[w.id]),
                    window_id=parts[w.id],
                    platform=w.platform,
                    account_id=w.account_id,
                    chat_id=w.chat_id,
                    messages=tuple(messages[w.id]),
                    created_at=now,
                )
                for w in due
                if messages[w.id]
            ]
            split = {part: window for window, part in parts.items() if part != window}
            try:
                await tx.write_jobs(jobs, split, now)
            except Refused:
                # One window's rows are refused: write them one by one, so that window
                # alone is set aside and every other chat gets its reply.
                written = []
                for job in jobs:
                    try:
                        await tx.write_jobs([job], split, now)
                        written.append(job)
                    except Refused as refused:
                        await self._set_aside(tx, job, refused)
                jobs = written
        fault_point("coalescer.after_emit")
        for w in due:
            EMISSION_LAG.observe(max((now - w.due_at).total_seconds(), 0.0))
        JOBS_EMITTED.inc(len(jobs))
        for j in jobs:
            logger.info(
                "emitted job %s for %s with %d message(s)",
                j.job_id,
                j.chat_key,
                len(j.messages),
                extra={"job_id": j.job_id, "chat": j.chat_key},
            )
        if split:
            logger.info(
                "%d window(s) held more than one job carries: the rest waits for the next job", len(split)
            )
        if jobs:
            self._on_jobs_emitted()
        return len(due)

    async def _set_aside(self, tx: WindowSession, job: ReplyJob, refused: Refused) -> None:
        """A window Postgres refuses to emit: its messages fail with the reason (a person
        may retry them) and the window goes, so the chat is not held by it."""
        reason = f"its window could not be emitted ({refused})"[:500]
        failed = await tx.set_aside(job, reason, self._owner)
        metrics.OPERATIONS.labels(outcome="failed").inc(len(failed))
        logger.error(
            "window %s of %s set aside: %s",
            job.window_id,
            job.chat_key,
            reason,
            extra={"job_id": job.job_id, "chat": job.chat_key},
        )
        if self._alerter is not None:
            await self._alerter.announce(
                "operation.failed",
                {"operations": [str(i) for i in failed], "reason": reason, "owner": self._owner},
            )

    def wake(self) -> None:
        """Look for due windows now (a job ended, or a window falls due sooner)."""
        self._wake.set()

    def stop(self) -> None:
        self._stopping = True
        self._stop_requested.set()
        self._wake.set()

    async def run_scheduler(self, *, poll_seconds: float = 0.5, batch: int = 200) -> None:
        """Emit windows as they fall due. Sleeps until the next due window, at most
        ``poll_seconds``. A newly filed message wakes it only when its window falls due
        before that (see ``handle``); a reply recorded wakes it at once (``wake``, on the
        notification the responder sends on JOBS_ENDED_CHANNEL after its records): the
        end frees a place of its account's fair share and unblocks its chat's next
        window, so a lone account's flood is not held to a share a poll. Notifications
        that arrive during a round make one more round. Other ends (a give-up, a
        withdrawal) and a lost notification connection are the poll's. After a failure
        it backs off, and nothing but stop() cuts that short."""
        backoff = 0.1
        loop = asyncio.get_running_loop()
        last_round = -ROUND_GAP_SECONDS
        while not self._stopping:
            # Jobs end a few at a time (a responder records its batch in one statement), each
            # end a notification: rounds at least ROUND_GAP_SECONDS apart take what ended
            # meanwhile together.
            gap = loop.time() - last_round
            if gap < ROUND_GAP_SECONDS:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(ROUND_GAP_SECONDS - gap):
                        await self._stop_requested.wait()
                if self._stopping:
                    break
            last_round = loop.time()
            self._wake.clear()
            try:
                await self._store.unblock_expired_holds()
                while await self.emit_due(batch) == batch and not self._stopping:
                    pass
                wait = await self.seconds_to_next_due()
                backoff = 0.1
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                logger.warning("scheduler: %s: %s; retrying in %.1fs", type(exc).__name__, exc, backoff)
                self._sleep_until = None
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
                continue
            timeout = poll_seconds if wait is None else min(max(wait, 0.0), poll_seconds)
            self._sleep_until = datetime.now(UTC) + timedelta(seconds=timeout)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self._wake.wait()

    async def seconds_to_next_due(self) -> float | None:
        return await self._store.seconds_to_next_due()

    async def refresh_stats(self) -> int:
        n = await self._store.open_windows()
        OPEN_WINDOWS.set(n)
        return n
