"""The status lifecycles of an operation, a reply job and a delivery, as data."""

from __future__ import annotations

import pytest

from shared.broker.dead_letters import dead_reason
from shared.migrate import FUNCTION_DIRS, read_header
from shared.state import job, operation
from shared.state.machine import TransitionNotAllowed
from shared.state.sql import OUTPUT, render
from tests.support.source import ROOT, python_files

pytestmark = pytest.mark.unit


def test_the_transition_sql_is_the_rendering_of_the_python_tables() -> None:
    assert read_header(OUTPUT.read_text()).body == render(), "run: python -m shared.state"


def test_an_unknown_outcome_never_becomes_failed() -> None:
    assert not operation.LIFECYCLE.allowed("needs_review", "failed")
    assert "needs_review" not in operation.LIFECYCLE.sources("failed")
    assert not job.LIFECYCLE.allowed("needs_review", "failed")
    assert not job.DELIVERY.allowed("unknown", "not_sent")


def test_a_buyer_message_is_never_ignored_on_the_way_to_a_reply() -> None:
    # Only a person (dismissing a failed or needs_review message) makes one ignored.
    assert operation.LIFECYCLE.sources("ignored") == ["failed", "needs_review"]


def test_replied_and_ignored_are_final_and_a_person_acts_on_failed_and_needs_review() -> None:
    assert operation.LIFECYCLE.final == ["replied", "ignored"]
    for status in ("failed", "needs_review"):
        assert operation.LIFECYCLE.allowed(status, "accepted")  # retry
        assert operation.LIFECYCLE.allowed(status, "replied")  # replied manually
        assert operation.LIFECYCLE.allowed(status, "ignored")  # dismissed


def test_a_transition_the_table_does_not_allow_raises() -> None:
    with pytest.raises(TransitionNotAllowed, match="replied -> waiting"):
        operation.LIFECYCLE.check("replied", "waiting")
    with pytest.raises(TransitionNotAllowed, match="sent -> pending"):
        job.LIFECYCLE.check("sent", "pending")


def test_a_needs_review_job_ends_superseded_by_a_persons_confirmed_resend_or_sent_by_its_echo() -> None:
    # A person confirms a re-send (a new job), or the platform echoes the reply back: it
    # was sent after all (chatq_record_echo). It never fails: the reply may be in the chat.
    assert job.LIFECYCLE.table[job.JobStatus.NEEDS_REVIEW] == {job.JobStatus.SUPERSEDED, job.JobStatus.SENT}
    assert job.LIFECYCLE.final == ["sent", "failed", "superseded"]


def test_a_dead_letters_reason_is_its_latest_death_and_the_last_error() -> None:
    headers = {
        "x-death": [
            {"reason": b"rejected", "queue": b"chatq.responder", "count": 1},
            {"reason": "expired", "queue": "chatq.responder.retry.1s", "count": 3},
        ],
        "x-first-death-reason": "expired",
        "chatq-last-error": "telegram: HTTP 503",
    }
    assert dead_reason(headers) == "rejected in chatq.responder (last error: telegram: HTTP 503)"
    assert dead_reason({"x-death": [{"reason": "delivery_limit", "queue": "chatq.coalescer"}]}) == (
        "redelivered past the queue's delivery limit in chatq.coalescer"
    )
    assert dead_reason(None) == "dead-lettered"


def test_a_send_may_have_reached_the_chat_while_its_latest_attempt_is_out_or_unknown_or_an_earlier_one_was() -> (
    None
):
    D = job.DeliveryStatus
    assert [s for s in D if job.may_have_sent(s, False)] == [D.SENDING, D.UNKNOWN]
    assert all(job.may_have_sent(s, True) for s in [*D, None])  # a part went out, or an earlier attempt
    assert not job.may_have_sent(None, False)  # nothing tried yet


def test_no_step_spells_out_which_deliveries_may_have_sent_it_asks_the_one_rule() -> None:
    """chatq_delivery_may_have_sent (rendered from job.may_have_sent) is the only place
    that says which delivery statuses may have reached the chat: a step with its own
    list drifted once (the step before sending withdrew replies half on the platform)."""
    import re

    spelled = re.compile(
        r"'(sending|unknown)'\s*,\s*'(sending|unknown)'|status\s*=\s*'not_sent'\s+AND\s+NOT", re.I
    )
    sources = [p for d in FUNCTION_DIRS for p in d.glob("*.sql") if p != OUTPUT]
    sources += python_files()
    found = [
        f"{p.relative_to(ROOT)}:{n}"
        for p in sources
        for n, line in enumerate(p.read_text().splitlines(), start=1)
        if spelled.search(line.split("--", 1)[0])
    ]
    assert not found, found
    assert "chatq_delivery_may_have_sent" in render()
