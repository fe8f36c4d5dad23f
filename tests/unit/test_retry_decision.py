from __future__ import annotations

import pytest

from shared.retry import RetryPlan, attempt_of, delivery_count_of, next_retry

pytestmark = pytest.mark.unit
TIERS = (1, 10, 60, 300)


def test_each_retry_takes_the_next_tier() -> None:
    assert [next_retry(a, max_attempts=5, tiers=TIERS) for a in (1, 2, 3, 4)] == [
        RetryPlan(2, 1),
        RetryPlan(3, 10),
        RetryPlan(4, 60),
        RetryPlan(5, 300),
    ]


def test_the_last_allowed_attempt_gives_up() -> None:
    assert next_retry(5, max_attempts=5, tiers=TIERS) is None
    assert next_retry(1, max_attempts=1, tiers=TIERS) is None


def test_the_last_tier_repeats_when_attempts_outnumber_tiers() -> None:
    assert next_retry(7, max_attempts=10, tiers=TIERS) == RetryPlan(8, 300)


def test_a_retry_after_picks_the_shortest_tier_that_waits_long_enough() -> None:
    assert next_retry(1, max_attempts=5, tiers=TIERS, retry_after=5) == RetryPlan(2, 10)
    assert next_retry(1, max_attempts=5, tiers=TIERS, retry_after=0.5) == RetryPlan(2, 1)
    assert next_retry(1, max_attempts=5, tiers=TIERS, retry_after=9999) == RetryPlan(2, 300)


def test_the_attempt_header_is_read_defensively() -> None:
    assert attempt_of(None) == 1
    assert attempt_of({"chatq-attempt": 3}) == 3
    assert attempt_of({"chatq-attempt": "x"}) == 1
    assert attempt_of({"chatq-attempt": -2}) == 1


def test_a_try_that_was_not_an_attempt_never_exhausts_and_keeps_its_attempt_number() -> None:
    # A copy that found the job busy on the last allowed attempt waits for the holder.
    assert next_retry(5, max_attempts=5, tiers=TIERS, counts=False) == RetryPlan(5, 1)
    assert next_retry(5, max_attempts=5, tiers=(10, 1, 60), counts=False) == RetryPlan(5, 1)


def test_the_delivery_count_the_broker_sets_is_read_defensively() -> None:
    assert delivery_count_of(None) == 0
    assert delivery_count_of({"x-delivery-count": 4}) == 4
    assert delivery_count_of({"x-delivery-count": "nope"}) == 0
