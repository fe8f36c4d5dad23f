"""Which adapter each account sends with, from the account registry (``stores.accounts.registry``):
an account added with its credentials sends with them; every other account is the
environment's. An adapter is built when first needed and again when the account's
credentials change (a rotation needs no restart). The responder sends through it; the
receiver's Avito poll reads through it."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping

import asyncpg

from platforms.avito.adapter import AvitoPlatform, AvitoToken
from platforms.base import HttpClient, Platform
from platforms.generic.adapter import GenericPlatform
from platforms.ratelimit import AccountRateLimiter, SharedBudget
from platforms.sandbox.adapter import SandboxPlatform
from platforms.telegram.adapter import TelegramPlatform
from shared.secretbox import SecretBox
from shared.settings import Settings
from stores.accounts.registry import Account, AccountRegistry, account_problems


class Unserved(Exception):
    """The account's replies cannot be sent by this deployment (removed, or its credentials
    cannot be opened): why, in words a person reads."""


class Incomplete(Unserved):
    """The account lacks a credential it needs to send (a row from before it was required):
    its replies wait while it is paused for it, and fail when it is not."""


class FixedPlatforms:
    """One adapter a platform, whatever the account (tests; a deployment without accounts)."""

    def __init__(self, platforms: Mapping[str, Platform]) -> None:
        self._platforms = platforms

    def for_account(self, platform: str, account_id: str) -> Platform | None:
        return self._platforms.get(platform)

    def names(self) -> list[str]:
        return sorted(self._platforms)

    async def learn(self, platform: str, account_id: str) -> None:
        return None

    async def aclose(self) -> None:
        return None


class AccountPlatforms:
    """The adapter each account sends with."""

    def __init__(
        self,
        settings: Settings,
        client: HttpClient,
        pool: asyncpg.Pool,
        registry: AccountRegistry | None,
        environment: Mapping[str, Platform],
        limiter: AccountRateLimiter,
        *,
        reply_client: HttpClient | None = None,
    ) -> None:
        self._settings = settings
        self._client = client
        #: Added generic accounts' replies go to a URL a tenant named: only through this
        #: client, which refuses addresses inside (``http.GuardedHttp``). None: this process
        #: sends none of them.
        self._reply_client = reply_client
        self._pool = pool
        self._registry = registry
        self._environment = environment
        self._limiter = limiter
        self._built: dict[tuple[str, str], tuple[str, Platform]] = {}
        #: Every Avito account's requests, in every process, count against one budget.
        self._budget = SharedBudget(pool, "avito", settings.avito_requests_per_minute)

    def of_environment(self, platform: str) -> Platform | None:
        """The adapter of the environment's credentials for ``platform`` (None: it has none)."""
        return self._environment.get(platform)

    def names(self) -> list[str]:
        names = set(self._environment)
        if self._registry is not None:
            names |= {a.platform for a in self._registry.all() if a.owns_credentials}
        return sorted(names)

    async def learn(self, platform: str, account_id: str) -> None:
        """Read the account's row now when the registry has not heard of it (its
        notification late or lost: the job outran it), before ``for_account``: an account
        added a moment ago is never taken for the environment's, whose adapter would send
        its reply to CHATQ_GENERIC_REPLY_URL signed with CHATQ_GENERIC_REPLY_SECRET. One
        query by the primary key, only on a miss."""
        if self._registry is not None and self._registry.get(platform, account_id) is None:
            await self._registry.refresh_account(platform, account_id)

    def for_account(self, platform: str, account_id: str) -> Platform | None:
        """The adapter for the account's replies; None when the platform is not configured;
        ``Unserved`` when the account may not send at all. (``learn`` first: an account the
        registry has not heard of is the environment's.)"""
        account = self._registry.get(platform, account_id) if self._registry is not None else None
        self._limiter.set_rate(
            f"{platform}:{account_id}", account.override("rate_per_second") if account else None
        )
        if platform == "sandbox":
            return self._environment.get(platform)
        if account is not None and account.removed:
            raise Unserved(f"the {platform} account {account_id} was removed")
        if account is None or not account.owns_credentials:
            if platform == "telegram" and account_id != self._settings.telegram_account_id:
                # The environment's bot token sends as that bot only.
                return None
            return self._environment.get(platform)
        if account.sealed:
            raise Unserved(
                f"the {platform} account {account_id}'s credentials cannot be opened: {account.sealed}"
            )
        problems = account_problems(account)
        if problems:
            raise Incomplete(
                f"the {platform} account {account_id} cannot send: {'; '.join(problems)} (an added account "
                "never sends with the environment's credentials): give them, then resume it"
            )
        key = (platform, account_id)
        built = self._built.get(key)
        if built is None or built[0] != account.fingerprint:
            built = (account.fingerprint, self._build(account))
            self._built[key] = built
        return built[1]

    def _build(self, account: Account) -> Platform:
        c, s = account.credentials, self._settings
        if account.platform == "telegram":
            return TelegramPlatform(s.telegram_api_base, c["bot_token"], self._client, self._limiter)
        if account.platform == "avito":
            token = AvitoToken(
                s.avito_api_base,
                c["client_id"],
                c["client_secret"],
                self._client,
                self._pool,
                account=account.account_id,
                box=self._registry.box if self._registry is not None else None,
            )
            return AvitoPlatform(s.avito_api_base, token, self._client, self._limiter, self._budget)
        # Only where the account says, signed with its own secret (for_account checked both
        # are there): never CHATQ_GENERIC_REPLY_URL or CHATQ_GENERIC_REPLY_SECRET, or the
        # account could replay a reply's genuine signature into the environment's endpoint.
        # Through the client that checks every address it connects to (reply_url may not
        # reach inside, DNS rebinding included).
        url, secret = c["reply_url"], c["reply_secret"]
        if self._reply_client is None:
            raise Unserved(
                f"this process sends no reply to the generic account {account.account_id}'s reply_url"
            )
        return GenericPlatform(url, secret, self._reply_client, self._limiter)

    async def aclose(self) -> None:
        for _, platform in self._built.values():
            with contextlib.suppress(Exception):
                await platform.aclose()


def build_environment_platforms(
    settings: Settings,
    client: HttpClient,
    pool: asyncpg.Pool,
    limiter: AccountRateLimiter,
    box: SecretBox | None = None,
) -> dict[str, Platform]:
    """Every platform whose reply credentials the environment configures, and the sandbox."""
    platforms: dict[str, Platform] = {}
    if settings.sandbox_active:
        platforms["sandbox"] = SandboxPlatform(pool)
    if settings.telegram_bot_token is not None:
        platforms["telegram"] = TelegramPlatform(
            settings.telegram_api_base, settings.telegram_bot_token.get_secret_value(), client, limiter
        )
    if settings.avito_client_id and settings.avito_client_secret is not None:
        token = AvitoToken(
            settings.avito_api_base,
            settings.avito_client_id,
            settings.avito_client_secret.get_secret_value(),
            client,
            pool,
            box=box,  # its token sealed with the accounts' key, when there is one
        )
        budget = SharedBudget(pool, "avito", settings.avito_requests_per_minute)
        platforms["avito"] = AvitoPlatform(settings.avito_api_base, token, client, limiter, budget)
    if settings.generic_reply_url:
        secret = settings.generic_reply_secret.get_secret_value() if settings.generic_reply_secret else None
        platforms["generic"] = GenericPlatform(settings.generic_reply_url, secret, client, limiter)
    return platforms
