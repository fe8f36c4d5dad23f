from __future__ import annotations

import pytest
from pydantic import ValidationError

from shared.settings import Settings

pytestmark = pytest.mark.unit


def test_settings_come_from_chatq_prefixed_environment_variables(monkeypatch) -> None:
    monkeypatch.setenv("CHATQ_QUIET_SECONDS", "3")
    monkeypatch.setenv("QUIET_SECONDS", "99")
    assert Settings().quiet_seconds == 3


def test_production_refuses_the_local_default_credentials() -> None:
    with pytest.raises(ValidationError, match="guest"):
        Settings(env="production", database_url="postgresql://app:pw@db/chatq")
    with pytest.raises(ValidationError, match="local development default"):
        Settings(env="production", amqp_url="amqp://app:pw@mq/")


def test_production_refuses_short_secrets() -> None:
    with pytest.raises(ValidationError, match="at least 16"):
        Settings(
            env="production",
            database_url="postgresql://app:pw@db/chatq",
            amqp_url="amqp://app:pw@mq/",
            admin_token="short",
        )


def test_a_telegram_secret_outside_telegrams_alphabet_is_refused() -> None:
    with pytest.raises(ValidationError, match="A-Z a-z 0-9"):
        Settings(telegram_webhook_secret="has spaces")


def test_reply_delays_must_be_an_interval() -> None:
    with pytest.raises(ValidationError, match="must not exceed"):
        Settings(reply_delay_min_seconds=30, reply_delay_max_seconds=10)


def test_retry_delays_are_parsed_and_must_be_positive() -> None:
    assert Settings(retry_delays_seconds="1, 10,60").retry_delays() == [1, 10, 60]
    with pytest.raises(ValidationError):
        Settings(retry_delays_seconds="1,-5")


def test_secrets_do_not_show_in_the_settings_repr() -> None:
    s = Settings(admin_token="very-secret-admin-token", amqp_url="amqp://u:hunter2@mq/")
    assert "very-secret-admin-token" not in repr(s)
    assert "hunter2" not in repr(s)


def test_the_telegram_account_is_the_bot_id_from_the_token() -> None:
    assert Settings(telegram_bot_token="123456:ABC").telegram_account_id == "123456"
    assert Settings().telegram_account_id == "bot"
