"""Migration runner: tables in numbered SQL files applied once each; functions in files
re-applied when a newer release of them comes. Both under one advisory lock.

Tables live in ``shared/migrations`` as ``NNNN_description.sql``. Each file runs in its
own transaction together with the row that records it in ``schema_migrations``. An
applied file whose content changed is refused: migrations are history, fix forward with
a new file.

Functions (and the triggers that call them) live beside their aggregate's store, in
``stores/<aggregate>/functions``, and those of no one aggregate in ``shared/functions``, as
``NN_aggregate.sql``, one file per aggregate, each the current definition in one piece
(``CREATE OR REPLACE``), in name order, each in its own transaction. Their first line is
the file's release (design invariant I10, forward only)::

    -- chatq:release 3 sha256:0123456789abcdef

``sha256`` is a digest of the rest of the file: a file edited without a new release is
caught by a unit test (``python -m shared.migrate --stamp`` bumps the release of every
file whose text changed and writes the digest). ``schema_functions`` records each file's
release; a process applies a file only when its release is newer than the database's,
or the same release whose text in the database no chatqueue recorded as a release (a
process from before releases, a hand edit); two builds of one release with different
texts are refused, since which is newer cannot be told. So a process of an older release
never puts older bodies back under newer code. When the
database's release of a file is newer, the process runs against it if that release keeps
every function the process's own release defined (signature and result type, as Postgres
recorded them when that release was applied, ``schema_function_releases``), and refuses
with what to do otherwise. So a function file never drops or retypes a function (a unit
test holds that): a changed result type is a new function; a drop is a migration, one
release after the last caller (``-- chatq:destructive``).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import logging
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg

from shared.roles import apply_grants

logger = logging.getLogger(__name__)

MIGRATIONS_DIR = Path(__file__).with_name("migrations")
FUNCTIONS_DIR = Path(__file__).with_name("functions")
#: Every directory of function files (files apply in name order across them): the
#: functions of no one aggregate here, each aggregate's beside its store, every
#: stores/<aggregate>/functions there is (found by path, so shared/ imports no store; an
#: installed wheel has stores/ beside shared/ too).
FUNCTION_DIRS: tuple[Path, ...] = (
    FUNCTIONS_DIR,
    *sorted((Path(__file__).resolve().parents[1] / "stores").glob("*/functions")),
)
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


_RELEASE = re.compile(r"^-- chatq:release (\d+) sha256:([0-9a-f]{16})\n")


@dataclass(frozen=True)
class ReleaseHeader:
    """A function file's first line: its release and the digest of the rest."""

    release: int
    digest: str | None
    body: str

    @property
    def current(self) -> bool:
        """Whether the digest is that of the body (the file was not edited since it was
        stamped)."""
        return self.digest == body_digest(self.body)


def body_digest(body: str) -> str:
    return hashlib.sha256(body.encode()).hexdigest()[:16]


def read_header(sql: str) -> ReleaseHeader:
    """The release line of a function file; a file without one is release 0."""
    match = _RELEASE.match(sql)
    if match is None:
        return ReleaseHeader(0, None, sql)
    return ReleaseHeader(int(match[1]), match[2], sql[match.end() :])


def stamped(body: str, previous: str | None) -> str:
    """``body`` with its release line: the previous text's release when the body is the
    same, the next one when it changed (or release 1 for a new file)."""
    before = read_header(previous) if previous is not None else None
    if before is not None and before.body == body and before.release > 0:
        release = before.release
    else:
        release = (before.release if before is not None else 0) + 1
    return f"-- chatq:release {release} sha256:{body_digest(body)}\n{body}"


def stamp(path: Path) -> bool:
    """Give ``path`` the next release when its text changed since its release line was
    written (or a first one); True when the file changed."""
    header = read_header(path.read_text())
    if header.digest is not None and header.current:
        return False
    path.write_text(f"-- chatq:release {header.release + 1} sha256:{body_digest(header.body)}\n{header.body}")
    return True


@dataclass(frozen=True)
class FunctionFile:
    name: str
    sql: str

    @property
    def checksum(self) -> str:
        return hashlib.sha256(self.sql.encode()).hexdigest()

    @property
    def release(self) -> int:
        return read_header(self.sql).release


def load_functions(directory: Path | Sequence[Path] | None = FUNCTION_DIRS) -> list[FunctionFile]:
    """The function files of ``directory`` (or of every one of several), in name order."""
    if directory is None:
        return []
    directories = [directory] if isinstance(directory, Path) else list(directory)
    files: list[FunctionFile] = []
    for d in directories:
        if not d.is_dir():
            # An install without its SQL files (package data) would otherwise migrate the
            # tables and silently leave every function out.
            raise MigrationError(f"function directory {d} is missing: reinstall chatqueue")
        for path in sorted(d.iterdir()):
            if path.suffix != ".sql":
                continue
            if not _FUNCTION_FILE.match(path.name):
                raise MigrationError(f"function file name {path.name!r} is not NN_name.sql")
            files.append(FunctionFile(path.name, path.read_text()))
    names = [f.name for f in files]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise MigrationError(f"function files of one name in two directories: {twice}")
    return sorted(files, key=lambda f: f.name)


_FUNCTIONS_TABLES = """
CREATE TABLE IF NOT EXISTS schema_functions (
    name       text PRIMARY KEY,
    checksum   text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
);
ALTER TABLE schema_functions ADD COLUMN IF NOT EXISTS release integer NOT NULL DEFAULT 0;
CREATE TABLE IF NOT EXISTS schema_function_releases (
    name       text NOT NULL,
    release    integer NOT NULL,
    checksum   text NOT NULL,
    -- What the file defined when it was applied: signature -> result type, as Postgres
    -- has them (regprocedure, pg_get_function_result).
    functions  jsonb NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (name, release, checksum)
);
"""

# The functions of the current schema created or replaced by this transaction: those of
# the file just executed in it.
_DEFINED_NOW = """
SELECT coalesce(jsonb_object_agg(p.oid::regprocedure::text, pg_get_function_result(p.oid)), '{}')
FROM pg_proc p
WHERE p.pronamespace = current_schema()::regnamespace AND p.xmin = pg_current_xact_id()::xid
"""

ROLLBACK_RUNBOOK = 'docs/deploying.md "Rolling back"'

# Pairs of functions of one name in our schema that a call could not choose between: a
# shape this transaction wrote (``p.xmin``) whose parameters, defaults taken, accept a call
# another shape of the name accepts too, with the same leading types. Forward-only releases
# keep an earlier release's shape beside a new one; a new shape that only adds parameters
# with defaults makes every call with the old arity "is not unique" on every upgraded
# database, while a fresh database (no old shape) works: refused here, at the migration.
_AMBIGUOUS_NOW = """
SELECT DISTINCT format('%s and %s', a.oid::regprocedure, b.oid::regprocedure)
FROM pg_proc a
JOIN pg_proc b ON b.proname = a.proname AND b.pronamespace = a.pronamespace AND b.oid <> a.oid
CROSS JOIN LATERAL generate_series(greatest(a.pronargs - a.pronargdefaults, b.pronargs - b.pronargdefaults)::int,
                                   least(a.pronargs, b.pronargs)::int) AS k
WHERE a.pronamespace = current_schema()::regnamespace AND a.xmin = pg_current_xact_id()::xid
  AND (a.pronargdefaults > 0 OR b.pronargdefaults > 0)
  AND (k = 0 OR (a.proargtypes::oid[])[0:k - 1] = (b.proargtypes::oid[])[0:k - 1])
"""


@dataclass(frozen=True)
class Newer:
    """A function file whose release in the database is newer than this process's."""

    name: str
    ours: int
    theirs: int
    missing: list[str]  # what our release defined that the database no longer has
    known: bool  # whether this database ever applied our release of the file

    @property
    def compatible(self) -> bool:
        return self.known and not self.missing

    def refusal(self) -> str:
        what = (
            f"{len(self.missing)} function(s) this release defines are gone or changed: "
            + ", ".join(self.missing)
            if self.known
            else f"this database never ran release {self.ours} of it, so whether release "
            f"{self.theirs} keeps what this release calls is unknown"
        )
        return (
            f"the database's SQL functions {self.name} are release {self.theirs}, newer than this "
            f"process's release {self.ours}, and {what}. This process refuses to start rather than "
            f"put older functions back or call missing ones: run the newer release's image, or "
            f"restore the database from a backup taken before the upgrade ({ROLLBACK_RUNBOOK})"
        )


async def _ensure_tables(conn: asyncpg.Connection) -> None:
    await conn.execute(_FUNCTIONS_TABLES)


async def _database_releases(conn: asyncpg.Connection) -> dict[str, tuple[int, str]]:
    if not await conn.fetchval("SELECT to_regclass('schema_functions') IS NOT NULL"):
        return {}
    has_release = await conn.fetchval(
        "SELECT count(*) > 0 FROM information_schema.columns "
        "WHERE table_name = 'schema_functions' AND column_name = 'release' AND table_schema = current_schema()"
    )
    rows = await conn.fetch(
        "SELECT name, checksum, release FROM schema_functions"
        if has_release
        else "SELECT name, checksum, 0 AS release FROM schema_functions"
    )
    return {r["name"]: (r["release"], r["checksum"]) for r in rows}


async def _newer(conn: asyncpg.Connection, f: FunctionFile, theirs: int) -> Newer:
    """What the database's newer release of ``f`` lacks of ours."""
    known = None
    if await conn.fetchval("SELECT to_regclass('schema_function_releases') IS NOT NULL"):
        known = await conn.fetchval(
            "SELECT functions FROM schema_function_releases WHERE name = $1 AND release = $2 AND checksum = $3",
            f.name,
            f.release,
            f.checksum,
        )
    if known is None:
        return Newer(f.name, f.release, theirs, [], known=False)
    ours: dict[str, str] = json.loads(known)
    missing = []
    for signature, result in sorted(ours.items()):
        now = await conn.fetchval("SELECT pg_get_function_result(to_regprocedure($1))", signature)
        if now != result:
            missing.append(f"{signature} -> {result}" + ("" if now is None else f" (now {now})"))
    return Newer(f.name, f.release, theirs, missing, known=True)


async def _recorded(conn: asyncpg.Connection, name: str, release: int, checksum: str) -> bool:
    """Whether this text of the file's release was applied here through the release
    mechanism (and so is a release, not a foreign write)."""
    return bool(
        await conn.fetchval(
            "SELECT count(*) > 0 FROM schema_function_releases WHERE name = $1 AND release = $2 AND checksum = $3",
            name,
            release,
            checksum,
        )
    )


def _same_release_refusal(f: FunctionFile) -> str:
    return (
        f"the database's SQL functions {f.name} are release {f.release} with other text than this "
        f"process's release {f.release}: two builds carry the same release number, and which is newer "
        "cannot be told. Give the newer build's file its next release (python -m shared.migrate "
        f"--stamp) and deploy that build ({ROLLBACK_RUNBOOK})"
    )


async def apply_functions(
    conn: asyncpg.Connection,
    directory: Path | Sequence[Path] | None = FUNCTION_DIRS,
    *,
    newer_schema: bool = False,
) -> list[str]:
    """Apply every function file whose text is not the database's and whose release is at
    least the database's (caller holds the migration lock). A file the database has in a
    newer release is left as it is: if that release keeps what ours defines, this process
    runs against it; if not, MigrationError says what to do. A file the database has in our
    very text is checked too: every function our release of it defined must still be there
    (a newer release's migration may have dropped one; ``newer_schema``: the database has
    migrations this process does not know). Missing under a newer schema, this process
    refuses; missing under ours, the file is applied again. Returns the names applied."""
    files = load_functions(directory)
    await _ensure_tables(conn)
    applied = await _database_releases(conn)
    done: list[str] = []
    for f in files:
        have = applied.get(f.name)
        if have is not None and have[1] == f.checksum:
            kept = await _newer(conn, f, have[0])
            if not kept.known or not kept.missing:
                continue
            if newer_schema:
                raise MigrationError(
                    f"the SQL functions of {f.name} that this process calls are gone from a database a newer "
                    f"release migrated: {', '.join(kept.missing)}. This process refuses to start rather than fail "
                    f"on every call: run the newer release's image ({ROLLBACK_RUNBOOK})"
                )
            logger.warning(
                "functions %s: %s missing; applying the file again", f.name, ", ".join(kept.missing)
            )
            await _apply_function_file(conn, f)
            done.append(f.name)
            continue
        if have is not None and have[0] > f.release:
            newer = await _newer(conn, f, have[0])
            if not newer.compatible:
                raise MigrationError(newer.refusal())
            logger.warning(
                "the database's functions %s are release %d, newer than this process's %d: "
                "running against them (they keep every function release %d defines); not applied",
                f.name,
                have[0],
                f.release,
                f.release,
            )
            continue
        if have is not None and have[0] == f.release and f.release > 0:
            if await _recorded(conn, f.name, f.release, have[1]):
                # Another build of the same release ran here: which text is newer is
                # unknowable, so neither replaces the other.
                raise MigrationError(_same_release_refusal(f))
            logger.warning(
                "functions %s: the database's text of release %d was not written by a chatqueue "
                "that records releases (an older release's process, or a hand edit): applying this one",
                f.name,
                f.release,
            )
        await _apply_function_file(conn, f)
        logger.info("applied functions %s (release %d)", f.name, f.release)
        done.append(f.name)
    return done


async def _apply_function_file(conn: asyncpg.Connection, f: FunctionFile) -> None:
    """The file, what it defined and its record, in one transaction. A failure that took
    the connection with it is raised as it is, not as the rollback's own error."""
    transaction = conn.transaction()
    await transaction.start()
    try:
        await conn.execute(f.sql)
        ambiguous = [r[0] for r in await conn.fetch(_AMBIGUOUS_NOW)]
        if ambiguous:
            raise MigrationError(
                f"{f.name} (release {f.release}) defines a function a call could not choose from another of its "
                f"name: {'; '.join(ambiguous)}. An earlier release's shape stays beside a new one (forward only), so "
                "every call with the earlier arity would fail on an upgraded database: give the new shape another "
                "name, or drop the earlier one in a migration once no running release calls it"
            )
        defined = await conn.fetchval(_DEFINED_NOW)
        await conn.execute(
            """
            INSERT INTO schema_functions (name, checksum, release) VALUES ($1, $2, $3)
            ON CONFLICT (name) DO UPDATE
            SET checksum = EXCLUDED.checksum, release = EXCLUDED.release, applied_at = now()
            """,
            f.name,
            f.checksum,
            f.release,
        )
        await conn.execute(
            """
            INSERT INTO schema_function_releases (name, release, checksum, functions) VALUES ($1, $2, $3, $4)
            ON CONFLICT (name, release, checksum) DO UPDATE SET functions = EXCLUDED.functions, applied_at = now()
            """,
            f.name,
            f.release,
            f.checksum,
            defined,
        )
    except BaseException:
        if not conn.is_closed():
            await transaction.rollback()
        raise
    await transaction.commit()


async def migrate(
    conn: asyncpg.Connection,
    directory: Path = MIGRATIONS_DIR,
    functions: Path | Sequence[Path] | None = None,
) -> list[int]:
    """Apply pending migrations, then every changed function file; return the migration
    versions applied now. ``functions`` defaults to the project's function files when
    ``directory`` is the project's migrations (and to none for another directory)."""
    if functions is None and directory == MIGRATIONS_DIR:
        functions = FUNCTION_DIRS
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
        await apply_functions(conn, functions, newer_schema=bool(unknown))
        if directory == MIGRATIONS_DIR:
            # Each service's role: exactly its grants, on the tables as they now are.
            await apply_grants(conn)
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
    have = await _database_releases(conn)
    for f in load_functions():
        release, checksum = have.get(f.name, (-1, ""))
        if checksum == f.checksum:
            continue
        if release > f.release:
            # Newer functions: nothing to wait for. Either this release runs on them, or
            # it never will: say so now rather than wait for ever.
            newer = await _newer(conn, f, release)
            if not newer.compatible:
                raise MigrationError(newer.refusal())
            continue
        if release == f.release and f.release > 0 and await _recorded(conn, f.name, release, checksum):
            raise MigrationError(_same_release_refusal(f))
        missing.append(f.name)
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
    import os

    from shared.logging import configure_logging, startup_failures
    from shared.settings import Settings

    parser = argparse.ArgumentParser(description="Apply chatqueue's database migrations.")
    parser.add_argument(
        "--wait",
        type=float,
        metavar="SECONDS",
        help="apply nothing; wait up to SECONDS until every migration is applied (exit 1 if not)",
    )
    parser.add_argument(
        "--stamp",
        action="store_true",
        help="give every function file whose text changed its next release line (no database)",
    )
    args = parser.parse_args()
    if args.stamp:
        for f in sorted((p for d in FUNCTION_DIRS for p in d.glob("*.sql")), key=lambda p: p.name):
            if stamp(f):
                print(f"{f.name}: release {read_header(f.read_text()).release}")
        return
    with startup_failures("migrate", os.environ):
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
