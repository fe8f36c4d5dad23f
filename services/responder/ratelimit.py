"""Per-account send pacing: a token bucket per (platform, account), paused when the
platform answers 429 with a retry-after, so one chat's 429 slows the whole account
instead of every other chat hitting the limit too."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


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
