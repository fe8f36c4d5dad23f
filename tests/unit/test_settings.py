from __future__ import annotations

import base64
import os

import pytest
from pydantic import ValidationError

from shared.settings import STANDARD_WEBHOOKS_SECRETS, Settings, placeholder_reason

pytestmark = pytest.mark.unit

SERVER_CREDENTIALS = {
    "database_url": "postgresql://chatq:Qm7vTz2pLw9xKc4R@db/chatq",
    "amqp_url": "amqp://chatq:Hs8dJ3kq0PzX5nVb@mq/",
}


def test_settings_come_from_chatq_prefixed_environment_variables(monkeypatch) -> None:
    monkeypatch.setenv("CHATQ_QUIET_SECONDS", "3")
    monkeypatch.setenv("QUIET_SECONDS", "99")
    assert Settings().quiet_seconds == 3


def test_production_refuses_the_local_default_credentials() -> None:
    with pytest.raises(ValidationError, match="guest"):
        Settings(env="production", database_url=SERVER_CREDENTIALS["database_url"])
    with pytest.raises(ValidationError, match="local development default"):
        Settings(env="production", amqp_url=SERVER_CREDENTIALS["amqp_url"])


def test_production_refuses_short_secrets() -> None:
    with pytest.raises(ValidationError, match="at least 16"):
        Settings(env="production", admin_token="short", **SERVER_CREDENTIALS)


def test_a_telegram_secret_outside_telegrams_alphabet_is_refused() -> None:
    with pytest.raises(ValidationError, match="A-Z a-z 0-9") as refused:
        Settings(telegram_webhook_secret="has two spaces")
    assert "2 of its characters are not allowed" in str(refused.value)
    assert "has two spaces" not in str(refused.value)
    with pytest.raises(ValidationError, match="3 of its characters"):
        Settings(telegram_webhook_secret="base64+with/slash=")
    with pytest.raises(ValidationError, match="it has 257 characters"):
        Settings(telegram_webhook_secret="a" * 257)
    with pytest.raises(ValidationError, match="it has 0 characters"):
        Settings(telegram_webhook_secret="")


def test_a_telegram_secret_of_telegrams_alphabet_is_taken() -> None:
    for secret in ("a", "A-z_0-9", "x" * 256, "k3Jq9vXw2LmP8rTz-_Qa"):
        assert Settings(telegram_webhook_secret=secret).telegram_webhook_secret.get_secret_value() == secret


def test_reply_delays_must_be_an_interval() -> None:
    with pytest.raises(ValidationError, match="must not exceed"):
        Settings(reply_delay_min_seconds=30, reply_delay_max_seconds=10)


def test_a_coalescer_batch_larger_than_its_prefetch_is_refused() -> None:
    with pytest.raises(ValidationError, match="COALESCER_FILE_BATCH_MESSAGES must not exceed"):
        Settings(coalescer_prefetch=32, coalescer_file_batch_messages=64)
    assert (
        Settings(coalescer_prefetch=64, coalescer_file_batch_messages=64).coalescer_file_batch_messages == 64
    )


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


@pytest.mark.parametrize("host", ["127.0.0.1", "127.3.2.1", "::1", "[::1]", "localhost", "LOCALHOST"])
def test_development_defaults_apply_while_the_http_host_is_a_loopback_address(host: str) -> None:
    s = Settings(http_host=host)
    assert not s.production_guards
    assert s.sandbox_active


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.0.0.5", "chatq.example.org", ""])
def test_any_other_http_host_refuses_the_development_defaults_even_without_chatq_env(host: str) -> None:
    with pytest.raises(ValidationError) as refused:
        Settings(http_host=host)
    message = str(refused.value)
    assert "is not a loopback address" in message
    assert "guest account" in message and "local development default" in message
    assert "Set CHATQ_ENV=production with real credentials" in message
    assert "bind CHATQ_HTTP_HOST=127.0.0.1 for local development" in message


def test_a_server_host_with_real_credentials_starts_with_the_sandbox_off_unless_enabled() -> None:
    s = Settings(http_host="0.0.0.0", **SERVER_CREDENTIALS)
    assert s.env == "development"
    assert s.production_guards
    assert not s.sandbox_active
    assert Settings(http_host="0.0.0.0", sandbox_enabled=True, **SERVER_CREDENTIALS).sandbox_active


def test_a_server_host_gets_the_production_checks_of_secrets_and_admin_token() -> None:
    with pytest.raises(ValidationError, match="CHATQ_ADMIN_TOKEN must be at least 16"):
        Settings(http_host="0.0.0.0", admin_token="short", **SERVER_CREDENTIALS)
    with pytest.raises(ValidationError, match="CHATQ_AVITO_WEBHOOK_SECRET must be at least 16"):
        Settings(http_host="0.0.0.0", avito_webhook_secret="short", **SERVER_CREDENTIALS)


def test_production_on_loopback_still_refuses_the_development_defaults_and_says_so() -> None:
    with pytest.raises(ValidationError) as refused:
        Settings(env="production")
    assert "CHATQ_ENV=production refuses" in str(refused.value)
    assert not Settings(env="production", **SERVER_CREDENTIALS).sandbox_active


def test_a_refusal_does_not_print_the_values_it_was_given() -> None:
    with pytest.raises(ValidationError) as refused:
        Settings(http_host="0.0.0.0", amqp_url="amqp://guest:guest@mq/", admin_token="tiny-secret")
    assert "tiny-secret" not in str(refused.value)
    assert "amqp://" not in str(refused.value)


def test_the_launcher_makes_an_admin_token_for_local_development_only(tmp_path) -> None:
    from services.__main__ import child_environment

    env_file = str(tmp_path / ".env")
    env, token = child_environment(Settings(), {"PATH": "/bin"}, env_file)
    assert token is not None and len(token) >= 16
    assert env == {"PATH": "/bin", "CHATQ_ADMIN_TOKEN": token}
    server = Settings(http_host="0.0.0.0", **SERVER_CREDENTIALS)
    assert child_environment(server, {"PATH": "/bin"}, str(tmp_path / "server.env")) == (
        {"PATH": "/bin"},
        None,
    )
    given = Settings(admin_token="a-token-the-person-chose")
    assert child_environment(given, {"CHATQ_ADMIN_TOKEN": "a-token-the-person-chose"}, env_file) == (
        {"CHATQ_ADMIN_TOKEN": "a-token-the-person-chose"},
        None,
    )
    assert child_environment(Settings(), {}, None) == ({}, None)


def test_make_runs_admin_token_is_the_same_on_the_second_start_and_only_its_owner_reads_it(
    tmp_path,
) -> None:
    from services.__main__ import child_environment

    env_file = tmp_path / ".env"
    env_file.write_text("CHATQ_TELEGRAM_BOT_TOKEN=123:abc")  # the seller's own line, no newline
    _, first = child_environment(Settings(_env_file=env_file), {}, str(env_file))
    second_env, second = child_environment(Settings(_env_file=env_file), {}, str(env_file))
    assert first is not None and second == first
    assert second_env == {"CHATQ_TELEGRAM_BOT_TOKEN": "123:abc", "CHATQ_ADMIN_TOKEN": first}
    assert Settings(_env_file=env_file).admin_token.get_secret_value() == first
    assert env_file.read_text().count("CHATQ_ADMIN_TOKEN=") == 1
    assert env_file.read_text().startswith("CHATQ_TELEGRAM_BOT_TOKEN=123:abc\n")
    assert env_file.stat().st_mode & 0o777 == 0o600


def test_the_environment_wins_over_the_env_file(tmp_path, monkeypatch) -> None:
    from chatq.envfile import merged_environment

    monkeypatch.setenv("CHATQ_LLM_MODEL", "from-env")
    env_file = tmp_path / ".env"
    env_file.write_text("CHATQ_QUIET_SECONDS=3\nCHATQ_LLM_MODEL=from-file\nPOSTGRES_PASSWORD=not-ours\n")
    settings = Settings(_env_file=env_file)
    assert (settings.quiet_seconds, settings.llm_model) == (3, "from-env")
    assert merged_environment({"CHATQ_LLM_MODEL": "from-env"}, env_file) == {
        "CHATQ_QUIET_SECONDS": "3",
        "CHATQ_LLM_MODEL": "from-env",
    }
    assert merged_environment({}, tmp_path / "missing.env") == {}


# ---- placeholders ----------------------------------------------------------------------

GOOD_SECRET = "k3Jq9vXw2LmP8rTz"
GOOD_WHSEC = "whsec_" + base64.b64encode(b"k3Jq9vXw2LmP8rTz-a-random-key-01").decode()


def production(**values: str) -> Settings:
    return Settings(env="production", **{**SERVER_CREDENTIALS, **values})


@pytest.mark.parametrize(
    "value",
    ["CHANGE-ME-admin-token-32-characters", "changeme-0123456789abcdef", "please_Change_Me_9f8e7d6c5b"],
)
def test_a_secret_containing_change_me_in_any_spelling_or_case_is_refused(value: str) -> None:
    assert placeholder_reason(value) is not None
    with pytest.raises(ValidationError, match="like a placeholder"):
        production(admin_token=value)


def test_a_secret_containing_placeholder_is_refused() -> None:
    assert placeholder_reason("my-PLACEHOLDER-secret-42") == "contains 'placeholder'"


def test_a_secret_containing_example_is_refused() -> None:
    assert placeholder_reason("token-from-the-Example-file") == "contains 'example'"


def test_a_secret_containing_your_dash_is_refused() -> None:
    assert placeholder_reason("your-webhook-secret-here") == "contains 'your-'"


def test_a_secret_containing_four_xs_is_refused() -> None:
    assert placeholder_reason("whsec_XXXXXXXXXXXXXXXXXXXX") == "contains 'xxxx'"


def test_a_secret_made_of_one_repeated_character_is_refused() -> None:
    assert placeholder_reason("a" * 32) == "is one character repeated"
    assert placeholder_reason("whsec_" + "Q" * 24) == "is one character repeated"


def test_a_secret_of_fewer_than_eight_distinct_characters_is_refused() -> None:
    assert placeholder_reason("abcabcabcabcabcabc") == "has only 3 distinct characters (at least 8)"
    assert placeholder_reason("1234567123456712345") == "has only 7 distinct characters (at least 8)"
    assert placeholder_reason("12345678123456781234") is None


def test_a_random_secret_is_not_a_placeholder() -> None:
    import secrets

    for _ in range(200):
        assert placeholder_reason(secrets.token_urlsafe(24)) is None
    # Drawn once by token_urlsafe(24): a mixed-case run of x failed this test by chance.
    assert placeholder_reason("XefD8mHbmYc7YE2eqoQZXxxxqXP62NNS") is None
    assert placeholder_reason("abcdefghXXXXjklmnop") == "contains 'xxxx'"
    assert placeholder_reason("whsec_" + "QUJDREVGR0hJSktMTU5PUA==") is None


@pytest.mark.parametrize(
    "setting",
    [
        "telegram_webhook_secret",
        "avito_webhook_secret",
        "generic_webhook_secret",
        "generic_reply_secret",
        "alert_webhook_secret",
        "admin_token",
    ],
)
def test_every_secret_the_production_guard_checks_refuses_a_placeholder(setting: str) -> None:
    good = GOOD_WHSEC if setting in STANDARD_WEBHOOKS_SECRETS else GOOD_SECRET
    production(**{setting: good})
    with pytest.raises(ValidationError) as refused:
        production(**{setting: "CHANGE-ME-" + good})
    assert f"CHATQ_{setting.upper()} contains 'change-me', like a placeholder" in str(refused.value)
    assert "secrets.token_urlsafe" in str(refused.value)
    with pytest.raises(ValidationError, match=f"CHATQ_{setting.upper()} must be at least 16"):
        production(**{setting: "Ab3-Ab3"})


def test_database_and_amqp_passwords_that_are_placeholders_are_refused() -> None:
    with pytest.raises(ValidationError) as refused:
        Settings(
            env="production",
            database_url="postgresql://chatq:CHANGE-ME-postgres-password@postgres:5432/chatqueue",
            amqp_url="amqp://chatq:aaaaaaaa@rabbitmq:5672/",
        )
    message = str(refused.value)
    assert "CHATQ_DATABASE_URL's password contains 'change-me', like a placeholder" in message
    assert "CHATQ_AMQP_URL's password is one character repeated, like a placeholder" in message
    assert "CHANGE-ME-postgres-password" not in message


def test_a_percent_encoded_placeholder_password_is_refused_too() -> None:
    with pytest.raises(ValidationError, match="CHATQ_DATABASE_URL's password contains 'your-'"):
        production(database_url="postgresql://chatq:your%2Dpassword%2D123456@db/chatq")


def test_a_url_without_a_password_is_not_a_placeholder() -> None:
    s = production(database_url="postgresql://chatq@/chatqueue?host=/run/postgresql")
    assert s.production_guards


def test_placeholders_are_refused_on_a_server_host_without_chatq_env_too() -> None:
    with pytest.raises(ValidationError, match="CHATQ_ADMIN_TOKEN contains 'xxxx'"):
        Settings(http_host="0.0.0.0", admin_token="xxxx-xxxx-xxxx-xxxx", **SERVER_CREDENTIALS)


def test_development_on_loopback_takes_any_secret() -> None:
    assert Settings(admin_token="changeme").admin_token is not None


# ---- admin port ------------------------------------------------------------------------


def test_without_an_admin_port_the_cli_finds_the_admin_api_on_the_http_port() -> None:
    assert Settings().admin_base_url == "http://127.0.0.1:8080"
    assert Settings(http_port=9000).admin_base_url == "http://127.0.0.1:9000"


def test_with_an_admin_port_the_cli_finds_the_admin_api_there() -> None:
    assert Settings(admin_port=8081).admin_base_url == "http://127.0.0.1:8081"
    assert Settings(http_host="::1", admin_port=8081).admin_base_url == "http://[::1]:8081"
    server = Settings(http_host="0.0.0.0", admin_port=8081, **SERVER_CREDENTIALS)
    assert server.admin_base_url == "http://127.0.0.1:8081"


def test_an_explicit_admin_url_wins_over_the_ports() -> None:
    s = Settings(admin_port=8081, admin_url="https://ops.internal:4443")
    assert s.admin_base_url == "https://ops.internal:4443"


def test_the_admin_port_must_differ_from_the_http_port() -> None:
    with pytest.raises(ValidationError, match="CHATQ_ADMIN_PORT must differ from CHATQ_HTTP_PORT"):
        Settings(http_port=8080, admin_port=8080)


def test_the_admin_port_comes_from_chatq_admin_port(monkeypatch) -> None:
    monkeypatch.setenv("CHATQ_ADMIN_PORT", "8081")
    assert Settings().admin_port == 8081


def test_the_public_url_is_a_base_url_kept_without_its_trailing_slash() -> None:
    assert Settings(public_url="https://chat.example.com/").public_url == "https://chat.example.com"
    assert (
        Settings(public_url="https://shop.example.com/chatq/").public_url == "https://shop.example.com/chatq"
    )
    assert Settings(public_url="").public_url is None
    for wrong in ("chat.example.com", "ftp://chat.example.com", "https://chat.example.com/?a=1"):
        with pytest.raises(ValidationError, match="PUBLIC_URL"):
            Settings(public_url=wrong)


def test_secret_values_lists_every_secret_and_the_passwords_of_the_urls_but_not_the_urls() -> None:
    s = Settings(
        **SERVER_CREDENTIALS, telegram_bot_token="4242:AAE-token", avito_client_secret="avito-secret"
    )
    assert sorted(s.secret_values()) == sorted(
        ["4242:AAE-token", "avito-secret", "Qm7vTz2pLw9xKc4R", "Hs8dJ3kq0PzX5nVb"]
    )


def test_a_previous_admin_token_is_accepted_only_beside_a_current_one_and_is_guarded_like_it() -> None:
    with pytest.raises(ValidationError, match="ADMIN_TOKEN_PREVIOUS is accepted only beside"):
        Settings(admin_token_previous="Qm7vTz2pLw9xKc4RHs8dJ3kq0PzX5nVb")
    with pytest.raises(ValidationError, match="CHATQ_ADMIN_TOKEN_PREVIOUS"):
        Settings(
            env="production",
            **SERVER_CREDENTIALS,
            admin_token="Qm7vTz2pLw9xKc4RHs8dJ3kq0PzX5nVb",
            admin_token_previous="CHANGE-ME-admin-token",
        )


def test_telegram_chat_types_default_to_private_chats_and_take_a_comma_separated_list() -> None:
    assert Settings().telegram_chat_type_set == frozenset({"private"})
    allowed = Settings(telegram_chat_types=" Group, private ,group")
    assert allowed.telegram_chat_types == "private,group"
    assert allowed.telegram_chat_type_set == frozenset({"private", "group"})


@pytest.mark.parametrize("value", ["privat", "private,forum", "", " , "])
def test_a_chat_type_telegram_does_not_document_is_refused(value: str) -> None:
    with pytest.raises(ValidationError, match="TELEGRAM_CHAT_TYPES must list Telegram chat types"):
        Settings(telegram_chat_types=value)


def test_the_greeting_has_a_plain_default_and_must_fit_one_telegram_message(monkeypatch) -> None:
    assert Settings().greeting.startswith("Hello!")
    monkeypatch.setenv("CHATQ_GREETING", "  Hi! Ask me anything about the bike.  ")
    assert Settings().greeting == "Hi! Ask me anything about the bike."
    for value in ("   ", "x" * 4097):
        with pytest.raises(ValidationError, match="GREETING must be 1-4096 characters"):
            Settings(greeting=value)


def test_the_amqp_url_may_list_every_node_of_a_cluster_each_password_guarded_and_masked() -> None:
    nodes = "amqp://chatq:Hs8dJ3kq0PzX5nVb@mq-1/, amqp://chatq:Hs8dJ3kq0PzX5nVb@mq-2/,amqp://chatq:Wq4rT8yU1iO3pZxC@mq-3/"
    s = Settings(env="production", database_url=SERVER_CREDENTIALS["database_url"], amqp_url=nodes)
    assert s.amqp_urls() == [
        "amqp://chatq:Hs8dJ3kq0PzX5nVb@mq-1/",
        "amqp://chatq:Hs8dJ3kq0PzX5nVb@mq-2/",
        "amqp://chatq:Wq4rT8yU1iO3pZxC@mq-3/",
    ]
    assert {"Hs8dJ3kq0PzX5nVb", "Wq4rT8yU1iO3pZxC"} <= set(s.secret_values())
    with pytest.raises(ValidationError, match="CHATQ_AMQP_URL's password contains 'change-me'") as refused:
        Settings(
            env="production",
            database_url=SERVER_CREDENTIALS["database_url"],
            amqp_url=nodes + ",amqp://chatq:CHANGE-ME-password@mq-4/",
        )
    assert "Wq4rT8yU1iO3pZxC" not in str(refused.value)
    with pytest.raises(ValidationError, match="guest account"):
        Settings(
            env="production",
            database_url=SERVER_CREDENTIALS["database_url"],
            amqp_url=nodes + ",amqp://guest:guest@mq-4/",
        )


def test_an_amqp_url_list_with_something_else_in_it_is_refused_with_the_reason() -> None:
    with pytest.raises(ValidationError, match="amqp:// or amqps:// URLs, comma-separated"):
        Settings(amqp_url="amqp://u:p@mq-1/,mq-2:5672")
    with pytest.raises(ValidationError, match="CHATQ_AMQP_URL is empty"):
        Settings(amqp_url=" , ")


def test_chatq_reads_the_admin_token_from_the_env_file_and_not_without_it(tmp_path, monkeypatch) -> None:
    from chatq.cli import EXIT_UNREACHABLE, EXIT_USAGE, main

    monkeypatch.delenv("CHATQ_ADMIN_TOKEN", raising=False)
    monkeypatch.delenv("CHATQ_ADMIN_URL", raising=False)
    env_file = tmp_path / ".env"
    env_file.write_text("CHATQ_ADMIN_TOKEN=kept-by-make-run-0123456789\nCHATQ_ADMIN_URL=http://127.0.0.1:9\n")
    assert main(["--env-file", str(env_file), "stats"]) == EXIT_UNREACHABLE  # the token was found
    assert main(["--env-file", os.devnull, "stats"]) == EXIT_USAGE  # "set CHATQ_ADMIN_TOKEN"


@pytest.mark.parametrize(
    ("share", "rate", "alone"),
    [
        (16, 20.0, 16),  # the default pace: a paced flood keeps the share's own 0.8 s
        (16, 100_000.0, 64),  # unpaced: four times the share
        (16, 40.0, 32),  # in between: what the pace sends in 0.8 s
        (16, 1.0, 16),  # never below the share
        (0, 100_000.0, 0),  # no share, no larger one
    ],
)
def test_an_account_alone_gets_what_its_pace_sends_in_a_share_time_between_one_and_four_shares(
    share: int, rate: float, alone: int
) -> None:
    settings = Settings(account_jobs_in_flight=share, platform_rate_per_second=rate)
    assert settings.account_jobs_alone() == alone


def test_the_responders_pool_is_one_shared_connection_per_batch_of_jobs_plus_the_pool_size() -> None:
    assert Settings(responder_concurrency=32, responder_batch_jobs=8).pool_connections("responder") == 14
    assert Settings(responder_concurrency=33, responder_batch_jobs=8).pool_connections("responder") == 15
    assert Settings(responder_concurrency=8, database_pool_size=3).pool_connections("responder") == 4
    assert Settings(database_pool_size=3).pool_connections("coalescer") == 3


def test_the_sandbox_cannot_be_enabled_with_env_production() -> None:
    with pytest.raises(
        ValidationError, match="CHATQ_SANDBOX_ENABLED=true is refused with CHATQ_ENV=production"
    ):
        Settings(env="production", sandbox_enabled=True, **SERVER_CREDENTIALS)
    assert not Settings(env="production", **SERVER_CREDENTIALS).sandbox_active
    # Under the guards of a server host in development it may still be turned on (a dev cluster).
    assert Settings(http_host="0.0.0.0", sandbox_enabled=True, **SERVER_CREDENTIALS).sandbox_active


def test_under_the_production_guards_the_receiver_requires_an_admin_port_and_the_workers_do_not() -> None:
    production = Settings(env="production", **SERVER_CREDENTIALS)
    problem = production.receiver_problem()
    assert problem is not None and "require CHATQ_ADMIN_PORT" in problem
    server_host = Settings(http_host="0.0.0.0", **SERVER_CREDENTIALS)
    assert server_host.receiver_problem() is not None
    assert Settings(env="production", admin_port=8081, **SERVER_CREDENTIALS).receiver_problem() is None
    # Development on loopback keeps one port for everything.
    assert Settings().receiver_problem() is None


@pytest.mark.parametrize("setting", STANDARD_WEBHOOKS_SECRETS)
@pytest.mark.parametrize(
    ("value", "why"),
    [
        # 34 URL-safe characters: the library dropped - and _ and kept a 15-byte key.
        ("whsec_ab-cd_ef-gh_ij-kl_mn-op_qr-st-uv_wx", "a URL-safe - or _ would be dropped"),
        (GOOD_SECRET + "-plain-random-secret", "must start with whsec_"),
        ("whsec_" + base64.b64encode(b"sixteen-byte-key").decode(), "decodes to 16"),
    ],
    ids=["url-safe", "no prefix", "short"],
)
def test_a_standard_webhooks_secret_of_the_environment_that_is_no_key_is_refused_when_settings_are_read(
    setting: str, value: str, why: str
) -> None:
    """On main CHATQ_GENERIC_WEBHOOK_SECRET, CHATQ_GENERIC_REPLY_SECRET and
    CHATQ_ALERT_WEBHOOK_SECRET were taken as they came: the library read a secret with - or
    _ as a shorter key, in silence."""
    with pytest.raises(ValidationError) as refused:
        Settings(**{setting: value})
    assert f"CHATQ_{setting.upper()} " in str(refused.value) and why in str(refused.value)
    assert value not in str(refused.value)
    assert Settings(**{setting: GOOD_WHSEC})
