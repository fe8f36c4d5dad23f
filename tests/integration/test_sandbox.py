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
        running_receiver(sandbox, host="localhost") as (_, client),
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
    async with running_receiver(replace(sandbox, relay_enabled=False), host="localhost") as (_, client):
        r = await client.post("/v1/sandbox/messages", json={"chat_id": "has space", "text": "x"})
        assert r.status_code == 422
    off = replace(sandbox, relay_enabled=False, sandbox_enabled=False)
    async with running_receiver(off, host="localhost") as (_, client):
        assert (await client.get("/sandbox")).status_code == 404
        r = await client.post("/v1/sandbox/messages", json={"chat_id": "s", "text": "x"})
        assert r.json()["error"]["code"] == "sandbox_disabled"


async def test_the_sandbox_chat_shows_each_message_in_the_status_a_person_reads_queued_and_replying(
    sandbox, pool: asyncpg.Pool
) -> None:
    """'queued' and 'replying' are read, not written (chatq_shown_status): the sandbox
    chat shows what the status API shows, not the stored 'accepted' and 'waiting'."""
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    async with running_receiver(sandbox, host="localhost") as (_, client):
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


@pytest.mark.parametrize(
    "content_type",
    ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None],
)
async def test_the_sandbox_takes_json_only_and_a_form_a_foreign_page_could_post_is_refused_with_415(
    sandbox, pool: asyncpg.Pool, content_type: str | None
) -> None:
    """A page on another site can post text/plain or a form to 127.0.0.1 without a CORS
    preflight; application/json it cannot."""
    headers = {"content-type": content_type} if content_type else {}
    async with running_receiver(replace(sandbox, relay_enabled=False), host="localhost") as (_, client):
        r = await client.post(
            "/v1/sandbox/messages", content=b'{"chat_id": "s1", "text": "Hi"}', headers=headers
        )
        assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"
        ok = await client.post("/v1/sandbox/messages", json={"chat_id": "s1", "text": "Hi"})
        assert ok.status_code == 202
    assert await pool.fetchval("SELECT count(*) FROM operations") == 1


@pytest.mark.parametrize("host", ["attacker.example", "receiver", "10.0.0.5:8080", "127.0.0.1.nip.io", ""])
async def test_the_sandbox_refuses_a_request_addressed_to_any_name_but_this_machines(
    sandbox, pool: asyncpg.Pool, host: str
) -> None:
    """DNS rebinding: a page on attacker.example re-points its name at 127.0.0.1 and its
    script reaches the sandbox with Host: attacker.example; it is refused before anything
    is read or stored."""
    async with running_receiver(replace(sandbox, relay_enabled=False), host="localhost") as (_, client):
        for method, path, body in [
            ("GET", "/sandbox", None),
            ("POST", "/v1/sandbox/messages", {"chat_id": "s1", "text": "Hi"}),
            ("GET", "/v1/sandbox/chats/s1/messages", None),
        ]:
            r = await client.request(method, path, json=body, headers={"host": host})
            assert r.status_code == 403, (method, path, r.text)
            assert r.json()["error"]["code"] == "sandbox_host_refused"
        for loopback in ["localhost", "localhost:8080", "127.0.0.1:8080", "[::1]:8080", "chat.localhost"]:
            r = await client.get("/v1/sandbox/chats/s1/messages", headers={"host": loopback})
            assert r.status_code == 200, loopback
    assert await pool.fetchval("SELECT count(*) FROM operations") == 0
