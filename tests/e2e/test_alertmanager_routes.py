"""The Alertmanager configuration compose ships, run by a real Alertmanager (Debian's
prometheus-alertmanager, which `make test` installs) against the fake Telegram: alerts
posted to its API reach the chat their severity names, in Alertmanager's own Telegram
message with the README's four numbers; the Watchdog goes to the heartbeat URL; while the
broker is down its fallout stays quiet. Only the grouping waits are shortened (the
routes, receivers and inhibition are the shipped ones)."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.fakes.platforms import running_fakes
from tests.fakes.world import FakeWorld
from tests.support.deploy_files import DEPLOY, interpolated
from tests.support.processes import free_port

pytestmark = pytest.mark.e2e

ALERTS_BOT = "7000002"
CRITICAL, WARNING = -1001, -1002
NUMBERS = (
    "Backlog 12 (oldest unfinished 40s); Receipt-to-reply p95 (24 h) 35s; Failed share (24 h) 2%; "
    "Retries (24 h) 14."
)


def shipped_config(fakes: str) -> dict[str, Any]:
    content = yaml.safe_load((DEPLOY / "compose.yaml").read_text())["configs"]["alertmanager-config"][
        "content"
    ]
    doc = yaml.safe_load(
        interpolated(
            content,
            {
                "ALERTMANAGER_RECEIVER": "telegram",
                "ALERTMANAGER_TELEGRAM_API_URL": fakes,
                "ALERTMANAGER_TELEGRAM_BOT_TOKEN": f"{ALERTS_BOT}:alerts-bot-token-for-tests",
                "ALERTMANAGER_TELEGRAM_CRITICAL_CHAT_ID": str(CRITICAL),
                "ALERTMANAGER_TELEGRAM_WARNING_CHAT_ID": str(WARNING),
                "ALERTMANAGER_HEARTBEAT_URL": f"{fakes}/alerts",
            },
        )
    )

    def quick(route: dict[str, Any]) -> None:
        route.update({"group_wait": "1s", "group_interval": "1s"})
        for child in route.get("routes", []):
            quick(child)

    quick(doc["route"])
    return doc


def start(binary: str, directory: Path, port: int, log: Any) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [
            binary, f"--config.file={directory / 'alertmanager.yml'}", f"--storage.path={directory / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}", "--cluster.listen-address=",
        ],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip


@pytest.fixture
async def alertmanager(tmp_path: Path) -> AsyncIterator[tuple[str, FakeWorld]]:
    binary = shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")
    assert binary, "Alertmanager not found: `make test` installs it (Debian package prometheus-alertmanager)"
    async with running_fakes() as world:
        (tmp_path / "alertmanager.yml").write_text(yaml.safe_dump(shipped_config(world.url)))
        port = free_port()
        log = (tmp_path / "alertmanager.log").open("w")
        process = start(binary, tmp_path, port, log)
        url = f"http://127.0.0.1:{port}"
        try:
            async with httpx.AsyncClient(timeout=2) as client:
                deadline = time.monotonic() + 20
                while True:
                    try:
                        if (await client.get(f"{url}/-/ready")).status_code == 200:
                            break
                    except httpx.HTTPError:
                        pass
                    assert process.poll() is None, (tmp_path / "alertmanager.log").read_text()
                    assert time.monotonic() < deadline, "Alertmanager did not become ready"
                    await asyncio.sleep(0.1)
            yield url, world
        finally:
            process.terminate()
            process.wait(timeout=10)
            log.close()
            if world.violations:
                print((tmp_path / "alertmanager.log").read_text()[-3000:])


def alert(name: str, severity: str, **labels: str) -> dict[str, Any]:
    now = datetime.now(UTC)
    return {
        "labels": {"alertname": name, "severity": severity, **labels},
        "annotations": {
            "summary": f"{name} summary",
            "description": f"{name} description",
            "numbers": NUMBERS,
        },
        "startsAt": (now - timedelta(minutes=1)).isoformat(),
        "endsAt": (now + timedelta(minutes=10)).isoformat(),
    }


async def post(url: str, *alerts: dict[str, Any]) -> None:
    async with httpx.AsyncClient(timeout=5) as client:
        r = await client.post(f"{url}/api/v2/alerts", json=list(alerts))
    assert r.status_code == 200, r.text


def sent(world: FakeWorld, chat: int) -> list[str]:
    return [
        m["text"] for m in world.telegram if str(m["bot"]) == ALERTS_BOT and str(m["chat_id"]) == str(chat)
    ]


async def until(what: str, check: Any, within: float = 20) -> Any:
    deadline = time.monotonic() + within
    while not (result := check()):
        assert time.monotonic() < deadline, f"not within {within:.0f} s: {what}"
        await asyncio.sleep(0.1)
    return result


async def test_critical_and_warning_alerts_reach_their_own_telegram_chats_with_the_four_numbers(
    alertmanager,
) -> None:
    url, world = alertmanager
    await post(url, alert("ChatqueueTargetDown", "critical", job="chatqueue-responder"))
    await post(url, alert("ChatqueueDeadLetters", "warning", queue="chatq.responder.dead"))
    (critical,) = await until("the critical alert", lambda: sent(world, CRITICAL))
    (warning,) = await until("the warning", lambda: sent(world, WARNING))
    assert critical.startswith("FIRING critical: ChatqueueTargetDown")
    assert "ChatqueueTargetDown summary" in critical and NUMBERS in critical
    assert warning.startswith("FIRING warning: ChatqueueDeadLetters") and NUMBERS in warning
    assert not world.violations, world.violations


async def test_the_watchdog_goes_to_the_heartbeat_url_and_nowhere_else(alertmanager) -> None:
    url, world = alertmanager
    await post(url, alert("Watchdog", "none"))
    (beat,) = await until("the heartbeat", lambda: world.alerts)
    assert beat["body"]["receiver"] == "heartbeat"
    assert [a["labels"]["alertname"] for a in beat["body"]["alerts"]] == ["Watchdog"]
    await asyncio.sleep(1.5)
    assert not [m for m in world.telegram if str(m["bot"]) == ALERTS_BOT], "the heartbeat is not a page"


async def test_while_the_broker_is_down_its_fallout_stays_quiet(alertmanager) -> None:
    url, world = alertmanager
    await post(
        url,
        alert("RabbitmqUnavailable", "critical"),
        alert("ChatqueueOutboxLagging", "critical"),
        alert("ChatqueueOldestUnfinishedTooOld", "critical"),
        alert("ChatqueueBacklogGrowing", "warning"),
        alert("ChatqueueFailedShareHigh", "critical"),
    )
    await until(
        "RabbitmqUnavailable", lambda: [t for t in sent(world, CRITICAL) if "RabbitmqUnavailable" in t]
    )
    await until(
        "the failed share", lambda: [t for t in sent(world, CRITICAL) if "ChatqueueFailedShareHigh" in t]
    )
    await asyncio.sleep(2)  # two more group intervals: anything not inhibited would be out
    texts = sent(world, CRITICAL) + sent(world, WARNING)
    for muted in ("ChatqueueOutboxLagging", "ChatqueueOldestUnfinishedTooOld", "ChatqueueBacklogGrowing"):
        assert not [t for t in texts if muted in t], f"{muted} was sent while the broker is down"


async def test_one_broker_node_down_mutes_nothing(alertmanager) -> None:
    # Found by a review: one node of three down muted every page of a real outage.
    url, world = alertmanager
    await post(
        url,
        alert("RabbitmqDown", "critical", job="rabbitmq", instance="rabbitmq-1:15692"),
        alert("ChatqueueOldestUnfinishedTooOld", "critical"),
    )
    await until(
        "the oldest unfinished",
        lambda: [t for t in sent(world, CRITICAL) if "ChatqueueOldestUnfinishedTooOld" in t],
    )
