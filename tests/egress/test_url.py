from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from metaagent.egress.url import InvalidHost, InvalidURL, SchemeRefused, parse_url

pytestmark = pytest.mark.security

FULLWIDTH_EXAMPLE_COM = "".join(chr(ord(c) + 0xFEE0) for c in "example.com")  # U+FF0E is the full-width dot


@pytest.mark.parametrize(
    ("url", "host"),
    [
        ("https://api.openai.com@evil.com/", "evil.com"),  # user info ends at the last @
        ("https://a@api.openai.com@evil.com/", "evil.com"),
        ("https://evil.com\\@api.openai.com/", "evil.com"),  # a backslash ends the authority
        ("https://evil.com\\.api.openai.com/", "evil.com"),
        ("https://evil.com#@api.openai.com/", "evil.com"),
        ("https://evil.com?@api.openai.com/", "evil.com"),
        ("HTTPS://API.OpenAI.COM./v1", "api.openai.com"),
        ("https:\\\\evil.com/", "evil.com"),
        ("https:evil.com/", "evil.com"),
        ("http://%65vil.com/", "evil.com"),  # percent-encoded host
        ("http://ev%49l.com/", "evil.com"),
        ("http://0x7f.1/", "127.0.0.1"),  # IPv4 in hex, octal, decimal
        ("http://0177.0.0.1/", "127.0.0.1"),
        ("http://2130706433/", "127.0.0.1"),
        ("http://127.1/", "127.0.0.1"),
        ("http://%31%32%37.0.0.1/", "127.0.0.1"),
        ("http://[::ffff:127.0.0.1]/", "::ffff:7f00:1"),
        ("http://[0:0:0:0:0:0:0:1]/", "::1"),
        ("http://\u0430pple.com/", "xn--pple-43d.com"),  # a Cyrillic a: not apple.com
        (f"http://{FULLWIDTH_EXAMPLE_COM}/", "example.com"),  # full-width letters and dot map to ASCII
        ("  http://exa\tmple.com/  ", "example.com"),  # tabs and newlines are removed, spaces trimmed
    ],
)
def test_host_is_read_as_the_url_standard_reads_it(url: str, host: str) -> None:
    assert parse_url(url).host == host


def test_userinfo_is_detected() -> None:
    assert parse_url("https://user:pw@example.com/").has_userinfo
    assert not parse_url("https://example.com/a@b").has_userinfo


def test_rebuilt_url_keeps_path_and_query_and_drops_fragment() -> None:
    target = parse_url("https://Example.com:8443/a\\b/c?x=1&y=\\#frag")
    assert target.url == "https://example.com:8443/a/b/c?x=1&y=\\"


def test_default_port_is_implied() -> None:
    assert parse_url("https://example.com").port == 443
    assert parse_url("http://example.com").url == "http://example.com/"
    assert parse_url("http://[::1]:8080/x").url == "http://[::1]:8080/x"


@pytest.mark.parametrize("url", ["ftp://example.com/", "file:///etc/passwd", "gopher://x/", "javascript:alert(1)"])
def test_only_http_and_https_are_accepted(url: str) -> None:
    with pytest.raises(SchemeRefused):
        parse_url(url)


@pytest.mark.parametrize(
    "url",
    [
        "example.com/x",
        "http://",
        "http://exa mple.com/",
        "http://a..b/",
        "http://[::1/",
        "http://x:99999/",
        "http://1.2.3.4.5/",
        "http://256.1.1.1/",
        "http://foo.08/",
        "http://ex%00ample.com/",
        "http://%ff.com/",
    ],
)
def test_invalid_urls_are_refused(url: str) -> None:
    with pytest.raises(InvalidURL):
        parse_url(url)


@pytest.mark.parametrize(
    ("url", "host"),
    [
        ("http://exa mple.com/", "exa mple.com"),
        ("http://a..b/", "a..b"),
        ("http://[::1/", "[::1"),
        ("http://[::1]x/", "[::1]x"),
        ("http://[not-ipv6]/", "[not-ipv6]"),
        ("http://1.2.3.4.5/", "1.2.3.4.5"),
        ("http://256.1.1.1/", "256.1.1.1"),
        ("http://foo.08/", "foo.08"),
        ("http://ex%00ample.com/", "ex%00ample.com"),
        ("http://%ff.com/", "%ff.com"),
    ],
)
def test_a_host_that_cannot_be_read_is_named_as_written(url: str, host: str) -> None:
    with pytest.raises(InvalidHost) as caught:
        parse_url(url)
    assert caught.value.host == host


@pytest.mark.parametrize("url", ["example.com/x", "http://", "http://x:99999/"])
def test_a_url_refused_for_its_form_or_port_is_not_a_host_refusal(url: str) -> None:
    with pytest.raises(InvalidURL) as caught:
        parse_url(url)
    assert not isinstance(caught.value, InvalidHost)


@given(st.integers(min_value=0, max_value=2**32 - 1))
def test_every_ipv4_spelling_reads_as_the_same_address(value: int) -> None:
    import ipaddress

    dotted = str(ipaddress.IPv4Address(value))
    parts = [int(p) for p in dotted.split(".")]
    spellings = [
        str(value),
        hex(value),
        ".".join(f"0{p:o}" for p in parts),
        ".".join(hex(p) for p in parts),
        f"{parts[0]}.{value & 0xFFFFFF}",
    ]
    for spelling in spellings:
        assert parse_url(f"http://{spelling}/").host == dotted
