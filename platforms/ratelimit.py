"""Per-account send pacing: a token bucket per (platform, account), paused when the
platform answers 429 with a retry-after, so one chat's 429 slows the whole account
instead of every other chat hitting the limit too."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any


class AccountRateLimiter:
    def __init__(
        self,
        rate_per_second: float,
        *,
        burst: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._rate = rate_per_second
        self._burst = burst if burst is not None else max(1.0, rate_per_second)
        self._clock = clock
        self._tokens: dict[str, float] = {}
        self._updated: dict[str, float] = {}
        self._paused_until: dict[str, float] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._rates: dict[str, float] = {}

    def set_rate(self, key: str, rate_per_second: float | None) -> None:
        """An account's own pace (its PACING override); None: the global one."""
        if rate_per_second is None:
            self._rates.pop(key, None)
        else:
            self._rates[key] = rate_per_second

    def delay(self, key: str) -> float:
        """Seconds until a send on ``key`` may go (0: now). Takes a token when 0."""
        now = self._clock()
        pause = self._paused_until.get(key, 0.0) - now
        if pause > 0:
            return pause
        rate = self._rates.get(key, self._rate)
        burst = max(1.0, rate) if key in self._rates else self._burst
        tokens = min(burst, self._tokens.get(key, burst) + (now - self._updated.get(key, now)) * rate)
        self._updated[key] = now
        if tokens >= 1:
            self._tokens[key] = tokens - 1
            return 0.0
        self._tokens[key] = tokens
        return (1 - tokens) / rate

    async def acquire(self, key: str) -> None:
        lock = self._locks.setdefault(key, asyncio.Lock())
        async with lock:
            while (wait := self.delay(key)) > 0:  # noqa: ASYNC110 - a computed wait, no event to await
                await asyncio.sleep(wait)

    def pause(self, key: str, seconds: float) -> None:
        self._paused_until[key] = max(self._paused_until.get(key, 0.0), self._clock() + seconds)


class BudgetSpent(Exception):
    """The account's shared request budget has less left than this caller may take (the
    poll, which leaves room for the sends): it stops, and goes on at its next round."""


class SharedBudget:
    """One request budget per platform account shared by every process that calls the
    platform for it (``platform_budgets``, migration 0030): the Avito poll in the receiver
    and the sends of every responder count against the same per-minute window, so N
    replicas do not take N times Avito's limit. The platform's word wins: the limit it
    states (``X-RateLimit-Limit``) replaces the configured one, and a pause it asks for
    (a 429, or no request left in the window) holds every process. One statement a
    request."""

    def __init__(self, pool: Any, platform: str, per_minute: int) -> None:
        self._pool = pool
        self._platform = platform
        self._per_minute = per_minute

    async def take(self, account_id: str, *, share: float = 1.0) -> None:
        """Wait until a request may go, and count it. ``share``: the part of the window this
        caller may use (the poll leaves the rest for the sends): past it, ``BudgetSpent``."""
        while True:
            row = await self._pool.fetchrow(_TAKE, self._platform, account_id, self._per_minute, share)
            if row["granted"]:
                return
            if share < 1.0:
                raise BudgetSpent(
                    f"{self._platform} account {account_id}: its share of the per-minute request budget is spent"
                )
            await asyncio.sleep(max(0.05, float(row["wait"])))

    async def pause(self, account_id: str, seconds: float) -> None:
        """The platform asked us to wait (a 429, or no request left in its window): every
        process holds this account's requests for ``seconds``."""
        await self._pool.execute(_PAUSE, self._platform, account_id, seconds)

    async def observe(self, account_id: str, per_minute: int) -> None:
        """The limit the platform states for the account (X-RateLimit-Limit)."""
        await self._pool.execute(_OBSERVE, self._platform, account_id, per_minute)


# Counts the request in the current minute unless the platform paused the account or the
# caller's share of the window is spent; says how long to wait otherwise: to the end of the
# pause, and to the minute's end only when the window is spent (it waited for the minute's
# end after any pause, so a 429 asking for 2 s held the account up to a minute).
_TAKE = """
WITH up AS (
    INSERT INTO platform_budgets AS b (platform, account_id, window_start, used)
    VALUES ($1, $2, date_trunc('minute', clock_timestamp()), 1)
    ON CONFLICT (platform, account_id) DO UPDATE
    SET used = CASE WHEN b.window_start < date_trunc('minute', clock_timestamp()) THEN 1 ELSE b.used + 1 END,
        window_start = date_trunc('minute', clock_timestamp())
    WHERE (b.paused_until IS NULL OR b.paused_until <= clock_timestamp())
      AND (b.window_start < date_trunc('minute', clock_timestamp())
           OR b.used < floor(coalesce(b.per_minute, $3) * $4::float8))
    RETURNING used
)
SELECT EXISTS (SELECT 1 FROM up) AS granted,
       coalesce((SELECT extract(epoch FROM greatest(
                    CASE WHEN b.paused_until > clock_timestamp() THEN b.paused_until END,
                    CASE WHEN b.window_start >= date_trunc('minute', clock_timestamp())
                          AND b.used >= floor(coalesce(b.per_minute, $3) * $4::float8)
                         THEN b.window_start + interval '1 minute' END) - clock_timestamp())
                 FROM platform_budgets b WHERE b.platform = $1 AND b.account_id = $2), 0) AS wait
"""
_PAUSE = """
INSERT INTO platform_budgets AS b (platform, account_id, window_start, used, paused_until)
VALUES ($1, $2, date_trunc('minute', clock_timestamp()), 0, clock_timestamp() + make_interval(secs => $3))
ON CONFLICT (platform, account_id) DO UPDATE
SET paused_until = greatest(b.paused_until, EXCLUDED.paused_until)
"""
_OBSERVE = """
INSERT INTO platform_budgets AS b (platform, account_id, window_start, used, per_minute)
VALUES ($1, $2, date_trunc('minute', clock_timestamp()), 0, $3)
ON CONFLICT (platform, account_id) DO UPDATE SET per_minute = EXCLUDED.per_minute
WHERE b.per_minute IS DISTINCT FROM EXCLUDED.per_minute
"""
