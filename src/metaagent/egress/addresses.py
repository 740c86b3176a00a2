"""Which IP addresses the egress guard refuses: the IANA special-purpose address registries, as a table.

The rows are those of

- the IANA IPv4 Special-Purpose Address Registry (iana-ipv4-special-registry, last updated 2020-09-04
  in the copies checked; the two NAT64/DNS64 discovery addresses, one row there, are two here), and
- the IANA IPv6 Special-Purpose Address Registry (iana-ipv6-special-registry, as updated 2025-10-09:
  with 3fff::/20 and 5f00::/16 of 2024, 2001:1::3/128 and 100:0:0:1::/64 of 2025),

each with the registry's Name, RFC and "Globally Reachable" column. They were written from the
registries (this machine has no internet), and checked against copies of them that other projects keep;
`tests/egress/test_addresses.py` states every row again, independently, and tests each one.

One rule decides: an address is refused unless the most specific row that holds it says Globally
Reachable: True. A row marked N/A (6to4 2002::/16, Teredo 2001::/32: their reachability is a tunnel's)
or left blank (the deprecated 192.88.99.0/24 and 2001:10::/28) is refused too. Addresses that no row
holds are ordinary unicast, except for these rows of the project's own, from the address-space
registries rather than the special-purpose ones:

- 224.0.0.0/4 and ff00::/8, multicast (ipv4-address-space, ipv6-address-space): never a TCP peer;
- ::/0, everything of IPv6 outside 2000::/3, the only block the IPv6 Address Space registry allocates
  as Global Unicast (2000::/3 itself is a row that allows).

One row that allows is still not the end: 64:ff9b::/96 (NAT64, RFC 6052) embeds an IPv4 address that a
translator would reach, so that address is judged too (`64:ff9b::a00:1` is refused as 10.0.0.1 is).

Python's `ipaddress` flags are not used: they lag behind the registries and differ between Python
versions. The same table serves the HTTP tool's guard and the sandbox tunnel (`guard.address_class`).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

IPV4_REGISTRY = "iana-ipv4-special-registry"
IPV6_REGISTRY = "iana-ipv6-special-registry"
ADDRESS_SPACE = "address-space"  # rows of the project's own, from the IPv4 and IPv6 address-space registries


@dataclass(frozen=True)
class Block:
    """One row: a block, the registry's name and RFC for it, and its Globally Reachable column."""

    network: IPNetwork
    name: str
    rfc: str
    globally_reachable: bool | None  # None: N/A or blank in the registry
    kind: str  # a short class for messages and audit records ("loopback", "private-use", ...)
    registry: str

    @property
    def allows(self) -> bool:
        return self.globally_reachable is True


def _rows(registry: str, rows: list[tuple[str, str, str, bool | None, str]]) -> tuple[Block, ...]:
    return tuple(
        Block(ipaddress.ip_network(net), name, rfc, reach, kind, registry) for net, name, rfc, reach, kind in rows
    )


# fmt: off
IPV4_SPECIAL: tuple[Block, ...] = _rows(IPV4_REGISTRY, [
    ("0.0.0.0/8", '"This network"', "RFC 791, Section 3.2", False, "this-network"),
    ("0.0.0.0/32", '"This host on this network"', "RFC 1122, Section 3.2.1.3", False, "unspecified"),
    ("10.0.0.0/8", "Private-Use", "RFC 1918", False, "private-use"),
    ("100.64.0.0/10", "Shared Address Space", "RFC 6598", False, "shared (carrier-grade NAT)"),
    ("127.0.0.0/8", "Loopback", "RFC 1122, Section 3.2.1.3", False, "loopback"),
    ("169.254.0.0/16", "Link Local", "RFC 3927", False, "link-local"),
    ("172.16.0.0/12", "Private-Use", "RFC 1918", False, "private-use"),
    ("192.0.0.0/24", "IETF Protocol Assignments", "RFC 6890, Section 2.1", False, "IETF protocol assignment"),
    ("192.0.0.0/29", "IPv4 Service Continuity Prefix", "RFC 7335", False, "IPv4 service continuity"),
    ("192.0.0.8/32", "IPv4 dummy address", "RFC 7600", False, "dummy"),
    ("192.0.0.9/32", "Port Control Protocol Anycast", "RFC 7723", True, "PCP anycast"),
    ("192.0.0.10/32", "Traversal Using Relays around NAT Anycast", "RFC 8155", True, "TURN anycast"),
    ("192.0.0.170/32", "NAT64/DNS64 Discovery", "RFC 8880, RFC 7050 Section 2.2", False, "NAT64 discovery"),
    ("192.0.0.171/32", "NAT64/DNS64 Discovery", "RFC 8880, RFC 7050 Section 2.2", False, "NAT64 discovery"),
    ("192.0.2.0/24", "Documentation (TEST-NET-1)", "RFC 5737", False, "documentation"),
    ("192.31.196.0/24", "AS112-v4", "RFC 7535", True, "AS112"),
    ("192.52.193.0/24", "AMT", "RFC 7450", True, "AMT"),
    ("192.88.99.0/24", "Deprecated (6to4 Relay Anycast)", "RFC 7526", None, "deprecated 6to4 relay anycast"),
    ("192.88.99.2/32", "6a44-relay anycast address", "RFC 6751", False, "6a44 relay anycast"),
    ("192.168.0.0/16", "Private-Use", "RFC 1918", False, "private-use"),
    ("192.175.48.0/24", "Direct Delegation AS112 Service", "RFC 7534", True, "AS112"),
    ("198.18.0.0/15", "Benchmarking", "RFC 2544", False, "benchmarking"),
    ("198.51.100.0/24", "Documentation (TEST-NET-2)", "RFC 5737", False, "documentation"),
    ("203.0.113.0/24", "Documentation (TEST-NET-3)", "RFC 5737", False, "documentation"),
    ("240.0.0.0/4", "Reserved", "RFC 1112, Section 4", False, "reserved"),
    ("255.255.255.255/32", "Limited Broadcast", "RFC 8190, RFC 919 Section 7", False, "broadcast"),
])

IPV6_SPECIAL: tuple[Block, ...] = _rows(IPV6_REGISTRY, [
    ("::1/128", "Loopback Address", "RFC 4291", False, "loopback"),
    ("::/128", "Unspecified Address", "RFC 4291", False, "unspecified"),
    ("::ffff:0:0/96", "IPv4-mapped Address", "RFC 4291", False, "IPv4-mapped"),
    ("64:ff9b::/96", "IPv4-IPv6 Translat.", "RFC 6052", True, "NAT64"),
    ("64:ff9b:1::/48", "IPv4-IPv6 Translat.", "RFC 8215", False, "local-use NAT64"),
    ("100::/64", "Discard-Only Address Block", "RFC 6666", False, "discard-only"),
    ("100:0:0:1::/64", "Dummy IPv6 Prefix", "RFC 9780", False, "dummy"),
    ("2001::/23", "IETF Protocol Assignments", "RFC 2928", False, "IETF protocol assignment"),
    ("2001::/32", "TEREDO", "RFC 4380, RFC 8190", None, "Teredo"),
    ("2001:1::1/128", "Port Control Protocol Anycast", "RFC 7723", True, "PCP anycast"),
    ("2001:1::2/128", "Traversal Using Relays around NAT Anycast", "RFC 8155", True, "TURN anycast"),
    ("2001:1::3/128", "DNS-SD Service Registration Protocol Anycast Address", "RFC 9665", True, "DNS-SD SRP anycast"),
    ("2001:2::/48", "Benchmarking", "RFC 5180, RFC Errata 1752", False, "benchmarking"),
    ("2001:3::/32", "AMT", "RFC 7450", True, "AMT"),
    ("2001:4:112::/48", "AS112-v6", "RFC 7535", True, "AS112"),
    ("2001:10::/28", "Deprecated (previously ORCHID)", "RFC 4843", None, "deprecated ORCHID"),
    ("2001:20::/28", "ORCHIDv2", "RFC 7343", True, "ORCHIDv2"),
    ("2001:30::/28", "Drone Remote ID Protocol Entity Tags (DETs) Prefix", "RFC 9374", True, "DRIP DET"),
    ("2001:db8::/32", "Documentation", "RFC 3849", False, "documentation"),
    ("2002::/16", "6to4", "RFC 3056", None, "6to4"),
    ("2620:4f:8000::/48", "Direct Delegation AS112 Service", "RFC 7534", True, "AS112"),
    ("3fff::/20", "Documentation", "RFC 9637", False, "documentation"),
    ("5f00::/16", "Segment Routing (SRv6) SIDs", "RFC 9602", False, "SRv6 SID"),
    ("fc00::/7", "Unique-Local", "RFC 4193, RFC 8190", False, "unique-local"),
    ("fe80::/10", "Link-Local Unicast", "RFC 4291", False, "link-local"),
])

ADDRESS_SPACE_ROWS: tuple[Block, ...] = _rows(ADDRESS_SPACE, [
    ("224.0.0.0/4", "Multicast", "RFC 5771", None, "multicast"),
    ("::/0", "Not Global Unicast (outside 2000::/3)", "RFC 4291", None, "not global unicast"),
    ("2000::/3", "Global Unicast", "RFC 4291", True, "global unicast"),
    ("ff00::/8", "Multicast", "RFC 4291", None, "multicast"),
])
# fmt: on

TABLE: tuple[Block, ...] = IPV4_SPECIAL + IPV6_SPECIAL + ADDRESS_SPACE_ROWS
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")


def _index(blocks: tuple[Block, ...], version: int) -> tuple[tuple[int, int, dict[int, Block]], ...]:
    """Per prefix length, longest first: (prefix length, mask, {network as int: row})."""
    bits = 32 if version == 4 else 128
    by_length: dict[int, dict[int, Block]] = {}
    for block in blocks:
        if block.network.version == version:
            by_length.setdefault(block.network.prefixlen, {})[int(block.network.network_address)] = block
    full = (1 << bits) - 1
    return tuple(
        (length, full ^ ((1 << (bits - length)) - 1), rows) for length, rows in sorted(by_length.items(), reverse=True)
    )


_INDEX = {4: _index(TABLE, 4), 6: _index(TABLE, 6)}


def most_specific(address: IPAddress) -> Block | None:
    """The most specific row holding the address, or None (ordinary IPv4 unicast)."""
    value = int(address)
    for _length, mask, rows in _INDEX[address.version]:
        block = rows.get(value & mask)
        if block is not None:
            return block
    return None


@dataclass(frozen=True)
class Refusal:
    """Why an address is refused: its row, and the embedded IPv4 address when that decided."""

    block: Block
    address: IPAddress
    via: Block | None = None  # the row that embeds `address` (NAT64)

    @property
    def kind(self) -> str:
        """The class, for the [SECURITY] line and the audit record: "loopback", "private-use via NAT64"."""
        return self.block.kind if self.via is None else f"{self.block.kind} via {self.via.kind}"

    def describe(self) -> str:
        """ "a loopback address (127.0.0.0/8, RFC 1122, ...)": the class, with the row it comes from."""
        text = f"{self.block.kind} address ({self.block.network}, {self.block.rfc})"
        if self.via is not None:
            return f"{self.via.kind} address embedding {self.address}, {text}"
        return text


def refusal(address: IPAddress) -> Refusal | None:
    """Why the egress policy refuses this address by default, or None when it is globally reachable."""
    block = most_specific(address)
    if block is None:
        return None
    if not block.allows:
        return Refusal(block, address)
    if isinstance(address, ipaddress.IPv6Address) and address in _NAT64:
        embedded = ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
        inner = refusal(embedded)
        if inner is not None:
            return Refusal(inner.block, embedded, via=block)
    return None
