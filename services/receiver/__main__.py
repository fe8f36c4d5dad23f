"""``python -m services.receiver``: webhook intake, the outbox relay and the admin API."""

from __future__ import annotations

import uvicorn

from shared.faults import arm
from shared.logging import configure_logging
from shared.settings import Settings

from .app import create_app


def main() -> None:
    settings = Settings()
    configure_logging(settings.log_level, service="receiver")
    arm(settings.fault_point)
    app = create_app(settings)
    uvicorn.run(
        app,
        host=settings.http_host,
        port=settings.http_port,
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=20,
    )


if __name__ == "__main__":
    main()
