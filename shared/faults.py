"""Named fault points: a test names one in CHATQ_FAULT_POINT, and reaching it kills the
process with SIGKILL, exactly there. Inert unless armed from settings in ``__main__``.

Crash-safety tests use these to prove that a kill -9 between two steps (after the
commit and before the response, after the publish and before the mark, ...) loses
nothing and duplicates nothing.
"""

from __future__ import annotations

import logging
import os
import signal
import sys

logger = logging.getLogger(__name__)

#: Every fault point in the code base. Arming an unknown name is refused at start-up,
#: so a typo in a test cannot turn a crash test into a test of nothing.
KNOWN_POINTS: frozenset[str] = frozenset(
    {
        "receiver.after_commit",  # inbox + outbox committed, response not sent
        "relay.after_publish",  # broker confirmed, rows not marked published
        "relay.after_mark",  # rows marked, transaction not committed
        "coalescer.before_commit",  # window updated, transaction not committed
        "coalescer.after_commit",  # message filed and committed, not acked
        "coalescer.after_emit",  # window closed, job + outbox row committed, not published
        "responder.after_generate",  # the model answered, nothing recorded or sent
        "responder.after_send",  # the platform accepted the reply, nothing recorded
        "responder.between_parts",  # a part of a long reply sent and recorded, the next not begun
        "responder.after_record",  # reply recorded and committed, job message not acked
    }
)

_armed: str | None = None


def arm(name: str | None) -> None:
    """Arm one fault point (or none). Called once from a service's ``__main__``."""
    global _armed
    if name and name not in KNOWN_POINTS:
        raise ValueError(f"unknown fault point {name!r}; known: {sorted(KNOWN_POINTS)}")
    _armed = name or None
    if _armed:
        logger.warning("fault point %s is armed: the process will be killed there", _armed)


def fault_point(name: str) -> None:
    """Kill this process with SIGKILL if ``name`` is the armed point."""
    if _armed is None:
        return
    if name not in KNOWN_POINTS:
        raise ValueError(f"fault point {name!r} is not registered in KNOWN_POINTS")
    if name == _armed:
        # Say it on stderr unbuffered so a test can confirm the kill was where it meant.
        sys.stderr.write(f"FAULT POINT {name}: killing pid {os.getpid()}\n")
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)
