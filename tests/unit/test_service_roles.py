"""shared/roles.py: each service's Postgres role is granted the tables it uses, and a table
a new migration adds is not forgotten (the services would be refused it in production)."""

from __future__ import annotations

import re

from shared.migrate import load_migrations
from shared.roles import GRANTS, SERVICES


def tables_of_the_migrations() -> set[str]:
    created: set[str] = set()
    for m in load_migrations():
        created |= set(re.findall(r"CREATE TABLE (?:IF NOT EXISTS )?(\w+)", m.sql, re.I))
        created -= set(re.findall(r"DROP TABLE (?:IF EXISTS )?(\w+)", m.sql, re.I))
    return created


def granted(service: str) -> dict[str, tuple[str, ...]]:
    return {table.partition("(")[0]: privileges for table, privileges in GRANTS[service].items()}


def test_every_table_the_migrations_create_is_granted_to_some_service() -> None:
    named = set().union(*(granted(s) for s in SERVICES))
    assert tables_of_the_migrations() - named == set(), "a table no service's role may touch"
    assert named - tables_of_the_migrations() - {"schema_migrations", "schema_functions",
                                                  "schema_function_releases"} == set()  # fmt: skip


def test_no_role_is_granted_more_than_rows_and_only_the_coalescer_deletes_buyer_messages() -> None:
    for service in SERVICES:
        for privileges in GRANTS[service].values():
            assert set(privileges) <= {"SELECT", "INSERT", "UPDATE", "DELETE"}
    assert "DELETE" in granted("coalescer")["operations"]
    assert "DELETE" not in granted("receiver")["operations"]
    assert "operations" not in granted("responder") or "INSERT" not in granted("responder")["operations"]


def test_the_coalescer_reads_accounts_without_their_credentials() -> None:
    (key,) = [t for t in GRANTS["coalescer"] if t.startswith("accounts")]
    assert key == "accounts(-credentials, webhook_key)"
