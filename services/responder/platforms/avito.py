"""Avito Messenger: OAuth client-credentials token (cached, refreshed ahead of expiry,
one refresh at a time, refreshed once on 401/403), send, and listing a chat's messages
to reconcile a send whose answer was lost."""

from __future__ import annotations

import asyncio
import logging
import time

import httpx

from ..failures import Failure, Kind
from ..ratelimit import AccountRateLimiter
from .base import Attempts, Sent, SentQuery, TooEarly, call, raise_for

logger = logging.getLogger(__name__)

#: Avito's page size limit for a chat's messages.
LIST_LIMIT = 100
#: How far Avito's clock may be from ours when matching an interrupted send by time.
CLOCK_SKEW_SECONDS = 5.0


class AvitoToken:
    """The access token, shared by every send. Refreshed when 90% of its life has passed
    (at most 10 minutes ahead), by one caller at a time; the others wait for it."""

    def __init__(self, api_base: str, client_id: str, client_secret: str, client: httpx.AsyncClient) -> None:
        self._url = f"{api_base.rstrip('/')}/token"
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
        self._send_timeout = client.timeout.read or 10.0

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
        raise_for(response, _detail(response), acts=True)
        try:
            return Sent(str(response.json()["id"]))
        except (ValueError, KeyError, TypeError):
            raise Failure(Kind.UNKNOWN, "Avito accepted the send without a message id") from None

    async def find_sent(self, query: SentQuery) -> Sent | None:
        """Our reply of an interrupted send, in the chat's latest messages (a bare JSON array,
        newest first, per Avito's ``Messages`` schema): an outgoing message with the job's
        text, not one recorded for another job, created while one of the job's attempts
        could have sent it — from the first attempt that may have sent, to the latest
        attempt's start plus the request timeout (and clock skew either way). Until that
        window has passed a send may still land, so it is too early to say "not sent".
        An answer that cannot tell is unknown, never "not sent": not a list, an item like
        ours without an id or a time, a full page that does not reach back to the window,
        or a reply like ours that another job of the chat, whose outcome is unknown too,
        could have sent."""
        window = self._window(query.attempts)
        wait = window[1] - time.time()
        if wait > 0:
            raise TooEarly(wait)
        url = f"{self._base}/messenger/v3/accounts/{query.account_id}/chats/{query.chat_id}/messages/"
        response = await self._authorized(
            query.account_id, "GET", url, params={"limit": LIST_LIMIT, "offset": 0}
        )
        raise_for(response, _detail(response))
        try:
            items = response.json()
        except ValueError:
            raise Failure(Kind.UNKNOWN, "Avito's message list is not JSON") from None
        if not isinstance(items, list) or not all(isinstance(i, dict) for i in items):
            raise Failure(Kind.UNKNOWN, "Avito's message list has a shape we do not know")
        times = [c for c in (i.get("created") for i in items) if _is_time(c)]
        if len(items) >= LIST_LIMIT and not (
            times == sorted(times, reverse=True) and times and times[-1] <= window[0]
        ):
            raise Failure(Kind.UNKNOWN, f"Avito's last {LIST_LIMIT} messages do not reach back to the send")
        rivals = [self._window(r) for r in query.rivals if r.text == query.attempts.text]
        for item in items:
            content = item.get("content")
            if item.get("direction") != "out" or not isinstance(content, dict):
                continue
            if content.get("text") != query.attempts.text:
                continue
            message_id, created = item.get("id"), item.get("created")
            if not message_id or not _is_time(created):
                raise Failure(Kind.UNKNOWN, "Avito listed a reply like ours without an id or a time")
            if str(message_id) in query.exclude or not window[0] <= created <= window[1]:
                continue
            if any(lo <= created <= hi for lo, hi in rivals):
                raise Failure(
                    Kind.UNKNOWN,
                    "a reply like ours is in the chat, but another job whose send is unknown may have sent it",
                )
            return Sent(str(message_id))
        return None

    def _window(self, attempts: Attempts) -> tuple[float, float]:
        """When Avito may have created a message these attempts sent (epoch seconds; its
        ``created`` is whole seconds)."""
        return (
            attempts.since.timestamp() - CLOCK_SKEW_SECONDS - 1,
            attempts.latest.timestamp() + self._send_timeout + CLOCK_SKEW_SECONDS,
        )

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


def _is_time(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
