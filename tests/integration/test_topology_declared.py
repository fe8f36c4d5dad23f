"""What the broker holds after every process declared the topology equals the topology."""

from __future__ import annotations

import secrets
from urllib.parse import quote, urlsplit, urlunsplit

import httpx
import pytest

from shared.broker.connection import BrokerConnection
from shared.broker.topology import build_topology, comparable, definitions
from tests.support.infra import create_vhost, delete_vhost

pytestmark = pytest.mark.integration


async def test_the_declared_topology_in_the_broker_equals_the_generated_definitions(infra) -> None:
    if not infra.rabbitmq_api_url:
        pytest.fail("this test reads the broker's definitions through CHATQ_TEST_RABBITMQ_API_URL")
    # A vhost of its own: other tests declare extra retry tiers in the session's vhost.
    vhost = f"{infra.vhost}_topo_{secrets.token_hex(2)}"
    user = urlsplit(infra.amqp_url).username or "guest"
    create_vhost(infra.rabbitmq_api_url, vhost, user)
    amqp = urlsplit(infra.amqp_url)
    url = urlunsplit((amqp.scheme, amqp.netloc, "/" + quote(vhost, safe=""), "", ""))
    topology = build_topology()
    try:
        # Declaring twice is a no-op: every process declares at start-up.
        for _ in range(2):
            broker = BrokerConnection(url, topology)
            await broker.connect()
            await broker.close()
        api = urlsplit(infra.rabbitmq_api_url)
        base = urlunsplit((api.scheme, f"{api.hostname}:{api.port or 15672}", api.path, "", ""))
        async with httpx.AsyncClient(auth=(api.username or "guest", api.password or "guest")) as client:
            response = await client.get(f"{base}/definitions/{quote(vhost, safe='')}")
            response.raise_for_status()
    finally:
        delete_vhost(infra.rabbitmq_api_url, vhost)
    assert comparable(response.json()) == comparable(definitions(topology, vhost))
