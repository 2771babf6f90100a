"""How many of something each client host holds (waiting calls, streams, connections), and all hosts together.

One home for the count behind every per-host share (one host's flood may take its share, not every host's
place). Not thread-safe: each user touches it from one event loop. Stdlib only: both halves import it.
"""

from __future__ import annotations

import ipaddress

IPV6_HOST_PREFIX = 64  # one client host: an IPv6 client holds a /64 (a subnet's addresses are all its own to use)


def client_host(address: str) -> str:
    """The client host an address counts under, in every per-host share: an IPv4 address as it is (an IPv4 client of a
    dual-stack socket, ``::ffff:a.b.c.d``, too); an IPv6 address by its /64, since a client picks any address of its
    subnet at no cost and would otherwise be as many hosts as it liked (loopback stays itself); anything that is not
    an address (a Unix socket's path) as given."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])  # an IPv6 zone (fe80::1%eth0) is not part of the host
    except ValueError:
        return address
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        if not ip.is_loopback:
            return str(ipaddress.IPv6Network((ip, IPV6_HOST_PREFIX), strict=False))
    return str(ip)


class HostCounts:
    """``total`` and ``of(host)``; a host holding none has no entry, so the memory is the hosts holding some."""

    def __init__(self) -> None:
        self.total = 0
        self._by_host: dict[str, int] = {}

    def of(self, host: str) -> int:
        return self._by_host.get(host, 0)

    def hosts(self) -> dict[str, int]:
        """A copy: each host holding some, with its count."""
        return dict(self._by_host)

    def add(self, host: str) -> None:
        self.total += 1
        self._by_host[host] = self._by_host.get(host, 0) + 1

    def remove(self, host: str) -> None:
        """One of ``host``'s back (it must hold one)."""
        left = self._by_host[host] - 1
        if left:
            self._by_host[host] = left
        else:
            del self._by_host[host]
        self.total -= 1
