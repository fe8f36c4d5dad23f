"""The windows store's contract: the same bodies, driven through the coalescer's filing and
emission (``services.coalescer.service.Coalescer``), against
``stores.windows.fake.InMemoryWindows`` and ``stores.windows.postgres.PgWindowStore`` (the
window functions of stores/windows/functions/20_windows.sql). The coalescer's branches are
unit-tested on the fake (tests/unit/test_coalescer_branches.py); these say the fake files
and emits what Postgres does.

Time: the fake has a clock of its own; on Postgres, "time passes" moves every window's and
message's times that far into the past, so a body never sleeps."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from typing import Protocol

import asyncpg
import pytest

from services.coalescer.service import Coalescer
from shared.broker.consumer import Reject
from shared.broker.topology import JOBS_EXCHANGE
from shared.messages import InboundMessage, ReplyJob
from stores.windows.fake import InMemoryWindows
from stores.windows.postgres import PgWindowStore
from stores.windows.protocol import WindowStore
from stores.windows.window import WindowPolicy
from tests.contract.conftest import MEMORY, POSTGRES, backends, postgres_pool

#: A reply 5 s after a chat's first message, 2 s after its last, never past 8 s.
POLICY = WindowPolicy(quiet=2, delay_min=5, delay_max=5, max_wait=8)


class Windows(Protocol):
    store: WindowStore

    async def receive(
        self, chat_id: str = "c1", text: str = "hello", message_id: str | None = None
    ) -> InboundMessage:
        """A buyer message stored by the intake; what the broker delivers to the coalescer."""
        ...

    async def advance(self, seconds: float) -> None: ...

    async def end_job(self, job_id: uuid.UUID) -> None:
        """The responder sent the job's reply."""
        ...

    async def emitted(self) -> list[ReplyJob]: ...

    async def statuses(self, *messages: InboundMessage) -> list[str]: ...


class MemoryWindows:
    def __init__(self) -> None:
        self.store = self.fake = InMemoryWindows()

    async def receive(
        self, chat_id: str = "c1", text: str = "hello", message_id: str | None = None
    ) -> InboundMessage:
        return self.fake.receive(chat_id, text, message_id=message_id)

    async def advance(self, seconds: float) -> None:
        self.fake.advance(seconds)

    async def end_job(self, job_id: uuid.UUID) -> None:
        self.fake.end_job(job_id)

    async def emitted(self) -> list[ReplyJob]:
        return list(self.fake.state.outbox)

    async def statuses(self, *messages: InboundMessage) -> list[str]:
        return [self.fake.operation(m).status.value for m in messages]


class PostgresWindows:
    def __init__(self, pool: asyncpg.Pool) -> None:
        self.pool = pool
        self.store = PgWindowStore(pool)
        self._n = 0

    async def receive(
        self, chat_id: str = "c1", text: str = "hello", message_id: str | None = None
    ) -> InboundMessage:
        self._n += 1
        now = datetime.now(UTC)
        inbound = InboundMessage(
            operation_id=uuid.uuid4(),
            platform="telegram",
            account_id="bot",
            chat_id=chat_id,
            message_id=message_id or str(self._n),
            author_id="buyer",
            text=text,
            sent_at=now,
            received_at=now,
        )
        await self.pool.execute(
            """
            INSERT INTO operations (id, platform, account_id, event_id, chat_id, message_id, author_id, text,
                                    sent_at, status, received_at, payload)
            VALUES ($1, 'telegram', 'bot', $2, $3, $4, 'buyer', $5, $6, 'accepted', $6, '{}')
            """,
            inbound.operation_id,
            f"e-{inbound.message_id}",
            chat_id,
            inbound.message_id,
            text,
            now,
        )
        return inbound

    async def advance(self, seconds: float) -> None:
        shift = timedelta(seconds=seconds)
        await self.pool.execute(
            "UPDATE chat_windows SET first_at = first_at - $1::interval, last_at = last_at - $1::interval,"
            " deadline_at = deadline_at - $1::interval, due_at = due_at - $1::interval",
            shift,
        )
        await self.pool.execute(
            "UPDATE operations SET sent_at = sent_at - $1::interval, received_at = received_at - $1::interval",
            shift,
        )

    async def end_job(self, job_id: uuid.UUID) -> None:
        # The lifecycle's own steps: claimed, then sent (a trigger refuses pending -> sent).
        await self.pool.execute("UPDATE reply_jobs SET status = 'processing' WHERE id = $1", job_id)
        await self.pool.execute(
            "UPDATE reply_jobs SET status = 'sent', reply_text = 'the reply', sent_at = now() WHERE id = $1",
            job_id,
        )

    async def emitted(self) -> list[ReplyJob]:
        rows = await self.pool.fetch("SELECT body FROM outbox WHERE exchange = $1 ORDER BY id", JOBS_EXCHANGE)
        return [ReplyJob.model_validate_json(r["body"]) for r in rows]

    async def statuses(self, *messages: InboundMessage) -> list[str]:
        rows = {
            r["id"]: r["status"]
            for r in await self.pool.fetch(
                "SELECT id, chatq_shown_status(status, id, platform, account_id, chat_id) AS status"
                " FROM operations WHERE id = ANY($1::uuid[])",
                [m.operation_id for m in messages],
            )
        }
        return [rows[m.operation_id] for m in messages]


@backends(MEMORY, POSTGRES)
def windows(request: pytest.FixtureRequest) -> Windows:
    if request.param == MEMORY:
        return MemoryWindows()
    return PostgresWindows(postgres_pool(request))


def coalescer(windows: Windows) -> Coalescer:
    return Coalescer(windows.store, POLICY, draw=lambda: 0.0)


async def test_a_chats_first_message_opens_a_window_that_falls_due_after_the_reply_delay(
    windows: Windows,
) -> None:
    c = coalescer(windows)
    m = await windows.receive()

    filed = await c.file(m)

    assert filed is not None and filed.opened
    due_in = await c.seconds_to_next_due()
    assert due_in is not None and 4.0 < due_in <= 5.0
    assert await windows.statuses(m) == ["waiting"]
    assert await c.emit_due() == 0


async def test_a_redelivered_message_is_filed_once(windows: Windows) -> None:
    c = coalescer(windows)
    m = await windows.receive()

    assert await c.file(m) is not None
    assert await c.file(m) is None
    assert await windows.store.open_windows() == 1


async def test_a_message_not_in_the_inbox_is_rejected_and_nothing_is_written(windows: Windows) -> None:
    stranger = (await windows.receive()).model_copy(update={"operation_id": uuid.uuid4()})

    with pytest.raises(Reject, match="not in the inbox"):
        await coalescer(windows).file(stranger)
    assert await windows.store.open_windows() == 0


async def test_a_burst_grows_one_window_that_becomes_one_job_with_its_messages_in_platform_order(
    windows: Windows,
) -> None:
    c = coalescer(windows)
    first = await c.file(await windows.receive(text="10", message_id="10"))
    await windows.advance(1)
    second = await c.file(await windows.receive(text="9", message_id="9"))
    assert first is not None and second is not None
    assert second.window_id == first.window_id and not second.opened

    await windows.advance(3)
    assert await c.emit_due() == 0  # 4 s of 5: not due
    await windows.advance(2)
    assert await c.emit_due() == 1

    (job,) = await windows.emitted()
    assert [m.text for m in job.messages] == ["10", "9"]  # sent a second apart: time first
    assert job.window_id == first.window_id
    assert await windows.store.open_windows() == 0


async def test_each_chat_gets_its_own_window_and_its_own_job(windows: Windows) -> None:
    c = coalescer(windows)
    a = await windows.receive(chat_id="a", text="from a")
    b = await windows.receive(chat_id="b", text="from b")
    filed_a, filed_b = await c.file(a), await c.file(b)
    assert filed_a is not None and filed_b is not None and filed_a.window_id != filed_b.window_id

    await windows.advance(5)
    assert await c.emit_due() == 2

    jobs = {job.chat_id: [m.text for m in job.messages] for job in await windows.emitted()}
    assert jobs == {"a": ["from a"], "b": ["from b"]}


async def test_a_window_opened_while_its_chats_job_is_in_flight_waits_for_that_job(windows: Windows) -> None:
    c = coalescer(windows)
    await c.file(await windows.receive(text="a"))
    await windows.advance(5)
    assert await c.emit_due() == 1
    (first,) = await windows.emitted()
    await c.file(await windows.receive(text="b"))
    await windows.advance(10)

    assert await c.emit_due() == 0
    await windows.end_job(first.job_id)
    assert await c.emit_due() == 1
    assert [m.text for m in (await windows.emitted())[1].messages] == ["b"]
