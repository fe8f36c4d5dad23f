"""The accounts' admin API (README "Many accounts"): add (or update) an account with its
credentials and overrides, list, show, pause, resume, remove, and connect its webhook.
Admin token as every admin endpoint. Credentials go in and never come out: a view says
which ones are set, and an Avito path secret shows as ``***``."""

from __future__ import annotations

import hmac
import secrets
from typing import Any, Literal

import asyncpg
import httpx
from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from platforms.avito.connect import connect_avito
from platforms.connect import ConnectError
from platforms.inbound import ApiError
from platforms.telegram.connect import connect_telegram
from services.receiver.admin import account_numbers, require_admin
from services.receiver.admin.routes import NO_NUL
from shared.credentials import credential_problems
from shared.db import one
from shared.reply_url import ReplyUrlRefused
from shared.secretbox import SecretsUnavailable
from shared.settings import Settings
from stores.accounts.postgres import pause_by_person, resume_by_person
from stores.accounts.registry import (
    CREDENTIALS,
    FACTS_FILE_NAME,
    OVERRIDES,
    REQUIRED,
    AccountRegistry,
    account_problems,
    path_key,
)

router = APIRouter()

#: Ids are path segments: what the platforms use (digits, letters, - _ .), nothing else.
_ID = r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}$"


class Credentials(BaseModel):
    """An account's credentials; which ones a platform takes: ``stores.accounts.registry.CREDENTIALS``.
    A webhook secret left out is made here (random), and ``chatq connect --account``
    registers it with the platform."""

    model_config = ConfigDict(extra="forbid", hide_input_in_errors=True)

    # Each one's format: shared.credentials (a 422 that names the rule, never the value).
    bot_token: str | None = Field(default=None, max_length=200)
    webhook_secret: str | None = Field(default=None, min_length=16, max_length=256)
    client_id: str | None = Field(default=None, min_length=1, max_length=200)
    client_secret: str | None = Field(default=None, min_length=1, max_length=500)
    reply_url: str | None = Field(default=None, max_length=2000)
    reply_secret: str | None = Field(default=None, min_length=16, max_length=500)

    def given(self) -> dict[str, str]:
        return {k: v for k, v in self.model_dump().items() if v is not None}


class Overrides(BaseModel):
    """Settings of this account that override the global ones (None: the global one)."""

    model_config = ConfigDict(extra="forbid")

    # Postgres text holds no NUL character: refused here as a 422, not a 500 from the write.
    facts: str | None = Field(default=None, min_length=1, max_length=100_000, pattern=NO_NUL)
    # A file name in CHATQ_FACTS_DIR: nothing else on the services' host is read for an account.
    facts_file: str | None = Field(default=None, pattern=FACTS_FILE_NAME)
    llm_model: str | None = Field(default=None, min_length=1, max_length=200, pattern=NO_NUL)
    prompt: str | None = Field(default=None, min_length=1, max_length=20_000, pattern=NO_NUL)
    reply_delay_min_seconds: float | None = Field(default=None, ge=0, le=86400)
    reply_delay_max_seconds: float | None = Field(default=None, ge=0, le=86400)
    takeover_seconds: float | None = Field(default=None, ge=0, le=30 * 86400)
    rate_per_second: float | None = Field(default=None, gt=0, le=1000)
    # A message the bot cannot read alone: 'person' hands it over, 'answer' answers it.
    unreadable_messages: Literal["person", "answer"] | None = None

    @model_validator(mode="after")
    def _pause_range(self) -> Overrides:
        low, high = self.reply_delay_min_seconds, self.reply_delay_max_seconds
        if low is not None and high is not None and low > high:
            raise ValueError("reply_delay_min_seconds must not exceed reply_delay_max_seconds")
        return self


#: The platforms an account can be of.
PlatformName = Literal["telegram", "avito", "generic"]


class AccountIn(BaseModel):
    model_config = ConfigDict(extra="forbid", hide_input_in_errors=True)

    platform: PlatformName
    account_id: str = Field(pattern=_ID, description="Telegram: the bot id; Avito: the user_id")
    name: str = Field(min_length=1, max_length=200)
    credentials: Credentials = Credentials()
    overrides: Overrides = Overrides()
    continue_history: bool = Field(
        default=False,
        description=(
            "Take an id that was removed, or that the environment's settings answered for: its "
            "chats and messages stay under the id, and the added account continues them (its "
            "model calls are given them). Only when it is the same seller."
        ),
    )

    @field_validator("name")
    @classmethod
    def _printable(cls, v: str) -> str:
        if not v.strip() or any(not c.isprintable() for c in v):
            raise ValueError("name must be printable text")
        return v.strip()


class PauseIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # Postgres text holds no NUL character: refused here as a 422, not a 500 from the write.
    reason: str = Field(min_length=1, max_length=500, pattern=NO_NUL)
    by: str = Field(default="admin", min_length=1, max_length=200, pattern=NO_NUL)


def _registry(request: Request) -> AccountRegistry:
    registry: AccountRegistry = request.app.state.runtime.accounts
    return registry


def webhook_path(platform: str, account_id: str) -> str:
    """Where the platform posts this account's messages (an Avito path secret as ***)."""
    return {
        "telegram": f"/v1/webhooks/telegram/{account_id}",
        "avito": "/v1/webhooks/avito/***",
        "generic": f"/v1/webhooks/generic/{account_id}",
    }[platform]


def _check_credentials(platform: str, account_id: str, credentials: dict[str, str]) -> None:
    """Postgres cannot read sealed credentials: what they must be is checked here
    (``shared.credentials``), so a bad one is refused when it is set, not at its first use."""
    unknown = sorted(set(credentials) - set(CREDENTIALS[platform]))
    if unknown:
        raise ApiError(
            422,
            "invalid_credentials",
            f"a {platform} account takes {', '.join(CREDENTIALS[platform])}; not {', '.join(unknown)}",
        )
    missing = [k for k in REQUIRED[platform] if not credentials.get(k)]
    if missing:
        why = (
            ": its replies go only where the account says, signed with its own secret (never to "
            "CHATQ_GENERIC_REPLY_URL nor with CHATQ_GENERIC_REPLY_SECRET)"
            if platform == "generic" and {"reply_url", "reply_secret"} & set(missing)
            else ""
        )
        raise ApiError(422, "invalid_credentials", f"a {platform} account needs {', '.join(missing)}{why}")
    problems = credential_problems(platform, account_id, credentials)
    if problems:
        raise ApiError(422, "invalid_credentials", "; ".join(problems))


def _refuse_history(platform: str, account_id: str, old: asyncpg.Record) -> None:
    """An id whose chats are someone else's is not handed over in silence: a removed
    account's, or one the environment's settings answered for, keep their chats and
    messages under the id, and an account added under it would continue them (its model
    calls given another tenant's conversations). 409 unless ``continue_history``."""
    if old["removed_at"] is not None:
        whose = "was removed"
    elif old["source"] != "admin":
        whose = "is the environment's (CHATQ_* settings)"
    else:
        return  # an update of the added account itself
    raise ApiError(
        409,
        "account_has_history",
        f"the {platform} account {account_id} {whose}; its chats and messages stay under this id and "
        "an account added under it would continue them (its model calls would be given them). Add it "
        "under another id, or, when it is the same seller, again with continue_history "
        "(chatq accounts add --continue-history)",
    )


async def _check_reply_url(settings: Settings, url: str) -> None:
    """A reply_url must not reach inside the deployment (shared/reply_url.py): its host, or
    every address it resolves to now, is on the public internet, or the operator allows it.
    The responder checks again at every send (a name may resolve elsewhere later)."""
    try:
        await settings.reply_url_policy().check(url)
    except ReplyUrlRefused as refused:
        raise ApiError(422, "invalid_reply_url", f"reply_url is refused: {refused.reason}") from None


def _is_environments_path(request: Request, secret: str) -> bool:
    """Whether an Avito path secret is CHATQ_AVITO_WEBHOOK_SECRET: two accounts on one path
    would take every delivery of the environment's for the added one's (and refuse it)."""
    settings: Settings = request.app.state.settings
    env = settings.avito_webhook_secret.get_secret_value() if settings.avito_webhook_secret else None
    return env is not None and hmac.compare_digest(secret.encode(), env.encode())


#: The environment's secrets an added account may not be given: with the environment's
#: generic reply secret its replies would carry signatures the environment's endpoint
#: takes; with a webhook secret of the environment's, that key would open an environment's
#: path too. (An Avito path secret: ``_is_environments_path``.)
ENVIRONMENT_SECRETS = (
    ("generic_webhook_secret", "CHATQ_GENERIC_WEBHOOK_SECRET"),
    ("generic_reply_secret", "CHATQ_GENERIC_REPLY_SECRET"),
    ("telegram_webhook_secret", "CHATQ_TELEGRAM_WEBHOOK_SECRET"),
    ("avito_webhook_secret", "CHATQ_AVITO_WEBHOOK_SECRET"),
    ("alert_webhook_secret", "CHATQ_ALERT_WEBHOOK_SECRET"),
)
#: The credentials that are secrets shared with the other side and must be the account's own.
OWN_SECRETS = ("webhook_secret", "reply_secret")


def _check_secrets_are_its_own(
    settings: Settings, registry: AccountRegistry, platform: str, account_id: str, credentials: dict[str, str]
) -> None:
    """409 when a webhook or reply secret is one of the environment's or another account's
    (the reason names the setting or says "another account", never a value)."""
    for name in OWN_SECRETS:
        value = credentials.get(name)
        if not value:
            continue
        mine = value.encode()
        for setting, env_name in ENVIRONMENT_SECRETS:
            env = getattr(settings, setting)
            if env is not None and hmac.compare_digest(mine, env.get_secret_value().encode()):
                raise ApiError(
                    409,
                    "secret_taken",
                    f"{name} is the environment's {env_name}: an added account's secrets are its own",
                )
        for other in registry.all():
            if not other.owns_credentials or (other.platform, other.account_id) == (platform, account_id):
                continue
            if any(
                hmac.compare_digest(mine, other.credentials[n].encode())
                for n in OWN_SECRETS
                if other.credentials.get(n)
            ):
                raise ApiError(
                    409,
                    "secret_taken",
                    f"{name} is another account's secret: each account's secrets are its own",
                )


def account_view(row: asyncpg.Record, credential_names: list[str]) -> dict[str, Any]:
    return {
        "platform": row["platform"],
        "account_id": row["account_id"],
        "name": row["name"],
        "source": row["source"],
        "state": "removed" if row["removed_at"] else row["state"],
        "reason": row["state_reason"],
        "since": row["state_since"].isoformat(),
        "credentials_set": credential_names,
        "overrides": {k: row[k] for k in OVERRIDES if row[k] is not None},
        "webhook_path": webhook_path(row["platform"], row["account_id"]),
        "created_at": row["created_at"].isoformat(),
    }


def _names(registry: AccountRegistry, row: asyncpg.Record) -> list[str]:
    if row["credentials"] is None:
        return []
    try:
        return sorted(registry.box.open(row["credentials"]))
    except SecretsUnavailable:
        return ["(sealed: no configured key opens them)"]


_ROW = f"""SELECT platform, account_id, name, source, state, state_reason, state_since, created_at, removed_at,
          credentials, {", ".join(OVERRIDES)} FROM accounts"""


async def _row(pool: asyncpg.Pool, platform: str, account_id: str) -> asyncpg.Record:
    if "\x00" in platform or "\x00" in account_id:  # no such account: Postgres text holds no NUL
        raise ApiError(404, "account_not_found", "no account has a NUL character in its id")
    row = await pool.fetchrow(_ROW + " WHERE platform = $1 AND account_id = $2", platform, account_id)
    if row is None:
        raise ApiError(404, "account_not_found", f"no {platform} account {account_id}")
    return row


@router.post("/v1/accounts")
async def add_account(body: AccountIn, request: Request) -> dict[str, Any]:
    """Add an account, or update it (its name, overrides, and the credentials given)."""
    require_admin(request)
    registry = _registry(request)
    pool: asyncpg.Pool = request.app.state.pool
    if not registry.box.configured:
        raise ApiError(
            409, "no_secrets_key", "set CHATQ_SECRETS_KEY on every service to keep an account's credentials"
        )
    async with pool.acquire() as conn, conn.transaction():
        old = await conn.fetchrow(
            "SELECT credentials, removed_at, source FROM accounts"
            " WHERE platform = $1 AND account_id = $2 FOR UPDATE",
            body.platform,
            body.account_id,
        )
        if old is not None and not body.continue_history:
            _refuse_history(body.platform, body.account_id, old)
        credentials: dict[str, str] = {}
        if old is not None and old["credentials"] is not None:
            try:
                credentials = registry.box.open(old["credentials"])
            except SecretsUnavailable as exc:
                raise ApiError(409, "sealed_credentials", f"{exc}; give every credential again") from None
        credentials.update(body.credentials.given())
        if body.platform in ("telegram", "avito") and not credentials.get("webhook_secret"):
            credentials["webhook_secret"] = secrets.token_urlsafe(24)
        _check_credentials(body.platform, body.account_id, credentials)
        if body.platform == "generic" and credentials.get("reply_url"):
            await _check_reply_url(request.app.state.settings, credentials["reply_url"])
        if body.platform == "avito" and _is_environments_path(request, credentials["webhook_secret"]):
            raise ApiError(
                409, "webhook_secret_taken", "the environment's Avito account has this webhook secret"
            )
        _check_secrets_are_its_own(
            request.app.state.settings, registry, body.platform, body.account_id, credentials
        )
        if body.overrides.facts_file is not None and request.app.state.settings.facts_dir is None:
            raise ApiError(
                422,
                "invalid_overrides",
                "facts_file names a file in CHATQ_FACTS_DIR, which is not set: give the facts as text",
            )
        overrides = body.overrides.model_dump()
        # Its Avito tokens were the old credentials': asked for again with the new ones.
        await conn.execute(
            "DELETE FROM platform_tokens WHERE platform = $1 AND account_id = $2",
            body.platform,
            body.account_id,
        )
        key = path_key(credentials["webhook_secret"]) if body.platform == "avito" else None
        try:
            row = await conn.fetchrow(
                f"""
                INSERT INTO accounts (platform, account_id, name, source, credentials, webhook_key,
                                      {", ".join(OVERRIDES)})
                VALUES ($1, $2, $3, 'admin', $4, $5, {", ".join(f"${i}" for i in range(6, 6 + len(OVERRIDES)))})
                ON CONFLICT (platform, account_id) DO UPDATE SET
                    name = excluded.name, source = 'admin', credentials = excluded.credentials,
                    webhook_key = excluded.webhook_key, removed_at = NULL, updated_at = now(),
                    {", ".join(f"{k} = excluded.{k}" for k in OVERRIDES)}
                RETURNING (xmax = 0) AS created
                """,
                body.platform,
                body.account_id,
                body.name,
                registry.box.seal(credentials),
                key,
                *(overrides[k] for k in OVERRIDES),
            )
        except asyncpg.UniqueViolationError:
            raise ApiError(409, "webhook_secret_taken", "another account has this webhook secret") from None
    await registry.refresh_account(body.platform, body.account_id)
    view = account_view(await _row(pool, body.platform, body.account_id), sorted(credentials))
    view["created"] = bool(one(row)["created"]) or (old is not None and old["removed_at"] is not None)
    return view


@router.post("/v1/accounts/rotate-key")
async def rotate_key(request: Request) -> dict[str, Any]:
    """Seal every account's credentials, and every Avito access token, again under the
    first SECRETS_KEY (after a new key was put first), so the old key can then be dropped."""
    require_admin(request)
    registry = _registry(request)
    # The key file read again first: its new first key may have been put there a moment
    # ago, and sealing again under the old key would lose every account when it is dropped.
    await registry.refresh()
    if registry.box.problem is not None:
        # Sealing again under the keys read before would not be under the file's new first key.
        raise ApiError(409, "secrets_key_file_invalid", f"{registry.box.problem}: fix it first")
    if not registry.box.configured:
        raise ApiError(409, "no_secrets_key", "set CHATQ_SECRETS_KEY on every service first")
    pool: asyncpg.Pool = request.app.state.pool
    resealed, unopened = 0, []
    async with pool.acquire() as conn, conn.transaction():
        rows = await conn.fetch(
            "SELECT platform, account_id, credentials FROM accounts WHERE credentials IS NOT NULL FOR UPDATE"
        )
        for r in rows:
            try:
                token = registry.box.rotate(r["credentials"])
            except SecretsUnavailable:
                unopened.append(f"{r['platform']}:{r['account_id']}")
                continue
            await conn.execute(
                "UPDATE accounts SET credentials = $3 WHERE platform = $1 AND account_id = $2",
                r["platform"],
                r["account_id"],
                token,
            )
            resealed += 1
        # Avito access tokens are sealed with the same keys: under the first key too, or
        # dropped when none opens them (asked of Avito again at the next send).
        for t in await conn.fetch(
            "SELECT platform, credential, sealed FROM platform_tokens WHERE sealed IS NOT NULL FOR UPDATE"
        ):
            try:
                await conn.execute(
                    "UPDATE platform_tokens SET sealed = $3 WHERE platform = $1 AND credential = $2",
                    t["platform"],
                    t["credential"],
                    registry.box.rotate(t["sealed"]),
                )
            except SecretsUnavailable:
                await conn.execute(
                    "DELETE FROM platform_tokens WHERE platform = $1 AND credential = $2",
                    t["platform"],
                    t["credential"],
                )
    await registry.refresh()
    return {"resealed": resealed, "unopened": unopened}


@router.get("/v1/accounts")
async def list_accounts(
    request: Request, platform: PlatformName | None = None, removed: bool = False
) -> dict[str, Any]:
    require_admin(request)
    pool: asyncpg.Pool = request.app.state.pool
    rows = await pool.fetch(
        _ROW + " WHERE ($1::text IS NULL OR platform = $1) AND ($2 OR removed_at IS NULL)"
        " ORDER BY platform, account_id",
        platform,
        removed,
    )
    registry = _registry(request)
    return {"accounts": [account_view(r, _names(registry, r)) for r in rows], "count": len(rows)}


@router.get("/v1/accounts/{platform}/{account_id:path}")
async def show_account(platform: str, account_id: str, request: Request) -> dict[str, Any]:
    require_admin(request)
    pool: asyncpg.Pool = request.app.state.pool
    row = await _row(pool, platform, account_id)
    view = account_view(row, _names(_registry(request), row))
    view["numbers"] = (await account_numbers(pool, platform, account_id)).get((platform, account_id), {})
    return view


@router.post("/v1/accounts/{platform}/{account_id:path}/pause")
async def pause_account(platform: str, account_id: str, body: PauseIn, request: Request) -> dict[str, Any]:
    """A person pauses the account: its replies wait (none fails) until a person resumes it."""
    require_admin(request)
    pool: asyncpg.Pool = request.app.state.pool
    await _row(pool, platform, account_id)
    moved = await pause_by_person(pool, platform, account_id, f"paused by {body.by}: {body.reason}")
    row = await _row(pool, platform, account_id)
    if not moved and row["removed_at"] is not None:
        raise ApiError(409, "account_removed", f"the {platform} account {account_id} was removed")
    await _registry(request).refresh_account(platform, account_id)
    return account_view(row, _names(_registry(request), row))


@router.post("/v1/accounts/{platform}/{account_id:path}/resume")
async def resume_account(platform: str, account_id: str, request: Request) -> dict[str, Any]:
    """A person's pause ends at once; a platform's is probed now (it ends when the platform
    accepts the account again)."""
    require_admin(request)
    pool: asyncpg.Pool = request.app.state.pool
    await _row(pool, platform, account_id)
    _refuse_unservable(_registry(request), platform, account_id)
    await resume_by_person(pool, platform, account_id)
    row = await _row(pool, platform, account_id)
    await _registry(request).refresh_account(platform, account_id)
    return account_view(row, _names(_registry(request), row))


def _refuse_unservable(registry: AccountRegistry, platform: str, account_id: str) -> None:
    """An added account that cannot send (a credential missing or without its format, a row
    from before they were checked; or its credentials no key opens) is not resumed: its
    waiting replies would fail for good. 409 naming what is missing; they keep waiting."""
    account = registry.get(platform, account_id)
    if account is None or not account.owns_credentials:
        return
    if account.sealed is not None:
        raise ApiError(
            409,
            "sealed_credentials",
            f"the {platform} account {account_id}'s credentials cannot be opened ({account.sealed}): "
            "give every credential again, then resume it",
        )
    problems = account_problems(account)
    if problems:
        raise ApiError(
            409,
            "incomplete_account",
            f"the {platform} account {account_id} cannot send: {'; '.join(problems)}. Give them with "
            f"`chatq accounts add {platform}:{account_id} --...`, then resume it; its replies wait meanwhile",
        )


@router.delete("/v1/accounts/{platform}/{account_id:path}")
async def remove_account(platform: str, account_id: str, request: Request) -> dict[str, Any]:
    """Remove the account: its credentials and tokens are wiped, its webhooks answer as an
    unknown account's (401), its replies
    not yet sent fail with the reason. Its messages and their record stay."""
    require_admin(request)
    pool: asyncpg.Pool = request.app.state.pool
    await _row(pool, platform, account_id)
    async with pool.acquire() as conn, conn.transaction():
        await conn.execute(
            """
            UPDATE accounts SET removed_at = coalesce(removed_at, now()), credentials = NULL, webhook_key = NULL,
                   updated_at = now()
            WHERE platform = $1 AND account_id = $2
            """,
            platform,
            account_id,
        )
        # Its access tokens are credentials too (an Avito account's): gone with it.
        await conn.execute(
            "DELETE FROM platform_tokens WHERE platform = $1 AND account_id = $2", platform, account_id
        )
    await _registry(request).refresh_account(platform, account_id)
    row = await _row(pool, platform, account_id)
    return account_view(row, [])


class ConnectIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    disconnect: bool = False


@router.post("/v1/accounts/{platform}/{account_id:path}/connect")
async def connect_account(
    platform: str, account_id: str, body: ConnectIn, request: Request
) -> dict[str, Any]:
    """Register (or remove) the account's webhook with its platform, from this receiver:
    the credentials never leave it (``chatq connect PLATFORM --account ID``)."""
    require_admin(request)
    settings: Settings = request.app.state.settings
    account = _registry(request).get(platform, account_id)
    if account is None or not account.owns_credentials or platform not in ("telegram", "avito"):
        raise ApiError(
            404, "account_not_found", f"no {platform} account {account_id} with credentials of its own"
        )
    c = account.credentials
    try:
        async with httpx.AsyncClient(timeout=15) as client:
            if platform == "telegram":
                own = settings.model_copy(
                    update={
                        "telegram_bot_token": _s(c["bot_token"]),
                        "telegram_webhook_secret": _s(c["webhook_secret"]),
                    }
                )
                outcome = await connect_telegram(own, client, disconnect=body.disconnect, account=account_id)
            else:
                own = settings.model_copy(
                    update={
                        "avito_client_id": c["client_id"],
                        "avito_client_secret": _s(c["client_secret"]),
                        "avito_webhook_secret": _s(c["webhook_secret"]),
                    }
                )
                outcome = await connect_avito(own, client, disconnect=body.disconnect)
    except ConnectError as exc:
        status = {"usage": 409, "refused": 502, "unreachable": 504}[exc.kind]
        raise ApiError(status, f"connect_{exc.kind}", str(exc)) from None
    return {"text": outcome.text, "changed": outcome.changed}


def _s(value: str) -> Any:
    from pydantic import SecretStr

    return SecretStr(value)
