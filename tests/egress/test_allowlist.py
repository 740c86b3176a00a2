from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from metaagent.egress.allowlist import AllowList, PatternError, normalize_pattern
from metaagent.errors import ConfigError

pytestmark = pytest.mark.security

SEED = AllowList.parse('["api.openai.com", "google.serper.dev", "*.example.com"]')


@pytest.mark.parametrize("host", ["api.example.com", "service.api.example.com"])
def test_seed_wildcard_matches_subdomains_at_any_depth(host: str) -> None:
    assert SEED.match(host).pattern == "*.example.com"


@pytest.mark.parametrize("host", ["example.com", "malicious-example.com", "example.com.evil.net", "xexample.com"])
def test_seed_wildcard_never_matches_the_root_or_a_look_alike(host: str) -> None:
    assert not SEED.allows(host)


def test_exact_entry_matches_only_that_host() -> None:
    assert SEED.match("api.openai.com").pattern == "api.openai.com"
    assert not SEED.allows("openai.com")
    assert not SEED.allows("x.api.openai.com")


def test_json_array_and_comma_separated_forms_parse_the_same() -> None:
    as_json = AllowList.parse('["api.openai.com", "*.example.com"]')
    as_text = AllowList.parse(" api.openai.com , *.example.com ")
    assert as_json.patterns == as_text.patterns == ("api.openai.com", "*.example.com")


@pytest.mark.parametrize("raw", [None, "", "   ", "[]"])
def test_empty_configuration_blocks_everything(raw: str | None) -> None:
    allowlist = AllowList.parse(raw)
    assert not allowlist
    assert "empty" in allowlist.match("api.openai.com").reason


@pytest.mark.parametrize(
    ("entry", "normal"),
    [
        ("API.OpenAI.com", "api.openai.com"),
        ("api.openai.com.", "api.openai.com"),
        ("bücher.de", "xn--bcher-kva.de"),
        ("*.Bücher.DE", "*.xn--bcher-kva.de"),
        ("[::1]", "::1"),
        ("0:0:0:0:0:0:0:1", "::1"),
        ("[2001:DB8::1]", "2001:db8::1"),
        ("127.0.0.1", "127.0.0.1"),
    ],
)
def test_patterns_are_normalised(entry: str, normal: str) -> None:
    assert normalize_pattern(entry) == normal


@pytest.mark.parametrize(
    ("entry", "reason_part", "fix_part"),
    [
        ("https://api.openai.com/v1", "scheme", "api.openai.com"),
        ("api.openai.com/v1", "path", "api.openai.com"),
        ("api.openai.com:443", "port", "api.openai.com"),
        ("*", "bare wildcard", "*.example.com"),
        ("api.*.example.com", "leftmost label", "*.example.com"),
        ("*api.example.com", "leftmost label", "*.example.com"),
        ("**.example.com", "leftmost label", "*.example.com"),
        ("api..example.com", "empty label", "dot"),
        (".example.com", "start with a dot", "*.example.com"),
        ("api_openai.com", "bad character '_'", "letters"),
        ("exa mple.com", "white space", "comma"),
        ("-api.example.com", "starts or ends with '-'", "hyphens"),
        ("*.com", "top-level domain", "*.example.com"),
        ("0x7f.1", "not an IP address", "127.0.0.1"),
        ("user@api.openai.com", "user info", "api.openai.com"),
        ("", "empty entry", "remove"),
    ],
)
def test_each_malformed_pattern_has_its_own_message(entry: str, reason_part: str, fix_part: str) -> None:
    with pytest.raises(PatternError) as caught:
        normalize_pattern(entry)
    assert reason_part in caught.value.reason
    assert fix_part in caught.value.fix


def test_parse_names_every_bad_entry() -> None:
    with pytest.raises(ConfigError) as caught:
        AllowList.parse('["good.example.com", "https://bad.example.com", "api.*.x.com"]')
    assert "2 malformed entries" in caught.value.message
    problems = "\n".join(caught.value.problems)
    assert problems.startswith("item 2: 'https://bad.example.com'")
    assert "https://bad.example.com" in problems
    assert "api.*.x.com" in problems
    assert "good.example.com" not in problems


@pytest.mark.parametrize("raw", ['["a.com", "b.com",]', "['a.com']", '["a.com", b.com]', '["a.com"'])
def test_broken_json_is_refused_with_a_json_syntax_hint(raw: str) -> None:
    with pytest.raises(ConfigError) as caught:
        AllowList.parse(raw)
    assert "JSON" in str(caught.value)
    assert "double quotes" in str(caught.value)


def test_a_json_array_names_each_item_that_is_not_a_string_by_position_and_value() -> None:
    with pytest.raises(ConfigError) as caught:
        AllowList.parse('["a.example.com", 42, null, {"x": 1}]')
    assert caught.value.message == "ALLOW_HTTP_HOSTS is a JSON array with 3 items that are not strings"
    assert [p.split(";")[0] for p in caught.value.problems] == [
        "item 2: 42 is not a string",
        "item 3: null is not a string",
        'item 4: {"x": 1} is not a string',
    ]
    assert all('write it in double quotes, like "api.example.com"' in p for p in caught.value.problems)


def test_a_json_array_with_one_bad_item_says_so_in_the_singular() -> None:
    with pytest.raises(ConfigError) as caught:
        AllowList.parse("[42]")
    assert caught.value.message == "ALLOW_HTTP_HOSTS is a JSON array with an item that is not a string"
    assert caught.value.problems[0].startswith("item 1: 42 is not a string")


def test_broken_json_says_where_json_could_not_read_it() -> None:
    with pytest.raises(ConfigError) as caught:
        AllowList.parse('["a.com", "b.com",]')
    assert caught.value.problems[0] == (
        'JSON could not read it at character 19 (Expecting value), near \'["a.com", "b.com",]\''
    )


def test_quotes_without_brackets_name_the_items_that_have_them() -> None:
    with pytest.raises(ConfigError) as caught:
        AllowList.parse('a.com, "b.com", c.com')
    assert caught.value.problems[0] == "item 2: '\"b.com\"' has brackets or quotes"


def test_malformed_patterns_are_named_by_position() -> None:
    with pytest.raises(ConfigError) as caught:
        AllowList.parse("good.example.com, https://bad.example.com, a..b")
    assert [p.split(":", 1)[0] for p in caught.value.problems] == ["item 2", "item 3"]
    assert caught.value.problems[0].startswith("item 2: 'https://bad.example.com': a scheme")


@pytest.mark.parametrize(
    ("raw", "patterns", "empty"),
    [
        ("api.openai.com,", ("api.openai.com",), 1),
        ("api.openai.com,,*.example.com", ("api.openai.com", "*.example.com"), 1),
        (",api.openai.com, ,", ("api.openai.com",), 3),
    ],
)
def test_empty_comma_separated_items_are_ignored_and_counted(raw: str, patterns: tuple[str, ...], empty: int) -> None:
    allowlist = AllowList.parse(raw)
    assert allowlist.patterns == patterns
    assert allowlist.empty_items == empty


@pytest.mark.parametrize("raw", [",", " , ,", ",,,"])
def test_a_list_of_only_empty_items_is_the_empty_list(raw: str) -> None:
    allowlist = AllowList.parse(raw)
    assert not allowlist
    assert "empty" in allowlist.match("api.openai.com").reason


def test_an_empty_string_in_a_json_array_is_malformed_not_ignored() -> None:
    # JSON has no stray commas: an empty string there was written on purpose, and means nothing.
    with pytest.raises(ConfigError) as caught:
        AllowList.parse('["a.example.com", ""]')
    assert caught.value.problems == ["item 2: '': empty entry; remove it"]


def test_ip_hosts_match_only_exact_entries() -> None:
    allowlist = AllowList.of("127.0.0.1", "*.example.com")
    assert allowlist.allows("127.0.0.1")
    assert not allowlist.allows("127.0.0.2")


def test_covers_narrows_but_never_widens() -> None:
    allowlist = AllowList.of("*.example.com", "api.other.com")
    assert allowlist.covers("a.example.com")
    assert allowlist.covers("*.example.com")
    assert allowlist.covers("*.deep.example.com")
    assert allowlist.covers("api.other.com")
    assert not allowlist.covers("example.com")
    assert not allowlist.covers("*.other.com")
    assert not allowlist.covers("*.api.other.com")


# Labels that read as numbers (`123`, `0x1f`) make a host an IPv4 address, so they are not names.
labels = st.from_regex(r"[a-z0-9]([a-z0-9-]{0,10}[a-z0-9])?", fullmatch=True).filter(
    lambda s: not re.fullmatch(r"0x[0-9a-f]*|[0-9]+", s)
)


@given(sub=st.lists(labels, min_size=1, max_size=4), base=st.lists(labels, min_size=2, max_size=3))
def test_wildcard_matches_exactly_the_strict_subdomains(sub: list[str], base: list[str]) -> None:
    domain = ".".join(base)
    allowlist = AllowList.of(f"*.{domain}")
    assert allowlist.allows(".".join([*sub, domain]))
    assert not allowlist.allows(domain)
    assert not allowlist.allows(f"{sub[0]}-{domain}")
    assert not allowlist.allows(f"{sub[0]}{domain}")


@given(host=st.lists(labels, min_size=2, max_size=5).map(".".join))
def test_normalisation_is_idempotent_and_case_blind(host: str) -> None:
    normal = normalize_pattern(host.upper() + ".")
    assert normal == host
    assert normalize_pattern(normal) == normal
