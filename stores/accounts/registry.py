"""Accounts as data (README "Many accounts"): every Telegram bot, Avito account and generic
sender the deployment answers for is a row of ``accounts``, with its own credentials
(encrypted, ``shared.secretbox``), webhook and overrides of the global settings.

Each process holds an ``AccountRegistry``: every account, credentials decrypted, read at
start and again every ACCOUNTS_REFRESH_SECONDS; an account that changes is read again at
once, alone (LISTEN chatq_accounts on a connection of its own, outside the pool: the
notification names the account, ``stores/accounts/functions/50_accounts.sql``), so adding an
account costs the same with ten accounts or ten thousand. A lost listening connection
(Postgres restarted) is opened again every RELISTEN_SECONDS, then every account is read,
since what changed meanwhile was not notified. Credentials never leave the
process: nothing here renders them (``Account.__repr__`` hides them), the admin API
returns only which ones are set.

The environment's single-account settings (CHATQ_TELEGRAM_BOT_TOKEN, CHATQ_AVITO_CLIENT_ID,
...) keep working: at start ``record_environment`` makes (or updates) the Telegram bot's
row, source 'environment'; the environment's Avito account gets its row when Avito names
it (``/core/v1/accounts/self``, asked by the poll from the first start) or with its first
message, a generic one with its first message, and at start every Avito account the inbox
already has messages of and no row (a deployment from before accounts were data), so the
Avito poll reads it. Their credentials stay in the environment, never
in the table.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import asyncpg
from cryptography.fernet import InvalidToken, MultiFernet

from shared import metrics
from shared.credentials import credential_problems
from shared.lifecycle import cancel_and_wait
from shared.secretbox import SecretBox, SecretsUnavailable
from shared.settings import Settings
from stores.accounts.postgres import pause_by_person

#: An account's facts file: a plain file name in FACTS_DIR (no folder, no leading dot).
FACTS_FILE_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,254}$"

logger = logging.getLogger(__name__)

CHANNEL = "chatq_accounts"
#: While the notifications' connection is down, how often it is tried again.
RELISTEN_SECONDS = 5.0

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
    "unreadable_messages",
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
    # Its replies go only where it says, signed with its own secret: never to the
    # environment's CHATQ_GENERIC_REPLY_URL nor with CHATQ_GENERIC_REPLY_SECRET (issue 39).
    "generic": ("webhook_secret", "reply_url", "reply_secret"),
}

#: The reason an added account whose credentials will not do (a row from before they were
#: checked) is paused with at start.
INCOMPLETE_REASON = (
    "paused at start: the credentials of this {platform} account will not do: {problems}. An added "
    "account never uses the environment's (CHATQ_GENERIC_REPLY_URL, CHATQ_GENERIC_REPLY_SECRET); give "
    "them with `chatq accounts add {platform}:{account_id} --...`, then resume it"
)


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


def account_problems(account: Account) -> list[str]:
    """Why an added account's credentials will not do (one it needs is missing, one has
    not its format: ``shared.credentials``), a row from before they were checked; empty
    for the environment's accounts and sealed ones (nothing here can read them)."""
    if not account.owns_credentials or account.sealed is not None:
        return []
    c = account.credentials
    problems = [f"no {k} of its own" for k in REQUIRED.get(account.platform, ()) if not c.get(k)]
    return problems + credential_problems(
        account.platform, account.account_id, {k: v for k, v in c.items() if v}
    )


_SELECT = f"""
SELECT platform, account_id, name, state, state_reason, source, removed_at IS NOT NULL AS removed,
       credentials, {", ".join(OVERRIDES)}
FROM accounts
"""
#: For a process that uses no account's credentials (the coalescer): its Postgres role
#: cannot read the column (shared/roles.py), and it never holds them.
_SELECT_WITHOUT_CREDENTIALS = _SELECT.replace("credentials,", "NULL::bytea AS credentials,", 1)
_SOME = "WHERE (platform, account_id) IN (SELECT * FROM unnest($1::text[], $2::text[]))"


def account_of(row: asyncpg.Record, box: SecretBox | None, opened: dict[str, str] | None = None) -> Account:
    """The row as an Account; ``opened``: its credentials, already decrypted."""
    credentials: dict[str, str] = {}
    sealed = None
    if opened is not None:
        credentials = opened
    elif row["credentials"] is not None:
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


def _path_of(account: Account) -> str | None:
    """The key an Avito account's webhook path is found by (None: it has no path of its own)."""
    secret = account.credentials.get("webhook_secret")
    if account.owns_credentials and account.platform == "avito" and secret:
        return path_key(secret)
    return None


Key = tuple[str, str]


class AccountRegistry:
    """Every account, in memory, kept current (see the module's docstring).

    What a change costs does not grow with the number of accounts: a notification names
    the account that changed and only its row is read again (``refresh_accounts``), and
    credentials are decrypted only when their sealed value (or the keys) changed, also at
    the periodic read of every row. ``rows_read`` and ``decrypted`` count both since start
    (a test holds them per added account)."""

    def __init__(
        self,
        pool: asyncpg.Pool,
        box: SecretBox,
        *,
        refresh_seconds: float = 30.0,
        dsn: str | None = None,
        credentials: bool = True,
        also_listen: Mapping[str, Callable[[], None]] | None = None,
    ) -> None:
        self._pool = pool
        #: Other channels heard on the same connection (one LISTEN connection a process,
        #: ``Settings.database_connections``): each calls its function when notified, and
        #: when the connection is (re)opened, since what was sent meanwhile went unheard.
        self._also = dict(also_listen or {})
        self._select = _SELECT if credentials else _SELECT_WITHOUT_CREDENTIALS
        self._dsn = dsn
        self.box = box
        self._refresh_seconds = refresh_seconds
        self._accounts: dict[Key, Account] = {}
        self._by_path: dict[str, Account] = {}
        #: Each account's sealed credentials and what they opened to, under ``_generation``'s keys.
        self._opened: dict[Key, tuple[bytes, dict[str, str]]] = {}
        self._generation = box.generation
        #: Why the key file cannot be used, as last logged (None: it can).
        self._key_problem: str | None = box.problem
        #: Reads of the table one at a time, so a later read is never overwritten by an earlier one.
        self._lock = asyncio.Lock()
        self._pending: set[Key] = set()
        self._read_all = False
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._listener: asyncpg.Connection | None = None
        #: Incremented at each refresh that changed something.
        self.version = 0
        self.rows_read = 0
        self.decrypted = 0

    @classmethod
    def from_settings(
        cls,
        pool: asyncpg.Pool,
        settings: Settings,
        *,
        credentials: bool = True,
        also_listen: Mapping[str, Callable[[], None]] | None = None,
    ) -> AccountRegistry:
        """``credentials=False``: the accounts without their credentials (never read, so
        no key is needed)."""
        keys = settings.secrets_key.get_secret_value() if settings.secrets_key and credentials else None
        return cls(
            pool,
            SecretBox(keys, settings.secrets_key_file if credentials else None),
            refresh_seconds=settings.accounts_refresh_seconds,
            dsn=settings.database_url.get_secret_value(),
            credentials=credentials,
            also_listen=also_listen,
        )

    def get(self, platform: str, account_id: str) -> Account | None:
        return self._accounts.get((platform, account_id))

    def by_path_secret(self, platform: str, secret: str) -> Account | None:
        """The live account whose webhook path secret this is (Avito)."""
        account = self._by_path.get(path_key(secret))
        return account if account is not None and account.platform == platform else None

    def all(self) -> Iterable[Account]:
        return self._accounts.values()

    def _account(self, row: asyncpg.Record) -> Account:
        """The row as an Account, its credentials decrypted only if they changed since the
        last read (or the keys did)."""
        key = (row["platform"], row["account_id"])
        token = row["credentials"]
        if token is None:
            self._opened.pop(key, None)
            return account_of(row, self.box)
        sealed = bytes(token)
        known = self._opened.get(key)
        if known is not None and known[0] == sealed:
            return account_of(row, self.box, known[1])
        self.decrypted += 1
        account = account_of(row, self.box)
        if account.sealed is None:
            self._opened[key] = (sealed, account.credentials)
        else:
            self._opened.pop(key, None)
            if account.owns_credentials:
                logger.error(
                    "%s account %s: its credentials cannot be opened (%s); it is not served",
                    account.platform,
                    account.account_id,
                    account.sealed,
                )
        return account

    def _reload_keys(self) -> bool:
        """Read the keys again (the key file, during a rotation); True when they changed.
        A key file that cannot be used keeps the keys in use (and so every account as it
        was opened), logged once and shown by ``chatq_secrets_key_file_invalid`` until it is
        good again; reading the rows goes on, so a removal or a pause (which need no key)
        still applies at once."""
        try:
            self.box.reload(self._opens_some)
        except SecretsUnavailable as exc:
            if str(exc) != self._key_problem:
                logger.error("accounts: %s", exc)
            self._key_problem = str(exc)
            metrics.SECRETS_KEY_FILE_INVALID.set(1)
        else:
            if self._key_problem is not None:
                logger.warning("accounts: the secrets key file can be used again")
            self._key_problem = None
            metrics.SECRETS_KEY_FILE_INVALID.set(0)
        if self.box.generation == self._generation:
            return False
        self._generation = self.box.generation
        self._opened.clear()  # what the old keys opened is opened again (or not) by the new
        return True

    def _opens_some(self, keys: MultiFernet) -> str | None:
        """Why new keys are a bad edit: they open none of the accounts' credentials the keys
        in use opened (the old key dropped before ``rotate-key``: every account would stop
        being served). None: they open at least one, or there is none to open."""
        sealed = [token for token, _ in self._opened.values()]
        for token in sealed:
            try:
                keys.decrypt(token)
            except InvalidToken:
                continue
            return None
        if not sealed:
            return None
        return (
            f"its keys open none of the {len(sealed)} account(s) the keys in use open (was the old "
            "key dropped before `chatq accounts rotate-key`? put it back after the new one)"
        )

    async def refresh(self) -> None:
        """Read every account again (and the key file, during a rotation): at start, every
        ACCOUNTS_REFRESH_SECONDS, and when a notification could not say which account."""
        async with self._lock:
            self._reload_keys()
            await self._read_all_rows()

    async def _read_all_rows(self) -> None:
        rows = await self._pool.fetch(self._select)
        self.rows_read += len(rows)
        accounts = {(r["platform"], r["account_id"]): self._account(r) for r in rows}
        for gone in self._opened.keys() - accounts.keys():
            del self._opened[gone]
        by_path = {path: a for a in accounts.values() if (path := _path_of(a)) is not None}
        if accounts.keys() != self._accounts.keys() or any(
            _changed(self._accounts[k], a) for k, a in accounts.items()
        ):
            self.version += 1
        self._accounts, self._by_path = accounts, by_path

    async def refresh_accounts(self, keys: Iterable[Key]) -> None:
        """Read these accounts again (a change to them was notified, or made here): one
        query, by the primary key, whatever the number of accounts. (Every account, when
        the keys changed.)"""
        wanted = set(keys)
        if not wanted:
            return
        async with self._lock:
            if self._reload_keys():
                await self._read_all_rows()
                return
            rows = await self._pool.fetch(
                self._select + _SOME, [k[0] for k in wanted], [k[1] for k in wanted]
            )
            self.rows_read += len(rows)
            found = {(r["platform"], r["account_id"]): self._account(r) for r in rows}
            changed = False
            for key in wanted:
                old, new = self._accounts.get(key), found.get(key)
                if old is not None and (path := _path_of(old)) is not None and self._by_path.get(path) is old:
                    del self._by_path[path]
                if new is None:
                    self._accounts.pop(key, None)
                    self._opened.pop(key, None)
                else:
                    self._accounts[key] = new
                    if (path := _path_of(new)) is not None:
                        self._by_path[path] = new
                changed = changed or old is None or new is None or _changed(old, new)
            if changed:
                self.version += 1

    async def refresh_account(self, platform: str, account_id: str) -> None:
        """Read this account again: the admin API's change seen by the process that made it
        before it answers (the others hear of it by notification)."""
        await self.refresh_accounts([(platform, account_id)])

    async def start(self) -> None:
        """Read the accounts, then keep them current in the background."""
        # It listens before the first read, so no change falls between the two.
        await self._listen()
        await self.refresh()
        self._task = asyncio.create_task(self._run(), name="accounts-refresh")

    @property
    def listening(self) -> bool:
        return self._listener is not None and not self._listener.is_closed()

    async def _listen(self) -> bool:
        """LISTEN on a connection of its own, outside the pool (the pool's size is the
        work's). False when Postgres cannot be reached: the caller tries again."""
        if self._dsn is None:
            return False
        try:
            listener = await asyncpg.connect(self._dsn)
        except (OSError, asyncpg.PostgresError) as exc:
            logger.warning(
                "accounts: no change notifications (%s); trying again in %gs, reading every %gs",
                exc,
                RELISTEN_SECONDS,
                self._refresh_seconds,
            )
            return False
        try:
            await listener.add_listener(CHANNEL, self._notified)
            for channel, call in self._also.items():
                await listener.add_listener(channel, _caller(call))
        except (OSError, asyncpg.PostgresError) as exc:
            logger.warning("accounts: LISTEN refused (%s); trying again in %gs", exc, RELISTEN_SECONDS)
            with contextlib.suppress(Exception):
                await listener.close(timeout=2)
            return False
        listener.add_termination_listener(self._lost)
        self._listener = listener
        for channel, call in self._also.items():
            _call_safely(channel, call)
        return True

    def _lost(self, _conn: object) -> None:
        """The listening connection ended (Postgres restarted, a proxy cut it): changes
        made from now on are not notified until it listens again."""
        logger.warning("accounts: the change notifications' connection was lost; listening again")
        self._changed.set()

    def _notified(self, _conn: object, _pid: int, _channel: str, payload: object) -> None:
        try:
            platform, account_id = json.loads(str(payload))
            self._pending.add((str(platform), str(account_id)))
        except (ValueError, TypeError):
            self._read_all = True  # no account named (an id too long for a notification)
        self._changed.set()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        due = loop.time() + self._refresh_seconds
        while True:
            wake = due if self.listening or self._dsn is None else min(due, loop.time() + RELISTEN_SECONDS)
            # asyncio.timeout, not wait_for: Python 3.11's wait_for swallows a cancellation
            # that comes as the event is set (gh-86296), and stop() then waited for ever
            # (a receiver's shutdown hung once in CI, this task still looping).
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, wake - loop.time())):
                    await self._changed.wait()
            self._changed.clear()
            if self._dsn is not None and not self.listening and await self._listen():
                # What changed while nobody listened was not notified: read everything.
                self._read_all = True
            pending, self._pending = self._pending, set()
            everything, self._read_all = self._read_all or loop.time() >= due, False
            try:
                if everything:
                    due = loop.time() + self._refresh_seconds
                    await self.refresh()
                else:
                    await self.refresh_accounts(pending)
            except Exception as exc:  # the database away: keep the accounts known
                logger.warning("accounts not refreshed: %s", exc)
                self._read_all = self._read_all or bool(pending)  # at the next wake

    async def aclose(self) -> None:
        await self.stop()

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)
        if self._listener is not None:
            listener, self._listener = self._listener, None
            listener.remove_termination_listener(self._lost)
            with contextlib.suppress(Exception):
                await listener.close(timeout=2)


def _caller(call: Callable[[], None]) -> Callable[[object, int, str, object], None]:
    def notified(_conn: object, _pid: int, channel: str, _payload: object) -> None:
        _call_safely(channel, call)

    return notified


def _call_safely(channel: str, call: Callable[[], None]) -> None:
    """A listener's function, whose failure is logged, never the accounts' refresh's."""
    try:
        call()
    except Exception:
        logger.exception("accounts: the listener of %s failed", channel)


def _changed(old: Account, new: Account) -> bool:
    return old != new or old.fingerprint != new.fingerprint


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


async def pause_incomplete(pool: asyncpg.Pool, registry: AccountRegistry) -> list[Key]:
    """At start: pause (by a person, with the reason and the fix) every added account whose
    credentials will not do, a row from before they were checked (a generic account without
    its own reply_url or reply_secret, which replied through the environment's; a webhook
    secret that is no Standard Webhooks key).
    Its replies wait instead of going where the account never said. Returns those paused."""
    paused: list[Key] = []
    for account in list(registry.all()):
        problems = account_problems(account)
        if not problems or account.state == "paused_by_person":
            continue
        reason = INCOMPLETE_REASON.format(
            platform=account.platform, account_id=account.account_id, problems="; ".join(problems)
        )
        moved = await pause_by_person(pool, account.platform, account.account_id, reason)
        if moved:
            logger.error("%s account %s: %s", account.platform, account.account_id, reason)
            paused.append((account.platform, account.account_id))
    await registry.refresh_accounts(paused)
    return paused
