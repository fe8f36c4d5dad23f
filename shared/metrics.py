"""Prometheus metrics (design section 8). Names are a contract: dashboards and alerts
use them. No chat, message or operation ids as labels."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
REPLY_BUCKETS = (0.5, 1, 2.5, 5, 10, 20, 30, 45, 60, 90, 120, 180, 300, 600, 1800, 3600)

WEBHOOKS = Counter(
    "chatq_webhooks_total",
    "Webhook deliveries by platform and outcome (accepted, duplicate, ignored, rejected; unavailable: a 503 "
    "while Postgres was away, sent again by the platform).",
    ["platform", "outcome"],
)
WEBHOOK_SECONDS = Histogram(
    "chatq_webhook_seconds",
    "Time from a webhook's arrival to its durable answer.",
    ["platform"],
    buckets=LATENCY_BUCKETS,
)
INTAKE_BATCH_ROWS = Histogram(
    "chatq_intake_batch_rows",
    "Webhook rows written by one committed intake statement (group commit).",
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
)
ACK_MESSAGES = Histogram(
    "chatq_consumer_ack_messages",
    "Messages settled by one ack (a multiple ack covers a whole batch), by queue.",
    ["queue"],
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
)
OPERATIONS = Counter(
    "chatq_operations_total",
    "Operations reaching a final state, by outcome (replied, failed, needs_review, ignored).",
    ["outcome"],
)
RETRIES = Counter("chatq_retries_total", "Retries scheduled, by reason.", ["reason"])
RECEIPT_TO_REPLY = Histogram(
    "chatq_receipt_to_reply_seconds",
    "Time from receiving a buyer's message to the platform accepting the reply.",
    buckets=REPLY_BUCKETS,
)
BACKLOG = Gauge("chatq_backlog", "Unfinished operations by state.", ["state"])
OLDEST_UNFINISHED = Gauge(
    "chatq_oldest_unfinished_age_seconds", "Age of the oldest unfinished operation by state.", ["state"]
)
OUTBOX_PENDING = Gauge("chatq_outbox_pending", "Outbox rows not yet confirmed by the broker.")
OUTBOX_LAG = Gauge(
    "chatq_outbox_lag_seconds", "Age of the oldest outbox row not yet confirmed by the broker."
)
OUTBOX_PUBLISH_DELAY = Histogram(
    "chatq_outbox_publish_delay_seconds",
    "Time from an outbox row's insert to the broker's confirm.",
    buckets=LATENCY_BUCKETS,
)
OUTBOX_PUBLISHED = Counter("chatq_outbox_published_total", "Outbox rows confirmed by the broker.")
OUTBOX_PUBLISH_ERRORS = Counter(
    "chatq_outbox_publish_errors_total", "Outbox publishes that failed, by reason.", ["reason"]
)
LLM_SECONDS = Histogram(
    "chatq_llm_request_seconds", "Reply generation time.", ["outcome"], buckets=LATENCY_BUCKETS
)
PLATFORM_SECONDS = Histogram(
    "chatq_platform_request_seconds",
    "Platform API request time by platform and outcome.",
    ["platform", "outcome"],
    buckets=LATENCY_BUCKETS,
)
DEAD_LETTERS = Counter(
    "chatq_dead_letters_total",
    "Messages that reached a dead-letter queue and were recorded, by queue.",
    ["queue"],
)
CONSUMER_OLDEST_UNSETTLED = Gauge(
    "chatq_consumer_oldest_unsettled_seconds",
    "How long the oldest message a consumer holds has waited to be settled (0: none held).",
    ["queue"],
)
JOBS_REDRIVEN = Counter(
    "chatq_jobs_redriven_total", "Reply jobs in flight that nobody held past the bound, published again."
)
# Per account, only with METRICS_ACCOUNT_LABEL (each account is a series: thousands of
# accounts are thousands of series). The totals above never carry an account.
ACCOUNT_WEBHOOKS = Counter(
    "chatq_account_webhooks_total",
    "Webhook deliveries by account (METRICS_ACCOUNT_LABEL only).",
    ["platform", "account", "outcome"],
)
ACCOUNT_REPLIES = Counter(
    "chatq_account_replies_total",
    "Replies sent by account (METRICS_ACCOUNT_LABEL only).",
    ["platform", "account"],
)
ACCOUNT_BACKLOG = Gauge(
    "chatq_account_backlog",
    "Unfinished operations of each account with any (METRICS_ACCOUNT_LABEL only).",
    ["platform", "account"],
)
LLM_TOKENS = Counter(
    "chatq_llm_tokens_total",
    "Model tokens by platform, account (its id with METRICS_ACCOUNT_LABEL, else empty: one series a "
    "platform) and kind (prompt, completion), as the model counted them: a seller's cost.",
    ["platform", "account", "kind"],
)
RECOVERED_MESSAGES = Counter(
    "chatq_recovered_messages_total",
    "Messages a poll found that no webhook had brought, stored through the webhook's intake, by platform.",
    ["platform"],
)
RETENTION_PURGED = Counter(
    "chatq_retention_purged_total", "Finished rows deleted by the retention rule, by table.", ["table"]
)
# Seeing a Postgres outage (issue 40): gauges read from Postgres keep their last value while
# it is away, so each set says when it was last refreshed; readiness is exported per check
# (re-evaluated every few seconds, not only when a probe asks); and work retried in the
# process because Postgres or the network failed under it is counted.
GAUGES_REFRESHED = Gauge(
    "chatq_gauges_refreshed_timestamp_seconds",
    "When a set of gauges read from Postgres was last refreshed (Unix time), by set: backlog "
    "(chatq_backlog, chatq_oldest_unfinished_age_seconds), outbox (chatq_outbox_pending, chatq_outbox_lag_seconds).",
    ["gauges"],
)
SECRETS_KEY_FILE_INVALID = Gauge(
    "chatq_secrets_key_file_invalid",
    "1 while CHATQ_SECRETS_KEY_FILE cannot be used (not Fernet keys): the keys read before stay in use.",
)
READY = Gauge(
    "chatq_ready",
    "Readiness per check, as /readyz judges it (1 ok, 0 failing): postgres, rabbitmq, progress.",
    ["check"],
)
IN_PROCESS_RETRIES = Counter(
    "chatq_in_process_retries_total",
    "Work retried in the process because Postgres or the network failed under it, by where "
    "(a consumer's queue, the outbox relay, the webhook intake) and error class.",
    ["where", "error"],
)


# Label values known before any event. A counter child born at its first event has no
# earlier sample, so increase() and rate() cannot see that event: a pod's first failure
# or retry would be invisible to the alerts. Each service creates these children at 0
# when it starts (``create_known_series``).
WEBHOOK_OUTCOMES = ("accepted", "duplicate", "ignored", "rejected", "unavailable")
# The responder's retry reasons (RetryLater kinds in services/responder/handler.py; a
# unit test keeps the two lists equal): "<stage>_transient" for the model and each
# platform, and the reasons that are not a stage's failure.
SETTLED_BY_ECHO = Counter(
    "chatq_sends_settled_by_echo_total",
    "Sends whose answer was lost that the platform's echo of the reply showed were sent, by platform "
    "(before a person was asked, by the responder; after, by the receiver).",
    ["platform"],
)
RETRY_REASONS = (
    "unknown_outcome",
    "reconcile",
    "reconcile_wait",
    "account_paused",
    "connection_paused",
    "echo_wait",
    "busy",
)


def create_known_series(service: str, platforms: Iterable[str] = ()) -> None:
    """Create at 0 the label children of the counters ``service`` increments that alerts
    and dashboards read with increase(): the receiver's webhooks per platform, the
    coalescer's and responder's outcomes, retries and dead letters."""
    if service == "receiver":
        for platform in platforms:
            for outcome in WEBHOOK_OUTCOMES:
                WEBHOOKS.labels(platform=platform, outcome=outcome)
        WEBHOOKS.labels(platform="avito", outcome="no_payload")
        RECOVERED_MESSAGES.labels(platform="avito")
        RETRIES.labels(reason="person")
    elif service == "coalescer":
        OPERATIONS.labels(outcome="failed")
        DEAD_LETTERS.labels(queue="chatq.coalescer.dead")
    elif service == "responder":
        for outcome in ("replied", "failed", "needs_review"):
            OPERATIONS.labels(outcome=outcome)
        for stage in ("model", *platforms):
            RETRIES.labels(reason=f"{stage}_transient")
        for reason in RETRY_REASONS:
            RETRIES.labels(reason=reason)
        DEAD_LETTERS.labels(queue="chatq.responder.dead")
    else:
        raise ValueError(f"no known series for service {service!r}")
