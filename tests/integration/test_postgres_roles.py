"""deploy/postgres/initdb on a real Postgres: the script compose runs on a fresh volume
makes an application role that owns the chatqueue database, can apply every migration,
and is no superuser, so the services never hold the keys to the whole server."""

from __future__ import annotations

import asyncio
import os
import secrets
import subprocess
from collections.abc import AsyncIterator
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest

from shared.migrate import load_migrations, migrate
from tests.support.deploy_files import DEPLOY
from tests.support.infra import Infra

pytestmark = pytest.mark.integration

SCRIPT = DEPLOY / "postgres" / "initdb" / "10-chatqueue-role.sh"


@pytest.fixture
async def app_role(infra: Infra) -> AsyncIterator[str]:
    """Run the init script as the superuser; yield the application role's URL."""
    admin = urlsplit(infra.admin_database_url)
    suffix = secrets.token_hex(4)
    user, password, database = f"chatq_app_{suffix}", secrets.token_urlsafe(18), f"chatq_roles_{suffix}"
    env = {
        **os.environ,
        "PGHOST": admin.hostname or "127.0.0.1",
        "PGPORT": str(admin.port or 5432),
        "PGPASSWORD": admin.password or "",
        "POSTGRES_USER": admin.username or "postgres",
        "POSTGRES_DB": admin.path.lstrip("/") or "postgres",
        "CHATQ_DB_USER": user,
        "CHATQ_DB_PASSWORD": password,
        "CHATQ_DB_NAME": database,
        "CHATQ_MONITOR_USER": f"chatq_monitor_{suffix}",
        "CHATQ_MONITOR_PASSWORD": password + "-monitor",
    }
    out = await asyncio.to_thread(
        subprocess.run, ["sh", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60
    )
    try:
        assert out.returncode == 0, out.stdout + out.stderr
        yield urlunsplit(
            ("postgresql", f"{user}:{password}@{admin.hostname}:{admin.port or 5432}", f"/{database}", "", "")
        )
    finally:
        conn = await asyncpg.connect(infra.admin_database_url)
        try:
            await conn.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
            await conn.execute(f'DROP ROLE IF EXISTS "{user}"')
            await conn.execute(f'DROP ROLE IF EXISTS "chatq_monitor_{suffix}"')
        finally:
            await conn.close()


async def test_the_application_role_owns_its_database_applies_every_migration_and_is_no_superuser(
    app_role: str,
) -> None:
    conn = await asyncpg.connect(app_role)
    try:
        applied = await migrate(conn)
        assert applied == [m.version for m in load_migrations()]
        me = await conn.fetchrow(
            "SELECT rolsuper, rolcreaterole, rolcreatedb, rolreplication, rolbypassrls"
            " FROM pg_roles WHERE rolname = current_user"
        )
        assert not any(me.values()), dict(me)
        owners = {
            r["tableowner"]
            for r in await conn.fetch("SELECT tableowner FROM pg_tables WHERE schemaname = 'public'")
        }
        assert owners == {urlsplit(app_role).username}
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await conn.execute("CREATE ROLE chatq_should_not_exist")
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await conn.execute("CREATE DATABASE chatq_should_not_exist")
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await conn.execute("ALTER SYSTEM SET max_connections = 1000")
    finally:
        await conn.close()


async def test_the_exporters_role_reads_statistics_and_not_one_row_of_the_application(app_role: str) -> None:
    """The Postgres exporter's role (compose's postgres-exporter): pg_monitor, no data."""
    conn = await asyncpg.connect(app_role)
    try:
        await migrate(conn)
    finally:
        await conn.close()
    parts = urlsplit(app_role)
    suffix = parts.username.rsplit("_", 1)[-1]
    monitor = urlunsplit(
        (
            "postgresql",
            f"chatq_monitor_{suffix}:{parts.password}-monitor@{parts.hostname}:{parts.port}",
            parts.path, "", "",
        )
    )  # fmt: skip
    conn = await asyncpg.connect(monitor)
    try:
        assert await conn.fetchval("SELECT count(*) >= 1 FROM pg_stat_database") is True
        assert await conn.fetchval("SELECT pg_has_role(current_user, 'pg_monitor', 'member')") is True
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await conn.fetchval("SELECT count(*) FROM public.operations")
    finally:
        await conn.close()
