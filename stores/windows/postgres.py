"""The windows aggregate in Postgres: ``PgWindowStore`` and its sessions, on the window
functions of stores/windows/functions/20_windows.sql (filing, the due claim with the accounts'
fair share, emission). Proven against ``fake.InMemoryWindows`` by tests/contract."""

from __future__ import annotations

import contextlib
import dataclasses
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from datetime import datetime

import asyncpg

from shared.broker.topology import JOB_ROUTING_KEY, JOBS_EXCHANGE
from shared.db import Conn
from shared.messages import JobMessage, ReplyJob
from shared.state import operation as operation_state
from stores.windows.protocol import ChatState, DueWindow, Filing, Listed, Refused, WindowSession
from stores.windows.window import Window

# Filing a batch is two round trips inside its transaction: the chats' locks and what is
# read under them, then every write (stores/windows/functions/20_windows.sql).
_LOCK_CHATS = "SELECT * FROM chatq_lock_chats($1::text[], $2::uuid[])"
_FILE_MESSAGES = """
SELECT chatq_file_messages($1::uuid[], $2::boolean[], $3::text[], $4::text[], $5::text[], $6::text[],
                           $7::timestamptz[], $8::timestamptz[], $9::timestamptz[], $10::timestamptz[],
                           $11::float8[], $12::int[], $13::uuid[], $14::uuid[], $15::timestamptz[])
"""

# A window may close when it is due, not blocked (no job of its chat in flight: the
# ready-windows index holds only these), and no message of its chat received before the
# window falls due is still in transit (the SQL function says why; a message received
# before due_at joins this window when filed, or an earlier one). The responder's fold-in
# waits for those received before the open window's last message. Blocked windows are never scanned.
#
# Fair share ($2 > 0, ACCOUNT_JOBS_IN_FLIGHT): an account with $2 reply jobs emitted and
# unfinished gets no more until some finish; its other due windows wait here, in order,
# instead of queueing ahead of every other account's jobs. Each account's earliest due
# windows fill its free places.
#
# Two ways, chosen each round by how many windows are due (a count that stops at 200).
# Fewer: they are read from chat_windows_ready_due and numbered by account, as before
# today; a round reads at most 200 rows, however many accounts have windows open (walking
# the accounts read one probe per account with an open window: 27 ms a round with 3,000
# accounts and one window due). More: a round costs what it emits, not what waits
# (migration 0025): the accounts with a ready
# window are found by a skip scan of chat_windows_ready_account (one probe each), and each
# account's earliest due windows are read only up to its free places (its share less its
# jobs in flight, one probe of reply_jobs_account_in_flight). It used to number every due
# window by account in a window function: with 5,000 due windows waiting behind one
# account's share, 4-8 ms of Postgres a round to emit 16. Every step is an index probe per
# row, so no plan, generic or made on stale statistics, can turn it into a scan of the due
# set (once a join of the due set with a count derived from it took 4-5 s a round). The
# due time is read once ((SELECT clock_timestamp()), an init plan) so that it bounds the
# index scans instead of filtering them. An account's due windows are asked for as its
# platform and a range of (account, due time), from its earliest ready window (the skip
# scan found it) to now, in the order of chat_windows_ready_account, which only that index
# gives: asked for as an account and a due time, the planner read them from
# chat_windows_ready_due and stepped over every other account's due windows (2,000 rows
# for one, in tests/integration/test_scheduler_cost.py). The platform is asked for as
# equal, not in the row: Postgres (before 18) ends a scan on a row comparison only where
# the row's first column decides, and a range of (platform, account, due time) stepped
# over every later account's ready windows, for every account (0.5 s a round with 3,000
# accounts); as it is, a probe steps at most over its own account's windows not yet due.
# An account whose earliest ready window is not due yet is not probed at all. The rows are
# locked one by one, by key, in the order they go, and no more than go (LIMIT over a nested
# loop stops pulling): a window another replica holds is skipped and the next placed one
# takes its place. The lock takes the key alone (OFFSET 0 keeps the state checks out of
# it), so no partial index of open windows can be scanned for it, and the checks read the
# row as locked, its latest version.
_CLAIM_DUE = """
WITH RECURSIVE few AS MATERIALIZED (
    -- Whether fewer than 200 windows are due: then they are read from the due index and
    -- numbered by account (at most 200 rows); else the accounts are walked (a probe each).
    SELECT count(*) < 200 AS yes FROM (
        SELECT 1 FROM chat_windows w
        WHERE w.status = 'open' AND NOT w.blocked AND w.due_at <= (SELECT clock_timestamp())
        LIMIT 200
    ) x
), ranked AS MATERIALIZED (
    -- Each account's jobs in flight are counted once, on its first window, and the count
    -- is shared with its others (a count made for each window read the share's 64 windows
    -- times its 60 jobs, 3,840 rows a round, for an account alone and unpaced).
    SELECT y.id, y.platform, y.account_id, y.due_at, y.place,
           max(y.counted) OVER (PARTITION BY y.platform, y.account_id) AS in_flight
    FROM (
        SELECT x.id, x.platform, x.account_id, x.due_at, x.place,
               CASE WHEN x.place = 1 AND $2 <> 0 THEN (
                   SELECT count(*) FROM reply_jobs r
                   WHERE r.platform = x.platform AND r.account_id = x.account_id
                     AND r.status IN ('pending', 'processing')) END AS counted
        FROM (
            SELECT w.id, w.platform, w.account_id, w.due_at,
                   row_number() OVER (PARTITION BY w.platform, w.account_id ORDER BY w.due_at) AS place
            FROM chat_windows w
            WHERE (SELECT yes FROM few)
              AND w.status = 'open' AND NOT w.blocked AND w.due_at <= (SELECT clock_timestamp())
        ) x
        WHERE $2 = 0 OR x.place <= greatest($2, $3)
    ) y
), accounts AS (
    (SELECT w.platform, w.account_id, w.due_at FROM chat_windows w
     WHERE w.status = 'open' AND NOT w.blocked
     ORDER BY w.platform, w.account_id, w.due_at LIMIT 1)
    UNION ALL
    SELECT n.platform, n.account_id, n.due_at FROM accounts a CROSS JOIN LATERAL (
        SELECT w.platform, w.account_id, w.due_at FROM chat_windows w
        WHERE w.status = 'open' AND NOT w.blocked AND (w.platform, w.account_id) > (a.platform, a.account_id)
        ORDER BY w.platform, w.account_id, w.due_at LIMIT 1
    ) n
), ready_accounts AS MATERIALIZED (
    SELECT DISTINCT d.platform, d.account_id FROM ranked d
    UNION
    SELECT a.platform, a.account_id FROM accounts a
    WHERE NOT (SELECT yes FROM few) AND a.due_at <= (SELECT clock_timestamp())
), share AS MATERIALIZED (
    -- The share: $2, or $3 for an account alone (no other account with a window due or a
    -- job unfinished). Another account's first window then waits behind at most $3 jobs.
    -- Another account has a job unfinished when the first or the last account in the
    -- in-flight index is not this one: two probes at the index's ends (a scan for any
    -- other account's job read every job row, 2 ms a claim at 6,000 jobs kept).
    SELECT CASE WHEN $3 > $2 AND (SELECT count(*) FROM ready_accounts) = 1
                 AND NOT EXISTS (
                     SELECT 1 FROM ready_accounts a CROSS JOIN LATERAL (
                         (SELECT r.platform, r.account_id FROM reply_jobs r
                          WHERE r.status IN ('pending', 'processing')
                          ORDER BY r.platform, r.account_id LIMIT 1)
                         UNION ALL
                         (SELECT r.platform, r.account_id FROM reply_jobs r
                          WHERE r.status IN ('pending', 'processing')
                          ORDER BY r.platform DESC, r.account_id DESC LIMIT 1)
                     ) e
                     WHERE (e.platform, e.account_id) <> (a.platform, a.account_id))
                THEN $3 ELSE $2 END AS jobs
), placed AS MATERIALIZED (
    (SELECT d.id, d.due_at FROM ranked d
     WHERE $2 = 0 OR d.place + d.in_flight <= (SELECT jobs FROM share))
    UNION ALL
    (SELECT d.id, d.due_at FROM accounts a CROSS JOIN LATERAL (
        SELECT w.id, w.due_at FROM chat_windows w
        WHERE w.status = 'open' AND NOT w.blocked
          AND w.platform = a.platform
          AND (w.account_id, w.due_at) >= (a.account_id, a.due_at)
          AND (w.account_id, w.due_at) <= (a.account_id, (SELECT clock_timestamp()))
        ORDER BY w.platform, w.account_id, w.due_at
        LIMIT CASE WHEN $2 = 0 THEN $1 * 2
                   ELSE greatest((SELECT jobs FROM share) - (SELECT count(*) FROM reply_jobs r
                                       WHERE r.platform = a.platform AND r.account_id = a.account_id
                                         AND r.status IN ('pending', 'processing')), 0)
              END
    ) d
    WHERE NOT (SELECT yes FROM few) AND a.due_at <= (SELECT clock_timestamp()))
    ORDER BY due_at
    LIMIT $1 * 2
), ready AS MATERIALIZED (
    -- The in-transit check (a query each) only for the few placed windows.
    SELECT w.id, p.due_at FROM placed p JOIN chat_windows w ON w.id = p.id
    WHERE NOT chatq_earlier_in_transit(w.platform, w.account_id, w.chat_id, w.due_at)
    ORDER BY p.due_at
), claimed AS MATERIALIZED (
    SELECT w.id, w.chat_key, w.platform, w.account_id, w.chat_id, w.due_at
    FROM ready r CROSS JOIN LATERAL (
        SELECT w.id, w.chat_key, w.platform, w.account_id, w.chat_id, w.due_at, w.status, w.blocked
        FROM chat_windows w WHERE w.id = r.id
        OFFSET 0 FOR UPDATE SKIP LOCKED
    ) w
    WHERE w.status = 'open' AND NOT w.blocked AND w.due_at <= clock_timestamp()
    LIMIT $1
)
SELECT c.id, c.chat_key, c.platform, c.account_id, c.chat_id, c.due_at FROM claimed c ORDER BY c.due_at, c.id
"""

# The next window to fall due. Windows already due but not emitted (their account at its
# fair share, a message of their chat in transit, another replica holding them) are
# looked at again at the next poll: counting them here would spin the scheduler. The time
# is read once ((SELECT clock_timestamp()), an init plan) so that it starts the scan of
# chat_windows_ready_due past the windows already due (clock_timestamp() itself, volatile,
# only filters: 1-1.6 ms a poll stepping over 4,800 due windows waiting for their share).
_NEXT_DUE = """
SELECT extract(epoch FROM w.due_at - clock_timestamp())::float8
FROM chat_windows w
WHERE w.status = 'open' AND NOT w.blocked AND w.due_at > (SELECT clock_timestamp())
  AND NOT chatq_earlier_in_transit(w.platform, w.account_id, w.chat_id, w.due_at)
ORDER BY w.due_at
LIMIT 1
"""

# The windows' messages in platform order (chatq_order), with each one's running count
# and text length, for the cap on what one job carries. Each message is read by its key:
# OFFSET 0 keeps the planner from joining operations by a scan, as a generic plan made
# while the table was small did (3 ms a round with 7,000 operations, in bench.pipeline).
_WINDOW_MESSAGES = """
SELECT wm.window_id, o.id, o.message_id, o.author_id, o.text, o.sent_at, o.received_at,
       row_number() OVER w AS n, sum(length(o.text)) OVER w AS chars, clock_timestamp() AS now
FROM window_messages wm
CROSS JOIN LATERAL (SELECT o.* FROM operations o WHERE o.id = wm.operation_id OFFSET 0) o
WHERE wm.window_id = ANY($1::uuid[])
WINDOW w AS (PARTITION BY wm.window_id ORDER BY chatq_order(o.platform, o.sent_at, o.message_id, o.received_at))
ORDER BY wm.window_id, n
"""

_EMIT_JOBS = """
SELECT chatq_emit_jobs($1::uuid[], $2::uuid[], $3::text[], $4::text[], $5::text[], $6::text[], $7::boolean[],
                       $8::bytea[], $9::uuid[], $10::uuid[], $11::timestamptz, $12::text, $13::text)
"""

#: SQLSTATE classes of errors that belong to one window's data (a constraint it breaks, a
#: value it holds), not to the database or the connection.
_DATA_ERRORS = ("22", "23")

_WINDOW_FIELDS = dataclasses.fields(Window)


class PgWindowStore:
    def __init__(self, pool: asyncpg.Pool) -> None:
        self._pool = pool

    @contextlib.asynccontextmanager
    async def transaction(self) -> AsyncIterator[WindowSession]:
        async with self._pool.acquire() as conn, conn.transaction():
            yield PgWindowSession(conn)

    async def fail_unfiled(self, operation_id: uuid.UUID, reason: str, owner: str) -> bool:
        async with self._pool.acquire() as conn:
            return await operation_state.fail_unfiled(conn, operation_id, reason, owner)

    async def unblock_expired_holds(self) -> None:
        # Chats whose seller hold ran out go on (an index of the chats held now).
        await self._pool.fetchval("SELECT chatq_unblock_expired_holds()")

    async def seconds_to_next_due(self) -> float | None:
        seconds: float | None = await self._pool.fetchval(_NEXT_DUE)
        return seconds

    async def open_windows(self) -> int:
        return int(await self._pool.fetchval("SELECT count(*) FROM chat_windows WHERE status = 'open'"))


class PgWindowSession:
    def __init__(self, conn: Conn) -> None:
        self._conn = conn
        # The database clock as the round's messages() read it.
        self._now: datetime | None = None

    async def lock_chats(self, messages: Sequence[tuple[str, uuid.UUID]]) -> list[ChatState]:
        rows = await self._conn.fetch(_LOCK_CHATS, [k for k, _ in messages], [o for _, o in messages])
        return [
            ChatState(
                row["duplicate"],
                row["known"],
                row["now"],
                row["id"],
                None if row["id"] is None else Window(**{f.name: row[f.name] for f in _WINDOW_FIELDS}),
            )
            for row in rows
        ]

    async def file(self, filings: Sequence[Filing]) -> None:
        if not filings:
            return
        # Each window once, as its last filing leaves it; inserted when the batch opened it.
        last = {f.window_id: f for f in filings}
        opened = {f.window_id for f in filings if f.opened}
        windows = list(last.values())
        await self._conn.execute(
            _FILE_MESSAGES,
            [f.window_id for f in windows],
            [f.window_id in opened for f in windows],
            [f.inbound.chat_key for f in windows],
            [f.inbound.platform for f in windows],
            [f.inbound.account_id for f in windows],
            [f.inbound.chat_id for f in windows],
            [f.window.first_at for f in windows],
            [f.window.last_at for f in windows],
            [f.window.deadline_at for f in windows],
            [f.window.due_at for f in windows],
            [f.window.delay_seconds for f in windows],
            [f.window.message_count for f in windows],
            [f.inbound.operation_id for f in filings],
            [f.window_id for f in filings],
            [f.window.due_at for f in filings],
        )

    async def claim_due(self, limit: int, account_jobs: int, alone_jobs: int = 0) -> list[DueWindow]:
        self._now = None
        return [
            DueWindow(w["id"], w["chat_key"], w["platform"], w["account_id"], w["chat_id"], w["due_at"])
            for w in await self._conn.fetch(_CLAIM_DUE, limit, account_jobs, alone_jobs)
        ]

    async def messages(self, window_ids: Sequence[uuid.UUID]) -> list[Listed]:
        # Its own statement, after the claim's: in READ COMMITTED a statement sees what was
        # committed when it started, so a read inside the claim's statement would miss a
        # message whose filing committed after that start but before the claim locked its
        # window (SKIP LOCKED only skips a window locked at that moment): the message left
        # in a closed window, never answered (chaos, "RabbitMQ connections cut": 3 lost).
        # The clock comes with the messages: the round's time, one round trip fewer.
        rows = await self._conn.fetch(_WINDOW_MESSAGES, list(window_ids))
        if rows:
            self._now = rows[0]["now"]
        return [Listed(m["window_id"], JobMessage.from_row(m), m["n"], m["chars"]) for m in rows]

    async def now(self) -> datetime:
        if self._now is not None:
            return self._now
        now: datetime = await self._conn.fetchval("SELECT clock_timestamp()")
        return now

    async def drop(self, window_ids: Sequence[uuid.UUID]) -> None:
        await self._conn.execute("DELETE FROM chat_windows WHERE id = ANY($1::uuid[])", list(window_ids))

    async def write_jobs(
        self, jobs: Sequence[ReplyJob], split: Mapping[uuid.UUID, uuid.UUID], now: datetime
    ) -> None:
        try:
            async with self._conn.transaction():
                await self._write_jobs(jobs, split, now)
        except asyncpg.PostgresError as exc:
            if (getattr(exc, "sqlstate", None) or "")[:2] not in _DATA_ERRORS:
                raise
            raise Refused(exc) from exc

    async def _write_jobs(
        self, jobs: Sequence[ReplyJob], split: Mapping[uuid.UUID, uuid.UUID], now: datetime
    ) -> None:
        if not jobs:
            return
        parts = [j for j in jobs if j.window_id in split]
        if parts:
            await self._conn.execute(
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
            await self._conn.execute(
                """
                UPDATE window_messages wm SET window_id = v.part
                FROM unnest($1::uuid[], $2::uuid[]) AS v(operation_id, part)
                WHERE wm.operation_id = v.operation_id AND wm.operation_id = ANY($1::uuid[])
                """,
                [m.operation_id for j in parts for m in j.messages],
                [j.window_id for j in parts for _ in j.messages],
            )
            await self._conn.execute(
                """
                UPDATE chat_windows w SET message_count = w.message_count - v.kept, due_at = $2,
                       deadline_at = greatest(w.deadline_at, $2), blocked = true
                FROM unnest($1::uuid[], $3::int[]) AS v(window_id, kept)
                WHERE w.id = v.window_id AND w.id = ANY($1::uuid[])
                """,
                [split[j.window_id] for j in parts],
                now,
                [len(j.messages) for j in parts],
            )
        # The jobs, the whole windows closed, the operations pointed at their jobs (and
        # their records), the outbox rows: one round trip (stores/windows/functions/20_windows.sql).
        await self._conn.execute(
            _EMIT_JOBS,
            [j.job_id for j in jobs],
            [j.window_id for j in jobs],
            [j.chat_key for j in jobs],
            [j.platform for j in jobs],
            [j.account_id for j in jobs],
            [j.chat_id for j in jobs],
            [j.window_id not in split for j in jobs],
            [j.to_bytes() for j in jobs],
            [m.operation_id for j in jobs for m in j.messages],
            [j.job_id for j in jobs for _ in j.messages],
            now,
            JOBS_EXCHANGE,
            JOB_ROUTING_KEY,
        )

    async def set_aside(self, job: ReplyJob, reason: str, owner: str) -> list[uuid.UUID]:
        ids = [m.operation_id for m in job.messages]
        await self._conn.execute("DELETE FROM window_messages WHERE operation_id = ANY($1::uuid[])", ids)
        await self._conn.execute(
            "DELETE FROM chat_windows w WHERE w.id = $1 AND NOT EXISTS "
            "(SELECT 1 FROM window_messages wm WHERE wm.window_id = w.id)",
            job.window_id,
        )
        return await operation_state.fail(self._conn, ids, reason, owner)
