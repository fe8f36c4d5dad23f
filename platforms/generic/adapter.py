"""Generic replies: POST to GENERIC_REPLY_URL, signed with Standard Webhooks and carrying
an Idempotency-Key (the job id), so re-sending after a lost answer is safe."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from datetime import UTC, datetime

from standardwebhooks.webhooks import Webhook

from platforms.base import Answer, HttpClient, Sent, SentQuery, call, raise_for
from platforms.failures import Failure, Kind
from platforms.ratelimit import AccountRateLimiter

#: What of an error answer's own words may be shown: a reason field of a JSON body, in
#: these characters, this long. The body itself never is (the reply endpoint is a tenant's;
#: what it answers must not reach a status, the API or /ops as it came).
_REASON_FIELDS = ("reason", "error", "message", "detail")
_UNSAFE = re.compile(r"[^A-Za-z0-9 _.,:;()'-]+")
REASON_CHARS = 80


def short_reason(response: Answer) -> str:
    """A short, sanitised reason from an error answer (a JSON body's ``reason``, ``error``,
    ``message`` or ``detail`` string), or nothing: never the body as it came."""
    if response.is_success:
        return ""
    try:
        body = response.json()
    except ValueError:
        return ""
    if not isinstance(body, dict):
        return ""
    for name in _REASON_FIELDS:
        value = body.get(name)
        if isinstance(value, dict):
            value = value.get("message")
        if isinstance(value, str) and (text := " ".join(_UNSAFE.sub(" ", value).split())):
            return text[:REASON_CHARS]
    return ""


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
        body = {"account_id": account_id, "chat_id": chat_id, "text": text, "reply_id": key}
        response = await self._post(account_id, key, body)
        if response.status_code == 409:
            # An idempotent receiver still working on this key: what it will do is unknown;
            # the next attempt sends again under the same key.
            raise Failure(Kind.UNKNOWN, "the receiver is still processing this reply (HTTP 409)")
        self._refused(response)
        raise_for(response, short_reason(response), acts=True)
        try:
            data = response.json()
        except ValueError:
            data = {}
        message_id = data.get("message_id") if isinstance(data, dict) else None
        if message_id is None and not response.is_success:
            raise Failure(Kind.UNKNOWN, "no message id")
        return Sent(str(message_id or key))

    def _refused(self, response: Answer) -> None:
        """A 401 or 403 is the endpoint refusing us, whatever the reply: the account waits."""
        if response.status_code in (401, 403):
            raise Failure(
                Kind.ACCOUNT,
                f"the reply endpoint refused our request (HTTP {response.status_code}): it does not accept our "
                "signature; set the account's reply_secret (or CHATQ_GENERIC_REPLY_SECRET) to the secret the "
                "endpoint verifies with",
            )

    async def probe(self, account_id: str) -> None:
        """Whether the reply endpoint accepts us again: a signed probe, ``{"probe": true}``,
        that a receiver answers without sending anything (docs/platforms.md). A 401 or 403
        keeps the account paused; anything else but a server error resumes it."""
        key = f"probe-{int(datetime.now(UTC).timestamp())}"
        response = await self._post(account_id, key, {"probe": True, "account_id": account_id})
        self._refused(response)
        if response.status_code >= 500 or response.status_code in (408, 429):
            raise Failure(
                Kind.TRANSIENT, f"the reply endpoint answered the probe HTTP {response.status_code}"
            )

    async def _post(self, account_id: str, key: str, document: Mapping[str, object]) -> Answer:
        """POST ``document`` as JSON to the reply URL, signed, with ``key`` as its
        Idempotency-Key and webhook-id."""
        body = json.dumps(document, ensure_ascii=False)
        return await call(
            self._client,
            self._limiter,
            self.name,
            account_id,
            "POST",
            self._url,
            content=body.encode(),
            headers=self._headers(key, body),
        )

    def _headers(self, key: str, body: str) -> dict[str, str]:
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
        return headers

    async def find_sent(self, query: SentQuery) -> Sent | None:
        raise NotImplementedError("generic replies are made safe by their Idempotency-Key instead")

    async def aclose(self) -> None:
        return None
