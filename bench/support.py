"""What every benchmark needs: a fresh database and a private RabbitMQ vhost, removed
afterwards, so a run never leaves work behind for the services on this machine; and the
command line around a benchmark's run."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

import asyncpg
import httpx

from shared.migrate import migrate


def with_path(url: str, path: str) -> str:
    p = urlsplit(url)
    return urlunsplit((p.scheme, p.netloc, path, p.query, ""))


async def fresh_database(admin_url: str) -> tuple[str, str]:
    name = f"chatq_bench_{secrets.token_hex(3)}"
    conn = await asyncpg.connect(admin_url)
    await conn.execute(f'CREATE DATABASE "{name}"')
    await conn.close()
    url = with_path(admin_url, f"/{name}")
    conn = await asyncpg.connect(url)
    await migrate(conn)
    await conn.close()
    return name, url


async def drop_database(admin_url: str, name: str) -> None:
    conn = await asyncpg.connect(admin_url)
    await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    await conn.close()


@contextlib.asynccontextmanager
async def private_vhost(amqp_url: str, api_url: str) -> AsyncIterator[str]:
    """Yield an AMQP URL to a new vhost; delete the vhost afterwards."""
    vhost = f"chatq_bench_{secrets.token_hex(3)}"
    p = urlsplit(api_url)
    base = urlunsplit((p.scheme, f"{p.hostname}:{p.port or 15672}", p.path, "", ""))
    auth = (p.username or "guest", p.password or "guest")
    async with httpx.AsyncClient(auth=auth) as client:
        (await client.put(f"{base}/vhosts/{vhost}")).raise_for_status()
        (
            await client.put(
                f"{base}/permissions/{vhost}/{auth[0]}", json={"configure": ".*", "write": ".*", "read": ".*"}
            )
        ).raise_for_status()
    try:
        yield with_path(amqp_url, "/" + quote(vhost, safe=""))
    finally:
        async with httpx.AsyncClient(auth=auth) as client:
            await client.delete(f"{base}/vhosts/{vhost}")


def add_infra_arguments(parser: argparse.ArgumentParser) -> None:
    """Where the benchmark finds Postgres (an admin database) and RabbitMQ."""
    parser.add_argument("--admin-database-url", default="postgresql://postgres@127.0.0.1:5432/postgres")
    parser.add_argument("--amqp-url", default="amqp://guest:guest@127.0.0.1:5672/")
    parser.add_argument("--rabbitmq-api-url", default="http://guest:guest@127.0.0.1:15672/api")


RESULTS = Path(__file__).resolve().parent / "results"


def add_setting_argument(parser: argparse.ArgumentParser) -> None:
    """``--setting NAME=VALUE``: a setting of chatqueue's services for the run, repeatable."""
    parser.add_argument(
        "--setting",
        type=lambda v: tuple(v.split("=", 1)),
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a setting of chatqueue's services for this run (e.g. responder_concurrency=32), repeatable",
    )


def bench_main(
    doc: str | None,
    add_arguments: Callable[[argparse.ArgumentParser], None],
    run: Callable[[argparse.Namespace], Awaitable[dict[str, Any]]],
    result_file: str,
) -> None:
    """``python -m bench.<step>``: parse the step's arguments, run it, write its JSON."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    result = asyncio.run(run(parser.parse_args()))  # type: ignore[arg-type]
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / result_file).write_text(json.dumps(result, indent=2, default=str))
