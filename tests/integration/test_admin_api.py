"""The admin API a person uses: lists, retry, resolve and the seller's numbers."""

from __future__ import annotations

import asyncpg
import pytest

from shared.metrics import RETRIES
from tests.conftest import ADMIN_TOKEN, AVITO_SECRET, TELEGRAM_SECRET, replace
from tests.fakes.world import FakeWorld
from tests.support.broker import wait_for
from tests.support.payloads import avito_webhook, telegram_update
from tests.support.pipeline import pipeline_settings
from tests.support.receiver import running_receiver
from tests.support.services import running_coalescers, running_responders

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("clean")]

TG = {"X-Telegram-Bot-Api-Secret-Token": TELEGRAM_SECRET}
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


@pytest.fixture
async def api(settings, world: FakeWorld):
    s = pipeline_settings(settings, world)
    async with running_receiver(s) as (_, client), running_coalescers(s), running_responders(s):
        yield client


async def post(api, n: int, chat: int, text: str = "Do you deliver?") -> str:
    r = await api.post("/v1/webhooks/telegram", json=telegram_update(n, chat_id=chat, text=text), headers=TG)
    return r.json()["operation_id"]


async def settled(api, op: str, *statuses: str) -> dict:
    async def check() -> dict | None:
        doc = (await api.get(f"/v1/operations/{op}", headers=ADMIN)).json()
        return doc if doc["status"] in statuses else None

    return await wait_for(check, within=20, what=f"{op} to be {statuses}")  # type: ignore[return-value]


async def test_a_failed_operation_is_retried_through_the_outbox_and_replied_once(
    api, world: FakeWorld
) -> None:
    world.fail("telegram.send", "400")
    op = await post(api, 1, 71)
    failed = await settled(api, op, "failed")
    assert "HTTP 400" in failed["status_text"]
    person_retries = RETRIES.labels(reason="person")._value.get()
    r = await api.post(f"/v1/operations/{op}/retry", headers=ADMIN)
    assert r.status_code == 202
    # One of the day's Retries, beside the automatic ones, for the dashboard and alerts.
    assert RETRIES.labels(reason="person")._value.get() == person_retries + 1
    assert r.json()["retried"] == [op]
    doc = await settled(api, op, "replied")
    assert doc["retries"] == 1
    assert doc["job"]["id"] != failed["job"]["id"]
    assert len(world.replies_to("71")) == 1
    # The record keeps the first attempt and says who retried it.
    record = doc["timeline"]
    assert [e["kind"] for e in record] == [
        "received", "filed", "emitted", "attempt", "failed", "retried", "filed", "emitted", "attempt", "replied",
    ]  # fmt: skip
    assert record[4]["job_id"] == failed["job"]["id"] and "HTTP 400" in record[4]["event"]
    assert record[5]["by"] == "admin" and record[9]["job_id"] == doc["job"]["id"]


async def test_a_replied_operation_cannot_be_retried_so_a_retry_never_makes_a_second_reply(
    api, world
) -> None:
    op = await post(api, 2, 72)
    await settled(api, op, "replied")
    r = await api.post(f"/v1/operations/{op}/retry", headers=ADMIN)
    assert r.status_code == 409
    assert r.json()["error"]["code"] == "not_retryable"
    assert len(world.replies_to("72")) == 1


async def test_resolving_records_who_and_why_and_replied_manually_feeds_the_answered_guard(
    api, world: FakeWorld, pool: asyncpg.Pool
) -> None:
    world.fail("telegram.send", "lost", "lost")
    a = await post(api, 3, 73)
    b = await post(api, 4, 74)
    await settled(api, a, "needs_review")
    await settled(api, b, "needs_review")
    r = await api.post(
        f"/v1/operations/{a}/resolve",
        headers=ADMIN,
        json={"resolution": "replied_manually", "owner": "anna", "note": "checked"},
    )
    assert r.status_code == 200
    doc = await settled(api, a, "replied")
    assert doc["resolution"]["by"] == "anna"
    assert doc["status_text"] == "replied manually by anna: checked"
    assert await pool.fetchval("SELECT count(*) FROM chats WHERE chat_key = 'telegram:4242:73'") == 1
    r = await api.post(
        f"/v1/operations/{b}/resolve", headers=ADMIN, json={"resolution": "dismissed", "owner": "anna"}
    )
    assert (await settled(api, b, "ignored"))["status_text"] == "dismissed by anna"
    again = await api.post(
        f"/v1/operations/{b}/resolve", headers=ADMIN, json={"resolution": "dismissed", "owner": "x"}
    )
    assert again.status_code == 409
    bad = await api.post(
        f"/v1/operations/{b}/resolve", headers=ADMIN, json={"resolution": "whatever", "owner": "x"}
    )
    assert bad.status_code == 422


async def test_an_avito_message_without_created_is_ordered_by_receipt_and_can_be_resolved_as_replied_manually(
    api, world: FakeWorld, pool: asyncpg.Pool
) -> None:
    # Avito's `created` is optional in its document: the platform time is then the
    # receipt time, so platform order and the answered marker have a time to go by.
    world.fail("avito.send", "400")
    payload = avito_webhook("no-created-1", chat_id="nc")
    del payload["payload"]["value"]["created"]
    r = await api.post(f"/v1/webhooks/avito/{AVITO_SECRET}", json=payload)
    assert r.status_code == 200, r.text
    op = r.json()["operation_id"]
    assert await pool.fetchval("SELECT sent_at = received_at FROM operations WHERE id = $1", op)
    await settled(api, op, "failed")
    r = await api.post(
        f"/v1/operations/{op}/resolve",
        headers=ADMIN,
        json={"resolution": "replied_manually", "owner": "anna", "note": "answered in the Avito app"},
    )
    assert r.status_code == 200, r.text
    assert (await settled(api, op, "replied"))[
        "status_text"
    ] == "replied manually by anna: answered in the Avito app"
    marker = await pool.fetchrow(
        "SELECT c.last_answered_message_id, c.last_answered_sent_at = o.sent_at AS same_time "
        "FROM chats c, operations o WHERE c.chat_key = 'avito:777:nc' AND o.id = $1",
        op,
    )
    assert marker is not None and marker["last_answered_message_id"] == "no-created-1" and marker["same_time"]


async def test_lists_filter_by_status_and_age_newest_first(api, world: FakeWorld) -> None:
    world.fail("telegram.send", "400")
    failed = await post(api, 5, 75)
    await settled(api, failed, "failed")
    replied = await post(api, 6, 76)
    await settled(api, replied, "replied")
    everything = (await api.get("/v1/operations", headers=ADMIN)).json()
    assert [o["id"] for o in everything["operations"]] == [replied, failed]
    only_failed = (await api.get("/v1/operations?status=failed,needs_review", headers=ADMIN)).json()
    assert [o["id"] for o in only_failed["operations"]] == [failed]
    assert (await api.get("/v1/operations?older_than=1h", headers=ADMIN)).json()["count"] == 0
    assert (await api.get("/v1/operations?status=nope", headers=ADMIN)).status_code == 400
    assert (await api.get("/v1/operations?older_than=soon", headers=ADMIN)).status_code == 400


async def test_the_needs_a_person_list_and_the_held_chats_show_only_the_chosen_accounts(
    api, world: FakeWorld
) -> None:
    # Two Avito accounts on the environment's path: each has a failed message, and the
    # second's seller answered a chat in person (held).
    world.fail("avito.send", "400", "400")
    url = f"/v1/webhooks/avito/{AVITO_SECRET}"
    failed = {}
    for user in (777, 999):
        r = await api.post(url, json=avito_webhook(f"f-{user}", user_id=user, chat_id=f"c{user}"))
        failed[user] = r.json()["operation_id"]
    for op in failed.values():
        await settled(api, op, "failed")
    seller = avito_webhook("s-999", user_id=999, author_id=999, chat_id="h999", text="I'll answer this one")
    assert (await api.post(url, json=seller)).status_code == 200

    async def listed(account: str | None) -> set[str]:
        params = {"status": "failed,needs_review", **({"account": account} if account else {})}
        r = await api.get("/v1/operations", params=params, headers=ADMIN)
        assert r.status_code == 200, r.text
        return {o["id"] for o in r.json()["operations"]}

    async def held(account: str | None) -> list[str]:
        r = await api.get(
            "/v1/chats", params={"held": "true", **({"account": account} if account else {})}, headers=ADMIN
        )
        assert r.status_code == 200, r.text
        return [c["chat"] for c in r.json()["chats"]]

    await wait_for(lambda: held(None), what="the held chat")
    assert await listed(None) == {failed[777], failed[999]}
    assert await listed("avito:777") == {failed[777]}
    assert await listed("avito:999") == {failed[999]}
    assert await listed("avito:99") == set()  # the beginning of another account's id is not it
    assert await listed("telegram:777") == set()
    assert await held(None) == ["avito:999:h999"]
    assert await held("avito:999") == ["avito:999:h999"]
    assert await held("avito:777") == [] and await held("avito:99") == []
    for bad in ("777", "fax:777", "avito:", "avito:7\x00"):
        for path in ("/v1/operations", "/v1/chats"):
            r = await api.get(path, params={"account": bad}, headers=ADMIN)
            assert r.status_code == 400 and r.json()["error"]["code"] == "bad_account", (path, bad)


async def test_stats_give_backlog_failed_share_retries_and_reply_time(api, world: FakeWorld) -> None:
    world.fail("telegram.send", "429:1", "400")
    first = await post(api, 7, 77)
    await settled(api, first, "failed")  # one retry, then a 400
    ok = await post(api, 8, 78)
    await settled(api, ok, "replied")
    stats = (await api.get("/v1/stats", headers=ADMIN)).json()
    day = stats["last_24h"]
    assert (day["received"], day["replied"], day["failed"]) == (2, 1, 1)
    assert day["failed_share"] == 0.5
    assert day["retries"] == 1
    assert day["receipt_to_reply_p50_seconds"] >= 0
    assert stats["backlog"]["failed"]["count"] == 1
    assert stats["backlog"]["waiting"]["count"] == 0
    metrics = (await api.get("/metrics/")).text
    assert 'chatq_retries_total{reason="telegram_transient"}' in metrics


async def test_during_a_rotation_both_the_new_and_the_previous_admin_token_work_and_no_other(
    settings,
) -> None:
    rotating = replace(
        settings, admin_token="new-admin-token-after-rotation", admin_token_previous=ADMIN_TOKEN
    )
    async with running_receiver(rotating) as (_, client):
        for token in ("new-admin-token-after-rotation", ADMIN_TOKEN):
            r = await client.get("/v1/stats", headers={"Authorization": f"Bearer {token}"})
            assert r.status_code == 200, token
        wrong = await client.get("/v1/stats", headers={"Authorization": "Bearer some-other-token-entirely"})
        assert wrong.status_code == 401
    # Rotation done: the previous token is unset and refused.
    async with running_receiver(replace(rotating, admin_token_previous=None)) as (_, client):
        r = await client.get("/v1/stats", headers=ADMIN)
        assert r.status_code == 401


async def test_the_admin_api_refuses_without_the_token(api) -> None:
    assert (await api.get("/v1/stats")).status_code == 401
    assert (await api.post("/v1/operations/00000000-0000-0000-0000-000000000000/retry")).status_code == 401


async def test_listing_accounts_of_a_platform_that_does_not_exist_is_a_4xx_not_a_server_error(api) -> None:
    # Found by the OpenAPI fuzzer: a NUL in the filter reached Postgres and answered 500.
    r = await api.get("/v1/accounts", params={"platform": "7\n\x00;"}, headers=ADMIN)
    assert r.status_code == 422
    assert (await api.get("/v1/accounts", params={"platform": "avito"}, headers=ADMIN)).status_code == 200


async def test_a_refused_retry_names_the_status_a_person_reads_not_the_one_stored(settings) -> None:
    """'queued' is read, not written (chatq_shown_status): a person who retries a message
    the status API shows 'queued' is told it is 'queued', not 'accepted'."""
    async with running_receiver(replace(settings, relay_poll_seconds=0.05)) as (_, client):
        op = await post(client, 9, 79)
        await settled(client, op, "queued")
        r = await client.post(f"/v1/operations/{op}/retry", headers=ADMIN)
    assert r.status_code == 409
    assert r.json()["error"]["message"].endswith("this one is queued")
