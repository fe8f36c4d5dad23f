"""Contract suites: one set of test bodies per store, each run against the store's
in-memory fake (``memory``) and its Postgres implementation (``postgres``). Where Postgres
takes a step two ways (one job's statement, or one statement for the jobs in flight
together), it runs both: ``postgres`` shares a connection among up to eight sessions,
``postgres-one-by-one`` gives each its own. A body that passes on one and fails on the
other is a fake that no longer says what Postgres does.

The ``memory`` runs need no service (``make check`` runs them); the Postgres ones take the
session's database like the integration tests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

MEMORY = "memory"
POSTGRES = "postgres"
ONE_BY_ONE = "postgres-one-by-one"


def backends(*names: str) -> Callable[[Any], Any]:
    """Parametrise a fixture over the named backends, each id its name; the Postgres ones
    are marked ``integration`` (``make check`` leaves them out with ``-m "not integration"``)."""
    params = [pytest.param(n, marks=[] if n == MEMORY else [pytest.mark.integration], id=n) for n in names]
    return pytest.fixture(params=params)


def postgres_pool(request: pytest.FixtureRequest) -> Any:
    """The session's pool, from empty tables (the integration tests' ``clean``): asked for
    only by the Postgres runs, so the memory runs need no database."""
    request.getfixturevalue("clean")
    return request.getfixturevalue("pool")
