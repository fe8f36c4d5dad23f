"""Which node a (re)connect tries first: any, in a random order, the one whose connection
was just lost last (it is likely the node that died)."""

from __future__ import annotations

import pytest

from shared.broker.connection import BrokerConnection
from shared.broker.topology import build_topology

pytestmark = pytest.mark.unit

NODES = [f"amqp://u:p@mq-{i}:5672/" for i in (1, 2, 3)]


def test_a_reconnect_tries_every_node_and_the_one_just_lost_last() -> None:
    broker = BrokerConnection(",".join(NODES), build_topology())
    broker.address = NODES[1]
    for _ in range(50):
        order = broker._order()
        assert sorted(order) == sorted(NODES)
        assert order[-1] == NODES[1]


def test_the_first_node_tried_varies_so_services_spread_over_the_cluster() -> None:
    broker = BrokerConnection(NODES, build_topology())
    firsts = {broker._order()[0] for _ in range(200)}
    assert firsts == set(NODES)


def test_one_address_is_always_the_one_tried() -> None:
    broker = BrokerConnection(NODES[0], build_topology())
    broker.address = NODES[0]
    assert broker._order() == [NODES[0]]
