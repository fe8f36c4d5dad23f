"""Our replies as the platforms echo them back (``reply_echoes``: the receiver records each
as it stores it, shared/functions/35_echoes.sql). An echo proves a reply is in the chat: a
send whose answer was lost is settled as sent by it, instead of going to a person."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

import asyncpg

#: How far the receiver's clock may be behind ours when an echo is matched to a send.
CLOCK_SKEW_SECONDS = 5.0


class Echoes:
    def __init__(self, pool: asyncpg.Pool) -> None:
        self._pool = pool

    async def of(self, chat_key: str, text: str, since: datetime, exclude: Sequence[str]) -> str | None:
        """The platform's id of an echo of ``text`` in the chat seen since ``since``, not one
        of ``exclude`` (replies already recorded), or None."""
        found: str | None = await self._pool.fetchval(
            "SELECT chatq_echo_of($1, $2, $3, $4)", chat_key, text, since, list(exclude)
        )
        return found
