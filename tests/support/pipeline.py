"""Settings that point every service at the fake platforms, with immediate coalescing
and short retry tiers."""

from __future__ import annotations

from shared.settings import Settings
from tests.conftest import GENERIC_SECRET, replace
from tests.fakes.platforms import FakeWorld


def pipeline_settings(settings: Settings, world: FakeWorld, **overrides: object) -> Settings:
    values: dict[str, object] = {
        "quiet_seconds": 0,
        "reply_delay_min_seconds": 0,
        "reply_delay_max_seconds": 0,
        "max_wait_seconds": 0,
        "coalescer_poll_seconds": 0.1,
        "relay_poll_seconds": 0.1,
        "metrics_port": 0,
        "telegram_api_base": world.url,
        "avito_client_id": "client-1",
        "avito_client_secret": "client-secret",
        "avito_api_base": world.url,
        "generic_reply_url": f"{world.url}/generic/replies",
        "generic_reply_secret": GENERIC_SECRET,
        "alert_webhook_url": f"{world.url}/alerts",
        "alert_webhook_secret": GENERIC_SECRET,
        "platform_timeout_seconds": 1.0,
        "retry_delays_seconds": "0.3,0.6,1.2",
        "max_attempts": 4,
        "responder_concurrency": 4,
    }
    values.update(overrides)
    return replace(settings, **values)
