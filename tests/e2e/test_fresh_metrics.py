"""A freshly started process exports its counters' known label children at 0, so the
first failure, retry or dead letter after a deploy is an increase() from 0 that the
alerts see, not a series born at 1 with no baseline."""

from __future__ import annotations

import re

import httpx
import pytest

from tests.fakes.world import FakeWorld
from tests.support.pipeline import pipeline_settings
from tests.support.processes import Receiver, Worker, free_port

# ``clean``: a responder started on a database with other tests' leftovers would reply to
# them, and the counter it should show at 0 would not be.
pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("clean")]


def zero_series(text: str, name: str) -> set[str]:
    """The label sets of ``name`` samples at exactly 0 in a Prometheus exposition."""
    return {m[1] for m in re.finditer(rf"^{name}\{{(.*)\}} 0\.0$", text, re.M)}


async def test_fresh_services_export_the_zero_series_of_every_known_label(settings, world: FakeWorld) -> None:
    s = pipeline_settings(settings, world)
    receiver = await Receiver(s, admin_port=free_port()).start()
    coalescer = await Worker("coalescer", s).start()
    responder = await Worker("responder", s).start()
    try:
        # /metrics answers on every service without a redirect.
        async with httpx.AsyncClient(timeout=10) as client:
            scraped = {
                name: (await client.get(f"{url}/metrics")).text
                for name, url in [
                    ("receiver", receiver.admin_url),
                    ("coalescer", coalescer.url),
                    ("responder", responder.url),
                ]
            }
    finally:
        for process in (responder, coalescer, receiver):
            await process.stop()
    webhooks = zero_series(scraped["receiver"], "chatq_webhooks_total")
    for platform in ("telegram", "avito", "generic"):
        for outcome in ("accepted", "duplicate", "ignored", "rejected"):
            assert f'outcome="{outcome}",platform="{platform}"' in webhooks, (platform, outcome)
    assert 'reason="person"' in zero_series(scraped["receiver"], "chatq_retries_total")
    assert 'outcome="failed"' in zero_series(scraped["coalescer"], "chatq_operations_total")
    assert 'queue="chatq.coalescer.dead"' in zero_series(scraped["coalescer"], "chatq_dead_letters_total")
    operations = zero_series(scraped["responder"], "chatq_operations_total")
    assert {'outcome="replied"', 'outcome="failed"', 'outcome="needs_review"'} <= operations
    retries = zero_series(scraped["responder"], "chatq_retries_total")
    for reason in ("model_transient", "telegram_transient", "avito_transient", "unknown_outcome"):
        assert f'reason="{reason}"' in retries, reason
    assert 'queue="chatq.responder.dead"' in zero_series(scraped["responder"], "chatq_dead_letters_total")
