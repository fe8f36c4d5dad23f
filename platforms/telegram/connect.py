"""``chatq connect telegram [--disconnect]`` (and the accounts API's connect of a bot):
register (or remove) this deployment's webhook with Telegram, then show what Telegram now
holds. Idempotent: Telegram is asked what it has first, and a second run changes nothing and
says so. Telegram's secret token is never read back (it does not show it)."""

from __future__ import annotations

import urllib.parse

import httpx

from platforms.admin import TELEGRAM_WEBHOOK_PATH, PlatformError, masked_url
from platforms.connect import ConnectError, Outcome, refused, require
from platforms.telegram.admin import TelegramAdmin
from platforms.telegram.webhook import answered_updates
from shared.settings import Settings

#: Telegram's answer to a setWebhook that changes nothing.
TELEGRAM_UNCHANGED = "Webhook is already set"


def telegram_webhook_url(settings: Settings, account: str | None = None) -> str:
    """The environment's bot's path, or an added bot's own (``/v1/webhooks/telegram/{id}``)."""
    return f"{settings.public_url}{TELEGRAM_WEBHOOK_PATH}" + (
        f"/{urllib.parse.quote(account, safe='')}" if account else ""
    )


def _refused(exc: PlatformError) -> ConnectError:
    if exc.status == 401:
        return ConnectError(
            "Telegram refused the bot token (401 Unauthorized): it was revoked or mistyped; "
            "get the current one from @BotFather and set CHATQ_TELEGRAM_BOT_TOKEN"
        )
    return refused(exc)


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
    require(settings, telegram=True, needed=needed)
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
