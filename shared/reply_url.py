"""Where a generic account's ``reply_url`` may send its replies (issue 39, point 3): to the
public internet only. A tenant who could name any URL could make the responder POST into
the deployment's own network (Postgres' host, RabbitMQ's management port, a cloud's
metadata service) and read the answer back from the reply's status. So the URL is refused
when its host is, or resolves to, a loopback, private, link-local, metadata, unspecified,
multicast or otherwise non-public address: when the account is added (422 with the
reason), and again at every send (``platforms.http.GuardedHttp``), which connects
to the very addresses it checked, so a name that resolves elsewhere between the check and
the connection (DNS rebinding) reaches nothing inside.

An operator may allow named hosts (``CHATQ_REPLY_URL_ALLOW_HOSTS``, matched as written in
the URL) and networks (``CHATQ_REPLY_URL_ALLOW_NETWORKS``, CIDR): a receiver of their own
inside the network. The environment's own ``CHATQ_GENERIC_REPLY_URL`` is the operator's,
not a tenant's, and is not checked."""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

#: Cloud metadata services (AWS/GCP/Azure/OpenStack, AWS over IPv6, Alibaba, Oracle):
#: named apart in the reason, though most are link-local or private anyway.
METADATA = frozenset(
    ipaddress.ip_address(a) for a in ("169.254.169.254", "fd00:ec2::254", "100.100.100.200", "192.0.0.192")
)
#: NAT64's well-known prefix: its addresses carry an IPv4 address in their last 32 bits.
NAT64 = ipaddress.ip_network("64:ff9b::/96")


class ReplyUrlRefused(Exception):
    """The reply URL may not be used: why, short and in words (never an answer's body)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def why_inside(ip: IPAddress) -> str | None:
    """What kind of address ``ip`` is when it is not on the public internet ("a loopback
    address"), or None when it is. An IPv6 address that carries an IPv4 one (mapped, 6to4,
    Teredo, NAT64) is judged by that too."""
    carried: list[IPAddress] = []
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            carried.append(ip.ipv4_mapped)
        if ip.sixtofour is not None:
            carried.append(ip.sixtofour)
        if ip.teredo is not None:
            carried.extend(ip.teredo)
        if ip in NAT64:
            carried.append(ipaddress.IPv4Address(int(ip) & 0xFFFF_FFFF))
    for a in (*carried, ip):
        if a in METADATA:
            return "a cloud metadata address"
        if a.is_loopback:
            return "a loopback address"
        if a.is_link_local:
            return "a link-local address"
        if a.is_unspecified:
            return "the unspecified address"
        if a.is_multicast:
            return "a multicast address"
        if a.is_private:
            return "a private address"
        if not a.is_global or a.is_reserved:
            return "an address not on the public internet"
    return None


def parse_networks(text: str) -> tuple[IPNetwork, ...]:
    """``CHATQ_REPLY_URL_ALLOW_NETWORKS``: comma-separated CIDR networks (ValueError names
    the one that is not)."""
    networks = []
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        try:
            networks.append(ipaddress.ip_network(item, strict=False))
        except ValueError:
            raise ValueError(
                f"REPLY_URL_ALLOW_NETWORKS: {item!r} is not a network (CIDR, e.g. 10.1.2.0/24)"
            ) from None
    return tuple(networks)


def _host_name(host: str) -> str:
    return host.strip().lower().rstrip(".")


Resolve = Callable[[str, int], Awaitable[list[str]]]


async def resolve(host: str, port: int) -> list[str]:
    """Every address ``host`` resolves to (TCP), as text; ReplyUrlRefused when none."""
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        raise ReplyUrlRefused(f"its host {host} does not resolve") from None
    addresses = [str(info[4][0]) for info in infos]
    if not addresses:
        raise ReplyUrlRefused(f"its host {host} does not resolve")
    return addresses


def _address(text: str) -> IPAddress | None:
    try:
        return ipaddress.ip_address(text.split("%", 1)[0])  # an IPv6 zone id is not the address
    except ValueError:
        return None


@dataclass(frozen=True)
class ReplyUrlPolicy:
    """What the operator allows beyond the public internet."""

    allow_hosts: frozenset[str] = frozenset()
    allow_networks: tuple[IPNetwork, ...] = ()

    @classmethod
    def of(cls, hosts: str, networks: str) -> ReplyUrlPolicy:
        return cls(frozenset(_host_name(h) for h in hosts.split(",") if h.strip()), parse_networks(networks))

    def host_allowed(self, host: str) -> bool:
        return _host_name(host) in self.allow_hosts

    def refusal(self, address: str) -> str | None:
        """What kind of address the responder may not connect to ``address`` is, or None."""
        ip = _address(address)
        if ip is None:
            return "not an IP address"
        if any(ip.version == n.version and ip in n for n in self.allow_networks):
            return None
        return why_inside(ip)

    def check_addresses(self, host: str, addresses: Iterable[str]) -> None:
        """Every address a name resolved to must be allowed: one inside among public ones
        would be reached as soon as the client tries it."""
        for address in addresses:
            if kind := self.refusal(address):
                where = f"{address} is" if _address(host) is not None else f"{host} resolves to {address},"
                raise ReplyUrlRefused(
                    f"its host {where} {kind}; an operator can allow it with "
                    "CHATQ_REPLY_URL_ALLOW_HOSTS or CHATQ_REPLY_URL_ALLOW_NETWORKS"
                )

    async def check(self, url: str, resolver: Resolve = resolve) -> None:
        """Refuse ``url`` (ReplyUrlRefused, with the reason) unless it is http(s) to a host
        the operator allows or whose every address is on the public internet."""
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https"):
            raise ReplyUrlRefused("it is not an http(s) URL")
        try:
            host, port = parts.hostname, parts.port
        except ValueError:
            raise ReplyUrlRefused("its port is not a number") from None
        if not host:
            raise ReplyUrlRefused("it names no host")
        if parts.username is not None or parts.password is not None:
            raise ReplyUrlRefused("it carries a user name or password: use reply_secret to sign instead")
        if self.host_allowed(host):
            return
        port = port or (443 if parts.scheme == "https" else 80)
        addresses = [host] if _address(host) is not None else await resolver(host, port)
        self.check_addresses(host, addresses)
