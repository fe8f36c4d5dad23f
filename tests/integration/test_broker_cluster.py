"""Losing a RabbitMQ node, on a local three-node cluster of the installed RabbitMQ
(chaos.cluster, its own directories and ports, removed afterwards): the topology a
service declares is replicated to every node with its leaders spread, and a consumer
and a confirming publisher given every node's address carry on through another node
when theirs is killed, while one given only the lost node's address waits for it."""

from __future__ import annotations

import asyncio
import time

import pytest

from chaos.cluster import LocalCluster, running_cluster
from chatq.doctor import check_broker
from shared.broker.connection import BrokerConnection, BrokerUnreachable
from shared.broker.consumer import Consumer
from shared.broker.delivery import Delivery
from shared.broker.publisher import ConfirmingPublisher, OutgoingMessage
from shared.broker.topology import (
    JOB_ROUTING_KEY,
    JOBS_EXCHANGE,
    QUORUM_REPLICAS,
    RESPONDER_QUEUE,
    build_topology,
)
from shared.settings import Settings
from tests.support.broker import wait_for
from tests.support.processes import free_port

# Booting three nodes takes a minute, more on a busy machine.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(600), pytest.mark.slow]

TOPOLOGY = build_topology((0.5, 1))


def dead_address(url: str) -> str:
    """The same URL on a port nothing listens on: a node that is down."""
    head, _, tail = url.partition("@")
    return f"{head}@127.0.0.1:{free_port()}/{tail.split('/', 1)[1]}"


async def test_a_service_given_a_down_node_and_a_live_one_connects_to_the_live_one_and_doctor_names_the_other(
    settings: Settings,
) -> None:
    live = settings.amqp_url.get_secret_value()
    down = dead_address(live)
    broker = BrokerConnection([down, live, down], TOPOLOGY, name="two-addresses")
    for _ in range(5):  # whatever order it tries them in
        await broker.connect()
        assert broker.address == live
        await broker.close()
    with pytest.raises(BrokerUnreachable, match="no RabbitMQ node answered"):
        await BrokerConnection([down], TOPOLOGY).connect()

    checks = await check_broker(Settings(**{**settings.model_dump(), "amqp_url": f"{live},{down}"}))
    states = {c.name: c.state for c in checks}
    assert list(states.values()).count("FAIL") == 1
    (failed,) = [c for c in checks if c.state == "FAIL"]
    assert "does not answer" in failed.reason and "other nodes" in failed.reason
    assert "start that node again" in failed.fix
    assert states["broker topology"] == "ok", "the topology is checked through the node that answers"
    assert "guest:guest" not in " ".join(c.reason + c.fix for c in checks)


@pytest.fixture(scope="module")
def local_cluster():
    with running_cluster() as cluster:
        yield cluster


async def test_every_queue_a_service_declares_has_a_replica_on_each_node_and_the_leaders_are_spread(
    local_cluster: LocalCluster,
) -> None:
    broker = BrokerConnection(local_cluster.urls, TOPOLOGY, name="declare")
    await broker.connect()
    await broker.close()
    leaders = set()
    for queue in TOPOLOGY.queues:
        info = await asyncio.to_thread(local_cluster.api, f"/queues/%2F/{queue.name}")
        assert isinstance(info, dict)
        assert sorted(info["members"]) == sorted(n.name for n in local_cluster.nodes), queue.name
        assert len(info["members"]) == QUORUM_REPLICAS
        leaders.add(info["leader"])
    # queue_leader_locator = balanced (as deploy/rabbitmq/rabbitmq.conf): not all on the
    # node the service happened to connect to.
    assert len(leaders) >= 2, leaders


async def test_a_consumer_and_a_publisher_with_every_address_carry_on_through_another_node_when_theirs_dies(
    local_cluster: LocalCluster,
) -> None:
    consume_broker = BrokerConnection(local_cluster.urls, TOPOLOGY, name="consume")
    publish_broker = BrokerConnection(local_cluster.urls, TOPOLOGY, name="publish")
    received: set[str] = set()

    async def handle(message: Delivery) -> None:
        received.add(message.message_id or "")

    consumer = Consumer(consume_broker, RESPONDER_QUEUE, handle, prefetch=20)
    consuming = asyncio.create_task(consumer.run())
    await wait_for(lambda: consumer.consuming, what="the consumer", within=30)
    lost_address = consume_broker.address
    assert lost_address is not None
    lost = local_cluster.nodes[local_cluster.urls.index(lost_address)]
    # A second consumer that knows only the lost node, as one URL gives it.
    lonely_broker = BrokerConnection([lost_address], TOPOLOGY, name="lonely")
    lonely = Consumer(lonely_broker, f"{RESPONDER_QUEUE}.retry.0.5s", handle, prefetch=1, max_backoff=1)
    lonely_task = asyncio.create_task(lonely.run())
    await wait_for(lambda: lonely.consuming, what="the single-address consumer", within=30)

    publisher = ConfirmingPublisher(publish_broker, confirm_timeout=10)
    confirmed: list[str] = []
    stop = asyncio.Event()

    async def publish() -> None:
        n = 0
        while not stop.is_set():
            n += 1
            message = OutgoingMessage(JOBS_EXCHANGE, JOB_ROUTING_KEY, f"m-{n}", b"{}")
            try:
                await publisher.publish(message)
                confirmed.append(message.message_id)
            except Exception:
                # Not confirmed: unknown, as the relay treats it (its row would stay
                # unpublished and be sent again); a fresh connection next time.
                await publisher.reset()
                await asyncio.sleep(0.1)

    publishing = asyncio.create_task(publish())
    try:
        await wait_for(lambda: len(confirmed) >= 50, what="confirmed publishes before the loss", within=30)
        killed_at = time.monotonic()
        await asyncio.to_thread(local_cluster.stop_node, lost, kill=True)
        before = len(confirmed)
        await wait_for(
            lambda: consumer.consuming and consume_broker.address not in (None, lost_address),
            what="the consumer on another node",
            within=30,
        )
        recovered = time.monotonic() - killed_at
        await wait_for(
            lambda: len(confirmed) >= before + 100, what="confirmed publishes after the loss", within=60
        )
        # The single-address consumer cannot reconnect while its node is down.
        assert not lonely.consuming
        stop.set()
        await publishing
        await wait_for(lambda: set(confirmed) <= received, what="every confirmed message consumed", within=60)
        print(f"consumer back on another node {recovered:.1f} s after the kill")
        assert recovered < 20
        await asyncio.to_thread(local_cluster.start_node, lost)
        await wait_for(lambda: lonely.consuming, what="the single-address consumer after its node", within=60)
    finally:
        stop.set()
        publishing.cancel()
        for c, task in ((consumer, consuming), (lonely, lonely_task)):
            await c.stop(drain_seconds=2)
            task.cancel()
        for b in (consume_broker, publish_broker, lonely_broker):
            await b.close()
        if not local_cluster.is_up(lost):
            await asyncio.to_thread(local_cluster.start_node, lost)
