"""Process settings: one object per process, parsed in ``__main__`` and passed down.

Every setting is read from the environment with the prefix ``CHATQ_`` (design section 6).
Nothing else in the code base reads the environment.
"""

from __future__ import annotations

import ipaddress
import math
from typing import Any, Literal
from urllib.parse import unquote, urlsplit

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from shared.credentials import MAKE_WHSEC, whsec_problem
from shared.messages import JobCaps, PromptBounds
from shared.reply_url import ReplyUrlPolicy, parse_networks

LOCAL_DATABASE_URL = "postgresql://postgres@127.0.0.1:5432/chatqueue"
LOCAL_AMQP_URL = "amqp://guest:guest@127.0.0.1:5672/"

# Secrets the production guards check: each at least 16 characters and no placeholder.
GUARDED_SECRETS = (
    "telegram_webhook_secret",
    "avito_webhook_secret",
    "generic_webhook_secret",
    "generic_reply_secret",
    "alert_webhook_secret",
    "admin_token",
    "admin_token_previous",
    "secrets_key",
)
MIN_SECRET_LENGTH = 16
# Secrets the standardwebhooks library signs or verifies with: Standard Webhooks keys
# (shared.credentials.whsec_problem), checked when the settings are read.
STANDARD_WEBHOOKS_SECRETS = ("generic_webhook_secret", "generic_reply_secret", "alert_webhook_secret")
# What the example files and tutorials put where a secret goes (compared lower-case).
PLACEHOLDER_MARKS = ("change-me", "changeme", "change_me", "placeholder", "example", "your-", "xxxx")
# A random value of 16 characters from a 64-symbol alphabet has fewer than 8 distinct ones
# about once in 200,000 draws; a hand-typed stand-in ("aaaabbbb...", "12341234...") has.
MIN_DISTINCT_CHARACTERS = 8
# Database statements of one reply job (claim, intent, record), in the drain arithmetic.
JOB_BOOKKEEPING_SECONDS = 5.0
#: Every process (receiver, coalescer, responder) holds one Postgres connection outside its
#: pool, listening for account changes (``stores.accounts.registry.AccountRegistry``).
ACCOUNTS_LISTEN_CONNECTIONS = 1

#: An account alone (no other account with a window due or a reply unfinished) may keep
#: as many replies unfinished as its platform's pace sends in this time, between its share
#: (ACCOUNT_JOBS_IN_FLIGHT) and four times it: the share's own time at the default pace
#: (16 at 20/s), so another account's first window waits no longer behind a paced flood,
#: and a lone account on an unpaced platform is not held to 16 (README "Many accounts").
ALONE_SECONDS = 0.8
ALONE_MAX_SHARES = 4
GENERATE_HINT = "generate one with: python3 -c 'import secrets; print(secrets.token_urlsafe(24))'"

#: Chat.type's documented values (Bot API: "private", "group", "supergroup" or "channel").
TELEGRAM_CHAT_TYPES = ("private", "group", "supergroup", "channel")
#: What a Telegram bot command (/start, /help) gets instead of a written reply.
DEFAULT_GREETING = (
    "Hello! Write your question here (is it available, the price, delivery) and we will answer shortly."
)
#: Telegram takes up to 4096 characters a message.
MAX_GREETING_CHARS = 4096


class SettingsRefused(ValueError):
    """Settings one service cannot run with although they parse (another may): a refusal
    that explains itself, logged without a traceback (``shared.logging.startup_failures``)."""


def placeholder_reason(secret: str) -> str | None:
    """Why ``secret`` looks like a stand-in rather than a random value, or None.

    The example files' ``CHANGE-ME-...`` values are longer than any length check, so
    the guard reads what a secret is made of. A Standard Webhooks ``whsec_`` prefix is
    not counted as part of the secret."""
    lowered = secret.lower()
    for mark in PLACEHOLDER_MARKS:
        # A run of x counts in one case only ("xxxx", "XXXX"): a random token holds a mixed
        # one ("Xxxx") about once in 9,000 draws.
        found = mark in secret or mark.upper() in secret if mark == "xxxx" else mark in lowered
        if found:
            return f"contains {mark!r}"
    distinct = len(set(secret.removeprefix("whsec_")))
    if distinct == 1:
        return "is one character repeated"
    if distinct < MIN_DISTINCT_CHARACTERS:
        return f"has only {distinct} distinct characters (at least {MIN_DISTINCT_CHARACTERS})"
    return None


def amqp_addresses(value: str) -> list[str]:
    """The AMQP URLs in ``CHATQ_AMQP_URL``: one, or several comma-separated (the nodes of a
    RabbitMQ cluster, each a whole URL with its user, password and vhost)."""
    return [part.strip() for part in value.split(",") if part.strip()]


def url_password(url: str) -> str | None:
    """The password in a URL's user info, decoded; None when the URL carries none."""
    try:
        password = urlsplit(url).password
    except ValueError:
        return None
    return unquote(password) if password else None


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine only: ``localhost``, 127.0.0.0/8 or ::1."""
    name = host.strip().strip("[]").rstrip(".").lower()
    if name == "localhost":
        return True
    try:
        address = ipaddress.ip_address(name)
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped.is_loopback
    return address.is_loopback


class Settings(BaseSettings):
    """All chatqueue settings. Defaults are for local development only.

    The production guards (``production_guards``) apply with ``CHATQ_ENV=production``
    and also whenever the HTTP host is not a loopback address: then the validator
    refuses the local defaults (guest credentials, trust-auth Postgres) and weak
    secrets, and the sandbox is off unless enabled.
    """

    model_config = SettingsConfigDict(
        env_prefix="CHATQ_", extra="ignore", frozen=True, hide_input_in_errors=True
    )

    env: Literal["development", "production"] = "development"
    log_level: str = "INFO"
    # text: one readable line an event; json: one JSON object a line (time with its
    # offset, level, logger, message, operation or job id, traceback as one field).
    log_format: Literal["text", "json"] = "text"

    database_url: SecretStr = SecretStr(LOCAL_DATABASE_URL)
    database_pool_size: int = Field(default=10, ge=1, le=200)
    # Intake group commit: concurrent webhooks written in one statement (1: one each).
    intake_batch_rows: int = Field(default=64, ge=1, le=1000)
    intake_batch_window_ms: float = Field(default=2.0, ge=0, le=50)
    amqp_url: SecretStr = SecretStr(LOCAL_AMQP_URL)
    migrate_on_start: bool = True

    # Platforms
    telegram_bot_token: SecretStr | None = None
    telegram_webhook_secret: SecretStr | None = None
    telegram_api_base: str = "https://api.telegram.org"
    # The Telegram chat types the bot answers (comma-separated Chat.type values); messages in
    # any other chat are stored as ignored with the reason.
    telegram_chat_types: str = "private"
    avito_client_id: str | None = None
    avito_client_secret: SecretStr | None = None
    avito_webhook_secret: SecretStr | None = None
    avito_api_base: str = "https://api.avito.ru"
    # How often one receiver replica reads the Avito accounts' unread chats for buyer
    # messages whose webhook never came (0: never; also once at start-up).
    avito_poll_seconds: float = Field(default=60.0, ge=0)
    # When an Avito account is first polled (connected), only buyer messages this recent are
    # answered; older ones are recorded and left to the seller (0: none).
    avito_backfill_seconds: float = Field(default=3600.0, ge=0, le=86400)
    # One request budget per Avito account, shared by the poll and the sends of every
    # process (Avito counts per minute; X-RateLimit-Limit, when Avito states it, wins).
    avito_requests_per_minute: int = Field(default=300, ge=1, le=100_000)
    generic_webhook_secret: SecretStr | None = None
    generic_reply_url: str | None = None
    generic_reply_secret: SecretStr | None = None
    # Where an added generic account's reply_url may point beyond the public internet
    # (shared/reply_url.py): host names as written in the URL, and CIDR networks,
    # comma-separated. Empty: public addresses only.
    reply_url_allow_hosts: str = ""
    reply_url_allow_networks: str = ""

    # Accounts as data (README "Many accounts"): the Fernet keys that encrypt the accounts'
    # credentials in Postgres, comma-separated; the first encrypts, every one decrypts. Or a
    # file holding them (read again at each refresh: a rotation needs no restart).
    secrets_key: SecretStr | None = None
    secrets_key_file: str | None = None
    # How often each process reads the accounts again (a change also tells them at once).
    accounts_refresh_seconds: float = Field(default=30.0, gt=0)

    # Reply logic
    llm_base_url: str | None = None
    llm_api_key: SecretStr | None = None
    llm_model: str = "gpt-4o-mini"
    llm_timeout_seconds: float = Field(default=20.0, gt=0)
    facts_file: str | None = None
    # The folder an account's facts_file override names a file in (None: accounts give
    # their facts as text). Nothing outside it is read for an account.
    facts_dir: str | None = None
    # The answer to a Telegram bot command (/start), sent without asking the model.
    greeting: str = DEFAULT_GREETING
    # A message the bot cannot read alone (a voice note or a file without words): 'person'
    # hands it to a person (needs_review, with the reason); 'answer' lets the bot answer its
    # placeholder ("[voice message, 12 s]"), e.g. asking the buyer to write. Per account too.
    unreadable_messages: Literal["person", "answer"] = "person"

    # Coalescing (design section 4)
    quiet_seconds: float = Field(default=8.0, ge=0)
    reply_delay_min_seconds: float = Field(default=20.0, ge=0)
    reply_delay_max_seconds: float = Field(default=60.0, ge=0)
    max_wait_seconds: float = Field(default=120.0, ge=0)
    coalescer_prefetch: int = Field(default=128, ge=1, le=5000)
    # Filing in batches: the inbound messages delivered together, up to this many, filed
    # in one transaction and acked with one ack (1: one each).
    coalescer_file_batch_messages: int = Field(default=64, ge=1, le=1000)
    coalescer_file_batch_wait_ms: float = Field(default=2.0, ge=0, le=50)
    coalescer_poll_seconds: float = Field(default=0.5, gt=0)
    coalescer_batch_size: int = Field(default=200, ge=1, le=5000)
    # The most one reply job carries; the rest of a window waits for the chat's next job.
    job_max_messages: int = Field(default=50, ge=1, le=1000)
    job_max_text_chars: int = Field(default=8000, ge=100, le=1_000_000)

    # Responder
    retry_delays_seconds: str = "1,10,60,300"
    max_attempts: int = Field(default=5, ge=1)
    responder_concurrency: int = Field(default=32, ge=1, le=1000)
    # Jobs in flight that share one Postgres connection, their claims, delivery intents and
    # records sent as one statement each (1: a connection per job, a statement per step).
    responder_batch_jobs: int = Field(default=32, ge=1, le=1000)
    platform_timeout_seconds: float = Field(default=10.0, gt=0)
    platform_rate_per_second: float = Field(default=20.0, gt=0)
    fold_max_rounds: int = Field(default=2, ge=0, le=10)
    history_messages: int = Field(default=12, ge=0, le=200)
    # What reaches the model, in characters: each turn (a buyer message, a history turn),
    # the history, the whole prompt (system prompt, history and the buyer's turn). What is
    # cut is said in the operation's record (services/responder/llm.py bound_prompt).
    llm_max_turn_chars: int = Field(default=4000, ge=100, le=1_000_000)
    llm_max_history_chars: int = Field(default=8000, ge=0, le=1_000_000)
    llm_max_prompt_chars: int = Field(default=32000, ge=1000, le=2_000_000)
    # A reply that repeats this many characters of the seller's instructions to the model
    # verbatim (or holds a secret) is not sent: a person reads it (services/responder/reply_check.py).
    reply_leak_run_chars: int = Field(default=60, ge=20, le=10_000)
    review_owner: str = "on-call"
    # When the seller answers a chat in person, the bot stays out of it this long (0: it
    # withdraws its pending replies but does not step back).
    takeover_seconds: float = Field(default=3600.0, ge=0)
    # Fair share between accounts: the most reply jobs of one account emitted and not yet
    # finished; its other due windows wait in Postgres (0: no limit). README "Many accounts".
    account_jobs_in_flight: int = Field(default=16, ge=0, le=100_000)
    # An account the platform refused as a whole is asked again this often.
    account_probe_seconds: float = Field(default=60.0, gt=0)
    # A reply whose send's answer was lost, on a platform that echoes replies back and
    # cannot be asked (Telegram Business), waits this long for the echo before a person
    # is asked.
    echo_wait_seconds: float = Field(default=30.0, ge=0, le=3600)

    # The deployment's public base URL, as the platforms reach the receiver (HTTPS): what
    # ``chatq connect`` registers and ``chatq doctor`` compares against.
    public_url: str | None = None

    # Operations
    admin_token: SecretStr | None = None
    # During a rotation, the token being replaced: accepted beside ADMIN_TOKEN until every
    # client has the new one, then unset (docs/deploying.md "Rotating secrets").
    admin_token_previous: SecretStr | None = None
    # Where the chatq CLI finds the admin API; unset: this machine's ADMIN_PORT, else HTTP_PORT.
    admin_url: str | None = None
    # The built-in sandbox chat: on in development, off under the production guards unless
    # enabled; never with CHATQ_ENV=production.
    sandbox_enabled: bool | None = None
    alert_webhook_url: str | None = None
    alert_webhook_secret: SecretStr | None = None
    http_host: str = "127.0.0.1"
    http_port: int = Field(default=8080, ge=0, le=65535)
    # Unset: the admin API, /metrics, /ops and /sandbox share HTTP_PORT with the webhooks.
    # Set: they move to this port and HTTP_PORT serves the webhooks and health checks only.
    admin_port: int | None = Field(default=None, ge=1, le=65535)
    metrics_port: int = Field(default=9100, ge=0, le=65535)
    # Per-account metrics (an `account` label: one series per account, so opt-in).
    metrics_account_label: bool = False

    # Slow clients (services/receiver/deadlines.py): a request's headers must arrive within
    # HTTP_HEADER_TIMEOUT_SECONDS of its first byte (or of the connection), its body within
    # HTTP_BODY_TIMEOUT_SECONDS of the headers, else 408 and the connection closed; past
    # HTTP_LIMIT_CONCURRENCY connections or requests on one port a request gets 503 at once.
    http_header_timeout_seconds: float = Field(default=10.0, gt=0, le=300)
    http_body_timeout_seconds: float = Field(default=20.0, gt=0, le=300)
    http_limit_concurrency: int = Field(default=1000, ge=1, le=100_000)

    # Intake
    max_body_bytes: int = Field(default=256 * 1024, ge=1024)
    # While Postgres is unreachable a webhook is held this long, its store tried again,
    # before a 503 asks the platform to send it again (README "When Postgres is down"):
    # under Telegram's ~60 s wait for an answer. Avito's are held 1.5 s at most (it wants
    # an answer within 2 s). 0: a 503 at once.
    webhook_hold_seconds: float = Field(default=50.0, ge=0, le=600)

    # Relay
    relay_enabled: bool = True
    relay_batch_size: int = Field(default=200, ge=1, le=5000)
    relay_poll_seconds: float = Field(default=1.0, gt=0)
    relay_retention_seconds: float = Field(default=24 * 3600, ge=0)
    relay_purge_interval_seconds: float = Field(default=60.0, gt=0)

    # Keeping every promise: a consumer holding a message this long without settling it
    # is reported unready; a reply job in flight untouched this long with no responder
    # holding it is published again; finished rows are purged after RETENTION_DAYS (0: never).
    consumer_stall_seconds: float = Field(default=300.0, gt=0)
    # A handler's unexpected error (a bug, a poison input) is requeued after this pause,
    # up to the queue's delivery limit, so a crash loop does not spin the CPU.
    requeue_pause_seconds: float = Field(default=1.0, ge=0, le=60)
    stuck_job_seconds: float = Field(default=900.0, gt=0)
    # How often the coalescer looks for such jobs.
    stuck_job_sweep_seconds: float = Field(default=60.0, gt=0)
    retention_days: float = Field(default=30.0, ge=0)
    retention_interval_seconds: float = Field(default=300.0, gt=0)

    # Draining on SIGTERM: how long in-flight work may take before the process exits.
    shutdown_grace_seconds: float = Field(default=20.0, ge=0)

    # Testing: a named fault point kills the process with SIGKILL when reached.
    fault_point: str | None = None

    def unreadable_policy(self, account: Any = None) -> str:
        """What the bot does with a message it cannot read alone, for ``account`` (an
        ``stores.accounts.registry.Account``): its own override, else UNREADABLE_MESSAGES."""
        override = account.override("unreadable_messages") if account is not None else None
        return str(override or self.unreadable_messages)

    @field_validator("telegram_webhook_secret")
    @classmethod
    def _telegram_secret_charset(cls, v: SecretStr | None) -> SecretStr | None:
        if v is None:
            return v
        raw = v.get_secret_value()
        outside = sum(1 for c in raw if not (c.isascii() and (c.isalnum() or c in "_-")))
        if 1 <= len(raw) <= 256 and not outside:
            return v
        # The value itself is never echoed: it is a secret.
        what = (
            f"it has {len(raw)} characters"
            if outside == 0
            else f"{outside} of its characters are not allowed"
        )
        raise ValueError(
            "CHATQ_TELEGRAM_WEBHOOK_SECRET must be 1-256 characters of A-Z a-z 0-9 _ - (Telegram's rule "
            f"for setWebhook's secret_token); {what}. {GENERATE_HINT}"
        )

    @field_validator("secrets_key")
    @classmethod
    def _secrets_keys_are_fernet_keys(cls, v: SecretStr | None) -> SecretStr | None:
        if v is None:
            return v
        from shared.secretbox import parse_keys

        parse_keys(v.get_secret_value())  # raises ValueError naming what is wrong, never the key
        return v

    @field_validator("reply_url_allow_networks")
    @classmethod
    def _reply_url_networks_are_networks(cls, v: str) -> str:
        parse_networks(v)  # raises ValueError naming the one that is not
        return v

    def reply_url_policy(self) -> ReplyUrlPolicy:
        """Where an added generic account's reply_url may point (shared/reply_url.py)."""
        return ReplyUrlPolicy.of(self.reply_url_allow_hosts, self.reply_url_allow_networks)

    @field_validator("telegram_chat_types")
    @classmethod
    def _telegram_chat_types_are_documented(cls, v: str) -> str:
        types = [t.strip().lower() for t in v.split(",") if t.strip()]
        unknown = [t for t in types if t not in TELEGRAM_CHAT_TYPES]
        if not types or unknown:
            raise ValueError(
                f"TELEGRAM_CHAT_TYPES must list Telegram chat types ({', '.join(TELEGRAM_CHAT_TYPES)}), "
                f"comma-separated; not {', '.join(unknown) or 'nothing'}"
            )
        return ",".join(t for t in TELEGRAM_CHAT_TYPES if t in types)

    @field_validator("amqp_url")
    @classmethod
    def _amqp_urls_are_urls(cls, v: SecretStr) -> SecretStr:
        addresses = amqp_addresses(v.get_secret_value())
        if not addresses:
            raise ValueError("CHATQ_AMQP_URL is empty: give RabbitMQ's URL (or several, comma-separated)")
        for address in addresses:
            parts = urlsplit(address)
            if parts.scheme not in ("amqp", "amqps") or not parts.hostname:
                raise ValueError(
                    "CHATQ_AMQP_URL takes amqp:// or amqps:// URLs, comma-separated for the nodes of a "
                    f"cluster; one of them is {parts.scheme or 'not'} a URL with a host"
                )
        return v

    @field_validator("greeting")
    @classmethod
    def _greeting_fits_a_message(cls, v: str) -> str:
        v = v.strip()
        if not v or len(v) > MAX_GREETING_CHARS:
            raise ValueError(f"GREETING must be 1-{MAX_GREETING_CHARS} characters")
        return v

    @field_validator("public_url")
    @classmethod
    def _public_url_is_a_base_url(cls, v: str | None) -> str | None:
        if v is None or not v.strip():
            return None
        v = v.strip().rstrip("/")
        parts = urlsplit(v)
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
            raise ValueError(
                "PUBLIC_URL must be the deployment's base URL, like https://chat.example.com (no query)"
            )
        return v

    @model_validator(mode="after")
    def _coherent(self) -> Settings:
        if self.reply_delay_min_seconds > self.reply_delay_max_seconds:
            raise ValueError("REPLY_DELAY_MIN_SECONDS must not exceed REPLY_DELAY_MAX_SECONDS")
        delays = self.retry_delays()  # validates the list
        if self.stuck_job_seconds <= max(delays):
            raise ValueError("STUCK_JOB_SECONDS must exceed the longest retry delay (RETRY_DELAYS_SECONDS)")
        if self.admin_token_previous is not None and self.admin_token is None:
            raise ValueError("CHATQ_ADMIN_TOKEN_PREVIOUS is accepted only beside CHATQ_ADMIN_TOKEN")
        if self.coalescer_file_batch_messages > self.coalescer_prefetch:
            raise ValueError(
                "CHATQ_COALESCER_FILE_BATCH_MESSAGES must not exceed CHATQ_COALESCER_PREFETCH "
                "(a batch holds only messages the broker has delivered)"
            )
        if self.admin_port is not None and self.admin_port == self.http_port:
            raise ValueError("CHATQ_ADMIN_PORT must differ from CHATQ_HTTP_PORT (unset it to share one port)")
        if self.env == "production" and self.sandbox_enabled:
            raise ValueError(
                "CHATQ_SANDBOX_ENABLED=true is refused with CHATQ_ENV=production: the sandbox takes "
                "messages from anyone who reaches it (unset it, or run the sandbox in development)"
            )
        if self.production_guards:
            problems = self._production_problems()
            if problems:
                raise ValueError(self._production_refusal(problems))
        # After the production guards, which say first that a value is a placeholder.
        for setting in STANDARD_WEBHOOKS_SECRETS:
            value = getattr(self, setting)
            if value is not None and (why := whsec_problem(value.get_secret_value())):
                # The library would drop what is not base64 in silence (a weaker key) or fail
                # at the first request; the reason names the rule, never the value.
                raise ValueError(f"CHATQ_{setting.upper()} {why}; {MAKE_WHSEC}")
        return self

    def _production_problems(self) -> list[str]:
        problems = []
        amqp_url = self.amqp_url.get_secret_value()
        database_url = self.database_url.get_secret_value()
        if "guest:guest@" in amqp_url:
            problems.append("CHATQ_AMQP_URL uses the guest account; set real credentials")
        if database_url == LOCAL_DATABASE_URL:
            problems.append("CHATQ_DATABASE_URL is the local development default (trust authentication)")
        weak = []
        urls = [("CHATQ_DATABASE_URL", database_url)]
        urls += [("CHATQ_AMQP_URL", url) for url in amqp_addresses(amqp_url)]
        for name, url in urls:
            password = url_password(url)
            if password and "guest:guest@" not in url and (reason := placeholder_reason(password)):
                if (problem := f"{name}'s password {reason}, like a placeholder") not in weak:
                    weak.append(problem)
        for setting in GUARDED_SECRETS:
            value = getattr(self, setting)
            if value is None:
                continue
            secret, name = value.get_secret_value(), f"CHATQ_{setting.upper()}"
            if len(secret) < MIN_SECRET_LENGTH:
                weak.append(f"{name} must be at least {MIN_SECRET_LENGTH} characters")
            elif reason := placeholder_reason(secret):
                weak.append(f"{name} {reason}, like a placeholder")
        if weak:
            problems += [*weak, GENERATE_HINT]
        return problems

    def _production_refusal(self, problems: list[str]) -> str:
        listed = "; ".join(problems)
        if self.env == "production":
            return f"CHATQ_ENV=production refuses: {listed}. Set real credentials and secrets."
        return (
            f"CHATQ_HTTP_HOST={self.http_host} is not a loopback address, so the production guards "
            f"apply although CHATQ_ENV is development: {listed}. Set CHATQ_ENV=production with real "
            "credentials and secrets, or bind CHATQ_HTTP_HOST=127.0.0.1 for local development."
        )

    @property
    def production_guards(self) -> bool:
        """Whether the production checks and defaults apply: with CHATQ_ENV=production, and
        whenever the HTTP host is not a loopback address, so that a server where
        CHATQ_ENV was forgotten does not run with the sandbox open and the development
        credentials accepted. Development defaults need a host only this machine reaches."""
        return self.env == "production" or not is_loopback(self.http_host)

    def retry_delays(self) -> list[float]:
        """Delays of the retry tiers, in seconds, from RETRY_DELAYS_SECONDS."""
        try:
            delays = [float(p) for p in self.retry_delays_seconds.split(",") if p.strip()]
        except ValueError as exc:
            raise ValueError("RETRY_DELAYS_SECONDS must be a comma-separated list of seconds") from exc
        if not delays or any(d <= 0 for d in delays):
            raise ValueError("RETRY_DELAYS_SECONDS needs at least one positive delay")
        return delays

    @property
    def sandbox_active(self) -> bool:
        """Never with CHATQ_ENV=production; else SANDBOX_ENABLED when set, otherwise on in
        development and off under the production guards."""
        if self.env == "production":
            return False
        return self.sandbox_enabled if self.sandbox_enabled is not None else not self.production_guards

    def receiver_problem(self) -> str | None:
        """Why the receiver refuses to start with these settings, or None: under the
        production guards the admin surface (admin and accounts API, /metrics, /ops,
        /openapi.json, the sandbox) never shares the public port with the webhooks, so
        CHATQ_ADMIN_PORT is required. Only the receiver serves HTTP on HTTP_PORT, so the
        coalescer and responder do not need it."""
        if self.production_guards and self.admin_port is None:
            return (
                "the production guards require CHATQ_ADMIN_PORT for the receiver: the admin and "
                "accounts API, /metrics, /ops, /openapi.json and the sandbox are never served on "
                f"the public port CHATQ_HTTP_PORT={self.http_port}; set CHATQ_ADMIN_PORT (e.g. 8081) "
                "and keep it off the load balancer"
            )
        return None

    @property
    def admin_base_url(self) -> str:
        """ADMIN_URL, or the admin API of a receiver on this machine with these settings."""
        if self.admin_url:
            return self.admin_url
        # A receiver bound to every address is reached on loopback; an IPv6 literal in brackets.
        host = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(
            self.http_host.strip("[]"), self.http_host.strip("[]")
        )
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.admin_port or self.http_port}"

    def secret_values(self) -> list[str]:
        """Every secret these settings hold (tokens, secrets, URL passwords), so that what
        a command prints can be checked for them and masked."""
        values = [
            v.get_secret_value()
            for name in type(self).model_fields
            if name not in ("database_url", "amqp_url")
            and isinstance(v := getattr(self, name), SecretStr)
            and v.get_secret_value()
        ]
        for url in (self.database_url.get_secret_value(), *self.amqp_urls()):
            if (password := url_password(url)) and password not in values:
                values.append(password)
        return values

    def amqp_urls(self) -> list[str]:
        """RabbitMQ's address, or each node's of a cluster (CHATQ_AMQP_URL, comma-separated)."""
        return amqp_addresses(self.amqp_url.get_secret_value())

    @property
    def telegram_account_id(self) -> str:
        """The bot's id: the part of the bot token before the colon ("bot" without a token)."""
        if self.telegram_bot_token is None:
            return "bot"
        return self.telegram_bot_token.get_secret_value().split(":", 1)[0] or "bot"

    def worst_case_job_seconds(self) -> float:
        """The longest one reply job can run once a responder took it, so the shortest
        SHUTDOWN_GRACE_SECONDS that never cuts a send mid-flight (docs/deploying.md "Grace periods"):
        the first generation and FOLD_MAX_ROUNDS regenerations at LLM_TIMEOUT_SECONDS
        each, the wait for a send slot (RESPONDER_CONCURRENCY sends ahead of it at
        PLATFORM_RATE_PER_SECOND), the send at PLATFORM_TIMEOUT_SECONDS, and
        JOB_BOOKKEEPING_SECONDS for its database statements."""
        return (
            self.llm_timeout_seconds * (self.fold_max_rounds + 1)
            + self.responder_concurrency / self.platform_rate_per_second
            + self.platform_timeout_seconds
            + JOB_BOOKKEEPING_SECONDS
        )

    def account_jobs_alone(self) -> int:
        """The fair share of an account alone (``ALONE_SECONDS``); 0: no share."""
        share = self.account_jobs_in_flight
        paced = math.ceil(self.platform_rate_per_second * ALONE_SECONDS)
        return min(ALONE_MAX_SHARES * share, max(share, paced))

    def pool_connections(self, service: str) -> int:
        """The most connections the pool of one process of ``service`` opens:
        DATABASE_POOL_SIZE, and for the responder one more for every RESPONDER_BATCH_JOBS
        jobs in flight: they share it for their claims and records all along
        (stores/jobs/batches.py), while their other queries (listings, tokens,
        hooks) borrow from the DATABASE_POOL_SIZE beside them for a statement."""
        if service == "responder":
            return math.ceil(self.responder_concurrency / self.responder_batch_jobs) + self.database_pool_size
        return self.database_pool_size

    def database_connections(self, service: str) -> int:
        """The most Postgres connections one process of ``service`` holds: its pool's, and
        the one outside it that listens for account changes (``stores.accounts.registry``)."""
        return self.pool_connections(service) + ACCOUNTS_LISTEN_CONNECTIONS

    @property
    def telegram_chat_type_set(self) -> frozenset[str]:
        """TELEGRAM_CHAT_TYPES as a set of Chat.type values."""
        return frozenset(self.telegram_chat_types.split(","))

    def prompt_bounds(self) -> PromptBounds:
        return PromptBounds(self.llm_max_turn_chars, self.llm_max_history_chars, self.llm_max_prompt_chars)

    def job_caps(self) -> JobCaps:
        return JobCaps(messages=self.job_max_messages, chars=self.job_max_text_chars)
