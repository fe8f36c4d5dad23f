"""A transition table: which status may follow which. Pure data with checks."""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

S = TypeVar("S", bound=enum.StrEnum)


class TransitionNotAllowed(ValueError):
    """A status change the aggregate's transition table does not allow."""


@dataclass(frozen=True)
class Lifecycle(Generic[S]):
    """``table[s]``: the statuses a row in status ``s`` may move to. A status missing from
    the keys is final."""

    aggregate: str
    states: type[S]
    table: Mapping[S, frozenset[S]]

    def __post_init__(self) -> None:
        for source, targets in self.table.items():
            if source in targets:
                raise ValueError(f"{self.aggregate}: {source} -> {source} is not a transition")

    def allowed(self, old: S | str, new: S | str) -> bool:
        return self.states(new) in self.table.get(self.states(old), frozenset())

    def check(self, old: S | str, new: S | str) -> None:
        if not self.allowed(old, new):
            raise TransitionNotAllowed(f"{self.aggregate} status {old} -> {new} is not allowed")

    def sources(self, target: S | str) -> list[str]:
        """Every status that may move to ``target``, in declaration order."""
        t = self.states(target)
        return [s.value for s in self.states if t in self.table.get(s, frozenset())]

    @property
    def final(self) -> list[str]:
        return [s.value for s in self.states if not self.table.get(s)]

    def values(self, states: Iterable[S]) -> list[str]:
        return [s.value for s in states]
