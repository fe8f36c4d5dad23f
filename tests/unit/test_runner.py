"""The one supervisor every service runs on: parts stop in reverse, each stop step runs
even when an earlier one fails, and a part that ends on its own fails the process."""

from __future__ import annotations

import asyncio
import logging

import pytest

from shared import runner
from shared.runner import Supervisor, serve
from shared.settings import Settings

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def _no_heap_freeze(monkeypatch: pytest.MonkeyPatch) -> None:
    # gc.freeze() would keep every later test's garbage alive.
    monkeypatch.setattr(runner, "freeze_startup_heap", lambda: None)


SETTINGS = Settings.model_construct()


class Closable:
    def __init__(self, name: str, events: list[str]) -> None:
        self.name, self.events = name, events

    async def aclose(self) -> None:
        self.events.append(f"close {self.name}")


async def until_stopped(name: str, stopped: asyncio.Event, events: list[str]) -> None:
    await stopped.wait()
    events.append(f"{name} finished")


def part(parts: Supervisor, name: str, events: list[str]) -> None:
    stopped = asyncio.Event()

    def stop() -> None:
        events.append(f"stop {name}")
        stopped.set()

    parts.run(name, until_stopped(name, stopped, events), stop=stop)


async def test_parts_stop_in_the_reverse_of_the_order_they_were_declared_and_clients_close_after_them() -> (
    None
):
    events: list[str] = []

    async def declare(parts: Supervisor) -> None:
        parts.closing("client", Closable("client", events))
        part(parts, "relay", events)
        part(parts, "consumer", events)

    stop = asyncio.Event()
    stop.set()
    assert await asyncio.wait_for(serve("test", SETTINGS, stop, declare), timeout=5) == 0
    assert events == [
        "stop consumer",
        "consumer finished",
        "stop relay",
        "relay finished",
        "close client",
    ]


async def test_a_part_that_ends_on_its_own_stops_the_service_with_exit_status_one_after_draining_the_rest(
    caplog: pytest.LogCaptureFixture,
) -> None:
    events: list[str] = []

    async def crashes() -> None:
        raise RuntimeError("the broker went away for good")

    async def declare(parts: Supervisor) -> None:
        part(parts, "consumer", events)
        parts.run("relay", crashes())

    with caplog.at_level(logging.ERROR, logger="shared.runner"):
        status = await asyncio.wait_for(serve("test", SETTINGS, asyncio.Event(), declare), timeout=5)
    assert status == 1
    assert events == ["stop consumer", "consumer finished"]
    assert "relay stopped unexpectedly" in caplog.text
    assert "the broker went away for good" in caplog.text


async def test_a_failing_stop_step_is_logged_and_the_parts_declared_before_it_still_stop(
    caplog: pytest.LogCaptureFixture,
) -> None:
    events: list[str] = []

    async def fails_to_stop() -> None:
        raise ConnectionError("relay's last pass failed")

    async def declare(parts: Supervisor) -> None:
        parts.closing("client", Closable("client", events))
        part(parts, "consumer", events)
        parts.run("relay", asyncio.sleep(3600), stop=fails_to_stop, wait=0.05)

    stop = asyncio.Event()
    stop.set()
    with caplog.at_level(logging.WARNING, logger="shared.runner"):
        assert await asyncio.wait_for(serve("test", SETTINGS, stop, declare), timeout=5) == 0
    assert events == ["stop consumer", "consumer finished", "close client"]
    assert "stopping relay failed" in caplog.text
    assert "relay's last pass failed" in caplog.text
    assert "relay did not finish within" in caplog.text


async def test_a_repeated_step_that_fails_is_logged_with_its_reason_and_runs_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    rounds: list[int] = []
    twice = asyncio.Event()

    async def gauges() -> None:
        rounds.append(len(rounds))
        if len(rounds) >= 2:
            twice.set()
        raise OSError("Postgres is away")

    async def declare(parts: Supervisor) -> None:
        parts.every(0.01, "backlog gauges", gauges)

    stop = asyncio.Event()
    with caplog.at_level(logging.WARNING, logger="shared.lifecycle"):
        service = asyncio.create_task(serve("test", SETTINGS, stop, declare))
        await asyncio.wait_for(twice.wait(), timeout=5)
        stop.set()
        assert await asyncio.wait_for(service, timeout=5) == 0
    assert len(rounds) >= 2
    assert "backlog gauges: OSError: Postgres is away" in caplog.text


async def test_parts_already_running_are_cancelled_when_start_up_fails_midway() -> None:
    started = asyncio.Event()
    cancelled = asyncio.Event()

    async def runs_forever() -> None:
        started.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async def declare(parts: Supervisor) -> None:
        parts.run("relay", runs_forever(), wait=0.01)
        await started.wait()
        raise OSError("the second broker connection was refused")

    with pytest.raises(OSError, match="refused"):
        await asyncio.wait_for(serve("test", SETTINGS, asyncio.Event(), declare), timeout=5)
    assert cancelled.is_set()
