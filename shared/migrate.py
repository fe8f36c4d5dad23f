"""Migration runner: numbered plain SQL files, applied once each, under an advisory lock.

Files live in ``shared/migrations`` and are named ``NNNN_description.sql``. Each file runs
in its own transaction together with the row that records it in ``schema_migrations``.
An applied file whose content changed is refused: migrations are history, fix forward
with a new file.
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

import asyncpg

logger = logging.getLogger(__name__)

MIGRATIONS_DIR = Path(__file__).with_name("migrations")
# Any constant shared by every chatqueue process; pg_advisory_lock takes a bigint.
ADVISORY_LOCK_KEY = 0x63686174_71756575 & 0x7FFF_FFFF_FFFF_FFFF  # "chatqueu"
_NAME = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")


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


async def migrate(conn: asyncpg.Connection, directory: Path = MIGRATIONS_DIR) -> list[int]:
    """Apply pending migrations; return the versions applied now."""
    migrations = load_migrations(directory)
    await conn.execute("SELECT pg_advisory_lock($1)", ADVISORY_LOCK_KEY)
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
            async with conn.transaction():
                await conn.execute(m.sql)
                await conn.execute(
                    "INSERT INTO schema_migrations (version, name, checksum) VALUES ($1, $2, $3)",
                    m.version,
                    m.name,
                    m.checksum,
                )
            logger.info("applied migration %04d_%s", m.version, m.name)
            done.append(m.version)
        unknown = sorted(set(applied) - {m.version for m in migrations})
        if unknown:
            logger.warning("database has migrations this code does not know: %s", unknown)
        return done
    finally:
        await conn.execute("SELECT pg_advisory_unlock($1)", ADVISORY_LOCK_KEY)


async def migrate_dsn(dsn: str) -> list[int]:
    conn = await asyncpg.connect(dsn)
    try:
        return await migrate(conn)
    finally:
        await conn.close()


async def pending(conn: asyncpg.Connection, directory: Path = MIGRATIONS_DIR) -> list[int]:
    """Versions this code knows that the database has not applied (all, before the first run)."""
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
    return [m.version for m in migrations if m.version not in applied]


async def wait_until_current(dsn: str, *, within: float, interval: float = 2.0) -> list[int]:
    """Wait, applying nothing, until the schema has every migration this code knows.
    Returns [] when current, or the versions still pending when ``within`` ran out.
    Kubernetes runs this as an init container while the migration Job does the work."""
    deadline = asyncio.get_running_loop().time() + within
    while True:
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
    configure_logging(settings.log_level)
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
