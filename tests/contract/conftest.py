"""Contract suites: one set of test bodies per store, each run against the store's
in-memory fake (``memory``) and its Postgres implementation (``postgres``). Where Postgres
defines a step twice (the jobs' batch functions, one statement for every job taking the
step together, beside the per-job ones they fall back to), the suite runs both:
``postgres`` with the batch functions and up to eight sessions on a connection,
``postgres-own-connection`` with the batch functions and a connection each,
``postgres-per-job`` with the per-job functions. A body that passes on one and fails on
another is a fake, or a twin definition, that no longer says what the others do.

The ``memory`` runs need no service (``make check`` runs them); the Postgres ones are marked
``integration`` and take the session's database and vhost like the integration tests (their
``clean`` empties the tables and the queues): ``make integration`` and ``make test`` run
them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

MEMORY = "memory"
POSTGRES = "postgres"
OWN_CONNECTION = "postgres-own-connection"
PER_JOB = "postgres-per-job"


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
