"""The admin API's routes (design section 5): parse and check the request, then read
(read.py) or command (commands.py, through the stores). Every response has its model
(models.py), so /openapi.json documents the admin API."""

from __future__ import annotations

import re
import uuid
from typing import Any

import asyncpg
from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from platforms.inbound import ApiError
from services.receiver.admin import commands, models, read
from services.receiver.admin.auth import require_admin
from shared.metrics import RETRIES
from stores.operations.postgres import PgOperationStore

router = APIRouter()

#: A person's words go to Postgres text, which holds no NUL character: a 422, not a 500.
NO_NUL = r"^[^\x00]*$"


def _parse_id(operation_id: str) -> uuid.UUID:
    try:
        return uuid.UUID(operation_id)
    except ValueError:
        raise ApiError(400, "bad_operation_id", "operation ids are UUIDs") from None


@router.get("/v1/operations/{operation_id}", response_model=models.OperationWithTimeline)
async def get_operation(operation_id: str, request: Request) -> dict[str, Any]:
    """An operation's status in words a person reads, its reply or error, and its record."""
    require_admin(request)
    op_id = _parse_id(operation_id)
    doc = await read.operation(request.app.state.pool, op_id)
    if doc is None:
        raise ApiError(404, "operation_not_found", f"no operation {op_id}")
    return doc


def parse_account(account: str | None) -> tuple[str | None, str | None]:
    """``platform:account_id`` (as ``chatq`` and the ops page write it) -> its two parts."""
    if account is None or not account.strip():
        return None, None
    platform, sep, account_id = account.strip().partition(":")
    # Postgres text holds no NUL character: a 400 here, not a 500 from the query.
    if (
        not sep
        or "\x00" in account_id
        or platform not in ("telegram", "avito", "generic", "sandbox")
        or not account_id
    ):
        raise ApiError(400, "bad_account", "account is PLATFORM:ACCOUNT_ID, e.g. avito:123456")
    return platform, account_id


_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhd]?)$")


def parse_age(value: str) -> float:
    """'90', '90s', '15m', '2h', '1d' -> seconds."""
    match = _DURATION.match(value.strip())
    if not match:
        raise ApiError(
            400, "bad_older_than", "older_than is seconds or a number with s, m, h or d (e.g. 15m)"
        )
    return float(match[1]) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[match[2]]


@router.get("/v1/operations", response_model=models.OperationList)
async def list_operations(
    request: Request,
    status: str | None = None,
    older_than: str | None = None,
    limit: int = 50,
    account: str | None = None,
) -> dict[str, Any]:
    """The newest operations, by status (comma-separated), age (``older_than=15m``) and
    account (``account=avito:42``)."""
    require_admin(request)
    platform, account_id = parse_account(account)
    if not 1 <= limit <= 1000:
        raise ApiError(400, "bad_limit", "limit is between 1 and 1000")
    statuses = [s.strip() for s in status.split(",")] if status else list(read.STATUSES)
    unknown = [s for s in statuses if s not in read.STATUSES]
    if unknown:
        raise ApiError(400, "bad_status", f"unknown status {unknown[0]!r}; one of {', '.join(read.STATUSES)}")
    age = parse_age(older_than) if older_than else 0.0
    return await read.operations(request.app.state.pool, statuses, age, limit, platform, account_id)


class RetryRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    by: str = Field(default="admin", min_length=1, max_length=200, pattern=NO_NUL)
    note: str = Field(default="", max_length=2000, pattern=NO_NUL)


@router.post("/v1/operations/{operation_id}/retry", status_code=202, response_model=models.Retried)
async def retry_operation(
    operation_id: str, request: Request, resend: bool = False, body: RetryRequest | None = None
) -> models.Retried:
    """Put a failed operation (with the rest of its reply job) back to work; a
    needs_review one only with ``resend=true`` (commands.retry)."""
    require_admin(request)
    op_id = _parse_id(operation_id)
    who = body or RetryRequest()
    done = await commands.retry(
        PgOperationStore(request.app.state.pool), op_id, resend=resend, by=who.by, note=who.note
    )
    # A person's retry is one of the day's Retries too (chatq_retries_total{reason="person"}).
    RETRIES.labels(reason="person").inc(len(done.retried))
    runtime = request.app.state.runtime
    if runtime.relay is not None:
        runtime.relay.notify()
    return models.Retried(
        operation_id=str(op_id), status="accepted", retried=[str(i) for i in done.retried], resend=done.resend
    )


class Resolution(BaseModel):
    model_config = ConfigDict(extra="forbid")

    resolution: commands.Resolution
    owner: str = Field(min_length=1, max_length=200, pattern=NO_NUL)
    note: str = Field(default="", max_length=2000, pattern=NO_NUL)


@router.post("/v1/operations/{operation_id}/resolve", response_model=models.Resolved)
async def resolve_operation(operation_id: str, body: Resolution, request: Request) -> models.Resolved:
    """A person closes a failed or needs_review operation (and the rest of its job)."""
    require_admin(request)
    op_id = _parse_id(operation_id)
    done = await commands.resolve(
        PgOperationStore(request.app.state.pool), op_id, body.resolution, owner=body.owner, note=body.note
    )
    return models.Resolved(
        operation_id=str(op_id), status=done.status.value, resolved=[str(i) for i in done.resolved]
    )


@router.get("/v1/chats", response_model=models.HeldChats)
async def list_chats(request: Request, held: bool = True, account: str | None = None) -> dict[str, Any]:
    """The chats a person holds: the seller answered in person and the bot stays out until
    ``held_until`` (``held=true``, the only listing today); all, or one account's
    (``account=avito:42``)."""
    require_admin(request)
    platform, account_id = parse_account(account)
    if not held:
        raise ApiError(400, "bad_filter", "only held=true is listed")
    return await read.held_chats(request.app.state.pool, platform, account_id)


@router.post("/v1/chats/{chat:path}/resume", response_model=models.Resumed)
async def resume_chat(chat: str, request: Request) -> dict[str, Any]:
    """Hand a chat the seller held back to the bot now: its waiting messages are answered
    after the usual pause. ``chat`` is the chat key, e.g. ``avito:777:u2i-1`` (URL-encoded)."""
    require_admin(request)
    pool: asyncpg.Pool = request.app.state.pool
    if not await pool.fetchval("SELECT chatq_resume_chat($1)", chat):
        raise ApiError(409, "not_held", f"chat {chat!r} is not held by the seller")
    return {"chat": chat, "held": False}


@router.get("/v1/stats", response_model=models.Stats, response_model_exclude_unset=True)
async def stats(request: Request, account: str | None = None, accounts: int = 20) -> dict[str, Any]:
    """The seller's numbers: the whole deployment's, or one account's (``account=avito:42``);
    with each account's four numbers and state (the ``accounts`` busiest by backlog)."""
    require_admin(request)
    if not 0 <= accounts <= 1000:
        raise ApiError(400, "bad_accounts", "accounts is between 0 and 1000")
    platform, account_id = parse_account(account)
    return await read.stats(request.app.state.pool, platform, account_id, accounts)
