"""Check that Postgres and RabbitMQ answer before a run or a test session, and say
exactly what to start when they do not. ``--create-database`` creates the database
named in the URL when the server answers but the database does not exist yet. Without
``--database-url`` and ``--amqp-url`` the URLs are the settings' (``--env-file``, as
``make run`` passes ``.env``, under the environment), so the check reaches what the
services will."""

from __future__ import annotations

import argparse
import asyncio
import socket
import sys
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import httpx

from shared.logging import redact_url

START_POSTGRES = "pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start"
START_RABBITMQ = "rabbitmq-server -detached"
ENABLE_MANAGEMENT = "rabbitmq-plugins enable rabbitmq_management rabbitmq_prometheus"


def _tcp_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=3):
            return True
    except OSError:
        return False


async def _check_postgres(url: str, create: bool) -> str | None:
    try:
        conn = await asyncpg.connect(url, timeout=5)
        await conn.close()
        return None
    except asyncpg.InvalidCatalogNameError:
        if not create:
            return f"Postgres answers but the database in {redact_url(url)} does not exist"
        parts = urlsplit(url)
        name = parts.path.lstrip("/")
        admin = urlunsplit((parts.scheme, parts.netloc, "/postgres", parts.query, ""))
        conn = await asyncpg.connect(admin, timeout=5)
        try:
            await conn.execute(f'CREATE DATABASE "{name}"')
        except asyncpg.DuplicateDatabaseError:
            pass
        finally:
            await conn.close()
        print(f"created database {name}")
        return None
    except (OSError, asyncpg.PostgresError, TimeoutError) as exc:
        return f"Postgres at {redact_url(url)} does not answer ({type(exc).__name__}: {exc}). Start it: {START_POSTGRES}"


COMPOSE_FILE = "deploy/compose.dev.yaml"


def _docker_engine() -> bool:
    import shutil
    import subprocess

    if not shutil.which("docker"):
        return False
    return subprocess.run(["docker", "info"], capture_output=True, timeout=15).returncode == 0


def _start_with_compose() -> bool:
    """Start Postgres and RabbitMQ from deploy/compose.dev.yaml where a Docker engine runs."""
    import os
    import subprocess

    if not os.path.exists(COMPOSE_FILE) or not _docker_engine():
        return False
    print(f"preflight: starting postgres and rabbitmq from {COMPOSE_FILE}", file=sys.stderr)
    cmd = ["docker", "compose", "-f", COMPOSE_FILE, "up", "-d", "--wait", "postgres", "rabbitmq"]
    return subprocess.run(cmd).returncode == 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--database-url", help="default: CHATQ_DATABASE_URL of the settings")
    parser.add_argument("--amqp-url", help="default: CHATQ_AMQP_URL of the settings")
    parser.add_argument("--env-file", help="settings file read under the environment (make run: .env)")
    parser.add_argument("--rabbitmq-api-url", help="management API, needed by the test suite for vhosts")
    parser.add_argument("--create-database", action="store_true")
    parser.add_argument(
        "--start-with-compose", action="store_true", help="start missing services with docker compose"
    )
    args = parser.parse_args(argv)
    if not args.database_url or not args.amqp_url:
        from shared.settings import Settings

        settings = Settings(_env_file=args.env_file)  # type: ignore[call-arg]
        args.database_url = args.database_url or settings.database_url.get_secret_value()
        args.amqp_url = args.amqp_url or settings.amqp_url.get_secret_value()
    problems = _problems(args)
    if problems and args.start_with_compose and _start_with_compose():
        problems = _problems(args)
    for p in problems:
        print(f"preflight: {p}", file=sys.stderr)
    return 1 if problems else 0


def _problems(args: argparse.Namespace) -> list[str]:
    problems: list[str] = []
    pg = asyncio.run(_check_postgres(args.database_url, args.create_database))
    if pg:
        problems.append(pg)
    # CHATQ_AMQP_URL may list a cluster's nodes: one that answers is enough to start.
    nodes = [urlsplit(u) for u in args.amqp_url.split(",") if u.strip()]
    if not any(_tcp_open(n.hostname or "127.0.0.1", n.port or 5672) for n in nodes):
        where = ", ".join(redact_url(u.geturl()) for u in nodes)
        problems.append(f"RabbitMQ at {where} does not answer. Start it: {START_RABBITMQ}")
    elif args.rabbitmq_api_url:
        api = urlsplit(args.rabbitmq_api_url)
        try:
            httpx.get(
                urlunsplit(
                    (api.scheme, f"{api.hostname}:{api.port or 15672}", api.path + "/overview", "", "")
                ),
                auth=(api.username or "guest", api.password or "guest"),
                timeout=5,
            ).raise_for_status()
        except httpx.HTTPError as exc:
            problems.append(
                f"RabbitMQ's management API at {redact_url(args.rabbitmq_api_url)} does not answer ({exc}). "
                f"Enable it: {ENABLE_MANAGEMENT}"
            )
    return problems


if __name__ == "__main__":
    sys.exit(main())
