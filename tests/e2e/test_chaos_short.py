"""The short variant of the fault campaign (``make chaos`` runs the full one): every
scenario must end with nothing lost, duplicated or out of order."""

from __future__ import annotations

import pytest

from tests.support.processes import run_tool

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


async def test_the_short_fault_campaign_loses_duplicates_and_reorders_nothing(infra) -> None:
    result = await run_tool(
        infra, "chaos", "--short", "--messages", "200", "--chats", "40", "--seconds", "20"
    )
    print(result.stdout[-4000:])
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    table = result.stdout.split("scenario  ", 1)[1]
    assert table.count(" pass") == 8
    assert "FAIL" not in table
