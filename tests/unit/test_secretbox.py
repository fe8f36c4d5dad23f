"""Account credentials at rest: sealed with the first key, opened with any, rotated
without a restart (a key file is read again), and a bad key named without showing it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from cryptography.fernet import Fernet
from pydantic import ValidationError

from shared.secretbox import SecretBox, SecretsUnavailable
from shared.settings import Settings

pytestmark = pytest.mark.unit

OLD, NEW = Fernet.generate_key().decode(), Fernet.generate_key().decode()
CREDENTIALS = {"bot_token": "123:secret-token-value", "webhook_secret": "a-webhook-secret"}


def test_credentials_sealed_with_the_old_key_open_after_the_new_key_is_put_first() -> None:
    sealed = SecretBox(OLD).seal(CREDENTIALS)
    assert b"secret-token-value" not in sealed
    both = SecretBox(f"{NEW},{OLD}")
    assert both.open(sealed) == CREDENTIALS
    rotated = both.rotate(sealed)
    assert SecretBox(NEW).open(rotated) == CREDENTIALS
    with pytest.raises(SecretsUnavailable):
        SecretBox(OLD).open(rotated)


def test_a_key_file_is_read_again_so_a_rotation_needs_no_restart(tmp_path: Path) -> None:
    keys = tmp_path / "secrets-key"
    keys.write_text(OLD)
    box = SecretBox(key_file=str(keys))
    sealed_new = SecretBox(NEW).seal(CREDENTIALS)
    with pytest.raises(SecretsUnavailable):
        box.open(sealed_new)
    keys.write_text(f"{NEW}\n{OLD}\n")
    box.reload()
    assert box.open(sealed_new) == CREDENTIALS
    assert box.open(sealed_new) == CREDENTIALS


@pytest.mark.parametrize(
    ("spoil", "why"),
    [
        (lambda keys: keys.unlink(), "cannot read SECRETS_KEY_FILE: No such file or directory"),
        (lambda keys: (keys.unlink(), keys.mkdir()), "cannot read SECRETS_KEY_FILE: Is a directory"),
        (lambda keys: keys.write_bytes(b"\xff\xfe"), "cannot read SECRETS_KEY_FILE: UnicodeDecodeError"),
        # `echo NEW,OLD > file` truncates the file before it writes it.
        (lambda keys: keys.write_text(""), "SECRETS_KEY_FILE is empty"),
        (lambda keys: keys.write_text(" \n"), "SECRETS_KEY_FILE is empty"),
    ],
    ids=["gone", "a directory", "not text", "empty", "blank"],
)
def test_a_key_file_that_cannot_be_read_or_is_empty_keeps_the_keys_in_use_and_says_why(
    tmp_path: Path, spoil: Callable[[Path], object], why: str
) -> None:
    """On main it was kept quiet (no problem, so no alert, and rotate-key sealed again
    under the keys of before); nor may it leave the process without keys."""
    keys = tmp_path / "secrets-key"
    keys.write_text(OLD)
    box = SecretBox(key_file=str(keys))
    sealed = box.seal(CREDENTIALS)
    spoil(keys)
    with pytest.raises(SecretsUnavailable, match=why):
        box.reload()
    assert box.problem == f"{why}; the keys read before stay in use"
    assert box.configured and box.open(sealed) == CREDENTIALS
    if keys.is_dir():
        keys.rmdir()
    keys.write_text(OLD)  # the file back: the keys in use, again, and nothing to say
    box.reload()
    assert box.problem is None and box.open(sealed) == CREDENTIALS


def test_without_a_key_nothing_is_sealed_and_the_error_says_which_setting() -> None:
    box = SecretBox(None)
    assert not box.configured
    with pytest.raises(SecretsUnavailable, match="CHATQ_SECRETS_KEY"):
        box.seal(CREDENTIALS)


def test_a_secrets_key_that_is_not_a_fernet_key_is_refused_without_showing_it() -> None:
    with pytest.raises(ValidationError) as refused:
        Settings(secrets_key=f"{NEW},not-a-key-at-all-but-long-enough")
    assert "key 2 is not a Fernet key" in str(refused.value)
    assert "not-a-key-at-all" not in str(refused.value) and NEW not in str(refused.value)


def test_a_key_file_a_bad_edit_made_unusable_keeps_the_keys_in_use_and_says_why_without_the_key(
    tmp_path: Path,
) -> None:
    """Issue 39: the file read again holds something that is not Fernet keys. The keys read
    before stay (every account keeps working), the reason names the key's place, and the
    file good again ends it."""
    keys = tmp_path / "secrets-key"
    keys.write_text(OLD)
    box = SecretBox(key_file=str(keys))
    sealed = box.seal(CREDENTIALS)
    keys.write_text(f"{NEW},not-a-key-at-all-but-long-enough")
    with pytest.raises(SecretsUnavailable, match="key 2 is not a Fernet key") as refused:
        box.reload()
    assert "not-a-key-at-all" not in str(refused.value) and NEW not in str(refused.value)
    assert box.problem is not None and "stay in use" in box.problem
    assert box.configured and box.open(sealed) == CREDENTIALS
    keys.write_text(OLD)  # the bad edit undone: the keys in use, again
    box.reload()
    assert box.problem is None and box.open(sealed) == CREDENTIALS
    keys.write_text("not-a-key-at-all-but-long-enough")
    with pytest.raises(SecretsUnavailable):
        box.reload()
    keys.write_text(f"{NEW},{OLD}")
    box.reload()
    assert box.problem is None and box.open(SecretBox(NEW).seal(CREDENTIALS)) == CREDENTIALS


def test_a_key_file_that_is_not_keys_at_start_refuses_to_start_with_the_reason(tmp_path: Path) -> None:
    keys = tmp_path / "secrets-key"
    keys.write_text("not-a-key-at-all-but-long-enough")
    with pytest.raises(SecretsUnavailable, match="key 1 is not a Fernet key"):
        SecretBox(key_file=str(keys))


def test_new_keys_a_check_refuses_are_a_bad_edit_and_the_keys_in_use_stay(tmp_path: Path) -> None:
    """The registry's check (stores.accounts.registry): new keys that open none of what the keys in
    use opened. Refused each time it is read, taken once the check has nothing against it."""
    keys = tmp_path / "secrets-key"
    keys.write_text(OLD)
    box = SecretBox(key_file=str(keys))
    sealed = box.seal(CREDENTIALS)
    keys.write_text(NEW)
    objection: list[str | None] = ["they open nothing"]
    for _ in range(2):
        with pytest.raises(SecretsUnavailable, match="cannot be used: they open nothing"):
            box.reload(lambda _keys: objection[0])
        assert box.problem is not None and "stay in use" in box.problem
        assert box.open(sealed) == CREDENTIALS
    objection[0] = None
    box.reload(lambda _keys: objection[0])
    assert box.problem is None
    with pytest.raises(SecretsUnavailable):
        box.open(sealed)
