"""Every service runs on uvloop (shared/lifecycle.run_service): the event loop and its
transports are a good part of each service's CPU per reply (docs/performance.md)."""

from __future__ import annotations

import asyncio
import importlib
import signal
from collections.abc import Coroutine
from typing import Any

import pytest
import uvloop

from shared.lifecycle import run_service, stop_on_signals


def test_a_service_main_runs_on_uvloop_and_its_exit_code_comes_back() -> None:
    seen: list[asyncio.AbstractEventLoop] = []

    async def main() -> int:
        seen.append(asyncio.get_running_loop())
        return 3

    assert run_service(main()) == 3
    assert isinstance(seen[0], uvloop.Loop)


@pytest.mark.parametrize("service", ["receiver", "coalescer", "responder"])
def test_each_service_starts_through_the_uvloop_runner(service: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import shared.faults
    import shared.lifecycle
    import shared.logging

    module = importlib.import_module(f"services.{service}.__main__")
    started: list[str] = []

    def fake_run_service(main: Coroutine[Any, Any, int]) -> int:
        started.append(main.cr_code.co_qualname)
        main.close()  # never started: nothing connects
        return 0

    monkeypatch.setattr(shared.lifecycle, "run_service", fake_run_service)
    monkeypatch.setattr(shared.faults, "arm", lambda point: None)
    monkeypatch.setattr(shared.logging, "configure_logging", lambda *a, **k: None)
    with pytest.raises(SystemExit) as exit_:
        module.main()
    assert exit_.value.code == 0
    assert started == ["service_main.<locals>.main"]


def test_a_service_that_ends_unsignalled_gives_sigterm_and_sigint_back_to_their_handlers() -> None:
    # A service whose part ended on its own exits 1 without a signal; its shutdown must
    # still die on SIGTERM or Ctrl-C. uvloop, closing, left both on its closed loop.
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}

    async def main() -> int:
        stop_on_signals()
        return 1

    assert run_service(main()) == 1
    assert {s: signal.getsignal(s) for s in before} == before
