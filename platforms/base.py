"""The interface every platform adapter implements, and the HTTP call they share."""

from __future__ import annotations

import random
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import httpx

from platforms.failures import TRANSPORT_ERRORS, Failure, Kind, classify_status, classify_transport
from platforms.ratelimit import AccountRateLimiter
from shared import metrics
from stores.jobs.protocol import Attempts


def segment(value: str) -> str:
    """A platform id as one path segment of a URL: percent-encoded whole (``/`` too), so an
    id is data and never a path (an Avito chat id ``../../x`` would otherwise reach another
    endpoint with the account's token). ``.`` and ``..`` are dot segments whatever their
    encoding (yarl, under aiohttp, decodes ``%2E`` and resolves them), and an empty id names
    nothing: no platform gives such an id, so none is sent anywhere."""
    if value in ("", ".", ".."):
        raise Failure(
            Kind.PERMANENT, f"the platform id {value!r} would name another path (or none): not sent"
        )
    return urllib.parse.quote(value, safe="")


@dataclass(frozen=True)
class Sent:
    message_id: str


@dataclass(frozen=True)
class Listing:
    """What a chat is about, as the platform describes it (Avito: the listing of a u2i
    chat), for the reply writer."""

    title: str
    price: str | None = None
    url: str | None = None

    def as_json(self) -> dict[str, str | None]:
        return {"title": self.title, "price": self.price, "url": self.url}

    @classmethod
    def from_json(cls, data: object) -> Listing | None:
        if not isinstance(data, dict) or not isinstance(data.get("title"), str) or not data["title"]:
            return None
        price, url = data.get("price"), data.get("url")
        return cls(
            data["title"], price if isinstance(price, str) else None, url if isinstance(url, str) else None
        )


@runtime_checkable
class ChatManners(Protocol):
    """What a platform offers beyond sending (Avito): the chat's listing, and marking a
    chat read once it is answered."""

    async def listing(self, account_id: str, chat_id: str) -> Listing | None: ...

    async def mark_read(self, account_id: str, chat_id: str) -> None: ...


_MANNERED: dict[type, bool] = {}


def chat_manners(platform: object) -> ChatManners | None:
    """``platform`` as a ChatManners, or None. Decided once per adapter class: a runtime
    protocol's isinstance looks up every member each time (twice a job, 5% of the
    responder's CPU in a py-spy profile under bench.pipeline)."""
    kind = type(platform)
    mannered = _MANNERED.get(kind)
    if mannered is None:
        mannered = _MANNERED[kind] = isinstance(platform, ChatManners)
    return platform if mannered else None  # type: ignore[return-value]


@dataclass(frozen=True)
class SentQuery:
    """What an interrupted send looked like, to find it on the platform: the job
    (``key``), its attempts, the chat's replies already recorded (never ours), and the
    attempts of the chat's other jobs whose outcome is unknown too (``rivals``: a reply
    that could be theirs is not taken for ours)."""

    account_id: str
    chat_id: str
    key: str
    attempts: Attempts
    exclude: frozenset[str] = frozenset()
    rivals: tuple[Attempts, ...] = ()


class TooEarly(Exception):
    """The platform cannot tell yet: a send still in its time window may not show. Ask
    again after ``seconds`` (not an attempt)."""

    def __init__(self, seconds: float) -> None:
        super().__init__(f"too early to tell; ask again in {seconds:.0f}s")
        self.seconds = seconds


class Platform(Protocol):
    name: str
    max_text: int
    #: Re-sending with the same key cannot produce a second message (Idempotency-Key).
    idempotent: bool
    #: ``find_sent`` can tell whether a reply whose answer was lost went out.
    can_reconcile: bool

    async def send(
        self, account_id: str, chat_id: str, text: str, *, key: str, business_connection_id: str | None = None
    ) -> Sent:
        """Send one reply; raise ``Failure`` when it did not (or may not have) gone out.
        ``business_connection_id``: Telegram Business, the connection to answer through
        (as the business account); other platforms have none and ignore it."""
        ...

    async def probe(self, account_id: str) -> None:
        """Whether the platform accepts the account as a whole; raise ``Failure`` (kind
        account) when it does not."""
        ...

    async def find_sent(self, query: SentQuery) -> Sent | None:
        """The reply an interrupted send made, if the platform shows it; None when the
        platform shows it did not; ``Failure`` when the platform's answer cannot tell;
        ``TooEarly`` when it cannot tell yet."""
        ...

    async def aclose(self) -> None: ...


class Answer(Protocol):
    """What the adapters read of an HTTP answer: ``httpx.Response`` or ``http.Reply``."""

    status_code: int

    @property
    def headers(self) -> Mapping[str, str]: ...

    @property
    def is_success(self) -> bool: ...

    @property
    def text(self) -> str: ...

    def json(self) -> Any: ...


class HttpClient(Protocol):
    """The platform calls' client: ``http.PlatformHttp`` (aiohttp) in the service, or an
    ``httpx.AsyncClient`` (tests use its MockTransport)."""

    @property
    def timeout(self) -> httpx.Timeout: ...

    @property
    def request(self) -> Callable[..., Awaitable[Any]]:
        """``request(method, url, json=, content=, data=, headers=, params=)``: the answer."""
        ...


async def call(
    client: HttpClient,
    limiter: AccountRateLimiter | None,
    platform: str,
    account_id: str,
    method: str,
    url: str,
    **kwargs: Any,
) -> Answer:
    """One platform request: paced per account, timed, transport errors classified.
    HTTP error statuses are returned for the adapter to read."""
    if limiter is not None:
        await limiter.acquire(f"{platform}:{account_id}")
    started = time.perf_counter()
    try:
        response: Answer = await client.request(method, url, **kwargs)
    except TRANSPORT_ERRORS as exc:
        failure = classify_transport(exc)
        metrics.PLATFORM_SECONDS.labels(platform=platform, outcome=failure.kind.value).observe(
            time.perf_counter() - started
        )
        raise failure from None
    outcome = "ok" if response.is_success else f"http_{response.status_code // 100}xx"
    metrics.PLATFORM_SECONDS.labels(platform=platform, outcome=outcome).observe(time.perf_counter() - started)
    if limiter is not None:
        key = f"{platform}:{account_id}"
        if response.status_code == 429:
            # A 429 may carry no retry-after (Avito): back off with jitter, so the account's
            # senders do not all come back at the same moment.
            limiter.pause(key, retry_after_of(response) or random.uniform(*LIMITED_BACKOFF_SECONDS))
        elif rate_limit_spent(response):
            # The platform's window (Avito: per minute, X-RateLimit-*) is used up: wait for
            # it to turn, with jitter, before the next send rather than collect a 429.
            limiter.pause(key, random.uniform(*SPENT_WINDOW_SECONDS))
    return response


#: How long an account waits after a 429 that says nothing, and after its rate-limit
#: window is spent (Avito counts per minute).
LIMITED_BACKOFF_SECONDS = (5.0, 20.0)
SPENT_WINDOW_SECONDS = (30.0, 60.0)


def rate_limit_spent(response: Answer) -> bool:
    """Whether the platform's rate-limit headers say no request is left in this window."""
    remaining = response.headers.get("x-ratelimit-remaining")
    try:
        return remaining is not None and int(remaining) <= 0
    except ValueError:
        return False


def retry_after_of(response: Answer) -> float | None:
    try:
        body = response.json()
    except ValueError:
        body = {}
    params = body.get("parameters") if isinstance(body, dict) else None
    if isinstance(params, dict) and isinstance(params.get("retry_after"), int | float):
        return float(params["retry_after"])
    try:
        return float(response.headers.get("retry-after", ""))
    except ValueError:
        return None


def raise_for(response: Answer, detail: str = "", *, acts: bool = False) -> None:
    """Raise the classified failure of an error answer; ``acts`` for sends (see
    ``classify_status``)."""
    failure: Failure | None = classify_status(
        response.status_code, detail, retry_after_of(response), acts=acts
    )
    if failure is not None:
        raise failure
