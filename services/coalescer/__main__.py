"""``python -m services.coalescer``: per-chat windows, one reply job per burst."""

from __future__ import annotations

import os

from services.coalescer.app import run
from shared.lifecycle import service_main


def main() -> None:
    service_main("coalescer", run, os.environ)


if __name__ == "__main__":
    main()
