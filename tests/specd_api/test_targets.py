"""The controller address setting: one gRPC target as given, or a list of replica IPs turned into an ``ipv4:`` /
``ipv6:`` target with round_robin; every malformed list refused with the field named."""

from __future__ import annotations

import pytest

from specd_api.targets import ROUND_ROBIN, Target, check_address, parse_target

TARGETS = [
    # one address is the target it always was, with gRPC's default policy (pick_first): unchanged behaviour
    pytest.param("127.0.0.1:50061", Target("127.0.0.1:50061", None, 1), id="one-ip"),
    pytest.param("controller.internal:50061", Target("controller.internal:50061", None, 1), id="one-name"),
    pytest.param("dns:///controller:50061", Target("dns:///controller:50061", None, 1), id="one-uri"),
    # several: the sockaddr resolver's list syntax, spaces dropped, round_robin over them
    pytest.param(
        "10.0.0.1:50061, 10.0.0.2:50061",
        Target("ipv4:10.0.0.1:50061,10.0.0.2:50061", ROUND_ROBIN, 2),
        id="two-ipv4",
    ),
    pytest.param("[::1]:1,[fe80::2]:2", Target("ipv6:[::1]:1,[fe80::2]:2", ROUND_ROBIN, 2), id="two-ipv6"),
]


@pytest.mark.parametrize(("address", "expected"), TARGETS)
def test_address_to_target(address, expected):
    assert parse_target(address) == expected


BAD = [
    pytest.param("", "empty string", id="empty"),
    pytest.param("10.0.0.1:1,", "entry 2 is empty", id="trailing-comma"),
    # a list is resolved as literal IPs only: a name in it would never be dialled
    pytest.param("a.internal:1,b.internal:1", "not an IP address", id="names-in-a-list"),
    pytest.param("10.0.0.1,10.0.0.2:1", "needs a port", id="no-port"),
    pytest.param("10.0.0.1:0,10.0.0.2:1", "1..65535", id="port-0"),
    pytest.param("10.0.0.1:65536,10.0.0.2:1", "1..65535", id="port-too-high"),
    pytest.param("10.0.0.1:x,10.0.0.2:1", "1..65535", id="port-not-a-number"),
    # ::1:2 could be an address or an address and a port: brackets say which
    pytest.param("::1:2,::1:3", r"\[address\]:port", id="ipv6-without-brackets"),
    pytest.param("10.0.0.1:1,[::1]:1", "mixes IPv4 and IPv6", id="mixed-families"),
    # the same replica twice would take twice its share of the calls
    pytest.param("10.0.0.1:1,10.0.0.1:1", "more than once", id="duplicate"),
]


@pytest.mark.parametrize(("address", "reason"), BAD)
def test_bad_address_is_refused_with_the_field_named(address, reason):
    with pytest.raises(ValueError, match=rf"^controller\.address.*{reason}"):
        parse_target(address, "controller.address")


def test_tls_over_several_replicas_needs_the_name_to_check_certificates_against():
    # the channel checks every replica's certificate against one name; an IP list offers none
    with pytest.raises(ValueError, match=r"^address: with TLS and several replicas set tls.server_name"):
        check_address("10.0.0.1:1,10.0.0.2:1", "address", None, tls=True)
    assert check_address("10.0.0.1:1,10.0.0.2:1", "address", "controller.internal", tls=True)
    assert check_address("10.0.0.1:1,10.0.0.2:1", "address", None, tls=False)
    assert check_address("controller.internal:1", "address", None, tls=True)  # one name is checked as itself
