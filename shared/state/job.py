"""A reply job: one chat window's reply, and its delivery (the latest send attempt).

    pending <-> processing -> sent
                          \\-> failed        nothing was sent; its messages may be retried
                          \\-> needs_review  a reply may be in the chat; a person decides
                          \\-> superseded    every message is answered or held by another reply
    needs_review -> superseded               a person confirmed a re-send (a new job)
    needs_review -> sent                     the platform echoed the reply back: it went out

Delivery: ``sending`` is committed before the platform is called; from then on the
reply may be on the platform until ``sent``, ``not_sent`` or ``unknown`` says otherwise.
A job a send of which may have reached the chat (``may_have_sent``) never becomes
``failed``, and is never withdrawn (superseded) because the seller wrote.
"""

from __future__ import annotations

import enum
import uuid

from shared.db import Conn

from .machine import Lifecycle


class JobStatus(enum.StrEnum):
    PENDING = "pending"
    PROCESSING = "processing"
    SENT = "sent"
    FAILED = "failed"
    NEEDS_REVIEW = "needs_review"
    SUPERSEDED = "superseded"


class DeliveryStatus(enum.StrEnum):
    SENDING = "sending"
    SENT = "sent"
    UNKNOWN = "unknown"
    NOT_SENT = "not_sent"


J = JobStatus
IN_FLIGHT = (J.PENDING, J.PROCESSING)

LIFECYCLE = Lifecycle(
    "reply job",
    JobStatus,
    {
        J.PENDING: frozenset({J.PROCESSING, J.FAILED, J.NEEDS_REVIEW, J.SUPERSEDED}),
        J.PROCESSING: frozenset({J.PENDING, J.SENT, J.FAILED, J.NEEDS_REVIEW, J.SUPERSEDED}),
        # A person confirmed a re-send; or the platform echoed the reply back (it is in
        # the chat: chatq_record_echo).
        J.NEEDS_REVIEW: frozenset({J.SUPERSEDED, J.SENT}),
    },
)

D = DeliveryStatus
#: The latest attempt's reply may be on the platform.
MAY_HAVE_SENT = (D.SENDING, D.UNKNOWN)


def may_have_sent(status: DeliveryStatus | str | None, maybe_sent: bool | None) -> bool:
    """Whether a send of the job may have reached the chat: its latest attempt's delivery
    says so (``sending``, ``unknown``), or an earlier attempt's did, or a part of a reply in
    parts went out (``maybe_sent``, which never goes back). The one rule: such a job is
    finished (sent, reconciled, resumed) or handed to a person (needs_review), never
    withdrawn nor failed. Postgres asks it as ``chatq_delivery_may_have_sent``, rendered
    from this (shared/state/sql.py)."""
    return (status is not None and DeliveryStatus(status) in MAY_HAVE_SENT) or bool(maybe_sent)


DELIVERY = Lifecycle(
    "delivery",
    DeliveryStatus,
    {
        D.SENDING: frozenset({D.SENT, D.UNKNOWN, D.NOT_SENT}),
        # The next attempt records its intent again.
        D.NOT_SENT: frozenset({D.SENDING}),
        # Re-sent under the same idempotency key, or after reconciling found nothing.
        D.UNKNOWN: frozenset({D.SENDING, D.SENT}),
    },
)


def lock_key(job_id: uuid.UUID) -> int:
    """The job's session advisory lock, held by the responder across a job's handling (a
    bigint from the job id). Whoever takes it may decide the job."""
    return job_id.int & 0x7FFF_FFFF_FFFF_FFFF


# ---- writes: every status change of a reply job made from Python ------------------------
# (the PL/pgSQL writers of stores/jobs/functions/30_jobs.sql use the same table through
# chatq_job_sources; the trigger of 00_states.sql refuses anything else.)


async def back_to_pending(conn: Conn, job_id: uuid.UUID, kind: str, reason: str) -> None:
    """An attempt did not send: back to pending until the retry tier hands the job back
    (the chat stays blocked). The attempt's outcome goes on the record of each of the
    job's messages (a wait for a paused account is not an attempt, and is not recorded
    again and again)."""
    await conn.execute(
        """
        WITH job AS (
            UPDATE reply_jobs SET status = 'pending', error_kind = $2, error_message = $3, updated_at = now()
            WHERE id = $1 AND status = ANY($4::text[])
            RETURNING operation_ids, attempts
        )
        SELECT chatq_log(job.operation_ids, 'attempt_failed',
                         'attempt ' || job.attempts || ' did not send (' || $2 || '): ' || $3, $1)
        FROM job WHERE $2 <> 'account'
        """,
        job_id,
        kind,
        reason[:500],
        LIFECYCLE.sources(J.PENDING),
    )


async def supersede_for_resend(conn: Conn, job_id: uuid.UUID, by: str) -> bool:
    """A person confirmed that a needs_review job's messages are sent again: the job is
    superseded by the new one, and its error says who confirmed. Returns whether it
    changed."""
    status = await conn.fetchval(
        """
        UPDATE reply_jobs SET status = 'superseded', updated_at = now(),
               error_message = left(coalesce(error_message, '') || '; re-send confirmed by ' || $2, 500)
        WHERE id = $1 AND status = $3
        RETURNING status
        """,
        job_id,
        by,
        J.NEEDS_REVIEW.value,
    )
    return status is not None
