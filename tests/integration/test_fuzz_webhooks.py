"""Hypothesis-generated webhook bodies, authenticated correctly, against each endpoint:
every one gets a 2xx or a JSON 4xx, never a 5xx, and a 4xx writes nothing."""

from __future__ import annotations

import json
import time
from typing import Any

import asyncpg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import AVITO_SECRET, GENERIC_SECRET, TELEGRAM_SECRET, replace
from tests.support.payloads import signed
from tests.support.receiver import running_receiver

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("clean")]

scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=40)
)
json_values = st.recursive(
    scalars,
    lambda children: (
        st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=12), children, max_size=6)
    ),
    max_leaves=30,
)
ids = (
    st.integers(-(2**63), 2**63)
    | st.text(max_size=20)
    | st.none()
    # Ids no platform has: integers of thousands of digits, strings longer than an index
    # entry can hold (the receiver must answer 4xx, never 500).
    | st.integers(10**4000, 10**4250)
    | st.text(min_size=257, max_size=20_000)
)
message_like = st.fixed_dictionaries(
    {
        "message_id": ids,
        "date": ids,
        "chat": st.fixed_dictionaries(
            {"id": ids, "type": st.sampled_from(["private", "group", "channel"]) | st.text(max_size=8)}
        ),
    },
    optional={
        "text": st.text(max_size=200) | st.none(),
        "caption": st.text(max_size=50) | st.none(),
        "photo": json_values,
        "from": st.fixed_dictionaries({"id": ids, "is_bot": st.booleans()}),
        "sender_chat": json_values,
        "edit_date": ids,
        "business_connection_id": st.text(max_size=300) | ids,
        "sender_business_bot": st.fixed_dictionaries({"id": ids, "is_bot": st.booleans()}) | json_values,
    },
)
telegram_like = st.fixed_dictionaries(
    {"update_id": ids},
    optional={
        "message": message_like,
        "edited_message": message_like | json_values,
        "channel_post": message_like,
        "business_message": message_like | json_values,
        "edited_business_message": message_like,
    },
)
avito_like = st.fixed_dictionaries(
    {
        "payload": st.fixed_dictionaries(
            {"type": st.sampled_from(["message", "chat_read", ""]) | st.text(max_size=5)},
            optional={
                "value": st.fixed_dictionaries(
                    {
                        "id": st.text(max_size=10),
                        "chat_id": st.text(max_size=10),
                        "user_id": ids,
                        "author_id": ids,
                        "type": st.sampled_from(["text", "system", "image"]) | st.text(max_size=5),
                    },
                    optional={
                        "content": st.fixed_dictionaries(
                            {}, optional={"text": st.text(max_size=100) | st.none()}
                        ),
                        "created": ids,
                    },
                )
            },
        )
    },
    optional={"id": st.text(max_size=10), "timestamp": ids},
)
generic_like = st.fixed_dictionaries(
    {
        "account_id": ids,
        "chat_id": ids,
        "message_id": ids,
        "text": st.text(max_size=100) | st.none(),
        "sent_at": st.datetimes().map(lambda d: d.isoformat()) | st.text(max_size=20) | ids,
    },
    optional={"author_id": ids, "extra": json_values},
)
bodies = {
    "telegram": telegram_like | json_values,
    "avito": avito_like | json_values,
    "generic": generic_like | json_values,
}
RAW = st.binary(max_size=300)
# Valid JSON with an integer longer than Python reads by default (4,300 digits), in the
# places an id goes.
HUGE = st.builds(
    lambda template, digits: template.replace("N", "9" * digits).encode(),
    st.sampled_from(
        [
            '{"update_id": N, "message": {"message_id": 1, "date": 1, "chat": {"id": 1, "type": "private"}}}',
            '{"update_id": 1, "message": {"message_id": 1, "date": 1, "chat": {"id": N, "type": "private"}, "text": "hi"}}',
            '{"payload": {"type": "message", "value": {"id": "m", "chat_id": "c", "user_id": N, "author_id": 1, "type": "text"}}}',
            '{"account_id": N, "chat_id": "c", "message_id": "m", "text": "hi", "sent_at": "2026-01-01T00:00:00Z"}',
        ]
    ),
    st.integers(4301, 8000),
)

CASES: dict[str, int] = {"2xx": 0, "4xx": 0}


async def _check(client: Any, pool: asyncpg.Pool, platform: str, body: bytes, n: int) -> None:
    before = await pool.fetchval("SELECT count(*) FROM operations")
    if platform == "telegram":
        r = await client.post(
            "/v1/webhooks/telegram",
            content=body,
            headers={"X-Telegram-Bot-Api-Secret-Token": TELEGRAM_SECRET, "content-type": "application/json"},
        )
    elif platform == "avito":
        r = await client.post(
            f"/v1/webhooks/avito/{AVITO_SECRET}", content=body, headers={"content-type": "application/json"}
        )
    else:
        try:
            headers = signed(GENERIC_SECRET, body, webhook_id=f"fz-{n}-{time.monotonic_ns()}")
        except UnicodeDecodeError:
            headers = {
                "content-type": "application/json",
                "webhook-id": "x",
                "webhook-timestamp": "1",
                "webhook-signature": "v1,x",
            }
        r = await client.post("/v1/webhooks/generic", content=body, headers=headers)
    assert r.status_code < 500, (platform, body[:200], r.status_code, r.text)
    after = await pool.fetchval("SELECT count(*) FROM operations")
    if r.status_code >= 400:
        CASES["4xx"] += 1
        assert r.headers["content-type"].startswith("application/json")
        assert "error" in r.json()
        assert after == before, "a rejected request wrote a row"
    else:
        CASES["2xx"] += 1
        assert after - before in (0, 1)


def generated(strategy: st.SearchStrategy[Any], n: int) -> list[bytes]:
    """Draw ``n`` bodies with hypothesis (derandomized: the same bodies every run).
    Requests are then sent from the async test, since the pool lives on its loop."""
    drawn: list[bytes] = []

    @settings(
        max_examples=n,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
        deadline=None,
    )
    @given(strategy)
    def collect(value: Any) -> None:
        if isinstance(value, bytes):
            drawn.append(value)
        else:
            drawn.append(json.dumps(value).encode())

    collect()
    return drawn


@pytest.mark.parametrize("platform", ["telegram", "avito", "generic"])
async def test_generated_webhook_bodies_get_a_2xx_or_a_json_4xx_and_a_4xx_writes_nothing(
    platform: str, settings, pool: asyncpg.Pool
) -> None:
    cases = generated(bodies[platform], 250) + generated(RAW, 50) + generated(HUGE, 20)
    async with running_receiver(replace(settings, relay_enabled=False)) as (_, client):
        for n, body in enumerate(cases):
            await _check(client, pool, platform, body, n)
    assert len(cases) >= 250
    print(f"{platform}: {len(cases)} generated bodies; so far {CASES}")
