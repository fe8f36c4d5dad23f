"""Chat identity and time you can trust (issue 14): no two chats share a key, no
timestamp mutes a chat, same-second messages keep receipt order, one bad window never
stops the others, a folded message is never filed again, a repeated update_id never
drops a different message, and a window a job blocks is never scanned."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime, timedelta

import asyncpg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.coalescer.app import policy_from
from services.coalescer.service import Coalescer, job_id_for
from shared.messages import InboundMessage, JobCaps, chat_key
from stores.jobs.postgres import JobStore
from stores.jobs.protocol import Job
from tests.conftest import AVITO_SECRET, GENERIC_SECRET, replace
from tests.fakes.world import FakeWorld
from tests.support.payloads import avito_webhook, dumps, generic_message, signed, telegram_update
from tests.support.pipeline import TG, Pipeline

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("clean")]


async def generic(
    p: Pipeline, message_id: str, *, account: str, chat: str, text: str, sent_at: str | None = None
):
    body = generic_message(message_id, chat_id=chat, text=text)
    body["account_id"] = account
    if sent_at is not None:
        body["sent_at"] = sent_at
    raw = dumps(body)
    return await p.client.post(
        "/v1/webhooks/generic",
        content=raw,
        headers=signed(GENERIC_SECRET, raw, webhook_id=f"wh-{message_id}"),
    )


# ---- 1. two chats never share a key ---------------------------------------------------


def test_ids_holding_the_separator_give_different_keys_and_plain_ids_read_as_themselves() -> None:
    assert chat_key("generic", "shop:1", "42") != chat_key("generic", "shop", "1:42")
    assert chat_key("generic", "shop%3A1", "42") != chat_key("generic", "shop:1", "42")
    assert chat_key("telegram", "4242", "-100123") == "telegram:4242:-100123"


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(st.text(alphabet=":%ab3A2", max_size=8), st.text(alphabet=":%ab3A2", max_size=8))
def test_a_chat_key_gives_back_its_parts_so_no_two_chats_share_one(account: str, chat: str) -> None:
    _, a, c = chat_key("generic", account, chat).split(":")
    assert (_unescape(a), _unescape(c)) == (account, chat)


def _unescape(part: str) -> str:
    return part.replace("%3A", ":").replace("%25", "%")


async def test_the_sql_chat_key_function_agrees_with_python(pool: asyncpg.Pool) -> None:
    samples = [("shop:1", "42"), ("shop", "1:42"), ("100%", "a:%3A"), ("", ""), ("x", "y"), ("%25", "::")]
    for account, chat in samples:
        assert await pool.fetchval("SELECT chatq_chat_key('generic', $1, $2)", account, chat) == chat_key(
            "generic", account, chat
        )


async def test_chats_whose_ids_would_have_collided_get_one_reply_each_in_their_own_chat(
    pipeline: Pipeline, world: FakeWorld, pool: asyncpg.Pool
) -> None:
    a = await generic(pipeline, "m-a", account="shop:1", chat="42", text="Do you deliver?")
    b = await generic(pipeline, "m-b", account="shop", chat="1:42", text="What is the price?")
    docs = [await pipeline.settled(r.json()["operation_id"]) for r in (a, b)]
    assert [d["status"] for d in docs] == ["replied", "replied"]
    assert docs[0]["job"]["id"] != docs[1]["job"]["id"]
    replies = {(r["account_id"], r["chat_id"]): r["text"] for r in world.generic}
    assert replies == {
        ("shop:1", "42"): "Hello! We ship across the country; delivery takes 2-5 days.",
        ("shop", "1:42"): "Hello! The price in the listing is final.",
    }
    keys = {r["chat_key"] for r in await pool.fetch("SELECT chat_key FROM reply_jobs")}
    assert keys == {"generic:shop%3A1:42", "generic:shop:1%3A42"}


# ---- 2. a timestamp never mutes a chat -------------------------------------------------


async def test_a_message_stamped_in_the_future_does_not_mute_the_chats_next_message(
    pipeline: Pipeline, world: FakeWorld, pool: asyncpg.Pool
) -> None:
    ahead = (datetime.now(UTC) + timedelta(hours=1)).isoformat()
    first = await generic(pipeline, "f-1", account="shop", chat="time", text="Hello?", sent_at=ahead)
    assert (await pipeline.settled(first.json()["operation_id"]))["status"] == "replied"
    second = await generic(pipeline, "f-2", account="shop", chat="time", text="Do you deliver?")
    assert (await pipeline.settled(second.json()["operation_id"]))["status"] == "replied"
    assert len([r for r in world.generic if r["chat_id"] == "time"]) == 2
    # The stamp was not believed: the receipt time stands in, and the marker is not ahead.
    stored = await pool.fetchrow("SELECT sent_at, received_at FROM operations WHERE message_id = 'f-1'")
    assert stored["sent_at"] == stored["received_at"]
    assert await pool.fetchval("SELECT max(last_answered_sent_at) <= now() FROM chats")


async def test_a_sent_at_without_a_time_zone_is_refused_and_nothing_is_written(
    pipeline: Pipeline, pool: asyncpg.Pool
) -> None:
    r = await generic(pipeline, "tz-1", account="shop", chat="tz", text="Hi", sent_at="2026-11-30T12:00:00")
    assert r.status_code == 422
    assert "sent_at" in json.dumps(r.json())
    assert await pool.fetchval("SELECT count(*) FROM operations") == 0


async def test_the_stored_inbound_message_is_the_row_as_stored_on_postgres_clock(
    pipeline: Pipeline, pool: asyncpg.Pool
) -> None:
    r = await pipeline.client.post("/v1/webhooks/telegram", json=telegram_update(71, chat_id=71), headers=TG)
    op = uuid.UUID(r.json()["operation_id"])
    row = await pool.fetchrow("SELECT * FROM operations WHERE id = $1", op)
    body = await pool.fetchval("SELECT body FROM outbox WHERE operation_id = $1", op)
    message = InboundMessage.from_bytes(body)
    assert (message.operation_id, message.chat_id, message.message_id, message.text) == (
        op,
        "71",
        "71",
        "Hello",
    )
    assert (message.sent_at, message.received_at) == (row["sent_at"], row["received_at"])
    assert message.chat_key == chat_key("telegram", row["account_id"], "71")


# ---- 3. same-second messages: receipt order, and never "already answered" -------------


async def test_avito_messages_of_the_same_second_are_all_answered_whatever_their_ids(
    pipeline: Pipeline, world: FakeWorld
) -> None:
    # Avito's created is whole seconds and its ids are opaque: "z-first" is earlier than
    # "a-second" only by receipt.
    url = f"/v1/webhooks/avito/{AVITO_SECRET}"
    first = await pipeline.client.post(url, json=avito_webhook("z-first", chat_id="same-second"))
    assert (await pipeline.settled(first.json()["operation_id"]))["status"] == "replied"
    body = avito_webhook("a-second", chat_id="same-second", text="Do you deliver?")
    body["payload"]["value"]["created"] = avito_webhook("x")["payload"]["value"]["created"]
    second = await pipeline.client.post(url, json=body)
    assert (await pipeline.settled(second.json()["operation_id"]))["status"] == "replied"
    assert len(world.replies_to("same-second")) == 2


async def test_a_job_lists_same_second_messages_with_opaque_ids_in_receipt_order(pool: asyncpg.Pool) -> None:
    at = datetime.now(UTC).replace(microsecond=0)
    ops = []
    for n, mid in enumerate(("zz", "aa", "mm")):
        op = uuid.uuid4()
        await pool.execute(
            """
            INSERT INTO operations (id, platform, account_id, chat_id, message_id, text, sent_at, status,
                                    received_at, payload)
            VALUES ($1, 'avito', '777', 'c', $2, 'hi', $3::timestamptz, 'waiting',
                    $3::timestamptz + make_interval(secs => $4), '{}')
            """,
            op,
            mid,
            at,
            n,
        )
        ops.append(op)
    window, job_id = uuid.uuid4(), uuid.uuid4()
    await pool.execute(
        """
        INSERT INTO chat_windows (id, chat_key, platform, account_id, chat_id, status, first_at, last_at,
                                  deadline_at, due_at, delay_seconds, message_count, closed_at, job_id)
        VALUES ($1, 'avito:777:c', 'avito', '777', 'c', 'closed', now(), now(), now(), now(), 0, 3, now(), $2)
        """,
        window,
        job_id,
    )
    await pool.execute(
        """
        INSERT INTO reply_jobs (id, window_id, chat_key, platform, account_id, chat_id, status, operation_ids)
        VALUES ($1, $2, 'avito:777:c', 'avito', '777', 'c', 'pending', $3)
        """,
        job_id,
        window,
        list(reversed(ops)),
    )
    async with JobStore(pool).exclusive(job_id) as db:
        job = await db.claim(job_id, 1)
    assert isinstance(job, Job)
    assert [m.message_id for m in job.messages] == ["zz", "aa", "mm"]


# ---- 4. one bad window never stops the others ------------------------------------------


async def seed_window(pool: asyncpg.Pool, chat: str, *, messages: int = 1, due_ago: float = 1.0) -> uuid.UUID:
    window = uuid.uuid4()
    await pool.execute(
        """
        INSERT INTO chat_windows (id, chat_key, platform, account_id, chat_id, status, first_at, last_at,
                                  deadline_at, due_at, delay_seconds, message_count)
        VALUES ($1, $2, 'telegram', 'bot', $3, 'open', now() - interval '1 minute', now() - interval '1 minute',
                now(), now() - make_interval(secs => $4), 0, greatest($5, 1))
        """,
        window,
        chat_key("telegram", "bot", chat),
        chat,
        due_ago,
        messages,
    )
    for n in range(messages):
        op = uuid.uuid4()
        await pool.execute(
            """
            INSERT INTO operations (id, platform, account_id, chat_id, message_id, text, sent_at, status,
                                    received_at, payload)
            VALUES ($1, 'telegram', 'bot', $2, $3, $4, now() - interval '2 minutes', 'waiting',
                    now() - interval '2 minutes' + make_interval(secs => $5), '{}')
            """,
            op,
            chat,
            str(n + 1),
            f"message {n + 1}",
            n,
        )
        await pool.execute(
            "INSERT INTO window_messages (operation_id, window_id) VALUES ($1, $2)", op, window
        )
    return window


async def test_a_window_postgres_refuses_is_set_aside_alone_and_the_other_chats_get_their_jobs(
    settings, pool: asyncpg.Pool
) -> None:
    good = [await seed_window(pool, f"good-{i}") for i in range(3)]
    bad = await seed_window(pool, "bad")
    # Its job id is taken already (a constraint the window breaks when emitted).
    other = await seed_window(pool, "elsewhere")
    await pool.execute(
        "UPDATE chat_windows SET due_at = now() + interval '1 hour', deadline_at = now() + interval '2 hours' WHERE id = $1",
        other,
    )
    await pool.execute(
        """
        INSERT INTO reply_jobs (id, window_id, chat_key, platform, account_id, chat_id, status, operation_ids)
        SELECT $1, $2, 'x', 'telegram', 'bot', 'x', 'pending',
               ARRAY(SELECT operation_id FROM window_messages WHERE window_id = $2)
        """,
        job_id_for(bad),
        other,
    )
    coalescer = Coalescer(pool, policy_from(settings))

    assert await coalescer.emit_due() == 4
    emitted = {
        r["window_id"] for r in await pool.fetch("SELECT window_id FROM reply_jobs WHERE chat_key <> 'x'")
    }
    assert emitted == set(good)
    failed = await pool.fetchrow("SELECT status, status_reason, owner FROM operations WHERE chat_id = 'bad'")
    assert failed["status"] == "failed" and "could not be emitted" in failed["status_reason"]
    assert failed["owner"] == "on-call"
    assert await pool.fetchval("SELECT count(*) FROM chat_windows WHERE id = $1", bad) == 0


async def test_an_empty_due_window_closes_without_a_job_and_holds_nobody(
    settings, pool: asyncpg.Pool
) -> None:
    empty = await seed_window(pool, "empty", messages=0)
    fine = await seed_window(pool, "fine")
    coalescer = Coalescer(pool, policy_from(settings))
    assert await coalescer.emit_due() == 2
    assert await pool.fetchval("SELECT count(*) FROM chat_windows WHERE id = $1", empty) == 0
    assert [r["window_id"] for r in await pool.fetch("SELECT window_id FROM reply_jobs")] == [fine]


async def test_a_window_larger_than_one_job_carries_is_answered_in_parts_in_order(
    settings, pool: asyncpg.Pool
) -> None:
    await seed_window(pool, "big", messages=5)
    coalescer = Coalescer(pool, policy_from(settings), caps=JobCaps(messages=2, chars=10_000))
    parts: list[list[str]] = []
    for _ in range(3):
        assert await coalescer.emit_due() == 1
        job = await pool.fetchrow("SELECT id, operation_ids FROM reply_jobs WHERE status = 'pending'")
        parts.append(
            [
                r["message_id"]
                for r in await pool.fetch(
                    "SELECT message_id FROM operations WHERE id = ANY($1::uuid[]) ORDER BY message_id",
                    job["operation_ids"],
                )
            ]
        )
        # The rest waits behind the job in flight, and goes once it ends.
        assert await coalescer.emit_due() == 0
        await pool.execute("UPDATE reply_jobs SET status = 'processing' WHERE id = $1", job["id"])
        await pool.execute(
            "UPDATE reply_jobs SET status = 'sent', reply_text = 'r', sent_at = now() WHERE id = $1",
            job["id"],
        )
    assert parts == [["1", "2"], ["3", "4"], ["5"]]


# ---- 5. a message a reply took is never filed again ------------------------------------


async def test_a_message_redelivered_after_a_fold_is_a_duplicate_for_the_coalescer(
    settings, pool: asyncpg.Pool
) -> None:
    op = uuid.uuid4()
    now = datetime.now(UTC)
    await pool.execute(
        """
        INSERT INTO operations (id, platform, account_id, chat_id, message_id, text, sent_at, status, received_at, payload)
        VALUES ($1, 'telegram', 'bot', '5', '5', 'hi', $2, 'replying', $2, '{}')
        """,
        op,
        now,
    )
    inbound = InboundMessage(
        operation_id=op, platform="telegram", account_id="bot", chat_id="5", message_id="5", author_id=None,
        text="hi", sent_at=now, received_at=now,
    )  # fmt: skip
    assert await Coalescer(pool, policy_from(settings)).file(inbound) is None
    assert await pool.fetchval("SELECT count(*) FROM chat_windows") == 0


# ---- 6. a window a job blocks is skipped by index, and unblocked by the job's end -------


async def test_a_window_opened_behind_a_job_in_flight_is_blocked_until_the_job_ends(
    settings, pool: asyncpg.Pool
) -> None:
    coalescer = Coalescer(
        pool,
        policy_from(
            replace(
                settings,
                reply_delay_min_seconds=0,
                reply_delay_max_seconds=0,
                quiet_seconds=0,
                max_wait_seconds=0,
            )
        ),
    )
    first = await seed_window(pool, "busy")
    assert await coalescer.emit_due() == 1
    now = datetime.now(UTC)
    op = uuid.uuid4()
    await pool.execute(
        """
        INSERT INTO operations (id, platform, account_id, chat_id, message_id, text, sent_at, status, received_at, payload)
        VALUES ($1, 'telegram', 'bot', 'busy', '9', 'more?', $2, 'queued', $2, '{}')
        """,
        op,
        now,
    )
    inbound = InboundMessage(
        operation_id=op, platform="telegram", account_id="bot", chat_id="busy", message_id="9", author_id=None,
        text="more?", sent_at=now, received_at=now,
    )  # fmt: skip
    filed = await coalescer.file(inbound)
    assert filed is not None
    assert await pool.fetchval("SELECT blocked FROM chat_windows WHERE id = $1", filed.window_id) is True
    assert await coalescer.emit_due() == 0
    assert await coalescer.seconds_to_next_due() is None
    job = job_id_for(first)
    await pool.execute("UPDATE reply_jobs SET status = 'processing' WHERE id = $1", job)
    await pool.execute(
        "UPDATE reply_jobs SET status = 'sent', reply_text = 'r', sent_at = now() WHERE id = $1", job
    )
    assert await pool.fetchval("SELECT blocked FROM chat_windows WHERE id = $1", filed.window_id) is False
    assert await coalescer.emit_due() == 1


# ---- 7. bad input is a 4xx, never a 500 -------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("telegram", '{"update_id": 1' + "9" * 5000 + "}"),
        (
            "telegram",
            '{"update_id": 1, "message": {"message_id": 1, "date": 1, "text": "hi", "chat": {"id": 1'
            + "0" * 4200
            + ', "type": "private"}}}',
        ),
        ("avito", json.dumps(avito_webhook("m", chat_id="c" * 20_000))),
    ],
    ids=[
        "an integer of 5,000 digits",
        "a Telegram chat.id of 4,201 digits",
        "an Avito chat_id of 20,000 characters",
    ],
)
async def test_ids_no_platform_has_are_a_4xx_and_write_nothing(
    pipeline: Pipeline, pool: asyncpg.Pool, path: str, body: str
) -> None:
    headers = (
        TG | {"content-type": "application/json"}
        if path == "telegram"
        else {"content-type": "application/json"}
    )
    url = "/v1/webhooks/telegram" if path == "telegram" else f"/v1/webhooks/avito/{AVITO_SECRET}"
    r = await pipeline.client.post(url, content=body.encode(), headers=headers)
    assert r.status_code == 422, r.text
    assert r.json()["error"]["code"] == "invalid_payload"
    assert await pool.fetchval("SELECT count(*) FROM operations") == 0


# ---- 8. a repeated update_id never drops a different message ----------------------------


async def test_a_telegram_update_id_used_again_for_another_message_is_a_new_message(
    pipeline: Pipeline, world: FakeWorld
) -> None:
    first = await pipeline.client.post(
        "/v1/webhooks/telegram",
        json=telegram_update(500, chat_id=81, message_id=1, text="Hello?"),
        headers=TG,
    )
    # A week later, Telegram hands out update_id 500 again, for another message.
    second = await pipeline.client.post(
        "/v1/webhooks/telegram",
        json=telegram_update(500, chat_id=82, message_id=7, text="Price?"),
        headers=TG,
    )
    assert second.json()["duplicate"] is False
    assert first.json()["operation_id"] != second.json()["operation_id"]
    for r in (first, second):
        assert (await pipeline.settled(r.json()["operation_id"]))["status"] == "replied"
    again = await pipeline.client.post(
        "/v1/webhooks/telegram",
        json=telegram_update(501, chat_id=82, message_id=7, text="Price?"),
        headers=TG,
    )
    assert again.json()["operation_id"] == second.json()["operation_id"]
    assert again.json()["duplicate"] is True


async def test_a_generic_webhook_id_reused_for_another_message_is_refused_not_dropped(
    pipeline: Pipeline, pool: asyncpg.Pool
) -> None:
    body = dumps(generic_message("w-1", chat_id="c"))
    r1 = await pipeline.client.post(
        "/v1/webhooks/generic", content=body, headers=signed(GENERIC_SECRET, body, webhook_id="same")
    )
    assert r1.status_code == 202
    other = dumps(generic_message("w-2", chat_id="c"))
    r2 = await pipeline.client.post(
        "/v1/webhooks/generic", content=other, headers=signed(GENERIC_SECRET, other, webhook_id="same")
    )
    assert r2.status_code == 409
    assert r2.json()["error"]["code"] == "event_id_reused"
    assert await pool.fetchval("SELECT count(*) FROM operations") == 1
