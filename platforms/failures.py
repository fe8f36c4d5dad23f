"""Failure classification, in one place and pure: what a platform or model answer (or
the lack of one) means for the job.

- transient: nothing happened, try again later (connection refused, 5xx, 408, 429,
  model timeout). A 429's retry-after is kept.
- permanent: trying again cannot help (other 4xx: bad request, chat gone, bot blocked,
  quota exhausted).
- account: the platform refuses the account as a whole (a revoked bot token, wrong client
  credentials, no paid Messenger plan): nothing about this job can fix it. The account
  is paused and its jobs wait, without spending attempts, until a probe finds the
  platform accepting it again.
- connection: the platform refuses the Telegram Business connection the reply goes
  through (the business account turned the bot off, or does not let it reply): like
  account, but only that connection's chats wait, until Telegram says it works again.
- unknown: a request that acts (a send) may have reached the platform and acted, and the
  answer does not say: a timeout or reset after the request was sent, or a gateway's 502
  or 504 (the gateway gave up waiting; the platform behind it may have finished). Never
  re-sent blindly: Avito reconciles by listing the chat, a generic receiver re-sends under
  the same Idempotency-Key, and Telegram, which can do neither, goes to a person.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

import aiohttp
import httpx

if TYPE_CHECKING:
    import openai


class Kind(enum.StrEnum):
    TRANSIENT = "transient"
    PERMANENT = "permanent"
    UNKNOWN = "unknown"
    ACCOUNT = "account"
    CONNECTION = "connection"


@dataclass
class Failure(Exception):
    kind: Kind
    reason: str
    retry_after: float | None = None

    def __str__(self) -> str:
        return f"{self.kind}: {self.reason}"


#: Gateway answers: the proxy in front of the platform gave up; the platform may have acted.
GATEWAY_STATUSES = (502, 504)


def classify_status(
    status: int, detail: str = "", retry_after: float | None = None, *, acts: bool = False
) -> Failure | None:
    """A platform's HTTP answer. None for success. ``acts``: the request changes something
    on the platform (a send), so an answer that does not say whether it did is unknown."""
    if 200 <= status < 300:
        return None
    text = f"HTTP {status}" + (f": {detail}" if detail else "")
    if acts and status in GATEWAY_STATUSES:
        return Failure(Kind.UNKNOWN, f"the platform's gateway gave up; the send may have happened ({text})")
    if status == 429:
        return Failure(Kind.TRANSIENT, f"rate limited ({text})", retry_after)
    if status == 408 or status >= 500:
        return Failure(Kind.TRANSIENT, text)
    return Failure(Kind.PERMANENT, text)


#: No answer, and the request never left: nothing can have happened on the platform.
#: (aiohttp: connecting failed, or timed out waiting for a connection or connecting.)
_NOT_SENT = (
    httpx.ConnectError,
    httpx.ConnectTimeout,
    httpx.PoolTimeout,
    httpx.WriteTimeout,
    httpx.WriteError,
    aiohttp.ClientConnectorError,
    aiohttp.ConnectionTimeoutError,
)
#: The request was sent and its answer lost: a read timeout, a reset or a disconnect.
_ANSWER_LOST = (
    httpx.ReadTimeout,
    httpx.ReadError,
    httpx.RemoteProtocolError,
    aiohttp.SocketTimeoutError,
    aiohttp.ServerDisconnectedError,
    aiohttp.ClientOSError,
    aiohttp.ClientPayloadError,
)
#: What the platform client raises when a request gets no answer (``platforms.base.call``).
TRANSPORT_ERRORS = (httpx.HTTPError, aiohttp.ClientError, TimeoutError)


def classify_transport(exc: BaseException) -> Failure:
    """A request that got no answer. Before the request was sent: transient. After (or
    when it cannot be told): unknown."""
    name = type(exc).__name__
    if isinstance(exc, _NOT_SENT):
        return Failure(Kind.TRANSIENT, f"could not reach the platform ({name})")
    if isinstance(exc, _ANSWER_LOST):
        return Failure(Kind.UNKNOWN, f"request sent but the answer was lost ({name})")
    return Failure(Kind.UNKNOWN, f"request failed ({name}: {exc})")


def classify_llm(exc: Exception) -> Failure:
    """The model's failure. Generation has no side effect, so nothing here is unknown."""
    import openai  # here, not at the top: the receiver imports this module and never calls a model

    if isinstance(exc, openai.RateLimitError):
        code = _code(exc)
        if code == "insufficient_quota":
            return Failure(Kind.PERMANENT, "model quota exhausted (insufficient_quota)")
        return Failure(Kind.TRANSIENT, "model rate limited", _retry_after(exc))
    if isinstance(exc, openai.APITimeoutError):
        return Failure(Kind.TRANSIENT, "model timed out")
    if isinstance(exc, openai.APIConnectionError):
        return Failure(Kind.TRANSIENT, "could not reach the model")
    if isinstance(exc, openai.InternalServerError):
        return Failure(Kind.TRANSIENT, f"model error {exc.status_code}")
    if isinstance(exc, openai.APIStatusError):
        if exc.status_code in (408, 409):
            return Failure(Kind.TRANSIENT, f"model error {exc.status_code}")
        return Failure(
            Kind.PERMANENT, f"model refused the request ({exc.status_code}: {_code(exc) or 'error'})"
        )
    return Failure(Kind.TRANSIENT, f"model call failed ({type(exc).__name__})")


def _code(exc: openai.APIStatusError) -> str | None:
    body = exc.body if isinstance(exc.body, dict) else {}
    err = body.get("error", body) if isinstance(body, dict) else {}
    code = err.get("code") if isinstance(err, dict) else None
    return str(code) if code else None


def _retry_after(exc: openai.APIStatusError) -> float | None:
    try:
        return float(exc.response.headers.get("retry-after", ""))
    except (TypeError, ValueError):
        return None
