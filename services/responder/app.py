"""The responder's composition root: declares every part, built from the settings, on
the shared supervisor (shared/runner.py), which runs them until SIGTERM and drains."""

from __future__ import annotations

import asyncio
import logging

import asyncpg
import httpx

from platforms.accounts import AccountPlatforms, build_environment_platforms
from platforms.base import HttpClient, Platform
from platforms.http import GuardedHttp, PlatformHttp
from platforms.ratelimit import AccountRateLimiter
from services.responder.connections import BusinessConnections
from services.responder.echoes import Echoes
from services.responder.handler import Responder
from services.responder.listings import Listings
from services.responder.reply_check import ReplyCheck
from services.responder.writers import AccountWriters, build_writer
from shared import metrics
from shared.alerts import Alerter
from shared.broker.consumer import Consumer, RetryTiers
from shared.broker.dead_letters import DeadLetterRecorder
from shared.broker.publisher import ConfirmingPublisher
from shared.broker.topology import RESPONDER_DEAD_QUEUE, RESPONDER_QUEUE
from shared.ops_http import READINESS_SECONDS, consumer_readiness, ops_server, readiness_gauges
from shared.runner import Supervisor, serve
from shared.settings import Settings
from stores.accounts.registry import AccountRegistry, pause_incomplete
from stores.jobs.postgres import JobStore

logger = logging.getLogger(__name__)


def build_platforms(settings: Settings, client: HttpClient, pool: asyncpg.Pool) -> dict[str, Platform]:
    """Every platform whose reply credentials the environment configures, and the sandbox."""
    limiter = AccountRateLimiter(settings.platform_rate_per_second)
    return build_environment_platforms(settings, client, pool, limiter)


async def run(settings: Settings, stop: asyncio.Event) -> int:
    """Serve until ``stop`` is set, then drain; the process's exit status."""
    return await serve("responder", settings, stop, lambda parts: declare(parts, settings))


async def declare(parts: Supervisor, settings: Settings) -> None:
    """The responder's parts, in the order they start; they stop in reverse: the
    consumers drain first (in-flight jobs finish and are acked), then the probe and the
    ops server, then the writer, the client, the brokers and the pool close."""
    pool = await parts.database(settings.pool_connections("responder"))
    if settings.shutdown_grace_seconds < settings.worst_case_job_seconds():
        # Worth a warning where SIGTERM comes from an orchestrator; on a developer's
        # machine (make run, Ctrl-C) it is only a fact.
        logger.log(
            logging.WARNING if settings.env == "production" else logging.INFO,
            "SHUTDOWN_GRACE_SECONDS=%g is shorter than the longest job (%.0f s): a SIGTERM may cut a "
            "send mid-flight and leave it for a person (needs_review)",
            settings.shutdown_grace_seconds,
            settings.worst_case_job_seconds(),
        )
    consume_broker = parts.broker("chatq-responder")
    retry_broker = parts.broker("chatq-responder-retry")
    timeout = httpx.Timeout(
        settings.platform_timeout_seconds, connect=min(5.0, settings.platform_timeout_seconds)
    )
    # Platform calls through aiohttp (platforms/http.py says why); the rare alert
    # posts keep httpx.
    platform_http = parts.closing(
        "platform client", PlatformHttp(timeout, max_connections=settings.responder_concurrency * 2)
    )
    reply_http = parts.closing(
        "reply_url client",
        GuardedHttp(
            timeout, max_connections=settings.responder_concurrency, policy=settings.reply_url_policy()
        ),
    )
    client = parts.closing("alert client", httpx.AsyncClient(timeout=timeout))
    registry = AccountRegistry.from_settings(pool, settings)
    await registry.start()
    parts.closing("accounts", registry)
    # Added accounts from before a credential was required (a generic one without its own
    # reply_url / reply_secret) wait, paused with the reason, instead of replying elsewhere.
    await pause_incomplete(pool, registry)
    limiter = AccountRateLimiter(settings.platform_rate_per_second)
    environment = build_environment_platforms(settings, platform_http, pool, limiter, registry.box)
    platforms = parts.closing(
        "account platforms",
        AccountPlatforms(
            settings, platform_http, pool, registry, environment, limiter, reply_client=reply_http
        ),
    )
    metrics.create_known_series("responder", platforms.names())
    writer = parts.closing("reply writer", AccountWriters(settings, registry, build_writer(settings)))
    responder = Responder(
        JobStore(
            pool,
            history=settings.history_messages,
            caps=settings.job_caps(),
            batch=settings.responder_batch_jobs,
        ),
        platforms,
        writer,
        Alerter(
            settings.alert_webhook_url,
            settings.alert_webhook_secret.get_secret_value() if settings.alert_webhook_secret else None,
            client,
        ),
        fold_max_rounds=settings.fold_max_rounds,
        review_owner=settings.review_owner,
        account_probe_seconds=settings.account_probe_seconds,
        greeting=settings.greeting,
        account_metrics=settings.metrics_account_label,
        listings=Listings(pool, platforms),
        connections=BusinessConnections(pool),
        echoes=Echoes(pool),
        echo_wait_seconds=settings.echo_wait_seconds,
        reply_check=ReplyCheck(settings.secret_values(), registry, run_chars=settings.reply_leak_run_chars),
    )
    consumer = Consumer(
        consume_broker,
        RESPONDER_QUEUE,
        responder.handle,
        prefetch=settings.responder_concurrency,
        retry=RetryTiers(ConfirmingPublisher(retry_broker), settings.retry_delays(), settings.max_attempts),
        on_give_up=responder.give_up,
        on_retry=responder.retry_scheduled,
        delivery_limit=parts.topology.queue(RESPONDER_QUEUE).delivery_limit,
        requeue_pause=settings.requeue_pause_seconds,
        acks_together=True,
    )
    dead = Consumer(
        consume_broker,
        RESPONDER_DEAD_QUEUE,
        DeadLetterRecorder(pool, RESPONDER_DEAD_QUEUE, responder.dead_lettered).handle,
        prefetch=10,
        requeue_pause=settings.requeue_pause_seconds,
    )
    readiness = consumer_readiness(
        consumer, pool, stall_seconds=settings.consumer_stall_seconds, others=[dead]
    )
    server = ops_server(readiness, settings.http_host, settings.metrics_port)
    parts.every(READINESS_SECONDS, "readiness gauges", readiness_gauges(readiness))
    grace = settings.shutdown_grace_seconds
    parts.run("ops-http", server.serve(), stop=lambda: setattr(server, "should_exit", True))
    parts.every(min(5.0, settings.account_probe_seconds), "account probe", responder.probe_accounts)
    parts.run("dead-letters", dead.run(), stop=lambda: dead.stop(drain_seconds=grace))
    parts.run("consumer", consumer.run(), stop=lambda: consumer.stop(drain_seconds=grace))
    logger.info(
        "responder running: platforms %s, writer %s, %d job(s) in flight at most",
        ", ".join(platforms.names()) or "none",
        type(writer.default).__name__,
        settings.responder_concurrency,
    )
