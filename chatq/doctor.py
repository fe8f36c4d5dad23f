"""``chatq doctor``: everything a seller needs for buyers' messages to be answered, checked
from this machine with this deployment's settings, as one table: each check ``ok``,
``FAIL`` (with the reason and the fix) or ``skipped`` (not configured, and how to).

It changes nothing, except that it sends one test alert to ALERT_WEBHOOK_URL (the only
way to know alerts reach a person).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Literal

import aio_pika
import asyncpg
import httpx
from aio_pika.exceptions import AMQPError

from platforms.admin import PlatformError, masked_url, public_url_problem
from platforms.avito.admin import AVITO_REFUSALS, AvitoAdmin
from platforms.avito.connect import avito_webhook_url
from platforms.telegram.admin import TelegramAdmin
from platforms.telegram.connect import telegram_webhook_url
from platforms.telegram.webhook import answered_updates
from shared.alerts import Alerter
from shared.broker.topology import build_topology
from shared.logging import redact_url
from shared.migrate import MigrationError, pending
from shared.settings import GENERATE_HINT, Settings
from stores.accounts import postgres as account_state

State = Literal["ok", "FAIL", "skipped"]
#: A delivery error Telegram reports this recently means buyers' messages are not arriving.
RECENT_ERROR_SECONDS = 3600
TIMEOUT_SECONDS = 10.0


@dataclass(frozen=True)
class Check:
    name: str
    state: State
    reason: str
    #: What to do: for a failure, the fix; for a skipped check, how to set it up.
    fix: str = ""


def ok(name: str, reason: str) -> Check:
    return Check(name, "ok", reason)


def fail(name: str, reason: str, fix: str) -> Check:
    return Check(name, "FAIL", reason, fix)


def skipped(name: str, reason: str, fix: str = "") -> Check:
    return Check(name, "skipped", reason, fix)


async def check_database(settings: Settings) -> list[Check]:
    url = settings.database_url.get_secret_value()
    try:
        conn = await asyncpg.connect(url, timeout=5)
    except (OSError, asyncpg.PostgresError, TimeoutError) as exc:
        return [
            fail(
                "database",
                f"{redact_url(url)} does not answer ({type(exc).__name__})",
                "start Postgres, or set CHATQ_DATABASE_URL to where it runs",
            ),
            skipped("migrations", "the database is not reachable"),
        ]
    try:
        missing = await pending(conn)
    except MigrationError as exc:
        return [
            ok("database", f"reachable at {redact_url(url)}"),
            fail("migrations", str(exc), "restore the migration file as applied; never edit an applied one"),
        ]
    finally:
        await conn.close()
    reachable = ok("database", f"reachable at {redact_url(url)}")
    if not missing:
        return [reachable, ok("migrations", "the schema is current"), *await check_accounts(url)]
    if missing:
        listed = ", ".join(str(m) for m in missing[:8]) + (" …" if len(missing) > 8 else "")
        return [
            reachable,
            fail(
                "migrations",
                f"{len(missing)} pending: {listed}",
                "run `chatq migrate` (every service also migrates at start with CHATQ_MIGRATE_ON_START=true)",
            ),
        ]
    return [reachable, ok("migrations", "the schema is current")]


async def check_accounts(url: str) -> list[Check]:
    """Each platform account the bot may not send on now, with why (the platform refused it:
    the reason names the fix; a person paused it)."""
    conn = await asyncpg.connect(url, timeout=5)
    try:
        rows = await account_state.paused(conn)
    finally:
        await conn.close()
    if not rows:
        return [ok("accounts", "no account is paused")]
    return [
        fail(
            f"{r['platform']} account {r['account_id']}",
            f"paused since {r['state_since']:%Y-%m-%d %H:%M} UTC: {r['state_reason']}",
            "a probe resumes it once the platform accepts it again (every CHATQ_ACCOUNT_PROBE_SECONDS); "
            "its replies wait meanwhile, none is lost"
            if r["state"] == "paused_by_platform"
            else "a person paused it; resume it when the account may send again",
        )
        for r in rows
    ]


async def check_broker(settings: Settings) -> list[Check]:
    """Each RabbitMQ address answers (each node of a cluster: a node down is a FAIL with
    the services still running on the others), and the topology is declared."""
    urls = settings.amqp_urls()
    checks: list[Check] = []
    connection = None
    for url in urls:
        name = "broker" if len(urls) == 1 else f"broker {redact_url(url)}"
        try:
            opened = await aio_pika.connect(url, timeout=5)
        except (OSError, AMQPError, TimeoutError) as exc:
            others = " (the services carry on through the other nodes)" if len(urls) > 1 else ""
            checks.append(
                fail(
                    name,
                    f"{redact_url(url)} does not answer ({type(exc).__name__}){others}",
                    "start RabbitMQ, or set CHATQ_AMQP_URL to where it runs (and its user and password)"
                    if len(urls) == 1
                    else "start that node again (it rejoins its cluster), or remove it from CHATQ_AMQP_URL",
                )
            )
            continue
        checks.append(ok(name, f"reachable at {redact_url(url)}"))
        if connection is None:
            connection = opened
        else:
            await opened.close()
    if connection is None:
        return [*checks, skipped("broker topology", "the broker is not reachable")]
    topology = build_topology(settings.retry_delays())
    missing: list[str] = []
    try:
        # Passive declarations: they look, never create. A missing one closes the channel.
        channel = await connection.channel()
        for kind, name in [("exchange", e.name) for e in topology.exchanges] + [
            ("queue", q.name) for q in topology.queues
        ]:
            try:
                if kind == "exchange":
                    await channel.get_exchange(name, ensure=True)
                else:
                    await channel.get_queue(name, ensure=True)
            except AMQPError:
                missing.append(f"{kind} {name}")
                channel = await connection.channel()
    finally:
        await connection.close()
    if missing:
        return [
            *checks,
            fail(
                "broker topology",
                f"not declared: {', '.join(missing)}",
                "start any chatq service once (each declares the topology), or load "
                "`chatq topology export` into RabbitMQ",
            ),
        ]
    count = len(topology.exchanges) + len(topology.queues)
    return [*checks, ok("broker topology", f"all {count} exchanges and queues declared")]


async def check_telegram(settings: Settings, client: httpx.AsyncClient, now: float) -> list[Check]:
    if settings.telegram_bot_token is None:
        how = (
            "create a bot with @BotFather, set CHATQ_TELEGRAM_BOT_TOKEN, CHATQ_TELEGRAM_WEBHOOK_SECRET "
            "and CHATQ_PUBLIC_URL, then run `chatq connect telegram` (README: Connect a real Telegram bot)"
        )
        return [
            skipped("telegram token", "not configured (CHATQ_TELEGRAM_BOT_TOKEN is not set)", how),
            skipped("telegram webhook", "not configured"),
        ]
    api = TelegramAdmin(settings.telegram_api_base, settings.telegram_bot_token.get_secret_value(), client)
    try:
        me = await api.get_me()
    except PlatformError as exc:
        if exc.status == 401:
            token_check = fail(
                "telegram token",
                "Telegram answered 401 Unauthorized to getMe: the token was revoked or is mistyped",
                "in @BotFather: /mybots → your bot → API Token; set CHATQ_TELEGRAM_BOT_TOKEN to it and "
                "restart the responder",
            )
        else:
            token_check = fail(
                "telegram token",
                f"getMe did not work ({exc})",
                f"check that this machine reaches {settings.telegram_api_base} (CHATQ_TELEGRAM_API_BASE)",
            )
        return [token_check, skipped("telegram webhook", "the token does not work")]
    token_check = ok("telegram token", f"bot @{me.get('username', '?')} (id {me.get('id', '?')})")
    return [token_check, await _telegram_webhook(settings, api, now)]


def _webhook_unusable(settings: Settings, platform: str, secret: object) -> Check | None:
    """The webhook check's failure when the receiver cannot take the platform's deliveries
    whatever the platform holds: no webhook secret, or no public URL it can call."""
    name, connect = f"{platform} webhook", f"run `chatq connect {platform}`"
    if secret is None:
        setting = f"CHATQ_{platform.upper()}_WEBHOOK_SECRET"
        return fail(
            name,
            f"{setting} is not set: the receiver refuses every {platform.capitalize()} delivery",
            f"set it ({GENERATE_HINT}), restart the receiver, then {connect}",
        )
    if problem := public_url_problem(settings.public_url, telegram=platform == "telegram"):
        return fail(name, problem, f"set CHATQ_PUBLIC_URL, then {connect}")
    return None


async def _telegram_webhook(settings: Settings, api: TelegramAdmin, now: float) -> Check:
    name = "telegram webhook"
    connect = "run `chatq connect telegram`"
    if unusable := _webhook_unusable(settings, "telegram", settings.telegram_webhook_secret):
        return unusable
    ours = telegram_webhook_url(settings)
    try:
        info = await api.webhook_info()
    except PlatformError as exc:
        return fail(
            name,
            f"getWebhookInfo did not work ({exc})",
            "run `chatq doctor` again; if it persists, check Telegram's status",
        )
    url, waiting = str(info.get("url") or ""), info.get("pending_update_count", 0)
    if not url:
        return fail(
            name, f"no webhook is registered: Telegram holds {waiting} update(s) and delivers none", connect
        )
    if url != ours:
        return fail(name, f"the webhook points to {masked_url(url)}, not to {masked_url(ours)}", connect)
    allowed = info.get("allowed_updates")
    answered = answered_updates(settings.telegram_chat_type_set)
    if isinstance(allowed, list) and not set(answered) <= set(allowed):
        return fail(name, f"Telegram delivers only {', '.join(map(str, allowed)) or 'nothing'}", connect)
    error_at = info.get("last_error_date")
    if isinstance(error_at, int) and now - error_at < RECENT_ERROR_SECONDS:
        minutes = int(max(0, now - error_at) // 60)
        ago = f"{minutes} min ago" if minutes else "less than a minute ago"
        at = datetime.fromtimestamp(error_at, UTC).strftime("%H:%M UTC")
        return fail(
            name,
            f"Telegram's last delivery to {masked_url(ours)} failed at {at} ({ago}): "
            f"{info.get('last_error_message') or 'no message'} ({waiting} update(s) waiting)",
            "the receiver must answer at CHATQ_PUBLIC_URL over HTTPS with a certificate Telegram trusts; "
            f"a 401 means the secret token differs from CHATQ_TELEGRAM_WEBHOOK_SECRET: {connect} again",
        )
    return ok(
        name,
        f"registered at {masked_url(ours)}; {waiting} update(s) waiting; no delivery error in the last hour",
    )


async def check_avito(settings: Settings, client: httpx.AsyncClient) -> list[Check]:
    if not settings.avito_client_id or settings.avito_client_secret is None:
        how = (
            "register an application at https://www.avito.ru/professionals/api, set CHATQ_AVITO_CLIENT_ID, "
            "CHATQ_AVITO_CLIENT_SECRET, CHATQ_AVITO_WEBHOOK_SECRET and CHATQ_PUBLIC_URL, then run "
            "`chatq connect avito` (README: Connect a real Avito account)"
        )
        return [
            skipped("avito token", "not configured (CHATQ_AVITO_CLIENT_ID/SECRET are not set)", how),
            skipped("avito messenger", "not configured"),
            skipped("avito webhook", "not configured"),
        ]
    api = AvitoAdmin(
        settings.avito_api_base,
        settings.avito_client_id,
        settings.avito_client_secret.get_secret_value(),
        client,
    )
    try:
        await api.token()
    except PlatformError as exc:
        return [
            fail(
                "avito token",
                f"Avito gave no access token ({exc})",
                "check CHATQ_AVITO_CLIENT_ID and CHATQ_AVITO_CLIENT_SECRET against the application at "
                "https://www.avito.ru/professionals/api",
            ),
            skipped("avito account", "no access token"),
            skipped("avito messenger", "no access token"),
            skipped("avito webhook", "no access token"),
        ]
    token_check = ok("avito token", "client credentials accepted")
    try:
        me = await api.account()
        account = ok(
            "avito account",
            f"the credentials are account {me['id']}"
            + (f" ({me['name']})" if me.get("name") else "")
            + ": polled from the first start, before any webhook",
        )
    except PlatformError as exc:
        account = fail(
            "avito account",
            f"Avito did not name the account behind the credentials ({exc})",
            "the poll for lost webhooks starts with the account's first webhook instead; "
            "run `chatq doctor` again, and check the application's access at https://www.avito.ru/professionals/api",
        )
    try:
        subscriptions = await api.subscriptions()
    except PlatformError as exc:
        why, fix = AVITO_REFUSALS.get(exc.status or 0, ("", ""))
        if why:
            messenger = fail(
                "avito messenger",
                f"Avito refused the Messenger API with a fresh token (HTTP {exc.status}: {exc.detail}): {why}",
                fix,
            )
        else:
            messenger = fail(
                "avito messenger", f"the Messenger API did not answer ({exc})", "run `chatq doctor` again"
            )
        return [
            token_check,
            account,
            messenger,
            skipped("avito webhook", "the Messenger API is not available"),
        ]
    return [
        token_check,
        account,
        ok("avito messenger", "the Messenger API answers"),
        _avito_webhook(settings, subscriptions),
    ]


def _avito_webhook(settings: Settings, subscriptions: list[str]) -> Check:
    if unusable := _webhook_unusable(settings, "avito", settings.avito_webhook_secret):
        return unusable
    ours = avito_webhook_url(settings)
    if ours not in subscriptions:
        others = f" (it has {len(subscriptions)} other subscription(s))" if subscriptions else ""
        return fail(
            "avito webhook",
            f"the account is not subscribed to {masked_url(ours)}{others}",
            "run `chatq connect avito`",
        )
    return ok("avito webhook", f"subscribed at {masked_url(ours)}")


async def check_model(settings: Settings, client: httpx.AsyncClient) -> Check:
    if not settings.llm_base_url:
        source = "CHATQ_FACTS_FILE" if settings.facts_file else "its built-in facts"
        return ok("model", f"no CHATQ_LLM_BASE_URL: the built-in facts responder answers from {source}")
    base = settings.llm_base_url.rstrip("/")
    key = settings.llm_api_key.get_secret_value() if settings.llm_api_key else None
    try:
        response = await client.get(
            f"{base}/models",
            headers={"Authorization": f"Bearer {key}"} if key else {},
            timeout=min(settings.llm_timeout_seconds, TIMEOUT_SECONDS),
        )
    except httpx.HTTPError as exc:
        return fail(
            "model", f"{redact_url(base)} does not answer ({type(exc).__name__})", "check CHATQ_LLM_BASE_URL"
        )
    if response.status_code in (401, 403):
        return fail(
            "model",
            f"{redact_url(base)} refused the API key (HTTP {response.status_code})",
            "set CHATQ_LLM_API_KEY",
        )
    if response.status_code == 404:
        return fail(
            "model",
            f"{redact_url(base)}/models does not exist (HTTP 404)",
            "CHATQ_LLM_BASE_URL is the API base of an OpenAI-compatible endpoint, e.g. https://api.openai.com/v1",
        )
    if response.is_error:
        return fail(
            "model", f"{redact_url(base)} answered HTTP {response.status_code}", "check the model endpoint"
        )
    try:
        listed = [str(m.get("id")) for m in response.json().get("data", []) if isinstance(m, dict)]
    except (ValueError, AttributeError):
        listed = []
    where = f"{redact_url(base)} answers"
    if listed and settings.llm_model not in listed:
        return fail(
            "model",
            f"{where}, but does not list {settings.llm_model}",
            "set CHATQ_LLM_MODEL to a model it lists",
        )
    return ok("model", f"{where}; model {settings.llm_model}")


async def check_generic(settings: Settings, client: httpx.AsyncClient) -> Check:
    """The generic reply endpoint takes our signature: a signed probe, as the responder sends
    a paused account's endpoint."""
    from platforms.failures import Failure
    from platforms.generic.adapter import GenericPlatform
    from platforms.ratelimit import AccountRateLimiter

    if not settings.generic_reply_url:
        return skipped("generic reply", "CHATQ_GENERIC_REPLY_URL is not set: generic replies are off")
    secret = settings.generic_reply_secret.get_secret_value() if settings.generic_reply_secret else None
    where = masked_url(settings.generic_reply_url)
    try:
        await GenericPlatform(settings.generic_reply_url, secret, client, AccountRateLimiter(1.0)).probe(
            "doctor"
        )
    except Failure as failure:
        return fail("generic reply", f"{where}: {failure.reason}", "fix it, then run `chatq doctor` again")
    return ok("generic reply", f"{where} accepts our signed requests")


async def check_alerts(settings: Settings, client: httpx.AsyncClient) -> Check:
    if not settings.alert_webhook_url:
        return skipped(
            "alerts",
            "CHATQ_ALERT_WEBHOOK_URL is not set: failed and needs_review operations are only logged",
            "set CHATQ_ALERT_WEBHOOK_URL (and CHATQ_ALERT_WEBHOOK_SECRET) to be told about them",
        )
    secret = settings.alert_webhook_secret.get_secret_value() if settings.alert_webhook_secret else None
    outcome = await Alerter(settings.alert_webhook_url, secret, client).announce(
        "doctor_check", {"reason": "a test alert from `chatq doctor`; nothing is wrong"}
    )
    where = masked_url(settings.alert_webhook_url)
    if outcome != "sent":
        return fail(
            "alerts", f"{where} did not take a test alert ({outcome})", "check CHATQ_ALERT_WEBHOOK_URL"
        )
    return ok("alerts", f"{where} took a test alert")


async def run_checks(settings: Settings, *, clock: Callable[[], float] = time.time) -> list[Check]:
    checks = [*await check_database(settings), *await check_broker(settings)]
    async with httpx.AsyncClient(timeout=TIMEOUT_SECONDS) as client:
        checks += await check_telegram(settings, client, clock())
        checks += await check_avito(settings, client)
        checks.append(await check_generic(settings, client))
        checks.append(await check_model(settings, client))
        checks.append(await check_alerts(settings, client))
    return checks


def render(checks: list[Check]) -> str:
    """One table: check, state, reason; under a failed (or skipped) line, what to do."""
    name_width = max(len(c.name) for c in checks)
    lines = [f"{'check'.ljust(name_width)}  state    reason", f"{'-' * name_width}  -------  {'-' * 40}"]
    for c in checks:
        lines.append(f"{c.name.ljust(name_width)}  {c.state.ljust(7)}  {c.reason}")
        if c.fix and c.state != "ok":
            label = "fix" if c.state == "FAIL" else "to set up"
            lines.append(f"{' ' * name_width}  {' ' * 7}  {label}: {c.fix}")
    failed = sum(c.state == "FAIL" for c in checks)
    lines.append("")
    lines.append(f"{failed} check(s) failed" if failed else "all checks passed")
    return "\n".join(lines)
