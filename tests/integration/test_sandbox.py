"""The built-in sandbox chat: a person types as a buyer and sees one coalesced answer."""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable

import asyncpg
import pytest

from tests.conftest import ADMIN_TOKEN, replace
from tests.support.broker import wait_for
from tests.support.receiver import running_receiver
from tests.support.services import running_coalescers, running_responders

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("clean")]


@pytest.fixture
def sandbox(settings):
    return replace(
        settings,
        quiet_seconds=0.5,
        reply_delay_min_seconds=1,
        reply_delay_max_seconds=1,
        max_wait_seconds=4,
        coalescer_poll_seconds=0.1,
        relay_poll_seconds=0.1,
        metrics_port=0,
    )


async def test_a_burst_typed_in_the_sandbox_gets_one_answer_through_the_real_pipeline(sandbox) -> None:
    async with (
        running_receiver(sandbox) as (_, client),
        running_coalescers(sandbox),
        running_responders(sandbox),
    ):
        page = await client.get("/sandbox")
        assert page.status_code == 200 and "chatqueue sandbox" in page.text
        for text in ("Hi", "Is it still available?", "Do you deliver?"):
            r = await client.post("/v1/sandbox/messages", json={"chat_id": "s1", "text": text})
            assert r.status_code == 202

        async def answered() -> list[dict]:
            msgs = (await client.get("/v1/sandbox/chats/s1/messages")).json()["messages"]
            return (
                msgs
                if any(m["from"] == "bot" for m in msgs)
                and all(m["status"] == "replied" for m in msgs if m["from"] == "buyer")
                else []
            )

        messages = await wait_for(answered, within=20, what="the bot's answer in the sandbox chat")
    assert [m["from"] for m in messages] == ["buyer", "buyer", "buyer", "bot"]
    assert (
        messages[-1]["text"]
        == "Hello! Yes, it is available. We ship across the country; delivery takes 2-5 days."
    )


async def test_bad_sandbox_input_is_refused_and_the_sandbox_is_off_in_production(sandbox) -> None:
    async with running_receiver(replace(sandbox, relay_enabled=False)) as (_, client):
        r = await client.post("/v1/sandbox/messages", json={"chat_id": "has space", "text": "x"})
        assert r.status_code == 422
    off = replace(sandbox, relay_enabled=False, sandbox_enabled=False)
    async with running_receiver(off) as (_, client):
        assert (await client.get("/sandbox")).status_code == 404
        r = await client.post("/v1/sandbox/messages", json={"chat_id": "s", "text": "x"})
        assert r.json()["error"]["code"] == "sandbox_disabled"


async def test_the_sandbox_chat_shows_each_message_in_the_status_a_person_reads_queued_and_replying(
    sandbox, pool: asyncpg.Pool
) -> None:
    """'queued' and 'replying' are read, not written (chatq_shown_status): the sandbox
    chat shows what the status API shows, not the stored 'accepted' and 'waiting'."""
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    async with running_receiver(sandbox) as (_, client):
        r = await client.post("/v1/sandbox/messages", json={"chat_id": "s2", "text": "Hi"})
        op = r.json()["operation_id"]

        async def shown() -> str:
            return (await client.get(f"/v1/operations/{op}", headers=admin)).json()["status"]

        async def in_chat() -> str:
            (m,) = (await client.get("/v1/sandbox/chats/s2/messages")).json()["messages"]
            return str(m["status"])

        await wait_for(lambda: _is(shown, "queued"), within=10, what="the relay to publish the message")
        assert await in_chat() == "queued"

        # Filed, then taken by a reply's claim (its reply_coverage row; the row stays 'waiting').
        window, job = uuid.uuid4(), uuid.uuid4()
        async with pool.acquire() as conn, conn.transaction():
            await conn.execute("UPDATE operations SET status = 'waiting' WHERE id = $1", uuid.UUID(op))
            await conn.execute(
                """
                INSERT INTO chat_windows (id, chat_key, platform, account_id, chat_id, status, first_at,
                                          last_at, deadline_at, due_at, delay_seconds, message_count,
                                          closed_at, job_id)
                VALUES ($1, 'sandbox:sandbox:s2', 'sandbox', 'sandbox', 's2', 'closed', now(), now(), now(),
                        now(), 0, 1, now(), $2)
                """,
                window,
                job,
            )
            await conn.execute(
                """
                INSERT INTO reply_jobs (id, window_id, chat_key, platform, account_id, chat_id, status,
                                        operation_ids)
                VALUES ($1, $2, 'sandbox:sandbox:s2', 'sandbox', 'sandbox', 's2', 'processing', ARRAY[$3::uuid])
                """,
                job,
                window,
                uuid.UUID(op),
            )
            await conn.execute(
                "INSERT INTO reply_coverage (operation_id, job_id) VALUES ($1, $2)", uuid.UUID(op), job
            )
        assert await shown() == "replying"
        assert await in_chat() == "replying"


async def _is(read: Callable[[], Awaitable[str]], status: str) -> bool:
    return await read() == status
