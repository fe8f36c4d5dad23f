"""Migration runner: tables in numbered SQL files applied once each; functions in files
re-applied whenever they change. Both under one advisory lock.

Tables live in ``shared/migrations`` as ``NNNN_description.sql``. Each file runs in its
own transaction together with the row that records it in ``schema_migrations``. An
applied file whose content changed is refused: migrations are history, fix forward with
a new file.

Functions (and the triggers that call them) live in ``shared/functions`` as
``NN_aggregate.sql``, one file per aggregate, each the current definition in one piece
(``CREATE OR REPLACE``). After the migrations, every file whose checksum differs from the
one recorded in ``schema_functions`` is applied, in name order, in its own transaction:
editing a function is editing its file. A file that changes a function's signature or
result type drops the old one first (``DROP FUNCTION IF EXISTS``), in the same file.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import logging
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg

logger = logging.getLogger(__name__)

MIGRATIONS_DIR = Path(__file__).with_name("migrations")
FUNCTIONS_DIR = Path(__file__).with_name("functions")
# Any constant shared by every chatqueue process; pg_advisory_lock takes a bigint.
ADVISORY_LOCK_KEY = 0x63686174_71756575 & 0x7FFF_FFFF_FFFF_FFFF  # "chatqueu"
_NAME = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")
_FUNCTION_FILE = re.compile(r"^\d{2}_[a-z0-9_]+\.sql$")
NO_TRANSACTION = "-- chatq:no-transaction"


class MigrationError(RuntimeError):
    """The database and the migration files disagree."""


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    sql: str

    @property
    def checksum(self) -> str:
        return hashlib.sha256(self.sql.encode()).hexdigest()

    @property
    def in_transaction(self) -> bool:
        return not self.sql.startswith(NO_TRANSACTION)

    def statements(self) -> list[str]:
        """The file's statements, each ending with ``;`` at the end of a line."""
        found: list[str] = []
        lines: list[str] = []
        for line in self.sql.splitlines():
            lines.append(line)
            if line.split("--", 1)[0].rstrip().endswith(";"):
                found.append("\n".join(lines))
                lines = []
        if any(line.split("--", 1)[0].strip() for line in lines):
            found.append("\n".join(lines))
        return found


def load_migrations(directory: Path = MIGRATIONS_DIR) -> list[Migration]:
    migrations: list[Migration] = []
    for path in sorted(directory.iterdir()):
        if path.suffix != ".sql":
            continue
        match = _NAME.match(path.name)
        if not match:
            raise MigrationError(f"migration file name {path.name!r} is not NNNN_name.sql")
        migrations.append(Migration(int(match[1]), match[2], path.read_text()))
    versions = [m.version for m in migrations]
    if len(set(versions)) != len(versions):
        raise MigrationError("two migration files share a version number")
    return migrations


@dataclass(frozen=True)
class FunctionFile:
    name: str
    sql: str

    @property
    def checksum(self) -> str:
        return hashlib.sha256(self.sql.encode()).hexdigest()


def load_functions(directory: Path | None = FUNCTIONS_DIR) -> list[FunctionFile]:
    if directory is None:
        return []
    if not directory.is_dir():
        # An install without its SQL files (package data) would otherwise migrate the
        # tables and silently leave every function out.
        raise MigrationError(f"function directory {directory} is missing: reinstall chatqueue")
    files: list[FunctionFile] = []
    for path in sorted(directory.iterdir()):
        if path.suffix != ".sql":
            continue
        if not _FUNCTION_FILE.match(path.name):
            raise MigrationError(f"function file name {path.name!r} is not NN_name.sql")
        files.append(FunctionFile(path.name, path.read_text()))
    return files


_FUNCTIONS_TABLE = """
CREATE TABLE IF NOT EXISTS schema_functions (
    name       text PRIMARY KEY,
    checksum   text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
)
"""


async def apply_functions(conn: asyncpg.Connection, directory: Path | None = FUNCTIONS_DIR) -> list[str]:
    """Apply every function file that changed since it was last applied (caller holds the
    migration lock). Returns the names applied now."""
    files = load_functions(directory)
    await conn.execute(_FUNCTIONS_TABLE)
    applied = {
        r["name"]: r["checksum"] for r in await conn.fetch("SELECT name, checksum FROM schema_functions")
    }
    done: list[str] = []
    for f in files:
        if applied.get(f.name) == f.checksum:
            continue
        record = """
            INSERT INTO schema_functions (name, checksum) VALUES ($1, $2)
            ON CONFLICT (name) DO UPDATE SET checksum = EXCLUDED.checksum, applied_at = now()
            """
        await _in_transaction(conn, f.sql, (record, f.name, f.checksum))
        logger.info("applied functions %s", f.name)
        done.append(f.name)
    return done


async def migrate(
    conn: asyncpg.Connection, directory: Path = MIGRATIONS_DIR, functions: Path | None = None
) -> list[int]:
    """Apply pending migrations, then every changed function file; return the migration
    versions applied now. ``functions`` defaults to the project's function files when
    ``directory`` is the project's migrations (and to none for another directory)."""
    if functions is None and directory == MIGRATIONS_DIR:
        functions = FUNCTIONS_DIR
    migrations = load_migrations(directory)
    # Waited for by polling, not by pg_advisory_lock: a runner blocked in that statement
    # holds a snapshot, which another runner's CREATE INDEX CONCURRENTLY waits out while
    # the blocked one waits for its lock (a deadlock Postgres breaks by failing one).
    while not await conn.fetchval("SELECT pg_try_advisory_lock($1)", ADVISORY_LOCK_KEY):  # noqa: ASYNC110
        await asyncio.sleep(0.1)  # the lock is Postgres': no event to wait on
    try:
        await conn.execute(
            """
            CREATE TABLE IF NOT EXISTS schema_migrations (
                version    integer PRIMARY KEY,
                name       text NOT NULL,
                checksum   text NOT NULL,
                applied_at timestamptz NOT NULL DEFAULT now()
            )
            """
        )
        applied = {
            r["version"]: r for r in await conn.fetch("SELECT version, name, checksum FROM schema_migrations")
        }
        done: list[int] = []
        for m in migrations:
            row = applied.get(m.version)
            if row is not None:
                if row["checksum"] != m.checksum:
                    raise MigrationError(
                        f"migration {m.version:04d}_{m.name} was edited after it was applied; "
                        "add a new migration instead"
                    )
                continue
            record = "INSERT INTO schema_migrations (version, name, checksum) VALUES ($1, $2, $3)"
            if m.in_transaction:
                await _in_transaction(conn, m.sql, (record, m.version, m.name, m.checksum))
            else:
                for statement in m.statements():
                    await conn.execute(statement)
                await conn.execute(record, m.version, m.name, m.checksum)
            logger.info("applied migration %04d_%s", m.version, m.name)
            done.append(m.version)
        unknown = sorted(set(applied) - {m.version for m in migrations})
        if unknown:
            logger.warning("database has migrations this code does not know: %s", unknown)
        await apply_functions(conn, functions)
    except BaseException:
        # The lock is the session's: if the failure took the connection with it, the lock
        # ended with it, and the unlock's own error must not hide why the run stopped.
        try:
            await conn.execute("SELECT pg_advisory_unlock($1)", ADVISORY_LOCK_KEY)
        except Exception as exc:
            logger.warning("migration lock not released by its runner (%s): it ends with the session", exc)
        raise
    await conn.execute("SELECT pg_advisory_unlock($1)", ADVISORY_LOCK_KEY)
    return done


async def _in_transaction(conn: asyncpg.Connection, sql: str, record: tuple[Any, ...]) -> None:
    """``sql`` and its record in one transaction. A failure that took the connection with
    it took the transaction too: it is raised as it is, not as the rollback's own error."""
    transaction = conn.transaction()
    await transaction.start()
    try:
        await conn.execute(sql)
        await conn.execute(*record)
    except BaseException:
        if not conn.is_closed():
            await transaction.rollback()
        raise
    await transaction.commit()


async def migrate_dsn(dsn: str) -> list[int]:
    conn = await asyncpg.connect(dsn)
    try:
        return await migrate(conn)
    finally:
        await conn.close()


async def pending(conn: asyncpg.Connection, directory: Path = MIGRATIONS_DIR) -> list[int | str]:
    """Migration versions this code knows that the database has not applied (all, before
    the first run), then the names of function files whose current text is not applied."""
    migrations = load_migrations(directory)
    exists = await conn.fetchval("SELECT to_regclass('schema_migrations') IS NOT NULL")
    applied = (
        {
            r["version"]: r["checksum"]
            for r in await conn.fetch("SELECT version, checksum FROM schema_migrations")
        }
        if exists
        else {}
    )
    for m in migrations:
        if m.version in applied and applied[m.version] != m.checksum:
            raise MigrationError(f"migration {m.version:04d}_{m.name} differs from the one applied")
    missing: list[int | str] = [m.version for m in migrations if m.version not in applied]
    if directory != MIGRATIONS_DIR:
        return missing
    have = (
        {r["name"]: r["checksum"] for r in await conn.fetch("SELECT name, checksum FROM schema_functions")}
        if await conn.fetchval("SELECT to_regclass('schema_functions') IS NOT NULL")
        else {}
    )
    missing += [f.name for f in load_functions() if have.get(f.name) != f.checksum]
    return missing


async def wait_until_current(dsn: str, *, within: float, interval: float = 2.0) -> list[int | str]:
    """Wait, applying nothing, until the schema has every migration this code knows.
    Returns [] when current, or the versions still pending when ``within`` ran out.
    Kubernetes runs this as an init container while the migration Job does the work."""
    deadline = asyncio.get_running_loop().time() + within
    while True:
        missing: list[int | str]
        try:
            conn = await asyncpg.connect(dsn, timeout=5)
            try:
                missing = await pending(conn)
            finally:
                await conn.close()
        except (OSError, asyncpg.PostgresError) as exc:
            logger.info("waiting for the database: %s", type(exc).__name__)
            missing = [-1]
        if not missing or asyncio.get_running_loop().time() >= deadline:
            return missing
        await asyncio.sleep(interval)


def main() -> None:
    from shared.logging import configure_logging
    from shared.settings import Settings

    parser = argparse.ArgumentParser(description="Apply chatqueue's database migrations.")
    parser.add_argument(
        "--wait",
        type=float,
        metavar="SECONDS",
        help="apply nothing; wait up to SECONDS until every migration is applied (exit 1 if not)",
    )
    args = parser.parse_args()
    settings = Settings()
    configure_logging(settings.log_level, service="migrate", fmt=settings.log_format)
    dsn = settings.database_url.get_secret_value()
    if args.wait is not None:
        missing = asyncio.run(wait_until_current(dsn, within=args.wait))
        if missing:
            print(f"schema not current after {args.wait:g} s; pending: {missing}", file=sys.stderr)
            sys.exit(1)
        print("schema is current")
        return
    applied = asyncio.run(migrate_dsn(dsn))
    print(f"applied {len(applied)} migration(s)" + (f": {applied}" if applied else ""))


if __name__ == "__main__":
    main()
