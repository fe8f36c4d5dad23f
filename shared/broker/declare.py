"""Idempotent declaration of the topology. Every process calls it at start-up; declaring
what exists with the same arguments is a no-op, and a mismatch fails loudly
(PRECONDITION_FAILED) instead of running against a different topology."""

from __future__ import annotations

import aio_pika
from aio_pika.abc import AbstractChannel

from shared.broker.topology import Topology


async def declare_topology(channel: AbstractChannel, topology: Topology) -> None:
    exchanges = {}
    for e in topology.exchanges:
        exchanges[e.name] = await channel.declare_exchange(
            e.name, aio_pika.ExchangeType(e.type), durable=e.durable
        )
    queues = {}
    for q in topology.queues:
        queues[q.name] = await channel.declare_queue(q.name, durable=q.durable, arguments=q.args)
    for b in topology.bindings:
        await queues[b.queue].bind(exchanges[b.exchange], routing_key=b.routing_key)
