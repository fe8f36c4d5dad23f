"""Lost webhooks found again (Avito). Avito delivers webhooks at least once, and some never
arrive; a buyer whose message was lost would never be answered. So one receiver replica at
a time (a Postgres advisory lock) reads, every AVITO_POLL_SECONDS and once at start-up,
each active Avito account's recently updated chats (read or not) and their latest
messages, and stores every buyer message the inbox does not have through the webhook's
own intake: the same rules
(``avito.message_intake``) and the same dedupe key (account, chat, message id), so a poll
and a late webhook of one message never make two operations.

Which messages: a chat's buyer messages after the seller's latest message written in person
(what came before is answered; our own replies answered only what the inbox held, so they
stop nothing), not older than ``RECOVERY_HORIZON_SECONDS``.

Which accounts: every Avito account of the account registry (``shared.accounts``, kept
current by its notifications: one added while the receiver runs is read the next round)
that is active, each with the credentials it answers with (the responder's
``AccountPlatforms``): an account added with its own (``chatq accounts add``) with those,
the environment's (named by its first message, or at start from the inbox) with
CHATQ_AVITO_CLIENT_ID/SECRET. Not an account that was removed, paused by a person, or
paused by the platform (the responder's probe resumes it), nor one whose credentials
cannot be opened or that the environment has no credentials for."""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Callable
from typing import Any

import asyncpg

from services.responder.accounts import AccountPlatforms, Unserved
from services.responder.failures import Failure
from services.responder.platforms.avito import AvitoPlatform
from shared import metrics
from shared.accounts import AccountRegistry

from .errors import ApiError
from .intake import Intake, store
from .webhooks import avito

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

_STORED = """
SELECT message_id FROM operations
WHERE platform = 'avito' AND account_id = $1 AND chat_id = $2 AND message_id = ANY($3::text[])
"""


def listed_intake(account_id: str, chat_id: str, item: dict[str, Any]) -> Intake:
    """A message from Avito's message list as the inbox stores it: the webhook's rules. The
    payload kept is the listed item, marked as found by the poll."""
    content = item.get("content")
    text = content.get("text") if isinstance(content, dict) else None
    author = item.get("author_id")
    return avito.message_intake(
        account_id=account_id,
        chat_id=chat_id,
        message_id=str(item["id"]),
        author_id=author if isinstance(author, int) else 0,
        kind=str(item.get("type") or "unknown"),
        chat_type=None,  # the poll reads u2i and u2u chats only
        text=text if isinstance(text, str) else None,
        created=item.get("created"),
        raw=json.dumps({"found_by": "poll", "user_id": account_id, "chat_id": chat_id, "message": item}),
    )


class AvitoRecovery:
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
    ) -> None:
        self._pool = pool
        self._platforms = platforms
        self._registry = registry
        self._hold_seconds = hold_seconds
        self._notify = notify
        self._horizon = horizon_seconds
        self._interval = interval_seconds
        #: Per account, when its last complete round started: the next reads the chats
        #: updated since then (less a margin for clocks and paging), the first a horizon back.
        self._last_round: dict[str, float] = {}

    def accounts(self) -> list[str]:
        """The accounts this round reads (``polled_accounts``)."""
        return polled_accounts(self._registry)

    async def poll(self) -> int:
        """One round over every account to read, by one replica (0 on the others while it
        runs; 0 at once when there is no Avito account). Returns how many messages it
        stored."""
        recovered = 0
        accounts = self.accounts()
        if not accounts:
            return 0
        # An account that leaves the round (paused, removed) is read a horizon back when it
        # comes back: what came meanwhile.
        polled = set(accounts)
        self._last_round = {a: t for a, t in self._last_round.items() if a in polled}
        async with self._pool.acquire() as conn:
            if not await conn.fetchval("SELECT pg_try_advisory_lock($1)", POLL_LOCK_KEY):
                return 0
            try:
                for account_id in accounts:
                    try:
                        recovered += await self._account(account_id)
                    except Unserved as exc:
                        logger.warning("Avito poll skips account %s: %s", account_id, exc)
                    except Failure as failure:
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
        return recovered

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
        since = started - self._horizon
        last = self._last_round.get(account_id)
        updated_since = since if last is None else max(since, last - 2 * self._interval - 60)
        recovered = 0
        for chat in await api.recent_chats(account_id, updated_since):
            chat_id = chat.get("id")
            if not isinstance(chat_id, str) or not chat_id:
                continue
            ours = frozenset(r[0] for r in await self._pool.fetch(_OURS, account_id, chat_id))
            items = await api.buyer_messages(account_id, chat_id, since, ours)
            if not items:
                continue
            stored = {
                r["message_id"]
                for r in await self._pool.fetch(_STORED, account_id, chat_id, [str(i["id"]) for i in items])
            }
            for item in items:
                if str(item["id"]) in stored:
                    continue
                try:
                    intake = listed_intake(account_id, chat_id, item)
                except ApiError as exc:  # an item the inbox cannot hold: say which
                    logger.warning(
                        "Avito poll: message %s of chat %s not stored: %s", item["id"], chat_id, exc
                    )
                    continue
                result = await store(self._pool, intake, hold_seconds=self._hold_seconds, recovered=True)
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
        self._last_round[account_id] = started
        return recovered
