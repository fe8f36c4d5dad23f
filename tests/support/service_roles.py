"""An opt-in way to run the integration tests with each in-process service on its own
Postgres role (shared/roles.py), as a deployment does: ``CHATQ_TEST_SERVICE_ROLES=1``.

The session's database then belongs to a role of its own, with a login role per service
named after it; the session's migration run grants them. The tests' own connections stay
the superuser's (they read and poke any table); ``as_service`` gives a service's settings
its role's URL and no migration, when they point at the session's database."""

from __future__ import annotations

import os
import secrets
from urllib.parse import urlsplit, urlunsplit

import asyncpg

from shared.roles import SERVICES, role_name
from shared.settings import Settings

#: The session's database URL and each service's, when the mode is on.
_URLS: dict[str, str] = {}


def enabled() -> bool:
    return os.environ.get("CHATQ_TEST_SERVICE_ROLES", "") not in ("", "0")


async def make_service_roles(admin_url: str, database_url: str) -> str:
    """Give the session's database an owner and a role per service; return the owner
    (``drop_service_roles`` once the database is gone)."""
    owner = f"chatq_roles_{secrets.token_hex(4)}"
    password = secrets.token_urlsafe(18)
    database = urlsplit(database_url).path.lstrip("/")
    await run_as(
        admin_url,
        f'CREATE ROLE "{owner}" NOLOGIN',
        f'ALTER DATABASE "{database}" OWNER TO "{owner}"',
        *(f"CREATE ROLE \"{role_name(owner, s)}\" LOGIN PASSWORD '{password}'" for s in SERVICES),
    )
    parts = urlsplit(database_url)
    _URLS["session"] = database_url
    for service in SERVICES:
        netloc = f"{role_name(owner, service)}:{password}@{parts.hostname}:{parts.port or 5432}"
        _URLS[service] = urlunsplit((parts.scheme, netloc, parts.path, "", ""))
    return owner


async def drop_service_roles(admin_url: str, owner: str) -> None:
    _URLS.clear()
    await run_as(
        admin_url, *(f'DROP ROLE IF EXISTS "{r}"' for r in [*(role_name(owner, s) for s in SERVICES), owner])
    )


async def run_as(url: str, *statements: str) -> None:
    """Each statement in turn, on a connection of its own to ``url``."""
    conn = await asyncpg.connect(url)
    try:
        for statement in statements:
            await conn.execute(statement)
    finally:
        await conn.close()


def as_service(settings: Settings, service: str) -> Settings:
    """``settings`` for ``service``: on its own role when the mode is on and they point at
    the session's database; else as they are."""
    url = _URLS.get(service)
    if url is None or settings.database_url.get_secret_value() != _URLS.get("session"):
        return settings
    return Settings(**{**settings.model_dump(), "database_url": url, "migrate_on_start": False})
