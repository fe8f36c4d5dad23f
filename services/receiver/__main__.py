"""``python -m services.receiver``: webhook intake, the outbox relay and the admin API."""

from __future__ import annotations

import os

from shared.lifecycle import service_main

from .app import run


def main() -> None:
    service_main("receiver", run, os.environ)


if __name__ == "__main__":
    main()
