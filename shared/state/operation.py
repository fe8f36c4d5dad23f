"""An operation: one inbound platform event, usually a buyer message.

    accepted -> queued -> waiting -> replying -> replied
                                  \\-> failed | needs_review  (a person: retry, resolve)
    ignored (stored as such: not for the bot)

A buyer message is never ``ignored`` because another message was answered first: it is
answered, or it goes to a person (``failed`` when nothing was sent, ``needs_review`` when a
reply may be in the chat). ``failed`` never follows ``needs_review``: an unknown outcome
stays with a person. A person's retry puts ``failed`` (and, confirmed, ``needs_review``)
back to ``accepted``; a person's resolution ends it ``replied`` or ``ignored``.
"""

from __future__ import annotations

import enum
import uuid
from collections.abc import Sequence

import asyncpg

from shared.db import Conn

from .machine import Lifecycle


class OperationStatus(enum.StrEnum):
    ACCEPTED = "accepted"
    QUEUED = "queued"
    WAITING = "waiting"
    REPLYING = "replying"
    REPLIED = "replied"
    FAILED = "failed"
    NEEDS_REVIEW = "needs_review"
    IGNORED = "ignored"


S = OperationStatus
UNFINISHED = (S.ACCEPTED, S.QUEUED, S.WAITING, S.REPLYING)
#: What a person acts on: retry or resolve.
ACTIONABLE = (S.FAILED, S.NEEDS_REVIEW)
_TO_A_PERSON = frozenset({S.FAILED, S.NEEDS_REVIEW})

LIFECYCLE = Lifecycle(
    "operation",
    OperationStatus,
    {
        # Published; filed in a window (the coalescer may file before the relay marks it
        # queued); taken by a reply; answered; given to a person.
        S.ACCEPTED: frozenset({S.QUEUED, S.WAITING, S.REPLYING, S.REPLIED}) | _TO_A_PERSON,
        S.QUEUED: frozenset({S.WAITING, S.REPLYING, S.REPLIED}) | _TO_A_PERSON,
        S.WAITING: frozenset({S.REPLYING, S.REPLIED}) | _TO_A_PERSON,
        S.REPLYING: frozenset({S.REPLIED}) | _TO_A_PERSON,
        # A person: retry (back to work), or resolve (replied manually, dismissed).
        S.FAILED: frozenset({S.ACCEPTED, S.REPLIED, S.IGNORED}),
        S.NEEDS_REVIEW: frozenset({S.ACCEPTED, S.REPLIED, S.IGNORED}),
    },
)

STATUS_TEXT = {
    S.ACCEPTED: "received and stored; about to be handed to the bot",
    S.QUEUED: "stored and queued for the bot",
    S.WAITING: "waiting for the buyer to finish typing",
    S.REPLYING: "the bot is writing the reply",
    S.REPLIED: "reply sent",
    S.FAILED: "gave up",
    S.NEEDS_REVIEW: "send outcome unknown — check the chat and resolve",
    S.IGNORED: "not for the bot",
}


# ---- writes: every status change of an operation made from Python ---------------------
# (PL/pgSQL writers in shared/functions use the same table through chatq_operation_sources;
# the trigger of 00_states.sql refuses anything else.)


async def fail(
    conn: Conn,
    ids: Sequence[uuid.UUID],
    reason: str,
    owner: str,
    *,
    unfiled_only: bool = False,
) -> list[uuid.UUID]:
    """The operations fail with the reason and an owner (a person may retry them), and the
    failure goes on their record. ``unfiled_only``: only a message never filed in a window
    (accepted, queued) fails; one already in a window is left to its reply. Returns the
    operations that changed."""
    sources = [S.ACCEPTED.value, S.QUEUED.value] if unfiled_only else LIFECYCLE.sources(S.FAILED)
    rows = await conn.fetch(
        """
        WITH up AS (
            UPDATE operations SET status = 'failed', status_reason = $2, owner = $3, updated_at = now()
            WHERE id = ANY($1::uuid[]) AND status = ANY($4::text[])
            RETURNING id
        ), ev AS (
            INSERT INTO operation_events (operation_id, kind, detail, actor) SELECT id, 'failed', 'failed: ' || $2, $3 FROM up
        )
        SELECT id FROM up
        """,
        list(ids),
        reason[:500],
        owner,
        sources,
    )
    return [r["id"] for r in rows]


async def fail_unfiled(conn: Conn, operation_id: uuid.UUID, reason: str, owner: str) -> bool:
    """The coalescer gave up on a message it never filed (see ``fail``). Returns whether
    the operation changed."""
    return bool(await fail(conn, [operation_id], reason, owner, unfiled_only=True))


async def record_event(
    conn: Conn,
    operation_ids: Sequence[uuid.UUID],
    kind: str,
    *,
    actor: str | None = None,
    detail: str | None = None,
    job_id: uuid.UUID | None = None,
) -> None:
    """Append what a person (or the pipeline) decided about these operations, in the
    caller's transaction."""
    await conn.execute(
        """
        INSERT INTO operation_events (operation_id, kind, actor, detail, job_id)
        SELECT x, $2, $3, $4, $5 FROM unnest($1::uuid[]) AS x
        """,
        list(operation_ids),
        kind,
        actor,
        detail,
        job_id,
    )


async def retry(conn: Conn, ids: Sequence[uuid.UUID]) -> list[asyncpg.Record]:
    """A person puts failed or needs_review operations back to work (the caller decided a
    needs_review one may be sent again). Returns what the re-publication needs."""
    return await conn.fetch(
        """
        UPDATE operations SET status = 'accepted', job_id = NULL, status_reason = NULL, owner = NULL,
               retries = retries + 1, updated_at = now()
        WHERE id = ANY($1::uuid[]) AND status IN ('failed', 'needs_review')
        RETURNING id, platform, account_id, chat_id, message_id, author_id, text, sent_at, received_at
        """,
        list(ids),
    )


async def resolve(
    conn: Conn,
    ids: Sequence[uuid.UUID],
    to: OperationStatus,
    *,
    reason: str,
    resolution: str,
    by: str,
    note: str | None,
) -> list[asyncpg.Record]:
    """A person closes failed or needs_review operations: replied (manually) or ignored
    (dismissed)."""
    LIFECYCLE.check(S.FAILED, to)
    return await conn.fetch(
        """
        UPDATE operations SET status = $2, status_reason = $3, resolution = $4, resolved_by = $5,
               resolved_at = now(), note = $6, updated_at = now()
        WHERE id = ANY($1::uuid[]) AND status IN ('failed', 'needs_review')
        RETURNING id, sent_at, received_at, message_id
        """,
        list(ids),
        to.value,
        reason,
        resolution,
        by,
        note,
    )
