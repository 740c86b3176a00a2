"""Reading an http(s) URL's host the way browsers and the WHATWG URL standard read it.

SSRF filters are usually beaten by a disagreement between the parser that checks a URL and the one
that fetches it (`https://allowed.com\\@evil.com`, `http://0x7f.1/`, `http://%31%32%37.0.0.1`). We close
that gap from both sides: the host is read here as the standard reads it (backslashes end the
authority, the last `@` ends the user info, percent-escapes are decoded, IPv4 in any of its decimal,
octal or hex spellings is canonicalised, names go through IDNA), and the request is then sent to a URL
rebuilt from exactly these parts, so the fetching client has nothing left to interpret differently.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from urllib.parse import unquote_to_bytes, urljoin

import idna

from metaagent.errors import EgressRefused

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*):(.*)$", re.DOTALL)
_DEFAULT_PORTS = {"http": 80, "https": 443}
MAX_SHOWN_HOST = 300  # characters of a malformed host echoed in an error
# What the WHATWG standard percent-encodes in a path and in a query (C0 controls, space, DEL and every
# non-ASCII character besides these), so that the URL sent carries no byte an HTTP client would refuse.
_PATH_ENCODE = frozenset(' "<>`{}') | frozenset(chr(c) for c in range(0x20)) | {"\x7f"}
_QUERY_ENCODE = frozenset(" \"<>'") | frozenset(chr(c) for c in range(0x20)) | {"\x7f"}
# The WHATWG "forbidden domain code points", after percent-decoding.
_FORBIDDEN = frozenset(" #%/:<>?@[\\]^|\x7f") | frozenset(chr(c) for c in range(0x20))


@dataclass(frozen=True)
class Target:
    """A parsed, canonical http(s) URL."""

    scheme: str
    host: str  # normalised: lower case, punycode, canonical IP, no brackets, no trailing dot
    port: int
    path: str  # path and query, starting with "/"
    has_userinfo: bool

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        port = "" if self.port == _DEFAULT_PORTS[self.scheme] else f":{self.port}"
        return f"{self.scheme}://{host}{port}{self.path}"


class InvalidURL(EgressRefused):
    pass


class InvalidHost(InvalidURL):
    """The URL's host cannot be read; `host` is its text as written, the message says why."""

    def __init__(self, host: str, message: str) -> None:
        super().__init__(message)
        self.host = host[:MAX_SHOWN_HOST]


class SchemeRefused(EgressRefused):
    def __init__(self, scheme: str) -> None:
        super().__init__(f"Only http and https URLs are allowed, not {scheme}:", scheme=scheme)
        self.scheme = scheme


def parse_url(raw: str) -> Target:
    """Parses an absolute http or https URL; raises InvalidURL or SchemeRefused."""
    text = raw.strip("".join(chr(c) for c in range(0x21)))
    text = re.sub(r"[\t\n\r]", "", text)
    match = _SCHEME.match(text)
    if not match:
        raise InvalidURL(f"Not an absolute URL: {raw[:200]!r}; write it like https://example.com/path")
    scheme = match.group(1).lower()
    if scheme not in _DEFAULT_PORTS:
        raise SchemeRefused(scheme)
    rest = match.group(2).lstrip("/\\")
    end = next((i for i, ch in enumerate(rest) if ch in "/\\?#"), len(rest))
    authority, tail = rest[:end], rest[end:]
    userinfo, _, hostport = authority.rpartition("@")
    host_text, port = _split_port(hostport, raw)
    host = parse_host(host_text, raw)
    path, _, _fragment = tail.partition("#")
    before_query, question, query = path.partition("?")
    path = (
        _percent_encode(before_query.replace("\\", "/"), _PATH_ENCODE)
        + question
        + _percent_encode(query, _QUERY_ENCODE)
    )
    if not path.startswith("/"):
        path = "/" + path
    return Target(scheme, host, port or _DEFAULT_PORTS[scheme], path, bool(userinfo))


def _percent_encode(text: str, encode: frozenset[str]) -> str:
    """`text` with the characters of `encode`, and every non-ASCII one, as UTF-8 percent-escapes."""
    if text.isascii() and not any(ch in encode for ch in text):
        return text
    return "".join(
        "".join(f"%{byte:02X}" for byte in ch.encode("utf-8", "surrogatepass"))
        if ch in encode or not ch.isascii()
        else ch
        for ch in text
    )


def join_location(base: str, location: str) -> str:
    """The URL a redirect's `Location` names, resolved against the URL that answered, as browsers do.

    The result is checked by `parse_url` like any URL; only a Location that cannot be read at all
    raises InvalidURL here, before any HTTP client tries to interpret it.
    """
    text = location.strip("".join(chr(c) for c in range(0x21)))
    text = re.sub(r"[\t\n\r]", "", text)
    head, sep, rest = text.partition("?")
    text = head.replace("\\", "/") + sep + rest  # http(s) URLs read a backslash as a slash
    try:
        return urljoin(base, text)
    except ValueError as exc:
        raise InvalidURL(f"The redirect location {location[:200]!r} is not a URL that can be read ({exc})") from None


def _split_port(hostport: str, raw: str) -> tuple[str, int | None]:
    if hostport.startswith("["):
        close = hostport.find("]")
        if close < 0:
            raise InvalidHost(hostport, f"Unclosed IPv6 bracket in URL: {raw[:200]!r}")
        host, after = hostport[: close + 1], hostport[close + 1 :]
        if after and not after.startswith(":"):
            raise InvalidHost(hostport, f"Unexpected text after the IPv6 address in URL: {raw[:200]!r}")
        port_text = after[1:]
    else:
        host, _, port_text = hostport.partition(":")
    if not port_text:
        return host, None
    if not port_text.isascii() or not port_text.isdigit() or int(port_text) > 65535:
        raise InvalidURL(f"Invalid port {port_text[:20]!r} in URL; ports are numbers from 0 to 65535")
    return host, int(port_text)


def parse_host(text: str, raw: str = "") -> str:
    """A URL host as the WHATWG host parser reads it, in the allow-list's normal form; InvalidHost (or
    InvalidURL, for no host at all) when it cannot be read."""
    if not text:
        raise InvalidURL(f"The URL has no host: {raw[:200]!r}")
    if text.startswith("["):
        try:
            return str(ipaddress.IPv6Address(text[1:-1]))
        except ValueError:
            raise InvalidHost(text, f"Invalid IPv6 address {text[:100]!r} in URL") from None
    try:
        decoded = unquote_to_bytes(text).decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidHost(text, f"The host {text[:100]!r} is not valid UTF-8 after percent-decoding") from None
    if decoded.isascii():
        ascii_host = decoded.lower()
    else:
        try:
            ascii_host = idna.encode(idna.uts46_remap(decoded, std3_rules=False, transitional=False)).decode()
        except idna.IDNAError as exc:
            raise InvalidHost(text, f"Invalid international host name in URL ({exc})") from None
    if any(ch in _FORBIDDEN for ch in ascii_host):
        raise InvalidHost(text, f"The host {decoded[:100]!r} contains characters a host cannot have")
    labels = ascii_host.split(".")
    if len(labels) > 1 and labels[-1] == "":
        labels.pop()
    if _ends_in_number(labels[-1]):
        return _parse_ipv4(labels, text)
    host = ".".join(labels)
    if not host or "" in labels:
        raise InvalidHost(text, f"The host {decoded[:100]!r} has an empty label")
    return host


def _ends_in_number(label: str) -> bool:
    if label.isascii() and label.isdigit():
        return True
    return label[:2] in ("0x", "0X") and all(c in "0123456789abcdefABCDEF" for c in label[2:])


def _parse_ipv4(labels: list[str], host: str) -> str:
    if len(labels) > 4:
        raise InvalidHost(host, f"Invalid IPv4 address {host[:100]!r}: more than four parts")
    numbers = [_ipv4_number(label, host) for label in labels]
    if any(n > 255 for n in numbers[:-1]) or numbers[-1] >= 256 ** (5 - len(numbers)):
        raise InvalidHost(host, f"Invalid IPv4 address {host[:100]!r}: a part is out of range")
    value = numbers[-1]
    for index, number in enumerate(numbers[:-1]):
        value += number * 256 ** (3 - index)
    return str(ipaddress.IPv4Address(value))


def _ipv4_number(label: str, host: str) -> int:
    try:
        if label[:2] in ("0x", "0X"):
            return int(label[2:] or "0", 16)
        if len(label) > 1 and label.startswith("0"):
            return int(label[1:], 8)
        return int(label, 10)
    except ValueError:
        raise InvalidHost(host, f"Invalid IPv4 address {host[:100]!r}: {label[:20]!r} is not a number") from None
