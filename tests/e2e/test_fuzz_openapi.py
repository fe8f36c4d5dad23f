"""schemathesis against the receiver's OpenAPI document, with the real secrets: no
generated request may get a 5xx, and the rows written match the deliveries the receiver
reports as accepted or ignored (a rejected request writes nothing)."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
from pathlib import Path

import asyncpg
import httpx
import pytest

from tests.conftest import ADMIN_TOKEN, TELEGRAM_SECRET, replace
from tests.support.processes import ROOT, Receiver

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("clean"), pytest.mark.slow]


def _count(metrics: str, outcome: str) -> float:
    return sum(
        float(v)
        for v in re.findall(
            rf'chatq_webhooks_total{{outcome="{outcome}",platform="[a-z]+"}} ([0-9.e+]+)', metrics
        )
    )


async def test_schemathesis_finds_no_server_error_and_rejected_requests_write_nothing(
    settings, pool: asyncpg.Pool
) -> None:
    receiver = await Receiver(replace(settings, relay_enabled=False)).start()
    try:
        result = await asyncio.to_thread(
            subprocess.run,
            [
                str(Path(sys.executable).with_name("schemathesis")),
                "run",
                f"{receiver.url}/openapi.json",
                "--checks",
                "not_a_server_error",
                "-H",
                f"X-Telegram-Bot-Api-Secret-Token: {TELEGRAM_SECRET}",
                "-H",
                f"Authorization: Bearer {ADMIN_TOKEN}",
                "--max-examples",
                "40",
                "--request-timeout",
                "10",
                "--seed",
                "1",
            ],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=600,
        )
        async with httpx.AsyncClient() as client:
            metrics = (await client.get(f"{receiver.url}/metrics/")).text
    finally:
        await receiver.stop()
    print(result.stdout[-3000:])
    assert result.returncode == 0, result.stdout[-5000:]
    generated, passed = map(int, re.search(r"(\d+) generated, (\d+) passed", result.stdout).groups())  # type: ignore[union-attr]
    assert generated >= 300 and passed == generated
    written = await pool.fetchval("SELECT count(*) FROM operations")
    assert written == _count(metrics, "accepted") + _count(metrics, "ignored")
    assert _count(metrics, "rejected") > 0
