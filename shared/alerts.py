"""Announcing failed and needs_review jobs to a person: a signed POST to
ALERT_WEBHOOK_URL (Standard Webhooks, ALERT_WEBHOOK_SECRET). Best effort with a short
timeout: the state is already in Postgres, visible in the API and counted in metrics,
so an alert that cannot be delivered is logged and counted, never retried forever."""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime
from typing import Any

import httpx
from prometheus_client import Counter
from standardwebhooks.webhooks import Webhook

logger = logging.getLogger(__name__)

ALERTS = Counter("chatq_alerts_total", "Alerts announced, by event and outcome.", ["event", "outcome"])


class Alerter:
    def __init__(self, url: str | None, secret: str | None, client: httpx.AsyncClient) -> None:
        self._url = url
        self._signer = Webhook(secret) if secret else None
        self._client = client

    async def announce(self, event: str, payload: dict[str, Any]) -> str:
        """Deliver one alert; returns the outcome ("sent", "not_configured", "http_<status>"
        or the transport error's name), also counted in chatq_alerts_total."""
        if not self._url:
            ALERTS.labels(event=event, outcome="not_configured").inc()
            logger.warning("%s: %s (no ALERT_WEBHOOK_URL configured)", event, payload.get("reason"))
            return "not_configured"
        now = datetime.now(UTC)
        subject = payload.get("job_id") or ",".join(payload.get("operations") or ())[:200]
        alert_id = f"{event}:{subject}"
        body = json.dumps({"type": event, "at": now.isoformat(), **payload}, default=str, ensure_ascii=False)
        headers = {"content-type": "application/json"}
        if self._signer is not None:
            headers.update(
                {
                    "webhook-id": alert_id,
                    "webhook-timestamp": str(int(now.timestamp())),
                    "webhook-signature": self._signer.sign(alert_id, now, body),
                }
            )
        try:
            response = await self._client.post(self._url, content=body.encode(), headers=headers, timeout=5)
            outcome = "sent" if response.is_success else f"http_{response.status_code}"
        except httpx.HTTPError as exc:
            outcome = type(exc).__name__
        ALERTS.labels(event=event, outcome=outcome).inc()
        if outcome != "sent":
            logger.warning("alert %s could not be delivered (%s)", alert_id, outcome)
        return outcome
