"""Fault campaign runner.

Each scenario starts the pipeline (receiver, coalescer, responder as real processes)
on a fresh database and vhost, with RabbitMQ reached through a TCP fault proxy and the
platforms and model faked in-process. A load driver posts bursts of buyer messages over
many chats through Telegram, Avito and generic webhooks, with duplicate deliveries, and
retries every delivery that did not get a 2xx, as the platforms do. Meanwhile the
scenario injects its faults. Then the pipeline drains and the verdict is computed from
the driver's records, the fake platforms' records and the database.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import signal
import subprocess
import time
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import asdict, dataclass, field
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import httpx

from bench.support import drop_database, fresh_database, private_vhost
from chaos import node_loss
from chaos.postgres import PrivatePostgres
from chaos.prometheus import AlertWatch, watching
from shared.faults import KNOWN_POINTS
from shared.settings import Settings
from tests.fakes.platforms import running_fakes
from tests.fakes.world import FakeWorld
from tests.support.payloads import avito_webhook, dumps, generic_message, signed, telegram_update
from tests.support.processes import Receiver, ServiceProcess, Worker, free_port
from tests.support.tcpproxy import TcpProxy

TG_SECRET = "chaos-telegram-secret"
AVITO_SECRET = "chaos-avito-secret"
GENERIC_SECRET = "whsec_Y2hhb3MtZ2VuZXJpYy1zZWNyZXQtMDEyMzQ1Njc4OQ=="
PLATFORMS = ("telegram", "avito", "generic")
FINAL = ("replied", "failed", "needs_review", "ignored")


@dataclass
class Event:
    platform: str
    chat: str
    message_id: str
    text: str
    at: float = 0.0  # seconds after the load starts
    deliveries: int = 0
    acked: bool = False


@dataclass
class Infra:
    admin_database_url: str
    amqp_url: str
    rabbitmq_api_url: str


@dataclass
class Cluster:
    """The three services as real processes, ``replicas`` of each ("responder",
    "responder-2", ...), all on one database and one vhost."""

    settings: Settings
    receiver_ports: list[int]
    procs: dict[str, ServiceProcess] = field(default_factory=dict)
    restarts: Counter[str] = field(default_factory=Counter)
    #: The three-node RabbitMQ cluster, in the scenarios that run on one.
    rabbit: node_loss.RabbitCluster | None = None
    #: When the load's last message is due (time.monotonic()).
    load_ends: float = 0.0
    #: The scenario's own Postgres, in the scenarios that stop or restart it.
    postgres: PrivatePostgres | None = None
    #: When it was stopped and started again (time.monotonic()).
    postgres_stopped_at: float | None = None
    postgres_started_at: float | None = None

    @property
    def replicas(self) -> int:
        return len(self.receiver_ports)

    @property
    def receiver_port(self) -> int:
        return self.receiver_ports[0]

    @property
    def receiver_urls(self) -> list[str]:
        return [f"http://127.0.0.1:{port}" for port in self.receiver_ports]

    def names(self, service: str) -> list[str]:
        return [service if i == 0 else f"{service}-{i + 1}" for i in range(self.replicas)]

    def _make(self, name: str, **extra: str) -> ServiceProcess:
        service, _, index = name.partition("-")
        if service == "receiver":
            port = self.receiver_ports[int(index or 1) - 1]
            return Receiver(self.settings, port=port, **extra)
        return Worker(service, self.settings, **extra)

    async def start(self, name: str, *, fault_point: str | None = None) -> None:
        extra = {"CHATQ_FAULT_POINT": fault_point} if fault_point else {}
        proc = self._make(name, **extra)
        await proc.start(wait_healthy=False)  # type: ignore[call-arg]
        self.procs[name] = proc

    async def start_all(self) -> None:
        for service in ("receiver", "coalescer", "responder"):
            for name in self.names(service):
                await self.start(name)
        for name, url in zip(self.names("receiver"), self.receiver_urls, strict=True):
            await self.procs[name].wait_http(f"{url}/healthz")

    async def kill(self, name: str) -> None:
        proc = self.procs[name]
        if proc.proc and proc.proc.returncode is None:
            proc.proc.send_signal(signal.SIGKILL)
        await proc.stop()

    async def restart(self, name: str, *, fault_point: str | None = None) -> None:
        await self.kill(name)
        self.restarts[name] += 1
        await self.start(name, fault_point=fault_point)

    async def ensure_running(self) -> None:
        for name, proc in list(self.procs.items()):
            if proc.proc is not None and proc.proc.returncode is not None:
                await proc.stop()
                self.restarts[name] += 1
                await self.start(name)

    async def stop_all(self) -> None:
        for proc in self.procs.values():
            await proc.stop()


#: What a person on call does once the load has drained: (admin API client, pool, world).
Person = Callable[[httpx.AsyncClient, asyncpg.Pool, FakeWorld], Awaitable[Counter[str]]]


@dataclass
class Scenario:
    name: str
    faults: Callable[[Cluster, TcpProxy, FakeWorld, asyncio.Event], Awaitable[None]]
    llm: bool = False
    replicas: int = 1
    person: Person | None = None
    #: On a local three-node RabbitMQ cluster (chaos.cluster) instead of the machine's node.
    on_cluster: bool = False
    #: The load lasts at least this long (the node losses need time).
    min_seconds: float = 0.0
    #: On a Postgres of its own (chaos.postgres), which its faults may stop: never the
    #: machine's, which other work uses.
    private_postgres: bool = False
    #: How long each platform waits for a webhook's answer (default: 5 s for all).
    client_timeouts: Mapping[str, float] | None = None
    #: Alerts a Prometheus watching the services (chaos.prometheus) must see firing.
    alerts: tuple[str, ...] = ()


# ---- faults --------------------------------------------------------------------------


async def no_faults(*_: object) -> None:
    return None


async def random_kills(cluster: Cluster, _proxy: TcpProxy, _world: FakeWorld, done: asyncio.Event) -> None:
    rng = random.Random(11)
    while not done.is_set():
        await _sleep_or_done(done, rng.uniform(1.0, 2.5))
        if done.is_set():
            break
        await cluster.restart(rng.choice(sorted(cluster.procs)))


async def fault_points(cluster: Cluster, _proxy: TcpProxy, _world: FakeWorld, done: asyncio.Event) -> None:
    owners = {"receiver": "receiver", "relay": "receiver", "coalescer": "coalescer", "responder": "responder"}
    for point in sorted(KNOWN_POINTS):
        if done.is_set():
            break
        name = owners[point.split(".")[0]]
        await cluster.restart(name, fault_point=point)
        proc = cluster.procs[name]
        with contextlib.suppress(AssertionError):
            await proc.wait_exit(within=4)  # reached the point and died, or never reached it
        await cluster.restart(name)
        await _sleep_or_done(done, 0.5)


async def broker_cuts(cluster: Cluster, proxy: TcpProxy, _world: FakeWorld, done: asyncio.Event) -> None:
    rng = random.Random(13)
    while not done.is_set():
        await _sleep_or_done(done, rng.uniform(1.0, 2.0))
        proxy.block()
        await asyncio.sleep(rng.uniform(0.5, 2.0))
        proxy.unblock()


async def platform_faults(cluster: Cluster, _proxy: TcpProxy, world: FakeWorld, done: asyncio.Event) -> None:
    world.random_faults = {
        "telegram.send": [("503", 0.08), ("429:1", 0.04), ("slow:0.5", 0.04), ("lost", 0.02)],
        "avito.send": [("500", 0.08), ("429:1", 0.03), ("lost", 0.04)],
        "avito.list": [("503", 0.05)],
        "generic.send": [("503", 0.08), ("lost", 0.04)],
        "llm": [("500", 0.06), ("slow:2", 0.04)],
    }
    await done.wait()


async def broker_restart(cluster: Cluster, _proxy: TcpProxy, _world: FakeWorld, done: asyncio.Event) -> None:
    await _sleep_or_done(done, 2)
    await asyncio.to_thread(subprocess.run, ["rabbitmqctl", "stop_app"], capture_output=True, check=False)
    await asyncio.sleep(3)
    await asyncio.to_thread(subprocess.run, ["rabbitmqctl", "start_app"], capture_output=True, check=False)


async def postgres_restart(
    cluster: Cluster, _proxy: TcpProxy, _world: FakeWorld, done: asyncio.Event
) -> None:
    """The scenario's own Postgres restarted (a fast shutdown, then up again at once)."""
    assert cluster.postgres is not None
    await _sleep_or_done(done, 2)
    await asyncio.to_thread(cluster.postgres.restart)


#: How long the "Postgres stopped" scenario keeps it down.
POSTGRES_DOWN_SECONDS = 120.0


async def postgres_stopped(
    cluster: Cluster, _proxy: TcpProxy, _world: FakeWorld, _done: asyncio.Event
) -> None:
    """The scenario's own Postgres stopped for two minutes under traffic, 15 s in
    (issue 40): webhooks are held, then answered 503 and sent again; work in flight waits;
    the load goes on through it and after it."""
    assert cluster.postgres is not None
    await asyncio.sleep(15)
    await asyncio.to_thread(cluster.postgres.stop)
    cluster.postgres_stopped_at = time.monotonic()
    await asyncio.sleep(POSTGRES_DOWN_SECONDS)
    await asyncio.to_thread(cluster.postgres.start)
    cluster.postgres_started_at = time.monotonic()


async def broker_away_with_backlog(
    cluster: Cluster, proxy: TcpProxy, _world: FakeWorld, done: asyncio.Event
) -> None:
    """RabbitMQ unreachable for seconds at a time: every relay piles up a backlog, then all
    of them publish it at once when the broker comes back (issue 13, defect 1)."""
    rng = random.Random(17)
    while not done.is_set():
        await _sleep_or_done(done, rng.uniform(1.0, 3.0))
        proxy.block()
        await asyncio.sleep(rng.uniform(2.0, 5.0))
        proxy.unblock()


async def permanent_failures(
    cluster: Cluster, _proxy: TcpProxy, world: FakeWorld, done: asyncio.Event
) -> None:
    """Some sends refused for good (400): those messages fail, later ones of their chats are
    answered, and a person retries the failed ones afterwards (issue 13, defect 2)."""
    world.random_faults = {
        "telegram.send": [("400", 0.12)],
        "avito.send": [("400", 0.12)],
        "generic.send": [("400", 0.12)],
    }
    await done.wait()


async def unknown_until_exhausted(
    cluster: Cluster, _proxy: TcpProxy, world: FakeWorld, done: asyncio.Event
) -> None:
    """Sends whose outcome is unknown (answers lost after the action, or requests that hang
    and do nothing; gateways' 502/504), and Avito listings that fail until the attempts run
    out: such messages go to a person, who looks at the chat (issue 13, defects 3, 4, 8)."""
    world.random_faults = {
        "telegram.send": [("lost", 0.05), ("hang", 0.05), ("502", 0.05)],
        "avito.send": [("lost", 0.08), ("hang", 0.08), ("504", 0.04)],
        "avito.list": [("503", 0.6)],
        "generic.send": [("lost", 0.08), ("504", 0.08)],
    }
    await done.wait()


async def retry_tiers_cut(cluster: Cluster, proxy: TcpProxy, world: FakeWorld, done: asyncio.Event) -> None:
    """Platform errors make every job go through the retry tiers while the broker's
    connections are cut again and again, so retry publishes fail (issue 13, defect 5)."""
    world.random_faults = {
        "telegram.send": [("429:1", 0.3)],
        "avito.send": [("500", 0.3)],
        "generic.send": [("503", 0.3)],
    }
    await broker_cuts(cluster, proxy, world, done)


async def responder_crash_loop(
    cluster: Cluster, _proxy: TcpProxy, _world: FakeWorld, done: asyncio.Event
) -> None:
    """The responder dies on the jobs it takes, again and again, past the queue's delivery
    limit: those jobs reach chatq.responder.dead without a give-up, and must be recorded and
    settled, and their chats answered again afterwards (issue 13, defect 6)."""
    await _sleep_or_done(done, 3)
    for _ in range(8):
        if done.is_set():
            break
        await cluster.restart("responder", fault_point="responder.after_generate")
        with contextlib.suppress(AssertionError):
            await cluster.procs["responder"].wait_exit(within=4)
    await cluster.restart("responder")


# ---- what a person does afterwards ---------------------------------------------------


async def retry_failed(admin: httpx.AsyncClient, pool: asyncpg.Pool, _world: FakeWorld) -> Counter[str]:
    """Retry every failed operation, as the person on call would once the cause is fixed."""
    done: Counter[str] = Counter()
    for op in await pool.fetch(
        # One per reply job: retrying a message retries the rest of its job with it.
        "SELECT DISTINCT ON (coalesce(job_id, id)) id FROM operations WHERE status = 'failed'"
    ):
        r = await admin.post(f"/v1/operations/{op['id']}/retry", json={"by": "chaos"})
        done["retried" if r.status_code == 202 else f"retry {r.status_code}"] += 1
    return done


async def check_the_chat(admin: httpx.AsyncClient, pool: asyncpg.Pool, world: FakeWorld) -> Counter[str]:
    """For each needs_review job, look at the chat as a person would: a reply there that no
    recorded reply accounts for is this job's (resolve as replied manually); none means it
    never went out (retry with a confirmed re-send). Failed ones are retried."""
    done = await retry_failed(admin, pool, world)
    jobs = await pool.fetch(
        """
        SELECT j.id, j.chat_id, j.operation_ids,
               (SELECT count(*) FROM reply_jobs s WHERE s.chat_key = j.chat_key AND s.status = 'sent') AS sent
        FROM reply_jobs j WHERE j.status = 'needs_review'
        """
    )
    for job in jobs:
        op = job["operation_ids"][0]
        in_chat = len(world.replies_to(job["chat_id"]))
        if in_chat > job["sent"]:
            r = await admin.post(
                f"/v1/operations/{op}/resolve",
                json={"resolution": "replied_manually", "owner": "chaos", "note": "the reply is in the chat"},
            )
            done["resolved" if r.status_code == 200 else f"resolve {r.status_code}"] += 1
        else:
            r = await admin.post(f"/v1/operations/{op}/retry?resend=true", json={"by": "chaos"})
            done["re-sent" if r.status_code == 202 else f"resend {r.status_code}"] += 1
    return done


async def broker_node_losses(
    cluster: Cluster, _proxy: TcpProxy, _world: FakeWorld, done: asyncio.Event
) -> None:
    """Every 20-40 s a RabbitMQ node is lost (killed, stopped, or once cut off) and later
    back (chaos.node_loss)."""
    assert cluster.rabbit is not None
    await node_loss.node_losses(cluster.rabbit, done, interval=(20, 40), load_ends=cluster.load_ends)


async def one_broker_node_killed(
    cluster: Cluster, _proxy: TcpProxy, _world: FakeWorld, done: asyncio.Event
) -> None:
    """The short variant: the node holding the most connections is killed once, 15 s in."""
    assert cluster.rabbit is not None
    await _sleep_or_done(done, 15)
    await cluster.rabbit.lose("kill", "connections", down_for=10)


async def _sleep_or_done(done: asyncio.Event, seconds: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(done.wait(), timeout=seconds)


SHORT = [
    Scenario("baseline (no faults)", no_faults),
    Scenario("kill -9 at random moments", random_kills),
    Scenario("kill -9 at every fault point", fault_points),
    Scenario("RabbitMQ connections cut", broker_cuts),
    Scenario("platform 5xx/429/slow/lost, model errors", platform_faults, llm=True),
    Scenario(
        "RabbitMQ away, two relays publish their backlogs at once", broker_away_with_backlog, replicas=2
    ),
    Scenario("sends refused, a person retries after later replies", permanent_failures, person=retry_failed),
    Scenario(
        "outcomes unknown until attempts run out, a person checks",
        unknown_until_exhausted,
        person=check_the_chat,
    ),
]
# Horizontal scale: two receivers (deliveries and their duplicates land on either), two
# coalescers, two responders, on one database and one vhost.
REPLICAS = [
    Scenario("two replicas of each service", no_faults, replicas=2),
    Scenario("two replicas of each, kill -9 at random moments", random_kills, replicas=2),
]
#: A three-node RabbitMQ cluster losing a node under traffic (issue 22).
NODE_LOSS = Scenario(
    "RabbitMQ cluster: a node killed, stopped or cut every 20-40 s",
    broker_node_losses,
    on_cluster=True,
    min_seconds=240,
)
NODE_KILLED_ONCE = Scenario("RabbitMQ cluster: one node killed", one_broker_node_killed, on_cluster=True)
#: Postgres away for two minutes under traffic (issue 40): the platforms wait as long as
#: their documents say (Telegram about 60 s, Avito 2 s, a generic sender 30 s here) and send
#: again what did not get a 2xx; a Prometheus with the project's rules watches.
POSTGRES_STOPPED = Scenario(
    "Postgres stopped for 2 minutes",
    postgres_stopped,
    private_postgres=True,
    min_seconds=170,
    client_timeouts={"telegram": 60.0, "avito": 2.0, "generic": 30.0},
    alerts=("ChatqueuePostgresUnreachable",),
)
FULL = [
    *SHORT,
    NODE_LOSS,
    Scenario("retry tiers unreachable while the platform fails", retry_tiers_cut),
    Scenario("responder crashes past the delivery limit", responder_crash_loop, person=retry_failed),
    Scenario("RabbitMQ stopped and started", broker_restart),
    Scenario("Postgres restarted", postgres_restart, private_postgres=True),
    POSTGRES_STOPPED,
    *REPLICAS,
]


# ---- load ----------------------------------------------------------------------------


def make_events(messages: int, chats: int, duration: float, rng: random.Random) -> list[list[Event]]:
    """Each chat's messages, in bursts of 1-4 typed 0.1-0.4 s apart, the bursts spread over
    ``duration`` seconds so the load runs while the faults do. Message ids grow with time
    within a chat, as the platforms' do."""
    counts = [0] * chats
    for _ in range(messages):
        counts[rng.randrange(chats)] += 1
    out: list[list[Event]] = []
    next_id = 1
    for c, count in enumerate(counts):
        if not count:
            continue
        times: list[float] = []
        while len(times) < count:
            start = rng.uniform(0, duration)
            for i in range(min(rng.randint(1, 4), count - len(times))):
                times.append(start + i * rng.uniform(0.1, 0.4))
        platform = PLATFORMS[c % len(PLATFORMS)]
        events = []
        for t in sorted(times):
            events.append(
                Event(platform, f"{7000 + c}", str(next_id), f"message {next_id}: is it available?", at=t)
            )
            next_id += 1
        out.append(events)
    return out


async def deliver(
    client: httpx.AsyncClient,
    event: Event,
    deadline: float,
    wait: float = 5.0,
    *,
    telegram_secret: str = TG_SECRET,
) -> None:
    """Post until a 2xx, as the platforms retry (each waiting ``wait`` seconds for an
    answer); give up at the deadline. A generic sender signs each attempt anew."""
    while time.monotonic() < deadline:
        event.deliveries += 1
        try:
            if event.platform == "telegram":
                r = await client.post(
                    "/v1/webhooks/telegram",
                    json=telegram_update(int(event.message_id), chat_id=int(event.chat), text=event.text),
                    headers={"X-Telegram-Bot-Api-Secret-Token": telegram_secret},
                    timeout=wait,
                )
            elif event.platform == "avito":
                r = await client.post(
                    f"/v1/webhooks/avito/{AVITO_SECRET}",
                    json=avito_webhook(event.message_id, chat_id=event.chat, text=event.text),
                    timeout=wait,
                )
            else:
                body = dumps(generic_message(event.message_id, chat_id=event.chat, text=event.text))
                r = await client.post(
                    "/v1/webhooks/generic",
                    content=body,
                    headers=signed(GENERIC_SECRET, body, webhook_id=f"wh-{event.message_id}"),
                    timeout=wait,
                )
            if r.is_success:
                event.acked = True
                return
        except httpx.HTTPError:
            pass
        await asyncio.sleep(0.3)


async def drive(
    urls: list[str],
    bursts: list[list[Event]],
    rng: random.Random,
    *,
    duplicates: float = 0.1,
    timeouts: Mapping[str, float] | None = None,
) -> None:
    """Deliver every event; each delivery (a duplicate too) goes to a receiver at random,
    waiting as long as its platform waits (``timeouts``, 5 s by default)."""
    started = time.monotonic()
    deadline = started + max(e.at for b in bursts for e in b) + 90
    async with contextlib.AsyncExitStack() as stack:
        clients = [
            await stack.enter_async_context(
                httpx.AsyncClient(base_url=url, timeout=5, limits=httpx.Limits(max_connections=64))
            )
            for url in urls
        ]

        async def chat(burst: list[Event]) -> None:
            for event in burst:
                wait = (timeouts or {}).get(event.platform, 5.0)
                await asyncio.sleep(max(0.0, started + event.at - time.monotonic()))
                await deliver(rng.choice(clients), event, deadline, wait)
                if rng.random() < duplicates:
                    await deliver(rng.choice(clients), event, deadline, wait)  # a duplicate delivery

        await asyncio.gather(*(chat(b) for b in bursts))


# ---- verdict -------------------------------------------------------------------------


@dataclass
class Verdict:
    scenario: str
    attempted: int
    deliveries: int
    acknowledged: int
    stored: int
    replied: int
    failed: int
    needs_review: int
    ignored: int
    lost: int
    duplicated: int
    out_of_order: int
    restarts: int
    person: dict[str, int]
    reasons: dict[str, int]
    lost_reasons: dict[str, int]
    seconds: float
    #: On a RabbitMQ cluster: each node loss and its recovery times, and what the work
    #: queues held (ready + unacknowledged) once the load had drained.
    node_losses: list[dict[str, object]] = field(default_factory=list)
    unsettled: dict[str, int] = field(default_factory=dict)
    #: The alerts the scenario expects, as a Prometheus watching the services saw them, and
    #: those it never saw firing.
    alerts: dict[str, str] = field(default_factory=dict)
    alerts_missing: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return (
            self.lost == 0
            and self.duplicated == 0
            and self.out_of_order == 0
            and not any(self.unsettled.values())
            and all(loss.get("reconnected_after") is not None for loss in self.node_losses)
            and not self.alerts_missing
        )


def delivered_replies(world: FakeWorld) -> set[tuple[str, str]]:
    """(chat, platform message id) of every reply the fake platforms took."""
    out = {(str(m["chat_id"]), str(m["message_id"])) for m in world.telegram}
    out |= {(str(m["chat_id"]), str(m["id"])) for m in world.avito}
    out |= {(str(m["chat_id"]), str(m["message_id"])) for m in world.generic}
    return out


async def verdict(
    name: str,
    pool: asyncpg.Pool,
    world: FakeWorld,
    bursts: list[list[Event]],
    restarts: int,
    seconds: float,
    person: Counter[str] | None = None,
) -> Verdict:
    """The honest accounting (design invariant I7). Every event the driver sent is a buyer
    message. One the platform acknowledged counts as **lost** unless a reply covering it
    (its sent job, found in the platform's own record) reached the platform, a person
    resolved it as replied manually, or it is failed or needs_review with an owner and a
    reason. An ``ignored`` buyer message is lost."""
    events = [e for b in bursts for e in b]
    rows = await pool.fetch(
        """
        SELECT o.platform, o.chat_id, o.message_id, o.status, o.status_reason, o.owner, o.resolution,
               j.status AS job_status, j.platform_message_id
        FROM operations o
        LEFT JOIN reply_coverage c ON c.operation_id = o.id
        LEFT JOIN reply_jobs j ON j.id = c.job_id
        """
    )
    ops = {(r["platform"], r["chat_id"], r["message_id"]): r for r in rows}
    delivered = delivered_replies(world)
    status: Counter[str] = Counter()
    reasons: Counter[str] = Counter()
    lost_reasons: Counter[str] = Counter()
    stored = 0
    for e in events:
        op = ops.get((e.platform, e.chat, e.message_id))
        if op is not None:
            stored += 1
            status[op["status"]] += 1
            if op["status"] in ("failed", "needs_review"):
                reasons[(op["status_reason"] or "")[:70]] += 1
        if not e.acked:
            continue
        why = _lost(op, e.chat, delivered)
        if why:
            lost_reasons[why] += 1
    # Duplicates: a message in two sent jobs, or more platform messages in a chat than
    # jobs that may have sent one (sent, or needs_review whose send may have happened).
    doubled = await pool.fetchval(
        "SELECT count(*) FROM (SELECT op FROM reply_jobs, unnest(operation_ids) op WHERE status = 'sent' GROUP BY op HAVING count(*) > 1) d"
    )
    may_have_sent = defaultdict(int)
    for r in await pool.fetch(
        "SELECT chat_id, count(*) AS n FROM reply_jobs WHERE status IN ('sent', 'needs_review') GROUP BY chat_id"
    ):
        may_have_sent[r["chat_id"]] = r["n"]
    extra = 0
    for chat in {e.chat for e in events}:
        extra += max(0, len(world.replies_to(chat)) - may_have_sent[chat])
    # Order: within a chat, each sent reply covers only messages after the previous one's
    # in platform order (chatq_order); a message a person retried is answered when the
    # person decided, and is left out.
    late = await pool.fetch(
        """
        WITH jobs AS (
            SELECT j.chat_key, j.sent_at,
                   (array_agg(chatq_order(o.platform, o.sent_at, o.message_id, o.received_at)
                              ORDER BY chatq_order(o.platform, o.sent_at, o.message_id, o.received_at)))[1] AS lo,
                   (array_agg(chatq_order(o.platform, o.sent_at, o.message_id, o.received_at)
                              ORDER BY chatq_order(o.platform, o.sent_at, o.message_id, o.received_at) DESC))[1] AS hi
            FROM reply_jobs j JOIN operations o ON o.id = ANY(j.operation_ids)
            WHERE j.status = 'sent' AND o.retries = 0
            GROUP BY j.id, j.chat_key, j.sent_at
        ), seq AS (
            SELECT jobs.*, lag(hi) OVER (PARTITION BY chat_key ORDER BY sent_at) AS prev_hi FROM jobs
        )
        SELECT chat_key, sent_at, lo::text, prev_hi::text FROM seq WHERE prev_hi IS NOT NULL AND lo <= prev_hi
        """
    )
    for r in late:
        print(
            f"  out of order in {r['chat_key']}: the reply at {r['sent_at']} covers {r['lo']}, not after {r['prev_hi']}"
        )
    out_of_order = len(late)
    return Verdict(
        scenario=name,
        attempted=len(events),
        deliveries=sum(e.deliveries for e in events),
        acknowledged=sum(e.acked for e in events),
        stored=stored,
        replied=status["replied"],
        failed=status["failed"],
        needs_review=status["needs_review"],
        ignored=status["ignored"],
        lost=sum(lost_reasons.values()),
        duplicated=int(doubled) + extra,
        out_of_order=out_of_order,
        restarts=restarts,
        person=dict(person or {}),
        reasons=dict(reasons.most_common(5)),
        lost_reasons=dict(lost_reasons.most_common(5)),
        seconds=round(seconds, 1),
    )


def _lost(op: asyncpg.Record | None, chat: str, delivered: set[tuple[str, str]]) -> str | None:
    """Why an acknowledged buyer message counts as lost, or None when it does not."""
    if op is None:
        return "acknowledged but not stored"
    if op["status"] == "replied":
        if op["resolution"] == "replied_manually":
            return None
        if op["job_status"] == "sent" and (chat, str(op["platform_message_id"])) in delivered:
            return None
        return "replied, but no covering reply reached the platform"
    if op["status"] in ("failed", "needs_review"):
        return None if op["owner"] and op["status_reason"] else f"{op['status']} without an owner or a reason"
    if op["status"] == "ignored":
        return f"ignored: {(op['status_reason'] or '')[:60]}"
    return f"still {op['status']}"


async def drain(pool: asyncpg.Pool, *, quiet_for: float = 15.0, within: float = 120.0) -> None:
    """Wait until every stored message is final, or nothing moved for ``quiet_for``."""
    deadline = time.monotonic() + within
    last, last_change = None, time.monotonic()
    while time.monotonic() < deadline:
        state = await pool.fetchval(
            "SELECT count(*) FILTER (WHERE status NOT IN ('replied','failed','needs_review','ignored')) || '/' || count(*) FROM operations"
        )
        if state.startswith("0/"):
            return
        if state != last:
            last, last_change = state, time.monotonic()
        elif time.monotonic() - last_change > quiet_for:
            return
        await asyncio.sleep(0.5)


# ---- one scenario --------------------------------------------------------------------


def _with_port(url: str, port: int) -> str:
    p = urlsplit(url)
    auth = f"{p.username}:{p.password}@" if p.username else ""
    return urlunsplit((p.scheme, f"{auth}127.0.0.1:{port}", p.path, "", ""))


@contextlib.asynccontextmanager
async def _broker(
    scenario: Scenario, infra: Infra
) -> AsyncIterator[tuple[str, TcpProxy, node_loss.RabbitCluster | None]]:
    """CHATQ_AMQP_URL for the services, the fault proxy in front of the broker and, on a
    cluster, the cluster: a vhost of its own on the machine's RabbitMQ, or a fresh local
    three-node cluster (a proxy in front of each node; the first node's is yielded)."""
    if scenario.on_cluster:
        async with node_loss.rabbit_cluster() as rabbit:
            yield rabbit.amqp_url, next(iter(rabbit.proxies.values())), rabbit
        return
    async with private_vhost(infra.amqp_url, infra.rabbitmq_api_url) as amqp_url:
        target = urlsplit(amqp_url)
        proxy = await TcpProxy(target.hostname or "127.0.0.1", target.port or 5672).start()
        try:
            yield _with_port(amqp_url, proxy.port), proxy, None
        finally:
            await proxy.close()


@contextlib.asynccontextmanager
async def _postgres(scenario: Scenario, infra: Infra) -> AsyncIterator[tuple[str, PrivatePostgres | None]]:
    """The admin URL the scenario's database is made on: the machine's Postgres, or one of
    the scenario's own that its faults may stop (removed afterwards)."""
    if not scenario.private_postgres:
        yield infra.admin_database_url, None
        return
    pg = await asyncio.to_thread(PrivatePostgres(free_port()).create)
    try:
        yield pg.admin_url, pg
    finally:
        await asyncio.to_thread(pg.remove)


def _targets(cluster: Cluster) -> dict[str, list[str]]:
    """Each service's /metrics, by the job names deploy/prometheus/prometheus.yml uses."""
    jobs = {"chatqueue-receiver": [f"127.0.0.1:{port}" for port in cluster.receiver_ports]}
    for service in ("coalescer", "responder"):
        jobs[f"chatqueue-{service}"] = [
            f"127.0.0.1:{cluster.procs[name].port}"  # type: ignore[attr-defined]
            for name in cluster.names(service)
        ]
    return jobs


async def _alerts_seen(
    watch: AlertWatch, cluster: Cluster, expected: tuple[str, ...]
) -> tuple[dict[str, str], list[str]]:
    """When each expected alert fired (seconds after Postgres stopped) and when it was last
    seen firing (after Postgres started again), by job; and those never seen. Waits up to
    90 s for them to resolve once Postgres is back."""
    async with httpx.AsyncClient(timeout=5) as client:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            await watch.poll(client)
            if not any(a in expected for a, _ in watch.last_firing) or all(
                watch.last_firing[k] < time.monotonic() - 5 for k in watch.last_firing if k[0] in expected
            ):
                break
            await asyncio.sleep(2)
    stopped = cluster.postgres_stopped_at or 0.0
    started = cluster.postgres_started_at or stopped
    seen: dict[str, str] = {}
    for alert in expected:
        jobs = sorted(j for a, j in watch.first_firing if a == alert)
        if jobs:
            seen[alert] = "; ".join(
                f"{job}: fired +{watch.first_firing[(alert, job)] - stopped:.0f} s after the stop, "
                f"last seen firing {watch.last_firing[(alert, job)] - started:+.0f} s from the start"
                for job in jobs
            )
    return seen, [a for a in expected if a not in seen]


async def run_scenario(
    scenario: Scenario, infra: Infra, *, messages: int, chats: int, duration: float, seed: int = 1
) -> Verdict:
    rng = random.Random(seed)
    duration = max(duration, scenario.min_seconds)
    async with _postgres(scenario, infra) as (admin_database_url, private):
        name, db_url = await fresh_database(admin_database_url)
        try:
            return await _run(scenario, infra, db_url, private, rng, messages, chats, duration)
        finally:
            with contextlib.suppress(Exception):
                await drop_database(admin_database_url, name)


async def _run(
    scenario: Scenario,
    infra: Infra,
    db_url: str,
    private: PrivatePostgres | None,
    rng: random.Random,
    messages: int,
    chats: int,
    duration: float,
) -> Verdict:
    async with (
        _broker(scenario, infra) as (amqp_url, proxy, rabbit),
        running_fakes() as world,
        contextlib.AsyncExitStack() as stack,
    ):
        started = time.monotonic()  # the cluster's boot is not the scenario's time
        settings = Settings(
            database_url=db_url,
            amqp_url=amqp_url,
            telegram_webhook_secret=TG_SECRET,
            telegram_bot_token="4242:chaos",
            telegram_api_base=world.url,
            avito_webhook_secret=AVITO_SECRET,
            avito_client_id="chaos",
            avito_client_secret="chaos-secret",
            avito_api_base=world.url,
            # The campaign's traffic is far above a real account's; Avito's per-minute
            # budget is tested by its own tests, not here.
            avito_requests_per_minute=100_000,
            generic_webhook_secret=GENERIC_SECRET,
            generic_reply_url=f"{world.url}/generic/replies",
            llm_base_url=f"{world.url}/v1" if scenario.llm else None,
            llm_timeout_seconds=1.0,
            admin_token="chaos-admin",
            quiet_seconds=0.3,
            reply_delay_min_seconds=0.3,
            reply_delay_max_seconds=0.8,
            max_wait_seconds=2.0,
            retry_delays_seconds="0.5,1,2",
            max_attempts=8,
            platform_timeout_seconds=1.0,
            coalescer_poll_seconds=0.2,
            relay_poll_seconds=0.2,
            database_pool_size=6,
            log_level="WARNING",
        )
        cluster = Cluster(
            settings, [free_port() for _ in range(scenario.replicas)], rabbit=rabbit, postgres=private
        )
        await cluster.start_all()
        watch: AlertWatch | None = None
        watching_done = asyncio.Event()
        if scenario.alerts:
            watch = await stack.enter_async_context(watching(_targets(cluster)))
            watcher = asyncio.create_task(watch.watch(watching_done))
        # No floor of idle connections: the pool does not fight a Postgres stopped on purpose.
        pool = await asyncpg.create_pool(db_url, min_size=0, max_size=2)
        try:
            bursts = make_events(messages, chats, duration, rng)
            done = asyncio.Event()
            cluster.load_ends = time.monotonic() + duration
            faults = asyncio.create_task(scenario.faults(cluster, proxy, world, done))
            await drive(cluster.receiver_urls, bursts, rng, timeouts=scenario.client_timeouts)
            done.set()
            await faults
            proxy.unblock()
            world.random_faults = {}
            await cluster.ensure_running()
            await drain(pool)
            person: Counter[str] = Counter()
            if scenario.person is not None:
                async with httpx.AsyncClient(
                    base_url=cluster.receiver_urls[0],
                    headers={"Authorization": "Bearer chaos-admin"},
                    timeout=10,
                ) as admin:
                    person = await scenario.person(admin, pool, world)
                await drain(pool)
            result = await verdict(
                scenario.name,
                pool,
                world,
                bursts,
                sum(cluster.restarts.values()),
                time.monotonic() - started,
                person,
            )
            if rabbit is not None:
                await node_loss.first_replies(pool, rabbit.losses)
                result.node_losses = [asdict(loss) for loss in rabbit.losses]
                result.unsettled = await rabbit.unsettled()
            if watch is not None:
                watching_done.set()
                await watcher
                result.alerts, result.alerts_missing = await _alerts_seen(watch, cluster, scenario.alerts)
            return result
        finally:
            watching_done.set()
            await pool.close()
            await cluster.stop_all()


def table(verdicts: list[Verdict]) -> str:
    headers = (
        "scenario",
        "attempted",
        "deliveries",
        "acked 2xx",
        "stored",
        "replied",
        "failed",
        "needs review",
        "ignored",
        "lost",
        "duplicated",
        "out of order",
        "restarts",
        "person",
        "s",
        "verdict",
    )
    rows = [
        (
            v.scenario,
            v.attempted,
            v.deliveries,
            v.acknowledged,
            v.stored,
            v.replied,
            v.failed,
            v.needs_review,
            v.ignored,
            v.lost,
            v.duplicated,
            v.out_of_order,
            v.restarts,
            ", ".join(f"{n} {k}" for k, n in sorted(v.person.items())) or "-",
            v.seconds,
            "pass" if v.ok else "FAIL",
        )
        for v in verdicts
    ]
    cells = [[str(c) for c in headers], *[[str(c) for c in r] for r in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    for v in verdicts:
        if v.node_losses or v.unsettled:
            lines.append(f"  {v.scenario}:")
            losses = [node_loss.Loss(**x) for x in v.node_losses]  # type: ignore[arg-type]
            lines += node_loss.report(losses, v.unsettled)
        if v.reasons:
            lines.append(f"  {v.scenario}: " + "; ".join(f"{n}× {r}" for r, n in v.reasons.items()))
        for alert, seen in v.alerts.items():
            lines.append(f"  {v.scenario}, alert {alert}: {seen}")
        for alert in v.alerts_missing:
            lines.append(f"  {v.scenario}, ALERT NEVER SEEN FIRING: {alert}")
        if v.lost_reasons:
            lines.append(
                f"  {v.scenario}, LOST: " + "; ".join(f"{n}× {r}" for r, n in v.lost_reasons.items())
            )
    return "\n".join(lines)
