"""The retry decision, pure: given the attempt that just failed, pick the retry tier or
give up. Tiers are the topology's TTL queues (RETRY_DELAYS_SECONDS)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal

ATTEMPT_HEADER = "chatq-attempt"
ERROR_HEADER = "chatq-last-error"


@dataclass(frozen=True)
class RetryPlan:
    next_attempt: int
    delay: float  # the tier to publish to


def next_retry(
    failed_attempt: int,
    *,
    max_attempts: int,
    tiers: Sequence[float],
    retry_after: float | None = None,
    counts: bool = True,
) -> RetryPlan | None:
    """None when ``failed_attempt`` was the last one allowed. Otherwise the tier for the
    next attempt: tier n for the n-th retry (the last tier repeats), or the shortest
    tier that waits at least ``retry_after`` when the platform said how long to wait.
    ``counts=False``: this try was not an attempt (the work was busy elsewhere, or it was
    too early to tell), so it never exhausts anything: the same attempt again, after the
    shortest tier (that waits at least ``retry_after``)."""
    if failed_attempt < 1:
        raise ValueError("attempts count from 1")
    ordered = sorted(tiers)
    if not counts:
        wait = retry_after or 0.0
        return RetryPlan(
            next_attempt=failed_attempt, delay=next((t for t in ordered if t >= wait), ordered[-1])
        )
    if failed_attempt >= max_attempts:
        return None
    delay = list(tiers)[min(failed_attempt - 1, len(tiers) - 1)]
    if retry_after is not None and retry_after > delay:
        delay = next((t for t in ordered if t >= retry_after), ordered[-1])
    return RetryPlan(next_attempt=failed_attempt + 1, delay=delay)


def _header_int(headers: Mapping[str, object] | None, name: str) -> int | None:
    """A header read as a whole number: None when absent or not one (a header is
    whatever the publisher put there: a number, a string of digits, bytes, or junk)."""
    value = (headers or {}).get(name)
    if isinstance(value, bool) or not isinstance(value, int | float | Decimal | str | bytes):
        return None
    try:
        return int(value)
    except (ValueError, OverflowError):
        return None


def attempt_of(headers: Mapping[str, object] | None) -> int:
    """The attempt a delivered message is on (1 when it carries no header)."""
    value = _header_int(headers, ATTEMPT_HEADER)
    return 1 if value is None else max(1, value)


#: Set by quorum queues on a redelivered message: its unsuccessful deliveries so far.
DELIVERY_COUNT_HEADER = "x-delivery-count"


def delivery_count_of(headers: Mapping[str, object] | None) -> int:
    """How many times the broker delivered this message before without success (0 on the
    first delivery)."""
    value = _header_int(headers, DELIVERY_COUNT_HEADER)
    return 0 if value is None else max(0, value)
