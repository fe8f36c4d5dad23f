"""Credentials are checked when they are set (issue 39, point 6): what each must look
like, and that a Standard Webhooks key is refused whenever the standardwebhooks library
would read it as something other than what was written."""

from __future__ import annotations

import base64
import os

import pytest
from standardwebhooks.webhooks import Webhook

from shared.credentials import credential_problems, url_problem, whsec_problem

pytestmark = pytest.mark.unit

GOOD = "whsec_" + base64.b64encode(os.urandom(32)).decode()


@pytest.mark.parametrize(
    "secret",
    [
        GOOD,
        "whsec_" + base64.b64encode(os.urandom(24)).decode(),
        "whsec_" + base64.b64encode(os.urandom(64)).decode(),
        "whsec_" + base64.b64encode(os.urandom(32)).decode().rstrip("="),  # unpadded: the library pads
    ],
)
def test_a_standard_webhooks_key_is_taken_and_reads_as_written(secret: str) -> None:
    assert whsec_problem(secret) is None
    body = secret.removeprefix("whsec_")
    assert Webhook(secret)._whsecret == base64.b64decode(body + "=" * (-len(body) % 4))


@pytest.mark.parametrize(
    ("secret", "why"),
    [
        # The issue's secret: 34 URL-safe characters the library read as 3 bytes.
        ("whsec_ab-cd_ef-gh_ij-kl_mn-op_qr-st", "a URL-safe - or _ would be dropped"),
        ("whsec_" + base64.urlsafe_b64encode(b"\xfb\xff" * 16).decode(), "would be dropped"),
        (base64.b64encode(os.urandom(32)).decode(), "must start with whsec_"),
        ("whsec_", "must be standard base64"),
        ("whsec_" + base64.b64encode(os.urandom(16)).decode(), "decodes to 16"),
        ("whsec_" + base64.b64encode(os.urandom(65)).decode(), "decodes to 65"),
        ("whsec_QUJD=REVG" + "QUJD" * 8, "must be standard base64"),
        ("whsec_" + "QUJD" * 8 + "Q", "a length no bytes make"),
        ("whsec_" + "QUJD" * 8 + " ", "must be standard base64"),
    ],
)
def test_a_secret_the_library_would_misread_or_that_is_too_short_is_refused_with_the_reason(
    secret: str, why: str
) -> None:
    problem = whsec_problem(secret)
    assert problem is not None and why in problem
    body = secret.removeprefix("whsec_")
    if len(body) > 4:
        assert body not in problem


def test_the_issues_secret_is_what_the_library_silently_shortened() -> None:
    """Why the check exists: the library decodes without validation."""
    assert len(Webhook("whsec_ab-cd_ef-gh_ij-kl_mn-op_qr-st")._whsecret) < 24


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("https://shop.example/replies", None),
        ("http://127.0.0.1:8080/r?x=1", None),
        ("ftp://shop.example/r", "http:// or https://"),
        ("https:///r", "must name a host"),
        ("https://u:p@shop.example/r", "must not carry a user"),
        ("https://shop.example:99999/r", "cannot be read"),
        ("https://shop.example/a b", "without spaces"),
        ("shop.example/r", "http:// or https://"),
    ],
)
def test_a_reply_url_must_be_an_absolute_http_url(url: str, why: str | None) -> None:
    problem = url_problem(url)
    assert (problem is None) if why is None else (problem is not None and why in problem)


def test_every_credential_with_a_format_is_checked_and_the_reasons_never_show_the_values() -> None:
    given = {
        "bot_token": "5151:short",
        "webhook_secret": "has spaces in it 0123",
        "client_id": "id with space",
        "client_secret": "",
        "reply_url": "gopher://x",
        "reply_secret": "plain-secret-value-0123",
    }
    problems = credential_problems("telegram", "5151", given)
    names = [p.split(":", 1)[0] for p in problems]
    assert names == ["bot_token", "webhook_secret", "client_id", "client_secret", "reply_url", "reply_secret"]
    text = "; ".join(problems)
    for value in given.values():
        if value:
            assert value not in text
    assert credential_problems("telegram", "5151", {"bot_token": "5151:" + "A" * 35}) == []
    assert credential_problems("telegram", "6161", {"bot_token": "5151:" + "A" * 35}) == [
        "bot_token: is another bot's: its id (before the colon) is not the account id"
    ]
    assert credential_problems("generic", "g", {"webhook_secret": GOOD, "reply_secret": GOOD}) == []


BOT_TOKEN = "5151:AAbot-two-token-0123456789abcdef"


@pytest.mark.parametrize(
    ("platform", "name", "value"),
    [
        ("telegram", "bot_token", BOT_TOKEN),
        ("telegram", "webhook_secret", "telegram-secret-0123456789"),
        ("avito", "client_id", "client-2"),
        ("avito", "client_secret", "client-2-secret"),
        ("avito", "webhook_secret", "shop2-path-secret-0123456789"),
        ("generic", "webhook_secret", GOOD),
        ("generic", "reply_secret", GOOD),
    ],
)
@pytest.mark.parametrize("end", ["\n", "\r\n", " "], ids=["line feed", "crlf", "space"])
def test_a_credential_with_a_line_break_or_space_at_its_end_is_refused_though_it_is_otherwise_good(
    platform: str, name: str, value: str, end: str
) -> None:
    """On main re.match with ^...$ took a bot token, a Telegram or Avito webhook secret and
    an Avito client id or secret with a "\\n" at the end ($ matches before it)."""
    account = "5151" if platform == "telegram" else "888"
    assert credential_problems(platform, account, {name: value}) == []
    [problem] = credential_problems(platform, account, {name: value + end})
    assert problem.startswith(f"{name}: ")


def test_a_bot_id_of_other_unicode_digits_is_no_bot_token() -> None:
    arabic = "\u0665\u0661\u0665\u0661"  # 5151 in Arabic-Indic digits: \d takes them
    assert credential_problems("telegram", arabic, {"bot_token": arabic + BOT_TOKEN[4:]})
