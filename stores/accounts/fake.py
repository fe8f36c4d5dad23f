"""Account states in memory: an implementation of ``stores.accounts.protocol`` that moves
every account through the lifecycle of shared/state/account.py (a move it refuses raises
TransitionNotAllowed), on a clock of its own. tests/contract/test_accounts.py runs the same
bodies on it and on Postgres; the jobs fake (stores/jobs/fake.py) pauses and resumes
accounts through it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from shared.messages import Row
from shared.state.account import LIFECYCLE, AccountState

T0 = datetime(2026, 11, 1, 12, 0, tzinfo=UTC)


@dataclass
class FakeAccount:
    state: AccountState = AccountState.ACTIVE
    reason: str | None = None
    since: datetime = T0
    next_probe_at: datetime | None = None

    def move(self, to: AccountState, now: datetime) -> None:
        LIFECYCLE.check(self.state, to)
        self.state, self.since = to, now


class InMemoryAccountStates:
    def __init__(self) -> None:
        self.accounts: dict[tuple[str, str], FakeAccount] = {}
        self.clock = T0

    def advance(self, seconds: float) -> None:
        self.clock += timedelta(seconds=seconds)

    def _of(self, platform: str, account_id: str) -> FakeAccount:
        return self.accounts.setdefault((platform, account_id), FakeAccount(since=self.clock))

    async def pause_by_platform(self, platform: str, account_id: str, reason: str, probe_in: float) -> bool:
        account = self._of(platform, account_id)
        if account.state is AccountState.ACTIVE:
            account.move(AccountState.PAUSED_BY_PLATFORM, self.clock)
            account.reason = reason[:500]
            account.next_probe_at = self.clock + timedelta(seconds=probe_in)
            return True
        await self.probe_later(platform, account_id, reason, probe_in)
        return False

    async def pause_by_person(self, platform: str, account_id: str, reason: str) -> bool:
        account = self.accounts.get((platform, account_id))
        if account is None or account.state is AccountState.PAUSED_BY_PERSON:
            return False
        account.move(AccountState.PAUSED_BY_PERSON, self.clock)
        account.reason, account.next_probe_at = reason, None
        return True

    async def resume(self, platform: str, account_id: str) -> bool:
        account = self.accounts.get((platform, account_id))
        if account is None or account.state is not AccountState.PAUSED_BY_PLATFORM:
            return False
        account.move(AccountState.ACTIVE, self.clock)
        account.reason, account.next_probe_at = None, None
        return True

    async def resume_by_person(self, platform: str, account_id: str) -> None:
        account = self.accounts.get((platform, account_id))
        if account is None:
            return
        if account.state is AccountState.PAUSED_BY_PERSON:
            account.move(AccountState.ACTIVE, self.clock)
            account.reason = None
        elif account.state is AccountState.PAUSED_BY_PLATFORM:
            account.next_probe_at = self.clock

    async def probe_later(self, platform: str, account_id: str, reason: str, probe_in: float) -> None:
        account = self.accounts.get((platform, account_id))
        if account is not None and account.state is AccountState.PAUSED_BY_PLATFORM:
            account.reason = reason[:500]
            account.next_probe_at = self.clock + timedelta(seconds=probe_in)

    async def due_for_probe(self, platforms: list[str]) -> Sequence[Row]:
        due = [
            (a.next_probe_at, p, i, a.reason)
            for (p, i), a in self.accounts.items()
            if a.state is AccountState.PAUSED_BY_PLATFORM
            and a.next_probe_at is not None
            and a.next_probe_at <= self.clock
            and p in platforms
        ]
        return [{"platform": p, "account_id": i, "state_reason": why} for _, p, i, why in sorted(due)]

    async def paused(self) -> Sequence[Row]:
        rows = [
            (a.since, p, i, a) for (p, i), a in self.accounts.items() if a.state is not AccountState.ACTIVE
        ]
        return [
            {
                "platform": p,
                "account_id": i,
                "state": a.state.value,
                "state_reason": a.reason,
                "state_since": s,
            }
            for s, p, i, a in sorted(rows, key=lambda r: r[0])
        ]
