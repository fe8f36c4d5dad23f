"""``make demo`` itself runs in CI, and its summary is checked."""

from __future__ import annotations

import pytest

from tests.support.processes import run_tool

pytestmark = pytest.mark.e2e


async def test_the_demo_shows_every_scenario_ending_as_expected(infra) -> None:
    result = await run_tool(infra, "demo", within=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "4 of 4 scenarios as expected" in result.stdout
    for scenario in (
        "burst of 3 answered once",
        "duplicate delivery ignored",
        "platform 429 retried, recovered",
        "permanent failure shown",
    ):
        line = next(line for line in result.stdout.splitlines() if line.startswith(scenario))
        assert line.rstrip().endswith("yes"), line
