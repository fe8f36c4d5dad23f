"""The README and docs/ say only what the code does: every setting is in the
configuration table (docs/configuration.md) and every row of it is a setting, and the
README's ten settings are rows of it; every metric they name is exported and every
exported metric is in the metrics table (docs/operations.md); every ``make`` target and
``chatq`` command they show exists; every link to docs/ and every #anchor resolves."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from chatq.cli import parser
from shared.roles import SERVICES, role_name
from shared.settings import Settings
from tests.support.source import python_files

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
CONFIGURATION = ROOT / "docs" / "configuration.md"
OPERATIONS = ROOT / "docs" / "operations.md"
PAGES = [README, *DOCS]

FENCE = re.compile(r"^ *```.*?^ *```", re.M | re.S)
CODE_SPAN = re.compile(r"`([^`\n]+)`")
METRIC_DEFINITION = re.compile(r"\b(?:Counter|Gauge|Histogram|Summary)\(\s*\"(chatq_[a-z0-9_]+)\"", re.S)
SQL_FUNCTION = re.compile(r"(?:FUNCTION|TYPE)\s+(?:public\.)?(chatq_[a-z0-9_]+)", re.I)
CHATQ_NAME = re.compile(r"\bchatq_[a-z0-9_]+\b")
LINK = re.compile(r"\]\(([^)\s]+)\)")


def text(page: Path) -> str:
    return page.read_text(encoding="utf-8")


def code_of(page: Path) -> str:
    """What a reader would type: fenced blocks and `code spans`."""
    body = text(page)
    return "\n".join([*FENCE.findall(body), *CODE_SPAN.findall(FENCE.sub("", body))])


def section(page: Path, heading: str) -> str:
    """The text under ``heading`` (a whole line, such as ``## Every setting``) up to the next heading."""
    parts = text(page).split(f"\n{heading}\n", 1)
    assert len(parts) == 2, f"{page.name} has no {heading!r}"
    return parts[1].split("\n#", 1)[0]


def setting_rows(table: str) -> list[list[str]]:
    """The setting names in the first column of each row of a settings table."""
    return [
        re.findall(r"CHATQ_[A-Z0-9_]+", line.split("|")[1])
        for line in table.splitlines()
        if line.startswith("| CHATQ_")
    ]


def configuration_table() -> list[str]:
    """The setting names in the first column of the configuration table (docs/configuration.md)."""
    return [name for row in setting_rows(section(CONFIGURATION, "## Every setting")) for name in row]


def test_the_docs_have_a_configuration_table_with_rows() -> None:
    assert len(configuration_table()) > 40


def test_every_setting_is_in_the_configuration_table_and_every_row_is_a_setting() -> None:
    settings = {f"CHATQ_{name.upper()}" for name in Settings.model_fields}
    table = configuration_table()
    assert sorted(settings - set(table)) == [], "settings missing from the configuration table"
    assert sorted(set(table) - settings) == [], "the configuration table lists what is not a setting"
    assert len(table) == len(set(table)), "a setting is listed twice"


def test_the_readme_has_ten_settings_and_each_is_in_the_configuration_table() -> None:
    rows = setting_rows(section(README, "## The ten settings a seller touches"))
    assert len(rows) == 10, "the README's short table has ten rows"
    named = [name for row in rows for name in row]
    assert sorted(set(named) - set(configuration_table())) == [], "the README names a setting the table lacks"
    assert len(named) == len(set(named)), "a setting is listed twice"


def test_every_chatq_variable_the_pages_name_is_a_setting() -> None:
    settings = {f"CHATQ_{name.upper()}" for name in Settings.model_fields}
    # The test suite's own variables, and compose's (deploy/.env.example: CHATQ_DB_PASSWORD).
    compose = set(re.findall(r"^(CHATQ_[A-Z0-9_]+)=", (ROOT / "deploy/.env.example").read_text(), re.M))
    for page in PAGES:
        named = set(re.findall(r"\bCHATQ_[A-Z0-9_]*[A-Z0-9]\b", text(page)))
        unknown = {n for n in named - settings - compose if not n.startswith("CHATQ_TEST_")}
        assert sorted(unknown) == [], f"{page.name} names settings that do not exist"


def exported_metrics() -> set[str]:
    names: set[str] = set()
    for source in python_files():
        names |= set(METRIC_DEFINITION.findall(source.read_text(encoding="utf-8")))
    return names


def sql_functions() -> set[str]:
    """The SQL functions and types, named chatq_ like the metrics."""
    names: set[str] = set()
    for source in [*(ROOT / "shared").rglob("*.sql"), *(ROOT / "stores").rglob("*.sql")]:
        names |= set(SQL_FUNCTION.findall(source.read_text(encoding="utf-8")))
    return names


def test_the_code_exports_metrics_to_compare_with() -> None:
    assert {"chatq_webhooks_total", "chatq_retries_total", "chatq_backlog"} <= exported_metrics()


def test_every_metric_the_pages_name_is_exported_and_every_exported_metric_is_in_the_metrics_table() -> None:
    exported = exported_metrics()
    # The services' Postgres roles (chatq_receiver, ...) are named chatq_ too.
    not_metrics = sql_functions() | {role_name("chatq", s) for s in SERVICES}
    for page in PAGES:
        named = {
            re.sub(r"_(bucket|sum|count)$", "", n) if n not in exported else n
            for n in CHATQ_NAME.findall(text(page))
            if n not in not_metrics and not n.startswith("chatq_test_")
        }
        assert sorted(named - exported) == [], f"{page.name} names metrics the code does not export"
    table = section(OPERATIONS, "## Metrics")
    in_table = {
        row.split("|")[1].strip().split("{")[0] for row in table.splitlines() if row.startswith("| chatq_")
    }
    assert sorted(exported - in_table) == [], "exported metrics missing from the metrics table"
    assert sorted(in_table - exported) == [], "the metrics table lists what is not exported"


def make_targets() -> set[str]:
    makefile = (ROOT / "Makefile").read_text()
    return set(re.findall(r"^([a-z][a-z0-9-]*):", makefile, re.M))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_make_target_the_page_shows_exists(page: Path) -> None:
    shown = set(re.findall(r"(?<![\w-])make ([a-z][a-z0-9-]*)", code_of(page)))
    if page == README:
        assert {"run", "test", "demo", "bench", "soak", "chaos"} <= shown, "the check reads nothing"
    assert sorted(shown - make_targets()) == [], f"{page.name} shows make targets the Makefile lacks"


def chatq_commands() -> set[str]:
    sub = next(a for a in parser()._actions if isinstance(a, argparse._SubParsersAction))
    return set(sub.choices)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_chatq_command_the_page_shows_exists(page: Path) -> None:
    code = code_of(page)
    # `chatq stats`, `$ chatq doctor`, `-- chatq list`, `.venv/bin/chatq migrate`; not `--env-file`.
    shown = set(re.findall(r"(?<![\w-])chatq(?: --env-file \S+)? ([a-z][a-z-]*)", code))
    if page == README:
        assert {"status", "show", "retry", "resolve", "stats", "connect", "doctor"} <= shown
    assert sorted(shown - chatq_commands()) == [], f"{page.name} shows chatq commands that do not exist"


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    seen: dict[str, int] = {}
    result: set[str] = set()
    for heading in re.findall(r"^#{1,6} (.+)$", FENCE.sub("", text(page)), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        result.add(slug if n == 0 else f"{slug}-{n}")
    return result


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_local_link_and_anchor_resolves(page: Path) -> None:
    broken = []
    for target in LINK.findall(FENCE.sub("", text(page))):
        if re.match(r"^[a-z]+:", target):
            continue  # https://, mailto:
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(target)
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(target)
    assert broken == [], f"{page.name} links to what does not exist"


def test_the_readme_links_every_page_of_docs() -> None:
    linked = {t.split("#")[0] for t in LINK.findall(text(README))}
    assert sorted(f"docs/{d.name}" for d in DOCS if f"docs/{d.name}" not in linked) == []
    assert DOCS, "the reference parts live in docs/"
