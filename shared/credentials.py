"""What an account's credentials must look like, checked when they are set (the admin API,
422 with the reason) and when an account's row is read at start (a row from before a
check pauses its account with the reason): a credential that only fails when it is first
used fails where nobody sees it (a generic account whose webhook secret was not a
Standard Webhooks key answered every delivery 500, and ``-``/``_`` were dropped from it
in silence, so a 34-character secret became a 3-byte key).

A reason names the credential and the rule, never the value (it is a secret)."""

from __future__ import annotations

import base64
import binascii
import re
from urllib.parse import urlsplit

# Every format below is checked with ``fullmatch``: ``re.match`` with ``^...$`` took a value
# with a line break at its end (``$`` matches before a final "\n"), and ``\d`` would take
# any Unicode digit.

#: A Standard Webhooks key: ``whsec_`` then standard base64 (A-Z a-z 0-9 + /, padding
#: optional) of 24 to 64 bytes (the specification's "between 24 and 64 bytes").
WHSEC_PREFIX = "whsec_"
_BASE64 = re.compile(r"[A-Za-z0-9+/]+={0,2}")
WHSEC_MIN_BYTES, WHSEC_MAX_BYTES = 24, 64
MAKE_WHSEC = "make one with: python3 -c 'import base64,os; print(\"whsec_\" + base64.b64encode(os.urandom(32)).decode())'"

#: A Telegram bot token: the bot's id, a colon, then Telegram's 35 characters (20-100 taken).
_BOT_TOKEN = re.compile(r"[0-9]{1,20}:[A-Za-z0-9_\-]{20,100}")
#: setWebhook's secret_token: Telegram's rule, and at least 16 characters.
_TELEGRAM_SECRET = re.compile(r"[A-Za-z0-9_\-]{16,256}")
#: An Avito webhook path secret: one URL path segment.
_PATH_SECRET = re.compile(r"[A-Za-z0-9_\-]{16,128}")
#: Avito's client id and secret: printable ASCII without spaces (what Avito issues; a
#: space or line break pasted with one would be sent and refused far from here).
_CLIENT_VALUE = re.compile(r"[\x21-\x7e]+")


def whsec_problem(secret: str) -> str | None:
    """Why ``secret`` is not a Standard Webhooks key the ``standardwebhooks`` library reads
    as written, or None. The library strips ``whsec_``, appends ``==`` and decodes without
    validation: a character outside base64 is dropped in silence and bad padding raises at
    the first request. Here every character must count."""
    if not secret.startswith(WHSEC_PREFIX):
        return f"must start with {WHSEC_PREFIX} (a Standard Webhooks key)"
    body = secret[len(WHSEC_PREFIX) :]
    if not _BASE64.fullmatch(body):
        outside = sum(1 for c in body.rstrip("=") if not (c.isascii() and (c.isalnum() or c in "+/")))
        return (
            f"after {WHSEC_PREFIX}, must be standard base64 (A-Z a-z 0-9 + /, = padding at the end); "
            f"{outside} character(s) are not (a URL-safe - or _ would be dropped in silence)"
        )
    unpadded = body.rstrip("=")
    if len(unpadded) % 4 == 1:
        return f"after {WHSEC_PREFIX}, the base64 has a length no bytes make"
    try:
        strict = base64.b64decode(unpadded + "=" * (-len(unpadded) % 4), validate=True)
        # What the library itself makes of it: the same bytes, or it is refused.
        lenient = base64.b64decode(body + "==")
    except (binascii.Error, ValueError):
        return f"after {WHSEC_PREFIX}, not valid base64"
    if strict != lenient:
        return f"after {WHSEC_PREFIX}, its padding is not where base64 puts it"
    if not WHSEC_MIN_BYTES <= len(strict) <= WHSEC_MAX_BYTES:
        return f"must decode to {WHSEC_MIN_BYTES}-{WHSEC_MAX_BYTES} bytes; it decodes to {len(strict)}"
    return None


def url_problem(url: str) -> str | None:
    """Why ``url`` is not an absolute http(s) URL a reply can be posted to, or None."""
    if any(c.isspace() or not c.isprintable() for c in url):
        return "must be a URL without spaces or control characters"
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return "is not a URL (its host or port cannot be read)"
    if parts.scheme not in ("http", "https"):
        return "must be an http:// or https:// URL"
    if not parts.hostname:
        return "must name a host"
    if parts.username is not None or parts.password is not None:
        return "must not carry a user or password (use reply_secret to authenticate replies)"
    if port == 0:
        return "has port 0"
    return None


def credential_problems(platform: str, account_id: str, credentials: dict[str, str]) -> list[str]:
    """Every credential given that does not have its platform's format, as ``name: why``."""
    problems: list[str] = []

    def check(name: str, why: str | None) -> None:
        if why is not None:
            problems.append(f"{name}: {why}")

    for name, value in credentials.items():
        if name == "bot_token":
            if not _BOT_TOKEN.fullmatch(value):
                check(name, "must be a Telegram bot token, <bot id>:<20-100 characters of A-Z a-z 0-9 _ ->")
            elif value.split(":", 1)[0] != account_id:
                check(name, "is another bot's: its id (before the colon) is not the account id")
        elif name in ("client_id", "client_secret"):
            if not _CLIENT_VALUE.fullmatch(value):
                check(name, "must be non-empty printable ASCII without spaces (as Avito issues it)")
        elif name == "reply_url":
            check(name, url_problem(value))
        elif name == "reply_secret":
            check(name, whsec_problem(value))
        elif name == "webhook_secret":
            if platform == "generic":
                check(name, whsec_problem(value))
            elif platform == "telegram" and not _TELEGRAM_SECRET.fullmatch(value):
                check(name, "16-256 characters of A-Z a-z 0-9 _ - (Telegram's rule for secret_token)")
            elif platform == "avito" and not _PATH_SECRET.fullmatch(value):
                check(name, "16-128 characters of A-Z a-z 0-9 _ - (a URL path)")
    return problems
