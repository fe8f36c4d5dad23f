"""The receiver's composition root: ``create_app(settings)`` builds every part from the
settings and wires them; ``run`` serves it (one port, or the webhooks and the admin
surface on two) until SIGTERM, then drains."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import math
import secrets
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import Any

import asyncpg
import httpx
import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from standardwebhooks.webhooks import Webhook

from platforms.accounts import AccountPlatforms, build_environment_platforms
from platforms.avito import webhook as avito
from platforms.generic import webhook as generic
from platforms.inbound import ApiError, Intake, parse_json
from platforms.ratelimit import AccountRateLimiter
from platforms.telegram import webhook as telegram
from services.receiver import accounts_api, pages, sandbox
from services.receiver import admin as admin_api
from services.receiver.deadlines import BodyDeadline, fit_file_descriptors, header_deadline
from services.receiver.direct import ReceiverApp
from services.receiver.errors import install_error_handlers
from services.receiver.intake import (
    AVITO_HOLD_SECONDS,
    IntakeBatcher,
    Stored,
    announce_review,
    held_while_postgres_is_away,
    record_business_connection,
    store,
)
from services.receiver.limits import BodySizeLimit
from services.receiver.openapi import json_body
from services.receiver.recovery import AvitoRecovery
from shared import metrics
from shared.alerts import Alerter
from shared.broker.connection import BrokerConnection
from shared.broker.topology import INBOUND_EXCHANGE
from shared.credentials import whsec_problem
from shared.faults import fault_point
from shared.lifecycle import freeze_startup_heap
from shared.ops_http import READINESS_SECONDS, OpsServer, export_readiness, postgres_check, readiness_gauges
from shared.outbox import Relay
from shared.runner import Supervisor, serve
from shared.settings import Settings, SettingsRefused
from stores.accounts.registry import AccountRegistry, pause_incomplete, record_environment, record_seen

logger = logging.getLogger(__name__)


@dataclass
class Runtime:
    """What the routes reach through ``app.state.runtime``."""

    pool: asyncpg.Pool
    broker: BrokerConnection
    relay: Relay | None
    accounts: AccountRegistry
    #: Intake group commit: the webhooks' rows written together.
    intake: IntakeBatcher
    #: Tells a person of a message handed to them as it is stored (ALERT_WEBHOOK_URL).
    alerter: Alerter | None = None
    #: The Avito poller (AVITO_POLL_SECONDS); None when off (0).
    recovery: AvitoRecovery | None = None


async def _refresh_backlog_gauges(pool: asyncpg.Pool, *, per_account: bool = False) -> None:
    """chatq_backlog and chatq_oldest_unfinished_age_seconds, from Postgres; with
    METRICS_ACCOUNT_LABEL, chatq_account_backlog too."""
    stats = await admin_api.collect_stats(pool)
    for state, b in stats["backlog"].items():
        metrics.BACKLOG.labels(state=state).set(b["count"])
        metrics.OLDEST_UNFINISHED.labels(state=state).set(b["oldest_age_seconds"])
    if per_account:
        metrics.ACCOUNT_BACKLOG.clear()
        for (platform, account), n in (await admin_api.account_numbers(pool)).items():
            metrics.ACCOUNT_BACKLOG.labels(platform=platform, account=account).set(n["backlog"])
    # While Postgres is away the gauges keep their last values: this says how old they are.
    metrics.GAUGES_REFRESHED.labels(gauges="backlog").set_to_current_time()


@dataclass(frozen=True)
class ReceiverApps:
    """What the receiver serves. Without ADMIN_PORT, ``public`` is the one app on
    HTTP_PORT and ``admin`` is None. With it, ``public`` (HTTP_PORT, the one a deploy
    exposes) has only the webhooks, /healthz and /readyz, and ``admin`` (ADMIN_PORT) the
    admin API, /metrics, /ops, /sandbox, the health checks and /openapi.json.

    ``declare`` starts the pool, broker, relay and gauges once for both apps on the
    shared supervisor; the HTTP servers do not run lifespans of their own. ``running()``
    does the same without the servers, for tests in one process."""

    settings: Settings
    public: FastAPI
    admin: FastAPI | None

    @property
    def listeners(self) -> list[tuple[FastAPI, int]]:
        """Each app with the port it is served on."""
        served = [(self.public, self.settings.http_port)]
        if self.admin is not None and self.settings.admin_port is not None:
            served.append((self.admin, self.settings.admin_port))
        return served

    async def declare(self, parts: Supervisor) -> Runtime:
        """The parts both apps share, in the order they start (they stop in reverse:
        the gauges, then the relay, then the broker and the pool)."""
        settings = self.settings
        pool = await parts.database(settings.database_pool_size)
        metrics.create_known_series(
            "receiver", ["telegram", "avito", "generic", *(["sandbox"] if settings.sandbox_active else [])]
        )
        await record_environment(pool, settings)
        accounts = AccountRegistry.from_settings(pool, settings)
        await accounts.start()
        parts.closing("accounts", accounts)
        await pause_incomplete(pool, accounts)  # as the responder does (stores.accounts.registry)
        broker = parts.broker("chatq-receiver-relay")
        relay = None
        if settings.relay_enabled:
            relay = Relay.from_settings(pool, broker, settings, exchanges=[INBOUND_EXCHANGE])
            parts.run("outbox-relay", relay.run(), stop=relay.stop, wait=10)
        parts.every(
            10,
            "backlog gauges",
            lambda: _refresh_backlog_gauges(pool, per_account=settings.metrics_account_label),
        )
        intake = IntakeBatcher(
            pool, window_seconds=settings.intake_batch_window_ms / 1000, max_rows=settings.intake_batch_rows
        )
        # Closed after the HTTP servers (declared later) and before the pool: what waits
        # is written.
        parts.closing("intake batches", intake)
        alerts_http = parts.closing("alert client", httpx.AsyncClient(timeout=10))
        alerter = Alerter(
            settings.alert_webhook_url,
            settings.alert_webhook_secret.get_secret_value() if settings.alert_webhook_secret else None,
            alerts_http,
        )
        runtime = Runtime(pool, broker, relay, accounts, intake, alerter)
        parts.every(READINESS_SECONDS, "readiness gauges", readiness_gauges(lambda: receiver_checks(runtime)))
        if settings.avito_poll_seconds > 0:
            # With or without the environment's Avito credentials: accounts added as data are
            # read too. A round without an Avito account asks nothing.
            http, platforms, runtime.recovery = _avito_recovery(settings, runtime)
            parts.closing("Avito poll client", http)
            parts.closing("Avito poll accounts", platforms)
            # The first round runs now: what arrived while the service was down.
            parts.every(settings.avito_poll_seconds, "Avito poll", runtime.recovery.poll)
        for app, _ in self.listeners:
            app.state.pool = runtime.pool
            app.state.runtime = runtime
        return runtime

    @asynccontextmanager
    async def running(self) -> AsyncIterator[Runtime]:
        """The runtime without the HTTP servers (tests call the apps in-process)."""
        async with AsyncExitStack() as stack:
            runtime = await self.declare(Supervisor("receiver", self.settings, stack))
            freeze_startup_heap()
            yield runtime


def create_app(settings: Settings) -> ReceiverApps:
    """The composition root: every route and part, built from the settings."""
    webhooks = _webhook_routes(settings)
    admin_routes = [admin_api.router, accounts_api.router, sandbox.router, pages.router]
    if settings.admin_port is None and settings.production_guards:
        # ``run`` refuses to start so (Settings.receiver_problem); built anyway (in a test),
        # the public port still answers none of the admin surface.
        return ReceiverApps(
            settings, public=_app(settings, [webhooks, health], admin=False, direct=webhooks), admin=None
        )
    if settings.admin_port is None:
        app = _app(settings, [*admin_routes, webhooks, health], admin=True, direct=webhooks)
        return ReceiverApps(settings, public=app, admin=None)
    public = _app(settings, [webhooks, health], admin=False, direct=webhooks)
    admin = _app(settings, [*admin_routes, health], admin=True)
    return ReceiverApps(settings, public=public, admin=admin)


def _app(
    settings: Settings, routers: list[APIRouter], *, admin: bool, direct: APIRouter | None = None
) -> FastAPI:
    """One FastAPI app over some of the routes. Only an app with the admin routes
    publishes /metrics and the OpenAPI document; on any other, those paths are the
    JSON 404 of every unknown path. The ``direct`` routes (the webhooks, one of
    ``routers``) are answered without FastAPI's router and middleware: the hot path
    (services/receiver/direct.py)."""
    app = ReceiverApp(
        title="chatqueue receiver",
        version="0.1.0",
        docs_url=None,
        redoc_url=None,
        openapi_url="/openapi.json" if admin else None,
    )
    # The current token, and during a rotation the previous one (docs/deploying.md "Rotating secrets").
    app.state.admin_tokens = [
        t for t in (_secret(settings.admin_token), _secret(settings.admin_token_previous)) if t
    ]
    app.state.sandbox_active = settings.sandbox_active
    app.state.settings = settings
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_body_bytes)
    app.add_middleware(BodyDeadline, seconds=settings.http_body_timeout_seconds)
    install_error_handlers(app)
    for router in routers:
        app.include_router(router)
    if direct is not None:
        app.serve_directly(direct.routes)
    if admin:
        # A route, not a mounted app: `curl :8080/metrics` answers with the metrics, not
        # a 307 to /metrics/ (which answers too, for scrapers configured with it).
        async def prometheus_metrics() -> Response:
            return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

        for path in ("/metrics", "/metrics/"):
            app.add_api_route(path, prometheus_metrics, methods=["GET"], include_in_schema=False)
    return app


def _webhook_routes(settings: Settings) -> APIRouter:
    """The webhooks: each account's own (Telegram ``/v1/webhooks/telegram/{bot id}`` with
    its secret token, Avito ``/v1/webhooks/avito/{its path secret}``, generic
    ``/v1/webhooks/generic/{account}`` signed with its secret), and the single paths of the
    environment's account, as before. A delivery is stored under the account its path
    authenticated and no other: a body naming another account is refused (403)."""
    generic_verifier = generic.verifier(_secret(settings.generic_webhook_secret))
    telegram_secret = _secret(settings.telegram_webhook_secret)
    avito_secret = _secret(settings.avito_webhook_secret)
    telegram_account = settings.telegram_account_id
    telegram_chat_types = settings.telegram_chat_type_set
    # An account's own path answers an account that is not there (never added, removed, or
    # its credentials unusable) exactly as it answers a wrong secret: the same check runs,
    # against a secret of this process nobody knows, so the same status, body and time come
    # back, and no answer tells which accounts exist (issue 39).
    decoy_secret = secrets.token_urlsafe(32)
    decoy_verifier = generic.verifier("whsec_" + base64.b64encode(secrets.token_bytes(32)).decode())
    #: Each added generic account's verifier, built once for its secret (a known account
    #: then does no more work before its signature check than an unknown one's decoy).
    verifiers: dict[str, tuple[str, Webhook]] = {}

    def account_verifier(account_id: str, secret: str) -> Webhook:
        built = verifiers.get(account_id)
        if built is None or built[0] != secret:
            # A secret from before they were checked that is no key: the signature is
            # checked against nobody's key, and fails as a wrong one does.
            webhook = generic.verifier(secret) if whsec_problem(secret) is None else decoy_verifier
            assert webhook is not None
            built = verifiers[account_id] = (secret, webhook)
        return built[1]

    router = APIRouter()
    seen: set[tuple[str, str]] = set()

    def registry(request: Request) -> AccountRegistry:
        runtime: Runtime = request.app.state.runtime
        return runtime.accounts

    async def accept(request: Request, platform: str, intake: Intake) -> Stored:
        account = registry(request).get(platform, intake.account_id)
        runtime: Runtime = request.app.state.runtime

        async def admitted() -> Stored:
            if (
                account is None
                and intake.chat_id is not None
                and intake.account_id != avito.UNKNOWN_ACCOUNT
                and (platform, intake.account_id) not in seen
            ):
                # The environment's account, named by its first message (Avito's user id).
                await record_seen(request.app.state.pool, platform, intake.account_id)
                seen.add((platform, intake.account_id))
            return await admit(runtime, settings, intake, announce=False)

        # While Postgres is away: held as long as the platform waits for an answer, then a
        # 503 it sends again (README "When Postgres is down").
        wait = settings.webhook_hold_seconds
        stored = await held_while_postgres_is_away(
            admitted,
            min(wait, AVITO_HOLD_SECONDS) if platform == "avito" else wait,
            lambda: postgres_answers(settings),
        )
        # The person is told after the message is stored, outside the hold: a slow alert
        # receiver never makes a stored message look unstored.
        await tell_a_person(runtime, settings, intake, stored)
        fault_point("receiver.after_commit")
        if runtime.relay is not None and not stored.duplicate and stored.status == "accepted":
            runtime.relay.notify()
        # An edit's fate is decided as it is stored: read the stored status.
        outcome = (
            "duplicate" if stored.duplicate else ("ignored" if stored.status == "ignored" else "accepted")
        )
        metrics.WEBHOOKS.labels(platform=platform, outcome=outcome).inc()
        if settings.metrics_account_label:
            metrics.ACCOUNT_WEBHOOKS.labels(
                platform=platform, account=intake.account_id, outcome=outcome
            ).inc()
        return stored

    def environment_avito(request: Request) -> str | None:
        """The environment's Avito account, when it has exactly one (``/core/v1/accounts/self``
        names it at start)."""
        ours = [
            a.account_id
            for a in registry(request).all()
            if a.platform == "avito" and a.source == "environment" and not a.removed
        ]
        return ours[0] if len(ours) == 1 else None

    def not_another_accounts(request: Request, platform: str, account_id: str) -> None:
        """The environment's single path serves the environment's account(s) only: an
        account added with its own credentials is reached on its own path, and a removed
        one (the environment's too) on none."""
        account = registry(request).get(platform, account_id)
        if account is not None and account.removed:
            raise ApiError(404, "account_removed", f"the {platform} account {account_id} was removed")
        if account is not None and account.source == "admin":
            raise ApiError(
                403,
                "account_has_its_own_webhook",
                f"{platform} account {account_id} has a webhook of its own",
            )

    async def telegram_update(request: Request, account_id: str) -> JSONResponse:
        started = time.perf_counter()
        with _rejections("telegram"):
            data, raw = parse_json(await _json_body(request))
            intake = telegram.normalise(data, raw, account_id, telegram_chat_types)
            stored = await accept(request, "telegram", intake)
        metrics.WEBHOOK_SECONDS.labels(platform="telegram").observe(time.perf_counter() - started)
        return JSONResponse(_ack(stored))

    @router.post("/v1/webhooks/telegram", openapi_extra=json_body(telegram.TelegramUpdate))
    async def telegram_webhook(request: Request) -> JSONResponse:
        with _rejections("telegram"):
            telegram.authenticate(telegram_secret, request.headers.get(telegram.SECRET_HEADER))
            not_another_accounts(request, "telegram", telegram_account)
        return await telegram_update(request, telegram_account)

    @router.post("/v1/webhooks/telegram/{account_id}", openapi_extra=json_body(telegram.TelegramUpdate))
    async def telegram_account_webhook(account_id: str, request: Request) -> JSONResponse:
        with _rejections("telegram"):
            account = registry(request).get("telegram", account_id)
            expected = None
            if account is not None and account.owns_credentials:
                expected = account.credentials.get("webhook_secret")
            elif account_id == telegram_account and (account is None or not account.removed):
                expected = telegram_secret  # the environment's bot, on its own path too
            # No bot here (or none with a secret): refused as a wrong secret token is.
            telegram.authenticate(expected or decoy_secret, request.headers.get(telegram.SECRET_HEADER))
        return await telegram_update(request, account_id)

    @router.post("/v1/webhooks/avito/{secret}", openapi_extra=json_body(avito.AvitoWebhook))
    async def avito_webhook(secret: str, request: Request) -> JSONResponse:
        started = time.perf_counter()
        with _rejections("avito"):
            account = registry(request).by_path_secret("avito", secret)
            if account is None:
                # No account's path and no environment's: a wrong path secret, whichever.
                avito.authenticate(avito_secret or decoy_secret, secret)
            # Any content type: Avito checks a subscription's URL with `curl -d '{}'` (form
            # content type, no payload) and wants a 200 within 2 s.
            data, raw = parse_json(await request.body())
            if not avito.has_payload(data):
                metrics.WEBHOOK_SECONDS.labels(platform="avito").observe(time.perf_counter() - started)
                metrics.WEBHOOKS.labels(platform="avito", outcome="no_payload").inc()
                return JSONResponse({"ok": True, "ignored": "no message payload: nothing to store"})
            # A message that names no account is this path's account's: an added account's
            # own path, or on the environment's path its one Avito account.
            hint = account.account_id if account is not None else environment_avito(request)
            intake = avito.normalise(data, raw, hint)
            if account is None:
                not_another_accounts(request, "avito", intake.account_id)
            elif intake.account_id != account.account_id:
                raise ApiError(
                    403,
                    "wrong_account",
                    f"this path is Avito account {account.account_id}'s; the body is for another account",
                )
            stored = await accept(request, "avito", intake)
        metrics.WEBHOOK_SECONDS.labels(platform="avito").observe(time.perf_counter() - started)
        return JSONResponse(_ack(stored))

    async def generic_message(request: Request, webhook: Any, account_id: str | None) -> JSONResponse:
        started = time.perf_counter()
        with _rejections("generic"):
            body = await request.body()
            webhook_id = generic.authenticate(webhook, body, dict(request.headers))
            _require_json(request)
            data, raw = parse_json(body)
            intake = generic.normalise(data, raw, webhook_id)
            if account_id is None:
                not_another_accounts(request, "generic", intake.account_id)
            elif intake.account_id != account_id:
                raise ApiError(
                    403, "wrong_account", f"this path is account {account_id}'s; the body names another"
                )
            stored = await accept(request, "generic", intake)
        metrics.WEBHOOK_SECONDS.labels(platform="generic").observe(time.perf_counter() - started)
        doc = _ack(stored)
        doc["status_url"] = f"/v1/operations/{stored.operation_id}"
        return JSONResponse(doc, status_code=202)

    @router.post("/v1/webhooks/generic", status_code=202, openapi_extra=json_body(generic.GenericMessage))
    async def generic_webhook(request: Request) -> JSONResponse:
        return await generic_message(request, generic_verifier, None)

    @router.post(
        "/v1/webhooks/generic/{account_id}", status_code=202, openapi_extra=json_body(generic.GenericMessage)
    )
    async def generic_account_webhook(account_id: str, request: Request) -> JSONResponse:
        account = registry(request).get("generic", account_id)
        secret = account.credentials.get("webhook_secret") if account is not None else None
        if account is None or not account.owns_credentials or not secret:
            verifiers.pop(account_id, None)
            return await generic_message(request, decoy_verifier, account_id)
        return await generic_message(request, account_verifier(account_id, secret), account_id)

    return router


health = APIRouter()


@health.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


async def receiver_checks(runtime: Runtime) -> dict[str, str]:
    """Postgres, and RabbitMQ as the relay of this process reaches it (no relay: no check).
    The relay keeps its broker connection through a Postgres outage, so only the check
    that failed is named."""
    checks = {"postgres": await postgres_check(runtime.pool)}
    if runtime.relay is not None:
        checks["rabbitmq"] = "ok" if runtime.broker.is_open else "unreachable"
    return checks


@health.get("/readyz")
async def readyz(request: Request) -> JSONResponse:
    runtime: Runtime = request.app.state.runtime
    checks = await receiver_checks(runtime)
    failed = export_readiness(checks)
    # The receiver stays in rotation whatever failed, and says which. While RabbitMQ is
    # away the outbox holds what arrives. While Postgres is away each webhook is held as
    # long as its platform waits, then answered 503 to be sent again: taken out of
    # rotation, every receiver would leave the platforms to the load balancer's own 503,
    # which holds nothing (README "When Postgres is down").
    return JSONResponse({"status": "degraded" if failed else "ok", "failing": failed, "checks": checks})


async def run(settings: Settings, stop: asyncio.Event) -> int:
    """Serve every listener in this event loop until ``stop`` is set, then drain: each
    server stops accepting and finishes its requests in flight (up to
    SHUTDOWN_GRACE_SECONDS), and only then the relay, broker and pool close. Returns the
    process's exit status."""
    if problem := settings.receiver_problem():
        raise SettingsRefused(problem)
    receiver = create_app(settings)
    fit_file_descriptors(settings.http_limit_concurrency * len(receiver.listeners))
    servers = [
        OpsServer(
            uvicorn.Config(
                app,
                host=settings.http_host,
                port=port,
                # Slow clients: a deadline on the headers (the protocol), one on the body
                # (BodyDeadline, in the app), and a bound on what one port holds.
                http=header_deadline(settings.http_header_timeout_seconds),
                limit_concurrency=settings.http_limit_concurrency,
                lifespan="off",
                log_config=None,
                access_log=False,
                timeout_graceful_shutdown=math.ceil(settings.shutdown_grace_seconds),
            )
        )
        for app, port in receiver.listeners
    ]

    def stop_serving() -> None:
        # Every server at once: each then finishes its requests in flight.
        for server in servers:
            server.should_exit = True

    async def declare(parts: Supervisor) -> None:
        await receiver.declare(parts)
        for server in servers:
            parts.run(f"http-{server.config.port}", server.serve(), stop=stop_serving, wait=None)

    return await serve("receiver", settings, stop, declare)


def _avito_recovery(
    settings: Settings, runtime: Runtime
) -> tuple[httpx.AsyncClient, AccountPlatforms, AvitoRecovery]:
    """The Avito poller, on the responder's Avito clients: each account's own credentials,
    or the environment's (their tokens shared in Postgres). What it finds is admitted as a
    webhook's message is (``admit``)."""
    pool, relay, accounts = runtime.pool, runtime.relay, runtime.accounts
    http = httpx.AsyncClient(
        timeout=httpx.Timeout(
            settings.platform_timeout_seconds, connect=min(5.0, settings.platform_timeout_seconds)
        )
    )
    limiter = AccountRateLimiter(settings.platform_rate_per_second)
    environment = build_environment_platforms(settings, http, pool, limiter, accounts.box)
    platforms = AccountPlatforms(
        settings, http, pool, accounts, {k: v for k, v in environment.items() if k == "avito"}, limiter
    )

    async def admitted(intake: Intake) -> Stored:
        return await admit(runtime, settings, intake, recovered=True)

    recovery = AvitoRecovery(
        pool,
        platforms,
        accounts,
        hold_seconds=settings.takeover_seconds,
        interval_seconds=settings.avito_poll_seconds,
        notify=relay.notify if relay is not None else (lambda: None),
        backfill_seconds=settings.avito_backfill_seconds,
        admit=admitted,
        alerter=runtime.alerter,
        probe_seconds=settings.account_probe_seconds,
    )
    return http, platforms, recovery


async def postgres_answers(settings: Settings) -> bool:
    """Whether Postgres answers at all, on a connection of its own (the pool's may all be
    busy with the statements being judged): a second to connect and answer."""
    try:
        conn = await asyncpg.connect(settings.database_url.get_secret_value(), timeout=1.0)
    except Exception:
        return False
    try:
        return bool(await conn.fetchval("SELECT true", timeout=1.0))
    except Exception:
        return False
    finally:
        with contextlib.suppress(Exception):
            await conn.close(timeout=1.0)


async def tell_a_person(runtime: Runtime, settings: Settings, intake: Intake, stored: Stored) -> None:
    """Announce a message handed to a person as it was stored (once: not for a repeat)."""
    if stored.status != "needs_review" or stored.duplicate or runtime.alerter is None:
        return
    account = runtime.accounts.get(intake.platform, intake.account_id)
    await announce_review(
        runtime.alerter,
        intake.for_a_person(settings.unreadable_policy(account)),
        stored,
        settings.review_owner,
    )


async def admit(
    runtime: Runtime, settings: Settings, intake: Intake, *, recovered: bool = False, announce: bool = True
) -> Stored:
    """Store a platform's message as the account's settings take it, whether its webhook
    brought it or the poll found it: a message the bot cannot read alone goes to a person
    (CHATQ_UNREADABLE_MESSAGES, per account), who is told; a seller's message holds the
    chat for the account's TAKEOVER_SECONDS; a business connection's state is kept."""
    account = runtime.accounts.get(intake.platform, intake.account_id)
    takeover = account.override("takeover_seconds") if account is not None else None
    hold = settings.takeover_seconds if takeover is None else takeover
    intake = intake.for_a_person(settings.unreadable_policy(account))
    if intake.business_connection is not None:
        await record_business_connection(
            runtime.pool, intake.account_id, intake.business_connection, settings.account_probe_seconds
        )
    if recovered:
        stored = await store(
            runtime.pool, intake, hold_seconds=hold, recovered=True, review_owner=settings.review_owner
        )
    else:
        stored = await runtime.intake.store(intake, hold_seconds=hold, review_owner=settings.review_owner)
    if announce:
        await tell_a_person(runtime, settings, intake, stored)
    return stored


def _secret(value: Any) -> str | None:
    return value.get_secret_value() if value is not None else None


def _ack(stored: Stored) -> dict[str, Any]:
    return {
        "ok": True,
        "operation_id": str(stored.operation_id),
        "status": stored.status,
        "duplicate": stored.duplicate,
    }


def _require_json(request: Request) -> None:
    ctype = request.headers.get("content-type", "")
    media = ctype.split(";", 1)[0].strip().lower()
    if media != "application/json":
        raise ApiError(415, "unsupported_media_type", "send the body as application/json")


async def _json_body(request: Request) -> bytes:
    _require_json(request)
    return await request.body()


class _rejections:
    """Count every 4xx a webhook endpoint answers (rejected), and every 503 (unavailable),
    by platform."""

    def __init__(self, platform: str) -> None:
        self.platform = platform

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        if isinstance(exc, ApiError) and exc.status >= 500:
            # Not the delivery's fault (Postgres away): the platform sends it again.
            metrics.WEBHOOKS.labels(platform=self.platform, outcome="unavailable").inc()
        elif isinstance(exc, ApiError):
            metrics.WEBHOOKS.labels(platform=self.platform, outcome="rejected").inc()
            logger.info("rejected %s webhook: %s %s", self.platform, exc.status, exc.code)
