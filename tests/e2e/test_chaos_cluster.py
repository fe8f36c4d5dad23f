"""The short variant of the cluster scenario (``make chaos`` runs the long one): the
whole pipeline on a fresh local three-node RabbitMQ cluster, the node holding the most
connections killed under traffic and started again. Nothing lost, duplicated or out of
order, the services back on the other nodes, nothing left unacknowledged."""

from __future__ import annotations

import re

import pytest

from tests.support.processes import run_tool

# Booting the cluster takes a minute, the scenario about two more.
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900), pytest.mark.slow]


async def test_a_killed_broker_node_loses_duplicates_and_reorders_nothing_and_the_services_move_on(
    infra,
) -> None:
    result = await run_tool(
        infra, "chaos", "--only", "one node killed", "--messages", "300", "--chats", "40", "--seconds", "60"
    )
    print(result.stdout[-4000:])
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    table = result.stdout.split("scenario  ", 1)[1]
    assert table.count(" pass") == 1 and "FAIL" not in table
    (back,) = re.findall(r"connections open on other nodes after ([\d.]+) s", table)
    assert float(back) < 30
    assert "ready + unacknowledged: chatq.coalescer 0, chatq.responder 0" in table
