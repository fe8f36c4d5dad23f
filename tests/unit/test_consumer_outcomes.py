"""The one place that maps a handler's outcome to what happens to its message."""

from __future__ import annotations

import asyncpg
import pytest

from shared.broker.consumer import Outcome, Reject, RetryLater, classify, last_delivery

pytestmark = pytest.mark.unit


def test_success_is_acked() -> None:
    assert classify(None) is Outcome.ACK


def test_a_rejected_message_is_dead_lettered() -> None:
    assert classify(Reject("not our schema")) is Outcome.DEAD_LETTER


def test_retry_later_goes_to_the_retry_tiers() -> None:
    assert classify(RetryLater("platform 503")) is Outcome.RETRY_TIER


@pytest.mark.parametrize(
    "exc",
    [
        ConnectionRefusedError(),
        TimeoutError(),
        asyncpg.exceptions.ConnectionDoesNotExistError("gone"),
        asyncpg.exceptions.CannotConnectNowError("starting up"),
        asyncpg.exceptions.SerializationError("40001"),
        asyncpg.exceptions.DeadlockDetectedError("40P01"),
        asyncpg.exceptions.TooManyConnectionsError("53300"),
    ],
)
def test_infrastructure_errors_are_retried_in_process_and_never_dead_lettered(exc) -> None:
    assert classify(exc) is Outcome.RETRY_IN_PROCESS


@pytest.mark.parametrize(
    "exc", [ValueError("bug"), KeyError("x"), asyncpg.exceptions.UndefinedColumnError("no column")]
)
def test_unexpected_errors_are_requeued_so_the_delivery_limit_catches_poison(exc) -> None:
    assert classify(exc) is Outcome.REQUEUE


def test_the_last_delivery_the_broker_allows_is_known_before_a_requeue_would_dead_letter_it() -> None:
    # A quorum queue with delivery-limit 5 dead-letters a message returned a sixth time:
    # on the delivery that has seen 5 unsuccessful ones, the consumer gives up itself.
    assert not last_delivery({"x-delivery-count": 4}, 5)
    assert last_delivery({"x-delivery-count": 5}, 5)
    assert not last_delivery(None, 5)
    assert not last_delivery({"x-delivery-count": 99}, None)
