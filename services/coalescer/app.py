"""The coalescer's composition root: declares every part, built from the settings, on
the shared supervisor (shared/runner.py), which runs them until SIGTERM and drains."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable

import httpx

from services.coalescer.service import Coalescer
from services.coalescer.sweeper import JobSweeper
from shared import metrics
from shared.alerts import Alerter
from shared.broker.connection import BrokerConnection
from shared.broker.consumer import Batching, Consumer
from shared.broker.dead_letters import DeadLetterRecorder
from shared.broker.topology import COALESCER_DEAD_QUEUE, COALESCER_QUEUE, JOBS_EXCHANGE, Topology
from shared.db import JOBS_ENDED_CHANNEL
from shared.ops_http import READINESS_SECONDS, consumer_readiness, ops_server, readiness_gauges
from shared.outbox import Relay
from shared.retention import Retention
from shared.runner import Supervisor, serve
from shared.settings import Settings
from stores.accounts.registry import AccountRegistry
from stores.windows.window import WindowPolicy

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


def inbound_consumer(
    broker: BrokerConnection, coalescer: Coalescer, settings: Settings, topology: Topology
) -> Consumer:
    """The consumer of inbound messages: the coalescer files what is delivered together
    in one transaction (``Coalescer.handle_batch``), or each alone (``handle``) when a
    batch fails as a whole, or always with a batch size of 1."""
    return Consumer(
        broker,
        COALESCER_QUEUE,
        coalescer.handle,
        prefetch=settings.coalescer_prefetch,
        on_give_up=coalescer.give_up,
        delivery_limit=topology.queue(COALESCER_QUEUE).delivery_limit,
        requeue_pause=settings.requeue_pause_seconds,
        batching=Batching(
            coalescer.handle_batch,
            size=settings.coalescer_file_batch_messages,
            wait=settings.coalescer_file_batch_wait_ms / 1000,
        )
        if settings.coalescer_file_batch_messages > 1
        else None,
    )


async def run(settings: Settings, stop: asyncio.Event) -> int:
    """Serve until ``stop`` is set, then drain; the process's exit status."""
    return await serve("coalescer", settings, stop, lambda parts: declare(parts, settings))


async def declare(parts: Supervisor, settings: Settings) -> None:
    """The coalescer's parts, in the order they start; they stop in reverse: the
    consumers drain first (in-flight messages finish and are acked), then the scheduler,
    then the relay after one last pass publishes what was emitted, then the ops server."""
    pool = await parts.database(settings.database_pool_size)
    metrics.create_known_series("coalescer")
    # The fair share and the overrides; never a credential (its role cannot read them).
    # Its LISTEN connection also hears jobs end (JOBS_ENDED_CHANNEL): the scheduler refills their
    # accounts' fair share at once, not at its next poll.
    registry = AccountRegistry.from_settings(
        pool, settings, credentials=False, also_listen={JOBS_ENDED_CHANNEL: lambda: coalescer.wake()}
    )
    # Separate connections: a consumer's flow control never blocks the relay's publishes.
    consume_broker = parts.broker("chatq-coalescer")
    relay_broker = parts.broker("chatq-coalescer-relay")
    relay = Relay.from_settings(pool, relay_broker, settings, exchanges=[JOBS_EXCHANGE])
    http = parts.closing("alert client", httpx.AsyncClient(timeout=10))
    coalescer = Coalescer(
        pool,
        policy_from(settings),
        policy_for=account_policies(settings, registry),
        account_jobs=settings.account_jobs_in_flight,
        alone_jobs=settings.account_jobs_alone(),
        on_jobs_emitted=relay.notify,
        alerter=Alerter(
            settings.alert_webhook_url,
            settings.alert_webhook_secret.get_secret_value() if settings.alert_webhook_secret else None,
            http,
        ),
        owner=settings.review_owner,
        caps=settings.job_caps(),
    )
    await registry.start()
    parts.closing("accounts", registry)
    consumer = inbound_consumer(consume_broker, coalescer, settings, parts.topology)
    dead = Consumer(
        consume_broker,
        COALESCER_DEAD_QUEUE,
        DeadLetterRecorder(pool, COALESCER_DEAD_QUEUE, coalescer.dead_lettered).handle,
        prefetch=10,
        requeue_pause=settings.requeue_pause_seconds,
    )
    sweeper = JobSweeper(pool, stuck_seconds=settings.stuck_job_seconds)
    retention = Retention(pool, keep_seconds=settings.retention_days * 86400)

    async def sweep() -> None:
        if await sweeper.sweep():
            relay.notify()

    async def last_relay_pass() -> None:
        # Emitted jobs leave before we go.
        relay.notify()
        try:
            async with asyncio.timeout(5):
                await relay.run_once()
        finally:
            relay.stop()

    readiness = consumer_readiness(
        consumer, pool, stall_seconds=settings.consumer_stall_seconds, others=[dead]
    )
    server = ops_server(readiness, settings.http_host, settings.metrics_port)
    parts.every(READINESS_SECONDS, "readiness gauges", readiness_gauges(readiness))
    grace = settings.shutdown_grace_seconds
    parts.run("ops-http", server.serve(), stop=lambda: setattr(server, "should_exit", True))
    parts.run("relay", relay.run(), stop=last_relay_pass)
    parts.run(
        "scheduler",
        coalescer.run_scheduler(
            poll_seconds=settings.coalescer_poll_seconds, batch=settings.coalescer_batch_size
        ),
        stop=coalescer.stop,
    )
    parts.every(5, "window stats", coalescer.refresh_stats)
    parts.every(settings.stuck_job_sweep_seconds, "job sweeper", sweep)
    if settings.retention_days > 0:
        parts.every(settings.retention_interval_seconds, "retention", retention.purge)
    parts.run("dead-letters", dead.run(), stop=lambda: dead.stop(drain_seconds=grace))
    parts.run("consumer", consumer.run(), stop=lambda: consumer.stop(drain_seconds=grace))
    logger.info("coalescer running (metrics and health on port %d)", settings.metrics_port)
