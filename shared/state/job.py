"""A reply job: one chat window's reply, and its delivery (the latest send attempt).

    pending <-> processing -> sent
                          \\-> failed        nothing was sent; its messages may be retried
                          \\-> needs_review  a reply may be in the chat; a person decides
                          \\-> superseded    every message is answered or held by another reply
    needs_review -> superseded               a person confirmed a re-send (a new job)

Delivery: ``sending`` is committed before the platform is called; from then on the
reply may be on the platform until ``sent``, ``not_sent`` or ``unknown`` says otherwise.
A job whose delivery is ``sending`` or ``unknown`` never becomes ``failed``.
"""

from __future__ import annotations

import enum
import uuid

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
        J.NEEDS_REVIEW: frozenset({J.SUPERSEDED}),
    },
)

D = DeliveryStatus
#: The reply may be on the platform.
MAY_HAVE_SENT = (D.SENDING, D.UNKNOWN)

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
