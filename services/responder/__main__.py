"""``python -m services.responder``: one reply per burst, exactly once."""

from __future__ import annotations

from shared.faults import arm
from shared.lifecycle import run_service, stop_on_signals
from shared.logging import configure_logging
from shared.settings import Settings

from .app import run


async def _main(settings: Settings) -> int:
    return await run(settings, stop_on_signals())


def main() -> None:
    settings = Settings()
    configure_logging(settings.log_level, service="responder", fmt=settings.log_format)
    arm(settings.fault_point)
    raise SystemExit(run_service(_main(settings)))


if __name__ == "__main__":
    main()
