"""A webhook held while Postgres is away (issue 40, its review's first finding): the hold
cuts an attempt only when Postgres does not answer. A statement that is slow, or waits for
a lock (a seller's message behind its chat's), is waited for: cut, it answered 503 after
having done nothing, and a platform that does not send again lost the message."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from platforms.inbound import ApiError
from services.receiver.intake import Stored, held_while_postgres_is_away

STORED = Stored(uuid.uuid4(), "accepted", False)


async def test_a_store_slower_than_the_hold_is_waited_for_while_postgres_answers() -> None:
    asked = asyncio.Event()
    release = asyncio.Event()

    async def store() -> Stored:
        await release.wait()  # behind a lock past the hold
        return STORED

    async def reachable() -> bool:
        asked.set()
        release.set()  # the lock is let go once the hold has asked
        return True

    assert await held_while_postgres_is_away(store, 0.1, reachable) == STORED
    assert asked.is_set()


async def test_a_store_that_hangs_while_postgres_does_not_answer_is_cut_with_a_503() -> None:
    cancelled = asyncio.Event()

    async def store() -> Stored:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise
        raise AssertionError("unreachable")

    async def reachable() -> bool:
        return False

    with pytest.raises(ApiError) as refused:
        await held_while_postgres_is_away(store, 0.1, reachable)
    assert refused.value.status == 503
    assert refused.value.headers and "Retry-After" in refused.value.headers
    assert cancelled.is_set()


async def test_a_refused_connection_is_tried_again_within_the_hold_and_stores_once() -> None:
    calls = 0

    async def store() -> Stored:
        nonlocal calls
        calls += 1
        if calls < 3:
            raise ConnectionRefusedError("Postgres restarting")
        return STORED

    assert await held_while_postgres_is_away(store, 5.0) == STORED
    assert calls == 3
