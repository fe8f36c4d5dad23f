"""A small TCP fault proxy for tests (no toxiproxy here): forwards a local port to a
target and can cut every connection and refuse new ones, as a broker restart or a
network partition would."""

from __future__ import annotations

import asyncio
import contextlib
from urllib.parse import urlsplit, urlunsplit


class TcpProxy:
    def __init__(self, target_host: str, target_port: int) -> None:
        self._target = (target_host, target_port)
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self.blocked = False
        self.port = 0

    async def start(self) -> TcpProxy:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def block(self) -> None:
        """Cut every open connection and refuse new ones until ``unblock``."""
        self.blocked = True
        for w in list(self._writers):
            with contextlib.suppress(Exception):
                w.transport.abort()
        self._writers.clear()

    def unblock(self) -> None:
        self.blocked = False

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.blocked:
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self._target)
        except OSError:
            writer.transport.abort()
            return
        self._writers.update((writer, up_writer))
        a = asyncio.create_task(self._pipe(reader, up_writer))
        b = asyncio.create_task(self._pipe(up_reader, writer))
        self._tasks.update((a, b))
        await asyncio.wait({a, b}, return_when=asyncio.FIRST_COMPLETED)
        for w in (writer, up_writer):
            with contextlib.suppress(Exception):
                w.transport.abort()
            self._writers.discard(w)
        for t in (a, b):
            t.cancel()
            self._tasks.discard(t)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(Exception):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()

    async def close(self) -> None:
        self.block()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for t in list(self._tasks):
            t.cancel()


def through(url: str, proxy: TcpProxy) -> str:
    """``url`` (Postgres or AMQP) with its host and port replaced by the proxy's."""
    parts = urlsplit(url)
    auth = parts.netloc.rpartition("@")[0]
    netloc = f"{auth}@127.0.0.1:{proxy.port}" if auth else f"127.0.0.1:{proxy.port}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, ""))


async def proxy_for(url: str) -> TcpProxy:
    """A started proxy in front of ``url``'s host and port."""
    target = urlsplit(url)
    return await TcpProxy(target.hostname or "127.0.0.1", target.port or 5432).start()
