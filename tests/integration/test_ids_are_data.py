"""Ids are data, never paths (issue 39, point 10): a platform id that goes into a URL is one
percent-encoded segment, so an Avito chat id made of ``../`` reaches the chat it names (or
nothing), never another endpoint with the account's token; and the listing put into the
prompt is the seller's own."""

from __future__ import annotations

from collections.abc import AsyncIterator

import asyncpg
import httpx
import pytest

from platforms.avito.adapter import AvitoPlatform, AvitoToken
from platforms.failures import Failure, Kind
from platforms.http import PlatformHttp
from platforms.ratelimit import AccountRateLimiter
from tests.fakes.world import FakeWorld
from tests.support.avito import ME, URL, Stack

pytestmark = pytest.mark.integration

#: A chat id a hostile webhook could carry: unencoded, the listing read walks up to another
#: account's chat list (GET /messenger/v2/accounts/999/chats?limit=100) with this account's token.
HOSTILE = "../../../../v2/accounts/999/chats?limit=100#"


@pytest.fixture
async def avito(world: FakeWorld) -> AsyncIterator[AvitoPlatform]:
    """Avito's adapter on the real client (aiohttp, whose yarl resolves dot segments)."""
    http = PlatformHttp(httpx.Timeout(5.0), max_connections=4)
    token = AvitoToken(world.url, "client-1", "client-secret", http)
    yield AvitoPlatform(world.url, token, http, AccountRateLimiter(100.0))
    await http.aclose()


def avito_of(world: FakeWorld, http: PlatformHttp) -> AvitoPlatform:
    """Avito's adapter on the real client (aiohttp, whose yarl resolves dot segments)."""
    token = AvitoToken(world.url, "client-1", "client-secret", http)
    return AvitoPlatform(world.url, token, http, AccountRateLimiter(100.0))


async def test_an_avito_chat_id_with_dot_dot_slashes_stays_one_segment_and_reaches_no_other_endpoint(
    world: FakeWorld, avito: AvitoPlatform
) -> None:
    world.add_avito_chat(ME, HOSTILE, title="Bicycle")
    await avito.send(ME, HOSTILE, "Yes, it is available.", key="job-1")
    await avito.mark_read(ME, HOSTILE)
    listing = await avito.listing(ME, HOSTILE)
    assert listing is not None and listing.title == "Bicycle"  # the chat's own, read by its id
    # The send went to the chat named by the whole id, as the send operation; nothing
    # listed the account's chats.
    assert world.avito[-1]["chat_id"] == HOSTILE
    assert world.avito[-1]["user_id"] == ME
    operations = [op for op, _, _ in world.avito_callers]
    assert "getChatsV2" not in operations
    assert all(user == ME for _, user, _ in world.avito_callers)
    assert (ME, HOSTILE) in world.avito_reads


@pytest.mark.parametrize("chat_id", [".", ".."])
async def test_an_avito_chat_id_that_is_a_dot_segment_is_sent_nowhere(
    world: FakeWorld, avito: AvitoPlatform, chat_id: str
) -> None:
    with pytest.raises(Failure) as refused:
        await avito.send(ME, chat_id, "hello", key="job-dot")
    assert refused.value.kind is Kind.PERMANENT
    assert world.avito == []
    assert world.avito_callers == []


@pytest.mark.usefixtures("clean")
async def test_a_chat_about_another_sellers_listing_is_answered_without_that_listing(
    stack: Stack, world: FakeWorld, pool: asyncpg.Pool
) -> None:
    # The account wrote about someone else's item (it was the buyer there): the listing in
    # the chat's context is not the seller's, so the writer is not told about it.
    world.add_avito_chat(ME, "u2i-theirs", title="Their bicycle", price="1 ₽", owner=999)
    hook = world.avito_buyer_writes(ME, "u2i-theirs", "Do you deliver?")
    r = await stack.p.client.post(URL, json=hook)
    assert (await stack.p.settled(r.json()["operation_id"]))["status"] == "replied"
    reply = world.replies_to("u2i-theirs")[-1]
    assert "Their bicycle" not in reply
    assert reply == "Hello! We ship across the country; delivery takes 2-5 days."
    assert (
        await pool.fetchval("SELECT listing FROM chat_listings WHERE chat_key = 'avito:777:u2i-theirs'")
        is None
    )
