"""A private PostgreSQL of the installed PostgreSQL 15, for the scenarios that stop or
restart Postgres: ``initdb`` into a directory of its own, ``pg_ctl`` on a free port of
127.0.0.1 (its socket in that directory too), trust authentication for ``postgres``. The
machine's own Postgres, which other work on this machine uses, is never touched.

Postgres refuses to run as root: under root every command runs as the ``postgres`` user
(``runuser``), who then owns the directory."""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
from pathlib import Path

#: Where Debian's PostgreSQL 15 keeps its programs (CHATQ_PG_BIN names another).
BIN = Path(os.environ.get("CHATQ_PG_BIN", "/usr/lib/postgresql/15/bin"))


class PrivatePostgres:
    def __init__(self, port: int, directory: Path | None = None) -> None:
        self.port = port
        self.directory = directory or Path(tempfile.mkdtemp(prefix=f"chatq-pg-{port}-"))
        self.data = self.directory / "data"
        self.log = self.directory / "postgres.log"

    @property
    def admin_url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, *args: str, timeout: float = 120) -> str:
        tool = str(BIN / args[0])
        command = [tool, *args[1:]]
        if os.geteuid() == 0:
            command = ["runuser", "-u", "postgres", "--", *command]
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(args[:2])}: {result.stdout}{result.stderr}{self._log_tail()}")
        return result.stdout

    def _log_tail(self) -> str:
        try:
            return "\n" + "\n".join(self.log.read_text().splitlines()[-20:])
        except OSError:
            return ""

    def create(self) -> PrivatePostgres:
        """initdb, then start."""
        if not (BIN / "initdb").exists():
            raise RuntimeError(f"no PostgreSQL programs in {BIN} (set CHATQ_PG_BIN)")
        if os.geteuid() == 0:
            owner = pwd.getpwnam("postgres")
            os.chown(self.directory, owner.pw_uid, owner.pw_gid)
        self.directory.chmod(0o700)
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync")
        self.start()
        return self

    def start(self) -> None:
        options = f"-p {self.port} -k {self.directory} -c listen_addresses=127.0.0.1 -c max_connections=200"
        self._run(
            "pg_ctl", "-D", str(self.data), "-l", str(self.log), "-o", options, "-w", "-t", "60", "start"
        )

    def stop(self) -> None:
        """A fast shutdown: every connection is cut, new ones are refused until ``start``."""
        self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "-t", "60", "stop")

    def restart(self) -> None:
        """Stop, then start: ``pg_ctl restart`` starts the server without ``-l``, on
        pg_ctl's own output, which then never closes."""
        self.stop()
        self.start()

    def remove(self) -> None:
        """Stop it (if it runs) and delete its directory."""
        if (self.data / "postmaster.pid").exists():
            try:
                self.stop()
            except (RuntimeError, subprocess.TimeoutExpired):
                self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "stop")
        shutil.rmtree(self.directory, ignore_errors=True)
