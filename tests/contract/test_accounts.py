"""The accounts store's contract: whether the bot may send on an account, the same bodies
against ``stores.accounts.fake.InMemoryAccountStates`` and
``stores.accounts.postgres.PgAccountStates``. The responder pauses and probes accounts
through the jobs store, whose fake delegates here (stores/jobs/fake.py); these say that
fake pauses, probes and resumes as Postgres does: one announcement a pause, a person's
pause never resumed by a probe, a probe due only when its time has come."""

from __future__ import annotations

from typing import Protocol

import asyncpg
import pytest

from stores.accounts.fake import InMemoryAccountStates
from stores.accounts.postgres import PgAccountStates
from stores.accounts.protocol import AccountStates
from tests.contract.conftest import MEMORY, POSTGRES, backends, postgres_pool

HOUR = 3600.0


class Accounts(Protocol):
    store: AccountStates

    async def add(self, platform: str, account_id: str) -> None:
        """An active account, as the registry writes it."""
        ...

    async def state(self, platform: str, account_id: str) -> tuple[str, str | None]: ...


class MemoryAccounts:
    def __init__(self) -> None:
        self.store = self.fake = InMemoryAccountStates()

    async def add(self, platform: str, account_id: str) -> None:
        self.fake._of(platform, account_id)

    async def state(self, platform: str, account_id: str) -> tuple[str, str | None]:
        account = self.fake.accounts[(platform, account_id)]
        return account.state.value, account.reason


class PostgresAccounts:
    def __init__(self, pool: asyncpg.Pool) -> None:
        self.pool = pool
        self.store = PgAccountStates(pool)

    async def add(self, platform: str, account_id: str) -> None:
        await self.pool.execute(
            "INSERT INTO accounts (platform, account_id) VALUES ($1, $2)", platform, account_id
        )

    async def state(self, platform: str, account_id: str) -> tuple[str, str | None]:
        row = await self.pool.fetchrow(
            "SELECT state, state_reason FROM accounts WHERE platform = $1 AND account_id = $2",
            platform,
            account_id,
        )
        assert row is not None
        return row["state"], row["state_reason"]


@backends(MEMORY, POSTGRES)
def accounts(request: pytest.FixtureRequest) -> Accounts:
    if request.param == MEMORY:
        return MemoryAccounts()
    return PostgresAccounts(postgres_pool(request))


async def test_a_platforms_refusal_pauses_an_account_once_and_keeps_the_latest_reason(
    accounts: Accounts,
) -> None:
    await accounts.add("avito", "7")

    first = await accounts.store.pause_by_platform("avito", "7", "401 from Avito", HOUR)
    second = await accounts.store.pause_by_platform("avito", "7", "403 from Avito", HOUR)

    assert (first, second) == (True, False)  # announced once
    assert await accounts.state("avito", "7") == ("paused_by_platform", "403 from Avito")


async def test_a_refusal_of_an_account_never_seen_pauses_it_too(accounts: Accounts) -> None:
    assert await accounts.store.pause_by_platform("telegram", "bot", "401 Unauthorized", HOUR)
    assert await accounts.state("telegram", "bot") == ("paused_by_platform", "401 Unauthorized")


async def test_a_probe_is_due_only_when_its_time_has_come_and_only_on_the_platforms_asked(
    accounts: Accounts,
) -> None:
    await accounts.store.pause_by_platform("avito", "now", "401", 0)
    await accounts.store.pause_by_platform("avito", "later", "401", HOUR)
    await accounts.store.pause_by_platform("telegram", "now", "401", 0)

    due = await accounts.store.due_for_probe(["avito"])

    assert [(r["platform"], r["account_id"], r["state_reason"]) for r in due] == [("avito", "now", "401")]


async def test_a_failed_probe_puts_the_next_one_off_with_the_new_reason(accounts: Accounts) -> None:
    await accounts.store.pause_by_platform("avito", "7", "401", 0)

    await accounts.store.probe_later("avito", "7", "still 401", HOUR)

    assert await accounts.store.due_for_probe(["avito"]) == []
    assert await accounts.state("avito", "7") == ("paused_by_platform", "still 401")


async def test_a_probe_that_succeeds_resumes_a_platforms_pause_once(accounts: Accounts) -> None:
    await accounts.store.pause_by_platform("avito", "7", "401", 0)

    assert await accounts.store.resume("avito", "7") is True
    assert await accounts.store.resume("avito", "7") is False
    assert await accounts.state("avito", "7") == ("active", None)
    assert await accounts.store.paused() == []


async def test_a_persons_pause_is_never_resumed_by_a_probe_and_a_refusal_does_not_replace_it(
    accounts: Accounts,
) -> None:
    await accounts.add("avito", "7")
    assert await accounts.store.pause_by_person("avito", "7", "paused by ann: the plan lapsed") is True
    assert await accounts.store.pause_by_person("avito", "7", "again") is False

    assert await accounts.store.pause_by_platform("avito", "7", "401", 0) is False
    assert await accounts.store.resume("avito", "7") is False
    assert await accounts.store.due_for_probe(["avito"]) == []
    assert await accounts.state("avito", "7") == ("paused_by_person", "paused by ann: the plan lapsed")

    await accounts.store.resume_by_person("avito", "7")
    assert await accounts.state("avito", "7") == ("active", None)


async def test_a_persons_resume_of_a_platforms_pause_asks_for_a_probe_now(accounts: Accounts) -> None:
    await accounts.store.pause_by_platform("avito", "7", "401", HOUR)

    await accounts.store.resume_by_person("avito", "7")

    assert await accounts.state("avito", "7") == ("paused_by_platform", "401")
    assert [r["account_id"] for r in await accounts.store.due_for_probe(["avito"])] == ["7"]


async def test_every_account_not_active_is_listed_for_a_person(accounts: Accounts) -> None:
    await accounts.add("avito", "ok")
    await accounts.add("telegram", "bot")
    await accounts.store.pause_by_platform("avito", "7", "401", HOUR)
    await accounts.store.pause_by_person("telegram", "bot", "paused by ann")

    listed = {(r["platform"], r["account_id"], r["state"]) for r in await accounts.store.paused()}

    assert listed == {("avito", "7", "paused_by_platform"), ("telegram", "bot", "paused_by_person")}
