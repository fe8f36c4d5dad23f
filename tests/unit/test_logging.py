"""CHATQ_LOG_FORMAT=json: one JSON object a line, with the time zone, level, logger, the
operation or job id where the call has one, and a traceback as one field."""

from __future__ import annotations

import ast
import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from shared.logging import CONTEXT_FIELDS, JsonFormatter
from shared.settings import Settings

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def test_a_json_line_carries_time_with_its_offset_level_logger_ids_and_the_traceback_as_one_field() -> None:
    try:
        raise ValueError("the platform said no")
    except ValueError:
        record = logging.getLogger("services.responder.handler").makeRecord(
            "services.responder.handler",
            logging.WARNING,
            __file__,
            1,
            "job %s failed (owner %s)",
            ("j-1", "on-call"),
            sys.exc_info(),
            extra={"job_id": "j-1", "chat": "telegram:1:2", "attempt": 3},
        )
    line = JsonFormatter("responder").format(record)
    assert "\n" not in line
    doc = json.loads(line)
    assert doc["time"].endswith("+00:00")
    assert doc["level"] == "WARNING"
    assert doc["service"] == "responder"
    assert doc["logger"] == "services.responder.handler"
    assert doc["message"] == "job j-1 failed (owner on-call)"
    assert (doc["job_id"], doc["chat"], doc["attempt"]) == ("j-1", "telegram:1:2", 3)
    assert doc["traceback"].startswith("Traceback (most recent call last):")
    assert "ValueError: the platform said no" in doc["traceback"]


def test_a_process_started_with_log_format_json_writes_only_json_lines() -> None:
    script = (
        "import logging\n"
        "from shared.logging import configure_logging\n"
        "configure_logging('INFO', service='receiver', fmt='json')\n"
        "log = logging.getLogger('shared.outbox')\n"
        "log.info('plain line')\n"
        "try:\n"
        "    {}['missing']\n"
        "except KeyError:\n"
        "    log.exception('failed', extra={'operation_id': 'op-7'})\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=60)
    lines = out.stderr.splitlines()
    assert len(lines) == 2, out.stderr
    plain, failed = (json.loads(line) for line in lines)
    assert plain["message"] == "plain line" and "operation_id" not in plain
    assert failed["operation_id"] == "op-7" and "KeyError" in failed["traceback"]


def test_the_log_format_setting_takes_text_or_json_only() -> None:
    assert Settings(log_format="json").log_format == "json"
    with pytest.raises(ValueError):
        Settings(log_format="xml")


OUTCOME_LINES = {
    "services/responder/handler.py": ("job %s",),
    "services/coalescer/service.py": ("operation %s", "emitted job", "window %s"),
    "shared/broker/consumer.py": ("retrying %s", "dead-lettering %s", "message %s"),
    "shared/broker/dead_letters.py": ("dead letter %s",),
}


@pytest.mark.parametrize("path", sorted(OUTCOME_LINES))
def test_every_line_that_logs_an_operation_or_job_outcome_passes_its_id_as_a_field(path: str) -> None:
    tree = ast.parse((ROOT / path).read_text())
    found = 0
    for node in ast.walk(tree):
        if not (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "logger"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and str(node.args[0].value).startswith(OUTCOME_LINES[path])
        ):
            continue
        found += 1
        extra = next((k.value for k in node.keywords if k.arg == "extra"), None)
        assert isinstance(extra, ast.Dict), f"{path}:{node.lineno} logs an outcome without extra="
        keys = {k.value for k in extra.keys if isinstance(k, ast.Constant)}
        assert keys & {"operation_id", "job_id", "message_id"}, f"{path}:{node.lineno}: {keys}"
        assert keys <= set(CONTEXT_FIELDS), keys - set(CONTEXT_FIELDS)
    assert found, f"no outcome line found in {path}: the check itself broke"


def started(module: str, **env: str) -> subprocess.CompletedProcess[str]:
    """``python -m module`` with only ``env`` for its settings (no CHATQ_* of ours)."""
    import os

    base = {k: v for k, v in os.environ.items() if not k.startswith("CHATQ_")}
    return subprocess.run(
        [sys.executable, "-m", module],
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )


@pytest.mark.parametrize("module", ["services.receiver", "services.coalescer", "services.responder"])
def test_a_service_refused_at_start_up_says_why_in_one_json_line(module: str) -> None:
    out = started(
        module,
        CHATQ_ENV="production",
        CHATQ_LOG_FORMAT="json",
        CHATQ_DATABASE_URL="postgresql://chatq:Qm7vTz2pLw9xKc4RHs8dJ3kq@db/chatqueue",
        CHATQ_AMQP_URL="amqp://chatq:Hs8dJ3kq0PzX5nVbQm7vTz2p@mq/",
        CHATQ_ADMIN_TOKEN="CHANGE-ME-admin-token-32-characters",
    )
    assert out.returncode == 1
    lines = (out.stdout + out.stderr).splitlines()
    assert len(lines) == 1, lines  # it was a 64-line traceback
    record = json.loads(lines[0])
    assert record["level"] == "ERROR" and record["service"] == module.split(".")[1]
    assert record["message"].startswith(
        f"{module.split('.')[1]} stopped: settings refused: CHATQ_ENV=production"
    )
    assert "CHATQ_ADMIN_TOKEN" in record["message"] and "traceback" not in record
    assert "Qm7vTz2pLw9xKc4RHs8dJ3kq" not in lines[0], "a password never reaches the log"


def test_a_failure_past_the_settings_keeps_its_traceback_inside_the_one_json_line() -> None:
    out = started(
        "shared.migrate",
        CHATQ_LOG_FORMAT="json",
        CHATQ_DATABASE_URL="postgresql://chatq@127.0.0.1:1/chatqueue",
    )
    assert out.returncode == 1
    lines = (out.stdout + out.stderr).splitlines()
    assert len(lines) == 1, lines
    record = json.loads(lines[0])
    assert record["message"].startswith("migrate stopped: ")
    assert "Traceback" in record["traceback"]
