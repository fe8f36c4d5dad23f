"""The migration runner: each file once, recorded, under a lock; an edited file is refused."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import asyncpg
import pytest

from shared.migrate import (
    MigrationError,
    apply_functions,
    body_digest,
    load_functions,
    load_migrations,
    migrate,
    migrate_dsn,
    wait_until_current,
)

pytestmark = pytest.mark.integration


@pytest.fixture
async def scratch_db(infra):
    """A database of its own, so these tests can apply and re-apply freely."""
    name = "chatq_mig_" + infra.vhost.rsplit("_", 1)[-1]
    admin = await asyncpg.connect(infra.admin_database_url)
    await admin.execute(f'DROP DATABASE IF EXISTS "{name}"')
    await admin.execute(f'CREATE DATABASE "{name}"')
    url = infra.database_url.rsplit("/", 1)[0] + f"/{name}"
    try:
        yield url
    finally:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()


def write(directory: Path, name: str, sql: str) -> None:
    (directory / name).write_text(sql)


async def test_migrations_are_applied_once_and_recorded(scratch_db, tmp_path: Path) -> None:
    write(tmp_path, "0001_a.sql", "CREATE TABLE a (id int);")
    write(tmp_path, "0002_b.sql", "CREATE TABLE b (id int);")
    conn = await asyncpg.connect(scratch_db)
    try:
        assert await migrate(conn, tmp_path) == [1, 2]
        assert await migrate(conn, tmp_path) == []
        rows = await conn.fetch("SELECT version, name FROM schema_migrations ORDER BY version")
        assert [tuple(r) for r in rows] == [(1, "a"), (2, "b")]
    finally:
        await conn.close()


async def test_an_edited_applied_migration_is_refused(scratch_db, tmp_path: Path) -> None:
    write(tmp_path, "0001_a.sql", "CREATE TABLE a (id int);")
    conn = await asyncpg.connect(scratch_db)
    try:
        await migrate(conn, tmp_path)
        write(tmp_path, "0001_a.sql", "CREATE TABLE a (id bigint);")
        with pytest.raises(MigrationError, match="edited after it was applied"):
            await migrate(conn, tmp_path)
    finally:
        await conn.close()


async def test_a_failing_migration_leaves_nothing_behind(scratch_db, tmp_path: Path) -> None:
    write(tmp_path, "0001_a.sql", "CREATE TABLE a (id int); SELECT no_such_function();")
    conn = await asyncpg.connect(scratch_db)
    try:
        with pytest.raises(asyncpg.UndefinedFunctionError):
            await migrate(conn, tmp_path)
        assert await conn.fetchval("SELECT to_regclass('a')") is None
        assert await conn.fetchval("SELECT count(*) FROM schema_migrations") == 0
    finally:
        await conn.close()


async def test_a_migration_that_loses_its_connection_fails_with_that_error_not_the_unlocks(
    scratch_db, tmp_path: Path
) -> None:
    # The server ends the runner's session mid-migration: the person reading the error must
    # see why it stopped, not that the lock could not be released on a closed connection
    # (the lock is the session's, so it ended with it; a runner after it takes it at once).
    write(tmp_path, "0001_a.sql", "CREATE TABLE a (id int); SELECT pg_terminate_backend(pg_backend_pid());")
    conn = await asyncpg.connect(scratch_db)
    try:
        with pytest.raises(
            (asyncpg.AdminShutdownError, asyncpg.ConnectionDoesNotExistError), match="administrator"
        ):
            await migrate(conn, tmp_path)
    finally:
        await conn.close()
    write(tmp_path, "0001_a.sql", "CREATE TABLE a (id int);")
    again = await asyncpg.connect(scratch_db)
    try:
        assert await asyncio.wait_for(migrate(again, tmp_path), 10) == [1]
    finally:
        await again.close()


async def test_a_function_file_that_loses_its_connection_fails_with_that_error(
    scratch_db, tmp_path: Path
) -> None:
    functions = tmp_path / "functions"
    functions.mkdir()
    migrations = tmp_path / "migrations"
    migrations.mkdir()
    write(functions, "10_a.sql", "SELECT pg_terminate_backend(pg_backend_pid());")
    conn = await asyncpg.connect(scratch_db)
    try:
        with pytest.raises(
            (asyncpg.AdminShutdownError, asyncpg.ConnectionDoesNotExistError), match="administrator"
        ):
            await migrate(conn, migrations, functions)
    finally:
        await conn.close()


async def test_runners_starting_together_apply_each_migration_exactly_once(
    scratch_db, tmp_path: Path
) -> None:
    # Without the advisory lock, the second CREATE TABLE would fail.
    write(tmp_path, "0001_slow.sql", "SELECT pg_sleep(0.3); CREATE TABLE slow (id int);")
    conns = [await asyncpg.connect(scratch_db) for _ in range(4)]
    try:
        results = await asyncio.gather(*(migrate(c, tmp_path) for c in conns))
        assert sorted(results) == [[], [], [], [1]]
    finally:
        for c in conns:
            await c.close()


def test_badly_named_migration_files_are_refused(tmp_path: Path) -> None:
    write(tmp_path, "1_a.sql", "SELECT 1;")
    with pytest.raises(MigrationError, match=r"NNNN_name\.sql"):
        load_migrations(tmp_path)


def test_the_project_migrations_load_in_order() -> None:
    versions = [m.version for m in load_migrations()]
    assert versions == sorted(versions)
    assert versions[0] == 1


async def test_waiting_for_the_schema_ends_once_the_migration_job_has_applied_it(scratch_db) -> None:
    waiter = asyncio.create_task(wait_until_current(scratch_db, within=30, interval=0.2))
    await asyncio.sleep(0.5)
    assert not waiter.done(), "the schema is empty: the init container must keep waiting"
    await migrate_dsn(scratch_db)
    assert await asyncio.wait_for(waiter, 10) == []


async def test_waiting_for_the_schema_gives_up_with_what_is_pending(scratch_db) -> None:
    missing = await wait_until_current(scratch_db, within=0.3, interval=0.1)
    assert missing == [m.version for m in load_migrations()] + [f.name for f in load_functions()]


async def test_a_function_file_is_applied_again_when_it_changes_and_not_otherwise(
    scratch_db, tmp_path: Path
) -> None:
    migrations, functions = tmp_path / "migrations", tmp_path / "functions"
    migrations.mkdir()
    functions.mkdir()
    write(migrations, "0001_a.sql", "CREATE TABLE a (id int);")
    write(
        functions, "10_a.sql", "CREATE OR REPLACE FUNCTION a_answer() RETURNS int LANGUAGE sql AS 'SELECT 1';"
    )
    conn = await asyncpg.connect(scratch_db)
    try:
        await migrate(conn, migrations, functions)
        assert await conn.fetchval("SELECT a_answer()") == 1
        assert await apply_functions(conn, functions) == []  # unchanged: not applied again

        write(
            functions,
            "10_a.sql",
            "CREATE OR REPLACE FUNCTION a_answer() RETURNS int LANGUAGE sql AS 'SELECT 2';",
        )
        assert await migrate(conn, migrations, functions) == []  # no migration, but the edit applies
        assert await conn.fetchval("SELECT a_answer()") == 2
        recorded = await conn.fetchval("SELECT checksum FROM schema_functions WHERE name = '10_a.sql'")
        assert recorded == load_functions(functions)[0].checksum
    finally:
        await conn.close()


async def test_a_function_file_that_fails_leaves_the_previous_definition(scratch_db, tmp_path: Path) -> None:
    write(
        tmp_path, "10_a.sql", "CREATE OR REPLACE FUNCTION a_answer() RETURNS int LANGUAGE sql AS 'SELECT 1';"
    )
    conn = await asyncpg.connect(scratch_db)
    try:
        await apply_functions(conn, tmp_path)
        write(
            tmp_path,
            "10_a.sql",
            "CREATE OR REPLACE FUNCTION a_answer() RETURNS int LANGUAGE sql AS 'SELECT 2'; SELECT no_such();",
        )
        with pytest.raises(asyncpg.UndefinedFunctionError):
            await apply_functions(conn, tmp_path)
        assert await conn.fetchval("SELECT a_answer()") == 1
    finally:
        await conn.close()


def test_badly_named_function_files_are_refused(tmp_path: Path) -> None:
    write(tmp_path, "claim.sql", "SELECT 1;")
    with pytest.raises(MigrationError, match=r"NN_name\.sql"):
        load_functions(tmp_path)


INDEX_CONCURRENTLY = """-- chatq:no-transaction
-- A build cut short leaves the index invalid: dropped first, then built again.
DROP INDEX CONCURRENTLY IF EXISTS t_even;
CREATE INDEX CONCURRENTLY t_even
    ON t (id) WHERE id % 2 = 0;
"""


async def index_is_valid(conn: asyncpg.Connection, name: str) -> bool | None:
    return await conn.fetchval(
        "SELECT i.indisvalid FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid WHERE c.relname = $1",
        name,
    )


async def test_a_migration_marked_no_transaction_builds_its_index_concurrently_and_is_recorded(
    scratch_db, tmp_path: Path
) -> None:
    """Postgres refuses CREATE INDEX CONCURRENTLY inside a transaction: the marked file runs
    statement by statement, and is recorded after the last."""
    write(tmp_path, "0001_t.sql", "CREATE TABLE t (id int); INSERT INTO t SELECT generate_series(1, 50000);")
    write(tmp_path, "0002_t_even.sql", INDEX_CONCURRENTLY)
    conn = await asyncpg.connect(scratch_db)
    try:
        assert await migrate(conn, tmp_path) == [1, 2]
        assert await index_is_valid(conn, "t_even") is True
        assert await migrate(conn, tmp_path) == []
    finally:
        await conn.close()


async def test_a_no_transaction_migration_cut_short_is_not_recorded_and_runs_again_from_the_top(
    scratch_db, tmp_path: Path
) -> None:
    write(tmp_path, "0001_t.sql", "CREATE TABLE t (id int); INSERT INTO t SELECT generate_series(1, 1000);")
    write(tmp_path, "0002_t_even.sql", INDEX_CONCURRENTLY + "SELECT no_such_function();\n")
    conn = await asyncpg.connect(scratch_db)
    try:
        with pytest.raises(asyncpg.UndefinedFunctionError):
            await migrate(conn, tmp_path)
        assert await conn.fetchval("SELECT max(version) FROM schema_migrations") == 1
        write(tmp_path, "0002_t_even.sql", INDEX_CONCURRENTLY)
        assert await migrate(conn, tmp_path) == [2]
        assert await index_is_valid(conn, "t_even") is True
    finally:
        await conn.close()


async def test_runners_starting_together_build_a_concurrent_index_once_without_a_deadlock(
    scratch_db, tmp_path: Path
) -> None:
    """A runner waiting for the migration lock holds no snapshot, which the other's
    concurrent build would wait out while the waiter waits for its lock."""
    write(tmp_path, "0001_t.sql", "CREATE TABLE t (id int); INSERT INTO t SELECT generate_series(1, 200000);")
    write(tmp_path, "0002_t_even.sql", INDEX_CONCURRENTLY)
    conns = [await asyncpg.connect(scratch_db) for _ in range(3)]
    try:
        results = await asyncio.wait_for(asyncio.gather(*(migrate(c, tmp_path) for c in conns)), 60)
        assert sorted(results) == [[], [], [1, 2]]
        assert await index_is_valid(conns[0], "t_even") is True
    finally:
        for c in conns:
            await c.close()


# ---- function releases: forward only (design invariant I10) --------------------------------


def release(directory: Path, name: str, number: int, sql: str) -> None:
    """A function file of release ``number``."""
    directory.mkdir(exist_ok=True)
    (directory / name).write_text(f"-- chatq:release {number} sha256:{body_digest(sql)}\n{sql}")


@pytest.fixture
async def releases(scratch_db, tmp_path: Path):
    """Two releases of one function file, ``old`` (1) and ``new`` (2), and a connection."""
    old, new = tmp_path / "old", tmp_path / "new"
    release(old, "10_a.sql", 1, ANSWER_1)
    release(new, "10_a.sql", 2, ANSWER_2)
    conn = await asyncpg.connect(scratch_db)
    try:
        yield old, new, conn
    finally:
        await conn.close()


ANSWER_1 = "CREATE OR REPLACE FUNCTION a_answer(p int) RETURNS int LANGUAGE sql AS 'SELECT 1';\n"
ANSWER_2 = (
    "CREATE OR REPLACE FUNCTION a_answer(p int) RETURNS int LANGUAGE sql AS 'SELECT 2';\n"
    "CREATE OR REPLACE FUNCTION a_more() RETURNS int LANGUAGE sql AS 'SELECT 3';\n"
)


async def test_an_older_release_never_puts_older_function_bodies_back_and_runs_on_the_newer(
    releases, caplog: pytest.LogCaptureFixture
) -> None:
    old, new, conn = releases
    assert await apply_functions(conn, old) == ["10_a.sql"]
    assert await apply_functions(conn, new) == ["10_a.sql"]  # the upgrade
    assert await conn.fetchval("SELECT a_answer(0)") == 2
    # A pod of the previous release starts (a rollback, an eviction mid-rollout): it
    # applies nothing, and says why.
    with caplog.at_level("WARNING", logger="shared.migrate"):
        assert await apply_functions(conn, old) == []
    assert await conn.fetchval("SELECT a_answer(0)") == 2, "the newer body stays"
    assert "newer than this process's 1: running against them" in caplog.text
    assert await conn.fetchval("SELECT release FROM schema_functions WHERE name = '10_a.sql'") == 2
    assert await apply_functions(conn, new) == [], "the newer release finds its own text"


async def test_an_older_release_refuses_to_start_when_a_function_it_defines_is_gone(releases) -> None:
    old, new, conn = releases
    release(
        old,
        "10_a.sql",
        1,
        ANSWER_1 + "CREATE OR REPLACE FUNCTION a_gone() RETURNS int LANGUAGE sql AS 'SELECT 9';\n",
    )
    await apply_functions(conn, old)
    await apply_functions(conn, new)
    # The release after dropped a_gone in a migration (one release after its last caller).
    await conn.execute("DROP FUNCTION a_gone()")
    with pytest.raises(MigrationError) as refused:
        await apply_functions(conn, old)
    message = str(refused.value)
    assert "10_a.sql are release 2, newer than this process's release 1" in message
    assert "a_gone() -> integer" in message
    assert "run the newer release's image" in message and 'docs/deploying.md "Rolling back"' in message
    assert await conn.fetchval("SELECT a_answer(0)") == 2


async def test_a_function_a_newer_release_dropped_from_an_unchanged_file_refuses_the_older_process(
    releases,
) -> None:
    """Found by a review: the check ran only for a file whose release was newer; a newer
    release's migration that drops a function of a file it left unchanged let the older
    process start, and fail on every call (UndefinedFunctionError)."""
    old, _new, conn = releases
    await apply_functions(conn, old)
    await conn.execute("DROP FUNCTION a_answer(int)")  # a newer release's migration
    with pytest.raises(MigrationError, match=r"a_answer\(integer\) -> integer"):
        await apply_functions(conn, old, newer_schema=True)
    # Under this process's own schema (nothing newer ran), the file is applied again.
    assert await apply_functions(conn, old) == ["10_a.sql"]
    assert await conn.fetchval("SELECT a_answer(0)") == 1


async def test_a_release_this_database_never_ran_is_refused_rather_than_guessed(releases) -> None:
    old, new, conn = releases
    await apply_functions(conn, new)  # installed at release 2, never at 1
    with pytest.raises(MigrationError, match="never ran release 1"):
        await apply_functions(conn, old)


async def test_a_worker_of_an_older_release_waits_for_nothing_and_refuses_at_once_when_it_cannot_run(
    scratch_db, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`shared.migrate --wait` (the workers' init container) on a database whose functions
    are newer: current when they keep what this release defines; otherwise a refusal at
    once, not a wait that never ends (a rolled-back worker Deployment stuck in Init)."""
    await migrate_dsn(scratch_db)
    conn = await asyncpg.connect(scratch_db)
    try:
        name = load_functions()[-1].name
        await conn.execute(
            "UPDATE schema_functions SET release = release + 1, checksum = 'newer' WHERE name = $1", name
        )
        assert await wait_until_current(scratch_db, within=0.3, interval=0.1) == []
        await conn.execute("DELETE FROM schema_function_releases WHERE name = $1", name)
        started = asyncio.get_running_loop().time()
        with pytest.raises(MigrationError, match=f"{name} are release"):
            await wait_until_current(scratch_db, within=30, interval=0.1)
        assert asyncio.get_running_loop().time() - started < 5
    finally:
        await conn.close()


async def test_the_functions_each_release_defined_are_recorded_as_postgres_has_them(scratch_db) -> None:
    await migrate_dsn(scratch_db)
    conn = await asyncpg.connect(scratch_db)
    try:
        rows = await conn.fetch("SELECT name, release, functions FROM schema_function_releases")
        recorded = {r["name"]: json.loads(r["functions"]) for r in rows}
        assert set(recorded) == {f.name for f in load_functions()}
        jobs = recorded["30_jobs.sql"]
        assert "chatq_claim_job(uuid,integer,bigint,integer)" in jobs
        assert jobs["chatq_claim_job(uuid,integer,bigint,integer)"] == "chatq_claim_result"
        assert all(r["release"] >= 1 for r in rows)
    finally:
        await conn.close()


async def test_two_builds_of_one_release_with_different_text_are_refused_not_swapped(
    releases, tmp_path: Path
) -> None:
    _, new, conn = releases
    other = tmp_path / "other"
    release(other, "10_a.sql", 2, ANSWER_2.replace("SELECT 3", "SELECT 4"))
    await apply_functions(conn, new)
    with pytest.raises(MigrationError, match="two builds carry the same release number"):
        await apply_functions(conn, other)
    assert await conn.fetchval("SELECT a_more()") == 3


async def test_a_release_rewritten_outside_the_releases_is_put_back_by_that_release(releases) -> None:
    """A process from before function releases re-applies its text over ours, keeping the
    release column: the release's own process puts its text back."""
    _, new, conn = releases
    await apply_functions(conn, new)
    await conn.execute("CREATE OR REPLACE FUNCTION a_more() RETURNS int LANGUAGE sql AS 'SELECT 0'")
    await conn.execute("UPDATE schema_functions SET checksum = 'written-by-an-older-chatqueue'")
    assert await apply_functions(conn, new) == ["10_a.sql"]
    assert await conn.fetchval("SELECT a_more()") == 3


async def test_a_new_shape_that_only_adds_defaulted_parameters_beside_an_earlier_one_is_refused(
    releases,
) -> None:
    """Found by the review of issue 41: release 2 gives a_answer a parameter with a default.
    On a fresh database all is well; on one that ran release 1 the earlier shape stays
    (forward only) and every call with one argument fails "is not unique". The migration
    refuses, and the database keeps release 1 whole."""
    old, new, conn = releases
    assert await apply_functions(conn, old) == ["10_a.sql"]
    release(new, "10_a.sql", 2, "CREATE OR REPLACE FUNCTION a_answer(p int, q int DEFAULT 0) RETURNS int "
            "LANGUAGE sql AS 'SELECT 2';\n")  # fmt: skip
    with pytest.raises(MigrationError, match=r"a_answer\(integer\) and a_answer\(integer,integer\)|"
                       r"a_answer\(integer,integer\) and a_answer\(integer\)"):  # fmt: skip
        await apply_functions(conn, new)
    assert await conn.fetchval("SELECT release FROM schema_functions WHERE name = '10_a.sql'") == 1
    assert await conn.fetchval("SELECT a_answer(0)") == 1
    # A new shape that does not overlap (another type) is applied.
    release(new, "10_a.sql", 2, "CREATE OR REPLACE FUNCTION a_answer(p text, q int DEFAULT 0) RETURNS int "
            "LANGUAGE sql AS 'SELECT 2';\n")  # fmt: skip
    assert await apply_functions(conn, new) == ["10_a.sql"]
