"""The address table against the IANA special-purpose registries, row by row, and the guard that uses it.

The registries' rows are written out again here, independently of `egress.addresses`: block and
Globally Reachable (True, False, or None for N/A and blank). A row missing from either side, or a flag
that differs, fails; then every row is probed with an address that it, and no more specific row, holds.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path

import anyio
import pytest

from metaagent.audit import AuditLog
from metaagent.egress.addresses import (
    ADDRESS_SPACE_ROWS,
    IPV4_SPECIAL,
    IPV6_SPECIAL,
    TABLE,
    Block,
    most_specific,
    refusal,
)
from metaagent.egress.allowlist import AllowList
from metaagent.egress.guard import EgressGuard, address_class
from metaagent.errors import EgressRefused

pytestmark = pytest.mark.security

# iana-ipv4-special-registry (the NAT64/DNS64 discovery row, 192.0.0.170/32 and 192.0.0.171/32, as two).
IPV4_REGISTRY: dict[str, bool | None] = {
    "0.0.0.0/8": False,
    "0.0.0.0/32": False,
    "10.0.0.0/8": False,
    "100.64.0.0/10": False,
    "127.0.0.0/8": False,
    "169.254.0.0/16": False,
    "172.16.0.0/12": False,
    "192.0.0.0/24": False,
    "192.0.0.0/29": False,
    "192.0.0.8/32": False,
    "192.0.0.9/32": True,
    "192.0.0.10/32": True,
    "192.0.0.170/32": False,
    "192.0.0.171/32": False,
    "192.0.2.0/24": False,
    "192.31.196.0/24": True,
    "192.52.193.0/24": True,
    "192.88.99.0/24": None,  # deprecated: the flags are blank
    "192.88.99.2/32": False,
    "192.168.0.0/16": False,
    "192.175.48.0/24": True,
    "198.18.0.0/15": False,
    "198.51.100.0/24": False,
    "203.0.113.0/24": False,
    "240.0.0.0/4": False,
    "255.255.255.255/32": False,
}

# iana-ipv6-special-registry.
IPV6_REGISTRY: dict[str, bool | None] = {
    "::1/128": False,
    "::/128": False,
    "::ffff:0:0/96": False,
    "64:ff9b::/96": True,
    "64:ff9b:1::/48": False,
    "100::/64": False,
    "100:0:0:1::/64": False,
    "2001::/23": False,
    "2001::/32": None,  # Teredo: N/A
    "2001:1::1/128": True,
    "2001:1::2/128": True,
    "2001:1::3/128": True,
    "2001:2::/48": False,
    "2001:3::/32": True,
    "2001:4:112::/48": True,
    "2001:10::/28": None,  # deprecated: blank
    "2001:20::/28": True,
    "2001:30::/28": True,
    "2001:db8::/32": False,
    "2002::/16": None,  # 6to4: N/A
    "2620:4f:8000::/48": True,
    "3fff::/20": False,
    "5f00::/16": False,
    "fc00::/7": False,
    "fe80::/10": False,
}


def test_the_ipv4_table_has_exactly_the_registrys_rows_and_flags() -> None:
    assert {str(b.network): b.globally_reachable for b in IPV4_SPECIAL} == IPV4_REGISTRY
    assert len(IPV4_SPECIAL) == len(IPV4_REGISTRY)


def test_the_ipv6_table_has_exactly_the_registrys_rows_and_flags() -> None:
    assert {str(b.network): b.globally_reachable for b in IPV6_SPECIAL} == IPV6_REGISTRY
    assert len(IPV6_SPECIAL) == len(IPV6_REGISTRY)


def probe(block: Block) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """An address of the row that no more specific row holds: its first or last address, or one just
    outside a more specific row inside it. For a row that allows, one that embeds a public IPv4 address
    first (NAT64 judges what it embeds)."""
    network = block.network
    first, last = int(network.network_address), int(network.broadcast_address)
    values = [first + 0x08080808] if block.allows and last - first > 0x08080808 else []
    values += [first, last]
    for other in TABLE:
        sub = other.network
        if other is not block and sub.version == network.version and sub.prefixlen > network.prefixlen:
            values += [int(sub.network_address) - 1, int(sub.broadcast_address) + 1]
    for value in values:
        if first <= value <= last:
            candidate = ipaddress.IPv6Address(value) if network.version == 6 else ipaddress.IPv4Address(value)
            if most_specific(candidate) is block:
                return candidate
    raise AssertionError(f"no address of {network} is decided by its own row")


REGISTRY_ROWS = [b for b in TABLE if b.registry != "address-space"]


@pytest.mark.parametrize("block", REGISTRY_ROWS, ids=lambda b: str(b.network))
def test_every_registry_row_refuses_exactly_when_it_is_not_globally_reachable(block: Block) -> None:
    address = probe(block)
    found = refusal(address)
    if block.globally_reachable is True:
        assert found is None, (address, found)
    else:
        assert found is not None, address
        assert found.block is block
        assert address_class(address) == block.kind


@pytest.mark.parametrize("block", REGISTRY_ROWS, ids=lambda b: str(b.network))
def test_the_guard_resolves_every_registry_row_by_the_table(block: Block, tmp_path: Path) -> None:
    # An IP literal resolves to itself without DNS; it is not an allow-list entry, so the table decides.
    address = probe(block)
    guard = EgressGuard(AllowList.of("api.example.com"), audit=AuditLog(tmp_path / "audit.jsonl"))

    async def resolve() -> list[str]:
        return await guard.resolve(str(address), 443)

    if block.globally_reachable is True:
        assert anyio.run(resolve) == [str(address)]
    else:
        with pytest.raises(EgressRefused) as caught:
            anyio.run(resolve)
        assert f"{block.network}, {block.rfc}" in caught.value.message
        assert caught.value.extra["address_class"] == block.kind


@pytest.mark.parametrize(
    ("address", "kind"),
    [
        ("224.0.0.1", "multicast"),
        ("239.255.255.250", "multicast"),
        ("ff02::1", "multicast"),
        ("4000::1", "not global unicast"),  # reserved by the IETF in the IPv6 address space
        ("fec0::1", "not global unicast"),  # the deprecated site-local block
        ("::a00:1", "not global unicast"),  # the deprecated IPv4-compatible form
    ],
)
def test_address_space_rows_refuse_multicast_and_ipv6_outside_global_unicast(address: str, kind: str) -> None:
    assert address_class(ipaddress.ip_address(address)) == kind


@pytest.mark.parametrize("address", ["8.8.8.8", "1.1.1.1", "2606:4700:4700::1111", "2a00:1450:4001::1"])
def test_ordinary_public_addresses_are_allowed(address: str) -> None:
    assert refusal(ipaddress.ip_address(address)) is None


def test_global_unicast_is_the_only_ipv6_block_of_the_address_space_rows_that_allows() -> None:
    assert [str(b.network) for b in ADDRESS_SPACE_ROWS if b.allows] == ["2000::/3"]


@pytest.mark.parametrize(
    ("address", "refused_as"),
    [
        ("64:ff9b::10.0.0.1", "private-use via NAT64"),
        ("64:ff9b::127.0.0.1", "loopback via NAT64"),
        ("64:ff9b::169.254.169.254", "link-local via NAT64"),
        ("64:ff9b::8.8.8.8", None),  # a translator would reach a public address
        ("::ffff:8.8.8.8", "IPv4-mapped"),  # the registry: not globally reachable, whatever it embeds
        ("::ffff:127.0.0.1", "IPv4-mapped"),
        ("2002:808:808::1", "6to4"),  # N/A in the registry: refused
        ("2001:0:4136:e378:8000:63bf:3fff:fdd2", "Teredo"),
    ],
)
def test_embedded_ipv4_forms_are_judged_by_their_row_and_nat64_by_what_it_embeds(
    address: str, refused_as: str | None
) -> None:
    assert address_class(ipaddress.ip_address(address)) == refused_as


def test_the_most_specific_row_decides_inside_a_refused_block() -> None:
    # 192.0.0.0/24 refuses, but two anycast addresses inside it are globally reachable.
    assert refusal(ipaddress.ip_address("192.0.0.9")) is None
    assert refusal(ipaddress.ip_address("192.0.0.10")) is None
    assert address_class(ipaddress.ip_address("192.0.0.11")) == "IETF protocol assignment"
    assert address_class(ipaddress.ip_address("2001:1::4")) == "IETF protocol assignment"
    assert refusal(ipaddress.ip_address("2001:1::3")) is None


def test_private_networks_allowed_lets_every_class_through(tmp_path: Path) -> None:
    guard = EgressGuard(AllowList.of("api.example.com"), allow_private_networks=True)

    async def resolve(host: str) -> list[str]:
        return await guard.resolve(host, 443)

    assert anyio.run(resolve, "10.0.0.1") == ["10.0.0.1"]
    assert anyio.run(resolve, "fd00::1") == ["fd00::1"]
