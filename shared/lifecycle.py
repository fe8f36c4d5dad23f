"""Process lifecycle for the services: their event loop, stop on SIGTERM or SIGINT, then drain."""

from __future__ import annotations

import asyncio
import gc
import io
import logging
import os
import signal
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from typing import Any, NoReturn

try:
    import uvloop
except ImportError:  # a platform uvloop does not build for (pyproject: not Windows)
    uvloop = None  # type: ignore[assignment]

logger = logging.getLogger(__name__)


def service_main(
    name: str, run: Callable[[Any, asyncio.Event], Awaitable[int]], environ: Mapping[str, str]
) -> NoReturn:
    """A service's ``python -m`` entry: parse the settings, log as they say, arm the fault
    point, run ``run(settings, stop)`` until a signal drains it; exit with its status. A
    failure anywhere on the way is one log record and exit status 1 (startup_failures)."""
    from shared.faults import arm
    from shared.logging import configure_logging, startup_failures
    from shared.settings import Settings

    async def main(settings: Settings) -> int:
        return await run(settings, stop_on_signals())

    with startup_failures(name, environ):
        settings = Settings()
        configure_logging(settings.log_level, service=name, fmt=settings.log_format)
        arm(settings.fault_point)
        code = run_service(main(settings))
    raise SystemExit(code)


def run_service(main: Coroutine[Any, Any, int], *, grace: float = 5.0, patience: float = 15.0) -> int:
    """Run a service's main coroutine to its exit code, on uvloop (asyncio's own loop
    where uvloop is not installed). The services spend a good part of their CPU in the
    event loop and its transports (aio-pika frames, asyncpg, aiohttp, uvicorn): measured
    in bench.pipeline, uvloop took the coalescer from 0.78 to 0.68 ms of CPU per reply and
    the responder from 1.13 to 1.02, and end-to-end throughput up by 6 % (docs/performance.md).

    Once ``main`` has returned, the tasks still running are cancelled (``cancel_and_wait``,
    with ``grace`` and ``patience``); if one will not stop, the process exits anyway, with
    status 1 when ``main``'s was 0: asyncio's own end cancels them once and waits for ever."""
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop if uvloop is not None else None) as runner:
            return runner.run(_and_nothing_left(main, grace=grace, patience=patience))
    finally:
        # A service that ends without a signal (a part stopped on its own) leaves
        # stop_on_signals' handlers in place; asyncio's loop puts the previous ones back on
        # close, uvloop leaves them on the closed loop, where SIGTERM and Ctrl-C would do
        # nothing for the rest of the shutdown.
        for s, handler in handlers.items():
            if handler is not None:
                signal.signal(s, handler)


async def _and_nothing_left(main: Coroutine[Any, Any, int], *, grace: float, patience: float) -> int:
    code = await main
    current = asyncio.current_task()
    rest = [task for task in asyncio.all_tasks() if task is not current]
    stopped = await asyncio.gather(*(cancel_and_wait(t, grace=grace, patience=patience) for t in rest))
    if not all(stopped):
        logger.error("%d task(s) would not stop; exiting without them", stopped.count(False))
        logging.shutdown()
        os._exit(code or 1)
    return code


def stop_on_signals() -> asyncio.Event:
    """An event set by the first SIGTERM or SIGINT (a second one kills at once)."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()

    def _first(sig: signal.Signals) -> None:
        logger.info("received %s: draining", sig.name)
        stop.set()
        for s in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(s)
            signal.signal(s, signal.SIG_DFL)

    for s in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(s, _first, s)
    return stop


def freeze_startup_heap() -> None:
    """Move everything allocated by start-up (modules, the app, pools, clients) out of the
    garbage collector's reach. A full collection otherwise walks all of it: measured on
    the receiver under load, gen-2 pauses of up to 170 ms and a p99 of 47 ms at a third
    of its maximum rate; frozen, pauses stay under about 20 ms and the p99 fell to 13 ms
    (bench.intake). Call once, when the service is set up and before it takes work."""
    gc.collect()
    gc.freeze()


async def every(seconds: float, name: str, step: Callable[[], Awaitable[object]]) -> None:
    """Run ``step`` every ``seconds`` until cancelled. A failing round is logged with its
    reason and the next round runs as planned (Postgres away, say), never swallowed.

    A cancellation that a round swallowed still ends the loop: Python 3.11's
    ``asyncio.wait_for`` (in a library a step calls, say) returns its result when the
    cancellation arrives as what it waits for finishes (gh-86296), and the loop then slept
    for the next round, cancelled in name only, with its canceller waiting for ever (a
    receiver's shutdown hung so in CI, its readiness gauges' task "cancelling" in here)."""
    task = asyncio.current_task()
    while True:
        try:
            await step()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            logger.warning("%s: %s: %s; next round in %.0fs", name, type(exc).__name__, exc, seconds)
        if task is not None and task.cancelling():
            raise asyncio.CancelledError
        await asyncio.sleep(seconds)


async def cancel_and_wait(task: asyncio.Task[Any], *, grace: float = 5.0, patience: float = 15.0) -> bool:
    """Cancel ``task`` and wait for it to end; True when it did.

    A single cancel followed by ``await task`` waits for ever on a task that swallowed its
    cancellation (Python 3.11's ``asyncio.wait_for``, gh-86296, in our code or a library's)
    and went on: a service's shutdown then hangs. So the task gets ``grace`` seconds to
    finish what it does on a cancellation (close a channel, say), is cancelled again every
    second after that, and after ``patience`` seconds is given up on, with its stack logged
    as an error: the process goes on stopping and the log says which task would not."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    task.cancel()
    while not task.done():
        elapsed = loop.time() - start
        if elapsed >= patience:
            stack = io.StringIO()
            task.print_stack(file=stack)
            logger.error(
                "task %s did not stop %.0fs after it was cancelled; left running:\n%s",
                task.get_name(),
                elapsed,
                stack.getvalue(),
            )
            return False
        if elapsed < grace:
            await asyncio.wait({task}, timeout=grace - elapsed)
        else:
            task.cancel()
            await asyncio.wait({task}, timeout=min(1.0, patience - elapsed))
    if not task.cancelled():
        task.exception()  # retrieved: the owner logs failures, asyncio need not
    return True
