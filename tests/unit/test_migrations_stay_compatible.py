"""Upgrades without downtime: during a rollout the previous release's pods run against
the new schema (docs/deploying.md "Upgrades without downtime"), so a migration must keep working for
the code one release back. Statements that break it - dropping or renaming a table or
column, changing a column's type, adding NOT NULL, emptying a table - need a marker
comment in the same statement saying why it is safe now (typically: the previous
release already stopped using it):

    -- chatq:destructive the previous release (0.3) no longer reads reply_jobs.legacy
    ALTER TABLE reply_jobs DROP COLUMN legacy;
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from shared.migrate import MIGRATIONS_DIR, load_migrations

pytestmark = pytest.mark.unit

# Migrations up to this version were released before the rule (0008 adds a NOT NULL that
# every release since 0001 already satisfied); an applied file can never be edited.
LAST_BEFORE_THE_RULE = 9
MARKER = re.compile(r"--\s*chatq:destructive\s+\S")
DESTRUCTIVE = [
    (re.compile(r"\bDROP\s+COLUMN\b", re.I), "drops a column"),
    (
        re.compile(
            r"\bALTER\s+TABLE\b.*\bDROP\s+(?!CONSTRAINT|DEFAULT|NOT\s+NULL|IDENTITY|EXPRESSION)\w", re.I
        ),
        "drops a column",
    ),
    (re.compile(r"\bDROP\s+(TABLE|VIEW|MATERIALIZED\s+VIEW|SCHEMA)\b", re.I), "drops a table"),
    (re.compile(r"\bRENAME\b", re.I), "renames a table, column or constraint"),
    (re.compile(r"\bALTER\s+COLUMN\b.*\b(TYPE|SET\s+DATA\s+TYPE)\b", re.I), "changes a column's type"),
    (re.compile(r"\bSET\s+NOT\s+NULL\b", re.I), "makes a column NOT NULL"),
    (re.compile(r"\bTRUNCATE\b", re.I), "empties a table"),
]


def unmarked_destructive_statements(sql: str) -> list[str]:
    """Each line of ``sql`` holding a destructive statement with no marker comment in the
    same statement, as 'line N: what it does'."""
    problems: list[str] = []
    statement: list[str] = []
    for number, line in enumerate(sql.splitlines(), start=1):
        statement.append(line)
        code = line.split("--", 1)[0]
        for pattern, what in DESTRUCTIVE:
            if pattern.search(code) and not any(MARKER.search(s) for s in statement):
                problems.append(f"line {number}: {what}")
                break
        if code.rstrip().endswith(";"):
            statement = []
    return problems


def test_every_new_migration_keeps_the_previous_release_working_or_says_why_not() -> None:
    new = [m for m in load_migrations() if m.version > LAST_BEFORE_THE_RULE]
    problems = {
        f"{m.version:04d}_{m.name}.sql": found
        for m in new
        if (found := unmarked_destructive_statements(m.sql))
    }
    assert not problems, (
        f"{problems}. The previous release still runs during a rollout: split the change over "
        "two releases, or mark the statement with '-- chatq:destructive <why it is safe now>'"
    )


def test_the_scan_finds_each_destructive_statement_and_accepts_a_marked_one() -> None:
    sql = """
CREATE TABLE fresh (id int);
ALTER TABLE reply_jobs DROP COLUMN legacy;
ALTER TABLE chats RENAME COLUMN a TO b;
ALTER TABLE operations ALTER COLUMN text TYPE varchar(10);
ALTER TABLE operations ALTER COLUMN note SET NOT NULL;
DROP TABLE old_things;
TRUNCATE sandbox_replies;
ALTER TABLE chats DROP CONSTRAINT chats_fkey;
-- chatq:destructive 0.3 no longer reads it
ALTER TABLE reply_jobs
    DROP COLUMN other;
"""
    assert unmarked_destructive_statements(sql) == [
        "line 3: drops a column",
        "line 4: renames a table, column or constraint",
        "line 5: changes a column's type",
        "line 6: makes a column NOT NULL",
        "line 7: drops a table",
        "line 8: empties a table",
    ]


def test_the_rule_starts_after_the_last_migration_released_before_it() -> None:
    """Every migration from before the rule is in the repository unchanged, so the rule
    applies to every file added since; the marker is documented where developers look."""
    versions = [m.version for m in load_migrations()]
    assert LAST_BEFORE_THE_RULE in versions
    assert (MIGRATIONS_DIR / "0009_accounts.sql").exists()
    assert "chatq:destructive" in (Path(__file__).resolve().parents[2] / "docs" / "deploying.md").read_text()
