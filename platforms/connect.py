"""``chatq connect telegram|avito [--disconnect]``: register (or remove) this deployment's
webhook with the platform, then show what the platform now holds.

Both are idempotent: the platform is asked what it has first, and a second run changes
nothing and says so. Neither prints a secret: the Avito path secret shows as ``***``, and
Telegram's secret token is never read back (the platform does not show it).
"""

from __future__ import annotations

import urllib.parse
from dataclasses import dataclass
from typing import Literal

import httpx

from platforms.admin import (
    AVITO_REFUSALS,
    AVITO_WEBHOOK_PATH,
    TELEGRAM_WEBHOOK_PATH,
    AvitoAdmin,
    PlatformError,
    TelegramAdmin,
    masked_url,
    public_url_problem,
)
from platforms.telegram.webhook import answered_updates
from shared.settings import Settings

#: Telegram's answer to a setWebhook that changes nothing.
TELEGRAM_UNCHANGED = "Webhook is already set"


class ConnectError(Exception):
    """The command cannot go on. ``kind``: "usage" when a setting is missing or wrong
    (nothing was asked of the platform), "refused" when the platform said no,
    "unreachable" when it did not answer."""

    def __init__(self, message: str, kind: Literal["usage", "refused", "unreachable"] = "refused") -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class Outcome:
    text: str
    changed: bool


def telegram_webhook_url(settings: Settings, account: str | None = None) -> str:
    """The environment's bot's path, or an added bot's own (``/v1/webhooks/telegram/{id}``)."""
    return f"{settings.public_url}{TELEGRAM_WEBHOOK_PATH}" + (
        f"/{urllib.parse.quote(account, safe='')}" if account else ""
    )


def avito_webhook_url(settings: Settings) -> str:
    secret = settings.avito_webhook_secret.get_secret_value() if settings.avito_webhook_secret else ""
    return f"{settings.public_url}{AVITO_WEBHOOK_PATH}{secret}"


def _require(settings: Settings, *, telegram: bool, needed: dict[str, object]) -> None:
    missing = [name for name, value in needed.items() if not value]
    problems = [f"set {name}" for name in missing]
    if problem := public_url_problem(settings.public_url, telegram=telegram):
        problems.append(problem)
    if problems:
        raise ConnectError("; ".join(problems), "usage")


def _refused(exc: PlatformError) -> ConnectError:
    if exc.status is None:
        return ConnectError(str(exc), "unreachable")
    if exc.platform == "Telegram" and exc.status == 401:
        return ConnectError(
            "Telegram refused the bot token (401 Unauthorized): it was revoked or mistyped; "
            "get the current one from @BotFather and set CHATQ_TELEGRAM_BOT_TOKEN"
        )
    if exc.platform == "Avito" and exc.status in AVITO_REFUSALS and exc.call != "token":
        why, fix = AVITO_REFUSALS[exc.status]
        return ConnectError(
            f"Avito refused the Messenger API (HTTP {exc.status}: {exc.detail}): {why}; {fix}"
        )
    return ConnectError(str(exc))


def _webhook_lines(info: dict[str, object]) -> list[str]:
    allowed = info.get("allowed_updates")
    error = info.get("last_error_message")
    return [
        f"  url               {masked_url(str(info.get('url') or '')) or '(none)'}",
        f"  allowed updates   {', '.join(map(str, allowed)) if isinstance(allowed, list) else '(all but a few)'}",
        f"  pending updates   {info.get('pending_update_count', 0)}",
        f"  last error        {error if error else 'none'}",
    ]


async def connect_telegram(
    settings: Settings, client: httpx.AsyncClient, *, disconnect: bool, account: str | None = None
) -> Outcome:
    needed: dict[str, object] = {"CHATQ_TELEGRAM_BOT_TOKEN": settings.telegram_bot_token}
    if not disconnect:
        needed["CHATQ_TELEGRAM_WEBHOOK_SECRET"] = settings.telegram_webhook_secret
    _require(settings, telegram=True, needed=needed)
    assert settings.telegram_bot_token is not None
    api = TelegramAdmin(settings.telegram_api_base, settings.telegram_bot_token.get_secret_value(), client)
    ours = telegram_webhook_url(settings, account)
    try:
        me = await api.get_me()
        bot = f"@{me.get('username', '?')} (id {me.get('id', '?')})"
        before = await api.webhook_info()
        current = str(before.get("url") or "")
        if disconnect:
            if not current:
                return Outcome(f"Telegram bot {bot}: no webhook is registered; nothing changed", False)
            if current != ours:
                raise ConnectError(
                    f"Telegram bot {bot}: the webhook points to {masked_url(current)}, not to this "
                    f"deployment ({masked_url(ours)}); nothing changed"
                )
            await api.delete_webhook()
            after = await api.webhook_info()
            lines = [
                f"Telegram bot {bot}: webhook removed; Telegram now keeps new messages for up to 24 hours"
            ]
            return Outcome("\n".join([*lines, *_webhook_lines(after)]), True)
        assert settings.telegram_webhook_secret is not None
        # Always sent: Telegram never shows the secret token back, so only setting it makes
        # sure it is the current one. Telegram says when nothing changed.
        said = await api.set_webhook(
            ours,
            settings.telegram_webhook_secret.get_secret_value(),
            list(answered_updates(settings.telegram_chat_type_set)),
        )
        after = await api.webhook_info()
    except PlatformError as exc:
        raise _refused(exc) from None
    changed = said != TELEGRAM_UNCHANGED or before != after
    lines = [
        f"Telegram bot {bot}: "
        + (
            f"webhook registered at {masked_url(ours)}"
            if changed
            else f"already registered at {masked_url(ours)} with these settings; nothing changed"
        )
    ]
    if current and current != ours:
        lines.append(f"  (it replaced the webhook that pointed to {masked_url(current)})")
    return Outcome("\n".join([*lines, *_webhook_lines(after)]), changed)


async def connect_avito(settings: Settings, client: httpx.AsyncClient, *, disconnect: bool) -> Outcome:
    _require(
        settings,
        telegram=False,
        needed={
            "CHATQ_AVITO_CLIENT_ID": settings.avito_client_id,
            "CHATQ_AVITO_CLIENT_SECRET": settings.avito_client_secret,
            "CHATQ_AVITO_WEBHOOK_SECRET": settings.avito_webhook_secret,
        },
    )
    assert settings.avito_client_id is not None and settings.avito_client_secret is not None
    api = AvitoAdmin(
        settings.avito_api_base,
        settings.avito_client_id,
        settings.avito_client_secret.get_secret_value(),
        client,
    )
    ours = avito_webhook_url(settings)
    try:
        before = await api.subscriptions()
        if disconnect:
            if ours not in before:
                head = "Avito: this deployment's webhook is not subscribed; nothing changed"
            else:
                await api.unsubscribe(ours)
                head = f"Avito: unsubscribed {masked_url(ours)}"
        elif ours in before:
            head = f"Avito: already subscribed at {masked_url(ours)}; nothing changed"
        else:
            await api.subscribe(ours)
            head = f"Avito: subscribed {masked_url(ours)}"
        after = await api.subscriptions()
    except PlatformError as exc:
        raise _refused(exc) from None
    lines = [head, "  subscriptions of this account:" if after else "  this account has no subscriptions"]
    for url in after:
        if url == ours:
            note = "this deployment"
        elif url.startswith(f"{settings.public_url}{AVITO_WEBHOOK_PATH}"):
            note = "this deployment with another path secret: the receiver refuses its deliveries"
        else:
            note = "another receiver; not touched"
        lines.append(f"  {masked_url(url)}  ({note})")
    return Outcome("\n".join(lines), before != after)
