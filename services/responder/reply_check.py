"""The model's answer is read before it is sent (issue 39, point 11). A buyer can ask the
model to repeat its instructions, or what it was told to keep to itself; what the seller
put in the prompt can be said to a buyer (README "What the prompt may say"), but a reply
that repeats a long run of the seller's instructions to the model (the prompt, not the
facts meant for buyers) verbatim, or that holds a secret-looking string, is not sent: it
goes to a person (``needs_review``) with the reason, and the text itself is not stored
(it may hold the secret).

Secrets looked for: the account's own credentials, every secret of the settings (the
model's API key, the platforms' tokens and webhook secrets, the admin token...), and
strings shaped like keys wherever they come from (``whsec_…``, ``sk-…``, a Telegram bot
token, a private key block, an AWS access key id, GitHub and Slack tokens)."""

from __future__ import annotations

import re
from collections.abc import Iterable

from stores.accounts.registry import AccountRegistry

#: Strings shaped like credentials, whoever's they are: (what, pattern).
SECRET_SHAPES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("a Standard Webhooks secret (whsec_…)", re.compile(r"whsec_[A-Za-z0-9+/=_-]{8,}")),
    ("an API key (sk-…)", re.compile(r"(?<![A-Za-z0-9])sk-(?:[A-Za-z0-9_-]*-)?[A-Za-z0-9_-]{16,}")),
    ("a Telegram bot token", re.compile(r"(?<!\d)\d{6,12}:AA[A-Za-z0-9_-]{30,}")),
    ("a private key", re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----")),
    ("an AWS access key id", re.compile(r"(?<![A-Z0-9])(?:AKIA|ASIA)[0-9A-Z]{16}(?![A-Z0-9])")),
    ("a GitHub token", re.compile(r"gh[pousr]_[A-Za-z0-9]{30,}")),
    ("a Slack token", re.compile(r"xox[abposr]-[A-Za-z0-9-]{10,}")),
)
#: A configured secret shorter than this is not looked for (it would match ordinary words).
MIN_SECRET_CHARS = 8
#: Credentials that are not secret (a reply may name its own receiver's URL or client id).
NOT_SECRET = ("reply_url", "client_id")


def _flat(text: str) -> str:
    """Whitespace collapsed and case folded: a run repeated with other line breaks or
    capitals is the same run."""
    return " ".join(text.split()).casefold()


def repeated_run(instructions: str, reply: str, chars: int) -> int:
    """How many characters of ``instructions`` (a prompt; its ``{facts}`` placeholder and
    what fills it are not instructions) the reply repeats verbatim in one run, counted
    when at least ``chars`` (else 0)."""
    said = _flat(reply)
    if len(said) < chars:
        return 0
    windows = {said[i : i + chars] for i in range(len(said) - chars + 1)}
    longest = 0
    for piece in instructions.split("{facts}"):
        told = _flat(piece)
        i = 0
        while i <= len(told) - chars:
            if told[i : i + chars] not in windows:
                i += 1
                continue
            # Grow the run as far as the reply repeats it.
            end = i + chars
            while end < len(told) and told[i : end + 1] in said:
                end += 1
            longest = max(longest, end - i)
            i = end
    return longest


def secret_in(reply: str, secrets: Iterable[str]) -> str | None:
    """What secret-looking thing the reply holds (in words, never the secret), or None."""
    for secret in secrets:
        for value in (secret, secret.removeprefix("whsec_")):
            if len(value) >= MIN_SECRET_CHARS and value in reply:
                return "a secret of this deployment's configuration"
    for what, shape in SECRET_SHAPES:
        if shape.search(reply):
            return what
    return None


class ReplyCheck:
    """Why a written reply must not be sent (a person reads it), or None."""

    def __init__(
        self, secrets: Iterable[str], registry: AccountRegistry | None, *, run_chars: int = 60
    ) -> None:
        self._secrets = tuple(s for s in secrets if s)
        self._registry = registry
        self._run_chars = run_chars

    def _account_secrets(self, platform: str, account_id: str) -> list[str]:
        account = self._registry.get(platform, account_id) if self._registry is not None else None
        if account is None or not account.owns_credentials or account.sealed:
            return []
        return [v for k, v in account.credentials.items() if k not in NOT_SECRET and isinstance(v, str)]

    def why_held(self, platform: str, account_id: str, instructions: str, reply: str) -> str | None:
        found = secret_in(reply, [*self._account_secrets(platform, account_id), *self._secrets])
        if found is not None:
            return f"held for a person: the written reply holds {found}"
        run = repeated_run(instructions, reply, self._run_chars)
        if run:
            return (
                f"held for a person: the written reply repeats {run} characters of the seller's instructions "
                "to the model verbatim"
            )
        return None
