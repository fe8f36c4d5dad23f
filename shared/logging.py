"""Logging set-up: one line per event, to stderr; readable text, or one JSON object a line
with ``CHATQ_LOG_FORMAT=json`` for a log pipeline.

The JSON line carries the time in UTC with its offset, the level, the service, the
logger, the message, the identifiers a call passed with ``extra=`` (operation, job,
message, queue, chat, attempt) and a traceback as one string field, so a multi-line
traceback never splits into several records."""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from typing import Literal

# What the outcome lines pass with extra=: the ids a person searches for.
CONTEXT_FIELDS = ("operation_id", "job_id", "message_id", "queue", "chat", "attempt")


class JsonFormatter(logging.Formatter):
    def __init__(self, service: str) -> None:
        super().__init__()
        self._service = service

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, object] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "service": self._service,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name in CONTEXT_FIELDS:
            value = getattr(record, name, None)
            if value is not None:
                doc[name] = value if isinstance(value, int | float) else str(value)
        if record.exc_info:
            doc["traceback"] = self.formatException(record.exc_info)
        if record.stack_info:
            doc["stack"] = self.formatStack(record.stack_info)
        return json.dumps(doc, ensure_ascii=False, default=str)


def configure_logging(
    level: str = "INFO", *, service: str = "chatq", fmt: Literal["text", "json"] = "text"
) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter(service))
    else:
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
