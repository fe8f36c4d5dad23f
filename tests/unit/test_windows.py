"""The debounce window, pure: example cases and properties (hypothesis)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stores.windows.window import Window, WindowPolicy, add_message, is_due, on_message, open_window

pytestmark = pytest.mark.unit

T0 = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
POLICY = WindowPolicy(quiet=8, delay_min=20, delay_max=60, max_wait=120)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def test_a_first_message_opens_a_window_due_after_a_delay_drawn_from_the_interval() -> None:
    assert open_window(T0, POLICY, lambda: 0.0).due_at == at(20)
    assert open_window(T0, POLICY, lambda: 0.5).due_at == at(40)
    assert open_window(T0, POLICY, lambda: 1.0).due_at == at(60)


def test_a_burst_within_the_delay_does_not_move_the_reply() -> None:
    w = open_window(T0, POLICY, lambda: 0.5)  # due at 40
    w = add_message(w, at(5), POLICY)
    w = add_message(w, at(10), POLICY)
    assert w.due_at == at(40)
    assert w.message_count == 3


def test_a_message_close_to_due_pushes_it_to_quiet_seconds_after_that_message() -> None:
    w = open_window(T0, POLICY, lambda: 0.0)  # due at 20
    assert add_message(w, at(15), POLICY).due_at == at(23)


def test_a_buyer_who_never_stops_typing_is_answered_at_max_wait() -> None:
    w = open_window(T0, POLICY, lambda: 0.0)
    for s in range(5, 200, 5):
        w = add_message(w, at(s), POLICY)
    assert w.due_at == at(120)


def test_zero_delays_make_a_window_due_at_once() -> None:
    zero = WindowPolicy(0, 0, 0, 0)
    w = open_window(T0, zero, lambda: 0.7)
    assert is_due(w, T0)
    assert is_due(add_message(w, at(0), zero), T0)


def test_a_delay_longer_than_max_wait_is_capped() -> None:
    w = open_window(T0, WindowPolicy(quiet=1, delay_min=300, delay_max=300, max_wait=30), lambda: 0.0)
    assert w.due_at == at(30)


def test_a_policy_with_an_inverted_interval_is_refused() -> None:
    with pytest.raises(ValueError):
        WindowPolicy(quiet=1, delay_min=10, delay_max=5, max_wait=30)


policies = st.builds(
    lambda q, a, b, m: WindowPolicy(quiet=q, delay_min=min(a, b), delay_max=max(a, b), max_wait=m),
    st.floats(0, 30),
    st.floats(0, 120),
    st.floats(0, 120),
    st.floats(0, 300),
)
offsets = st.lists(st.floats(0, 600), min_size=1, max_size=40)


@settings(max_examples=300, deadline=None)
@given(policy=policies, gaps=offsets, u=st.floats(0, 1))
def test_due_never_passes_first_plus_max_wait_and_never_moves_earlier(policy, gaps, u) -> None:
    t = T0
    w: Window | None = None
    for gap in gaps:
        t = t + timedelta(seconds=gap)
        before = w
        w = on_message(w, t, policy, lambda: u)
        assert w.due_at <= w.first_at + timedelta(seconds=policy.max_wait)
        assert w.due_at >= w.first_at
        if before is not None:
            assert w.due_at >= before.due_at
            assert w.first_at == before.first_at


@settings(max_examples=200, deadline=None)
@given(policy=policies, gaps=offsets, u=st.floats(0, 1))
def test_every_message_of_a_simulated_stream_lands_in_exactly_one_emitted_window(policy, gaps, u) -> None:
    """Feed messages and emit windows as a scheduler would (whenever due): each message
    belongs to exactly one window, and windows are emitted in time order."""
    t = T0
    open_w: Window | None = None
    members: list[int] = []
    emitted: list[list[int]] = []
    for i, gap in enumerate(gaps):
        t = t + timedelta(seconds=gap)
        if open_w is not None and is_due(open_w, t):
            emitted.append(members)
            open_w, members = None, []
        open_w = on_message(open_w, t, policy, lambda: u)
        members.append(i)
    emitted.append(members)
    flat = [m for window in emitted for m in window]
    assert flat == list(range(len(gaps)))
    assert all(window for window in emitted)
