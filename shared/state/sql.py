"""Render the transition tables as SQL (``shared/functions/00_states.sql``): for each
aggregate, ``chatq_<name>_sources(target)`` (the statuses that may move to ``target``,
immutable so the planner folds it into a constant) and a trigger that refuses any status
change the table does not allow, whoever writes it. A unit test keeps the file equal to
this rendering (under its release line, shared/migrate.py); ``python -m shared.state``
rewrites it, with the next release when the rendering changed."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from . import account, job, operation
from .machine import Lifecycle

OUTPUT = Path(__file__).resolve().parent.parent / "functions" / "00_states.sql"

#: (SQL name, table, key column, status column, lifecycle)
TABLES: tuple[tuple[str, str, str, str, Lifecycle], ...] = (  # type: ignore[type-arg]
    ("operation", "operations", "id", "status", operation.LIFECYCLE),
    ("job", "reply_jobs", "id", "status", job.LIFECYCLE),
    ("delivery", "deliveries", "job_id", "status", job.DELIVERY),
    ("delivery_part", "delivery_parts", "job_id", "status", job.DELIVERY),
    ("account", "accounts", "account_id", "state", account.LIFECYCLE),
)


def _array(values: Sequence[str]) -> str:
    return "ARRAY[" + ", ".join(f"'{v}'" for v in values) + "]::text[]" if values else "'{}'::text[]"


def _one(name: str, table: str, key: str, column: str, lifecycle: Lifecycle) -> str:  # type: ignore[type-arg]
    cases = "\n".join(
        f"        WHEN '{s.value}' THEN {_array(lifecycle.sources(s))}"
        for s in lifecycle.states
        if lifecycle.sources(s)
    )
    return f"""
-- {lifecycle.aggregate}: the statuses that may move to p_to.
CREATE OR REPLACE FUNCTION chatq_{name}_sources(p_to text) RETURNS text[]
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT CASE p_to
{cases}
        ELSE '{{}}'::text[]
    END
$$;

CREATE OR REPLACE FUNCTION chatq_check_{name}_{column}() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NOT (OLD.{column} = ANY(chatq_{name}_sources(NEW.{column}))) THEN
        RAISE EXCEPTION '{lifecycle.aggregate} %: {column} % -> % is not allowed', NEW.{key}, OLD.{column}, NEW.{column}
            USING ERRCODE = 'check_violation';
    END IF;
    RETURN NEW;
END
$$;

CREATE OR REPLACE TRIGGER {table}_{column}_transition
    BEFORE UPDATE OF {column} ON {table}
    FOR EACH ROW WHEN (OLD.{column} IS DISTINCT FROM NEW.{column})
    EXECUTE FUNCTION chatq_check_{name}_{column}();
"""


def _may_have_sent() -> str:
    """``job.may_have_sent`` as SQL: one expression, so Postgres inlines it wherever it is
    called (a plain SQL function, immutable)."""
    return f"""
-- delivery: whether a send of the job may have reached the chat (shared/state/job.py
-- may_have_sent): its latest attempt's status is {" or ".join(job.MAY_HAVE_SENT)}, or an
-- earlier attempt's was, or a part of a reply in parts went out (maybe_sent). Such a job is
-- finished or handed to a person, never withdrawn nor failed: every step that may
-- withdraw or fail a job asks this, and nothing else.
CREATE OR REPLACE FUNCTION chatq_delivery_may_have_sent(p_status text, p_maybe_sent boolean) RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT coalesce(p_status = ANY({_array([s.value for s in job.MAY_HAVE_SENT])}), false)
        OR coalesce(p_maybe_sent, false)
$$;
"""


def render() -> str:
    head = (
        "-- Generated from shared/state (python -m shared.state): the transition tables of\n"
        "-- shared/state/operation.py, job.py and account.py. Do not edit by hand.\n"
    )
    return head + "".join(_one(*t) for t in TABLES) + _may_have_sent()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Render the status transition tables as SQL.")
    parser.add_argument("-o", "--output", type=Path, default=OUTPUT)
    args = parser.parse_args(argv)
    from shared.migrate import stamped

    previous = args.output.read_text() if args.output.exists() else None
    args.output.write_text(stamped(render(), previous))
    print(f"wrote {args.output}")
