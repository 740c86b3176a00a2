"""The package policy without npm or Docker: spec grammar, block list, allow-list and its start-up checks."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from metaagent.errors import ConfigError, PackageRefused
from metaagent.packages.policy import (
    BLOCKED_PACKAGES,
    DEFAULT_ALLOWED_PACKAGES,
    NODE_CORE_MODULES,
    PackagePolicy,
    PackageSpec,
    SpecRefused,
    parse_spec,
)

pytestmark = pytest.mark.security

VALID = [
    ("lodash", PackageSpec("lodash")),
    ("@js-joda/core", PackageSpec("@js-joda/core")),
    ("decimal.js", PackageSpec("decimal.js")),
    ("lodash@4.17.21", PackageSpec("lodash", "4.17.21")),
    ("lodash@^4.17.0", PackageSpec("lodash", "^4.17.0")),
    ("@js-joda/core@~5.6", PackageSpec("@js-joda/core", "~5.6")),
    ("dayjs@>=1.11.0 <2", PackageSpec("dayjs", ">=1.11.0 <2")),
    ("dayjs@1.x", PackageSpec("dayjs", "1.x")),
    ("dayjs@^1 || ^2", PackageSpec("dayjs", "^1 || ^2")),
    ("dayjs@1.2.3 - 1.11.0", PackageSpec("dayjs", "1.2.3 - 1.11.0")),
    ("uuid@11.0.0-rc.1", PackageSpec("uuid", "11.0.0-rc.1")),
]

MALFORMED = [
    ("", "empty"),
    ("   ", "empty"),
    ("lodash\n", "whitespace"),
    ("lodash\nfs", "whitespace"),
    ("lo\tdash", "whitespace"),
    (" lodash", "whitespace"),
    ("lodash rimraf", "whitespace"),
    ("https://evil.example/x.tgz", "url"),
    ("http://127.0.0.1/lodash", "url"),
    ("git+ssh://git@github.com/lodash/lodash.git", "git"),
    ("git://github.com/lodash/lodash.git", "git"),
    ("git@github.com:lodash/lodash.git", "git"),
    ("github:lodash/lodash", "git"),
    ("lodash/lodash", "git"),
    ("lodash@lodash/lodash#main", "git"),
    ("./lodash-4.17.21.tgz", "tarball"),
    ("lodash.tgz", "tarball"),
    ("file:../lodash", "path"),
    ("link:/opt/lodash", "path"),
    ("/etc/passwd", "path"),
    ("../lodash", "path"),
    ("~/lodash", "path"),
    ("lodash\\x", "path"),
    ("lodash@npm:evil-lodash", "alias"),
    ("npm:lodash", "alias"),
    ("lodash;rm -rf /", "whitespace"),
    ("lodash;id", "characters"),
    ("$(id)", "characters"),
    ("`id`", "characters"),
    ("lodash|cat", "characters"),
    ("lodash&&id", "characters"),
    ("Lodash", "case"),
    (".lodash", "characters"),
    ("_lodash", "characters"),
    ("@scope", "scope"),
    ("@scope/a/b", "scope"),
    ("lodäsh", "characters"),
    ("a" * 215, "length"),
    ("lodash@", "version"),
    ("lodash@latest", "version"),
    ("lodash@next", "version"),
    ("lodash@>=1;id", "version"),
    ("lodash@1.2.3\n", "whitespace"),
]


@pytest.mark.parametrize(("text", "expected"), VALID)
def test_registry_names_and_versions_are_accepted(text: str, expected: PackageSpec) -> None:
    assert parse_spec(text) == expected


@pytest.mark.parametrize(("text", "rule"), MALFORMED)
def test_each_malformed_spec_is_refused_by_its_own_rule(text: str, rule: str) -> None:
    with pytest.raises(SpecRefused) as caught:
        parse_spec(text)
    assert caught.value.rule == rule, caught.value
    refusal = caught.value.refusal()
    assert refusal.status_code == 400
    assert refusal.body()["error"].startswith("Package not allowed: ")
    assert refusal.body()["package"] == text
    assert refusal.body()["rule"] == rule


@pytest.mark.parametrize(
    "text",
    ["fs", "node:fs", "fs/promises", "node:fs/promises", "FS", "child_process", "node:child_process", "net",
     "worker_threads", "vm", "inspector", "node:test", "fs@1.0.0", "fs-extra", "graceful-fs", "shelljs", "execa",
     "cross-spawn", "node-pty", "vm2", "child-process"],
)  # fmt: skip
def test_core_modules_and_their_wrappers_are_blocked_in_every_spelling(text: str) -> None:
    with pytest.raises(SpecRefused) as caught:
        parse_spec(text)
    assert caught.value.rule == "blocked"


def test_the_block_list_covers_every_core_module_of_the_hosts_node() -> None:
    node = shutil.which("node")
    assert node, "node is needed: npm runs on it"
    listed = subprocess.run(
        [node, "-p", "JSON.stringify(require('module').builtinModules)"], capture_output=True, text=True, check=True
    )
    missing = set(json.loads(listed.stdout)) - NODE_CORE_MODULES
    assert not missing
    assert set(NODE_CORE_MODULES) <= set(BLOCKED_PACKAGES)


def _npm_module(name: str) -> Path:
    npm = shutil.which("npm")
    assert npm, "npm is needed"
    found = Path(npm).resolve().parent.parent / "node_modules" / name
    assert found.is_dir(), found
    return found


def test_what_the_grammar_accepts_npm_accepts_too() -> None:
    """Every accepted name is valid for a new npm package and every accepted version a valid range,
    by npm's own validate-npm-package-name and semver (both ship inside npm)."""
    specs = [parse_spec(text) for text, _ in VALID] + [parse_spec(t) for t in DEFAULT_ALLOWED_PACKAGES]
    script = """
      const [validate, semver] = [require(process.argv[1]), require(process.argv[2])];
      const specs = JSON.parse(process.argv[3]);
      const verdict = ([n, v]) => [validate(n).validForNewPackages, v === null || semver.validRange(v) !== null];
      console.log(JSON.stringify(specs.map(verdict)));
    """
    node = shutil.which("node")
    assert node
    result = subprocess.run(
        [node, "-e", script, str(_npm_module("validate-npm-package-name")), str(_npm_module("semver")),
         json.dumps([[s.name, s.version] for s in specs])],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    verdicts = json.loads(result.stdout)
    assert verdicts == [[True, True]] * len(specs), list(zip(specs, verdicts, strict=True))


def test_an_unset_allow_list_is_the_documented_default() -> None:
    policy = PackagePolicy.parse(None)
    assert set(policy.entries) == {parse_spec(t).name for t in DEFAULT_ALLOWED_PACKAGES}
    assert policy.entries["uuid"] == "^11"
    assert not policy.blocked_entries


@pytest.mark.parametrize("raw", ['["lodash", "@js-joda/core@^5"]', "lodash, @js-joda/core@^5"])
def test_the_allow_list_reads_json_or_comma_separated_text(raw: str) -> None:
    assert dict(PackagePolicy.parse(raw).entries) == {"lodash": None, "@js-joda/core": "^5"}


@pytest.mark.parametrize("raw", ["", "[]"])
def test_an_empty_allow_list_refuses_every_package(raw: str) -> None:
    policy = PackagePolicy.parse(raw)
    with pytest.raises(PackageRefused) as caught:
        policy.check(["lodash"])
    assert caught.value.extra["rule"] == "not-allowed"
    assert "is empty" in caught.value.message


def test_malformed_allow_list_entries_refuse_start_up_each_named() -> None:
    with pytest.raises(ConfigError) as caught:
        PackagePolicy.parse('["lodash", "https://x.example/a.tgz", "Dayjs", "zod@latest", "zod@^3"]')
    problems = "\n".join(caught.value.problems)
    assert len(caught.value.problems) == 3
    assert [p.split(":", 1)[0] for p in caught.value.problems] == ["item 2", "item 3", "item 4"]
    for bad in ("https://x.example/a.tgz", "Dayjs", "zod@latest"):
        assert bad in problems


def test_the_same_package_listed_with_two_versions_refuses_start_up() -> None:
    with pytest.raises(ConfigError) as caught:
        PackagePolicy.parse("lodash@^4, lodash@^3")
    assert caught.value.problems[0].startswith("item 2: 'lodash' is listed twice")


@pytest.mark.parametrize(("raw", "names", "empty"), [("lodash,,dayjs,", {"lodash", "dayjs"}, 2), (", ,", set(), 3)])
def test_empty_comma_separated_items_of_the_package_list_are_ignored_and_counted(
    raw: str, names: set[str], empty: int
) -> None:
    policy = PackagePolicy.parse(raw)
    assert set(policy.entries) == names
    assert policy.empty_items == empty


def test_a_json_package_list_names_each_item_that_is_not_a_string() -> None:
    with pytest.raises(ConfigError) as caught:
        PackagePolicy.parse('["lodash", 42]')
    assert caught.value.message == "METAAGENT_NPM_ALLOWED_PACKAGES is a JSON array with an item that is not a string"
    assert caught.value.problems[0].startswith("item 2: 42 is not a string")


def test_broken_json_in_the_allow_list_refuses_start_up() -> None:
    with pytest.raises(ConfigError, match="not valid JSON"):
        PackagePolicy.parse('["lodash",]')


def test_a_blocked_entry_on_the_allow_list_stays_refused() -> None:
    policy = PackagePolicy.parse('["lodash", "fs-extra", "fs"]')
    assert policy.blocked_entries == ("fs-extra", "fs")
    with pytest.raises(PackageRefused) as caught:
        policy.check(["fs-extra"])
    assert caught.value.extra["rule"] == "blocked"


def test_a_package_off_the_list_is_refused_by_name() -> None:
    with pytest.raises(PackageRefused) as caught:
        PackagePolicy.parse("lodash").check(["left-pad"])
    assert caught.value.message.startswith("Package not allowed: left-pad: left-pad is not on the package allow-list")
    assert caught.value.extra == {"package": "left-pad", "rule": "not-allowed"}


def test_a_package_asked_for_twice_is_refused() -> None:
    with pytest.raises(PackageRefused) as caught:
        PackagePolicy.parse("lodash").check(["lodash", "lodash@4"])
    assert caught.value.extra["rule"] == "duplicate"


def test_versions_combine_with_a_pinned_entry() -> None:
    policy = PackagePolicy.parse("lodash, uuid@^11, dayjs@^1 || ~2.0")
    assert policy.check(["lodash"]) == {"lodash": "latest"}
    assert policy.check(["lodash@~4.17.0"]) == {"lodash": "~4.17.0"}
    assert policy.check(["uuid"]) == {"uuid": "^11"}
    assert policy.check(["uuid@^11"]) == {"uuid": "^11"}
    assert policy.check(["uuid@11.0.3"]) == {"uuid": "11.0.3 ^11"}
    assert policy.check(["dayjs@>=1.11 || 2.0.1"]) == {"dayjs": ">=1.11 ^1 || >=1.11 ~2.0 || 2.0.1 ^1 || 2.0.1 ~2.0"}


def test_a_hyphen_range_does_not_combine_with_a_pinned_entry() -> None:
    with pytest.raises(PackageRefused) as caught:
        PackagePolicy.parse("uuid@^11").check(["uuid@11.0.0 - 11.1.0"])
    assert caught.value.extra["rule"] == "version"
