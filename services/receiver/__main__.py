"""``python -m services.receiver``: webhook intake, the outbox relay and the admin API."""

from __future__ import annotations

import os

from services.receiver.app import run
from shared.lifecycle import service_main


def main() -> None:
    service_main("receiver", run, os.environ)


if __name__ == "__main__":
    main()
