"""Generic replies: POST to GENERIC_REPLY_URL, signed with Standard Webhooks and carrying
an Idempotency-Key (the job id), so re-sending after a lost answer is safe."""

from __future__ import annotations

import json
from datetime import UTC, datetime

from standardwebhooks.webhooks import Webhook

from ..failures import Failure, Kind
from ..ratelimit import AccountRateLimiter
from .base import HttpClient, Sent, SentQuery, call, raise_for


class GenericPlatform:
    name = "generic"
    max_text = 4096
    idempotent = True
    can_reconcile = False

    def __init__(self, url: str, secret: str | None, client: HttpClient, limiter: AccountRateLimiter) -> None:
        self._url = url
        self._signer = Webhook(secret) if secret else None
        self._client = client
        self._limiter = limiter

    async def send(
        self, account_id: str, chat_id: str, text: str, *, key: str, business_connection_id: str | None = None
    ) -> Sent:
        body = json.dumps(
            {"account_id": account_id, "chat_id": chat_id, "text": text, "reply_id": key}, ensure_ascii=False
        )
        headers = {"content-type": "application/json", "idempotency-key": key}
        if self._signer is not None:
            now = datetime.now(UTC)
            headers.update(
                {
                    "webhook-id": key,
                    "webhook-timestamp": str(int(now.timestamp())),
                    "webhook-signature": self._signer.sign(key, now, body),
                }
            )
        response = await call(
            self._client,
            self._limiter,
            self.name,
            account_id,
            "POST",
            self._url,
            content=body.encode(),
            headers=headers,
        )
        if response.status_code == 409:
            # An idempotent receiver still working on this key: what it will do is unknown;
            # the next attempt sends again under the same key.
            raise Failure(Kind.UNKNOWN, "the receiver is still processing this reply (HTTP 409)")
        raise_for(response, response.text[:200] if not response.is_success else "", acts=True)
        try:
            data = response.json()
        except ValueError:
            data = {}
        message_id = data.get("message_id") if isinstance(data, dict) else None
        if message_id is None and not response.is_success:
            raise Failure(Kind.UNKNOWN, "no message id")
        return Sent(str(message_id or key))

    async def probe(self, account_id: str) -> None:
        """Nothing to pause: no account the receiver can refuse as a whole."""
        return None

    async def find_sent(self, query: SentQuery) -> Sent | None:
        raise NotImplementedError("generic replies are made safe by their Idempotency-Key instead")

    async def aclose(self) -> None:
        return None
