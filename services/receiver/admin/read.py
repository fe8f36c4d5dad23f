"""The admin API's read side: an operation's document and record, lists, the held chats
and the seller's numbers, each read with its own SQL (no store in between: these are
views, and the SQL is the clearest statement of what they show)."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any

import asyncpg

from shared.db import one
from shared.state import operation as operation_state
from shared.state.operation import OperationStatus
from stores.accounts import postgres as account_state

STATUSES = tuple(s.value for s in OperationStatus)
UNFINISHED = tuple(s.value for s in operation_state.UNFINISHED)
ACTIONABLE = tuple(s.value for s in operation_state.ACTIONABLE)
STATUS_TEXT = {s.value: text for s, text in operation_state.STATUS_TEXT.items()}


def status_text(status: str, reason: str | None, replied_at: datetime | None = None) -> str:
    if status == "replied" and replied_at is not None:
        return f"reply sent at {replied_at.astimezone(UTC):%H:%M} UTC"
    if status == "replied" and reason:
        # Answered, but not by the bot's reply: by the seller in person, or a person's resolve.
        return reason
    if status == "ignored" and reason and reason.startswith("dismissed by "):
        # A person's decision, not a message that was never for the bot.
        return reason
    if status == "needs_review" and reason and reason.startswith("held for a person"):
        # A written reply held back before any send (services/responder/reply_check.py):
        # nothing is unknown about it.
        return reason
    if status == "needs_review":
        return (
            f"{STATUS_TEXT[status]}: {reason}"
            if reason and "check the chat" not in reason
            else (reason or STATUS_TEXT[status])
        )
    text = STATUS_TEXT.get(status, status)
    return f"{text}: {reason}" if reason else text


_SELECT = """
SELECT o.id, o.platform, o.account_id, o.chat_id, o.message_id, o.author_id, o.text, o.sent_at,
       chatq_shown_status(o.status, o.id, o.platform, o.account_id, o.chat_id) AS status,
       o.status_reason, o.received_at, o.updated_at, o.resolution, o.resolved_by, o.resolved_at,
       o.note, o.retries, o.owner AS op_owner, c.held_until,
       j.id AS job_id, j.status AS job_status, j.attempts, j.reply_text, j.platform_message_id,
       j.sent_at AS reply_sent_at, j.error_kind, j.error_message, j.owner, j.created_at AS job_created_at
FROM operations o LEFT JOIN reply_jobs j ON j.id = o.job_id
LEFT JOIN chats c ON c.chat_key = chatq_chat_key(o.platform, o.account_id, o.chat_id) AND c.held_until > now()
"""


async def operation(pool: asyncpg.Pool, op_id: uuid.UUID) -> dict[str, Any] | None:
    """One operation's document with its record (None: there is none)."""
    row = await pool.fetchrow(_SELECT + " WHERE o.id = $1", op_id)
    if row is None:
        return None
    doc = operation_document(row)
    doc["timeline"] = await timeline(pool, op_id)
    return doc


async def operations(
    pool: asyncpg.Pool,
    statuses: list[str],
    age: float,
    limit: int,
    platform: str | None = None,
    account_id: str | None = None,
) -> dict[str, Any]:
    """The newest operations in ``statuses`` received at least ``age`` seconds ago: the
    whole deployment's, or one account's."""
    rows = await pool.fetch(
        _SELECT
        + """
        WHERE o.status = ANY($6::text[]) AND o.received_at <= now() - make_interval(secs => $2)
          AND ($4::text IS NULL OR (o.platform = $4 AND o.account_id = $5))
          AND chatq_shown_status(o.status, o.id, o.platform, o.account_id, o.chat_id) = ANY($1::text[])
        ORDER BY o.received_at DESC LIMIT $3
        """,
        statuses,
        age,
        limit,
        platform,
        account_id,
        stored_statuses(statuses),
    )
    return {"operations": [operation_document(r) for r in rows], "count": len(rows)}


def stored_statuses(statuses: list[str]) -> list[str]:
    """The statuses written in operations.status that may read as ``statuses``: 'queued'
    and 'replying' are shown, not written (``chatq_shown_status``), for an operation
    stored 'accepted' or 'waiting'."""
    stored = set(statuses)
    if "queued" in stored:
        stored.add("accepted")
    if "replying" in stored:
        stored.add("waiting")
    return sorted(stored)


async def held_chats(
    pool: asyncpg.Pool, platform: str | None = None, account_id: str | None = None
) -> dict[str, Any]:
    """The chats the seller holds (the bot stays out until ``held_until``), with the
    messages waiting in each: the whole deployment's, or one account's (a chat key begins
    with its account's, ``chatq_chat_key``)."""
    rows = await pool.fetch(
        """
        SELECT c.chat_key, c.seller_wrote_at, c.seller_message_id, c.held_until,
               (SELECT count(*) FROM chat_windows w JOIN window_messages wm ON wm.window_id = w.id
                WHERE w.chat_key = c.chat_key AND w.status = 'open') AS waiting
        FROM chats c WHERE c.held_until > now()
          AND ($1::text IS NULL OR starts_with(c.chat_key, chatq_chat_key($1, $2, '')))
        ORDER BY c.held_until
        """,
        platform,
        account_id,
    )
    return {
        "chats": [
            {
                "chat": r["chat_key"],
                "seller_wrote_at": _iso(r["seller_wrote_at"]),
                "seller_message_id": r["seller_message_id"],
                "held_until": _iso(r["held_until"]),
                "waiting_messages": r["waiting"],
            }
            for r in rows
        ],
        "count": len(rows),
    }


async def stats(
    pool: asyncpg.Pool, platform: str | None, account_id: str | None, accounts: int
) -> dict[str, Any]:
    """The seller's numbers: the whole deployment's, or one account's; with each account's
    four numbers and state (the ``accounts`` busiest by backlog)."""
    doc = await collect_stats(pool, platform, account_id)
    numbers = await account_numbers(pool, platform, account_id)
    ranked = sorted(numbers.values(), key=lambda n: (-n["backlog"], n["platform"], n["account_id"]))
    doc["accounts"] = ranked[:accounts]
    doc["accounts_total"] = len(numbers)
    if platform is not None:
        doc["account"] = f"{platform}:{account_id}"
    return doc


async def account_numbers(
    pool: asyncpg.Pool, platform: str | None = None, account_id: str | None = None
) -> dict[tuple[str, str], dict[str, Any]]:
    """Each account's four numbers (backlog, receipt-to-reply over 24 h, failed share,
    retries) and state: every account the table knows, and any with messages."""
    rows = await pool.fetch(
        """
        WITH f AS (SELECT $1::text AS platform, $2::text AS account_id),
        backlog AS (
            SELECT o.platform, o.account_id, count(*) AS n,
                   extract(epoch FROM now() - min(o.received_at))::float8 AS oldest
            FROM operations o, f
            WHERE o.status = ANY($3::text[]) AND (f.platform IS NULL OR o.platform = f.platform)
              AND (f.account_id IS NULL OR o.account_id = f.account_id)
            GROUP BY 1, 2
        ), day AS (
            SELECT o.platform, o.account_id,
                   count(*) FILTER (WHERE e.kind IN ('replied', 'answered_by_seller')) AS answered,
                   count(*) FILTER (WHERE e.kind IN ('failed', 'needs_review')) AS failed,
                   count(DISTINCT (e.job_id, e.detail)) FILTER (WHERE e.kind = 'retry_scheduled')
                     + count(*) FILTER (WHERE e.kind = 'retried') AS retries,
                   percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM e.at - o.received_at))
                     FILTER (WHERE e.kind = 'replied') AS p50,
                   percentile_cont(0.95) WITHIN GROUP (ORDER BY extract(epoch FROM e.at - o.received_at))
                     FILTER (WHERE e.kind = 'replied') AS p95
            FROM operation_events e JOIN operations o ON o.id = e.operation_id, f
            WHERE e.at > now() - interval '24 hours' AND (f.platform IS NULL OR o.platform = f.platform)
              AND (f.account_id IS NULL OR o.account_id = f.account_id)
            GROUP BY 1, 2
        ), known AS (
            SELECT a.platform, a.account_id, a.name, a.state, a.state_reason, a.removed_at FROM accounts a, f
            WHERE (f.platform IS NULL OR a.platform = f.platform) AND (f.account_id IS NULL OR a.account_id = f.account_id)
        ), ids AS (
            SELECT platform, account_id FROM known UNION SELECT platform, account_id FROM backlog
            UNION SELECT platform, account_id FROM day
        )
        SELECT ids.platform, ids.account_id, k.name, coalesce(k.state, 'active') AS state, k.state_reason,
               k.removed_at IS NOT NULL AS removed, coalesce(b.n, 0) AS backlog, coalesce(b.oldest, 0) AS oldest,
               coalesce(d.answered, 0) AS answered, coalesce(d.failed, 0) AS failed,
               coalesce(d.retries, 0) AS retries, d.p50, d.p95
        FROM ids LEFT JOIN known k USING (platform, account_id) LEFT JOIN backlog b USING (platform, account_id)
        LEFT JOIN day d USING (platform, account_id)
        """,
        platform,
        account_id,
        list(UNFINISHED),
    )
    numbers = {}
    for r in rows:
        finished = r["answered"] + r["failed"]
        numbers[(r["platform"], r["account_id"])] = {
            "platform": r["platform"],
            "account_id": r["account_id"],
            "name": r["name"],
            "state": "removed" if r["removed"] else r["state"],
            "reason": r["state_reason"],
            "backlog": r["backlog"],
            "oldest_unfinished_age_seconds": round(r["oldest"], 3),
            "receipt_to_reply_p50_seconds": round(r["p50"], 3) if r["p50"] is not None else None,
            "receipt_to_reply_p95_seconds": round(r["p95"], 3) if r["p95"] is not None else None,
            "failed_share": round(r["failed"] / finished, 4) if finished else 0.0,
            "retries": r["retries"],
        }
    return numbers


async def collect_stats(
    pool: asyncpg.Pool, platform: str | None = None, account_id: str | None = None
) -> dict[str, Any]:
    # Without an account: the whole deployment. With one: its operations only.
    scope = "($2::text IS NULL OR {o}.platform = $2) AND ($3::text IS NULL OR {o}.account_id = $3)"
    # A message waiting in a chat the seller holds is not late: the bot steps back on
    # purpose for up to TAKEOVER_SECONDS. It is counted apart ("held"), out of the Backlog
    # and its Oldest unfinished, so a long hold never pages anyone.
    backlog = {s: {"count": 0, "oldest_age_seconds": 0.0} for s in (*UNFINISHED, *ACTIONABLE, "held")}
    for r in await pool.fetch(
        f"""
        SELECT CASE WHEN s.shown = 'waiting' AND EXISTS (
                    SELECT 1 FROM chats c
                    WHERE c.chat_key = chatq_chat_key(o.platform, o.account_id, o.chat_id)
                      AND c.held_until > now())
               THEN 'held' ELSE s.shown END AS status,
               count(*) AS n, extract(epoch FROM now() - min(o.received_at))::float8 AS oldest
        FROM operations o
        CROSS JOIN LATERAL (SELECT chatq_shown_status(o.status, o.id, o.platform, o.account_id, o.chat_id)
                            AS shown OFFSET 0) s  -- one call a message (flattened, the CASE made two)
        WHERE o.status = ANY($1::text[]) AND {scope.format(o="o")} GROUP BY 1
        """,
        [*UNFINISHED, *ACTIONABLE],
        platform,
        account_id,
    ):
        backlog[r["status"]] = {"count": r["n"], "oldest_age_seconds": round(r["oldest"], 3)}
    # Counted from the event record by when each event happened: a failure resolved later
    # still failed today, an ignored message was never "received" for the bot.
    events = (
        "operation_events e"
        if platform is None
        else f"operation_events e JOIN operations o ON o.id = e.operation_id AND {scope.format(o='o')}"
    )
    day = await pool.fetchrow(
        f"""
        SELECT count(*) FILTER (WHERE kind = 'received') AS received,
               count(*) FILTER (WHERE kind = 'ignored') AS ignored,
               count(*) FILTER (WHERE kind = 'duplicate') AS duplicates,
               count(*) FILTER (WHERE kind = 'replied') AS replied,
               count(*) FILTER (WHERE kind = 'answered_by_seller') AS answered_by_seller,
               count(*) FILTER (WHERE kind = 'failed') AS failed,
               count(*) FILTER (WHERE kind = 'needs_review') AS needs_review,
               count(*) FILTER (WHERE kind = 'resolved') AS resolved,
               count(DISTINCT (e.job_id, detail)) FILTER (WHERE kind = 'retry_scheduled') AS automatic_retries,
               count(*) FILTER (WHERE kind = 'retried') AS person_retries
        FROM {events} WHERE e.at > now() - interval '24 hours' AND $1::int IS NOT NULL
        """,
        1,
        *((platform, account_id) if platform is not None else ()),
    )
    percentiles = await pool.fetchrow(
        f"""
        SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM e.at - o.received_at)),
               percentile_cont(0.95) WITHIN GROUP (ORDER BY extract(epoch FROM e.at - o.received_at))
        FROM operation_events e JOIN operations o ON o.id = e.operation_id
        WHERE e.kind = 'replied' AND e.at > now() - interval '24 hours' AND $1::int IS NOT NULL
          AND {scope.format(o="o")}
        """,
        1,
        platform,
        account_id,
    )
    day, (p50, p95) = one(day), one(percentiles)
    accounts = [
        {
            "platform": r["platform"],
            "account_id": r["account_id"],
            "state": r["state"],
            "reason": r["state_reason"],
            "since": _iso(r["state_since"]),
        }
        for r in await account_state.paused(pool)
        if platform is None or (r["platform"], r["account_id"]) == (platform, account_id)
    ]
    finished = day["replied"] + day["answered_by_seller"] + day["failed"] + day["needs_review"]
    unfinished = [b for s, b in backlog.items() if s in UNFINISHED and b["count"]]
    return {
        "paused_accounts": accounts,
        "backlog": backlog,
        "backlog_total": sum(b["count"] for s, b in backlog.items() if s in UNFINISHED),
        "oldest_unfinished_age_seconds": max((b["oldest_age_seconds"] for b in unfinished), default=0.0),
        "last_24h": {
            "received": day["received"],
            "ignored": day["ignored"],
            "duplicates": day["duplicates"],
            "replied": day["replied"],
            "answered_by_seller": day["answered_by_seller"],
            "failed": day["failed"],
            "needs_review": day["needs_review"],
            "resolved": day["resolved"],
            "failed_share": round((day["failed"] + day["needs_review"]) / finished, 4) if finished else 0.0,
            "retries": day["automatic_retries"] + day["person_retries"],
            "automatic_retries": day["automatic_retries"],
            "person_retries": day["person_retries"],
            "receipt_to_reply_p50_seconds": round(p50, 3) if p50 is not None else None,
            "receipt_to_reply_p95_seconds": round(p95, 3) if p95 is not None else None,
        },
    }


#: What each kind of event in an operation's record means, for a reader (the record's
#: ``detail`` says the specifics: which attempt, what error, whose note).


EVENT_WORDS = {
    "received": "received and stored",
    "ignored": "stored; not for the bot",
    "duplicate": "delivered again by the platform; stored once",
    "recovered": "recovered by polling (the webhook never brought it)",
    "filed": "filed in the chat's window",
    "held": "filed; the seller holds the chat",
    "emitted": "in a reply job",
    "attempt": "attempt to reply",
    "folded": "joined the reply being written",
    "prompt_cut": "the model was given less of the chat",
    "part_sent": "part of the reply sent",
    "replied": "reply sent",
    "answered_by_seller": "answered by the seller",
    "attempt_failed": "attempt failed",
    "retry_scheduled": "retry scheduled",
    "failed": "failed",
    "needs_review": "needs review",
    "retried": "retried by a person",
    "resolved": "resolved by a person",
}


async def timeline(pool: asyncpg.Pool, operation_id: uuid.UUID) -> list[dict[str, Any]]:
    """The operation's record, oldest first: each event as it was written, in the
    transaction of the change it records (operation_events). Nothing is rebuilt from the
    current rows, so a retry keeps the first attempt's events and a resolve keeps the
    failure it closed."""
    rows = await pool.fetch(
        "SELECT at, kind, actor, detail, job_id FROM operation_events WHERE operation_id = $1 ORDER BY id",
        operation_id,
    )
    # A give-up is decided by the service; its actor is the person it is handed to.
    handed = ("failed", "needs_review")
    return [
        {
            "at": _iso(r["at"]),
            "kind": r["kind"],
            "event": r["detail"] or EVENT_WORDS.get(r["kind"], r["kind"]),
            "by": None if r["kind"] in handed else r["actor"],
            "for": r["actor"] if r["kind"] in handed else None,
            "job_id": str(r["job_id"]) if r["job_id"] else None,
        }
        for r in rows
    ]


def operation_document(row: asyncpg.Record) -> dict[str, Any]:
    now = datetime.now(UTC)
    status = row["status"]
    reason = row["status_reason"]
    error = None
    if status in ACTIONABLE or (row["error_message"] and status in UNFINISHED):
        error = {
            "kind": row["error_kind"] or status,
            "message": row["error_message"] or reason,
            "attempts": row["attempts"],
        }
    reply = None
    if row["reply_text"] is not None and row["job_status"] == "sent":
        reply = {
            "text": row["reply_text"],
            "platform_message_id": row["platform_message_id"],
            "sent_at": _iso(row["reply_sent_at"]),
        }
    resolution = None
    if row["resolution"]:
        resolution = {
            "resolution": row["resolution"],
            "by": row["resolved_by"],
            "at": _iso(row["resolved_at"]),
            "note": row["note"],
        }
    return {
        "id": str(row["id"]),
        "platform": row["platform"],
        "chat": {"account_id": row["account_id"], "chat_id": row["chat_id"]},
        "message": {
            "id": row["message_id"],
            "author_id": row["author_id"],
            "text": row["text"],
            "sent_at": _iso(row["sent_at"]),
        },
        "status": status,
        "status_text": (
            f"held by the seller until {row['held_until'].astimezone(UTC):%H:%M} UTC: the bot stays out of "
            "this chat while the seller answers in person"
            if row["held_until"] is not None and status in ("accepted", "queued", "waiting")
            else status_text(status, reason, row["reply_sent_at"] if reply else None)
        ),
        "received_at": _iso(row["received_at"]),
        "updated_at": _iso(row["updated_at"]),
        "age_seconds": round((now - row["received_at"]).total_seconds(), 3),
        "job": {"id": str(row["job_id"]), "status": row["job_status"]} if row["job_id"] else None,
        "reply": reply,
        "error": error,
        "owner": (row["op_owner"] or row["owner"]) if status in ACTIONABLE else None,
        "resolution": resolution,
        "retries": row["retries"],
    }


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value else None
