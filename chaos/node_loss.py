"""Losing a RabbitMQ node under traffic: the pipeline runs on a local three-node cluster
(``chaos.cluster``), each node reached through a TCP fault proxy of its own, and the
services are given all three addresses. Every 20-40 s the node holding the most of the
services' connections, or the leader of ``chatq.responder`` (in turn), is killed
(SIGKILL of its VM) or stopped (``rabbitmqctl stop``) (in turn), and started again
10-15 s later; once, a node is cut off from the services instead (its proxy cuts every
connection and refuses new ones for 10 s). Each loss records when it happened and when
every connection the services held before it was open again; the end-to-end recovery
(the first reply sent to a message received after the loss) is read from the database
at the end. Afterwards nothing may be left ready or unacknowledged in the work queues.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import random
import statistics
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import asyncpg
import httpx

from chaos.cluster import LocalCluster, Node, running_cluster
from shared.broker.topology import build_topology, definitions
from tests.support.tcpproxy import TcpProxy

#: The queues whose messages must all be settled once the load has drained.
WORK_QUEUES = ("chatq.coalescer", "chatq.responder")


@dataclass
class Loss:
    kind: str  # "kill", "stop" or "cut"
    node: str
    why: str  # "most connections" or "leader of chatq.responder"
    at: float  # wall clock (time.time()), comparable with Postgres' timestamps
    connections_on_node: int = 0  # service connections the lost node held
    reconnected_after: float | None = None  # seconds until every connection was back
    first_reply_after: float | None = None  # seconds until a message received after it was answered
    #: The longest time without a reply sent in the 30 s after the loss (from the loss):
    #: how long the pipeline stalled, if it did.
    longest_pause: float | None = None


@dataclass
class RabbitCluster:
    """The local cluster, a proxy in front of each node, and what happened to them."""

    cluster: LocalCluster
    proxies: dict[str, TcpProxy]
    losses: list[Loss] = field(default_factory=list)
    rng: random.Random = field(default_factory=lambda: random.Random(22))

    @property
    def amqp_url(self) -> str:
        """CHATQ_AMQP_URL for the services: every node, through its proxy."""
        return ",".join(f"amqp://guest:guest@127.0.0.1:{p.port}/" for p in self.proxies.values())

    async def api(self, path: str) -> object:
        return await asyncio.to_thread(self.cluster.api, path)

    async def service_connections(self) -> dict[str, str]:
        """Each service connection's name -> the node it is on."""
        out: dict[str, str] = {}
        with contextlib.suppress(Exception):
            for c in await self.api("/connections"):  # type: ignore[union-attr]
                name = (c.get("client_properties") or {}).get("connection_name") or ""
                if name.startswith("chatq-") and c.get("state") in (None, "running"):
                    out[f"{name}#{c.get('peer_port')}"] = c["node"]
        return out

    async def target(self, by: str) -> tuple[Node, str]:
        if by == "leader":
            with contextlib.suppress(Exception):
                q = await self.api("/queues/%2F/chatq.responder")
                leader = q.get("leader") if isinstance(q, dict) else None  # type: ignore[union-attr]
                if leader:
                    return self.cluster.node_named(leader), "leader of chatq.responder"
        counts: dict[str, int] = {n.name: 0 for n in self.cluster.nodes}
        for node in (await self.service_connections()).values():
            counts[node] = counts.get(node, 0) + 1
        busiest = max(counts, key=lambda n: (counts[n], self.rng.random()))
        return self.cluster.node_named(busiest), "most connections"

    async def lose(self, kind: str, by: str, *, down_for: float) -> Loss:
        """``kind``: kill, stop or cut; ``by``: the node with the most connections
        ("connections") or the leader of chatq.responder ("leader")."""
        node, why = await self.target(by)
        before = await self.service_connections()
        cut = kind == "cut"
        on_node = sum(1 for n in before.values() if n == node.name)
        loss = Loss(kind, node.name, why, time.time(), connections_on_node=on_node)
        self.losses.append(loss)
        started = time.monotonic()
        watcher = asyncio.create_task(self._reconnected(loss, before, node, started))
        if cut:
            self.proxies[node.name].block()
            await asyncio.sleep(down_for)
            self.proxies[node.name].unblock()
        else:
            await asyncio.to_thread(self.cluster.stop_node, node, kill=kind == "kill")
            await asyncio.sleep(down_for)
            await asyncio.to_thread(self.cluster.start_node, node)
            await self.wait_clustered()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(watcher, timeout=60)
        return loss

    async def _reconnected(self, loss: Loss, before: dict[str, str], lost: Node, started: float) -> None:
        """Until each service connection that was on the lost node is open again on
        another (0 s when the services held none there). The responder's retry
        publisher is left out: it opens its connection at its next retry only."""
        on_lost = {key for key, node in before.items() if node == lost.name and "-retry#" not in key}
        while True:
            now = await self.service_connections()
            names_now = {key.split("#")[0] for key, node in now.items() if node != lost.name}
            if not on_lost & set(now) and {key.split("#")[0] for key in on_lost} <= names_now:
                loss.reconnected_after = round(time.monotonic() - started, 2)
                return
            await asyncio.sleep(0.25)

    async def wait_clustered(self, within: float = 120) -> None:
        deadline = time.monotonic() + within
        want = {n.name for n in self.cluster.nodes}
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                running = set(await asyncio.to_thread(self.cluster.running_nodes))
                if running >= want:
                    return
            await asyncio.sleep(1)
        raise RuntimeError("the restarted node did not rejoin the cluster")

    async def unsettled(self) -> dict[str, int]:
        """Messages ready or unacknowledged in the work queues, read from the broker
        (the management stats lag a few seconds: the lowest of several looks)."""
        lowest: dict[str, int] = {}
        for _ in range(8):
            for q in WORK_QUEUES:
                with contextlib.suppress(Exception):
                    info = await self.api(f"/queues/%2F/{q}")
                    assert isinstance(info, dict)
                    n = int(info.get("messages_ready", 0)) + int(info.get("messages_unacknowledged", 0))
                    lowest[q] = min(lowest.get(q, n), n)
            if lowest and not any(lowest.values()):
                break
            await asyncio.sleep(2)
        return lowest


#: What is lost, in turn: (kill, stop or cut; the node with the most connections or the
#: leader of chatq.responder). After the first two, the rest repeats.
PLAN = (
    ("kill", "connections"),
    ("cut", "leader"),
    ("stop", "leader"),
    ("kill", "connections"),
    ("stop", "connections"),
    ("kill", "leader"),
)


async def node_losses(
    rabbit: RabbitCluster, done: asyncio.Event, *, interval: tuple[float, float], load_ends: float
) -> None:
    """A loss every ``interval`` seconds while the load lasts (none that would start
    less than 20 s before ``load_ends``, a monotonic time: its recovery needs traffic)."""
    index = 0
    while True:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(done.wait(), timeout=rabbit.rng.uniform(*interval))
        if done.is_set() or time.monotonic() > load_ends - 20:
            return
        kind, by = PLAN[index] if index < len(PLAN) else PLAN[2 + (index - 2) % (len(PLAN) - 2)]
        await rabbit.lose(kind, by, down_for=10 if kind == "cut" else rabbit.rng.uniform(10, 15))
        index += 1


@contextlib.asynccontextmanager
async def rabbit_cluster() -> AsyncIterator[RabbitCluster]:
    """A fresh local cluster with the deployment's definitions (topology and policies:
    quorum leaders spread over the nodes) and a proxy in front of each node."""
    async with contextlib.AsyncExitStack() as stack:
        cluster = await asyncio.to_thread(stack.enter_context, running_cluster())
        defs = definitions(build_topology((0.5, 1, 2)))
        defs.pop("vhosts")
        api = cluster.nodes[0]
        async with httpx.AsyncClient(auth=("guest", "guest"), timeout=30) as client:
            r = await client.post(
                f"http://127.0.0.1:{api.management_port}/api/definitions/%2F",
                content=json.dumps(defs),
                headers={"content-type": "application/json"},
            )
            r.raise_for_status()
        proxies = {}
        for node in cluster.nodes:
            proxies[node.name] = await TcpProxy("127.0.0.1", node.amqp_port).start()
            stack.push_async_callback(proxies[node.name].close)
        yield RabbitCluster(cluster, proxies)


async def first_replies(pool: asyncpg.Pool, losses: list[Loss]) -> None:
    """For each loss, the seconds until the first reply to a message received after it,
    and the longest pause between replies sent in the 30 s after it."""
    for loss in losses:
        sent = await pool.fetch(
            """
            SELECT extract(epoch FROM sent_at - to_timestamp($1))::float8 AS t FROM reply_jobs
            WHERE status = 'sent' AND sent_at BETWEEN to_timestamp($1) AND to_timestamp($1) + interval '30 s'
            ORDER BY sent_at
            """,
            loss.at,
        )
        times = [0.0, *(r["t"] for r in sent)]
        loss.longest_pause = round(max(b - a for a, b in itertools.pairwise(times)), 2) if sent else None
        loss.first_reply_after = await pool.fetchval(
            """
            SELECT round(extract(epoch FROM min(j.sent_at) - to_timestamp($1))::numeric, 2)::float8
            FROM reply_jobs j JOIN operations o ON o.id = ANY(j.operation_ids)
            WHERE j.status = 'sent' AND o.received_at > to_timestamp($1)
            """,
            loss.at,
        )


def percentile(values: list[float], p: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return round(statistics.quantiles(values, n=100, method="inclusive")[int(p) - 1], 2)


def report(losses: list[Loss], unsettled: dict[str, int]) -> list[str]:
    lines = ["  broker node losses:"]
    for i, loss in enumerate(losses, 1):
        lines.append(
            f"    {i}. {loss.kind} {loss.node} ({loss.why}): its {loss.connections_on_node} service "
            f"connections open on other nodes after {_s(loss.reconnected_after)}, first reply to a "
            f"message received after the loss {_s(loss.first_reply_after)} after it, longest pause "
            f"between replies in the 30 s after it {_s(loss.longest_pause)}"
        )
    for label, values in (
        ("connections back", [x.reconnected_after for x in losses]),
        ("first reply", [x.first_reply_after for x in losses]),
        ("longest pause", [x.longest_pause for x in losses]),
    ):
        got = [v for v in values if v is not None]
        lines.append(
            f"    {label}: p50 {_s(percentile(got, 50))}, p99 {_s(percentile(got, 99))} "
            f"({len(got)} of {len(values)} losses)"
        )
    lines.append(
        "    afterwards, ready + unacknowledged: "
        + ", ".join(f"{q} {n}" for q, n in sorted(unsettled.items()))
    )
    return lines


def _s(v: float | None) -> str:
    return "never" if v is None else f"{v:.1f} s"
