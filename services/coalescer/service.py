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
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import asyncpg
from aio_pika.abc import AbstractIncomingMessage
from prometheus_client import Counter, Gauge, Histogram
from pydantic import ValidationError

from shared import metrics
from shared.alerts import Alerter
from shared.broker.consumer import Reject
from shared.broker.topology import JOB_ROUTING_KEY, JOBS_EXCHANGE
from shared.db import Conn, one
from shared.faults import fault_point
from shared.messages import InboundMessage, JobCaps, JobMessage, ReplyJob
from shared.outbox import OutboxMessage, enqueue_many
from shared.state import operation as operation_state

from .windows import Window, WindowPolicy, on_message

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

#: Job ids are derived from window ids: emitting a window twice would give the same job.
JOB_NAMESPACE = uuid.UUID("6f1d3c2e-8a43-4e0b-9f55-3c1a2b7d9e10")


def job_id_for(window_id: uuid.UUID) -> uuid.UUID:
    return uuid.uuid5(JOB_NAMESPACE, str(window_id))


@dataclass(frozen=True)
class Filed:
    window_id: uuid.UUID
    due_at: datetime
    opened: bool


_LOCK_CHAT_WINDOW = "SELECT * FROM chatq_lock_chat_window($1, $2)"

# Filing writes in one statement: the window (opened, or moved on), the message in it,
# and the operation's status.
_FILED = """
, filed AS (INSERT INTO window_messages (operation_id, window_id) SELECT $2, id FROM w)
, held AS (SELECT c.held_until FROM chats c WHERE c.chat_key = $6 AND c.held_until > now())
, ev AS (
    INSERT INTO operation_events (operation_id, kind, detail)
    SELECT $2,
           CASE WHEN held.held_until IS NULL THEN 'filed' ELSE 'held' END,
           CASE WHEN held.held_until IS NULL
                THEN 'filed in the chat''s window, waiting for the buyer to finish typing (due '
                     || to_char($4::timestamptz AT TIME ZONE 'UTC', 'HH24:MI:SS') || ' UTC)'
                ELSE 'filed in the chat''s window; the seller holds the chat until '
                     || to_char(held.held_until AT TIME ZONE 'UTC', 'HH24:MI') || ' UTC'
           END
    FROM w LEFT JOIN held ON true
)
UPDATE operations SET status = 'waiting', updated_at = now()
WHERE id = $2 AND status IN ('accepted', 'queued')
"""

# A window opened while its chat has a reply job in flight, or while the seller holds the
# chat, is blocked until that ends (the chat's lock, held here, serialises this with the
# job's end and the hold's: 40_windows_blocked.sql).
_FILE_OPENING = (
    """
WITH w AS (
    INSERT INTO chat_windows (id, chat_key, platform, account_id, chat_id, status, first_at, last_at,
                              deadline_at, due_at, delay_seconds, message_count, blocked)
    VALUES ($1, $6, $7, $8, $9, 'open', $10, $3, $11, $4, $12, $5, chatq_chat_blocked($6))
    RETURNING id
)
"""
    + _FILED
)

_FILE_ADDING = (
    """
WITH w AS (
    UPDATE chat_windows SET last_at = $3, due_at = $4, message_count = $5 WHERE id = $1 AND chat_key = $6 RETURNING id
)
"""
    + _FILED
)

# A window may close when it is due, not blocked (no job of its chat in flight: the
# ready-windows index holds only these), and no message of its chat received before the
# window's last one is still in transit (the SQL function says why; the responder's
# fold-in waits for the same). Blocked windows are never scanned.
#
# Fair share ($2 > 0, ACCOUNT_JOBS_IN_FLIGHT): an account with $2 reply jobs emitted and
# unfinished gets no more until some finish; its other due windows wait here, in order,
# instead of queueing ahead of every other account's jobs. Each account's earliest due
# windows fill its free places.
_CLAIM_DUE = """
WITH due AS (
    SELECT w.id, w.platform, w.account_id, w.due_at FROM chat_windows w
    WHERE w.status = 'open' AND NOT w.blocked AND w.due_at <= clock_timestamp()
), busy AS (
    SELECT r.platform, r.account_id, count(*) AS n FROM reply_jobs r
    WHERE $2 > 0 AND r.status IN ('pending', 'processing')
      AND (r.platform, r.account_id) IN (SELECT DISTINCT platform, account_id FROM due)
    GROUP BY 1, 2
), placed AS MATERIALIZED (
    SELECT d.id FROM (
        SELECT d.id, d.platform, d.account_id, d.due_at,
               row_number() OVER (PARTITION BY d.platform, d.account_id ORDER BY d.due_at) AS place
        FROM due d
    ) d LEFT JOIN busy b USING (platform, account_id)
    WHERE $2 = 0 OR d.place + coalesce(b.n, 0) <= $2
    ORDER BY d.due_at
    LIMIT $1 * 2
), ready AS MATERIALIZED (
    -- The in-transit check (a query each) only for the few placed windows.
    SELECT w.id FROM placed p JOIN chat_windows w ON w.id = p.id
    WHERE NOT chatq_earlier_in_transit(w.platform, w.account_id, w.chat_id, w.last_at)
)
SELECT w.id, w.chat_key, w.platform, w.account_id, w.chat_id, w.due_at
FROM chat_windows w
WHERE w.id IN (SELECT id FROM ready)
  AND w.status = 'open' AND NOT w.blocked AND w.due_at <= clock_timestamp()
ORDER BY w.due_at
LIMIT $1
FOR UPDATE OF w SKIP LOCKED
"""

# The next window to fall due. Windows already due but not emitted (their account at its
# fair share, a message of their chat in transit, another replica holding them) are
# looked at again at the next poll: counting them here would spin the scheduler.
_NEXT_DUE = """
SELECT extract(epoch FROM w.due_at - clock_timestamp())::float8
FROM chat_windows w
WHERE w.status = 'open' AND NOT w.blocked AND w.due_at > clock_timestamp()
  AND NOT chatq_earlier_in_transit(w.platform, w.account_id, w.chat_id, w.last_at)
ORDER BY w.due_at
LIMIT 1
"""

# The windows' messages in platform order (chatq_order), with each one's running count
# and text length, for the cap on what one job carries.
_WINDOW_MESSAGES = """
SELECT wm.window_id, o.id, o.message_id, o.author_id, o.text, o.sent_at, o.received_at,
       row_number() OVER w AS n, sum(length(o.text)) OVER w AS chars
FROM window_messages wm JOIN operations o ON o.id = wm.operation_id
WHERE wm.window_id = ANY($1::uuid[])
WINDOW w AS (PARTITION BY wm.window_id ORDER BY chatq_order(o.platform, o.sent_at, o.message_id, o.received_at))
ORDER BY wm.window_id, n
"""

#: SQLSTATE classes of errors that belong to one window's data (a constraint it breaks, a
#: value it holds), not to the database or the connection: that window is set aside.
_DATA_ERRORS = ("22", "23")


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


class Coalescer:
    def __init__(
        self,
        pool: asyncpg.Pool,
        policy: WindowPolicy,
        *,
        draw: Callable[[], float] | None = None,
        on_jobs_emitted: Callable[[], None] = lambda: None,
        alerter: Alerter | None = None,
        owner: str = "on-call",
        caps: JobCaps | None = None,
        policy_for: Callable[[str, str], WindowPolicy] | None = None,
        account_jobs: int = 0,
    ) -> None:
        #: Fair share: the most unfinished reply jobs one account has emitted (0: no limit).
        self._account_jobs = account_jobs
        self._pool = pool
        self._policy = policy
        # An account's own reply pause (its override), else ``policy``.
        self._policy_for = policy_for or (lambda _platform, _account: policy)
        self._alerter = alerter
        self._owner = owner
        self._draw = draw or random.SystemRandom().random
        self._on_jobs_emitted = on_jobs_emitted
        self._caps = caps or JobCaps()
        self._wake = asyncio.Event()
        #: When the scheduler looks again unless woken (None: now, or it is backing off).
        self._sleep_until: datetime | None = None
        self._stopping = False
        self._chat_locks = KeyedLocks()

    # ---- consuming -------------------------------------------------------------

    async def handle(self, message: AbstractIncomingMessage) -> None:
        """Consumer handler: file one inbound message into its chat's window."""
        try:
            inbound = InboundMessage.from_bytes(message.body)
        except ValidationError as exc:
            raise Reject(f"not a chatq.inbound.v1 message: {exc.error_count()} error(s)") from None
        # Messages of one chat are filed in the order they were delivered: the consumer
        # runs deliveries concurrently, and an asyncio.Lock wakes its waiters in FIFO order.
        async with self._chat_locks.hold(inbound.chat_key):
            filed = await self.file(inbound)
        fault_point("coalescer.after_commit")
        # Wake the scheduler only for a window due before it means to look again (a burst
        # of messages pushing their windows out does not spin it).
        if filed is not None and (self._sleep_until is None or filed.due_at < self._sleep_until):
            self._wake.set()

    async def file(self, inbound: InboundMessage) -> Filed | None:
        """Add the message to its chat's open window (opening one if needed), in one
        transaction. Returns None for a message already filed (a redelivery)."""
        key = inbound.chat_key
        async with self._pool.acquire() as conn, conn.transaction():
            # The chat's lock serialises its messages across replicas (windows of other
            # chats proceed in parallel); the rest is read under it.
            row = one(await conn.fetchrow(_LOCK_CHAT_WINDOW, key, inbound.operation_id))
            if row["duplicate"]:
                MESSAGES_FILED.labels(outcome="duplicate").inc()
                return None
            if not row["known"]:
                raise Reject(f"operation {inbound.operation_id} is not in the inbox")
            opened = row["id"] is None
            policy = self._policy_for(inbound.platform, inbound.account_id)
            # The window's pause counts from the message's receipt (Postgres' clock, as
            # ``now``), not from this filing: a message filed late (behind another
            # account's flood in the inbound queue) waits that much less.
            at = min(row["now"], inbound.received_at)
            window = on_message(None if opened else _window(row), at, policy, self._draw)
            # Yet it waits QUIET_SECONDS after this filing (never past its deadline): the
            # buyer's next messages, right behind this one in a backlog, join it.
            floor = min(row["now"] + timedelta(seconds=policy.quiet), window.deadline_at)
            if window.due_at < floor:
                window = dataclasses.replace(window, due_at=floor)
            window_id = uuid.uuid4() if opened else row["id"]
            await conn.execute(
                _FILE_OPENING if opened else _FILE_ADDING,
                window_id,
                inbound.operation_id,
                window.last_at,
                window.due_at,
                window.message_count,
                key,
                *(
                    (inbound.platform, inbound.account_id, inbound.chat_id, window.first_at,
                     window.deadline_at, window.delay_seconds)
                    if opened
                    else ()
                ),
            )  # fmt: skip
            fault_point("coalescer.before_commit")
        MESSAGES_FILED.labels(outcome="filed").inc()
        logger.info(
            "filed %s in window %s of %s (%d message(s), due %s)",
            inbound.operation_id,
            window_id,
            key,
            window.message_count,
            window.due_at.isoformat(timespec="milliseconds"),
        )
        return Filed(window_id, window.due_at, opened=opened)

    async def give_up(self, message: AbstractIncomingMessage, kind: str, reason: str) -> None:
        """Consumer hook before an inbound message is dead-lettered, and the dead-letter
        recorder's: an operation that was never filed fails, with the reason and an owner,
        for a person to retry. One already in a window is left to its reply."""
        try:
            operation_id = uuid.UUID(message.message_id or "")
        except ValueError:
            return
        why = f"could not be filed in its chat's window ({kind}): {reason}"
        async with self._pool.acquire() as conn:
            changed = await operation_state.fail_unfiled(conn, operation_id, why, self._owner)
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

    async def dead_lettered(self, message: AbstractIncomingMessage, reason: str) -> None:
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
        async with self._pool.acquire() as conn, conn.transaction():
            due = await conn.fetch(_CLAIM_DUE, limit, self._account_jobs)
            if not due:
                return 0
            ids = [w["id"] for w in due]
            messages: dict[uuid.UUID, list[JobMessage]] = {i: [] for i in ids}
            overflow: dict[uuid.UUID, list[uuid.UUID]] = {}
            for m in await conn.fetch(_WINDOW_MESSAGES, ids):
                if m["n"] > 1 and (m["n"] > self._caps.messages or m["chars"] > self._caps.chars):
                    overflow.setdefault(m["window_id"], []).append(m["id"])
                    continue
                messages[m["window_id"]].append(
                    JobMessage(
                        operation_id=m["id"],
                        message_id=m["message_id"],
                        author_id=m["author_id"],
                        text=m["text"],
                        sent_at=m["sent_at"],
                        received_at=m["received_at"],
                    )
                )
            now: datetime = await conn.fetchval("SELECT clock_timestamp()")
            empty = [w["id"] for w in due if not messages[w["id"]]]
            if empty:
                await conn.execute("DELETE FROM chat_windows WHERE id = ANY($1::uuid[])", empty)
                logger.info("closed %d empty window(s) without a job", len(empty))
            # A window past the cap keeps the rest of its messages and stays open (blocked
            # by this job); the part answered now gets a closed window of its own.
            parts = {w["id"]: uuid.uuid4() if w["id"] in overflow else w["id"] for w in due}
            jobs = [
                ReplyJob(
                    job_id=job_id_for(parts[w["id"]]),
                    window_id=parts[w["id"]],
                    platform=w["platform"],
                    account_id=w["account_id"],
                    chat_id=w["chat_id"],
                    messages=tuple(messages[w["id"]]),
                    created_at=now,
                )
                for w in due
                if messages[w["id"]]
            ]
            split = {part: window for window, part in parts.items() if part != window}
            try:
                async with conn.transaction():
                    await self._write_jobs(conn, jobs, split, now)
            except asyncpg.PostgresError as exc:
                if (getattr(exc, "sqlstate", None) or "")[:2] not in _DATA_ERRORS:
                    raise
                # One window's rows are refused: write them one by one, so that window
                # alone is set aside and every other chat gets its reply.
                written = []
                for job in jobs:
                    try:
                        async with conn.transaction():
                            await self._write_jobs(conn, [job], split, now)
                        written.append(job)
                    except asyncpg.PostgresError as one:
                        if (getattr(one, "sqlstate", None) or "")[:2] not in _DATA_ERRORS:
                            raise
                        await self._set_aside(conn, job, one)
                jobs = written
        fault_point("coalescer.after_emit")
        for w in due:
            EMISSION_LAG.observe(max((now - w["due_at"]).total_seconds(), 0.0))
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

    async def _write_jobs(
        self, conn: Conn, jobs: list[ReplyJob], split: dict[uuid.UUID, uuid.UUID], now: datetime
    ) -> None:
        """The jobs, their windows closed, their operations pointed at them, their outbox
        rows. A job in ``split`` (its window id -> the window it came from) answers part of
        a window past the cap: its part gets a closed window of its own, and the window it
        came from stays open with the rest, due now and blocked by this job (never a new
        open window: filing, under the chat's lock, may be waiting for this one)."""
        if not jobs:
            return
        parts = [j for j in jobs if j.window_id in split]
        if parts:
            await conn.execute(
                """
                INSERT INTO chat_windows (id, chat_key, platform, account_id, chat_id, status, first_at, last_at,
                                          deadline_at, due_at, delay_seconds, message_count, closed_at, job_id)
                SELECT v.part, w.chat_key, w.platform, w.account_id, w.chat_id, 'closed', w.first_at, w.last_at,
                       w.deadline_at, w.due_at, w.delay_seconds, v.kept, $4, v.job_id
                FROM unnest($1::uuid[], $2::uuid[], $3::uuid[], $5::int[]) AS v(part, window_id, job_id, kept)
                JOIN chat_windows w ON w.id = v.window_id
                """,
                [j.window_id for j in parts],
                [split[j.window_id] for j in parts],
                [j.job_id for j in parts],
                now,
                [len(j.messages) for j in parts],
            )
            await conn.execute(
                """
                UPDATE window_messages wm SET window_id = v.part
                FROM unnest($1::uuid[], $2::uuid[]) AS v(operation_id, part)
                WHERE wm.operation_id = v.operation_id
                """,
                [m.operation_id for j in parts for m in j.messages],
                [j.window_id for j in parts for _ in j.messages],
            )
            await conn.execute(
                """
                UPDATE chat_windows w SET message_count = w.message_count - v.kept, due_at = $2,
                       deadline_at = greatest(w.deadline_at, $2), blocked = true
                FROM unnest($1::uuid[], $3::int[]) AS v(window_id, kept)
                WHERE w.id = v.window_id
                """,
                [split[j.window_id] for j in parts],
                now,
                [len(j.messages) for j in parts],
            )
        await conn.executemany(
            """
            INSERT INTO reply_jobs (id, window_id, chat_key, platform, account_id, chat_id, status,
                                    operation_ids, created_at, updated_at)
            VALUES ($1, $2, $3, $4, $5, $6, 'pending', $7, $8, $8)
            """,
            [
                (j.job_id, j.window_id, j.chat_key, j.platform, j.account_id, j.chat_id,
                 [m.operation_id for m in j.messages], now)
                for j in jobs
            ],
        )  # fmt: skip
        whole = [j for j in jobs if j.window_id not in split]
        await conn.execute(
            """
            UPDATE chat_windows w SET status = 'closed', closed_at = $3, job_id = v.job_id
            FROM unnest($1::uuid[], $2::uuid[]) AS v(window_id, job_id)
            WHERE w.id = v.window_id
            """,
            [j.window_id for j in whole],
            [j.job_id for j in whole],
            now,
        )
        await conn.execute(
            """
            WITH ev AS (
                INSERT INTO operation_events (operation_id, kind, detail, job_id)
                SELECT v.operation_id, 'emitted', 'in a reply job: the buyer paused, one reply answers the burst', v.job_id
                FROM unnest($1::uuid[], $2::uuid[]) AS v(operation_id, job_id)
            )
            UPDATE operations o SET job_id = v.job_id, updated_at = $3
            FROM unnest($1::uuid[], $2::uuid[]) AS v(operation_id, job_id)
            WHERE o.id = v.operation_id
            """,
            [m.operation_id for j in jobs for m in j.messages],
            [j.job_id for j in jobs for _ in j.messages],
            now,
        )
        await enqueue_many(
            conn,
            [
                OutboxMessage(
                    exchange=JOBS_EXCHANGE,
                    routing_key=JOB_ROUTING_KEY,
                    message_id=str(j.job_id),
                    ordering_key=j.chat_key,
                    body=j.to_bytes(),
                )
                for j in jobs
            ],
        )

    async def _set_aside(self, conn: Conn, job: ReplyJob, error: asyncpg.PostgresError) -> None:
        """A window Postgres refuses to emit: its messages fail with the reason (a person
        may retry them) and the window goes, so the chat is not held by it."""
        reason = f"its window could not be emitted ({type(error).__name__}: {error})"[:500]
        ids = [m.operation_id for m in job.messages]
        await conn.execute("DELETE FROM window_messages WHERE operation_id = ANY($1::uuid[])", ids)
        await conn.execute(
            "DELETE FROM chat_windows w WHERE w.id = $1 AND NOT EXISTS "
            "(SELECT 1 FROM window_messages wm WHERE wm.window_id = w.id)",
            job.window_id,
        )
        failed = await conn.fetch(
            """
            WITH up AS (
                UPDATE operations SET status = 'failed', status_reason = $2, owner = $3, updated_at = now()
                WHERE id = ANY($1::uuid[]) AND status = ANY(chatq_operation_sources('failed'))
                RETURNING id
            ), ev AS (
                INSERT INTO operation_events (operation_id, kind, detail, actor) SELECT id, 'failed', 'failed: ' || $2, $3 FROM up
            )
            SELECT id FROM up
            """,
            ids,
            reason,
            self._owner,
        )
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
                {"operations": [str(r["id"]) for r in failed], "reason": reason, "owner": self._owner},
            )

    def wake(self) -> None:
        self._wake.set()

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()

    async def run_scheduler(self, *, poll_seconds: float = 0.5, batch: int = 200) -> None:
        """Emit windows as they fall due. Sleeps until the next due window, at most
        ``poll_seconds`` (windows a job's end unblocked elsewhere are seen by then). A
        newly filed message wakes it only when its window falls due before that (see
        ``handle``). After a failure it backs off, and no filed message cuts that short."""
        backoff = 0.1
        while not self._stopping:
            self._wake.clear()
            try:
                # Chats whose seller hold ran out go on (an index of the chats held now).
                await self._pool.fetchval("SELECT chatq_unblock_expired_holds()")
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
                await asyncio.wait_for(self._wake.wait(), timeout=timeout)

    async def seconds_to_next_due(self) -> float | None:
        seconds: float | None = await self._pool.fetchval(_NEXT_DUE)
        return seconds

    async def refresh_stats(self) -> int:
        n = await self._pool.fetchval("SELECT count(*) FROM chat_windows WHERE status = 'open'")
        OPEN_WINDOWS.set(n)
        return int(n)


def _window(row: asyncpg.Record) -> Window:
    return Window(
        first_at=row["first_at"],
        last_at=row["last_at"],
        deadline_at=row["deadline_at"],
        due_at=row["due_at"],
        delay_seconds=row["delay_seconds"],
        message_count=row["message_count"],
    )
