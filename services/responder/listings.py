"""What a chat is about, for the reply writer: the platform's listing of the chat (Avito: the
title, price and url of a u2i chat's listing), cached per chat in Postgres
(``chat_listings``) and read from the platform again after ``LISTING_TTL_SECONDS``.

Best effort: a listing the platform does not give (a failure, a chat about no listing)
never holds a reply back; the reply is written with the cached one, or without."""

from __future__ import annotations

import logging
from collections.abc import Mapping

import asyncpg
from prometheus_client import Counter

from platforms.accounts import AccountPlatforms, FixedPlatforms, Unserved
from platforms.base import Listing, Platform, chat_manners
from platforms.failures import Failure

logger = logging.getLogger(__name__)

LISTING_FAILURES = Counter(
    "chatq_listing_failures_total",
    "Chat listings the platform did not give when a reply was written (written without), by platform.",
    ["platform"],
)

#: A listing's title and price change rarely; a chat's reply reads it again after this.
LISTING_TTL_SECONDS = 3600.0

_READ = """
SELECT listing, fetched_at > now() - make_interval(secs => $2) AS fresh FROM chat_listings WHERE chat_key = $1
"""
_WRITE = """
INSERT INTO chat_listings (chat_key, listing, fetched_at) VALUES ($1, $2, now())
ON CONFLICT (chat_key) DO UPDATE SET listing = EXCLUDED.listing, fetched_at = EXCLUDED.fetched_at
"""


class Listings:
    def __init__(
        self,
        pool: asyncpg.Pool,
        platforms: Mapping[str, Platform] | AccountPlatforms | FixedPlatforms,
        *,
        ttl_seconds: float = LISTING_TTL_SECONDS,
    ) -> None:
        self._pool = pool
        # The account's own adapter (platforms/accounts.py).
        self._platforms = FixedPlatforms(platforms) if isinstance(platforms, Mapping) else platforms
        self._ttl = ttl_seconds

    async def of(self, platform_name: str, account_id: str, chat_id: str, chat_key: str) -> Listing | None:
        """The chat's listing: cached while fresh, else asked of the platform (and cached)."""
        try:
            platform = self._platforms.for_account(platform_name, account_id)
        except Unserved:
            return None
        manners = chat_manners(platform)
        if manners is None:
            return None
        row = await self._pool.fetchrow(_READ, chat_key, self._ttl)
        if row is not None and row["fresh"]:
            return Listing.from_json(row["listing"])
        try:
            listing = await manners.listing(account_id, chat_id)
        except Failure as failure:
            LISTING_FAILURES.labels(platform=platform_name).inc()
            logger.warning("the listing of %s is not available: %s", chat_key, failure.reason)
            return Listing.from_json(row["listing"]) if row is not None else None
        await self._pool.execute(_WRITE, chat_key, listing.as_json() if listing else None)
        return listing
