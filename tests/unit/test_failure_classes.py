"""What a platform's answer (or its absence) means for a job: pure classification, and
how an Avito listing is read when a send's outcome is unknown."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import httpx
import pytest

from platforms.avito.adapter import AvitoPlatform, AvitoToken
from platforms.base import Sent, SentQuery, TooEarly, call
from platforms.failures import Kind, classify_llm, classify_status, classify_transport
from platforms.ratelimit import AccountRateLimiter
from platforms.telegram.adapter import TelegramPlatform
from stores.jobs.protocol import Attempts

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("status", [502, 504])
def test_a_gateway_error_on_a_send_may_have_acted_so_it_is_unknown(status: int) -> None:
    failure = classify_status(status, acts=True)
    assert failure is not None and failure.kind is Kind.UNKNOWN
    assert "may have happened" in failure.reason


@pytest.mark.parametrize("status", [502, 504, 500, 503])
def test_a_server_error_on_a_request_that_acts_on_nothing_is_transient(status: int) -> None:
    failure = classify_status(status)
    assert failure is not None and failure.kind is Kind.TRANSIENT


@pytest.mark.parametrize("status", [500, 503, 408, 429])
def test_a_server_error_that_says_nothing_happened_is_transient_on_a_send_too(status: int) -> None:
    failure = classify_status(status, acts=True)
    assert failure is not None and failure.kind is Kind.TRANSIENT


def test_a_client_error_is_permanent_and_success_is_none() -> None:
    assert classify_status(400, acts=True).kind is Kind.PERMANENT  # type: ignore[union-attr]
    assert classify_status(200, acts=True) is None


def test_no_answer_before_the_request_left_is_transient_after_it_unknown() -> None:
    request = httpx.Request("POST", "https://example.invalid/")
    assert classify_transport(httpx.ConnectError("refused", request=request)).kind is Kind.TRANSIENT
    assert classify_transport(httpx.ReadTimeout("late", request=request)).kind is Kind.UNKNOWN


# An attempt an hour ago: its time window (start to start + timeout + skew) has passed.
STARTED = datetime.now(UTC).replace(microsecond=0) - timedelta(hours=1)
T = int(STARTED.timestamp())
TEXT = "Yes, it is available."


def listing(items: object, status: int = 200) -> AvitoPlatform:
    """Avito with a token endpoint and a message list answering ``items``."""

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/token":
            return httpx.Response(
                200, json={"access_token": "t", "expires_in": 86400, "token_type": "Bearer"}
            )
        return httpx.Response(status, json=items)

    client = httpx.AsyncClient(transport=httpx.MockTransport(handle), timeout=10)
    return AvitoPlatform(
        "https://avito.test",
        AvitoToken("https://avito.test", "id", "secret", client),
        client,
        AccountRateLimiter(1000),
    )


def query(*, since: datetime = STARTED, latest: datetime = STARTED, **changes: object) -> SentQuery:
    values: dict[str, object] = {
        "account_id": "7", "chat_id": "c", "key": "job", "attempts": Attempts(TEXT, since, latest),
        "exclude": frozenset(), "rivals": (),
    }  # fmt: skip
    values.update(changes)
    return SentQuery(**values)  # type: ignore[arg-type]


def out(message_id: str, created: object, text: str = TEXT) -> dict[str, object]:
    return {
        "id": message_id,
        "direction": "out",
        "created": created,
        "type": "text",
        "content": {"text": text},
    }


async def test_our_reply_is_found_when_sent_in_the_attempts_own_time() -> None:
    assert await listing([out("m-2", T + 3)]).find_sent(query()) == Sent("m-2")


async def test_a_reply_an_earlier_attempt_of_the_job_may_have_sent_is_found_too() -> None:
    # Attempt 1 timed out (its send landed late), attempt 2 failed clearly: the reply of
    # attempt 1 is still this job's.
    platform = listing([out("m-2", T + 12)])
    assert await platform.find_sent(query(latest=STARTED + timedelta(minutes=5))) == Sent("m-2")


async def test_an_identical_reply_already_recorded_for_another_job_is_never_taken_for_ours() -> None:
    platform = listing([out("m-2", T + 3)])
    assert await platform.find_sent(query(exclude=frozenset({"m-2"}))) is None


async def test_an_identical_reply_from_before_the_attempt_is_not_ours() -> None:
    assert await listing([out("m-1", T - 60)]).find_sent(query()) is None


async def test_an_identical_reply_another_unknown_job_could_have_sent_is_unknown_not_ours() -> None:
    rival = Attempts(TEXT, STARTED - timedelta(seconds=4), STARTED - timedelta(seconds=4))
    with pytest.raises(Exception) as raised:
        await listing([out("m-1", T - 3)]).find_sent(query(rivals=(rival,)))
    assert getattr(raised.value, "kind", None) is Kind.UNKNOWN


async def test_before_the_attempts_window_has_passed_it_is_too_early_to_say_not_sent() -> None:
    just_now = datetime.now(UTC)
    with pytest.raises(TooEarly) as raised:
        await listing([]).find_sent(query(since=just_now, latest=just_now))
    assert 10 <= raised.value.seconds <= 16  # the 10 s timeout plus clock skew


async def test_an_answer_of_a_shape_we_do_not_know_is_unknown_not_absent() -> None:
    for items in ({"items": [out("m-2", T)]}, [out("m-2", None)], ["m-2"], {"messages": "m-2"}):
        with pytest.raises(Exception) as raised:
            await listing(items).find_sent(query())
        assert getattr(raised.value, "kind", None) is Kind.UNKNOWN, items


async def test_our_reply_is_found_in_the_list_as_an_object_with_meta_as_in_a_bare_array() -> None:
    # The live API's list as public clients read it: {"messages": [...], "meta": {...}}.
    found = await listing({"messages": [out("m-2", T)], "meta": {"has_more": False}}).find_sent(query())
    assert found is not None and found.message_id == "m-2"


async def test_a_full_page_that_does_not_reach_back_to_the_attempt_is_unknown() -> None:
    newer = [out(f"x-{i}", T + 1000 - i, text="something else") for i in range(100)]
    with pytest.raises(Exception) as raised:
        await listing(newer).find_sent(query())
    assert getattr(raised.value, "kind", None) is Kind.UNKNOWN
    oldest_first = [out(f"x-{i}", T - 1000 + i, text="something else") for i in range(100)]
    with pytest.raises(Exception) as raised:
        await listing(oldest_first).find_sent(query())
    assert getattr(raised.value, "kind", None) is Kind.UNKNOWN
    reaching_back = [out(f"x-{i}", T + 50 - i, text="something else") for i in range(100)]
    assert await listing(reaching_back).find_sent(query()) is None


async def test_a_listing_that_fails_with_a_server_error_is_transient() -> None:
    with pytest.raises(Exception) as raised:
        await listing({"error": {"code": 503, "message": "down"}}, status=503).find_sent(query())
    assert getattr(raised.value, "kind", None) is Kind.TRANSIENT


def telegram(status: int, body: object | bytes) -> TelegramPlatform:
    def handle(request: httpx.Request) -> httpx.Response:
        if isinstance(body, bytes):
            return httpx.Response(status, content=body)
        return httpx.Response(status, json=body)

    client = httpx.AsyncClient(transport=httpx.MockTransport(handle), timeout=10)
    return TelegramPlatform("https://tg.test", "1:x", client, AccountRateLimiter(1000))


@pytest.mark.parametrize(
    ("status", "body", "kind"),
    [
        (200, b"<html>oops</html>", Kind.UNKNOWN),  # took the request, answer unreadable
        (500, {"ok": False, "error_code": 500, "description": "Internal Server Error"}, Kind.UNKNOWN),
        (502, b"Bad Gateway", Kind.UNKNOWN),
        (
            429,
            {
                "ok": False,
                "error_code": 429,
                "description": "Too Many Requests",
                "parameters": {"retry_after": 3},
            },
            Kind.TRANSIENT,
        ),
        (
            403,
            {"ok": False, "error_code": 403, "description": "Forbidden: bot was blocked by the user"},
            Kind.PERMANENT,
        ),
    ],
)
async def test_telegram_retries_only_what_never_reached_it_and_429s(
    status: int, body: object, kind: Kind
) -> None:
    with pytest.raises(Exception) as raised:
        await telegram(status, body).send("1", "42", "hi", key="job")
    assert getattr(raised.value, "kind", None) is kind


@pytest.mark.parametrize(
    ("status", "body"),
    [
        (401, {"ok": False, "error_code": 401, "description": "Unauthorized"}),
        (404, {"ok": False, "error_code": 404, "description": "Not Found"}),
    ],
)
async def test_a_refused_bot_token_is_about_the_account_not_the_chat(status: int, body: object) -> None:
    with pytest.raises(Exception) as raised:
        await telegram(status, body).send("1", "42", "hi", key="job")
    assert getattr(raised.value, "kind", None) is Kind.ACCOUNT
    assert "@BotFather" in str(raised.value)


async def test_an_avito_token_answer_without_an_access_token_is_transient_with_its_reason() -> None:
    def handle(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=b"<html>Service Temporarily Unavailable</html>")

    client = httpx.AsyncClient(transport=httpx.MockTransport(handle), timeout=10)
    with pytest.raises(Exception) as raised:
        await AvitoToken("https://avito.test", "id", "secret", client).get()
    assert getattr(raised.value, "kind", None) is Kind.TRANSIENT
    assert "without an access_token" in str(raised.value)


async def test_a_spent_rate_limit_window_pauses_the_account_before_the_next_send() -> None:
    def handle(request: httpx.Request) -> httpx.Response:
        return httpx.Response(
            200, json={"id": "m"}, headers={"X-RateLimit-Limit": "60", "X-RateLimit-Remaining": "0"}
        )

    limiter = AccountRateLimiter(1000)
    client = httpx.AsyncClient(transport=httpx.MockTransport(handle), timeout=10)
    await call(client, limiter, "avito", "7", "POST", "https://avito.test/x")
    assert limiter.delay("avito:7") >= 30
    assert limiter.delay("avito:8") == 0  # another account is not held


async def test_a_429_without_retry_after_backs_off_with_jitter() -> None:
    def handle(request: httpx.Request) -> httpx.Response:
        return httpx.Response(429, json={"error": {"code": 429, "message": "Too Many Requests"}})

    waits = set()
    for _ in range(5):
        limiter = AccountRateLimiter(1000)
        client = httpx.AsyncClient(transport=httpx.MockTransport(handle), timeout=10)
        await call(client, limiter, "avito", "7", "POST", "https://avito.test/x")
        waits.add(round(limiter.delay("avito:7"), 3))
    assert all(5 <= w <= 20 for w in waits) and len(waits) > 1


def test_every_retry_reason_the_responder_can_count_is_created_at_start() -> None:
    """shared.metrics.RETRY_REASONS lists the RetryLater kinds that are not a stage's
    failure; the rest are "<stage>_<failure kind>", and only transient failures retry."""
    import re
    from pathlib import Path

    from services.responder import handler
    from shared.metrics import RETRY_REASONS

    source = Path(handler.__file__).read_text()
    literal = set(re.findall(r'kind="([a-z_]+)"', source))
    assert literal == set(RETRY_REASONS), literal ^ set(RETRY_REASONS)
    assert 'kind=f"{stage}_{failure.kind}"' in source
    assert "if failure.kind is Kind.PERMANENT:" in source, "non-transient failures do not retry"


def _model_error(status: int, body: dict[str, object], headers: dict[str, str] | None = None) -> Exception:
    import openai

    request = httpx.Request("POST", "http://model.test/v1/chat/completions")
    response = httpx.Response(status, headers=headers or {}, json=body, request=request)
    cls = {
        400: openai.BadRequestError,
        409: openai.ConflictError,
        429: openai.RateLimitError,
        500: openai.InternalServerError,
    }[status]
    return cls("model error", response=response, body=body)


@pytest.mark.parametrize(
    ("error", "kind", "reason", "retry_after"),
    [
        (_model_error(429, {"error": {"code": "insufficient_quota"}}), Kind.PERMANENT, "quota", None),
        (
            _model_error(429, {"error": {"code": "rate_limit"}}, {"retry-after": "7"}),
            Kind.TRANSIENT,
            "rate",
            7.0,
        ),
        (_model_error(500, {}), Kind.TRANSIENT, "model error 500", None),
        (_model_error(409, {}), Kind.TRANSIENT, "model error 409", None),
        (
            _model_error(400, {"error": {"code": "context_length_exceeded"}}),
            Kind.PERMANENT,
            "context_length",
            None,
        ),
        (TimeoutError(), Kind.TRANSIENT, "model call failed (TimeoutError)", None),
    ],
)
def test_a_models_failure_is_retried_unless_asking_again_cannot_help(
    error: Exception, kind: Kind, reason: str, retry_after: float | None
) -> None:
    failure = classify_llm(error)
    assert (failure.kind, failure.retry_after) == (kind, retry_after)
    assert reason in failure.reason


def test_the_receiver_starts_without_importing_the_model_client() -> None:
    """openai's types are half a second of imports, paid at each restart of a receiver (a
    webhook refused meanwhile is retried by the platform later) that never calls a model."""
    import subprocess
    import sys

    probe = "import sys, services.receiver.app; print('openai' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
