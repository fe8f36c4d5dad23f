"""Fixtures for tests that run the whole pipeline in-process against the fakes."""

from __future__ import annotations

from collections.abc import AsyncIterator

import asyncpg
import pytest
from cryptography.fernet import Fernet

from shared.settings import Settings
from tests.conftest import replace
from tests.fakes.world import FakeWorld
from tests.support.avito import Stack
from tests.support.broker import wait_for
from tests.support.pipeline import Pipeline, pipeline_settings, running_pipeline
from tests.support.receiver import running_receiver
from tests.support.services import running_coalescers, running_responders


@pytest.fixture
def fast(settings: Settings, world: FakeWorld) -> Settings:
    """Settings pointing at the fakes, with immediate coalescing and short retry tiers."""
    return pipeline_settings(settings, world)


@pytest.fixture
async def pipeline(fast: Settings, pool: asyncpg.Pool) -> AsyncIterator[Pipeline]:
    """Receiver, coalescer and responder running in-process on ``fast``."""
    async with running_receiver(fast) as (_, client), running_coalescers(fast), running_responders(fast):
        yield Pipeline(client, pool)


@pytest.fixture
def polling(fast: Settings) -> Settings:
    """The Avito poller on, its rounds driven by the test (the start-up round runs at once);
    accounts can be added with credentials of their own."""
    return replace(fast, avito_poll_seconds=3600, secrets_key=Fernet.generate_key().decode())


@pytest.fixture
async def stack(polling: Settings, pool: asyncpg.Pool) -> AsyncIterator[Stack]:
    """The pipeline with the Avito poller (``Stack.poll`` runs a round)."""
    async with running_pipeline(polling, pool) as p:
        assert p.receiver is not None
        stack = Stack(p, p.receiver.public.state.runtime)
        recovery = stack.runtime.recovery
        assert recovery is not None
        # The start-up round, done before the test writes anything.
        await wait_for(lambda: recovery.rounds >= 1, what="the start-up poll")
        yield stack
