"""A replica's fleet settings: one machine without Redis; with it, a node URL and a shared secret, or no
start (exit 2, each problem named, no secret shown)."""

from __future__ import annotations

from pathlib import Path

import pytest

from metaagent.errors import ConfigError
from metaagent.fleet.replica import fleet_config, shared_state
from metaagent.fleet.state import LocalState
from tests.conftest import make_settings
from tests.test_cli import run

TOKEN = "t" * 32


def test_without_redis_the_state_is_this_machines_memory(tmp_path: Path) -> None:
    assert fleet_config(make_settings(tmp_path)) is None
    assert isinstance(shared_state(None), LocalState)


@pytest.mark.parametrize(
    ("values", "named"),
    [
        ({}, ["METAAGENT_NODE_URL", "METAAGENT_FLEET_TOKEN"]),
        ({"node_url": "http://10.0.0.5:3102", "fleet_token": "short"}, ["METAAGENT_FLEET_TOKEN"]),
        ({"node_url": "10.0.0.5:3102", "fleet_token": TOKEN}, ["METAAGENT_NODE_URL"]),
        ({"node_url": "http://10.0.0.5:3102/api", "fleet_token": TOKEN}, ["METAAGENT_NODE_URL"]),
        (
            {"node_url": "http://10.0.0.5:3102", "fleet_token": TOKEN, "redis_url": "http://r:6379"},
            ["METAAGENT_REDIS_URL"],
        ),
    ],
)
def test_with_redis_a_node_url_and_a_fleet_token_are_required(
    tmp_path: Path, values: dict[str, str], named: list[str]
) -> None:
    settings = make_settings(tmp_path, **{"redis_url": "redis://:hunter2-password@127.0.0.1:6379/0", **values})
    with pytest.raises(ConfigError) as refused:
        fleet_config(settings)
    assert [problem.split(":")[0] for problem in refused.value.problems] == named
    assert "hunter2" not in str(refused.value.problems)


def test_a_complete_fleet_configuration_is_accepted_and_keeps_its_secrets_out_of_its_repr(tmp_path: Path) -> None:
    settings = make_settings(
        tmp_path, redis_url="redis://:hunter2@127.0.0.1:6379/0", node_url="http://10.0.0.5:3102/", fleet_token=TOKEN
    )
    config = fleet_config(settings)
    assert config is not None
    assert config.node_url == "http://10.0.0.5:3102"
    assert "hunter2" not in repr(config)
    assert TOKEN not in repr(config)


def test_serve_refuses_to_start_with_an_incomplete_fleet_configuration(tmp_path: Path) -> None:
    result = run(
        tmp_path,
        "serve",
        "--port",
        "0",
        METAAGENT_REDIS_URL="redis://:hunter2@127.0.0.1:6379",
        METAAGENT_FLEET_TOKEN="short",
    )
    assert result.returncode == 2
    assert "METAAGENT_NODE_URL" in result.stderr
    assert "METAAGENT_FLEET_TOKEN" in result.stderr
    assert "hunter2" not in result.stderr + result.stdout
