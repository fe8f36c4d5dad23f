"""The broker topology as typed data (design section 7), declared by every process and
exported as deploy/rabbitmq/definitions.json. Queue names and arguments live here only.

Every queue is a quorum queue: replicated, with a delivery limit for poison messages and
at-least-once dead-lettering (``x-dead-letter-strategy``), so a message that is
dead-lettered or that expires from a retry tier is never dropped on the way.

Dead-lettering and the retry tiers' TTLs are queue arguments, not policies, on purpose:
retries and failures must route correctly on a broker nobody has configured, and
RabbitMQ lets a queue's own x-dead-letter-exchange win over a policy's (and takes the
lower of two TTLs), so a policy there would be inert. What an operator may want to tune
on a running cluster without redeclaring queues is a policy in definitions.json
(``POLICIES``): leader placement of the quorum queues and how long dead letters are kept.

On a cluster (README "Running against a RabbitMQ cluster"): each quorum queue gets
``QUORUM_REPLICAS`` replicas, RabbitMQ's own default (``quorum_cluster_size``), capped at
the number of nodes, so one node keeps working with one replica and three nodes keep a
message confirmed to us through the loss of any one. Neither the replica count
(``x-quorum-initial-group-size``) nor the leader placement (``x-queue-leader-locator``)
is a queue argument: RabbitMQ compares both when a queue is declared again (measured on
3.10: PRECONDITION_FAILED, "inequivalent arg"), so adding one would stop every service
on a broker whose queues were declared without it. Leader placement is the policy below
and ``queue_leader_locator`` in deploy/rabbitmq/rabbitmq.conf; the delivery limit, which
matters on a cluster as anywhere (a redelivery after a lost node counts), is an argument.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

ExchangeType = Literal["direct", "topic", "fanout"]

INBOUND_EXCHANGE = "chatq.inbound"
JOBS_EXCHANGE = "chatq.jobs"
RETRY_EXCHANGE = "chatq.retry"
DEAD_EXCHANGE = "chatq.dead"

COALESCER_QUEUE = "chatq.coalescer"
RESPONDER_QUEUE = "chatq.responder"
COALESCER_DEAD_QUEUE = "chatq.coalescer.dead"
RESPONDER_DEAD_QUEUE = "chatq.responder.dead"

JOB_ROUTING_KEY = "reply"
DEFAULT_RETRY_DELAYS: tuple[float, ...] = (1, 10, 60, 300)

#: Replicas of each quorum queue: RabbitMQ's default initial group size, at most the
#: number of nodes. Not declared (see the module's docstring); the cluster tests check it.
QUORUM_REPLICAS = 3
#: Queue arguments RabbitMQ compares on redeclaration that the topology must never add:
#: an existing deployment's queues were declared without them.
NOT_QUEUE_ARGUMENTS = ("x-quorum-initial-group-size", "x-queue-leader-locator")

COALESCER_DELIVERY_LIMIT = 10
RESPONDER_DELIVERY_LIMIT = 5


def inbound_routing_key(platform: str) -> str:
    return f"inbound.{platform}"


def retry_tier_name(delay_seconds: float) -> str:
    """'1s', '10s', '1.5s': the routing key and queue suffix of a retry tier."""
    return f"{delay_seconds:g}s"


@dataclass(frozen=True)
class Exchange:
    name: str
    type: ExchangeType
    durable: bool = True


@dataclass(frozen=True)
class Queue:
    name: str
    arguments: tuple[tuple[str, Any], ...] = ()
    durable: bool = True

    @property
    def args(self) -> dict[str, Any]:
        return dict(self.arguments)

    @property
    def delivery_limit(self) -> int | None:
        """The quorum queue's limit of unsuccessful deliveries before it dead-letters."""
        value = self.args.get("x-delivery-limit")
        return int(value) if value is not None else None


@dataclass(frozen=True)
class Binding:
    exchange: str
    queue: str
    routing_key: str


@dataclass(frozen=True)
class Policy:
    """A RabbitMQ policy: definitions.json carries it; processes never set policies."""

    name: str
    pattern: str
    definition: tuple[tuple[str, Any], ...]
    priority: int = 0
    apply_to: Literal["queues", "exchanges", "all"] = "queues"


DEAD_LETTER_RETENTION_MS = 14 * 24 * 3600 * 1000

POLICIES: tuple[Policy, ...] = (
    # Spread quorum queue leaders over the cluster's nodes instead of the declaring one.
    Policy("chatq-queues", r"^chatq\.", (("queue-leader-locator", "balanced"),)),
    # Dead letters are also recorded in Postgres (failed, with the reason, retryable from
    # the admin API); the broker's copy is kept 14 days. A queue gets only its
    # highest-priority policy, so this one repeats the leader placement.
    Policy(
        "chatq-dead-letters",
        r"^chatq\.(coalescer|responder)\.dead$",
        (("message-ttl", DEAD_LETTER_RETENTION_MS), ("queue-leader-locator", "balanced")),
        priority=10,
    ),
)


@dataclass(frozen=True)
class Topology:
    exchanges: tuple[Exchange, ...]
    queues: tuple[Queue, ...]
    bindings: tuple[Binding, ...]
    retry_tiers: tuple[float, ...] = field(default=DEFAULT_RETRY_DELAYS)

    def queue(self, name: str) -> Queue:
        for q in self.queues:
            if q.name == name:
                return q
        raise KeyError(name)

    def retry_queue_name(self, delay_seconds: float) -> str:
        return f"{RESPONDER_QUEUE}.retry.{retry_tier_name(delay_seconds)}"


def _quorum(**extra: Any) -> tuple[tuple[str, Any], ...]:
    args: dict[str, Any] = {"x-queue-type": "quorum"}
    args.update(extra)
    return tuple(sorted(args.items()))


def _work_queue(name: str, *, delivery_limit: int, dead_key: str) -> Queue:
    return Queue(
        name,
        _quorum(
            **{
                "x-delivery-limit": delivery_limit,
                "x-dead-letter-exchange": DEAD_EXCHANGE,
                "x-dead-letter-routing-key": dead_key,
                "x-dead-letter-strategy": "at-least-once",
                "x-overflow": "reject-publish",
            }
        ),
    )


def build_topology(retry_delays: Sequence[float] = DEFAULT_RETRY_DELAYS) -> Topology:
    tiers = tuple(retry_delays)
    exchanges = (
        Exchange(INBOUND_EXCHANGE, "topic"),
        Exchange(JOBS_EXCHANGE, "direct"),
        Exchange(RETRY_EXCHANGE, "direct"),
        Exchange(DEAD_EXCHANGE, "direct"),
    )
    queues: list[Queue] = [
        _work_queue(COALESCER_QUEUE, delivery_limit=COALESCER_DELIVERY_LIMIT, dead_key="coalescer"),
        _work_queue(RESPONDER_QUEUE, delivery_limit=RESPONDER_DELIVERY_LIMIT, dead_key="responder"),
        Queue(COALESCER_DEAD_QUEUE, _quorum()),
        Queue(RESPONDER_DEAD_QUEUE, _quorum()),
    ]
    bindings: list[Binding] = [
        Binding(INBOUND_EXCHANGE, COALESCER_QUEUE, "inbound.#"),
        Binding(JOBS_EXCHANGE, RESPONDER_QUEUE, JOB_ROUTING_KEY),
        Binding(DEAD_EXCHANGE, COALESCER_DEAD_QUEUE, "coalescer"),
        Binding(DEAD_EXCHANGE, RESPONDER_DEAD_QUEUE, "responder"),
    ]
    for delay in tiers:
        name = f"{RESPONDER_QUEUE}.retry.{retry_tier_name(delay)}"
        queues.append(
            Queue(
                name,
                _quorum(
                    **{
                        "x-message-ttl": int(delay * 1000),
                        # Expired messages go back to the responder's queue.
                        "x-dead-letter-exchange": JOBS_EXCHANGE,
                        "x-dead-letter-routing-key": JOB_ROUTING_KEY,
                        "x-dead-letter-strategy": "at-least-once",
                        "x-overflow": "reject-publish",
                    }
                ),
            )
        )
        bindings.append(Binding(RETRY_EXCHANGE, name, retry_tier_name(delay)))
    return Topology(tuple(exchanges), tuple(queues), tuple(bindings), tiers)


def definitions(topology: Topology, vhost: str = "/") -> dict[str, Any]:
    """The topology in RabbitMQ's definitions format (load_definitions at boot)."""
    return {
        "vhosts": [{"name": vhost}],
        "exchanges": [
            {
                "name": e.name,
                "vhost": vhost,
                "type": e.type,
                "durable": e.durable,
                "auto_delete": False,
                "internal": False,
                "arguments": {},
            }
            for e in topology.exchanges
        ],
        "queues": [
            {
                "name": q.name,
                "vhost": vhost,
                "durable": q.durable,
                "auto_delete": False,
                "arguments": q.args,
            }
            for q in topology.queues
        ],
        "policies": [
            {
                "name": p.name,
                "vhost": vhost,
                "pattern": p.pattern,
                "apply-to": p.apply_to,
                "priority": p.priority,
                "definition": dict(p.definition),
            }
            for p in POLICIES
        ],
        "bindings": [
            {
                "source": b.exchange,
                "vhost": vhost,
                "destination": b.queue,
                "destination_type": "queue",
                "routing_key": b.routing_key,
                "arguments": {},
            }
            for b in topology.bindings
        ],
    }


def render_definitions(topology: Topology, vhost: str = "/") -> str:
    return json.dumps(definitions(topology, vhost), indent=2, sort_keys=True) + "\n"


def comparable(defs: Mapping[str, Any]) -> dict[str, Any]:
    """Reduce definitions (ours or the broker's export) to what the topology decides."""
    return {
        "exchanges": sorted(
            (e["name"], e["type"], e["durable"])
            for e in defs.get("exchanges", [])
            if e["name"].startswith("chatq.")
        ),
        "queues": sorted(
            (q["name"], q["durable"], json.dumps(q.get("arguments", {}), sort_keys=True))
            for q in defs.get("queues", [])
            if q["name"].startswith("chatq.")
        ),
        "bindings": sorted(
            (b["source"], b["destination"], b["routing_key"])
            for b in defs.get("bindings", [])
            if b["source"].startswith("chatq.")
        ),
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Export the broker topology as definitions.json.")
    parser.add_argument("command", choices=["export"])
    parser.add_argument("--vhost", default="/")
    parser.add_argument("--output", "-o", help="file to write (default: standard output)")
    args = parser.parse_args(argv)
    text = render_definitions(build_topology(), args.vhost)
    if args.output:
        with open(args.output, "w") as fh:
            fh.write(text)
    else:
        sys.stdout.write(text)


if __name__ == "__main__":
    main()
