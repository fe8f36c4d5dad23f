"""``make demo`` itself runs in CI, and its summary is checked."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from tests.support.processes import ROOT

pytestmark = pytest.mark.e2e


async def test_the_demo_shows_every_scenario_ending_as_expected(infra) -> None:
    amqp_root = infra.amqp_url.rsplit("/", 1)[0] + "/"
    result = await asyncio.to_thread(
        subprocess.run,
        [
            sys.executable,
            "-m",
            "demo",
            "--admin-database-url",
            infra.admin_database_url,
            "--amqp-url",
            amqp_root,
            "--rabbitmq-api-url",
            infra.rabbitmq_api_url or "",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "4 of 4 scenarios as expected" in result.stdout
    for scenario in (
        "burst of 3 answered once",
        "duplicate delivery ignored",
        "platform 503 retried, recovered",
        "permanent failure shown",
    ):
        line = next(line for line in result.stdout.splitlines() if line.startswith(scenario))
        assert line.rstrip().endswith("yes"), line
