"""The accounts aggregate's states as a Protocol: whether the bot may send on an account
(shared/state/account.py: active, paused by the platform, paused by a person).
``postgres.PgAccountStates`` implements it, ``fake.InMemoryAccountStates`` in memory under
the same lifecycle; tests/contract/test_accounts.py runs one set of bodies against both."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from shared.messages import Row


class AccountStates(Protocol):
    async def pause_by_platform(self, platform: str, account_id: str, reason: str, probe_in: float) -> bool:
        """The platform refused the account as a whole: paused, probed in ``probe_in``
        seconds. True for the one caller that moved it from active (announced once)."""
        ...

    async def pause_by_person(self, platform: str, account_id: str, reason: str) -> bool:
        """A person paused it: no probe resumes it. True when this moved it."""
        ...

    async def resume(self, platform: str, account_id: str) -> bool:
        """A probe succeeded: a platform's pause ends (a person's stays). True when it ended."""
        ...

    async def resume_by_person(self, platform: str, account_id: str) -> None:
        """A person's resume: their pause ends at once, a platform's is probed now."""
        ...

    async def probe_later(self, platform: str, account_id: str, reason: str, probe_in: float) -> None:
        """A probe failed: the platform's pause goes on, with the latest reason."""
        ...

    async def due_for_probe(self, platforms: list[str]) -> Sequence[Row]:
        """Accounts the platform paused whose probe is due, on these platforms, soonest first
        (platform, account_id, state_reason)."""
        ...

    async def paused(self) -> Sequence[Row]:
        """Every account that is not active (platform, account_id, state, state_reason, state_since)."""
        ...
