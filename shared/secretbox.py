"""Account credentials at rest: Fernet (``cryptography``), keys from CHATQ_SECRETS_KEY or
CHATQ_SECRETS_KEY_FILE, comma-separated. The first key encrypts; every key decrypts, so a
rotation is: put the new key first and keep the old one after it, let ``chatq accounts
rotate-key`` re-encrypt every account, then drop the old key. A key file is read again at
each accounts refresh: a rotation needs no restart."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from cryptography.fernet import Fernet, InvalidToken, MultiFernet


class SecretsUnavailable(Exception):
    """No key is configured, or none of the keys opens a stored value."""


def parse_keys(text: str) -> list[Fernet]:
    """Fernet keys from comma-separated text; ValueError (without the key) when one is not
    a key (32 bytes, url-safe base64)."""
    parts = [p.strip() for p in text.replace("\n", ",").split(",") if p.strip()]
    if not parts:
        raise ValueError("SECRETS_KEY holds no key")
    keys = []
    for number, part in enumerate(parts, start=1):
        try:
            keys.append(Fernet(part.encode()))
        except (ValueError, TypeError):
            raise ValueError(
                f"SECRETS_KEY: key {number} is not a Fernet key (32 bytes, url-safe base64); make one "
                "with: python3 -c 'from cryptography.fernet import Fernet; print(Fernet.generate_key().decode())'"
            ) from None
    return keys


class SecretBox:
    """Encrypts and decrypts account credentials (a dict of strings)."""

    def __init__(self, keys: str | None = None, key_file: str | None = None) -> None:
        self._inline = keys
        self._file = key_file
        self._fernet: MultiFernet | None = None
        self._text: str | None = None
        #: Why the key file last read could not be used (None: it could).
        self.problem: str | None = None
        #: Incremented whenever the keys change (a rotation): what they opened may not open now.
        self.generation = 0
        self.reload()

    def reload(self, check: Callable[[MultiFernet], str | None] | None = None) -> None:
        """Read the keys again (the key file may have changed: a rotation). A key file that
        cannot be used while keys are in use (unreadable, empty, or not Fernet keys: a bad
        edit) keeps those keys and raises SecretsUnavailable saying why (``problem`` holds it
        until the file is good again); with no keys yet (at start), it raises too.

        ``check``: asked of new keys while keys are in use; a reason it gives (the new keys
        open none of what the old ones did: the old key dropped before ``rotate-key``) makes
        the file a bad edit too."""
        text = self._inline
        if self._file:
            try:
                text = Path(self._file).read_text()
            except (OSError, UnicodeDecodeError) as exc:
                why = exc.strerror if isinstance(exc, OSError) and exc.strerror else type(exc).__name__
                self._unusable(f"cannot read SECRETS_KEY_FILE: {why}")
            if not text.strip() and self._fernet is not None:
                # Caught empty while it is rewritten, or emptied: the keys in use stay, and it
                # is said (a rotation must not seal again under the keys of before).
                self._unusable("SECRETS_KEY_FILE is empty")
        if self.generation and text == self._text:
            self.problem = None  # the keys in use, again (after a bad edit was undone)
            return  # the same keys: what they opened stays open
        try:
            fernet = MultiFernet(parse_keys(text)) if text else None
        except ValueError as exc:  # the message names the key's place, never the key
            self._unusable(f"SECRETS_KEY_FILE cannot be used: {exc}")
        if check is not None and fernet is not None and self._fernet is not None:
            # Asked again at each read while the file stays so: what the keys in use open
            # changes (another process's rotate-key), and so may the answer.
            refused = check(fernet)
            if refused is not None:
                self._unusable(f"SECRETS_KEY_FILE cannot be used: {refused}")
        self.problem = None
        self._fernet = fernet
        self._text = text
        self.generation += 1

    def _unusable(self, why: str) -> NoReturn:
        """The key file read cannot be used: with keys in use they stay, and ``problem``
        says why until the file is good again; with none yet (at start) the process has no
        keys. Raises SecretsUnavailable either way."""
        if self._fernet is not None:
            self.problem = f"{why}; the keys read before stay in use"
            raise SecretsUnavailable(self.problem)
        raise SecretsUnavailable(why)

    @property
    def configured(self) -> bool:
        return self._fernet is not None

    @property
    def fernet(self) -> MultiFernet:
        """The keys themselves, for another credential sealed with them (an Avito token)."""
        return self._require()

    def _require(self) -> MultiFernet:
        if self._fernet is None:
            raise SecretsUnavailable(
                "accounts with their own credentials need CHATQ_SECRETS_KEY (or CHATQ_SECRETS_KEY_FILE)"
            )
        return self._fernet

    def seal(self, credentials: dict[str, str]) -> bytes:
        return self._require().encrypt(json.dumps(credentials, sort_keys=True).encode())

    def open(self, token: bytes) -> dict[str, str]:
        try:
            value = json.loads(self._require().decrypt(bytes(token)))
        except InvalidToken:
            raise SecretsUnavailable("no configured SECRETS_KEY opens the stored credentials") from None
        return {str(k): str(v) for k, v in value.items()}

    def rotate(self, token: bytes) -> bytes:
        """The same credentials under the first key."""
        try:
            return self._require().rotate(bytes(token))
        except InvalidToken:
            raise SecretsUnavailable("no configured SECRETS_KEY opens the stored credentials") from None
