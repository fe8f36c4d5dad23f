"""A second Avito account added with ``chatq accounts`` against real services, connected
with ``chatq connect --account``, and its first buyer message answered with its own
credentials. The transcript is written to .pytest_cache/chatq-accounts-transcript.txt."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from cryptography.fernet import Fernet

from tests.conftest import ADMIN_TOKEN, replace
from tests.fakes.world import FakeWorld
from tests.support.broker import wait_for
from tests.support.payloads import avito_webhook
from tests.support.pipeline import ADMIN, pipeline_settings
from tests.support.processes import ROOT, Receiver, Worker, run_chatq

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("clean")]

TRANSCRIPT = ROOT / ".pytest_cache" / "chatq-accounts-transcript.txt"
SHOP2_SECRET = "shop2-path-secret-0123456789"


@pytest.fixture
async def stack(settings, world: FakeWorld) -> AsyncIterator[Receiver]:
    s = replace(
        pipeline_settings(settings, world),
        secrets_key=Fernet.generate_key().decode(),
        public_url="https://chat.example.com",
    )
    receiver = await Receiver(s).start()
    workers = [await Worker("coalescer", s).start(), await Worker("responder", s).start()]
    try:
        yield receiver
    finally:
        for p in (*workers, receiver):
            await p.stop()


async def chatq(receiver: Receiver, transcript: list[str], *args: str) -> str:
    done = await run_chatq(receiver, *args, token=ADMIN_TOKEN)
    transcript += [f"$ chatq {' '.join(args)}", done.stdout.rstrip(), done.stderr.rstrip()]
    assert done.returncode == 0, done.stderr
    return done.stdout


async def test_chatq_adds_a_second_avito_account_connects_it_and_its_first_message_is_answered(
    stack: Receiver, world: FakeWorld, tmp_path: Path
) -> None:
    secret_file = tmp_path / "client-secret"
    secret_file.write_text("client-2-secret-value\n")
    world.avito_accounts = {"777": "client-1", "888": "client-2"}
    t: list[str] = []
    added = await chatq(
        stack,
        t,
        "accounts",
        "add",
        "avito:888",
        "--name",
        "Second shop",
        "--client-id",
        "client-2",
        "--client-secret",
        f"@{secret_file}",
        "--webhook-secret",
        SHOP2_SECRET,
        "--reply-delay",
        "0,0",
    )
    assert "added avito:888" in added and "client-2-secret-value" not in added
    listed = await chatq(stack, t, "accounts", "list")
    assert "avito:888" in listed and "Second shop" in listed
    connected = await chatq(stack, t, "connect", "avito", "--account", "888")
    assert "subscribed https://chat.example.com/v1/webhooks/avito/***" in connected
    assert world.avito_subscriptions == [f"https://chat.example.com/v1/webhooks/avito/{SHOP2_SECRET}"]
    async with httpx.AsyncClient(base_url=stack.url, timeout=10) as client:
        r = await client.post(
            world.avito_subscriptions[0].removeprefix("https://chat.example.com"),
            json=avito_webhook("first-1", user_id=888, chat_id="u2i-888", text="Is it still available?"),
        )
        op = r.json()["operation_id"]
        t.append(f"(buyer -> account 888) Is it still available?  => operation {op}")

        async def replied() -> bool:
            doc = (await client.get(f"/v1/operations/{op}", headers=ADMIN)).json()
            return doc["status"] == "replied"

        await wait_for(replied, within=30, what="the first message of account 888 answered")
    status = await chatq(stack, t, "status", op)
    assert "status     replied" in status
    await chatq(stack, t, "accounts", "show", "avito:888")
    stats = await chatq(stack, t, "stats", "--account", "avito:888")
    assert "account avito:888" in stats
    assert [(m["user_id"], m["chat_id"]) for m in world.avito] == [("888", "u2i-888")]
    TRANSCRIPT.write_text("\n".join(line for line in t if line) + "\n")
