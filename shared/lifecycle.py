"""Process lifecycle for the worker services: stop on SIGTERM or SIGINT, then drain."""

from __future__ import annotations

import asyncio
import logging
import signal

logger = logging.getLogger(__name__)


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
