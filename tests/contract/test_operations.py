"""The operations store's contract, as a person's commands (retry, resolve) change it: the
same bodies against ``stores.operations.fake.InMemoryOperations`` and
``stores.operations.postgres.PgOperationStore``. The commands' branches are unit-tested on
the fake (tests/unit/test_admin_commands.py); these say the fake does what Postgres does:
what a lock reads, what a retry and a resolution move and leave, and that a transaction
that raises leaves nothing behind."""

from __future__ import annotations

import uuid
from typing import Protocol

import asyncpg
import pytest

from shared.state.job import JobStatus
from shared.state.operation import OperationStatus
from stores.operations.fake import InMemoryOperations
from stores.operations.postgres import PgOperationStore
from stores.operations.protocol import Closing, OperationStore
from tests.contract.conftest import MEMORY, POSTGRES, backends, postgres_pool
from tests.support import seed

S = OperationStatus
CHAT = "telegram:bot:77"


class Operations(Protocol):
    store: OperationStore

    async def message(self, status: OperationStatus) -> uuid.UUID: ...

    async def job(self, status: JobStatus, *ops: uuid.UUID) -> uuid.UUID: ...

    async def statuses(self, *ops: uuid.UUID) -> list[str]: ...

    async def published(self) -> list[uuid.UUID]: ...


class MemoryOperations:
    def __init__(self) -> None:
        self.store = self.fake = InMemoryOperations()

    async def message(self, status: OperationStatus) -> uuid.UUID:
        return self.fake.message(status, chat_id="77")

    async def job(self, status: JobStatus, *ops: uuid.UUID) -> uuid.UUID:
        return self.fake.job(status, *ops)

    async def statuses(self, *ops: uuid.UUID) -> list[str]:
        return [self.fake.op(o).status.value for o in ops]

    async def published(self) -> list[uuid.UUID]:
        return [m.operation_id for m in self.fake.state.outbox]


class PostgresOperations:
    def __init__(self, pool: asyncpg.Pool) -> None:
        self.pool = pool
        self.store = PgOperationStore(pool)
        self._n = 0

    async def message(self, status: OperationStatus) -> uuid.UUID:
        self._n += 1
        return await seed.operation(self.pool, str(self._n), status=status.value)

    async def job(self, status: JobStatus, *ops: uuid.UUID) -> uuid.UUID:
        return await seed.job(self.pool, list(ops), status=status.value)

    async def statuses(self, *ops: uuid.UUID) -> list[str]:
        rows = {
            r["id"]: r["status"]
            for r in await self.pool.fetch(
                "SELECT id, status FROM operations WHERE id = ANY($1::uuid[])", ops
            )
        }
        return [rows[o] for o in ops]

    async def published(self) -> list[uuid.UUID]:
        rows = await self.pool.fetch("SELECT operation_id FROM outbox ORDER BY id")
        return [r["operation_id"] for r in rows]


@backends(MEMORY, POSTGRES)
def operations(request: pytest.FixtureRequest) -> Operations:
    if request.param == MEMORY:
        return MemoryOperations()
    return PostgresOperations(postgres_pool(request))


async def test_locking_an_operation_the_store_does_not_have_finds_none(operations: Operations) -> None:
    async with operations.store.transaction() as tx:
        assert await tx.lock(uuid.uuid4()) is None


async def test_a_lock_reads_the_operations_status_and_its_reply_jobs_messages(operations: Operations) -> None:
    a, b = await operations.message(S.FAILED), await operations.message(S.FAILED)
    job_id = await operations.job(JobStatus.FAILED, a, b)

    async with operations.store.transaction() as tx:
        locked = await tx.lock(a)

    assert locked is not None
    assert (locked.status, locked.job_id, locked.job_operation_ids) == (S.FAILED, job_id, [a, b])
    assert (locked.platform, locked.account_id, locked.chat_id, locked.job_chat_key) == (
        "telegram",
        "bot",
        "77",
        CHAT,
    )


async def test_a_lone_message_is_locked_with_no_job(operations: Operations) -> None:
    op = await operations.message(S.FAILED)

    async with operations.store.transaction() as tx:
        locked = await tx.lock(op)

    assert locked is not None
    assert (locked.job_id, locked.job_operation_ids, locked.job_chat_key) == (None, [], None)


async def test_a_retry_puts_failed_and_needs_review_messages_back_and_leaves_the_others(
    operations: Operations,
) -> None:
    failed, review, replied = (
        await operations.message(S.FAILED),
        await operations.message(S.NEEDS_REVIEW),
        await operations.message(S.REPLIED),
    )

    async with operations.store.transaction() as tx:
        back = await tx.retry([failed, review, replied])
        await tx.publish(back)

    assert sorted(m.operation_id for m in back) == sorted([failed, review])
    assert await operations.statuses(failed, review, replied) == ["accepted", "accepted", "replied"]
    assert sorted(await operations.published()) == sorted([failed, review])


async def test_a_resolution_closes_only_the_messages_a_person_may_close(operations: Operations) -> None:
    failed, waiting = await operations.message(S.FAILED), await operations.message(S.WAITING)
    closing = Closing(S.IGNORED, "the buyer wrote elsewhere", "dismissed", "on-call", None)

    async with operations.store.transaction() as tx:
        done = await tx.resolve([failed, waiting], closing)

    assert done == [failed]
    assert await operations.statuses(failed, waiting) == ["ignored", "waiting"]


async def test_siblings_are_the_operation_itself_and_those_still_its_jobs_in_that_status(
    operations: Operations,
) -> None:
    a, b = await operations.message(S.NEEDS_REVIEW), await operations.message(S.NEEDS_REVIEW)
    c = await operations.message(S.REPLIED)
    job_id = await operations.job(JobStatus.NEEDS_REVIEW, a, b, c)
    elsewhere = await operations.message(S.NEEDS_REVIEW)  # not the job's

    async with operations.store.transaction() as tx:
        found = await tx.siblings([a, b, c, elsewhere], S.NEEDS_REVIEW, a, job_id)

    assert sorted(found) == sorted([a, b])


async def test_a_transaction_that_raises_leaves_every_change_undone(operations: Operations) -> None:
    failed = await operations.message(S.FAILED)

    with pytest.raises(RuntimeError, match="a command failed half-way"):
        async with operations.store.transaction() as tx:
            await tx.publish(await tx.retry([failed]))
            raise RuntimeError("a command failed half-way")

    assert await operations.statuses(failed) == ["failed"]
    assert await operations.published() == []
