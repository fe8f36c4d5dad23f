"""Least privilege in Postgres: a role per service, with only the grants it uses.

The migration runner connects as the database's owner (deploy/postgres/initdb: ``chatq``),
which owns the schema and every table. Each service connects as a role of its own, named
after the owner: ``<owner>_receiver``, ``<owner>_coalescer``, ``<owner>_responder``
(``chatq_receiver`` ...). Whoever creates the roles (the init script, or a person on a
managed Postgres) gives them LOGIN and a password and nothing else; every migration run
(``shared.migrate``) then sets their privileges to exactly ``GRANTS`` in one transaction:
everything revoked, then CONNECT, USAGE on the schema, the sequences, and each table's
privileges below. A role that does not exist is skipped; one created later gets its grants
at the next migration run.

The functions in shared/functions run with the caller's privileges (none is SECURITY
DEFINER), so a service's grants cover the tables of every function it calls: a seller's
message withdraws pending replies from the receiver (chatq_seller_wrote), so the receiver
updates reply_jobs, and the Avito poll runs in the receiver with the responder's Avito
client, so it keeps the shared tokens and request budgets. What no grant gives: DDL,
TRUNCATE, a table's rows deleted by any service but the one that owns their lifetime
(retention is the coalescer's), and a service's writes into another's tables where it
has none (the receiver creates no reply job, window or delivery; the responder stores no
buyer message and publishes nothing through the outbox; the coalescer reads no
credentials and changes no account).
"""

from __future__ import annotations

import logging

import asyncpg

logger = logging.getLogger(__name__)

SERVICES = ("receiver", "coalescer", "responder")

SEL, INS, UPD, DEL = "SELECT", "INSERT", "UPDATE", "DELETE"

#: What every service reads to know the schema it runs on (``shared.migrate --wait``).
_SCHEMA = {"schema_migrations": (SEL,), "schema_functions": (SEL,), "schema_function_releases": (SEL,)}

#: Table -> privileges, per service. "table(-a, b)" grants every column of the table but
#: a and b (columns added later are granted at the next migration run).
GRANTS: dict[str, dict[str, tuple[str, ...]]] = {
    "receiver": {
        **_SCHEMA,
        # Webhooks stored with their events, the relay's outbox, and what a buyer's or a
        # seller's message changes in its chat (chatq_seller_wrote, chatq_record_echo).
        "operations": (SEL, INS, UPD),
        "operation_events": (SEL, INS),
        "outbox": (SEL, INS, UPD, DEL),
        "chats": (SEL, INS, UPD),
        "chat_windows": (SEL, UPD, DEL),
        "window_messages": (SEL, UPD, DEL),
        "reply_jobs": (SEL, UPD),
        "reply_coverage": (SEL, DEL),
        "deliveries": (SEL, UPD),
        "delivery_parts": (SEL,),
        "reply_echoes": (SEL, INS),
        "telegram_business_connections": (SEL, INS, UPD),
        # The accounts API and the environment's accounts recorded at start.
        "accounts": (SEL, INS, UPD),
        # The Avito poll (services/receiver/recovery.py) with the responder's Avito client.
        "avito_poll_accounts": (SEL, INS, UPD),
        "avito_poll_chats": (SEL, INS, UPD),
        "platform_tokens": (SEL, INS, UPD, DEL),
        "platform_budgets": (SEL, INS, UPD),
        # The sandbox chat page reads the bot's answers.
        "sandbox_replies": (SEL,),
    },
    "coalescer": {
        **_SCHEMA,
        # Filing buyer messages into windows, emitting reply jobs through the outbox, the
        # sweeper, the relay, and retention (it alone deletes finished rows).
        "operations": (SEL, UPD, DEL),
        "operation_events": (SEL, INS),
        "outbox": (SEL, INS, UPD, DEL),
        "chats": (SEL, INS, UPD),
        "chat_windows": (SEL, INS, UPD, DEL),
        "window_messages": (SEL, INS, UPD, DEL),
        "reply_jobs": (SEL, INS, UPD, DEL),
        "reply_coverage": (SEL, DEL),
        "deliveries": (SEL, DEL),
        "reply_echoes": (SEL, DEL),
        "chat_listings": (SEL, DEL),
        "sandbox_replies": (SEL, DEL),
        "avito_poll_chats": (SEL, DEL),
        "dead_letters": (SEL, INS, DEL),
        # The fair share and each account's overrides; never its credentials.
        "accounts(-credentials, webhook_key)": (SEL,),
    },
    "responder": {
        **_SCHEMA,
        # Claiming reply jobs, sending, recording what was sent; an account the platform
        # refused is paused.
        "reply_jobs": (SEL, UPD),
        "operations": (SEL, UPD),
        "operation_events": (SEL, INS),
        "chats": (SEL, INS, UPD),
        "chat_windows": (SEL, UPD, DEL),
        "window_messages": (SEL, UPD, DEL),
        "reply_coverage": (SEL, INS, UPD, DEL),
        "deliveries": (SEL, INS, UPD),
        "delivery_parts": (SEL, INS, UPD),
        "reply_echoes": (SEL,),
        "telegram_business_connections": (SEL, INS, UPD),
        "chat_listings": (SEL, INS, UPD),
        "platform_tokens": (SEL, INS, UPD, DEL),
        "platform_budgets": (SEL, INS, UPD),
        "sandbox_replies": (SEL, INS),
        "dead_letters": (INS,),
        # Pausing an account the platform refused (its row made first if the environment's).
        "accounts": (SEL, INS, UPD),
    },
}


def role_name(owner: str, service: str) -> str:
    """The role ``service`` connects as, in a database owned by ``owner``."""
    return f"{owner}_{service}"


async def apply_grants(conn: asyncpg.Connection) -> list[str]:
    """Set each existing service role's privileges to ``GRANTS`` (run by the migration
    runner as the owner, after the migrations); return the roles set."""
    owner = await conn.fetchval(
        "SELECT pg_get_userbyid(datdba) FROM pg_database WHERE datname = current_database()"
    )
    present = {
        r["rolname"]
        for r in await conn.fetch(
            "SELECT rolname FROM pg_roles WHERE rolname = ANY($1::text[])",
            [role_name(owner, s) for s in SERVICES],
        )
    }
    done = []
    database = await conn.fetchval("SELECT current_database()")
    tables = {
        r["relname"]
        for r in await conn.fetch(
            "SELECT relname FROM pg_class WHERE relnamespace = current_schema()::regnamespace AND relkind = 'r'"
        )
    }
    for service in SERVICES:
        role = role_name(owner, service)
        if role not in present:
            continue
        async with conn.transaction():
            await conn.execute(f"REVOKE ALL ON ALL TABLES IN SCHEMA public FROM {_quote(role)}")
            await conn.execute(f"REVOKE ALL ON ALL SEQUENCES IN SCHEMA public FROM {_quote(role)}")
            await conn.execute(f"GRANT CONNECT ON DATABASE {_quote(database)} TO {_quote(role)}")
            await conn.execute(f"GRANT USAGE ON SCHEMA public TO {_quote(role)}")
            await conn.execute(f"GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA public TO {_quote(role)}")
            for table, privileges in GRANTS[service].items():
                name, _, columns = table.partition("(")
                if name not in tables:
                    continue  # schema_functions before the first function file, say
                if columns:
                    left_out = {c.strip().lstrip("-") for c in columns.rstrip(")").split(",")}
                    kept = [c for c in await _columns(conn, name) if c not in left_out]
                    listed = ", ".join(_quote(c) for c in kept)
                    what = ", ".join(f"{p} ({listed})" for p in privileges)
                else:
                    what = ", ".join(privileges)
                await conn.execute(f"GRANT {what} ON {_quote(name)} TO {_quote(role)}")
        done.append(role)
    if done:
        logger.info("service roles granted: %s", ", ".join(done))
    return done


async def _columns(conn: asyncpg.Connection, table: str) -> list[str]:
    rows = await conn.fetch(
        "SELECT attname FROM pg_attribute WHERE attrelid = to_regclass($1) AND attnum > 0 AND NOT attisdropped"
        " ORDER BY attnum",
        table,
    )
    return [r["attname"] for r in rows]


def _quote(identifier: str) -> str:
    return '"' + identifier.replace('"', '""') + '"'
