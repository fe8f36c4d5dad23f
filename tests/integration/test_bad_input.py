"""Bad input gets a clear JSON 4xx and writes nothing (invariant I6).

Each case builds its body and headers when the test runs, not when the module is
collected: a signature made at collection time is over five minutes old by the time a
long suite reaches it, and the case would test the timestamp window instead."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import asyncpg
import pytest

from tests.conftest import AVITO_SECRET, GENERIC_SECRET, TELEGRAM_SECRET, replace
from tests.support.payloads import dumps, generic_message, signed, telegram_update
from tests.support.receiver import running_receiver

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("clean")]

JSON = {"content-type": "application/json"}
TG = {"X-Telegram-Bot-Api-Secret-Token": TELEGRAM_SECRET, **JSON}
AVITO = f"/v1/webhooks/avito/{AVITO_SECRET}"

Request = Callable[[], tuple[bytes, dict[str, str]]]


@dataclass(frozen=True)
class Case:
    name: str
    path: str
    request: Request  # the body and headers, built when the test runs
    status: int
    code: str


def good_telegram() -> bytes:
    return dumps(telegram_update(1))


def good_generic() -> bytes:
    return dumps(generic_message("g-1"))


def fixed(body: bytes | Callable[[], bytes], headers: dict[str, str]) -> Request:
    """A request whose headers do not depend on the clock."""
    return lambda: (body() if callable(body) else body, headers)


def generic(
    body: Callable[[], bytes] = good_generic,
    *,
    signed_body: Callable[[], bytes] | None = None,
    age_seconds: float = 0.0,
    **overrides: str,
) -> Request:
    """A generic webhook signed now (or ``age_seconds`` ago), over ``signed_body`` when
    given, with some headers overridden."""

    def build() -> tuple[bytes, dict[str, str]]:
        content = body()
        over = signed_body() if signed_body is not None else content
        headers = signed(GENERIC_SECRET, over, webhook_id="msg_bad", timestamp=time.time() - age_seconds)
        headers.update({k.replace("_", "-"): v for k, v in overrides.items()})
        return content, headers

    return build


MISSING_TEXT = b'{"account_id": "a", "chat_id": "c", "message_id": "m", "sent_at": "2026-01-01T00:00:00Z"}'

CASES = [
    Case(
        "telegram without the secret header",
        "/v1/webhooks/telegram",
        fixed(good_telegram, JSON),
        401,
        "bad_secret_token",
    ),
    Case(
        "telegram with a wrong secret",
        "/v1/webhooks/telegram",
        fixed(good_telegram, {**JSON, "X-Telegram-Bot-Api-Secret-Token": "nope"}),
        401,
        "bad_secret_token",
    ),
    Case(
        "avito with a wrong path secret",
        "/v1/webhooks/avito/guess",
        fixed(b"{}", JSON),
        401,
        "bad_path_secret",
    ),
    Case(
        "generic with a forged signature",
        "/v1/webhooks/generic",
        generic(webhook_signature="v1,Zm9yZ2Vk"),
        401,
        "bad_signature",
    ),
    Case(
        "generic signed for another body",
        "/v1/webhooks/generic",
        generic(signed_body=lambda: dumps(generic_message("other"))),
        401,
        "bad_signature",
    ),
    Case(
        "generic with a stale timestamp",
        "/v1/webhooks/generic",
        generic(age_seconds=3600),
        401,
        "bad_signature",
    ),
    Case(
        "generic with a timestamp from the future",
        "/v1/webhooks/generic",
        generic(age_seconds=-3600),
        401,
        "bad_signature",
    ),
    Case(
        "generic without signature headers",
        "/v1/webhooks/generic",
        fixed(good_generic, JSON),
        401,
        "bad_signature",
    ),
    Case(
        "generic with a garbled signature header",
        "/v1/webhooks/generic",
        generic(webhook_signature="garbage-without-comma"),
        401,
        "bad_signature",
    ),
    Case(
        "a body over the cap",
        "/v1/webhooks/telegram",
        fixed(b'{"update_id": 1, "pad": "' + b"x" * 300_000 + b'"}', TG),
        413,
        "body_too_large",
    ),
    Case("malformed JSON", "/v1/webhooks/telegram", fixed(b'{"update_id": 1,', TG), 400, "malformed_json"),
    Case(
        "invalid UTF-8",
        "/v1/webhooks/telegram",
        fixed(b'{"update_id": 1, "x": "\xff\xfe"}', TG),
        400,
        "invalid_utf8",
    ),
    Case(
        "valid JSON of the wrong shape",
        "/v1/webhooks/telegram",
        fixed(b"[1, 2, 3]", TG),
        422,
        "invalid_payload",
    ),
    Case(
        "a telegram update_id that is a string",
        "/v1/webhooks/telegram",
        fixed(b'{"update_id": "1"}', TG),
        422,
        "invalid_payload",
    ),
    Case(
        "a telegram message without a chat",
        "/v1/webhooks/telegram",
        fixed(b'{"update_id": 2, "message": {"message_id": 1, "date": 1, "text": "hi"}}', TG),
        422,
        "invalid_payload",
    ),
    Case(
        "a text with a NUL character",
        "/v1/webhooks/telegram",
        fixed(lambda: dumps(telegram_update(3, text="a\u0000b")), TG),
        422,
        "invalid_payload",
    ),
    Case(
        "a text with a lone surrogate",
        "/v1/webhooks/telegram",
        fixed(
            b'{"update_id": 4, "message": {"message_id": 4, "date": 1, "chat": {"id": 1, "type": "private"}, '
            b'"text": "\\ud800"}}',
            TG,
        ),
        422,
        "invalid_payload",
    ),
    Case(
        "wrong content type",
        "/v1/webhooks/telegram",
        fixed(good_telegram, {**TG, "content-type": "text/plain"}),
        415,
        "unsupported_media_type",
    ),
    # (A body with no payload at all is Avito's subscription check: a 200, see test_accounts.)
    Case(
        "avito with a payload that is not an object",
        AVITO,
        fixed(b'{"id": "x", "payload": "x"}', JSON),
        422,
        "invalid_payload",
    ),
    Case(
        "avito message whose value is not an object",
        AVITO,
        fixed(b'{"payload": {"type": "message", "value": "text"}, "id": 5}', JSON),
        422,
        "invalid_payload",
    ),
    Case(
        "generic with a missing text",
        "/v1/webhooks/generic",
        generic(lambda: MISSING_TEXT),
        422,
        "invalid_payload",
    ),
    Case(
        "deeply nested JSON",
        "/v1/webhooks/telegram",
        fixed(b'{"update_id": 5, "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", TG),
        400,
        "malformed_json",
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
async def test_bad_input_is_refused_with_a_json_4xx_and_nothing_is_written(
    case: Case, settings, pool: asyncpg.Pool
) -> None:
    body, headers = case.request()
    async with running_receiver(replace(settings, relay_enabled=False)) as (_, client):
        response = await client.post(case.path, content=body, headers=headers)
    assert response.status_code == case.status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert error["code"] == case.code
    assert error["message"]
    assert await pool.fetchval("SELECT count(*) FROM operations") == 0
    assert await pool.fetchval("SELECT count(*) FROM outbox") == 0


async def test_an_endpoint_whose_secret_is_not_configured_is_off(settings, pool: asyncpg.Pool) -> None:
    off = replace(settings, relay_enabled=False, telegram_webhook_secret=None)
    async with running_receiver(off) as (_, client):
        response = await client.post("/v1/webhooks/telegram", content=good_telegram(), headers=TG)
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "platform_not_configured"
    assert await pool.fetchval("SELECT count(*) FROM operations") == 0
