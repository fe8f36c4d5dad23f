"""Accounts as data (README "Many accounts"): every Telegram bot, Avito account and generic
sender the deployment answers for is a row of ``accounts``, with its own credentials
(encrypted, ``shared.secretbox``), webhook and overrides of the global settings.

Each process holds an ``AccountRegistry``: every account, credentials decrypted, read at
start, again every ACCOUNTS_REFRESH_SECONDS, and at once when the table changes (LISTEN
chatq_accounts, ``shared/functions/50_accounts.sql``). Credentials never leave the
process: nothing here renders them (``Account.__repr__`` hides them), the admin API
returns only which ones are set.

The environment's single-account settings (CHATQ_TELEGRAM_BOT_TOKEN, CHATQ_AVITO_CLIENT_ID,
...) keep working: at start ``record_environment`` makes (or updates) the Telegram bot's
row, source 'environment'; an Avito or generic account of the environment gets its row
with its first message (Avito names the account only there), and at start every Avito
account the inbox already has messages of and no row (a deployment from before accounts
were data), so the Avito poll reads it. Their credentials stay in the environment, never
in the table.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import asyncpg

from shared.secretbox import SecretBox, SecretsUnavailable
from shared.settings import Settings

logger = logging.getLogger(__name__)

CHANNEL = "chatq_accounts"

#: The per-account overrides of global settings (columns of ``accounts``).
OVERRIDES = (
    "facts",
    "facts_file",
    "llm_model",
    "prompt",
    "reply_delay_min_seconds",
    "reply_delay_max_seconds",
    "takeover_seconds",
    "rate_per_second",
)

#: The credentials each platform's account takes, and which of them it needs.
CREDENTIALS: dict[str, tuple[str, ...]] = {
    "telegram": ("bot_token", "webhook_secret"),
    "avito": ("client_id", "client_secret", "webhook_secret"),
    "generic": ("webhook_secret", "reply_url", "reply_secret"),
}
REQUIRED: dict[str, tuple[str, ...]] = {
    "telegram": ("bot_token", "webhook_secret"),
    "avito": ("client_id", "client_secret", "webhook_secret"),
    "generic": ("webhook_secret",),
}


def path_key(secret: str) -> str:
    """What the table keeps of a webhook path secret: its SHA-256, to find the account."""
    return hashlib.sha256(secret.encode()).hexdigest()


@dataclass(frozen=True)
class Account:
    platform: str
    account_id: str
    name: str | None
    state: str
    state_reason: str | None
    source: str
    removed: bool
    overrides: dict[str, Any]
    credentials: dict[str, str] = field(default_factory=dict, repr=False, compare=False)
    #: The credentials could not be opened (no key, or no key opens them): why.
    sealed: str | None = None

    @property
    def owns_credentials(self) -> bool:
        """Added with credentials of its own (not the environment's)."""
        return self.source == "admin" and not self.removed

    def override(self, name: str) -> Any:
        return self.overrides.get(name)

    @property
    def fingerprint(self) -> str:
        """Changes whenever what a process builds from the account changes (its credentials
        or overrides), never shows them."""
        parts = [repr(sorted(self.credentials.items())), repr(sorted(self.overrides.items()))]
        return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


_SELECT = f"""
SELECT platform, account_id, name, state, state_reason, source, removed_at IS NOT NULL AS removed,
       credentials, {", ".join(OVERRIDES)}
FROM accounts
"""


def account_of(row: asyncpg.Record, box: SecretBox | None) -> Account:
    credentials: dict[str, str] = {}
    sealed = None
    if row["credentials"] is not None:
        try:
            if box is None:
                raise SecretsUnavailable("no SECRETS_KEY")
            credentials = box.open(row["credentials"])
        except SecretsUnavailable as exc:
            sealed = str(exc)
    return Account(
        row["platform"],
        row["account_id"],
        row["name"],
        row["state"],
        row["state_reason"],
        row["source"],
        row["removed"],
        {k: row[k] for k in OVERRIDES if row[k] is not None},
        credentials,
        sealed,
    )


class AccountRegistry:
    """Every account, in memory, kept current (see the module's docstring)."""

    def __init__(
        self, pool: asyncpg.Pool, box: SecretBox, *, refresh_seconds: float = 30.0, dsn: str | None = None
    ) -> None:
        self._pool = pool
        self._dsn = dsn
        self.box = box
        self._refresh_seconds = refresh_seconds
        self._accounts: dict[tuple[str, str], Account] = {}
        self._by_path: dict[str, Account] = {}
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._listener: asyncpg.Connection | None = None
        #: Incremented at each refresh that changed something.
        self.version = 0

    @classmethod
    def from_settings(cls, pool: asyncpg.Pool, settings: Settings) -> AccountRegistry:
        keys = settings.secrets_key.get_secret_value() if settings.secrets_key else None
        return cls(
            pool,
            SecretBox(keys, settings.secrets_key_file),
            refresh_seconds=settings.accounts_refresh_seconds,
            dsn=settings.database_url.get_secret_value(),
        )

    def get(self, platform: str, account_id: str) -> Account | None:
        return self._accounts.get((platform, account_id))

    def by_path_secret(self, platform: str, secret: str) -> Account | None:
        """The live account whose webhook path secret this is (Avito)."""
        account = self._by_path.get(path_key(secret))
        return account if account is not None and account.platform == platform else None

    def all(self) -> Iterable[Account]:
        return self._accounts.values()

    async def refresh(self) -> None:
        """Read every account again (and the key file, during a rotation)."""
        try:
            self.box.reload()
        except SecretsUnavailable as exc:
            logger.warning("accounts: %s", exc)
        rows = await self._pool.fetch(_SELECT)
        accounts = {(r["platform"], r["account_id"]): account_of(r, self.box) for r in rows}
        by_path = {
            path_key(a.credentials["webhook_secret"]): a
            for a in accounts.values()
            if a.owns_credentials and a.platform == "avito" and a.credentials.get("webhook_secret")
        }
        for a in accounts.values():
            if a.sealed and a.owns_credentials:
                logger.error(
                    "%s account %s: its credentials cannot be opened (%s); it is not served",
                    a.platform,
                    a.account_id,
                    a.sealed,
                )
        if {k: (a, a.fingerprint) for k, a in accounts.items()} != {
            k: (a, a.fingerprint) for k, a in self._accounts.items()
        }:
            self.version += 1
        self._accounts, self._by_path = accounts, by_path

    async def start(self) -> None:
        """Read the accounts, then keep them current in the background."""
        await self.refresh()
        if self._dsn is not None:
            try:
                # Its own connection, outside the pool: the pool's size is the work's.
                self._listener = await asyncpg.connect(self._dsn)
                await self._listener.add_listener(CHANNEL, self._notified)
            except (OSError, asyncpg.PostgresError) as exc:
                logger.warning(
                    "accounts: no change notifications (%s); reading every %gs", exc, self._refresh_seconds
                )
        self._task = asyncio.create_task(self._run(), name="accounts-refresh")

    def _notified(self, *_: object) -> None:
        self._changed.set()

    async def _run(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), timeout=self._refresh_seconds)
            self._changed.clear()
            try:
                await self.refresh()
            except Exception as exc:  # the database away: keep the accounts known
                logger.warning("accounts not refreshed: %s", exc)

    async def aclose(self) -> None:
        await self.stop()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        if self._listener is not None:
            with contextlib.suppress(Exception):
                await self._listener.close(timeout=2)
            self._listener = None


# The Avito accounts the inbox has messages of and no row (a skip scan of
# operations_message_key: one index probe per account), as the environment's.
_ENVIRONMENT_AVITO = """
WITH RECURSIVE a AS (
    (SELECT account_id FROM operations WHERE platform = 'avito' ORDER BY account_id LIMIT 1)
    UNION ALL
    SELECT (SELECT o.account_id FROM operations o
            WHERE o.platform = 'avito' AND o.account_id > a.account_id ORDER BY o.account_id LIMIT 1)
    FROM a WHERE a.account_id IS NOT NULL
)
INSERT INTO accounts (platform, account_id, name, source)
SELECT 'avito', a.account_id, 'environment', 'environment' FROM a
WHERE a.account_id ~ '^[0-9]+$'
ON CONFLICT (platform, account_id) DO NOTHING
"""


async def record_environment(pool: asyncpg.Pool, settings: Settings) -> None:
    """The environment's single-account settings as accounts (made or updated at start):
    the Telegram bot named by CHATQ_TELEGRAM_BOT_TOKEN, and with CHATQ_AVITO_CLIENT_ID the
    Avito accounts the inbox has messages of but no row. Their credentials stay in the
    environment. A row a person added (source 'admin') or removed is left as it is."""
    if settings.avito_client_id and settings.avito_client_secret is not None:
        await pool.execute(_ENVIRONMENT_AVITO)
    if settings.telegram_bot_token is None:
        return
    await pool.execute(
        """
        INSERT INTO accounts (platform, account_id, name, source) VALUES ('telegram', $1, 'environment', 'environment')
        ON CONFLICT (platform, account_id) DO UPDATE SET source = 'environment', updated_at = now(),
               name = coalesce(accounts.name, 'environment')
        WHERE accounts.source = 'seen'
        """,
        settings.telegram_account_id,
    )


async def record_seen(pool: asyncpg.Pool, platform: str, account_id: str) -> None:
    """An account of the environment named by its first message (Avito's user id)."""
    await pool.execute(
        "INSERT INTO accounts (platform, account_id, name, source) VALUES ($1, $2, 'environment', 'environment')"
        " ON CONFLICT DO NOTHING",
        platform,
        account_id,
    )
