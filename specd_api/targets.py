"""Where a client finds the controller: one address, or several replicas spread by gRPC client-side load balancing.

An address setting is one string. Without a comma it is one gRPC target, used as it always was (``host:port``,
``dns:///name:port``, ``unix:/path``; gRPC's default ``pick_first``). With commas it lists controller replicas, each
``IPv4:port`` or ``[IPv6]:port`` (one family for all): the channel dials every replica and spreads calls over those
that are up (``round_robin``), so a dead replica is skipped as soon as its connection drops. Host names are not
allowed in a list: gRPC resolves a list of addresses only as literal IPs (``ipv4:`` / ``ipv6:`` targets).

Checked once, when a configuration is made (``check_address``), with a message that names the field.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

ROUND_ROBIN = "round_robin"
SEPARATOR = ","


@dataclass(frozen=True)
class Target:
    """What a channel is opened with: the gRPC target string and the load-balancing policy (None: gRPC's
    default, pick_first)."""

    target: str
    lb_policy: str | None
    replicas: int

    def options(self) -> list[tuple[str, str]]:
        return [("grpc.lb_policy_name", self.lb_policy)] if self.lb_policy is not None else []


def parse_target(address: str, field: str = "address") -> Target:
    """The channel target for an address setting; a ValueError naming ``field`` when it is not one (no name: for
    a validator whose error pydantic already places)."""
    named = f"{field}: " if field else ""
    if not address or not address.strip():
        raise ValueError(f"{named}must be host:port (or several IP:port, comma-separated), got an empty string")
    if SEPARATOR not in address:
        return Target(address, None, 1)
    entries = [entry.strip() for entry in address.split(SEPARATOR)]
    families: set[int] = set()
    hosts: list[str] = []
    for n, entry in enumerate(entries):
        where = f"{named}entry {n + 1} ({entry[:60]!r})"
        if not entry:
            raise ValueError(f"{named}entry {n + 1} is empty (a stray comma?); give IP:port, comma-separated")
        host, port = _split_host_port(entry, where)
        families.add(host.version)
        hosts.append(f"[{host}]:{port}" if host.version == 6 else f"{host}:{port}")
    if len(families) > 1:
        raise ValueError(f"{named}mixes IPv4 and IPv6 addresses; list replicas of one family")
    duplicates = sorted({h for h in hosts if hosts.count(h) > 1})
    if duplicates:
        raise ValueError(f"{named}{', '.join(duplicates)} is listed more than once")
    scheme = "ipv6" if families == {6} else "ipv4"
    return Target(f"{scheme}:{SEPARATOR.join(hosts)}", ROUND_ROBIN, len(hosts))


def _split_host_port(entry: str, where: str) -> tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]:
    if entry.startswith("["):
        host_text, bracket, port_text = entry[1:].partition("]:")
        if not bracket:
            raise ValueError(f"{where}: an IPv6 replica is written [address]:port")
    else:
        host_text, colon, port_text = entry.rpartition(":")
        if not colon:
            raise ValueError(f"{where}: needs a port (IP:port)")
    try:
        host = ipaddress.ip_address(host_text)
    except ValueError:
        raise ValueError(
            f"{where}: {host_text[:60]!r} is not an IP address; a list of replicas takes literal IPs (for one DNS "
            "name give that name alone)"
        ) from None
    if host.version == 6 and not entry.startswith("["):
        raise ValueError(f"{where}: an IPv6 replica is written [address]:port")
    if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        raise ValueError(f"{where}: the port must be a number in 1..65535, got {port_text[:20]!r}")
    return host, int(port_text)


def check_address(address: str, field: str, tls_server_name: str | None, tls: bool) -> str:
    """``address`` when a client can dial it with these TLS settings; else a ValueError naming ``field``.

    With TLS and several replicas the channel checks every replica's certificate against one name (there is no
    host name in an IP list to check against), so ``tls.server_name`` must say which name that is."""
    target = parse_target(address, field)
    if tls and target.replicas > 1 and tls_server_name is None:
        named = f"{field}: " if field else ""
        raise ValueError(
            f"{named}with TLS and several replicas set tls.server_name, the name every replica's certificate "
            "carries (the certificates are checked against it, not against the IPs)"
        )
    return address
