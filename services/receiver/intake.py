"""Durable intake: one statement writes the inbox row and, for a message the bot will
answer, its outbox row. One statement is one transaction, and one round trip.

Time is Postgres' clock, the one every other step uses: ``received_at`` is the database's
time of the insert, and the inbound message's body is built in the same statement from
the row as stored. A platform's ``sent_at`` is the buyer's claim: one more than
``FUTURE_TOLERANCE_SECONDS`` ahead of the database's clock is replaced by the receipt
time (the original stays in the payload), and a missing one is the receipt time.

A repeat of an event already stored (same platform event id, or same platform message)
writes nothing and returns the stored operation. An event id that names another message
is refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import asyncpg
from prometheus_client import Counter

from platforms.inbound import ApiError, BusinessConnectionState, Intake
from shared import metrics
from shared.alerts import Alerter
from shared.broker.consumer import Outcome, classify
from shared.broker.topology import INBOUND_EXCHANGE, inbound_routing_key
from shared.ids import new_id
from shared.messages import chat_key

logger = logging.getLogger(__name__)

TAKEOVERS = Counter(
    "chatq_seller_takeovers_total",
    "Messages the seller wrote in person, stepping the bot back, by platform.",
    ["platform"],
)

#: A platform timestamp further ahead of our clock than this is not believed.
FUTURE_TOLERANCE_SECONDS = 300
#: Why an edit is stored as ignored: no reply of its chat was pending when it arrived.
EDITED_AFTER_REPLY = "edited after the reply; not answered again"
#: Avito wants a webhook's answer within about 2 s: held no longer than this.
AVITO_HOLD_SECONDS = 1.5
#: What a 503 asks the sender to wait before sending again (Telegram keeps its own pace).
RETRY_AFTER_SECONDS = 10


async def held_while_postgres_is_away(
    store: Callable[[], Awaitable[Stored]],
    hold_seconds: float,
    reachable: Callable[[], Awaitable[bool]] | None = None,
) -> Stored:
    """``store()``; while Postgres is unreachable (the error the consumers retry in
    process: connection refused or lost, the server shutting down or out of connections),
    tried again with backoff for up to ``hold_seconds``, the delivery held meanwhile; then
    a 503 with Retry-After and nothing stored, which every platform sends again. An attempt
    that outlasts the hold may still commit: the platform's next delivery is then a
    duplicate, never a second message.

    An attempt still running at the end of the hold is cut only when Postgres does not
    answer (``reachable``, asked on a connection of its own): a statement that waits for a
    lock (a seller's message behind its chat's) or a slow one is waited for, not answered
    503 after having done nothing (a review found a seller's message lost that way)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + hold_seconds
    backoff = 0.1
    while True:
        left = deadline - loop.time()
        attempt = asyncio.ensure_future(store())
        try:
            async with asyncio.timeout(max(left, 0.5)):
                return await asyncio.shield(attempt)
        except TimeoutError as exc:
            if reachable is not None and await reachable():
                return await attempt  # Postgres answers: slow, not away
            attempt.cancel()
            with contextlib.suppress(BaseException):
                await attempt
            error: BaseException = exc
        except Exception as exc:
            if classify(exc) is not Outcome.RETRY_IN_PROCESS:
                raise
            error = exc
        left = deadline - loop.time()
        if left <= 0:
            logger.warning(
                "webhook not stored: Postgres is unreachable (%s: %s)", type(error).__name__, error
            )
            raise ApiError(
                503,
                "database_unavailable",
                "the message could not be stored (the database is unreachable) and nothing was kept: send it again",
                headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
            )
        metrics.IN_PROCESS_RETRIES.labels(where="intake", error=type(error).__name__).inc()
        await asyncio.sleep(min(backoff, left))
        backoff = min(backoff * 2, 2.0)


@dataclass(frozen=True)
class Stored:
    operation_id: uuid.UUID
    status: str
    duplicate: bool


# What the record says of a message as it is stored: 'received' (with the defaults taken
# for fields the platform left out, $notes), and for one handed to a person at once its
# 'needs_review' with the reason; 'ignored' with its reason for one not for the bot.
def _events(notes: str) -> str:
    return f"""
    SELECT op.id, e.kind, e.detail
    FROM op CROSS JOIN LATERAL (VALUES
        (2, CASE WHEN op.status = 'ignored' THEN 'ignored' ELSE 'received' END,
            CASE WHEN op.status = 'ignored' THEN 'stored; not for the bot: ' || op.status_reason
                 ELSE 'received and stored' || coalesce('; ' || {notes}, '') END),
        (3, 'needs_review', op.status_reason)
    ) AS e(n, kind, detail)
    WHERE e.n <> 3 OR op.status = 'needs_review'
"""


# What the group commit writes after the operations: each one's event, and (in ``ob``)
# for an accepted message its outbox row, whose body is the inbound message built from
# the row as stored. (A message with defaults noted or for a person goes alone, through
# _STORE_SQL.)
_EVENT_AND_OUTBOX = """), ev AS (
    INSERT INTO operation_events (operation_id, kind, detail)
    SELECT op.id, CASE WHEN op.status = 'ignored' THEN 'ignored' ELSE 'received' END,
           CASE WHEN op.status = 'ignored' THEN 'stored; not for the bot: ' || op.status_reason
                ELSE 'received and stored' END
    FROM op
), ob AS ("""
_INBOUND_BODY = """           convert_to(json_build_object(
               'schema', 'chatq.inbound.v1', 'operation_id', op.id, 'platform', op.platform,
               'account_id', op.account_id, 'chat_id', op.chat_id, 'message_id', op.message_id,
               'author_id', op.author_id, 'text', op.text, 'sent_at', op.sent_at,
               'received_at', op.received_at)::text, 'UTF8')
"""

# The inbound message's body is the row as stored, as chatq.inbound.v1 (shared.messages:
# a test checks that it parses as InboundMessage).
#
# An edit ($15) to answer is answered only while a reply to its chat is pending, read in
# this statement's one snapshot: an open window, a reply job in flight that has not
# recorded its delivery intent (or whose only attempt surely did not send), or a message
# of the chat still on its way to a window. Otherwise it is stored as ignored ($16): the
# reply went out, or may have. Two racing edits each see a committed state; neither can
# see half of one (a window closes into its job in one transaction, a reply is recorded
# in one).
_STORE_SQL = f"""
WITH clock AS (SELECT clock_timestamp() AS now), late AS (
    SELECT CASE WHEN $15::boolean AND $10::text = 'accepted' THEN NOT (
        EXISTS (SELECT 1 FROM chat_windows w
                WHERE w.chat_key = chatq_chat_key($2, $3, $5) AND w.status = 'open')
        OR EXISTS (SELECT 1 FROM reply_jobs r LEFT JOIN deliveries d ON d.job_id = r.id
                   WHERE r.chat_key = chatq_chat_key($2, $3, $5) AND r.status IN ('pending', 'processing')
                     AND NOT chatq_delivery_may_have_sent(d.status, d.maybe_sent))
        OR EXISTS (SELECT 1 FROM operations t
                   WHERE t.platform = $2 AND t.account_id = $3 AND t.chat_id = $5
                     AND t.status IN ('accepted', 'queued')
                     AND t.received_at IS NOT NULL)  -- the in-transit index's predicate (0029)
    ) ELSE false END AS edited_after_reply
), op AS (
    INSERT INTO operations (id, platform, account_id, event_id, chat_id, message_id,
                            author_id, text, sent_at, status, status_reason, received_at, payload,
                            business_connection_id, owner)
    SELECT $1, $2, $3, $4, $5, $6, $7, $8,
           CASE WHEN $9::timestamptz IS NULL
                  OR $9::timestamptz > clock.now + interval '{FUTURE_TOLERANCE_SECONDS} seconds'
                THEN clock.now ELSE $9::timestamptz END,
           CASE WHEN late.edited_after_reply THEN 'ignored' ELSE $10 END,
           CASE WHEN late.edited_after_reply THEN $16 ELSE $11 END,
           clock.now, $12::text::json, $17,
           CASE WHEN $10 = 'needs_review' AND NOT late.edited_after_reply THEN $19 END
    FROM clock, late
    ON CONFLICT DO NOTHING
    RETURNING id, platform, account_id, chat_id, message_id, author_id, text, sent_at, received_at, status,
              status_reason
), ev AS (
    -- A message the poller found ($18: how) is recorded as recovered, then as received.
    INSERT INTO operation_events (operation_id, kind, detail)
    SELECT op.id, 'recovered', $18::text FROM op WHERE $18::text IS NOT NULL
    UNION ALL
    {_events("$20::text")}
), ob AS (
    INSERT INTO outbox (exchange, routing_key, message_id, ordering_key, operation_id, body)
    SELECT $13, $14, op.id::text, chatq_chat_key(op.platform, op.account_id, op.chat_id), op.id,
{_INBOUND_BODY}    FROM op WHERE op.status = 'accepted'
)
SELECT id, status FROM op
"""

# A message the account itself wrote: our own reply coming back (an echo), or the seller
# answering in person, which withdraws the replies not yet sent and holds the chat
# (chatq_seller_wrote), in the statement that stores it.
_STORE_SELLER_SQL = """
WITH clock AS (SELECT clock_timestamp() AS now),
echo AS (SELECT $14::boolean OR chatq_is_echo(chatq_chat_key($2, $3, $5), $6, $8) AS yes),
op AS (
    INSERT INTO operations (id, platform, account_id, event_id, chat_id, message_id,
                            author_id, text, sent_at, status, status_reason, received_at, payload,
                            business_connection_id)
    SELECT $1, $2, $3, $4, $5, $6, $7, $8, least(coalesce($9::timestamptz, clock.now), clock.now), 'ignored',
           CASE WHEN echo.yes THEN 'our own message (echo)' ELSE $10 END, clock.now, $11::text::json, $13
    FROM clock, echo
    ON CONFLICT DO NOTHING
    RETURNING id, status, sent_at, status_reason
), ev AS (
    INSERT INTO operation_events (operation_id, kind, detail) SELECT op.id, 'ignored', op.status_reason FROM op
), seller AS (
    SELECT chatq_seller_wrote($2, $3, $5, $6, op.sent_at, $12) AS answered FROM op, echo WHERE NOT echo.yes
), echoed AS (
    -- Our reply, in the chat: proof for a send whose answer was lost (chatq_record_echo).
    SELECT chatq_record_echo(chatq_chat_key($2, $3, $5), $6, $8) AS settled
    FROM op, echo WHERE echo.yes AND $8::text IS NOT NULL
)
SELECT op.id, op.status, (SELECT answered FROM seller) AS answered, (SELECT settled FROM echoed) AS settled
FROM op
"""

# Group commit: the rows of concurrent webhooks in one statement and one transaction, the
# same writes as _STORE_SQL for each (edits and the seller's messages, which read state
# as they store, keep the one-row statements). Each row's receipt time is its own
# clock_timestamp(), taken in arrival order; the outbox rows follow that order.
_STORE_BATCH_SQL = f"""
WITH rows AS (
    SELECT r.*, clock_timestamp() AS now
    FROM unnest($1::uuid[], $2::text[], $3::text[], $4::text[], $5::text[], $6::text[], $7::text[],
                $8::text[], $9::timestamptz[], $10::text[], $11::text[], $12::text[], $13::text[],
                $14::text[])
         WITH ORDINALITY AS r(id, platform, account_id, event_id, chat_id, message_id, author_id, text,
                              sent_at, status, status_reason, payload, business_connection_id,
                              routing_key, ord)
    ORDER BY r.ord
), op AS (
    INSERT INTO operations (id, platform, account_id, event_id, chat_id, message_id,
                            author_id, text, sent_at, status, status_reason, received_at, payload,
                            business_connection_id)
    SELECT id, platform, account_id, event_id, chat_id, message_id, author_id, text,
           CASE WHEN sent_at IS NULL OR sent_at > now + interval '{FUTURE_TOLERANCE_SECONDS} seconds'
                THEN now ELSE sent_at END,
           status, status_reason, now, payload::json, business_connection_id
    FROM rows ORDER BY ord
    ON CONFLICT DO NOTHING
    RETURNING id, platform, account_id, chat_id, message_id, author_id, text, sent_at, received_at, status,
              status_reason
{_EVENT_AND_OUTBOX}
    INSERT INTO outbox (exchange, routing_key, message_id, ordering_key, operation_id, body)
    SELECT $15, rows.routing_key, op.id::text, chatq_chat_key(op.platform, op.account_id, op.chat_id), op.id,
{_INBOUND_BODY}    FROM op JOIN rows USING (id) WHERE op.status = 'accepted'
    ORDER BY rows.ord
)
SELECT id, status FROM op
"""

# The status as a person reads it (chatq_shown_status): a repeat's answer says what the
# status API says, e.g. queued, not the stored accepted.
_EXISTING_SQL = """
SELECT id, chatq_shown_status(status, id, platform, account_id, chat_id) AS status, chat_id, message_id
FROM operations
WHERE platform = $1 AND account_id = $2
  AND (event_id = $3 OR (chat_id = $4 AND message_id = $5))
ORDER BY (chat_id = $4 AND message_id = $5) DESC NULLS LAST
LIMIT 1
"""


#: What the record says of a message the poller found (services/receiver/recovery.py).
RECOVERED = "recovered by poll: the platform's webhook never brought it"
#: What it says when a webhook and the poller stored the same message: once.
FOUND_AGAIN = {
    False: "delivered again by the platform; stored once",
    True: "found again by the poll; stored once",
}


async def store(
    pool: asyncpg.Pool,
    intake: Intake,
    *,
    hold_seconds: float = 0,
    recovered: bool = False,
    review_owner: str = "on-call",
) -> Stored:
    """Store the intake (once: a repeat is a duplicate). A message the seller wrote in
    person steps the bot back from its chat for ``hold_seconds``. ``recovered``: the poller
    found the message (its webhook never came); the record says so, and the dedupe key is
    the webhook's, so a late webhook of it is a duplicate. A message handed to a person as
    it is stored (``Intake.review``) is theirs: ``review_owner``."""
    if intake.written_by_seller or intake.ours:
        return await _store_seller(pool, intake, hold_seconds)
    try:
        row = await pool.fetchrow(
            _STORE_SQL,
            new_id(),
            intake.platform,
            intake.account_id,
            intake.event_id,
            intake.chat_id,
            intake.message_id,
            intake.author_id,
            intake.text,
            intake.sent_at,
            intake.status,
            intake.ignored_reason or intake.review,
            intake.payload,
            INBOUND_EXCHANGE,
            inbound_routing_key(intake.platform),
            intake.is_edit,
            EDITED_AFTER_REPLY,
            intake.business_connection_id,
            RECOVERED if recovered else None,
            review_owner,
            intake.received_detail,
        )
    except (asyncpg.DataError, asyncpg.InvalidTextRepresentationError) as exc:
        # E.g. a JSON escape Postgres cannot store (\u0000, a lone surrogate).
        raise ApiError(422, "invalid_payload", f"the body cannot be stored: {exc}") from None
    except asyncpg.ProgramLimitExceededError:
        raise ApiError(422, "invalid_payload", "a value in the body is too large to store") from None
    if row is not None:
        return Stored(row["id"], row["status"], duplicate=False)
    return await _existing(pool, intake, recovered=recovered)


class IntakeBatcher:
    """Group commit for the webhooks: what arrives within ``window_seconds`` of the first
    waiting row, or ``max_rows`` rows, is written in one statement and one transaction
    (``_STORE_BATCH_SQL``). Each caller gets its own answer only after the batch
    committed, with its own operation id and duplicate flag. If the batch statement fails
    (a row Postgres refuses, a deadlock between two batches, a lost connection), every row
    of it is stored again alone: a bad row fails only its own request.

    Edits and messages the seller wrote read the chat's state as they are stored; they
    keep the one-row statements. ``max_rows`` 1 turns batching off."""

    def __init__(self, pool: asyncpg.Pool, *, window_seconds: float, max_rows: int) -> None:
        self.pool = pool
        self.window_seconds = window_seconds
        self.max_rows = max_rows
        self._waiting: list[tuple[Intake, uuid.UUID, asyncio.Future[Stored | None]]] = []
        self._timer: asyncio.TimerHandle | None = None
        self._flushing: set[asyncio.Task[None]] = set()
        #: Batch statements committed and the rows they wrote (also in /metrics).
        self.batches = 0
        self.rows = 0

    async def store(
        self, intake: Intake, *, hold_seconds: float = 0, review_owner: str = "on-call"
    ) -> Stored:
        if (
            self.max_rows <= 1
            or intake.written_by_seller
            or intake.ours
            or intake.is_edit
            or intake.review
            or intake.notes
        ):
            return await store(self.pool, intake, hold_seconds=hold_seconds, review_owner=review_owner)
        future: asyncio.Future[Stored | None] = asyncio.get_running_loop().create_future()
        self._waiting.append((intake, new_id(), future))
        if len(self._waiting) >= self.max_rows:
            self._flush()
        elif self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.window_seconds, self._flush)
        # The batch runs in a task of its own: a caller that goes away does not cancel it.
        stored = await asyncio.shield(future)
        return stored if stored is not None else await _existing(self.pool, intake)

    def _flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        batch, self._waiting = self._waiting, []
        if batch:
            task = asyncio.create_task(self._write(batch), name="intake-batch")
            self._flushing.add(task)
            task.add_done_callback(self._flushing.discard)

    async def _write(self, batch: list[tuple[Intake, uuid.UUID, asyncio.Future[Stored | None]]]) -> None:
        try:
            rows = await self.pool.fetch(
                _STORE_BATCH_SQL,
                [op_id for _, op_id, _ in batch],
                *(
                    [getattr(i, field) for i, _, _ in batch]
                    for field in ("platform", "account_id", "event_id", "chat_id", "message_id", "author_id")
                ),
                [i.text for i, _, _ in batch],
                [i.sent_at for i, _, _ in batch],
                ["ignored" if i.ignored_reason else "accepted" for i, _, _ in batch],
                [i.ignored_reason for i, _, _ in batch],
                [i.payload for i, _, _ in batch],
                [i.business_connection_id for i, _, _ in batch],
                [inbound_routing_key(i.platform) for i, _, _ in batch],
                INBOUND_EXCHANGE,
            )
        except Exception as exc:  # each row again, alone, decides its own fate
            logger.info("a batch of %d webhooks failed (%s): storing each alone", len(batch), exc)
            await asyncio.gather(*(self._alone(intake, future) for intake, _, future in batch))
            return
        self.batches += 1
        self.rows += len(batch)
        metrics.INTAKE_BATCH_ROWS.observe(len(batch))
        stored = {row["id"]: row["status"] for row in rows}
        for _, op_id, future in batch:
            if future.done():
                continue
            status = stored.get(op_id)
            # None: a row of this key was already stored (or stored earlier in this batch).
            future.set_result(Stored(op_id, status, duplicate=False) if status is not None else None)

    async def _alone(self, intake: Intake, future: asyncio.Future[Stored | None]) -> None:
        try:
            result = await store(self.pool, intake)
        except BaseException as exc:  # handed to the caller waiting for it
            if not future.done():
                future.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
            return
        if not future.done():
            future.set_result(result)

    async def aclose(self) -> None:
        """Write what is waiting and wait for every batch in flight."""
        self._flush()
        while self._flushing:
            await asyncio.gather(*self._flushing, return_exceptions=True)


async def _store_seller(pool: asyncpg.Pool, intake: Intake, hold_seconds: float) -> Stored:
    minutes = round(hold_seconds / 60)
    reason = (
        f"written by the seller: the replies not yet sent are withdrawn and the bot steps back "
        f"from this chat for {minutes} min"
        if hold_seconds > 0
        else "written by the seller: the replies not yet sent are withdrawn"
    )
    try:
        row = await pool.fetchrow(
            _STORE_SELLER_SQL,
            new_id(),
            intake.platform,
            intake.account_id,
            intake.event_id,
            intake.chat_id,
            intake.message_id,
            intake.author_id,
            intake.text,
            intake.sent_at,
            reason,
            intake.payload,
            hold_seconds,
            intake.business_connection_id,
            intake.ours,
        )
    except asyncpg.ProgramLimitExceededError:
        raise ApiError(422, "invalid_payload", "a value in the body is too large to store") from None
    if row is not None:
        if row["answered"] is not None:
            TAKEOVERS.labels(platform=intake.platform).inc()
        if row["settled"] is not None:
            metrics.SETTLED_BY_ECHO.labels(platform=intake.platform).inc()
            logger.warning(
                "job %s: the platform echoed its reply back; settled as sent (it had gone to a person)",
                row["settled"],
                extra={"job_id": row["settled"]},
            )
        return Stored(row["id"], row["status"], duplicate=False)
    return await _existing(pool, intake)


async def _existing(pool: asyncpg.Pool, intake: Intake, *, recovered: bool = False) -> Stored:
    existing = await pool.fetchrow(
        _EXISTING_SQL,
        intake.platform,
        intake.account_id,
        intake.event_id,
        intake.chat_id,
        intake.message_id,
    )
    if existing is None:  # pragma: no cover - a conflict implies a committed row
        raise RuntimeError("insert conflicted but no stored operation was found")
    if (existing["chat_id"], existing["message_id"]) != (intake.chat_id, intake.message_id):
        # The event id is taken by another message: a sender reusing ids. Storing nothing
        # and answering 2xx would lose this message without a trace.
        raise ApiError(
            409,
            "event_id_reused",
            f"event id {intake.event_id!r} already names another message; send each message with its own id",
        )
    await pool.execute(
        "SELECT chatq_log(ARRAY[$1]::uuid[], 'duplicate', $2)", existing["id"], FOUND_AGAIN[recovered]
    )
    return Stored(existing["id"], existing["status"], duplicate=True)


async def record_business_connection(
    pool: asyncpg.Pool, account_id: str, state: BusinessConnectionState, probe_seconds: float
) -> None:
    """Keep what Telegram said of a business connection: turned off, or without the right to
    reply, its chats' replies wait (the responder reads this before sending); on again,
    they go."""
    await pool.execute(
        """
        INSERT INTO telegram_business_connections
            (account_id, connection_id, owner_id, is_enabled, can_reply, paused_reason, next_probe_at, updated_at)
        VALUES ($1, $2, $3, $4, $5, $6, CASE WHEN $6::text IS NOT NULL THEN now() + make_interval(secs => $7) END, now())
        ON CONFLICT (account_id, connection_id) DO UPDATE
        SET owner_id = EXCLUDED.owner_id, is_enabled = EXCLUDED.is_enabled, can_reply = EXCLUDED.can_reply,
            paused_reason = EXCLUDED.paused_reason, next_probe_at = EXCLUDED.next_probe_at, updated_at = now()
        """,
        account_id,
        state.connection_id,
        state.owner_id,
        state.is_enabled,
        state.can_reply,
        state.paused_reason,
        probe_seconds,
    )


async def announce_review(alerter: Alerter, intake: Intake, stored: Stored, owner: str) -> None:
    """Tell a person of a message handed to them as it was stored (one the bot cannot read
    alone), as the responder tells of a reply it hands over."""
    metrics.OPERATIONS.labels(outcome="needs_review").inc()
    chat = chat_key(intake.platform, intake.account_id, intake.chat_id) if intake.chat_id else None
    logger.warning(
        "operation %s needs review (owner %s): %s",
        stored.operation_id,
        owner,
        intake.review,
        extra={"operation_id": stored.operation_id, "chat": chat},
    )
    await alerter.announce(
        "operation.needs_review",
        {
            "operations": [str(stored.operation_id)],
            "chat": chat,
            "reason": intake.review,
            "kind": "unreadable",
            "owner": owner,
        },
    )
