"""The webhooks are served without FastAPI's router and middleware
(services/receiver/direct.py). Each request below goes once through that direct path and
once through FastAPI's own stack, on the same app: the answers, the metrics and the log
lines must be the same, byte for byte."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Annotated, Any

import pytest
from fastapi import APIRouter, Depends, FastAPI, Header, HTTPException, Path, Request
from fastapi.responses import JSONResponse
from prometheus_client import REGISTRY

from platforms.inbound import Intake
from services.receiver.app import create_app
from services.receiver.direct import ReceiverApp
from services.receiver.intake import Stored
from services.receiver.limits import BodySizeLimit
from shared.settings import Settings
from stores.accounts.registry import Account, path_key
from tests.conftest import AVITO_SECRET, GENERIC_SECRET, TELEGRAM_SECRET
from tests.support.payloads import avito_webhook, dumps, generic_message, signed, telegram_update

pytestmark = pytest.mark.unit

CAP = 2048
BOT = "4242"
JSON = {"content-type": "application/json"}
TG = {**JSON, "x-telegram-bot-api-secret-token": TELEGRAM_SECRET}
OWN_SECRET = "whsec_" + "b3duLXNlY3JldC1vZi1zaG9wLTItMDEyMzQ1Njc4OQ=="


def account(platform: str, account_id: str, *, removed: bool = False, **credentials: str) -> Account:
    source = "admin" if credentials else "environment"
    return Account(platform, account_id, None, "active", None, source, removed, {}, credentials)


ACCOUNTS = [
    account("telegram", "777", bot_token="777:t", webhook_secret="bot-777-secret"),
    account("telegram", "555", removed=True, bot_token="555:t", webhook_secret="gone"),
    account("avito", "888", client_id="c", client_secret="s", webhook_secret="shop-888-path"),
    account("generic", "shop-2", webhook_secret=OWN_SECRET),
    account("generic", "closed", removed=True),
]


class FakeAccounts:
    """The reading side of stores.accounts.registry.AccountRegistry."""

    def __init__(self, accounts: list[Account]) -> None:
        self._accounts = {(a.platform, a.account_id): a for a in accounts}

    def get(self, platform: str, account_id: str) -> Account | None:
        return self._accounts.get((platform, account_id))

    def by_path_secret(self, platform: str, secret: str) -> Account | None:
        for a in self._accounts.values():
            secret_of = a.credentials.get("webhook_secret")
            if a.platform == platform and a.owns_credentials and secret_of:
                if path_key(secret_of) == path_key(secret):
                    return a
        return None


class FakeIntake:
    """IntakeBatcher's ``store``: an operation id that depends only on what is stored, so
    both paths get the same one; ``failing`` makes every store raise."""

    def __init__(self) -> None:
        self.failing = False

    async def store(
        self, intake: Intake, *, hold_seconds: float = 0, review_owner: str = "on-call"
    ) -> Stored:
        if self.failing:
            raise ConnectionResetError("the database went away")
        key = f"{intake.platform}/{intake.account_id}/{intake.event_id}/{intake.message_id}"
        return Stored(uuid.uuid5(uuid.NAMESPACE_URL, key), intake.status, duplicate=False)


class FakePool:
    async def execute(self, *args: Any) -> str:
        return "INSERT 0 1"


@dataclass
class Answer:
    messages: list[dict[str, Any]]
    raised: str | None
    metrics: dict[str, float]
    logs: list[tuple[str, int, str]] = field(default_factory=list)


def receiver_app(**settings: Any) -> tuple[ReceiverApp, FakeIntake]:
    # A failing store is tried again for the whole hold (50 s in production): 0.5 s here.
    settings.setdefault("webhook_hold_seconds", 0.5)
    app = create_app(
        Settings(
            telegram_webhook_secret=TELEGRAM_SECRET,
            telegram_bot_token=f"{BOT}:token",
            avito_webhook_secret=AVITO_SECRET,
            generic_webhook_secret=GENERIC_SECRET,
            max_body_bytes=CAP,
            **settings,
        )
    ).public
    assert isinstance(app, ReceiverApp)
    intake = FakeIntake()
    app.state.runtime = SimpleNamespace(
        accounts=FakeAccounts(ACCOUNTS), intake=intake, relay=None, pool=FakePool(), alerter=None
    )
    app.state.pool = FakePool()
    return app, intake


def webhook_samples() -> dict[str, float]:
    return {
        f"{s.name}{sorted(s.labels.items())}": s.value
        for metric in REGISTRY.collect()
        if metric.name in ("chatq_webhooks", "chatq_webhook_seconds")
        for s in metric.samples
        if not s.name.endswith(("_sum", "_created", "_bucket"))
    }


async def answer(
    call: Callable[[Any, Any, Any], Awaitable[None]],
    method: str,
    path: str,
    headers: dict[str, str],
    chunks: list[bytes],
    caplog: pytest.LogCaptureFixture,
) -> Answer:
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.4"},
        "http_version": "1.1",
        "server": ("127.0.0.1", 8080),
        "client": ("127.0.0.1", 50000),
        "scheme": "http",
        "method": method,
        "root_path": "",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "headers": [(b"host", b"receiver"), *((k.lower().encode(), v.encode()) for k, v in headers.items())],
        "state": {},
    }
    pending = [
        {"type": "http.request", "body": chunk, "more_body": i < len(chunks) - 1}
        for i, chunk in enumerate(chunks)
    ]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return pending.pop(0) if pending else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    before = webhook_samples()
    caplog.clear()
    raised = None
    try:
        await call(scope, receive, send)
    except Exception as exc:
        raised = f"{type(exc).__name__}: {exc}"
    after = webhook_samples()
    moved = {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}
    logs = [(r.name, r.levelno, r.getMessage()) for r in caplog.records if r.name.startswith("services")]
    return Answer(sent, raised, moved, logs)


@dataclass(frozen=True)
class Case:
    name: str
    path: str
    request: Callable[[], tuple[dict[str, str], list[bytes]]]
    method: str = "POST"
    failing_store: bool = False


def one(body: bytes | Callable[[], bytes], headers: dict[str, str], *, length: bool = True) -> Any:
    """A request of one body; with a Content-Length unless ``length`` is False."""

    def build() -> tuple[dict[str, str], list[bytes]]:
        content = body() if callable(body) else body
        return ({**headers, "content-length": str(len(content))} if length else headers), [content]

    return build


def generic(data: dict[str, Any], *, secret: str = GENERIC_SECRET, **over: str) -> Any:
    def build() -> tuple[dict[str, str], list[bytes]]:
        content = dumps(data)
        headers = {**signed(secret, content, webhook_id="msg_1", timestamp=time.time()), **over}
        return {**headers, "content-length": str(len(content))}, [content]

    return build


def telegram(update_id: int = 1) -> bytes:
    return dumps(telegram_update(update_id))


def avito(user_id: int = 777) -> bytes:
    return dumps(avito_webhook("m-1", user_id=user_id))


CASES = [
    Case("a telegram update", "/v1/webhooks/telegram", one(telegram, TG)),
    Case("a telegram update that is not a message", "/v1/webhooks/telegram", one(b'{"update_id": 9}', TG)),
    Case("telegram without the secret", "/v1/webhooks/telegram", one(telegram, JSON)),
    Case(
        "telegram with a wrong secret",
        "/v1/webhooks/telegram",
        one(telegram, {**TG, "x-telegram-bot-api-secret-token": "no"}),
    ),
    Case(
        "telegram as text/plain", "/v1/webhooks/telegram", one(telegram, {**TG, "content-type": "text/plain"})
    ),
    Case(
        "telegram without a content type", "/v1/webhooks/telegram", one(telegram, TG | {"content-type": ""})
    ),
    Case("malformed JSON", "/v1/webhooks/telegram", one(b'{"update_id": 1,', TG)),
    Case("invalid UTF-8", "/v1/webhooks/telegram", one(b'{"x": "\xff"}', TG)),
    Case("JSON of the wrong shape", "/v1/webhooks/telegram", one(b"[1, 2]", TG)),
    Case("a declared length over the cap", "/v1/webhooks/telegram", one(b"x" * (CAP + 1), TG)),
    Case(
        "a length that is not a number",
        "/v1/webhooks/telegram",
        lambda: ({**TG, "content-length": "many"}, [telegram()]),
    ),
    Case(
        "a body streaming past the cap",
        "/v1/webhooks/telegram",
        lambda: ({**TG, "transfer-encoding": "chunked"}, [b"x" * 1500, b"x" * 1500, b"x"]),
    ),
    Case(
        "a body in chunks under the cap",
        "/v1/webhooks/telegram",
        lambda: ({**TG, "transfer-encoding": "chunked"}, [telegram()[:20], telegram()[20:]]),
    ),
    Case("the environment's bot on its own path", f"/v1/webhooks/telegram/{BOT}", one(telegram, TG)),
    Case(
        "a bot with its own secret",
        "/v1/webhooks/telegram/777",
        one(telegram, {**JSON, "x-telegram-bot-api-secret-token": "bot-777-secret"}),
    ),
    Case("a bot with its own secret, given another", "/v1/webhooks/telegram/777", one(telegram, TG)),
    Case("a removed bot", "/v1/webhooks/telegram/555", one(telegram, TG)),
    Case("an unknown bot", "/v1/webhooks/telegram/31337", one(telegram, TG)),
    Case("a bot id with a slash in it", "/v1/webhooks/telegram/1/2", one(telegram, TG)),
    Case("an Avito message", f"/v1/webhooks/avito/{AVITO_SECRET}", one(avito, JSON)),
    Case("an Avito subscription check", f"/v1/webhooks/avito/{AVITO_SECRET}", one(b"{}", {})),
    Case("Avito with a wrong path secret", "/v1/webhooks/avito/guess", one(avito, JSON)),
    Case(
        "Avito for an account with its own path", f"/v1/webhooks/avito/{AVITO_SECRET}", one(avito(888), JSON)
    ),
    Case("an account's own Avito path", "/v1/webhooks/avito/shop-888-path", one(avito(888), JSON)),
    Case("another account on an Avito path", "/v1/webhooks/avito/shop-888-path", one(avito, JSON)),
    Case("Avito without a path secret", "/v1/webhooks/avito/", one(avito, JSON)),
    Case("a generic message", "/v1/webhooks/generic", generic(generic_message("g-1"))),
    Case("a generic message unsigned", "/v1/webhooks/generic", one(dumps(generic_message("g-1")), JSON)),
    Case(
        "a generic message as text/plain",
        "/v1/webhooks/generic",
        generic(generic_message("g-1"), **{"content-type": "text/plain"}),
    ),
    Case(
        "a generic message for an account with its own secret",
        "/v1/webhooks/generic",
        generic({**generic_message("g-2"), "account_id": "shop-2"}),
    ),
    Case(
        "a generic message for a removed account",
        "/v1/webhooks/generic",
        generic({**generic_message("g-3"), "account_id": "closed"}),
    ),
    Case(
        "a generic message on its account's path",
        "/v1/webhooks/generic/shop-2",
        generic({**generic_message("g-4"), "account_id": "shop-2"}, secret=OWN_SECRET),
    ),
    Case(
        "a generic message for another account on an account's path",
        "/v1/webhooks/generic/shop-2",
        generic(generic_message("g-5"), secret=OWN_SECRET),
    ),
    Case(
        "a generic account that is not there", "/v1/webhooks/generic/nobody", generic(generic_message("g-6"))
    ),
    Case("a GET of a webhook", "/v1/webhooks/telegram", one(b"", {}), method="GET"),
    Case("a webhook path with a trailing slash", "/v1/webhooks/telegram/", one(telegram, TG)),
    Case("a POST to an admin path", "/v1/operations", one(b"{}", JSON)),
    Case("a store that fails", "/v1/webhooks/telegram", one(telegram, TG), failing_store=True),
    Case(
        "a store that fails on Avito",
        f"/v1/webhooks/avito/{AVITO_SECRET}",
        one(avito, JSON),
        failing_store=True,
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
async def test_a_webhook_request_is_answered_directly_exactly_as_fastapi_answers_it(
    case: Case, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    app, intake = receiver_app()
    intake.failing = case.failing_store
    headers, chunks = case.request()

    async def through_fastapi(scope: Any, receive: Any, send: Any) -> None:
        await FastAPI.__call__(app, scope, receive, send)

    framework, direct, framework_again = [
        await answer(call, case.method, case.path, headers, chunks, caplog)
        for call in (through_fastapi, app, through_fastapi)
    ]
    assert direct == framework
    assert framework_again == framework
    assert framework.messages[0]["type"] == "http.response.start"


def test_every_webhook_route_is_served_directly_and_stays_in_the_openapi_document() -> None:
    app, _ = receiver_app(admin_token="t")
    direct = {r.route.path for r in app._direct_routes}
    assert direct == {
        "/v1/webhooks/telegram",
        "/v1/webhooks/telegram/{account_id}",
        "/v1/webhooks/avito/{secret}",
        "/v1/webhooks/generic",
        "/v1/webhooks/generic/{account_id}",
    }
    paths = app.openapi()["paths"]
    for path in direct:
        assert paths[path]["post"]["requestBody"]["content"]["application/json"]["schema"]


def test_a_route_that_needs_fastapi_to_parse_something_cannot_be_served_directly() -> None:
    router = APIRouter()

    @router.post("/v1/webhooks/other")
    async def other(request: Request, x_token: str = Header()) -> JSONResponse:
        return JSONResponse({})

    app = ReceiverApp()
    app.include_router(router)
    with pytest.raises(ValueError, match="nothing else"):
        app.serve_directly(router.routes)


async def test_middleware_added_after_webhooks_were_answered_is_refused_as_fastapi_refuses_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """FastAPI builds its stack on the first request and then refuses ``add_middleware``; an
    app that has answered only webhooks must refuse it too, or the new middleware would run
    on every request but the webhooks."""
    app, _ = receiver_app()
    headers, chunks = one(telegram, TG)()
    answered = await answer(app, "POST", "/v1/webhooks/telegram", headers, chunks, caplog)
    assert answered.messages[0]["status"] == 200
    with pytest.raises(RuntimeError, match="after an application has started"):
        app.add_middleware(BodySizeLimit, max_bytes=1)


def _deny() -> None:
    raise HTTPException(403, "denied")


async def _hook(x: str, request: Request) -> JSONResponse:
    return JSONResponse({"x": x})


async def _hook_limited(x: Annotated[str, Path(max_length=3)], request: Request) -> JSONResponse:
    return JSONResponse({"x": x})


async def _hook_aliased(request: Request, y: Annotated[str, Path(alias="x")]) -> JSONResponse:
    return JSONResponse({"x": y})


async def _hook_returning_data(x: str, request: Request) -> dict[str, str]:
    return {"x": x}


@dataclass(frozen=True)
class Build:
    name: str
    path: str
    endpoint: Callable[..., Any] = _hook
    template: str = "/hook/{x}"
    route: dict[str, Any] = field(default_factory=dict)
    include: dict[str, Any] | None = field(default_factory=dict)
    app: dict[str, Any] = field(default_factory=dict)
    earlier: str | None = None
    served: bool = False

    def __call__(self) -> tuple[ReceiverApp, APIRouter]:
        router = APIRouter()
        router.add_api_route(self.template, self.endpoint, methods=["POST"], **self.route)
        app = ReceiverApp(**self.app)
        if self.earlier is not None:
            first = APIRouter()

            @first.post(self.earlier)
            async def earlier() -> dict[str, bool]:
                return {"earlier": True}

            app.include_router(first)
        if self.include is not None:
            app.include_router(router, **self.include)
        return app, router


BUILDS = [
    Build("a route as it is", "/hook/abc", served=True),
    Build(
        "a route included with a prefix, asked without it", "/hook/abc", include={"prefix": "/p"}, served=True
    ),
    Build(
        "a route included with a prefix, asked with it", "/p/hook/abc", include={"prefix": "/p"}, served=True
    ),
    Build("a route included with a dependency", "/hook/abc", include={"dependencies": [Depends(_deny)]}),
    Build("a route of an app with a dependency", "/hook/abc", app={"dependencies": [Depends(_deny)]}),
    Build("a route included with a body limit", "/hook/abc", include={"max_body_size": 1}),
    Build("a route with a body limit of its own", "/hook/abc", route={"max_body_size": 1}),
    Build("a route of an app with a body limit", "/hook/abc", app={"max_body_size": 1}),
    Build("a route whose parameter has a length limit", "/hook/abcdef", endpoint=_hook_limited),
    Build("a route whose parameter has an alias", "/hook/abc", endpoint=_hook_aliased),
    Build("a route whose text parameter the path converts to a number", "/hook/12", template="/hook/{x:int}"),
    Build("a route whose endpoint returns data, not a response", "/hook/abc", endpoint=_hook_returning_data),
    Build("a route that a route included before it takes", "/hook/special", earlier="/hook/special"),
    Build("a route that a catch-all route included before it takes", "/hook/abc", earlier="/{anything:path}"),
    Build("a route this app does not include", "/hook/abc", include=None),
]


@pytest.mark.parametrize("build", BUILDS, ids=[b.name for b in BUILDS])
async def test_a_route_is_served_directly_only_where_fastapi_would_give_the_same_answer(
    build: Build, caplog: pytest.LogCaptureFixture
) -> None:
    """Either ``serve_directly`` refuses the route, or a POST to it is answered directly
    exactly as FastAPI answers it."""
    app, router = build()
    if not build.served:
        with pytest.raises(ValueError):
            app.serve_directly(router.routes)
        return
    app.serve_directly(router.routes)
    assert app._direct_routes
    headers, chunks = one(b"{}", JSON)()

    async def through_fastapi(scope: Any, receive: Any, send: Any) -> None:
        await FastAPI.__call__(app, scope, receive, send)

    framework, direct = [
        await answer(call, "POST", build.path, headers, chunks, caplog) for call in (through_fastapi, app)
    ]
    assert direct == framework
