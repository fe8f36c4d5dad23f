"""What ``chatq connect telegram|avito [--disconnect]`` and the accounts API's connect
share: the outcome, the error, the settings every platform needs. Each platform's own is
``platforms.telegram.connect`` and ``platforms.avito.connect``: register (or remove) this
deployment's webhook with the platform, then show what the platform now holds.

Both are idempotent: the platform is asked what it has first, and a second run changes
nothing and says so. Neither prints a secret: the Avito path secret shows as ``***``, and
Telegram's secret token is never read back (the platform does not show it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from platforms.admin import (
    PlatformError,
    public_url_problem,
)
from shared.settings import Settings


class ConnectError(Exception):
    """The command cannot go on. ``kind``: "usage" when a setting is missing or wrong
    (nothing was asked of the platform), "refused" when the platform said no,
    "unreachable" when it did not answer."""

    def __init__(self, message: str, kind: Literal["usage", "refused", "unreachable"] = "refused") -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class Outcome:
    text: str
    changed: bool


def require(settings: Settings, *, telegram: bool, needed: dict[str, object]) -> None:
    missing = [name for name, value in needed.items() if not value]
    problems = [f"set {name}" for name in missing]
    if problem := public_url_problem(settings.public_url, telegram=telegram):
        problems.append(problem)
    if problems:
        raise ConnectError("; ".join(problems), "usage")


def refused(exc: PlatformError) -> ConnectError:
    """The platform's refusal (or silence) as the command's error; each platform's
    ``connect`` words its own refusals first."""
    if exc.status is None:
        return ConnectError(str(exc), "unreachable")
    return ConnectError(str(exc))
