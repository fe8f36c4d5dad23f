"""The topology is data: its export is what deploy/ ships, and its shape is the contract."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shared.broker.topology import (
    COALESCER_QUEUE,
    INBOUND_EXCHANGE,
    NOT_QUEUE_ARGUMENTS,
    POLICIES,
    RESPONDER_QUEUE,
    build_topology,
    definitions,
    render_definitions,
)

pytestmark = pytest.mark.unit
DEFINITIONS = Path(__file__).resolve().parents[2] / "deploy" / "rabbitmq" / "definitions.json"


def test_the_committed_definitions_json_equals_the_generated_topology() -> None:
    assert DEFINITIONS.read_text() == render_definitions(build_topology()), (
        "deploy/rabbitmq/definitions.json is stale: run `make definitions`"
    )


def test_work_queues_are_quorum_queues_with_a_delivery_limit_and_safe_dead_lettering() -> None:
    topology = build_topology()
    for name in (COALESCER_QUEUE, RESPONDER_QUEUE):
        args = topology.queue(name).args
        assert args["x-queue-type"] == "quorum"
        assert args["x-delivery-limit"] >= 1
        assert args["x-dead-letter-exchange"] == "chatq.dead"
        assert args["x-dead-letter-strategy"] == "at-least-once"


def test_replica_count_and_leader_placement_are_never_queue_arguments_so_old_queues_redeclare() -> None:
    # RabbitMQ refuses a redeclaration that adds either (PRECONDITION_FAILED): every
    # deployment's existing queues were declared without them.
    for queue in build_topology().queues:
        assert not set(queue.args) & set(NOT_QUEUE_ARGUMENTS), queue.name
    # Leader placement on a cluster is the policy's (and rabbitmq.conf's), for every queue.
    placed = {p.pattern for p in POLICIES if dict(p.definition).get("queue-leader-locator") == "balanced"}
    assert r"^chatq\." in placed and len(placed) == len(POLICIES)
    conf = (DEFINITIONS.parent / "rabbitmq.conf").read_text()
    assert "queue_leader_locator = balanced" in conf


def test_each_retry_tier_expires_back_into_the_jobs_exchange_after_its_delay() -> None:
    topology = build_topology([1, 10, 60, 300])
    tiers = {q.name: q.args for q in topology.queues if ".retry." in q.name}
    assert sorted(tiers) == sorted(f"chatq.responder.retry.{t}" for t in ("1s", "10s", "60s", "300s"))
    assert tiers["chatq.responder.retry.10s"]["x-message-ttl"] == 10_000
    assert {a["x-dead-letter-exchange"] for a in tiers.values()} == {"chatq.jobs"}
    bound = {(b.exchange, b.routing_key) for b in topology.bindings if ".retry." in b.queue}
    assert bound == {("chatq.retry", k) for k in ("1s", "10s", "60s", "300s")}


def test_every_binding_names_a_declared_exchange_and_queue() -> None:
    topology = build_topology()
    exchanges = {e.name for e in topology.exchanges}
    queues = {q.name for q in topology.queues}
    for b in topology.bindings:
        assert b.exchange in exchanges
        assert b.queue in queues


def test_definitions_are_valid_json_for_the_named_vhost() -> None:
    doc = json.loads(render_definitions(build_topology(), "prod"))
    assert doc["vhosts"] == [{"name": "prod"}]
    assert {q["vhost"] for q in definitions(build_topology(), "prod")["queues"]} == {"prod"}


def test_the_shown_status_looks_for_unpublished_rows_on_the_inbound_exchange_the_topology_names() -> None:
    """chatq_shown_status reads 'queued' from the inbound outbox rows by exchange name (the
    outbox index leads with it); a renamed exchange would read every message 'queued'."""
    sql = (Path(__file__).resolve().parents[2] / "shared" / "functions" / "15_shown_status.sql").read_text()
    assert f"b.exchange = '{INBOUND_EXCHANGE}'" in sql
