"""The seller's settings file for ``make run`` and ``chatq``: one ``.env`` of ``CHATQ_*``
lines, so credentials survive a restart and the development admin token stays the same.

The environment wins over the file (pydantic-settings' order), and a missing file is no
file. Settings are still parsed only by :class:`shared.settings.Settings`; this module
reads the file for the services' child processes and keeps the development admin token
in it.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Mapping
from pathlib import Path

from dotenv import dotenv_values

DEFAULT_ENV_FILE = ".env"
ADMIN_TOKEN_KEY = "CHATQ_ADMIN_TOKEN"
FILE_MODE = 0o600


def env_file_values(path: str | Path | None) -> dict[str, str]:
    """The ``CHATQ_*`` assignments of ``path`` (none when it is unset or missing)."""
    if not path or not Path(path).is_file():
        return {}
    return {k: v for k, v in dotenv_values(path).items() if k.startswith("CHATQ_") and v is not None}


def merged_environment(environ: Mapping[str, str], path: str | Path | None) -> dict[str, str]:
    """``environ`` with the file's settings added where the environment has none."""
    return {**env_file_values(path), **environ}


def stored_admin_token(path: str | Path) -> str:
    """The development admin token kept in ``path``: the one already there, or a new one
    appended (the file is created if missing). The file holds credentials, so it is
    made readable by its owner only (mode 0600) either way."""
    file = Path(path)
    token = env_file_values(file).get(ADMIN_TOKEN_KEY)
    if not token:
        token = secrets.token_urlsafe(24)
        existing = file.read_text() if file.is_file() else ""
        separator = "" if not existing or existing.endswith("\n") else "\n"
        fd = os.open(file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, FILE_MODE)
        with os.fdopen(fd, "a") as fh:
            fh.write(
                f"{separator}# The development admin token (/ops, chatq), made once by `make run`; "
                "kept across restarts.\n"
                f"{ADMIN_TOKEN_KEY}={token}\n"
            )
    os.chmod(file, FILE_MODE)
    return token
