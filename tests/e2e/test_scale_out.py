"""Horizontal scale (design section 3's invariants with every service replicated): two
receivers, two coalescers and two responders on one Postgres and one RabbitMQ, each
delivery and its duplicate sent to either receiver, then the same with kill -9 of a
random process every 1-2.5 s. Nothing lost, nothing answered twice, nothing reordered."""

from __future__ import annotations

import pytest

from tests.support.processes import run_tool

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


async def test_two_replicas_of_each_service_keep_every_invariant(infra) -> None:
    result = await run_tool(
        infra, "chaos", "--only", "two replicas", "--messages", "300", "--chats", "60", "--seconds", "20"
    )
    print(result.stdout[-4000:])
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    table = result.stdout.split("scenario  ", 1)[1]
    rows = [line for line in table.splitlines() if line.startswith("two replicas")]
    assert len(rows) == 2 and all(" pass" in r for r in rows), table
    assert "FAIL" not in table
