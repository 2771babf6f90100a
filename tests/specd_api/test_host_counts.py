"""The client host every per-host share counts under (specd_api/host_counts.py), and the counts themselves."""

from __future__ import annotations

import pytest

from specd_api.host_counts import HostCounts, client_host


@pytest.mark.parametrize(
    ("address", "host", "why"),
    [
        ("10.0.0.7", "10.0.0.7", "an IPv4 client is its address"),
        ("::ffff:10.0.0.7", "10.0.0.7", "an IPv4 client of a dual-stack socket is the same host"),
        ("2001:db8:1:2::1", "2001:db8:1:2::/64", "an IPv6 client is its /64"),
        ("2001:db8:1:2:ffff:ffff:ffff:ffff", "2001:db8:1:2::/64", "any address of the subnet: the same host"),
        ("2001:db8:1:3::1", "2001:db8:1:3::/64", "another /64: another host"),
        ("fe80::1%eth0", "fe80::/64", "a zone is not part of the host"),
        ("::1", "::1", "loopback stays itself"),
        ("/run/specd.sock", "/run/specd.sock", "not an address: as given"),
    ],
)
def test_the_client_host_of_an_address(address: str, host: str, why: str) -> None:
    assert client_host(address) == host, why


def test_counts_keep_only_the_hosts_holding_some() -> None:
    counts = HostCounts()
    for host in ("a", "a", "b"):
        counts.add(host)
    assert (counts.total, counts.of("a"), counts.of("c")) == (3, 2, 0)
    counts.remove("a")
    counts.remove("b")
    assert counts.hosts() == {"a": 1} and counts.total == 1
