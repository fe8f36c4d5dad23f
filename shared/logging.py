"""Logging set-up: one readable line per event, to stderr."""

from __future__ import annotations

import logging
import sys


def configure_logging(level: str = "INFO", *, service: str = "chatq") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        logging.Formatter(
            f"%(asctime)s %(levelname)-7s {service} %(name)s: %(message)s",
            datefmt="%Y-%m-%dT%H:%M:%S",
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # Library chatter that would drown the outcome lines.
    for noisy in ("aiormq", "aio_pika", "uvicorn.access", "httpx"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
