"""A reply some send of which may have reached the chat is finished or handed to a person,
never withdrawn (issue 40, point 1). A reply partly on the platform (a part sent, the next
refused before it left) or sent with an unknown outcome (a generic send whose answer was
lost) stays the bot's even when the seller writes meanwhile: withdrawing it would leave
the buyer half an answer, or a reply nobody accounts for, and tell no one. One rule says
whether a send may have happened (chatq_delivery_may_have_sent, rendered from
shared/state/job.py), and every step that may withdraw a job asks it."""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any

import asyncpg
import pytest

from services.responder.parts import split_reply
from shared.settings import Settings
from shared.state.job import lock_key
from tests.conftest import AVITO_SECRET, replace
from tests.fakes.world import FakeWorld
from tests.integration.test_before_send_batch import job_in_flight
from tests.integration.test_claim_batch import T0
from tests.support.broker import wait_for
from tests.support.payloads import avito_webhook
from tests.support.pipeline import Pipeline
from tests.support.receiver import running_receiver
from tests.support.services import running_coalescers, running_responders

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("clean")]

#: What the job's delivery row says before the seller writes: (status, maybe_sent), None for
#: no row (nothing tried yet), and whether a send of the job may have reached the chat.
DELIVERIES: dict[str, tuple[tuple[str, bool] | None, bool]] = {
    "nothing tried": (None, False),
    "surely not sent": (("not_sent", False), False),
    "intent recorded": (("sending", False), True),
    "outcome unknown": (("unknown", False), True),
    "a part sent, the next refused before it left": (("not_sent", True), True),
}


async def seeded(
    conn: asyncpg.Connection, delivery: tuple[str, bool] | None, job_status: str
) -> tuple[Any, str]:
    """A job of one message in its own chat (generic: the platform whose unknown outcomes
    are re-sent under their key), holding it, with ``delivery``."""
    job, key = await job_in_flight(
        conn, f"c-{uuid.uuid4().hex[:8]}", seller_wrote=False, platform="generic", status=job_status
    )
    await conn.execute(
        "INSERT INTO reply_coverage (operation_id, job_id) SELECT unnest(operation_ids), id FROM reply_jobs"
        " WHERE id = $1",
        job,
    )
    if delivery is not None:
        status, maybe = delivery
        await conn.execute(
            """
            INSERT INTO deliveries (job_id, status, text, attempt, started_at, maybe_sent, maybe_since)
            VALUES ($1, $2, 'the reply', 1, $3, $4, CASE WHEN $4 THEN $3::timestamptz END)
            """,
            job, status, T0 + timedelta(seconds=1), maybe,
        )  # fmt: skip
    return job, key


async def seller_writes(conn: asyncpg.Connection, key: str) -> None:
    chat = key.split(":", 2)[2]
    await conn.fetchval("SELECT chatq_seller_wrote('generic', 'acc', $1, 's-1', now(), 0)", chat)


async def withdrawn_by(conn: asyncpg.Connection, path: str, job: Any, key: str) -> bool:
    """Whether ``path`` withdrew the job: superseded, "answered by the seller"."""
    if path == "the seller's message":
        await seller_writes(conn, key)
    else:
        await seller_writes(conn, key)
        if path == "chatq_claim_job":
            await conn.fetchrow("SELECT * FROM chatq_claim_job($1, 1, $2, 0)", job, lock_key(job))
        elif path == "chatq_claim_jobs":
            await conn.fetch("SELECT * FROM chatq_claim_jobs($1, '{1}', $2, 0)", [job], [lock_key(job)])
        elif path == "chatq_before_send":
            await conn.fetch(
                "SELECT * FROM chatq_before_send($1, $2, 'the reply', 2, false, 4, 4000)", job, key
            )
        elif path == "chatq_before_send_many":
            await conn.fetch(
                "SELECT * FROM chatq_before_send_many($1, $2, '{the reply}', '{2}', '{false}', 4, 4000)",
                [job],
                [key],
            )
        else:
            raise AssertionError(path)
    return await conn.fetchval("SELECT status = 'superseded' FROM reply_jobs WHERE id = $1", job)


@pytest.mark.parametrize("situation", list(DELIVERIES))
@pytest.mark.parametrize(
    "path",
    [
        "the seller's message",
        "chatq_claim_job",
        "chatq_claim_jobs",
        "chatq_before_send",
        "chatq_before_send_many",
    ],
)
async def test_every_step_that_may_withdraw_a_job_withdraws_it_only_when_no_send_of_it_may_have_reached_the_chat(
    pool: asyncpg.Pool, path: str, situation: str
) -> None:
    delivery, may_have_sent = DELIVERIES[situation]
    # The seller's message withdraws pending jobs; the claim takes a pending job; the step
    # before sending runs on a job a responder holds.
    job_status = "processing" if path.startswith("chatq_before_send") else "pending"
    async with pool.acquire() as conn, conn.transaction():
        job, key = await seeded(conn, delivery, job_status)
        withdrawn = await withdrawn_by(conn, path, job, key)
        await conn.execute("SELECT pg_advisory_unlock_all()")
        assert withdrawn is not may_have_sent, f"{path} {'withdrew' if withdrawn else 'kept'} the job"
        if may_have_sent and path.startswith("chatq_before_send"):
            # The attempt goes on, its intent recorded, never forgetting that an earlier
            # one may have sent.
            row = await conn.fetchrow("SELECT status, maybe_sent FROM deliveries WHERE job_id = $1", job)
            assert (row["status"], row["maybe_sent"]) == ("sending", True)


LONG = " ".join(f"Sentence {n} says one more thing about the listing." for n in range(50))  # ~2,500 chars
SELLER = 777  # the Avito account's own id: the author of the seller's messages


@pytest.fixture
def model(fast: Settings, world: FakeWorld) -> Settings:
    world.llm_answer = LONG
    return replace(fast, llm_base_url=f"{world.url}/v1", llm_timeout_seconds=5)


async def test_a_reply_half_sent_when_the_seller_writes_is_finished_not_withdrawn(
    model: Settings, pool: asyncpg.Pool, world: FakeWorld
) -> None:
    """Part 1 of an Avito reply in parts is sent, part 2 is refused before it leaves (a 429),
    and the seller writes in person while the job waits: the next attempt sends the
    rest, once each, in order. (It withdrew the job: "answered by the seller", the rest
    never sent, the buyer left with half an answer, and no one told.)"""
    parts = split_reply(LONG, 1000)
    assert len(parts) == 3
    url = f"/v1/webhooks/avito/{AVITO_SECRET}"
    world.fail("avito.send", "slow:0", "429:2")  # the fake takes Avito faults by target
    async with running_receiver(model) as (_, client), running_coalescers(model), running_responders(model):
        p = Pipeline(client, pool)
        r = await client.post(url, json=avito_webhook("b-1", chat_id="half", text="Tell me everything"))
        assert r.status_code == 200, r.text
        buyer = r.json()["operation_id"]
        await wait_for(
            lambda: pool.fetchval(
                "SELECT count(*) = 1 FROM delivery_parts WHERE part = 2 AND status = 'not_sent'"
            ),
            what="part 2 refused",
        )
        r = await client.post(
            url, json=avito_webhook("s-1", chat_id="half", author_id=SELLER, text="I will answer this myself")
        )
        assert r.status_code == 200, r.text
        doc = await p.settled(buyer, within=30)
    assert [m["text"] for m in world.avito if m["chat_id"] == "half"] == parts
    assert doc["status"] == "replied"
    assert doc["status_text"].startswith("reply sent"), doc["status_text"]
    assert await pool.fetchval("SELECT status FROM reply_jobs") == "sent"
