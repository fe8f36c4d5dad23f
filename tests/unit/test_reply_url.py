"""A generic account's reply_url cannot reach inside (issue 39, point 3): refused by what
its host is or resolves to, when the account is added and again at every send, where the
connection goes to the address that was checked; and an error answer's body is never
shown beyond a short sanitised reason."""

from __future__ import annotations

import asyncio
import socket

import httpx
import pytest
from aiohttp.abc import AbstractResolver, ResolveResult

from platforms.failures import Failure, Kind
from platforms.generic.adapter import GenericPlatform, short_reason
from platforms.http import GuardedHttp
from platforms.ratelimit import AccountRateLimiter
from shared.reply_url import ReplyUrlPolicy, ReplyUrlRefused
from shared.settings import Settings
from tests.unit.test_platform_http import Handler, answering, failure_of, read_request, server

pytestmark = pytest.mark.unit

PUBLIC = "93.184.215.14"


def resolving(*addresses: str):  # type: ignore[no-untyped-def]
    async def resolve(host: str, port: int) -> list[str]:
        return list(addresses)

    return resolve


async def refusal(url: str, policy: ReplyUrlPolicy | None = None, *addresses: str) -> str:
    with pytest.raises(ReplyUrlRefused) as refused:
        await (policy or ReplyUrlPolicy()).check(url, resolver=resolving(*addresses or (PUBLIC,)))
    return refused.value.reason


@pytest.mark.parametrize(
    ("url", "kind"),
    [
        ("http://127.0.0.1:8080/hook", "a loopback address"),
        ("http://[::1]/hook", "a loopback address"),
        ("http://10.1.2.3/hook", "a private address"),
        ("http://192.168.0.10/hook", "a private address"),
        ("http://169.254.169.254/latest/meta-data/", "a cloud metadata address"),
        ("http://[fd00:ec2::254]/latest/meta-data/", "a cloud metadata address"),
        ("http://169.254.10.1/", "a link-local address"),
        ("http://[fe80::1]/", "a link-local address"),
        ("http://0.0.0.0:5432/", "the unspecified address"),
        ("http://224.0.0.251/", "a multicast address"),
        ("http://[::ffff:127.0.0.1]/", "a loopback address"),
        ("http://100.64.0.1/", "an address not on the public internet"),
    ],
)
async def test_a_reply_url_whose_host_is_an_address_inside_is_refused_with_the_reason(
    url: str, kind: str
) -> None:
    reason = await refusal(url)
    assert kind in reason
    assert "CHATQ_REPLY_URL_ALLOW_HOSTS" in reason


@pytest.mark.parametrize("inside", ["127.0.0.1", "10.0.0.5", "169.254.169.254", "fd00:ec2::254"])
async def test_a_name_that_resolves_inside_is_refused_not_only_an_address_as_written(inside: str) -> None:
    reason = await refusal("https://hooks.example.com/replies", None, inside)
    assert reason.startswith(f"its host hooks.example.com resolves to {inside},")


async def test_one_address_inside_among_public_ones_refuses_the_name() -> None:
    # The client would try them in turn: the one inside would be reached.
    reason = await refusal("https://hooks.example.com/r", None, PUBLIC, "10.0.0.7")
    assert "10.0.0.7, a private address" in reason


async def test_a_public_host_is_allowed() -> None:
    await ReplyUrlPolicy().check(
        "https://hooks.example.com/r", resolver=resolving(PUBLIC, "2606:2800:220:1::1")
    )
    await ReplyUrlPolicy().check(f"http://{PUBLIC}:8443/r")


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("ftp://hooks.example.com/r", "not an http(s) URL"),
        ("http://user:pw@hooks.example.com/r", "user name or password"),
        ("http:///r", "names no host"),
    ],
)
async def test_a_reply_url_that_is_not_a_plain_http_url_is_refused(url: str, why: str) -> None:
    assert why in await refusal(url)


async def test_an_operator_allows_a_named_host_or_network_and_nothing_else() -> None:
    policy = Settings(
        reply_url_allow_hosts="Receiver.Internal., 127.0.0.1", reply_url_allow_networks="10.20.0.0/16"
    ).reply_url_policy()
    await policy.check("http://receiver.internal/r", resolver=resolving("10.9.9.9"))
    await policy.check("http://127.0.0.1:9000/r")
    await policy.check("http://hooks.corp/r", resolver=resolving("10.20.3.4"))
    assert "10.21.0.1, a private address" in await refusal("http://hooks.corp/r", policy, "10.21.0.1")
    assert "a loopback address" in await refusal("http://localhost/r", policy, "127.0.0.1")


def test_an_allowed_network_that_is_not_a_network_is_refused_at_start() -> None:
    with pytest.raises(ValueError, match="REPLY_URL_ALLOW_NETWORKS: 'ten' is not a network"):
        Settings(reply_url_allow_networks="10.0.0.0/8,ten")


class FakeDns(AbstractResolver):
    """Answers each name with the addresses the test gives, in turn (DNS rebinding)."""

    def __init__(self, *answers: str) -> None:
        self.answers = list(answers)
        self.asked: list[str] = []

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        self.asked.append(host)
        address = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        return [
            {
                "hostname": host,
                "host": address,
                "port": port,
                "family": socket.AF_INET6 if ":" in address else socket.AF_INET,
                "proto": 0,
                "flags": socket.AI_NUMERICHOST,
            }
        ]

    async def close(self) -> None:
        return None


def guarded(policy: ReplyUrlPolicy, dns: FakeDns | None = None) -> GuardedHttp:
    return GuardedHttp(httpx.Timeout(2.0, connect=1.0), max_connections=4, policy=policy, resolver=dns)


async def send_failure(handle: Handler, policy: ReplyUrlPolicy) -> Failure:
    """The failure of a generic send through the guarded client to a loopback server."""
    async with server(handle) as url:
        http = guarded(policy)
        try:
            platform = GenericPlatform(f"{url}/r", None, http, AccountRateLimiter(1000))
            return await failure_of(platform.send("a", "c", "hi", key="j"))
        finally:
            await http.aclose()


async def test_a_name_checked_public_when_added_that_resolves_inside_at_send_time_reaches_nothing() -> None:
    seen: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append(await read_request(reader))
        writer.close()

    async with server(handle) as url:
        port = url.rsplit(":", 1)[1]
        reply_url = f"http://hooks.example.com:{port}/replies"
        # When the account was added, the name was public.
        await ReplyUrlPolicy().check(reply_url, resolver=resolving(PUBLIC))
        # Now it answers loopback, where the server listens.
        http = guarded(ReplyUrlPolicy(), FakeDns("127.0.0.1"))
        try:
            platform = GenericPlatform(reply_url, None, http, AccountRateLimiter(1000))
            failure = await failure_of(platform.send("shop", "c-1", "hi", key="job-1"))
            probe = await failure_of(platform.probe("shop"))
        finally:
            await http.aclose()
    assert failure.kind is Kind.ACCOUNT  # the account waits, paused, until its reply_url changes
    assert failure.reason == (
        "the account's reply_url is refused: its host hooks.example.com resolves to 127.0.0.1, a loopback "
        "address; an operator can allow it with CHATQ_REPLY_URL_ALLOW_HOSTS or CHATQ_REPLY_URL_ALLOW_NETWORKS"
    )
    assert probe.kind is Kind.ACCOUNT  # a probe does not resume it either
    assert seen == []


async def test_an_address_as_written_is_checked_at_send_time_too() -> None:
    failure = await send_failure(answering(200, {"message_id": "m-1"}), ReplyUrlPolicy())
    assert failure.kind is Kind.ACCOUNT
    assert "127.0.0.1 is a loopback address" in failure.reason


async def test_the_connection_goes_to_the_checked_address_with_the_urls_host_name() -> None:
    heads: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        heads.append(head)
        body = b'{"message_id": "m-7"}'
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
            + str(len(body)).encode()
            + b"\r\nconnection: close\r\n\r\n"
            + body
        )
        await writer.drain()
        writer.close()

    dns = FakeDns("127.0.0.1")
    async with server(handle) as url:
        port = url.rsplit(":", 1)[1]
        http = guarded(ReplyUrlPolicy.of("", "127.0.0.0/8"), dns)
        try:
            platform = GenericPlatform(
                f"http://hooks.example.com:{port}/r", None, http, AccountRateLimiter(1000)
            )
            sent = await platform.send("shop", "c-1", "hi", key="job-2")
        finally:
            await http.aclose()
    assert sent.message_id == "m-7"
    assert dns.asked == ["hooks.example.com"]
    assert f"host: hooks.example.com:{port}".encode() in heads[0].lower()


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b"<html>ami-id\ninstance-id\nAccessKeyId: AKIAEXAMPLE secret</html>", ""),
        (b'{"Code": "Success", "SecretAccessKey": "wJalrXUtnFEMI/K7MDENG"}', ""),
        (b'{"error": "chat <b>c-1</b> is closed\\n\\tcall us"}', "chat b c-1 b is closed call us"),
        (b'{"error": {"message": "bad chat"}}', "bad chat"),
        (b'{"reason": "' + b"x" * 500 + b'"}', "x" * 80),
    ],
)
async def test_an_error_answers_body_is_shown_only_as_a_short_sanitised_reason(
    body: bytes, reason: str
) -> None:
    answer = httpx.Response(400, content=body)
    assert short_reason(answer) == reason
    failure = await send_failure(answering(400, body), ReplyUrlPolicy.of("127.0.0.1", ""))
    assert failure.kind is Kind.PERMANENT
    assert failure.reason == ("HTTP 400" + (f": {reason}" if reason else ""))
    assert "Secret" not in failure.reason and "AKIA" not in failure.reason
