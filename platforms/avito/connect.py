"""``chatq connect avito [--disconnect]`` (and the accounts API's connect of an account):
subscribe (or unsubscribe) this deployment's webhook with Avito, then show the account's
subscriptions. Idempotent: Avito is asked what it has first, and a second run changes
nothing and says so. The path secret prints as ``***``."""

from __future__ import annotations

import httpx

from platforms.admin import AVITO_WEBHOOK_PATH, PlatformError, masked_url
from platforms.avito.admin import AVITO_REFUSALS, AvitoAdmin
from platforms.connect import ConnectError, Outcome, refused, require
from shared.settings import Settings


def avito_webhook_url(settings: Settings) -> str:
    secret = settings.avito_webhook_secret.get_secret_value() if settings.avito_webhook_secret else ""
    return f"{settings.public_url}{AVITO_WEBHOOK_PATH}{secret}"


def _refused(exc: PlatformError) -> ConnectError:
    if exc.status in AVITO_REFUSALS and exc.call != "token":
        why, fix = AVITO_REFUSALS[exc.status]
        return ConnectError(
            f"Avito refused the Messenger API (HTTP {exc.status}: {exc.detail}): {why}; {fix}"
        )
    return refused(exc)


async def connect_avito(settings: Settings, client: httpx.AsyncClient, *, disconnect: bool) -> Outcome:
    require(
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
