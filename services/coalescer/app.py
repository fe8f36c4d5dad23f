"""The coalescer's composition root: builds every part from the settings, runs them
until SIGTERM, then drains (stop consuming, finish and ack in-flight messages, let the
relay publish what was emitted, close)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Callable

import httpx

from shared import metrics
from shared.accounts import AccountRegistry
from shared.alerts import Alerter
from shared.broker.connection import BrokerConnection
from shared.broker.consumer import Consumer
from shared.broker.dead_letters import DeadLetterRecorder
from shared.broker.topology import COALESCER_DEAD_QUEUE, COALESCER_QUEUE, JOBS_EXCHANGE, build_topology
from shared.db import create_pool
from shared.lifecycle import every, freeze_startup_heap
from shared.migrate import migrate_dsn
from shared.ops_http import consumer_readiness, ops_server
from shared.outbox import Relay
from shared.retention import Retention
from shared.settings import Settings

from .service import Coalescer
from .sweeper import JobSweeper
from .windows import WindowPolicy

logger = logging.getLogger(__name__)


def policy_from(settings: Settings) -> WindowPolicy:
    return WindowPolicy(
        quiet=settings.quiet_seconds,
        delay_min=settings.reply_delay_min_seconds,
        delay_max=settings.reply_delay_max_seconds,
        max_wait=settings.max_wait_seconds,
    )


def account_policies(settings: Settings, registry: AccountRegistry) -> Callable[[str, str], WindowPolicy]:
    """Each account's window policy: the global one, with the account's reply pause range."""
    default = policy_from(settings)

    def policy_for(platform: str, account_id: str) -> WindowPolicy:
        account = registry.get(platform, account_id)
        low = account.override("reply_delay_min_seconds") if account else None
        high = account.override("reply_delay_max_seconds") if account else None
        if low is None and high is None:
            return default
        low = default.delay_min if low is None else low
        high = max(low, default.delay_max if high is None else high)
        return dataclasses.replace(default, delay_min=low, delay_max=high)

    return policy_for


async def run(settings: Settings, stop: asyncio.Event) -> None:
    dsn = settings.database_url.get_secret_value()
    if settings.migrate_on_start:
        await migrate_dsn(dsn)
    metrics.create_known_series("coalescer")
    pool = await create_pool(dsn, size=settings.database_pool_size)
    registry = AccountRegistry.from_settings(pool, settings)
    await registry.start()
    topology = build_topology(settings.retry_delays())
    amqp = settings.amqp_url.get_secret_value()
    # Separate connections: a consumer's flow control never blocks the relay's publishes.
    consume_broker = BrokerConnection(amqp, topology, name="chatq-coalescer")
    relay_broker = BrokerConnection(amqp, topology, name="chatq-coalescer-relay")
    relay = Relay.from_settings(pool, relay_broker, settings, exchanges=[JOBS_EXCHANGE])
    http = httpx.AsyncClient(timeout=10)
    coalescer = Coalescer(
        pool,
        policy_from(settings),
        policy_for=account_policies(settings, registry),
        account_jobs=settings.account_jobs_in_flight,
        on_jobs_emitted=relay.notify,
        alerter=Alerter(
            settings.alert_webhook_url,
            settings.alert_webhook_secret.get_secret_value() if settings.alert_webhook_secret else None,
            http,
        ),
        owner=settings.review_owner,
        caps=settings.job_caps(),
    )
    consumer = Consumer(
        consume_broker,
        COALESCER_QUEUE,
        coalescer.handle,
        prefetch=settings.coalescer_prefetch,
        on_give_up=coalescer.give_up,
        delivery_limit=topology.queue(COALESCER_QUEUE).delivery_limit,
    )
    dead = Consumer(
        consume_broker,
        COALESCER_DEAD_QUEUE,
        DeadLetterRecorder(pool, COALESCER_DEAD_QUEUE, coalescer.dead_lettered).handle,
        prefetch=10,
    )
    sweeper = JobSweeper(pool, stuck_seconds=settings.stuck_job_seconds)
    retention = Retention(pool, keep_seconds=settings.retention_days * 86400)

    async def sweep() -> None:
        if await sweeper.sweep():
            relay.notify()

    server = ops_server(
        consumer_readiness(consumer, pool, stall_seconds=settings.consumer_stall_seconds, others=[dead]),
        settings.http_host,
        settings.metrics_port,
    )
    freeze_startup_heap()
    tasks = {
        "relay": asyncio.create_task(relay.run(), name="relay"),
        "scheduler": asyncio.create_task(
            coalescer.run_scheduler(
                poll_seconds=settings.coalescer_poll_seconds, batch=settings.coalescer_batch_size
            ),
            name="scheduler",
        ),
        "consumer": asyncio.create_task(consumer.run(), name="consumer"),
        "dead": asyncio.create_task(dead.run(), name="dead-letters"),
        "ops": asyncio.create_task(server.serve(), name="ops-http"),
        "stats": asyncio.create_task(every(5, "window stats", coalescer.refresh_stats), name="stats"),
        "sweeper": asyncio.create_task(every(60, "job sweeper", sweep), name="sweeper"),
    }
    if settings.retention_days > 0:
        tasks["retention"] = asyncio.create_task(
            every(settings.retention_interval_seconds, "retention", retention.purge), name="retention"
        )
    logger.info("coalescer running (metrics and health on port %d)", settings.metrics_port)
    stopper = asyncio.create_task(stop.wait())
    done, _ = await asyncio.wait({stopper, *tasks.values()}, return_when=asyncio.FIRST_COMPLETED)
    for task in done:
        if task is not stopper and task.exception():
            logger.error("%s stopped unexpectedly", task.get_name(), exc_info=task.exception())
    # Drain: no new messages; in-flight ones finish and are acked.
    await asyncio.gather(
        consumer.stop(drain_seconds=settings.shutdown_grace_seconds),
        dead.stop(drain_seconds=settings.shutdown_grace_seconds),
    )
    coalescer.stop()
    # Give the relay one last pass so emitted jobs leave before we go.
    relay.notify()
    with contextlib.suppress(Exception):
        await asyncio.wait_for(relay.run_once(), timeout=5)
    relay.stop()
    server.should_exit = True
    for name in ("scheduler", "relay", "ops", "consumer", "dead"):
        with contextlib.suppress(Exception, asyncio.CancelledError):
            await asyncio.wait_for(tasks[name], timeout=5)
    for name in ("stats", "sweeper", "retention"):
        if name in tasks:
            tasks[name].cancel()
    stopper.cancel()
    await http.aclose()
    await consume_broker.close()
    await relay_broker.close()
    await registry.stop()
    await pool.close()
    logger.info("coalescer stopped")
