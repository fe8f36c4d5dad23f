"""Fixtures shared by every test layer. Service fixtures connect only when a test asks
for them, so ``tests/unit`` runs without Postgres or RabbitMQ."""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest

from shared.broker.connection import BrokerConnection
from shared.broker.topology import build_topology
from shared.db import create_pool
from shared.migrate import migrate
from shared.settings import Settings
from tests.fakes.platforms import running_fakes
from tests.fakes.world import FakeWorld
from tests.support import service_roles
from tests.support.broker import QueueInspector
from tests.support.infra import Infra, InfraUnavailable, provision_infra

TELEGRAM_SECRET = "tg-secret-for-tests"
AVITO_SECRET = "avito-path-secret-for-tests"
GENERIC_SECRET = "whsec_" + base64.b64encode(b"generic-secret-for-tests-0123456").decode()
ADMIN_TOKEN = "admin-token-for-tests"
TEST_TOPOLOGY = build_topology()
ALL_QUEUES = tuple(q.name for q in TEST_TOPOLOGY.queues)


@pytest.fixture(scope="session")
async def infra() -> AsyncIterator[Infra]:
    owner: tuple[str, str] | None = None
    try:
        async with provision_infra() as provisioned:
            if service_roles.enabled():
                made = await service_roles.make_service_roles(
                    provisioned.admin_database_url, provisioned.database_url
                )
                owner = (provisioned.admin_database_url, made)
            conn = await asyncpg.connect(provisioned.database_url)
            try:
                await migrate(conn)
            finally:
                await conn.close()
            broker = BrokerConnection(provisioned.amqp_url, TEST_TOPOLOGY, name="chatq-tests")
            await broker.connect()  # declares the topology in the session's vhost
            await broker.close()
            yield provisioned
    except InfraUnavailable as exc:
        pytest.fail(str(exc), pytrace=False)
    finally:
        if owner is not None:
            await service_roles.drop_service_roles(*owner)


def make_settings(infra: Infra, **overrides: Any) -> Settings:
    values: dict[str, Any] = {
        "database_url": infra.database_url,
        "amqp_url": infra.amqp_url,
        "telegram_webhook_secret": TELEGRAM_SECRET,
        "telegram_bot_token": "4242:test-token",
        "avito_webhook_secret": AVITO_SECRET,
        "generic_webhook_secret": GENERIC_SECRET,
        "admin_token": ADMIN_TOKEN,
        "relay_poll_seconds": 0.2,
        "database_pool_size": 12,
    }
    values.update(overrides)
    return Settings(**values)


@pytest.fixture
async def world(request: pytest.FixtureRequest) -> AsyncIterator[FakeWorld]:
    """The fake platforms, model and alert sink on a local port (tests/fakes). A test
    whose code sent Telegram or Avito a request their documents do not allow fails here,
    unless it is marked ``spec_violations_expected`` (it sends bad requests on purpose)."""
    async with running_fakes() as w:
        yield w
    if w.violations and request.node.get_closest_marker("spec_violations_expected") is None:
        listed = "\n".join(f"  - {v}" for v in w.violations)
        pytest.fail(f"requests or answers the platforms' documents do not allow:\n{listed}", pytrace=False)


@pytest.fixture
def settings(infra: Infra) -> Settings:
    return make_settings(infra)


@pytest.fixture(scope="session")
async def pool(infra: Infra) -> AsyncIterator[asyncpg.Pool]:
    p = await create_pool(infra.database_url, size=8)
    yield p
    await p.close()


@pytest.fixture(scope="session")
async def queues(infra: Infra) -> AsyncIterator[QueueInspector]:
    inspector = QueueInspector(infra.amqp_url)
    yield inspector
    await inspector.close()


@pytest.fixture
async def clean(pool: asyncpg.Pool, queues: QueueInspector) -> None:
    """Start a test from empty tables and empty queues."""
    await pool.execute(
        "TRUNCATE operations, outbox, chat_windows, window_messages, reply_jobs, reply_coverage, deliveries, chats,"
        " operation_events, dead_letters, sandbox_replies, accounts, platform_tokens, delivery_parts, chat_listings,"
        " telegram_business_connections, avito_poll_accounts, avito_poll_chats, platform_budgets, reply_echoes"
        " RESTART IDENTITY CASCADE"
    )
    await queues.purge(*ALL_QUEUES)


def replace(settings: Settings, **changes: Any) -> Settings:
    """A validated copy of settings with some values changed (model_copy skips validation)."""
    return Settings(**{**settings.model_dump(), **changes})


#: Seconds into a test past which every asyncio task's stack is printed (pytest-timeout
#: fails the test at 300 s and shows only threads; a hang in a coroutine shows here).
HANG_REPORT_SECONDS = 200


@pytest.fixture(autouse=True)
async def _report_a_hang(request: pytest.FixtureRequest) -> AsyncIterator[None]:
    """A test still running after HANG_REPORT_SECONDS prints what every task awaits: a
    rare hang seen once in a full run (no log, no stack of the coroutine) names itself."""
    import asyncio
    import io

    def report() -> None:
        out = io.StringIO()
        for task in asyncio.all_tasks():
            print(f"--- task {task.get_name()} ({task.get_coro()!r})", file=out)
            task.print_stack(limit=12, file=out)
        print(
            f"\n+++ {request.node.nodeid} still running after {HANG_REPORT_SECONDS} s; tasks:\n{out.getvalue()}"
        )

    handle = asyncio.get_running_loop().call_later(HANG_REPORT_SECONDS, report)
    try:
        yield
    finally:
        handle.cancel()
