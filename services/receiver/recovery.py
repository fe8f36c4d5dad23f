"""Lost webhooks found again (Avito). Avito delivers webhooks at least once, and some never
arrive; a buyer whose message was lost would never be answered. So one receiver replica at
a time (a Postgres advisory lock) reads, every AVITO_POLL_SECONDS and once at start-up,
each active Avito account's chats updated since its last complete listing (read or not)
and the latest messages of those updated since they were last read, and stores every
buyer message the inbox does not have through the webhook's own intake: the same rules
(``avito.message_intake``) and the same dedupe key (account, chat, message id), so a poll
and a late webhook of one message never make two operations. ``AvitoRecovery`` says what a
round asks of Avito and how its progress is kept.

Which messages: a chat's buyer messages after the seller's latest message written in person
(what came before is answered; our own replies answered only what the inbox held, so they
stop nothing), not older than ``RECOVERY_HORIZON_SECONDS``; at an account's first poll,
those older than AVITO_BACKFILL_SECONDS are recorded as left to the seller.

Which accounts: every Avito account of the account registry (``stores.accounts.registry``, kept
current by its notifications: one added while the receiver runs is read the next round)
that is active, each with the credentials it answers with (the responder's
``AccountPlatforms``): an account added with its own (``chatq accounts add``) with those,
the environment's with CHATQ_AVITO_CLIENT_ID/SECRET, named by Avito at the first start
(``/core/v1/accounts/self``). Not an account that was removed, paused by a person, or
paused by the platform (the responder's probe resumes it), nor one whose credentials
cannot be opened or that the environment has no credentials for."""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any

import asyncpg

from platforms.accounts import AccountPlatforms, Unserved
from platforms.avito import webhook as avito
from platforms.avito.adapter import CLOCK_SKEW_SECONDS, AvitoPlatform
from platforms.failures import Failure, Kind
from platforms.inbound import ApiError, Intake
from platforms.ratelimit import BudgetSpent
from services.receiver.intake import Stored, store
from shared import metrics
from shared.alerts import Alerter
from stores.accounts import postgres as account_state
from stores.accounts.registry import AccountRegistry, record_seen

logger = logging.getLogger(__name__)

#: One poller at a time across receiver replicas (a session advisory lock).
POLL_LOCK_KEY = 0x63686174_706F6C6C  # "chatpoll"
#: A message older than this is left to the seller, not answered by the bot a day late.
RECOVERY_HORIZON_SECONDS = 24 * 3600

#: Avito's user ids are numbers: an id that is not one is never put in a URL.
_USER_ID = re.compile(r"[0-9]+")


def polled_accounts(registry: AccountRegistry) -> list[str]:
    """The Avito accounts a round reads: active (not paused by a person or the platform)
    and not removed."""
    return sorted(
        a.account_id
        for a in registry.all()
        if a.platform == "avito"
        and a.state == "active"
        and not a.removed
        and _USER_ID.fullmatch(a.account_id)
    )


# The ids of the replies we sent to the chat (whole, or in parts): they answered only what
# the inbox held, so they do not mark the messages before them as answered.
_OURS = """
SELECT d.platform_message_id FROM deliveries d JOIN reply_jobs j ON j.id = d.job_id
WHERE j.chat_key = chatq_chat_key('avito', $1, $2) AND j.status = 'sent' AND d.platform_message_id IS NOT NULL
UNION
SELECT p.platform_message_id FROM delivery_parts p JOIN reply_jobs j ON j.id = p.job_id
WHERE j.chat_key = chatq_chat_key('avito', $1, $2) AND p.platform_message_id IS NOT NULL
"""

# A message the webhook brought without its id (stored under its delivery's id or its
# content, and handed to a person): the poll finds it again under its real id, by its time
# and its words, and must not store it twice.
_STORED_NAMELESS = """
SELECT id FROM operations
WHERE platform = 'avito' AND account_id = $1 AND (chat_id = $2 OR chat_id IS NULL)
  AND (message_id LIKE 'evt:%' OR message_id LIKE 'sha256:%')
  AND sent_at = to_timestamp($3) AND text IS NOT DISTINCT FROM $4
LIMIT 1
"""

_STORED = """
SELECT message_id FROM operations
WHERE platform = 'avito' AND account_id = $1 AND chat_id = $2 AND message_id = ANY($3::text[])
"""


def listed_intake(account_id: str, chat_id: str, item: dict[str, Any]) -> Intake:
    """A message from Avito's message list as the inbox stores it: the webhook's rules. The
    payload kept is the listed item, marked as found by the poll."""
    content = item.get("content")
    author = item.get("author_id")
    created = item.get("created")
    return avito.message_intake(
        account_id=account_id,
        chat_id=chat_id,
        message_id=str(item["id"]),
        author_id=author if isinstance(author, int) and not isinstance(author, bool) else None,
        kind=str(item.get("type") or "text"),
        chat_type=None,  # the poll reads u2i and u2u chats only
        content=content if isinstance(content, dict) else {},
        created=created if isinstance(created, int | float) and not isinstance(created, bool) else None,
        raw=json.dumps({"found_by": "poll", "user_id": account_id, "chat_id": chat_id, "message": item}),
    )


#: The part of an account's per-minute request budget the poll may use; the rest is the
#: sends' (platforms/ratelimit.py SharedBudget).
POLL_SHARE = 0.5
#: How far back of the last complete listing the next one reads: clocks and paging.
LISTING_MARGIN_SECONDS = 60.0

_PROGRESS = """
SELECT connected_at, extract(epoch FROM connected_at)::float8 AS connected, listed_since
FROM avito_poll_accounts WHERE account_id = $1
"""
_CONNECTED = """
INSERT INTO avito_poll_accounts (account_id) VALUES ($1) ON CONFLICT DO NOTHING
RETURNING extract(epoch FROM connected_at)::float8 AS connected
"""
_CHATS_READ = """
SELECT chat_id, updated FROM avito_poll_chats WHERE account_id = $1 AND chat_id = ANY($2::text[])
"""
_CHAT_READ = """
INSERT INTO avito_poll_chats (account_id, chat_id, updated, read_at) VALUES ($1, $2, $3, now())
ON CONFLICT (account_id, chat_id) DO UPDATE SET updated = EXCLUDED.updated, read_at = now()
"""
_LISTED = "UPDATE avito_poll_accounts SET listed_since = $2, updated_at = now() WHERE account_id = $1"

#: Why a message found at an account's first poll is not answered by the bot.
LEFT_TO_THE_SELLER = (
    "arrived {age} before the account was connected, more than CHATQ_AVITO_BACKFILL_SECONDS ({limit}): "
    "left to the seller"
)


def _span(seconds: float) -> str:
    minutes = round(seconds / 60)
    return f"{minutes // 60} h {minutes % 60} min" if minutes >= 60 else f"{minutes} min"


class AvitoRecovery:
    """One round over every Avito account to read (``poll``), by one receiver replica at a
    time. What it asks of Avito: the chat list, newest first, until it reaches back to the
    last complete listing (one page when little changed), and the messages of each chat
    updated since its messages were last read; within half of the account's per-minute
    request budget (the sends keep the other half). Its progress is kept in Postgres, per
    account and per chat, so a round cut short (a 429, a 5xx, a restart) loses only what
    it had not read. At an account's first poll, messages older than
    AVITO_BACKFILL_SECONDS are recorded as left to the seller, not answered."""

    def __init__(
        self,
        pool: asyncpg.Pool,
        platforms: AccountPlatforms,
        registry: AccountRegistry,
        *,
        hold_seconds: float,
        notify: Callable[[], None],
        horizon_seconds: float = RECOVERY_HORIZON_SECONDS,
        interval_seconds: float = 60.0,
        backfill_seconds: float = 3600.0,
        admit: Callable[[Intake], Awaitable[Stored]] | None = None,
        alerter: Alerter | None = None,
        probe_seconds: float = 60.0,
    ) -> None:
        self._pool = pool
        self._platforms = platforms
        self._registry = registry
        self._hold_seconds = hold_seconds
        self._notify = notify
        self._horizon = horizon_seconds
        self._interval = interval_seconds
        self._backfill = backfill_seconds
        self._admit = admit or (lambda intake: store(pool, intake, hold_seconds=hold_seconds, recovered=True))
        self._alerter = alerter
        self._probe_seconds = probe_seconds
        #: Whether the environment's credentials have named their account (``who``).
        self._environment_named = False
        #: Rounds run to their end by this replica (the first runs at start-up).
        self.rounds = 0

    def accounts(self) -> list[str]:
        """The accounts this round reads (``polled_accounts``)."""
        return polled_accounts(self._registry)

    async def poll(self) -> int:
        """One round over every account to read, by one replica (0 on the others while it
        runs; 0 at once when there is no Avito account). Returns how many messages it
        stored."""
        recovered = 0
        await self._name_environment_account()
        accounts = self.accounts()
        if not accounts:
            self.rounds += 1
            return 0
        async with self._pool.acquire() as conn:
            if not await conn.fetchval("SELECT pg_try_advisory_lock($1)", POLL_LOCK_KEY):
                return 0
            try:
                for account_id in accounts:
                    try:
                        recovered += await self._account(account_id)
                    except Unserved as exc:
                        logger.warning("Avito poll skips account %s: %s", account_id, exc)
                    except BudgetSpent as spent:
                        # The sends took the minute's budget: the poll goes on at its next round.
                        logger.warning("Avito poll of account %s stops for this round: %s", account_id, spent)
                    except Failure as failure:
                        if failure.kind is Kind.ACCOUNT:
                            await self._refused(account_id, failure.reason)
                        # One account's refusal does not stop the others; the next round asks again.
                        logger.warning("Avito poll of account %s: %s", account_id, failure.reason)
                    except Exception:
                        # Nor does anything else one account's answers provoke.
                        logger.exception(
                            "Avito poll of account %s failed; the next round asks again", account_id
                        )
            finally:
                await conn.execute("SELECT pg_advisory_unlock($1)", POLL_LOCK_KEY)
        if recovered:
            logger.warning("Avito poll: recovered %d message(s) no webhook brought", recovered)
        self.rounds += 1
        return recovered

    async def _name_environment_account(self) -> None:
        """The environment's Avito credentials name their account (``/core/v1/accounts/self``):
        it is polled from the first start, before any webhook. Asked until it answers."""
        if self._environment_named:
            return
        api = self._platforms.of_environment("avito")
        if not isinstance(api, AvitoPlatform):
            self._environment_named = True  # no credentials in the environment
            return
        try:
            me = await api.who()
        except Failure as failure:
            logger.warning("Avito did not name the environment's account yet: %s", failure.reason)
            return
        account_id = str(me["id"])
        await record_seen(self._pool, "avito", account_id)
        await self._registry.refresh_account("avito", account_id)
        self._environment_named = True
        logger.info(
            "the environment's Avito credentials are account %s (%s)", account_id, me.get("name") or ""
        )

    async def _refused(self, account_id: str, reason: str) -> None:
        """Avito refuses the account as a whole: paused like the sends pause it (one alert),
        until the responder's probe finds it accepted again."""
        async with self._pool.acquire() as conn:
            moved = await account_state.pause_by_platform(
                conn, "avito", account_id, reason, self._probe_seconds
            )
        if moved and self._alerter is not None:
            await self._alerter.announce(
                "account.paused", {"platform": "avito", "account_id": account_id, "reason": reason}
            )

    def _api(self, account_id: str) -> AvitoPlatform | None:
        """The account's Avito client, with its own credentials or the environment's; None
        when it has none (an account of the environment, without CHATQ_AVITO_CLIENT_ID)."""
        api = self._platforms.for_account("avito", account_id)
        return api if isinstance(api, AvitoPlatform) else None

    async def _account(self, account_id: str) -> int:
        api = self._api(account_id)
        if api is None:
            logger.debug("Avito poll: account %s has no credentials here", account_id)
            return 0
        started = time.time()
        progress = await self._pool.fetchrow(_PROGRESS, account_id)
        if progress is None:
            connected = await self._pool.fetchval(_CONNECTED, account_id) or started
            listed_since = None
        else:
            connected, listed_since = progress["connected"], progress["listed_since"]
        horizon = started - self._horizon
        list_since = horizon if listed_since is None else max(horizon, listed_since - LISTING_MARGIN_SECONDS)
        chats = await api.recent_chats(account_id, list_since, share=POLL_SHARE)
        ids = [c["id"] for c in chats if isinstance(c.get("id"), str) and c["id"]]
        read = {r["chat_id"]: r["updated"] for r in await self._pool.fetch(_CHATS_READ, account_id, ids)}
        recovered = 0
        #: Where the next listing must reach back to: this round's start, or earlier, to a
        #: chat this round could not read (it is read again then; the others are skipped).
        listed = started
        # Oldest first: a round cut short has read what waited longest.
        for chat in sorted(chats, key=lambda c: c["updated"] if _is_time(c.get("updated")) else 0):
            chat_id, updated = chat.get("id"), chat.get("updated")
            if not isinstance(chat_id, str) or chat_id in ("", ".", ".."):
                continue  # no chat (a dot segment is a path, never an id: platforms.base.segment)
            if _is_time(updated) and chat_id in read and read[chat_id] >= updated:
                continue  # nothing new since its messages were read
            try:
                recovered += await self._chat(api, account_id, chat_id, horizon, connected)
            except (BudgetSpent, Unserved):
                raise  # the account's round stops (progress so far kept)
            except Failure as failure:
                if failure.kind is Kind.ACCOUNT:
                    raise
                # One chat Avito will not list does not hide the account's other chats.
                logger.warning(
                    "Avito poll: chat %s of account %s not read: %s", chat_id, account_id, failure.reason
                )
                listed = min(listed, float(updated) if isinstance(updated, int | float) else horizon)
                continue
            except Exception:
                logger.exception("Avito poll: chat %s of account %s not read", chat_id, account_id)
                listed = min(listed, float(updated) if isinstance(updated, int | float) else horizon)
                continue
            if isinstance(updated, int | float):
                # Avito's times are whole seconds, its clock not ours: a chat updated within
                # a few seconds of this read is read again next round, in case a message came
                # in the same second after it.
                seen = min(float(updated), started - CLOCK_SKEW_SECONDS)
                await self._pool.execute(_CHAT_READ, account_id, chat_id, seen)
        await self._pool.execute(_LISTED, account_id, listed)
        return recovered

    async def _chat(
        self, api: AvitoPlatform, account_id: str, chat_id: str, since: float, connected: float
    ) -> int:
        logger.debug("Avito poll: reading the messages of chat %s of account %s", chat_id, account_id)
        ours = frozenset(r[0] for r in await self._pool.fetch(_OURS, account_id, chat_id))
        items = await api.buyer_messages(account_id, chat_id, since, ours, share=POLL_SHARE)
        if not items:
            return 0
        stored = {
            r["message_id"]
            for r in await self._pool.fetch(_STORED, account_id, chat_id, [str(i["id"]) for i in items])
        }
        recovered = 0
        for item in items:
            if str(item["id"]) in stored:
                continue
            try:
                intake = listed_intake(account_id, chat_id, item)
            except ApiError as exc:  # an item the inbox cannot hold: say which
                logger.warning("Avito poll: message %s of chat %s not stored: %s", item["id"], chat_id, exc)
                continue
            twin = await self._pool.fetchval(
                _STORED_NAMELESS, account_id, chat_id, float(item["created"]), intake.text
            )
            if twin is not None:
                logger.info(
                    "Avito poll: message %s of chat %s is stored already, without its id (operation %s)",
                    item["id"],
                    chat_id,
                    twin,
                )
                continue
            age = connected - float(item["created"])
            if intake.ignored_reason is None and age > self._backfill:
                intake = dataclasses.replace(
                    intake,
                    ignored_reason=LEFT_TO_THE_SELLER.format(age=_span(age), limit=_span(self._backfill)),
                    unreadable=None,
                )
            result = await self._admit(intake)
            if result.duplicate:
                continue  # its webhook came meanwhile
            recovered += 1
            metrics.RECOVERED_MESSAGES.labels(platform="avito").inc()
            logger.info(
                "Avito poll: stored message %s of chat %s (%s), which no webhook brought",
                item["id"],
                chat_id,
                result.status,
                extra={"operation_id": result.operation_id},
            )
            if result.status == "accepted":
                self._notify()
        return recovered


def _is_time(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
