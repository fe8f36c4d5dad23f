"""The debounce window as a pure function of (window, event time, policy, random draw).

Design section 4: a chat's first message opens a window with a reply delay d drawn once
from [REPLY_DELAY_MIN, REPLY_DELAY_MAX], due = t + d. Each further message at t' sets
due = min(first + MAX_WAIT, max(due, t' + QUIET)): a burst keeps pushing the reply out
while the buyer types, but never past MAX_WAIT after the first message and never earlier
than already promised. No I/O, no clock: callers pass the time and the random source.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import datetime, timedelta


@dataclass(frozen=True)
class WindowPolicy:
    quiet: float
    delay_min: float
    delay_max: float
    max_wait: float

    def __post_init__(self) -> None:
        if min(self.quiet, self.delay_min, self.delay_max, self.max_wait) < 0:
            raise ValueError("window durations cannot be negative")
        if self.delay_min > self.delay_max:
            raise ValueError("delay_min exceeds delay_max")


@dataclass(frozen=True)
class Window:
    first_at: datetime
    last_at: datetime
    deadline_at: datetime  # first_at + max_wait, fixed when the window opens
    due_at: datetime
    delay_seconds: float
    message_count: int


def open_window(t: datetime, policy: WindowPolicy, draw: Callable[[], float]) -> Window:
    """A new window for a message at ``t``. ``draw`` returns a float in [0, 1)."""
    u = draw()
    if not 0.0 <= u <= 1.0:
        raise ValueError("draw() must return a number in [0, 1]")
    delay = policy.delay_min + u * (policy.delay_max - policy.delay_min)
    deadline = t + timedelta(seconds=policy.max_wait)
    due = min(t + timedelta(seconds=delay), deadline)
    return Window(
        first_at=t, last_at=t, deadline_at=deadline, due_at=due, delay_seconds=delay, message_count=1
    )


def add_message(window: Window, t: datetime, policy: WindowPolicy) -> Window:
    """The window after one more message at ``t``."""
    due = min(window.deadline_at, max(window.due_at, t + timedelta(seconds=policy.quiet)))
    return replace(window, last_at=max(window.last_at, t), due_at=due, message_count=window.message_count + 1)


def on_message(window: Window | None, t: datetime, policy: WindowPolicy, draw: Callable[[], float]) -> Window:
    return open_window(t, policy, draw) if window is None else add_message(window, t, policy)


def is_due(window: Window, now: datetime) -> bool:
    return now >= window.due_at
