"""Fixtures for tests that run the whole pipeline in-process against the fakes."""

from __future__ import annotations

from collections.abc import AsyncIterator

import asyncpg
import pytest

from shared.settings import Settings
from tests.fakes.platforms import FakeWorld
from tests.support.pipeline import Pipeline, pipeline_settings
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
