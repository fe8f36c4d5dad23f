"""A service's shutdown cannot hang on a task that swallowed its cancellation.

Python 3.11's ``asyncio.wait_for`` returns its awaitable's result when a cancellation
arrives in the same loop iteration as that result (gh-86296): the caller goes on as if
never cancelled, and whoever cancelled it and then awaited it waits for ever. CI saw a
receiver's shutdown hang so twice (the account registry's refresh loop, then the
readiness gauges' loop). The product code waits with ``asyncio.timeout`` instead; and
since a library may still swallow one, the repeated steps stop on a swallowed
cancellation and every cancel-and-wait cancels again and gives up, loudly, in the end."""

from __future__ import annotations

import ast
import asyncio
import logging
import subprocess
import sys
import textwrap
from collections.abc import Awaitable, Callable

import pytest

from shared import runner
from shared.lifecycle import cancel_and_wait, every
from shared.runner import Supervisor, serve
from shared.settings import Settings
from tests.support.source import ROOT, python_files

pytestmark = pytest.mark.unit


Wait = Callable[["asyncio.Future[None]"], Awaitable[None]]


async def _finish_as_cancelled(wait: Wait) -> str:
    """Start a task that waits on a future through ``wait``, then finish the future and
    cancel the task in the same loop iteration: what the task did with its cancellation."""
    done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def waiter() -> str:
        await wait(done)
        return "went on"

    task = asyncio.create_task(waiter())
    await asyncio.sleep(0)  # one turn of the loop: the task starts and waits on the future
    done.set_result(None)
    task.cancel()
    try:
        return await task
    except asyncio.CancelledError:
        return "cancelled"


async def test_python_3_11s_wait_for_swallows_a_cancellation_that_arrives_as_its_awaitable_finishes_and_timeout_does_not() -> (
    None
):
    async def with_wait_for(future: asyncio.Future[None]) -> None:
        await asyncio.wait_for(future, timeout=10)

    async def with_timeout(future: asyncio.Future[None]) -> None:
        async with asyncio.timeout(10):
            await future

    # Why the rule below exists: on the Python we run, wait_for loses the cancellation.
    assert await _finish_as_cancelled(with_wait_for) == "went on"
    assert await _finish_as_cancelled(with_timeout) == "cancelled"


def test_no_product_module_waits_with_asyncio_wait_for() -> None:
    found = []
    for path in python_files():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (
                isinstance(node, ast.Attribute)
                and node.attr == "wait_for"
                and isinstance(node.value, ast.Name)
                and node.value.id == "asyncio"
            ) or (
                isinstance(node, ast.ImportFrom)
                and node.module == "asyncio"
                and any(alias.name == "wait_for" for alias in node.names)
            ):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert found == [], (
        "asyncio.wait_for loses a cancellation on Python 3.11 (gh-86296); wait inside "
        f"`async with asyncio.timeout(...)` instead: {found}"
    )


async def test_a_repeated_step_ends_when_cancelled_even_if_the_round_swallowed_the_cancellation() -> None:
    rounds = 0
    entered = asyncio.Event()

    async def step() -> None:
        nonlocal rounds
        rounds += 1
        entered.set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            return  # what wait_for does when its awaitable finishes at the same moment

    task = asyncio.create_task(every(3600, "gauges", step))
    await asyncio.wait_for(entered.wait(), 5)
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=5)
    assert done == {task} and task.cancelled()
    assert rounds == 1


async def test_a_task_that_swallowed_its_cancellation_is_cancelled_again_after_the_grace_and_stops() -> None:
    swallowed = asyncio.Event()

    async def swallows_once() -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            swallowed.set()
        await asyncio.sleep(60)  # goes on as if never cancelled

    task = asyncio.create_task(swallows_once())
    await asyncio.sleep(0)
    assert await asyncio.wait_for(cancel_and_wait(task, grace=0.05, patience=5), 5) is True
    assert swallowed.is_set() and task.cancelled()


async def test_a_task_finishing_its_cleanup_within_the_grace_is_not_interrupted() -> None:
    cleaned = asyncio.Event()

    async def cleans_up() -> None:
        try:
            await asyncio.sleep(60)
        finally:
            await asyncio.sleep(0.2)  # closes a channel, say
            cleaned.set()

    task = asyncio.create_task(cleans_up())
    await asyncio.sleep(0)
    assert await asyncio.wait_for(cancel_and_wait(task, grace=2, patience=5), 5) is True
    assert cleaned.is_set()


async def test_a_task_that_will_not_stop_is_given_up_on_with_its_stack_in_the_log(
    caplog: pytest.LogCaptureFixture,
) -> None:
    release = asyncio.Event()

    async def refuses_to_stop() -> None:
        while not release.is_set():
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                continue

    task = asyncio.create_task(refuses_to_stop(), name="stubborn")
    await asyncio.sleep(0)
    with caplog.at_level(logging.ERROR, logger="shared.lifecycle"):
        assert await asyncio.wait_for(cancel_and_wait(task, grace=0.05, patience=0.3), 5) is False
    assert "task stubborn did not stop" in caplog.text
    assert "refuses_to_stop" in caplog.text  # where it was, for the person reading the log
    release.set()
    task.cancel()
    await asyncio.wait({task}, timeout=5)


async def test_a_service_whose_gauges_swallowed_the_cancellation_still_stops(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(runner, "freeze_startup_heap", lambda: None)
    entered = asyncio.Event()

    async def readiness_gauges() -> None:
        entered.set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            return

    async def declare(parts: Supervisor) -> None:
        parts.every(3600, "readiness gauges", readiness_gauges)

    stop = asyncio.Event()
    service = asyncio.create_task(serve("test", Settings.model_construct(), stop, declare))
    await asyncio.wait_for(entered.wait(), 5)
    stop.set()
    assert await asyncio.wait_for(service, timeout=5) == 0


def test_a_service_process_exits_even_when_a_task_of_it_will_not_stop() -> None:
    # Without the bound, asyncio's own end cancels the task once and waits for ever.
    program = textwrap.dedent(
        """
        import asyncio, logging, sys
        from shared.lifecycle import run_service
        logging.basicConfig(stream=sys.stderr)

        async def refuses_to_stop() -> None:
            while True:
                try:
                    await asyncio.sleep(60)
                except asyncio.CancelledError:
                    continue

        async def main() -> int:
            asyncio.get_running_loop().create_task(refuses_to_stop(), name="stubborn")
            await asyncio.sleep(0.01)
            return 0

        sys.exit(run_service(main(), grace=0.05, patience=0.3))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", program], cwd=ROOT, capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 1
    assert "task stubborn did not stop" in done.stderr
    assert "1 task(s) would not stop; exiting without them" in done.stderr
