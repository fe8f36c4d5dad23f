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

from shared.migrate import (
    FUNCTIONS_DIR,
    MIGRATIONS_DIR,
    body_digest,
    load_functions,
    load_migrations,
    read_header,
    stamp,
)

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
    (re.compile(r"\bDROP\s+(FUNCTION|PROCEDURE|ROUTINE)\b", re.I), "drops a function"),
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


# ---- SQL functions: forward only (design invariant I10) -----------------------------------


def test_every_function_file_carries_its_release_and_was_not_edited_since() -> None:
    """A function file's text changes only with a new release: the database keeps the
    newest release it was given, so an edit under the old number could be overwritten by,
    or overwrite, another build of that number."""
    stale = []
    for f in load_functions():
        header = read_header(f.sql)
        assert header.release >= 1, f"{f.name} has no '-- chatq:release N sha256:...' first line"
        if not header.current:
            stale.append(f.name)
    assert not stale, (
        f"{stale} changed since their release line was written: run `python -m shared.migrate --stamp` "
        "(it gives each the next release)"
    )


def _git(*args: str) -> str:
    import subprocess

    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        pytest.fail(
            f"git {' '.join(args)} failed ({done.stderr.strip()}): this check reads the function files' "
            "history; run it in a git clone with its history (not a shallow one)",
            pytrace=False,
        )
    return done.stdout


def function_file_history() -> dict[str, list[tuple[int, str]]]:
    """Every function file that ever carried a release line on this branch's history, and
    each (release, digest) it had, in commit order."""
    if _git("rev-parse", "--is-shallow-repository").strip() == "true":
        pytest.fail(
            "a shallow clone has no history to hold the releases against: fetch --unshallow", pytrace=False
        )
    seen: dict[str, list[tuple[int, str]]] = {}
    # Function files live in shared/functions and, since the stores became packages, in
    # stores/<aggregate>/functions: a file is known by its name wherever it lived.
    commits = _git("log", "--reverse", "--format=%H", "--", "shared/functions", "stores").split()
    for commit in commits:
        for name in _git("ls-tree", "-r", "--name-only", commit, "shared/functions/", "stores/").split():
            if not name.endswith(".sql") or not (
                name.startswith("shared/functions/") or "/functions/" in name
            ):
                continue
            header = read_header(_git("show", f"{commit}:{name}"))
            if header.release >= 1:
                seen.setdefault(Path(name).name, []).append((header.release, header.digest))
    return seen


def test_no_function_file_ever_goes_back_to_an_older_release_or_reuses_one_for_new_text() -> None:
    """Found by a review: a `git revert` of a function change brings back release N-1 with a
    valid digest; a database at release N keeps N's (broken) body, and the fix never
    applies. A file's release only goes up, and new text always takes a new release."""
    history = function_file_history()
    for f in load_functions():
        header = read_header(f.sql)
        earlier = history.get(f.name, [])
        if not earlier:
            continue
        top = max(release for release, _ in earlier)
        digests_at = {release: {d for r, d in earlier if r == release} for release, _ in earlier}
        assert header.release >= top, (
            f"{f.name} is release {header.release}, but release {top} of it was on this branch: a release "
            "never goes back; run `python -m shared.migrate --stamp` after bumping it past "
            f"{top} (a reverted change is a new release)"
        )
        if header.release == top:
            assert digests_at[top] == {header.digest}, (
                f"{f.name}: release {top} had other text on this branch: give the new text a new release"
            )


def test_no_function_file_that_carried_a_release_is_renamed_or_removed() -> None:
    """Found by a review: a renamed file's previous name, on a database that never saw it,
    lets the previous release's image put its older bodies back. Function files keep their
    names."""
    gone = sorted(set(function_file_history()) - {f.name for f in load_functions()})
    assert not gone, f"function files that carried a release are gone (renamed or removed): {gone}"


def test_no_function_file_drops_or_retypes_a_function() -> None:
    """The previous release's processes call its functions during a rollout and after a
    rollback (docs/deploying.md "Rolling back"): a function file keeps every signature it
    had. A new result type is a new function; a drop is a migration, one release after the
    last caller, marked ``-- chatq:destructive``. (CREATE OR REPLACE itself refuses to
    change a result type, so a drop is the only way a file could.)"""
    for f in load_functions():
        for number, line in enumerate(f.sql.splitlines(), start=1):
            code = line.split("--", 1)[0]
            assert not re.search(r"\bDROP\s+(FUNCTION|PROCEDURE|ROUTINE|TYPE)\b", code, re.I), (
                f"{f.name} line {number}: {line.strip()}"
            )


def test_stamping_gives_an_edited_file_the_next_release_and_leaves_the_others(tmp_path: Path) -> None:
    path = tmp_path / "10_a.sql"
    path.write_text("CREATE OR REPLACE FUNCTION a() RETURNS int LANGUAGE sql AS 'SELECT 1';\n")
    assert stamp(path) and read_header(path.read_text()).release == 1
    assert not stamp(path), "unchanged text keeps its release"
    path.write_text(path.read_text().replace("SELECT 1", "SELECT 2"))
    assert not read_header(path.read_text()).current
    assert stamp(path)
    header = read_header(path.read_text())
    assert (header.release, header.digest) == (2, body_digest(header.body))
    assert FUNCTIONS_DIR.is_dir()
