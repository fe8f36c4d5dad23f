"""The whole pipeline with the Avito poller driven by the test, and the Avito account the
tests' webhooks come from."""

from __future__ import annotations

from dataclasses import dataclass

from services.receiver.app import Runtime
from tests.conftest import AVITO_SECRET
from tests.fakes.world import FakeWorld
from tests.support.pipeline import ADMIN, Pipeline

#: The environment's Avito account (its user_id), and the environment's webhook path.
ME = "777"
URL = f"/v1/webhooks/avito/{AVITO_SECRET}"


@dataclass
class Stack:
    p: Pipeline
    runtime: Runtime

    async def poll(self) -> int:
        assert self.runtime.recovery is not None
        return await self.runtime.recovery.poll()

    async def add(self, account: dict) -> None:
        r = await self.p.client.post("/v1/accounts", json=account, headers=ADMIN)
        assert r.status_code == 200, r.text


async def known_account(s: Stack, world: FakeWorld) -> None:
    """The account speaks once through a webhook, and is answered: the inbox knows it."""
    hook = world.avito_buyer_writes(ME, "u2i-known", "Is it still available?")
    r = await s.p.client.post(URL, json=hook)
    assert r.status_code == 200, r.text
    assert (await s.p.settled(r.json()["operation_id"]))["status"] == "replied"
