"""The platform calls' HTTP client: aiohttp behind the small interface the adapters use
(``request`` answering a ``Reply`` with httpx's names: ``status_code``, ``is_success``,
``headers``, ``text``, ``json()``), so an ``httpx.AsyncClient`` still fits in tests.

Why aiohttp: on this kind of machine (2 cores) httpx's async client posted to a trivial
endpoint at about 70-120 req/s with 32 requests in flight, spending 2-4 ms of CPU a
request; aiohttp at 740-1,020 req/s and 0.2 ms (bench/http_clients.py, README
"Performance"). The responder runs up to RESPONDER_CONCURRENCY sends at once.

Timeouts keep httpx's meaning: ``connect`` bounds waiting for a pooled connection and
connecting (nothing was sent: transient), ``read`` bounds each wait for the answer (the
request was sent: unknown). Transport errors are classified by
``failures.classify_transport``.
"""

from __future__ import annotations

import json as jsonlib
import socket
from collections.abc import Mapping
from typing import Any

import aiohttp
import httpx
from aiohttp.abc import AbstractResolver, ResolveResult
from multidict import CIMultiDictProxy

from platforms.failures import Failure, Kind
from shared.reply_url import ReplyUrlPolicy, ReplyUrlRefused


class Reply:
    """An HTTP answer, read in full."""

    __slots__ = ("content", "headers", "status_code")

    def __init__(self, status_code: int, headers: CIMultiDictProxy[str], content: bytes) -> None:
        self.status_code = status_code
        self.headers = headers  # case-insensitive, as httpx's
        self.content = content

    @property
    def is_success(self) -> bool:
        return 200 <= self.status_code < 300

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", errors="replace")

    def json(self) -> Any:
        """The body as JSON; ``ValueError`` (as httpx) when it is not."""
        return jsonlib.loads(self.content)


class PlatformHttp:
    """One aiohttp session for every platform call of a process. ``timeout`` is the
    ``httpx.Timeout`` the adapters read (Avito's send window uses ``timeout.read``)."""

    def __init__(self, timeout: httpx.Timeout, *, max_connections: int) -> None:
        self.timeout = timeout
        self._timeout = aiohttp.ClientTimeout(
            total=None, connect=timeout.connect or timeout.pool, sock_read=timeout.read
        )
        self._max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None

    def _connector(self) -> aiohttp.TCPConnector:
        return aiohttp.TCPConnector(limit=self._max_connections)

    def _open(self) -> aiohttp.ClientSession:
        # Made on first use, inside the running loop.
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                timeout=self._timeout,
                connector=self._connector(),
                # Platform responses are JSON read by the adapters; no cookies between calls.
                cookie_jar=aiohttp.DummyCookieJar(),
                raise_for_status=False,
            )
        return self._session

    async def request(
        self,
        method: str,
        url: str,
        *,
        json: Any = None,
        content: bytes | None = None,
        data: Mapping[str, str] | None = None,
        headers: Mapping[str, str] | None = None,
        params: Mapping[str, str | int] | None = None,
    ) -> Reply:
        body: Any = content if content is not None else data
        async with self._open().request(
            method,
            url,
            json=json,
            data=body,
            headers=headers,
            params={k: str(v) for k, v in params.items()} if params else None,
            allow_redirects=False,
        ) as response:
            return Reply(response.status, response.headers, await response.read())

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()


class CheckingResolver(AbstractResolver):
    """Resolves as aiohttp does, then hands the connector only addresses the policy allows:
    the connection goes to the address that was checked (with the URL's host name as Host
    and TLS server name), so a name that resolves inside at connect time (DNS rebinding)
    is refused, not reached."""

    def __init__(self, policy: ReplyUrlPolicy, inner: AbstractResolver | None = None) -> None:
        self._policy = policy
        self._resolver = inner or aiohttp.DefaultResolver()

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        found = await self._resolver.resolve(host, port, family)
        if not self._policy.host_allowed(host):
            self._policy.check_addresses(host, [r["host"] for r in found])
        return found

    async def close(self) -> None:
        await self._resolver.close()


class GuardedHttp(PlatformHttp):
    """The client of added generic accounts' replies (their reply_url is a tenant's):
    every request goes only where ``ReplyUrlPolicy`` allows, checked when it is sent. A
    refused URL is the account's failure (it waits, paused, until its reply_url changes),
    with the reason; nothing is sent."""

    def __init__(
        self,
        timeout: httpx.Timeout,
        *,
        max_connections: int,
        policy: ReplyUrlPolicy,
        resolver: AbstractResolver | None = None,
    ) -> None:
        super().__init__(timeout, max_connections=max_connections)
        self._policy = policy
        self._resolver = resolver  # the system's (aiohttp's default) unless a test gives its own

    def _connector(self) -> aiohttp.TCPConnector:
        return aiohttp.TCPConnector(
            limit=self._max_connections, resolver=CheckingResolver(self._policy, self._resolver)
        )

    async def request(self, method: str, url: str, **kwargs: Any) -> Reply:
        try:
            # The URL's form and an address as written (which never reaches a resolver)
            # are checked here; a name's addresses by the connector's CheckingResolver.
            await self._policy.check(url, resolver=_at_connect)
            return await super().request(method, url, **kwargs)
        except ReplyUrlRefused as refused:
            raise Failure(Kind.ACCOUNT, f"the account's reply_url is refused: {refused.reason}") from None


async def _at_connect(host: str, port: int) -> list[str]:
    """A name is resolved (and checked) by the connector's CheckingResolver, at connect."""
    return []
