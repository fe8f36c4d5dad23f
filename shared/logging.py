"""Logging set-up: one line per event, to stderr; readable text, or one JSON object a line
with ``CHATQ_LOG_FORMAT=json`` for a log pipeline.

The JSON line carries the time in UTC with its offset, the level, the service, the
logger, the message, the identifiers a call passed with ``extra=`` (operation, job,
message, queue, chat, attempt) and a traceback as one string field, so a multi-line
traceback never splits into several records."""

from __future__ import annotations

import contextlib
import json
import logging
import sys
from collections.abc import Iterator, Mapping
from datetime import UTC, datetime
from typing import Literal
from urllib.parse import urlsplit, urlunsplit

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
    global _configured
    _configured = True


_configured = False


@contextlib.contextmanager
def startup_failures(service: str, environ: Mapping[str, str]) -> Iterator[None]:
    """Whatever stops a process ends it with exit status 1 and one log record, in the
    format the deployment asked for: one JSON line with ``CHATQ_LOG_FORMAT=json``, where a
    raw traceback would be dozens of lines a log pipeline splits into as many records.
    Until the settings are parsed (they may be what failed) the format comes from
    ``environ``, which ``__main__`` passes. A refusal that explains itself (settings, a
    migration) is logged without its traceback; anything else carries it, in the record.
    """
    try:
        yield
    except Exception as exc:
        if not _configured:
            fmt: Literal["text", "json"] = (
                "json" if environ.get("CHATQ_LOG_FORMAT", "").strip().lower() == "json" else "text"
            )
            configure_logging("INFO", service=service, fmt=fmt)
        message, explained = _refusal(exc)
        log = logging.getLogger(f"{service}.startup")
        if explained:
            log.error("%s stopped: %s", service, message)
        else:
            log.error("%s stopped: %s", service, message, exc_info=exc)
        raise SystemExit(1) from None


def _refusal(exc: Exception) -> tuple[str, bool]:
    """A failure's one-line text, and whether that text is the whole story."""
    from pydantic import ValidationError

    from shared.migrate import MigrationError
    from shared.settings import SettingsRefused

    if isinstance(exc, ValidationError):
        reasons = "; ".join(str(e["msg"]).removeprefix("Value error, ") for e in exc.errors())
        return f"settings refused: {reasons}", True
    if isinstance(exc, SettingsRefused):
        return f"settings refused: {exc}", True
    if isinstance(exc, MigrationError):
        return f"migration refused: {exc}", True
    return f"{type(exc).__name__}: {exc}", False


def redact_url(url: str) -> str:
    """The URL without its password (and query): safe to print."""
    parts = urlsplit(url)
    netloc = parts.hostname or ""
    if parts.port:
        netloc += f":{parts.port}"
    if parts.username:
        netloc = f"{parts.username}:***@{netloc}" if parts.password else f"{parts.username}@{netloc}"
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))
