"""Lost webhooks found again (Avito). Avito delivers webhooks at least once, and some never
arrive; a buyer whose message was lost would never be answered. So one receiver replica at
a time (a Postgres advisory lock) reads, every AVITO_POLL_SECONDS and once at start-up,
each known Avito account's recently updated chats (read or not) and their latest messages, and stores every buyer
message the inbox does not have through the webhook's own intake: the same rules
(``avito.message_intake``) and the same dedupe key (account, chat, message id), so a poll
and a late webhook of one message never make two operations.

Which messages: a chat's buyer messages after the seller's latest message written in person
(what came before is answered; our own replies answered only what the inbox held, so they
stop nothing), not older than
``RECOVERY_HORIZON_SECONDS``. Which accounts: the Avito accounts the inbox has a message
of (Avito's Messenger API names no account of its own credentials), except those the
platform refused (paused: the probe resumes them)."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import Any

import asyncpg

from services.responder.failures import Failure
from services.responder.platforms.avito import AvitoPlatform
from shared import metrics

from .errors import ApiError
from .intake import Intake, store
from .webhooks import avito

logger = logging.getLogger(__name__)

#: One poller at a time across receiver replicas (a session advisory lock).
POLL_LOCK_KEY = 0x63686174_706F6C6C  # "chatpoll"
#: A message older than this is left to the seller, not answered by the bot a day late.
RECOVERY_HORIZON_SECONDS = 24 * 3600

# The Avito accounts the inbox knows (a skip scan of operations_message_key: one index
# probe per account), without the ones the platform refused.
_KNOWN_ACCOUNTS = """
WITH RECURSIVE a AS (
    (SELECT account_id FROM operations WHERE platform = 'avito' ORDER BY account_id LIMIT 1)
    UNION ALL
    SELECT (SELECT o.account_id FROM operations o
            WHERE o.platform = 'avito' AND o.account_id > a.account_id ORDER BY o.account_id LIMIT 1)
    FROM a WHERE a.account_id IS NOT NULL
)
SELECT a.account_id FROM a
WHERE a.account_id ~ '^[0-9]+$'
  AND NOT EXISTS (SELECT 1 FROM accounts x WHERE x.platform = 'avito' AND x.account_id = a.account_id
                  AND x.state = 'paused_by_platform')
"""

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
        api: AvitoPlatform,
        *,
        hold_seconds: float,
        notify: Callable[[], None],
        horizon_seconds: float = RECOVERY_HORIZON_SECONDS,
        interval_seconds: float = 60.0,
    ) -> None:
        self._pool = pool
        self._api = api
        self._hold_seconds = hold_seconds
        self._notify = notify
        self._horizon = horizon_seconds
        self._interval = interval_seconds
        #: Per account, when its last complete round started: the next reads the chats
        #: updated since then (less a margin for clocks and paging), the first a horizon back.
        self._last_round: dict[str, float] = {}

    async def poll(self) -> int:
        """One round over every known account, by one replica (0 on the others while it
        runs). Returns how many messages it stored."""
        recovered = 0
        async with self._pool.acquire() as conn:
            if not await conn.fetchval("SELECT pg_try_advisory_lock($1)", POLL_LOCK_KEY):
                return 0
            try:
                accounts = [r["account_id"] for r in await conn.fetch(_KNOWN_ACCOUNTS)]
                for account_id in accounts:
                    try:
                        recovered += await self._account(account_id)
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

    async def _account(self, account_id: str) -> int:
        started = time.time()
        since = started - self._horizon
        last = self._last_round.get(account_id)
        updated_since = since if last is None else max(since, last - 2 * self._interval - 60)
        recovered = 0
        for chat in await self._api.recent_chats(account_id, updated_since):
            chat_id = chat.get("id")
            if not isinstance(chat_id, str) or not chat_id:
                continue
            ours = frozenset(r[0] for r in await self._pool.fetch(_OURS, account_id, chat_id))
            items = await self._api.buyer_messages(account_id, chat_id, since, ours)
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
