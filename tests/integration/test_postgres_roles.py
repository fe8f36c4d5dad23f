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

from shared.migrate import load_migrations, migrate, pending
from shared.roles import SERVICES, role_name
from shared.settings import Settings
from tests.conftest import replace
from tests.fakes.world import FakeWorld
from tests.support.avito import ME, Stack, known_account
from tests.support.broker import wait_for
from tests.support.deploy_files import DEPLOY
from tests.support.infra import Infra
from tests.support.pipeline import ADMIN, Pipeline
from tests.support.receiver import running_receiver
from tests.support.service_roles import run_as
from tests.support.services import running_coalescers, running_responders

pytestmark = pytest.mark.integration

SCRIPT = DEPLOY / "postgres" / "initdb" / "10-chatqueue-role.sh"


def service_url(app_url: str, service: str) -> str:
    """The URL ``service`` connects with: its own role, made by the init script."""
    parts = urlsplit(app_url)
    user = role_name(parts.username or "", service)
    netloc = f"{user}:{parts.password}-{service}@{parts.hostname}:{parts.port or 5432}"
    return urlunsplit(("postgresql", netloc, parts.path, "", ""))


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
        **{f"CHATQ_{s.upper()}_DB_PASSWORD": f"{password}-{s}" for s in SERVICES},
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
        await run_as(
            infra.admin_database_url,
            f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)',
            f'DROP ROLE IF EXISTS "{user}"',
            f'DROP ROLE IF EXISTS "chatq_monitor_{suffix}"',
            *(f'DROP ROLE IF EXISTS "{role_name(user, s)}"' for s in SERVICES),
        )


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


#: What each service's role must not do: write another service's rows, read what it does
#: not use, delete what it does not own the lifetime of, change the schema.
REFUSED = {
    "receiver": [
        "INSERT INTO reply_jobs DEFAULT VALUES",  # a reply job is the coalescer's to create
        "DELETE FROM reply_jobs",
        "INSERT INTO chat_windows DEFAULT VALUES",
        "INSERT INTO deliveries DEFAULT VALUES",  # sending is the responder's
        "INSERT INTO delivery_parts DEFAULT VALUES",
        "UPDATE delivery_parts SET status = status",
        "SELECT count(*) FROM chat_listings",
        "SELECT count(*) FROM dead_letters",
        "INSERT INTO sandbox_replies DEFAULT VALUES",
        "DELETE FROM operations",  # retention is the coalescer's
        "DELETE FROM accounts",
        "TRUNCATE outbox",
        "CREATE TABLE chatq_should_not_exist (a int)",
        "ALTER TABLE operations ADD COLUMN chatq_should_not_exist int",
    ],
    "coalescer": [
        "SELECT credentials FROM accounts",  # no credential, ever
        "SELECT webhook_key FROM accounts",
        "UPDATE accounts SET state = state",
        "INSERT INTO accounts DEFAULT VALUES",
        "SELECT count(*) FROM platform_tokens",
        "SELECT count(*) FROM telegram_business_connections",
        "INSERT INTO operations DEFAULT VALUES",  # a buyer message is the receiver's to store
        "INSERT INTO deliveries DEFAULT VALUES",
        "UPDATE deliveries SET status = status",
        "SELECT count(*) FROM delivery_parts",
        "TRUNCATE reply_jobs",
        "CREATE TABLE chatq_should_not_exist (a int)",
    ],
    "responder": [
        "INSERT INTO operations DEFAULT VALUES",
        "DELETE FROM operations",
        "INSERT INTO outbox DEFAULT VALUES",  # it publishes nothing
        "SELECT count(*) FROM outbox",
        "INSERT INTO reply_jobs DEFAULT VALUES",
        "DELETE FROM reply_jobs",
        "INSERT INTO chat_windows DEFAULT VALUES",
        "DELETE FROM accounts",
        "SELECT count(*) FROM avito_poll_accounts",
        "SELECT count(*) FROM dead_letters",
        "TRUNCATE deliveries",
        "CREATE TABLE chatq_should_not_exist (a int)",
    ],
}
#: And what it does need, so that the refusals above are not a role that can do nothing.
ALLOWED = {
    "receiver": [
        "SELECT count(*) FROM operations",
        "SELECT count(*) FROM accounts WHERE credentials IS NOT NULL",
        "UPDATE reply_jobs SET status = status WHERE false",  # a seller's message withdraws replies
        "SELECT count(*) FROM schema_migrations",
    ],
    "coalescer": [
        "SELECT platform, account_id, state, takeover_seconds FROM accounts",
        "INSERT INTO reply_jobs SELECT * FROM reply_jobs WHERE false",
        "DELETE FROM operations WHERE false",
        "SELECT count(*) FROM schema_migrations",
    ],
    "responder": [
        "SELECT count(*) FROM accounts WHERE credentials IS NOT NULL",
        "INSERT INTO deliveries SELECT * FROM deliveries WHERE false",
        "UPDATE reply_jobs SET status = status WHERE false",
        "SELECT count(*) FROM schema_migrations",
    ],
}


@pytest.fixture
async def migrated(app_role: str) -> str:
    conn = await asyncpg.connect(app_role)
    try:
        await migrate(conn)
    finally:
        await conn.close()
    return app_role


@pytest.mark.parametrize("service", SERVICES)
async def test_each_services_role_is_refused_what_it_does_not_use_and_allowed_what_it_does(
    migrated: str, service: str
) -> None:
    conn = await asyncpg.connect(service_url(migrated, service))
    try:
        me = await conn.fetchrow(
            "SELECT rolsuper, rolcreaterole, rolcreatedb, rolreplication, rolbypassrls"
            " FROM pg_roles WHERE rolname = current_user"
        )
        assert not any(me.values()), dict(me)
        refused = []
        for statement in REFUSED[service]:
            try:
                async with conn.transaction():
                    await conn.execute(statement)
            except asyncpg.InsufficientPrivilegeError:
                continue
            refused.append(statement)
        assert refused == [], f"{service} may: {refused}"
        for statement in ALLOWED[service]:
            async with conn.transaction():
                await conn.execute(statement)
        # What a worker's init container asks before it starts (shared.migrate --wait).
        assert await pending(conn) == []
    finally:
        await conn.close()


async def test_a_service_role_made_after_the_migrations_gets_its_grants_at_the_next_migration_run(
    migrated: str, infra: Infra
) -> None:
    owner = urlsplit(migrated).username or ""
    role = role_name(owner, "responder")
    password = f"{urlsplit(migrated).password}-responder"
    await run_as(
        _with_database(infra.admin_database_url, urlsplit(migrated).path),
        f'DROP OWNED BY "{role}"',
        f'DROP ROLE "{role}"',
        f"CREATE ROLE \"{role}\" LOGIN PASSWORD '{password}'",
        f'GRANT CONNECT ON DATABASE "{urlsplit(migrated).path.lstrip("/")}" TO "{role}"',
    )
    conn = await asyncpg.connect(service_url(migrated, "responder"))
    try:
        # Without USAGE on the schema its tables are not even seen.
        with pytest.raises((asyncpg.InsufficientPrivilegeError, asyncpg.UndefinedTableError)):
            await conn.fetchval("SELECT count(*) FROM reply_jobs")
    finally:
        await conn.close()
    owner_conn = await asyncpg.connect(migrated)
    try:
        assert await migrate(owner_conn) == []  # nothing to apply; the grants are set again
    finally:
        await owner_conn.close()
    conn = await asyncpg.connect(service_url(migrated, "responder"))
    try:
        assert await conn.fetchval("SELECT count(*) FROM reply_jobs") == 0
    finally:
        await conn.close()


def _with_database(url: str, path: str) -> str:
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, path, "", ""))


async def test_the_three_services_run_under_their_own_roles_through_webhook_poll_sandbox_and_admin(
    migrated: str, polling: Settings, world: FakeWorld, caplog: pytest.LogCaptureFixture
) -> None:
    """Each service on its own role's URL, not migrating: a Telegram webhook, an Avito
    message found by the poll (the receiver's tokens and poll state), a sandbox chat, the
    admin API, the coalescer's retention pass and the responder's sends all work, and no
    statement is refused a privilege."""
    as_service = {
        s: replace(polling, database_url=service_url(migrated, s), migrate_on_start=False) for s in SERVICES
    }
    pool = await asyncpg.create_pool(migrated, min_size=1, max_size=2)
    try:
        async with (
            running_receiver(as_service["receiver"], host="localhost") as (receiver, client),
            running_coalescers(as_service["coalescer"]),
            running_responders(as_service["responder"]),
        ):
            stack = Stack(Pipeline(client, pool, receiver), receiver.public.state.runtime)
            recovery = stack.runtime.recovery
            assert recovery is not None
            await wait_for(lambda: recovery.rounds >= 1, what="the start-up poll")
            op = await stack.p.telegram(1, 501, "Is it available?")
            assert (await stack.p.settled(op))["status"] == "replied"
            await known_account(stack, world)
            world.avito_buyer_writes(ME, "u2i-lost", "Do you deliver?")
            assert await stack.poll() == 1
            lost = await pool.fetchval("SELECT id::text FROM operations WHERE chat_id = 'u2i-lost'")
            assert (await stack.p.settled(lost))["status"] == "replied"
            sent = await client.post("/v1/sandbox/messages", json={"chat_id": "s1", "text": "Hi"})
            assert (await stack.p.settled(sent.json()["operation_id"]))["status"] == "replied"
            assert (await client.get("/v1/stats", headers=ADMIN)).status_code == 200
            assert (await client.get("/v1/accounts", headers=ADMIN)).status_code == 200
            assert (await client.get("/metrics")).status_code == 200
    finally:
        await pool.close()
    refused = [r.getMessage() for r in caplog.records if "permission denied" in r.getMessage().lower()]
    refused += [
        str(r.exc_info[1])
        for r in caplog.records
        if r.exc_info and isinstance(r.exc_info[1], asyncpg.InsufficientPrivilegeError)
    ]
    assert refused == []
