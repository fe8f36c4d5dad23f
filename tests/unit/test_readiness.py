"""Readiness as /readyz and chatq_ready report it (issue 40, point 5): a check that only
waits on another (a consumer holding its message while Postgres is away) is not judged,
so the cause is the one check named, and the gauge of each check says the same as the
page."""

from __future__ import annotations

from typing import Any

import pytest
from starlette.testclient import TestClient

from shared import metrics
from shared.ops_http import consumer_readiness, ops_app, readiness_gauges

pytestmark = pytest.mark.unit


class Consumer:
    """What readiness reads of a consumer."""

    def __init__(self, queue: str, *, held_for: float, consuming: bool = True) -> None:
        self.queue, self.held_for, self.consuming = queue, held_for, consuming

    def oldest_unsettled_seconds(self) -> float:
        return self.held_for


class Pool:
    def __init__(self, *, up: bool) -> None:
        self.up = up

    async def fetchval(self, _query: str) -> Any:
        if not self.up:
            raise ConnectionRefusedError("Postgres is away")
        return 1


def gauges() -> dict[str, float]:
    return {c: metrics.READY.labels(check=c)._value.get() for c in ("postgres", "rabbitmq", "progress")}


def ready(consumer: Consumer, pool: Pool) -> Any:
    return consumer_readiness(consumer, pool, stall_seconds=300)  # type: ignore[arg-type]


async def test_while_postgres_is_away_readiness_names_postgres_alone_and_not_the_consumer_it_holds_up() -> (
    None
):
    check = ready(Consumer("chatq.responder", held_for=400), Pool(up=False))
    doc = TestClient(ops_app(check)).get("/readyz")
    assert doc.status_code == 503
    body = doc.json()
    assert body["failing"] == ["postgres"]
    assert body["checks"]["postgres"] == "unreachable: ConnectionRefusedError"
    assert body["checks"]["rabbitmq"] == "ok"
    assert body["checks"]["progress"].startswith("not judged while postgres is unreachable")
    assert gauges() == {"postgres": 0, "rabbitmq": 1, "progress": 1}


async def test_a_consumer_stalled_while_postgres_answers_fails_progress_and_its_gauge() -> None:
    check = ready(Consumer("chatq.responder", held_for=400), Pool(up=True))
    await readiness_gauges(check)()  # the service's round between probes
    assert gauges() == {"postgres": 1, "rabbitmq": 1, "progress": 0}
    body = TestClient(ops_app(check)).get("/readyz").json()
    assert body["failing"] == ["progress"]
    assert body["checks"]["progress"] == "chatq.responder has held a message unsettled for 400s"


async def test_all_checks_passing_is_ready_with_every_gauge_at_one() -> None:
    check = ready(Consumer("chatq.coalescer", held_for=2), Pool(up=True))
    doc = TestClient(ops_app(check)).get("/readyz")
    assert (doc.status_code, doc.json()["failing"]) == (200, [])
    assert gauges() == {"postgres": 1, "rabbitmq": 1, "progress": 1}
