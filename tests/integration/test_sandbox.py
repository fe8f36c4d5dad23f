"""The built-in sandbox chat: a person types as a buyer and sees one coalesced answer."""

from __future__ import annotations

import pytest

from tests.conftest import replace
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
