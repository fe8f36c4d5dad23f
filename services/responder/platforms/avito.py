"""Avito Messenger: OAuth client-credentials token (cached, refreshed ahead of expiry,
one refresh at a time, refreshed once on 401/403), send, and listing a chat's messages
to reconcile a send whose answer was lost."""

from __future__ import annotations

import asyncio
import logging
import time
from datetime import datetime

import httpx

from ..failures import Failure, Kind
from ..ratelimit import AccountRateLimiter
from .base import Sent, call, raise_for

logger = logging.getLogger(__name__)


class AvitoToken:
    """The access token, shared by every send. Refreshed when 90% of its life has passed
    (at most 10 minutes ahead), by one caller at a time; the others wait for it."""

    def __init__(self, api_base: str, client_id: str, client_secret: str, client: httpx.AsyncClient) -> None:
        self._url = f"{api_base.rstrip('/')}/token/"
        self._form = {
            "grant_type": "client_credentials",
            "client_id": client_id,
            "client_secret": client_secret,
        }
        self._client = client
        self._token: str | None = None
        self._refresh_at = 0.0
        self._lock = asyncio.Lock()
        self.refreshes = 0

    async def get(self, *, stale: str | None = None) -> str:
        """A valid token. ``stale``: the token the platform just refused; refresh unless
        another caller already has."""
        async with self._lock:
            if self._token is not None and self._token != stale and time.monotonic() < self._refresh_at:
                return self._token
            response = await call(self._client, None, "avito", "-", "POST", self._url, data=self._form)
            raise_for(response, "token request")
            body = response.json()
            self._token = str(body["access_token"])
            life = float(body.get("expires_in", 3600))
            self._refresh_at = time.monotonic() + max(1.0, life - min(600.0, life * 0.1))
            self.refreshes += 1
            logger.info("Avito access token refreshed (valid %.0fs)", life)
            return self._token


class AvitoPlatform:
    name = "avito"
    max_text = 1000
    idempotent = False
    can_reconcile = True

    def __init__(
        self, api_base: str, token: AvitoToken, client: httpx.AsyncClient, limiter: AccountRateLimiter
    ) -> None:
        self._base = api_base.rstrip("/")
        self._token = token
        self._client = client
        self._limiter = limiter

    async def _authorized(self, account_id: str, method: str, url: str, **kwargs: object) -> httpx.Response:
        stale: str | None = None
        for _ in range(2):
            token = await self._token.get(stale=stale)
            response = await call(
                self._client,
                self._limiter,
                self.name,
                account_id,
                method,
                url,
                headers={"Authorization": f"Bearer {token}"},
                **kwargs,
            )
            if response.status_code not in (401, 403):
                break
            # An expired token gives 403: refresh once and try once more.
            stale = token
        return response

    async def send(self, account_id: str, chat_id: str, text: str, *, key: str) -> Sent:
        url = f"{self._base}/messenger/v1/accounts/{account_id}/chats/{chat_id}/messages"
        response = await self._authorized(
            account_id, "POST", url, json={"message": {"text": text}, "type": "text"}
        )
        raise_for(response, _detail(response))
        try:
            return Sent(str(response.json()["id"]))
        except (ValueError, KeyError, TypeError):
            raise Failure(Kind.UNKNOWN, "Avito accepted the send without a message id") from None

    async def find_sent(self, account_id: str, chat_id: str, text: str, since: datetime) -> Sent | None:
        url = f"{self._base}/messenger/v3/accounts/{account_id}/chats/{chat_id}/messages/"
        response = await self._authorized(account_id, "GET", url, params={"limit": 50, "offset": 0})
        raise_for(response, _detail(response))
        body = response.json()
        items = body.get("messages", body) if isinstance(body, dict) else body
        for item in items if isinstance(items, list) else []:
            if not isinstance(item, dict) or item.get("direction") != "out":
                continue
            content = item.get("content") or {}
            created = item.get("created")
            if content.get("text") == text and (
                not isinstance(created, int | float) or created >= since.timestamp() - 120
            ):
                return Sent(str(item.get("id")))
        return None

    async def aclose(self) -> None:
        return None


def _detail(response: httpx.Response) -> str:
    if response.is_success:
        return ""
    try:
        body = response.json()
    except ValueError:
        return response.text[:200]
    err = body.get("error", body) if isinstance(body, dict) else body
    return str(err.get("message", err) if isinstance(err, dict) else err)[:200]
