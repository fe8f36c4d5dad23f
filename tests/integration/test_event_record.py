"""The event record (issue 18): every operation keeps an append-only log of what happened,
who decided and when, written in the transaction of the change it records, and the
seller's numbers are counted from it by event time."""

from __future__ import annotations

import uuid
from datetime import datetime

import asyncpg
import pytest

from tests.fakes.world import FakeWorld
from tests.support.broker import wait_for
from tests.support.payloads import telegram_update
from tests.support.pipeline import ADMIN, TG, Pipeline

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("clean")]


def kinds(doc: dict) -> list[str]:
    return [e["kind"] for e in doc["timeline"]]


def at(event: dict) -> datetime:
    return datetime.fromisoformat(event["at"])


async def stats(pipeline: Pipeline) -> dict:
    r = await pipeline.client.get("/v1/stats", headers=ADMIN)
    assert r.status_code == 200
    return r.json()


async def test_a_retried_then_resolved_operation_keeps_both_attempts_and_says_who_decided_what(
    pipeline: Pipeline, world: FakeWorld
) -> None:
    world.fail("telegram.send:61", "400", "400")
    op = await pipeline.telegram(6101, 61, "Do you ship to Kazan?")
    first = await pipeline.settled(op)
    assert first["status"] == "failed"

    r = await pipeline.client.post(
        f"/v1/operations/{op}/retry", headers=ADMIN, json={"by": "anna", "note": "chat is back"}
    )
    assert r.status_code == 202, r.text

    async def failed_again() -> dict | None:
        doc = await pipeline.status(op)
        return doc if doc["status"] == "failed" and kinds(doc).count("failed") == 2 else None

    second = await wait_for(failed_again, within=20, what="the retry to fail too")
    r = await pipeline.client.post(
        f"/v1/operations/{op}/resolve",
        headers=ADMIN,
        json={"resolution": "dismissed", "owner": "bob", "note": "the buyer called instead"},
    )
    assert r.status_code == 200, r.text
    doc = await pipeline.status(op)

    assert kinds(doc) == [
        "received", "filed", "emitted", "attempt", "failed",
        "retried", "filed", "emitted", "attempt", "failed",
        "resolved",
    ]  # fmt: skip
    record = doc["timeline"]
    # What was written stays as written: the first failure keeps its time and its job.
    assert record[: len(first["timeline"])] == first["timeline"]
    assert record[: len(second["timeline"])] == second["timeline"]
    assert record[4]["job_id"] == first["job"]["id"] != record[9]["job_id"] == second["job"]["id"]
    assert "HTTP 400" in record[4]["event"] and record[4]["by"] is None
    assert record[4]["for"] == "on-call"  # the service gave up; the person it is handed to
    assert record[5]["by"] == "anna" and record[5]["event"] == "retried by anna: chat is back"
    assert record[10]["by"] == "bob"
    assert record[10]["event"] == "dismissed by bob: the buyer called instead"
    assert [at(e) for e in record] == sorted(at(e) for e in record)
    assert at(record[4]) < at(record[5]) < at(record[9]) < at(record[10])
    # A dismissed message reads as a person's decision, not as one never meant for the bot.
    assert doc["status"] == "ignored"
    assert doc["status_text"] == "dismissed by bob: the buyer called instead"


async def test_an_attempt_that_is_retried_records_its_error_class_and_the_retry_tier(
    pipeline: Pipeline, world: FakeWorld
) -> None:
    world.fail("telegram.send:62", "429:1")
    op = await pipeline.telegram(6201, 62, "Is it still available?")
    doc = await pipeline.settled(op)
    assert doc["status"] == "replied"
    assert kinds(doc) == [
        "received", "filed", "emitted", "attempt", "attempt_failed", "retry_scheduled", "attempt", "replied",
    ]  # fmt: skip
    failed, scheduled = doc["timeline"][4], doc["timeline"][5]
    assert failed["event"].startswith("attempt 1 did not send (transient): telegram: rate limited")
    assert scheduled["event"].startswith("next: attempt 2 after the ")
    assert doc["timeline"][6]["event"] == "attempt 2: writing the reply"
    assert len(world.replies_to("62")) == 1
    day = (await stats(pipeline))["last_24h"]
    assert (day["automatic_retries"], day["person_retries"], day["retries"]) == (1, 0, 1)


async def test_a_platform_delivering_the_same_update_again_is_recorded_on_the_one_operation(
    pipeline: Pipeline, world: FakeWorld
) -> None:
    update = telegram_update(6301, chat_id=63, text="Hello?")
    headers = TG
    first = await pipeline.client.post("/v1/webhooks/telegram", json=update, headers=headers)
    again = await pipeline.client.post("/v1/webhooks/telegram", json=update, headers=headers)
    assert first.json()["operation_id"] == again.json()["operation_id"]
    doc = await pipeline.settled(first.json()["operation_id"])
    assert kinds(doc).count("received") == 1
    assert kinds(doc).count("duplicate") == 1
    assert (await stats(pipeline))["last_24h"]["duplicates"] == 1


async def test_the_day_numbers_count_events_when_they_happened_so_a_resolve_does_not_hide_a_failure(
    pipeline: Pipeline, world: FakeWorld
) -> None:
    world.fail("telegram.send:64", "400")
    failed = await pipeline.telegram(6401, 64, "Price?")
    replied = await pipeline.telegram(6402, 65, "Colour?")
    assert (await pipeline.settled(failed))["status"] == "failed"
    assert (await pipeline.settled(replied))["status"] == "replied"
    # A message not for the bot (a sticker) is stored, and is not "received" for it.
    group = telegram_update(6403, chat_id=66, text=None)
    r = await pipeline.client.post("/v1/webhooks/telegram", json=group, headers=TG)
    assert (await pipeline.settled(r.json()["operation_id"]))["status"] == "ignored"

    before = await stats(pipeline)
    day = before["last_24h"]
    assert (day["received"], day["ignored"], day["replied"], day["failed"]) == (2, 1, 1, 1)
    assert day["failed_share"] == 0.5
    assert before["backlog"]["failed"]["count"] == 1

    r = await pipeline.client.post(
        f"/v1/operations/{failed}/resolve",
        headers=ADMIN,
        json={"resolution": "replied_manually", "owner": "anna"},
    )
    assert r.status_code == 200
    after = await stats(pipeline)
    # The failure happened today whatever a person did about it later; the backlog moved.
    assert after["last_24h"]["failed"] == 1 and after["last_24h"]["failed_share"] == 0.5
    assert after["last_24h"]["resolved"] == 1 and after["last_24h"]["received"] == 2
    assert after["backlog"]["failed"]["count"] == 0


async def test_the_record_is_append_only_and_knows_only_the_documented_kinds(
    pipeline: Pipeline, pool: asyncpg.Pool
) -> None:
    op = uuid.UUID(await pipeline.telegram(6501, 67, "Hi"))
    await pipeline.settled(str(op))
    with pytest.raises(asyncpg.IntegrityConstraintViolationError, match="append-only"):
        await pool.execute("UPDATE operation_events SET detail = 'rewritten' WHERE operation_id = $1", op)
    with pytest.raises(asyncpg.CheckViolationError):
        await pool.execute("SELECT chatq_log(ARRAY[$1]::uuid[], 'made_up', 'x')", op)
