"""``python -m services.responder``: one reply per burst, exactly once."""

from __future__ import annotations

import os

from services.responder.app import run
from shared.lifecycle import service_main


def main() -> None:
    service_main("responder", run, os.environ)


if __name__ == "__main__":
    main()
