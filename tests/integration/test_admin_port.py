"""CHATQ_ADMIN_PORT: the webhooks and health checks on HTTP_PORT (what a deploy exposes),
everything a person or Prometheus uses on the admin port, over one runtime."""

from __future__ import annotations

import asyncio

import pytest

from services.receiver.app import create_app
from tests.conftest import ADMIN_TOKEN, TELEGRAM_SECRET, replace
from tests.support.payloads import telegram_update
from tests.support.receiver import client_of, running_receiver

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("clean")]

TG = {"X-Telegram-Bot-Api-Secret-Token": TELEGRAM_SECRET}
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
ADMIN_ONLY = [
    ("GET", "/v1/operations"),
    ("GET", "/v1/operations/00000000-0000-0000-0000-000000000000"),
    ("POST", "/v1/operations/00000000-0000-0000-0000-000000000000/retry"),
    ("POST", "/v1/operations/00000000-0000-0000-0000-000000000000/resolve"),
    ("GET", "/v1/stats"),
    ("GET", "/metrics"),
    ("GET", "/metrics/"),
    ("GET", "/ops"),
    ("GET", "/static/ops.js"),
    ("GET", "/sandbox"),
    ("POST", "/v1/sandbox/messages"),
    ("GET", "/v1/sandbox/chats/s1/messages"),
    ("GET", "/openapi.json"),
    ("GET", "/docs"),
    ("GET", "/v1/accounts"),
    ("POST", "/v1/accounts"),
    ("GET", "/v1/accounts/telegram/1"),
    ("DELETE", "/v1/accounts/telegram/1"),
    ("POST", "/v1/accounts/rotate-key"),
]


@pytest.fixture
def split(settings):
    return replace(settings, admin_port=18081)


@pytest.mark.parametrize(("method", "path"), ADMIN_ONLY, ids=[f"{m} {p}" for m, p in ADMIN_ONLY])
async def test_the_public_port_answers_admin_paths_with_the_json_404_of_an_unknown_path(
    split, method: str, path: str
) -> None:
    async with running_receiver(split) as (_, public):
        r = await public.request(method, path, headers=ADMIN, json={})
    assert r.status_code == 404
    assert r.headers["content-type"].startswith("application/json")
    assert r.json() == {"error": {"code": "not_found", "message": "Not Found"}}


async def test_the_public_port_takes_webhooks_and_answers_health_checks(split, pool) -> None:
    async with running_receiver(split) as (_, public):
        r = await public.post("/v1/webhooks/telegram", json=telegram_update(1), headers=TG)
        assert r.status_code == 200 and r.json()["status"] == "accepted"
        assert (await public.get("/healthz")).json() == {"status": "ok"}
        assert (await public.get("/readyz")).status_code == 200
    assert await pool.fetchval("SELECT count(*) FROM operations") == 1


async def test_the_admin_port_serves_the_admin_api_pages_metrics_and_health_over_the_same_runtime(
    split,
) -> None:
    async with running_receiver(split) as (receiver, public):
        assert receiver.admin is not None
        async with client_of(receiver.admin, "localhost") as admin:
            op = (await public.post("/v1/webhooks/telegram", json=telegram_update(2), headers=TG)).json()
            doc = (await admin.get(f"/v1/operations/{op['operation_id']}", headers=ADMIN)).json()
            assert doc["id"] == op["operation_id"]
            assert (await admin.get("/v1/stats")).status_code == 401
            assert (await admin.get("/v1/stats", headers=ADMIN)).json()["last_24h"]["received"] == 1
            metrics = (await admin.get("/metrics/")).text
            assert 'chatq_webhooks_total{outcome="accepted",platform="telegram"}' in metrics
            ops = await admin.get("/ops")
            assert (
                ops.status_code == 200 and "frame-ancestors 'none'" in ops.headers["content-security-policy"]
            )
            assert (await admin.get("/static/ops.js")).status_code == 200
            assert (await admin.get("/sandbox")).status_code == 200
            sent = await admin.post("/v1/sandbox/messages", json={"chat_id": "s1", "text": "Hi"})
            assert sent.status_code == 202
            assert (await admin.get("/healthz")).json() == {"status": "ok"}
            assert (await admin.get("/readyz")).status_code == 200
            paths = set((await admin.get("/openapi.json")).json()["paths"])
            assert "/v1/stats" in paths and not any(p.startswith("/v1/webhooks") for p in paths)
            webhook = await admin.post("/v1/webhooks/telegram", json=telegram_update(3), headers=TG)
            assert webhook.status_code == 404


async def test_the_two_apps_share_one_runtime_started_once(split) -> None:
    async with running_receiver(split) as (receiver, _):
        assert receiver.admin is not None
        assert receiver.admin.state.runtime is receiver.public.state.runtime
        assert receiver.admin.state.pool is receiver.public.state.pool
        relays = [t for t in asyncio.all_tasks() if t.get_name() == "outbox-relay" and not t.done()]
        assert len(relays) == 1
        assert [port for _, port in receiver.listeners] == [split.http_port, 18081]


async def test_without_an_admin_port_one_app_serves_everything(settings) -> None:
    async with running_receiver(settings, host="localhost") as (receiver, client):
        assert receiver.admin is None
        assert [port for _, port in receiver.listeners] == [settings.http_port]
        r = await client.post("/v1/webhooks/telegram", json=telegram_update(4), headers=TG)
        assert r.status_code == 200
        assert (await client.get("/v1/stats", headers=ADMIN)).status_code == 200
        assert (await client.get("/ops")).status_code == 200
        assert "chatq_webhooks_total" in (await client.get("/metrics/")).text


async def test_metrics_answer_at_slash_metrics_without_a_redirect(settings) -> None:
    async with running_receiver(settings) as (_, client):
        r = await client.get("/metrics", follow_redirects=False)
        assert r.status_code == 200, r.status_code
        assert r.headers["content-type"].startswith("text/plain")
        assert "chatq_webhooks_total" in r.text


@pytest.fixture
def production(settings):
    """The test settings under CHATQ_ENV=production (the broker's guest account replaced:
    nothing here connects)."""
    return replace(
        settings, env="production", amqp_url="amqp://chatq:Hs8dJ3kq0PzX5nVb@127.0.0.1:1/", relay_enabled=False
    )


@pytest.mark.parametrize(("method", "path"), ADMIN_ONLY, ids=[f"{m} {p}" for m, p in ADMIN_ONLY])
async def test_in_production_without_an_admin_port_the_one_port_serves_none_of_the_admin_surface(
    production, method: str, path: str
) -> None:
    """The receiver refuses to start so (``run``: Settings.receiver_problem); an app built
    anyway still answers every admin path with the 404 of an unknown path, the admin
    token notwithstanding."""
    receiver = create_app(production)
    assert receiver.admin is None and production.receiver_problem() is not None
    async with client_of(receiver.public, "localhost") as public:
        r = await public.request(method, path, headers=ADMIN, json={})
    assert r.status_code == 404
    assert r.json() == {"error": {"code": "not_found", "message": "Not Found"}}


async def test_in_production_the_admin_port_has_no_sandbox(production) -> None:
    receiver = create_app(replace(production, admin_port=18081))
    assert receiver.admin is not None
    async with client_of(receiver.admin, "localhost") as admin:
        assert (await admin.get("/sandbox")).json()["error"]["code"] == "sandbox_disabled"
        sent = await admin.post("/v1/sandbox/messages", json={"chat_id": "s1", "text": "Hi"})
        assert sent.status_code == 404 and sent.json()["error"]["code"] == "sandbox_disabled"
