"""Where the tests get real Postgres and RabbitMQ, and a private namespace in each.

Order of preference:
1. ``CHATQ_TEST_DATABASE_URL`` (a server-level DSN; its database is only used to create
   and drop ours), ``CHATQ_TEST_AMQP_URL`` and ``CHATQ_TEST_RABBITMQ_API_URL`` (the
   management API, used to create and drop our vhost; ``rabbitmqctl`` is the fallback);
2. testcontainers, where a Docker engine answers;
3. otherwise the run stops with a message that says what to set. Never a silent skip.

Each test session gets its own database ``chatq_test_<hex>`` and vhost ``chatq_test_<hex>``,
so concurrent runs never see each other's data.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from urllib.parse import quote, urlsplit, urlunsplit

import asyncpg
import httpx


class InfraUnavailable(RuntimeError):
    pass


@dataclass(frozen=True)
class Infra:
    database_url: str  # the session's own database
    amqp_url: str  # the session's own vhost
    admin_database_url: str
    rabbitmq_api_url: str | None
    vhost: str


def _with_path(url: str, path: str) -> str:
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, path, parts.query, parts.fragment))


def _docker_engine_available() -> bool:
    try:
        import docker

        docker.from_env(timeout=3).ping()
        return True
    except Exception:
        return False


@contextlib.contextmanager
def _containers() -> Iterator[tuple[str, str, str]]:
    from testcontainers.postgres import PostgresContainer
    from testcontainers.rabbitmq import RabbitMqContainer

    with (
        PostgresContainer("postgres:15-alpine", driver=None) as pg,
        RabbitMqContainer("rabbitmq:3.10-management") as mq,
    ):
        host = mq.get_container_host_ip()
        yield (
            pg.get_connection_url(),
            f"amqp://guest:guest@{host}:{mq.get_exposed_port(5672)}/",
            f"http://guest:guest@{host}:{mq.get_exposed_port(15672)}/api",
        )


def create_vhost(api_url: str | None, vhost: str, user: str) -> None:
    if api_url:
        parts = urlsplit(api_url)
        auth = (parts.username or "guest", parts.password or "guest")
        base = urlunsplit(
            (parts.scheme, parts.hostname + (f":{parts.port}" if parts.port else ""), parts.path, "", "")
        )
        try:
            with httpx.Client(auth=auth, timeout=10) as client:
                client.put(f"{base}/vhosts/{quote(vhost, safe='')}").raise_for_status()
                client.put(
                    f"{base}/permissions/{quote(vhost, safe='')}/{quote(user, safe='')}",
                    json={"configure": ".*", "write": ".*", "read": ".*"},
                ).raise_for_status()
            return
        except httpx.HTTPError as exc:
            if not shutil.which("rabbitmqctl"):
                raise InfraUnavailable(f"RabbitMQ management API at {base} failed: {exc}") from exc
    if not shutil.which("rabbitmqctl"):
        raise InfraUnavailable(
            "cannot create a RabbitMQ vhost: set CHATQ_TEST_RABBITMQ_API_URL (management plugin) "
            "or run where rabbitmqctl works"
        )
    try:
        # A bound on each: rabbitmqctl can wait for ever on a node that does not answer (or
        # for one of the few Erlang distribution ports it may use).
        subprocess.run(["rabbitmqctl", "add_vhost", vhost], check=True, capture_output=True, timeout=60)
        subprocess.run(
            ["rabbitmqctl", "set_permissions", "-p", vhost, user, ".*", ".*", ".*"],
            check=True,
            capture_output=True,
            timeout=60,
        )
    except subprocess.TimeoutExpired as exc:
        raise InfraUnavailable(
            f"rabbitmqctl did not answer within {exc.timeout:.0f}s: is RabbitMQ up?"
        ) from exc


def delete_vhost(api_url: str | None, vhost: str) -> None:
    with contextlib.suppress(Exception):
        if api_url:
            parts = urlsplit(api_url)
            auth = (parts.username or "guest", parts.password or "guest")
            base = urlunsplit(
                (parts.scheme, parts.hostname + (f":{parts.port}" if parts.port else ""), parts.path, "", "")
            )
            with httpx.Client(auth=auth, timeout=10) as client:
                client.delete(f"{base}/vhosts/{quote(vhost, safe='')}")
            return
        subprocess.run(["rabbitmqctl", "delete_vhost", vhost], check=False, capture_output=True)


async def _create_database(admin_url: str, name: str) -> None:
    try:
        conn = await asyncpg.connect(admin_url, timeout=10)
    except Exception as exc:
        raise InfraUnavailable(f"Postgres at CHATQ_TEST_DATABASE_URL does not answer: {exc}") from exc
    try:
        await conn.execute(f'CREATE DATABASE "{name}"')
    finally:
        await conn.close()


async def _drop_database(admin_url: str, name: str) -> None:
    with contextlib.suppress(Exception):
        conn = await asyncpg.connect(admin_url, timeout=10)
        try:
            await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            await conn.close()


@contextlib.asynccontextmanager
async def provision_infra():
    """Yield an Infra with a fresh database and vhost; remove both afterwards."""
    db_url = os.environ.get("CHATQ_TEST_DATABASE_URL")
    amqp_url = os.environ.get("CHATQ_TEST_AMQP_URL")
    api_url = os.environ.get("CHATQ_TEST_RABBITMQ_API_URL")
    stack = contextlib.ExitStack()
    if not (db_url and amqp_url):
        if not _docker_engine_available():
            raise InfraUnavailable(
                "integration tests need real Postgres and RabbitMQ. Set CHATQ_TEST_DATABASE_URL "
                "(e.g. postgresql://postgres@127.0.0.1:5432/postgres), CHATQ_TEST_AMQP_URL "
                "(e.g. amqp://guest:guest@127.0.0.1:5672/) and CHATQ_TEST_RABBITMQ_API_URL "
                "(e.g. http://guest:guest@127.0.0.1:15672/api) - `make test` sets them for the "
                "local services - or run where a Docker engine answers, for testcontainers."
            )
        db_url, amqp_url, api_url = stack.enter_context(_containers())
    suffix = secrets.token_hex(4)
    name = f"chatq_test_{suffix}"
    user = urlsplit(amqp_url).username or "guest"
    try:
        await _create_database(db_url, name)
        try:
            create_vhost(api_url, name, user)
        except Exception:
            await _drop_database(db_url, name)
            raise
        try:
            yield Infra(
                database_url=_with_path(db_url, f"/{name}"),
                amqp_url=_with_path(amqp_url, f"/{name}"),
                admin_database_url=db_url,
                rabbitmq_api_url=api_url,
                vhost=name,
            )
        finally:
            await _drop_database(db_url, name)
            delete_vhost(api_url, name)
    finally:
        stack.close()
