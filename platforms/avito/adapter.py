"""Avito Messenger: an OAuth client-credentials token shared by every replica (refreshed
ahead of expiry, one refresh at a time, refreshed once on 401/403), send, listing a
chat's messages to reconcile a send whose answer was lost, and a probe of the account.

A 403 that a fresh token does not cure is about the account when the account's chat list
is refused too (no paid Messenger plan, a blocked account): the account is paused, not
the job failed. Otherwise it is about the chat, and that job fails alone."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import logging
import random
import time
from typing import Any, TypeGuard

import asyncpg
from cryptography.fernet import Fernet, InvalidToken, MultiFernet

from platforms.base import (
    LIMITED_BACKOFF_SECONDS,
    SPENT_WINDOW_SECONDS,
    Answer,
    HttpClient,
    Listing,
    Sent,
    SentQuery,
    TooEarly,
    call,
    raise_for,
    rate_limit_spent,
    retry_after_of,
    segment,
)
from platforms.failures import Failure, Kind
from platforms.ratelimit import AccountRateLimiter, SharedBudget
from shared.secretbox import SecretBox
from stores.jobs.protocol import Attempts

logger = logging.getLogger(__name__)

#: Avito's page size limit for a chat's messages and for chats, and the furthest offset it
#: takes (its documents: limit at most 100, offset at most 1000).
LIST_LIMIT = 100
MAX_OFFSET = 1000
#: The chats the poller reads: about a listing (u2i) and between users (u2u); a chat with
#: Avito itself (a2u) is never answered.
ANSWERED_CHAT_TYPES = "u2i,u2u"
#: How far Avito's clock may be from ours when matching an interrupted send by time.
CLOCK_SKEW_SECONDS = 5.0


class AvitoToken:
    """The access token of one account's client credentials, shared by every send of every
    replica: kept in Postgres (``platform_tokens``) and refreshed when 90% of its life has
    passed (at most 10 minutes ahead) by one process at a time, under an advisory lock;
    the others read the new one. Replicas never invalidate each other's tokens, and N
    replicas cost one token request, not N. Each process keeps the token it read until
    it is due, so a send reads Postgres only around a refresh.

    The token is a credential (issue 39): stored sealed with the accounts' key
    (CHATQ_SECRETS_KEY, ``box``), or without one (the environment's account alone) with a
    key made from the client credentials themselves; and keyed by the account and a digest
    of its client id and secret, never the client id alone, so an account given another's
    client id with a wrong secret never reuses that account's token (it asks Avito, which
    refuses it). Removing the account deletes its tokens (``services/receiver/accounts_api``)."""

    def __init__(
        self,
        api_base: str,
        client_id: str,
        client_secret: str,
        client: HttpClient,
        pool: asyncpg.Pool | None = None,
        *,
        account: str | None = None,
        box: SecretBox | None = None,
    ) -> None:
        self._url = f"{api_base.rstrip('/')}/token"
        self._account = account
        self._credential = token_key(account, client_id, client_secret)
        self._box = box
        self._own = _own_key(client_id, client_secret)
        self._form = {
            "grant_type": "client_credentials",
            "client_id": client_id,
            "client_secret": client_secret,
        }
        self._client = client
        self._pool = pool
        self._token: str | None = None
        self._refresh_at = 0.0  # time.time() at which this process stops using its token
        self._lock = asyncio.Lock()
        self.refreshes = 0

    async def get(self, *, stale: str | None = None) -> str:
        """A valid token. ``stale``: the token the platform just refused; refresh unless
        another caller (or replica) already has."""
        async with self._lock:
            if self._usable(self._token, self._refresh_at, stale):
                assert self._token is not None
                return self._token
            if self._pool is None:
                token, expires = await self._request()
            else:
                token, expires = await self._shared(stale)
            self._token, self._refresh_at = token, _refresh_time(expires)
            return token

    @property
    def _seal(self) -> Fernet | MultiFernet:
        """The keys a token is sealed and opened with, as they are now: the box's current
        ones (read at each use, so after a key rotation a token is sealed under the new first
        key, never the retired one), or without the accounts' key, the client credentials' own."""
        if self._box is not None and self._box.configured:
            return self._box.fernet
        return self._own

    @staticmethod
    def _usable(token: str | None, refresh_at: float, stale: str | None) -> bool:
        return token is not None and token != stale and time.time() < refresh_at

    def _opened(self, row: asyncpg.Record | None) -> tuple[str, float] | None:
        """The stored token, when this account's key opens it (after a key rotation it may
        not: then it is asked for again)."""
        if row is None:
            return None
        try:
            return self._seal.decrypt(bytes(row["sealed"])).decode(), row["expires"]
        except InvalidToken:
            return None

    async def _shared(self, stale: str | None) -> tuple[str, float]:
        assert self._pool is not None
        async with self._pool.acquire() as conn:
            known = self._opened(await conn.fetchrow(_READ_TOKEN, self._credential))
            if known and self._usable(known[0], _refresh_time(known[1]), stale):
                return known
            async with conn.transaction():
                # One refresh across replicas; the others wait here, then read its token.
                await conn.execute(
                    "SELECT pg_advisory_xact_lock(hashtextextended('avito-token:' || $1, 0))",
                    self._credential,
                )
                known = self._opened(await conn.fetchrow(_READ_TOKEN, self._credential))
                if known and self._usable(known[0], _refresh_time(known[1]), stale):
                    return known
                token, expires = await self._request()
                if self._account is not None and await conn.fetchval(_REMOVED, self._account):
                    # Removed while its token was asked for: the removal deleted its tokens,
                    # and this one is not stored after it (nothing sends for it any more).
                    return token, expires
                await conn.execute(
                    """
                    INSERT INTO platform_tokens (platform, credential, account_id, sealed, expires_at)
                    VALUES ('avito', $1, $2, $3, to_timestamp($4))
                    ON CONFLICT (platform, credential) DO UPDATE
                    SET sealed = EXCLUDED.sealed, token = NULL, expires_at = EXCLUDED.expires_at,
                        refreshed_at = now()
                    """,
                    self._credential,
                    self._account,
                    self._seal.encrypt(token.encode()),
                    expires,
                )
                # The account's tokens of earlier credentials (and any left in clear by
                # the previous release during a rollout) are not kept.
                await conn.execute(
                    "DELETE FROM platform_tokens WHERE platform = 'avito' AND credential <> $1"
                    " AND (account_id IS NOT DISTINCT FROM $2 OR sealed IS NULL)",
                    self._credential,
                    self._account,
                )
                return token, expires

    async def _request(self) -> tuple[str, float]:
        """A new token from Avito: (token, expiry as epoch seconds)."""
        response = await call(self._client, None, "avito", "-", "POST", self._url, data=self._form)
        if response.status_code in (400, 401, 403):
            raise Failure(
                Kind.ACCOUNT,
                f"Avito refused the client credentials (HTTP {response.status_code}: {_detail(response)}): "
                "check CHATQ_AVITO_CLIENT_ID and CHATQ_AVITO_CLIENT_SECRET in Avito's developer settings",
            )
        raise_for(response, "token request")
        try:
            body = response.json()
            token = str(body["access_token"])
            life = float(body.get("expires_in", 3600))
        except (ValueError, KeyError, TypeError):
            # Not an exception that dead-letters the job: Avito will answer properly again.
            raise Failure(
                Kind.TRANSIENT,
                f"Avito's token endpoint answered without an access_token (HTTP {response.status_code})",
            ) from None
        self.refreshes += 1
        logger.info("Avito access token refreshed (valid %.0fs)", life)
        return token, time.time() + life


#: Whether the account was removed, its row locked until the token is stored: a removal
#: (services/receiver/accounts_api.py: the row updated, then its tokens deleted) that
#: commits first is seen here; one that comes later waits, then deletes this token too.
_REMOVED = """
SELECT removed_at IS NOT NULL FROM accounts WHERE platform = 'avito' AND account_id = $1 FOR SHARE
"""

_READ_TOKEN = """
SELECT sealed, extract(epoch FROM expires_at)::float8 AS expires
FROM platform_tokens WHERE platform = 'avito' AND credential = $1 AND sealed IS NOT NULL
"""


def token_key(account: str | None, client_id: str, client_secret: str) -> str:
    """Whose token a row of ``platform_tokens`` is: the account (``environment`` for the
    environment's credentials) and a digest of its client id and secret (never either)."""
    digest = hashlib.sha256(f"{client_id}\0{client_secret}".encode()).hexdigest()[:32]
    return f"{account or 'environment'}:{digest}"


def _own_key(client_id: str, client_secret: str) -> Fernet:
    """Without CHATQ_SECRETS_KEY (the environment's account alone): a key only the holder
    of the client credentials can make."""
    material = hashlib.sha256(f"chatq avito token\0{client_id}\0{client_secret}".encode()).digest()
    return Fernet(base64.urlsafe_b64encode(material))


def _refresh_time(expires: float) -> float:
    """When to stop using a token that expires at ``expires`` (epoch seconds): after 90%
    of its life, at most 10 minutes before it expires."""
    life = expires - time.time()
    return expires - min(600.0, max(life, 0.0) * 0.1)


class AvitoPlatform:
    name = "avito"
    max_text = 1000
    idempotent = False
    can_reconcile = True

    def __init__(
        self,
        api_base: str,
        token: AvitoToken,
        client: HttpClient,
        limiter: AccountRateLimiter,
        budget: SharedBudget | None = None,
    ) -> None:
        self._base = api_base.rstrip("/")
        self._token = token
        self._client = client
        self._limiter = limiter
        self._budget = budget
        self._send_timeout = client.timeout.read or 10.0

    async def _authorized(
        self,
        account_id: str,
        method: str,
        url: str,
        *,
        refresh: bool = True,
        share: float = 1.0,
        **kwargs: object,
    ) -> Answer:
        """The request with the account's token; ``refresh``: once more with a fresh token
        when Avito refuses this one (a call that may do without skips it). Each request
        counts against the account's budget shared by every process (``share``: the part of
        it this caller may use; the poll leaves room for the sends)."""
        stale: str | None = None
        for _ in range(2 if refresh else 1):
            token = await self._token.get(stale=stale)
            if self._budget is not None:
                await self._budget.take(account_id, share=share)
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
            await self._heed_limits(account_id, response)
            if response.status_code not in (401, 403):
                break
            # An expired token gives 403: refresh once and try once more.
            stale = token
        return response

    async def _heed_limits(self, account_id: str, response: Answer) -> None:
        """What Avito says of the account's per-minute limit, for every process: the limit
        it states, and a pause when it answers 429 or has no request left in the window."""
        if self._budget is None:
            return
        limit = response.headers.get("x-ratelimit-limit")
        if limit is not None and limit.isdigit() and int(limit) > 0:
            await self._budget.observe(account_id, int(limit))
        if response.status_code == 429:
            await self._budget.pause(
                account_id, retry_after_of(response) or random.uniform(*LIMITED_BACKOFF_SECONDS)
            )
        elif rate_limit_spent(response):
            await self._budget.pause(account_id, random.uniform(*SPENT_WINDOW_SECONDS))

    def _refused(self, account_id: str, response: Answer) -> None:
        """Raise when Avito refuses the account as a whole, whatever the chat: 401 with a
        fresh token (the account refuses this application) or 402 (payment required)."""
        if response.status_code == 401:
            raise Failure(
                Kind.ACCOUNT,
                f"Avito refuses this application for account {account_id} with a fresh token "
                f"(HTTP 401: {_detail(response)}): the account's owner must grant the application access to "
                "the Messenger API again (Avito's developer settings), or the client credentials belong to another "
                "account",
            )
        if response.status_code == 402:
            raise Failure(
                Kind.ACCOUNT,
                f"Avito answers payment required for account {account_id} (HTTP 402: {_detail(response)}): "
                "the account's subscription does not include the Messenger API or has run out; renew it",
            )

    async def send(
        self, account_id: str, chat_id: str, text: str, *, key: str, business_connection_id: str | None = None
    ) -> Sent:
        # Ids as one segment each, never a path (platforms.base.segment).
        user, chat = segment(account_id), segment(chat_id)
        url = f"{self._base}/messenger/v1/accounts/{user}/chats/{chat}/messages"
        response = await self._authorized(
            account_id, "POST", url, json={"message": {"text": text}, "type": "text"}
        )
        self._refused(account_id, response)
        if response.status_code == 403:
            await self.probe(account_id)  # raises when the whole account is refused
        raise_for(response, _detail(response), acts=True)
        try:
            return Sent(str(response.json()["id"]))
        except (ValueError, KeyError, TypeError):
            raise Failure(Kind.UNKNOWN, "Avito accepted the send without a message id") from None

    async def probe(self, account_id: str) -> None:
        """Whether Avito accepts the account: a token, and the account's chat list. Raises
        ``Failure`` (kind account: no paid Messenger plan or a blocked account; or the
        credentials) when it does not."""
        # Ids as one segment each, never a path (platforms.base.segment).
        user = segment(account_id)
        url = f"{self._base}/messenger/v2/accounts/{user}/chats"
        response = await self._authorized(account_id, "GET", url, params={"limit": 1})
        self._refused(account_id, response)
        if response.status_code == 403:
            raise Failure(
                Kind.ACCOUNT,
                f"Avito refuses the Messenger API for account {account_id} with a fresh token "
                f"(HTTP {response.status_code}: {_detail(response)}): the account has no paid Messenger plan, "
                "or it is blocked; put it on a plan that includes the Messenger API",
            )
        raise_for(response, _detail(response))

    async def find_sent(self, query: SentQuery) -> Sent | None:
        """Our reply of an interrupted send, in the chat's latest messages (newest first, in
        either shape the list comes in: ``message_list``): an outgoing message with the job's
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
        # Ids as one segment each, never a path (platforms.base.segment).
        user, chat = segment(query.account_id), segment(query.chat_id)
        url = f"{self._base}/messenger/v3/accounts/{user}/chats/{chat}/messages/"
        response = await self._authorized(
            query.account_id, "GET", url, params={"limit": LIST_LIMIT, "offset": 0}
        )
        self._refused(query.account_id, response)
        raise_for(response, _detail(response))
        try:
            items = message_list(response.json())
        except ValueError:
            raise Failure(Kind.UNKNOWN, "Avito's message list is not JSON") from None
        if items is None:
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

    async def recent_chats(
        self, account_id: str, since: float, *, share: float = 1.0
    ) -> list[dict[str, Any]]:
        """The account's chats (u2i and u2u) updated at or after ``since`` (epoch seconds; a
        chat without ``updated`` is kept), as Avito lists them: newest first, so the pages
        stop at the first that reaches back past ``since``. Read or unread: a seller who
        opened a chat in the app has not answered it, and we mark answered chats read
        ourselves."""
        # Ids as one segment each, never a path (platforms.base.segment).
        user = segment(account_id)
        url = f"{self._base}/messenger/v2/accounts/{user}/chats"
        chats: list[dict[str, Any]] = []
        offset: int | None = 0
        while offset is not None:
            params = {"chat_types": ANSWERED_CHAT_TYPES, "limit": LIST_LIMIT}
            response = await self._authorized(
                account_id, "GET", url, params={**params, "offset": offset}, share=share
            )
            self._refused(account_id, response)
            raise_for(response, _detail(response))
            body = _json(response, "chat list")
            page = _objects(body.get("chats") if isinstance(body, dict) else None, "chat list")
            chats += [c for c in page if not _is_time(c.get("updated")) or c["updated"] >= since]
            offset = None if reaches_back(page, since) else next_offset(offset, len(page))
        return chats

    async def buyer_messages(
        self,
        account_id: str,
        chat_id: str,
        since: float,
        ours: frozenset[str] = frozenset(),
        *,
        share: float = 1.0,
    ) -> list[dict[str, Any]]:
        """The chat's buyer messages since the seller's latest message written in person
        (what came before it is answered) and not older than ``since`` (epoch seconds),
        oldest first; paged back until one of the two is reached. ``ours``: the ids of the
        replies we sent, which answer only what the inbox held, so they stop nothing."""
        # Ids as one segment each, never a path (platforms.base.segment).
        user, chat = segment(account_id), segment(chat_id)
        url = f"{self._base}/messenger/v3/accounts/{user}/chats/{chat}/messages/"
        items: list[dict[str, Any]] = []
        offset: int | None = 0
        while offset is not None:
            response = await self._authorized(
                account_id, "GET", url, params={"limit": LIST_LIMIT, "offset": offset}, share=share
            )
            self._refused(account_id, response)
            raise_for(response, _detail(response))
            page = message_list(_json(response, "message list"))
            if page is None:
                raise Failure(Kind.TRANSIENT, "Avito's message list has a shape we do not know")
            items += page
            found, reached = since_last_answer(items, account_id, since, ours)
            offset = None if reached else next_offset(offset, len(page))
        return found

    async def who(self) -> dict[str, Any]:
        """The account these credentials belong to, as ``GET /core/v1/accounts/self`` names
        it (``id``: the user_id every messenger path takes; ``name``, ``profile_url``)."""
        response = await call(
            self._client,
            self._limiter,
            self.name,
            "-",
            "GET",
            f"{self._base}/core/v1/accounts/self",
            headers={"Authorization": f"Bearer {await self._token.get()}"},
        )
        raise_for(response, _detail(response))
        body = _json(response, "account")
        if (
            not isinstance(body, dict)
            or not isinstance(body.get("id"), int)
            or isinstance(body.get("id"), bool)
        ):
            raise Failure(Kind.TRANSIENT, "Avito's /core/v1/accounts/self answered without an account id")
        return body

    async def listing(self, account_id: str, chat_id: str) -> Listing | None:
        """The listing the chat is about (title, price, url), or None for a chat about none."""
        # Ids as one segment each, never a path (platforms.base.segment).
        user, chat = segment(account_id), segment(chat_id)
        url = f"{self._base}/messenger/v2/accounts/{user}/chats/{chat}"
        # Best effort (the reply goes out without it): a refused token is the send's to refresh.
        response = await self._authorized(account_id, "GET", url, refresh=False)
        raise_for(response, _detail(response))
        return listing_of(_json(response, "chat"), account_id)

    async def mark_read(self, account_id: str, chat_id: str) -> None:
        """Mark the chat read in the seller's Avito app (sending does not)."""
        # Ids as one segment each, never a path (platforms.base.segment).
        user, chat = segment(account_id), segment(chat_id)
        url = f"{self._base}/messenger/v1/accounts/{user}/chats/{chat}/read"
        response = await self._authorized(account_id, "POST", url)
        raise_for(response, _detail(response))

    def _window(self, attempts: Attempts) -> tuple[float, float]:
        """When Avito may have created a message these attempts sent (epoch seconds; its
        ``created`` is whole seconds)."""
        return (
            attempts.since.timestamp() - CLOCK_SKEW_SECONDS - 1,
            attempts.latest.timestamp() + self._send_timeout + CLOCK_SKEW_SECONDS,
        )

    async def aclose(self) -> None:
        return None


def _detail(response: Answer) -> str:
    if response.is_success:
        return ""
    try:
        body = response.json()
    except ValueError:
        return response.text[:200]
    err = body.get("error", body) if isinstance(body, dict) else body
    return str(err.get("message", err) if isinstance(err, dict) else err)[:200]


def message_list(body: object) -> list[dict[str, Any]] | None:
    """A chat's messages from the message list's answer, in either shape it comes in: the
    bare array Avito's document describes (``Messages``), or the object public clients read
    from the live API, ``{"messages": [...], "meta": {...}}``. None for anything else. Paging
    goes by the page's length either way (``next_offset``): what ``meta`` holds is not
    documented."""
    items = body.get("messages") if isinstance(body, dict) else body
    if not isinstance(items, list) or not all(isinstance(i, dict) for i in items):
        return None
    return items


def _is_time(value: object) -> TypeGuard[float]:
    return isinstance(value, int | float) and not isinstance(value, bool)


def reaches_back(page: list[dict[str, Any]], since: float) -> bool:
    """Whether a page of chats, listed newest first, reaches back past ``since``: its last
    chat was updated before it, and the page is in that order (one out of order is read
    on, in case the list is not)."""
    times = [t for t in (c.get("updated") for c in page) if _is_time(t)]
    if not times or len(times) != len(page):
        return False
    return times == sorted(times, reverse=True) and times[-1] < since


def next_offset(offset: int, got: int, limit: int = LIST_LIMIT) -> int | None:
    """The offset of the page after the one at ``offset`` that held ``got`` items; None when
    that was the last page (a short one), or the next is past the furthest offset Avito
    takes."""
    if got < limit:
        return None
    following = offset + limit
    return following if following <= MAX_OFFSET else None


def since_last_answer(
    items: list[dict[str, Any]], account_id: str, since: float, ours: frozenset[str] = frozenset()
) -> tuple[list[dict[str, Any]], bool]:
    """The buyer's messages among ``items`` (a chat's messages, as Avito lists them) that came
    after the seller's latest message written in person and not before ``since``, oldest
    first; and whether the items reach back that far (older pages need not be read). A
    message from the account (direction ``out``, or its author) that is not one of ``ours``
    answers all before it. Our own replies do not: the bot wrote them from the inbox, so
    they never covered a message whose webhook was lost. A message without an id or a time
    is none we could store."""
    ordered = sorted(items, key=lambda i: i["created"] if _is_time(i.get("created")) else 0, reverse=True)
    found: list[dict[str, Any]] = []
    for item in ordered:
        if item.get("direction") == "out" or str(item.get("author_id")) == account_id:
            if str(item.get("id")) in ours:
                continue
            return found[::-1], True
        created = item.get("created")
        if not isinstance(created, int | float) or not _is_time(created) or not item.get("id"):
            continue
        if created < since:
            return found[::-1], True
        if item.get("direction") == "in":
            found.append(item)
    return found[::-1], False


def listing_of(chat: object, account_id: str) -> Listing | None:
    """The listing in a chat's ``context`` (type ``item``: title, price_string, url), when
    it is the account's own: its ``user_id`` (the listing's author) is the account. A chat
    about another seller's listing (the account asked as a buyer), or one whose listing
    names no author, gives none: the reply writer speaks for the seller about the seller's
    listings only."""
    context = chat.get("context") if isinstance(chat, dict) else None
    value = context.get("value") if isinstance(context, dict) and context.get("type") == "item" else None
    if not isinstance(value, dict):
        return None
    author = value.get("user_id")
    if isinstance(author, bool) or not isinstance(author, int | str) or str(author) != account_id:
        return None
    return Listing.from_json(
        {"title": value.get("title"), "price": value.get("price_string"), "url": value.get("url")}
    )


def _json(response: Answer, what: str) -> Any:
    try:
        return response.json()
    except ValueError:
        raise Failure(Kind.TRANSIENT, f"Avito's {what} is not JSON") from None


def _objects(value: object, what: str) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not all(isinstance(i, dict) for i in value):
        raise Failure(Kind.TRANSIENT, f"Avito's {what} has a shape we do not know")
    return value
