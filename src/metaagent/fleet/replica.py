"""This replica's place in the fleet: its settings checked at start-up, its shared state, its heartbeat.

Without `METAAGENT_REDIS_URL` the service is one machine and its state lives in memory (`LocalState`).
With it, `METAAGENT_NODE_URL` and `METAAGENT_FLEET_TOKEN` are required (exit 2 without them): the other
replicas reach this one at that URL and present that secret. Each start is a new node id, so records of an
earlier run of the same replica (a crash, a kill -9) belong to a node that is lost, never to this one.
"""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass
from urllib.parse import urlsplit

import anyio

from metaagent.errors import ConfigError
from metaagent.fleet.state import HEARTBEAT_S, LocalState, RedisState, SharedState, SharedStateUnavailable
from metaagent.settings import Settings

log = logging.getLogger("metaagent")

MIN_TOKEN_CHARS = 32


@dataclass(frozen=True)
class FleetConfig:
    redis_url: str
    node_url: str
    token: str

    def __repr__(self) -> str:  # the URL may hold Redis's password, and the token is a secret
        return f"FleetConfig(node_url={self.node_url!r})"


def fleet_config(settings: Settings) -> FleetConfig | None:
    """None for one machine; the fleet's settings, checked, with Redis (ConfigError names each problem)."""
    if settings.redis_url is None:
        return None
    redis_url = settings.redis_url.get_secret_value().strip()
    problems = []
    if urlsplit(redis_url).scheme not in ("redis", "rediss", "unix"):
        problems.append("METAAGENT_REDIS_URL: give a redis://, rediss:// or unix:// URL")
    node_url = (settings.node_url or "").strip().rstrip("/")
    parts = urlsplit(node_url)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path or parts.query:
        problems.append(
            "METAAGENT_NODE_URL: give the URL at which the other replicas reach this one, "
            "e.g. http://10.0.0.5:3102 (scheme, host and port only)"
        )
    token = settings.fleet_token.get_secret_value() if settings.fleet_token else ""
    if len(token) < MIN_TOKEN_CHARS:
        problems.append(
            f"METAAGENT_FLEET_TOKEN: give every replica the same secret of at least {MIN_TOKEN_CHARS} characters "
            '(e.g. python3 -c "import secrets; print(secrets.token_urlsafe(32))")'
        )
    if problems:
        raise ConfigError("METAAGENT_REDIS_URL is set, and the fleet's settings are incomplete:", problems)
    return FleetConfig(redis_url, node_url, token)


def shared_state(config: FleetConfig | None) -> SharedState:
    if config is None:
        return LocalState()
    return RedisState(config.redis_url, f"node_{secrets.token_hex(6)}", config.node_url)


async def keep_beating(state: SharedState) -> None:
    """Says every HEARTBEAT_S that this replica is alive (and writes back what it holds if Redis forgot
    it), until cancelled. An unreachable Redis is logged when it goes and when it comes back."""
    reachable = True
    while True:
        try:
            await state.beat()
        except SharedStateUnavailable as exc:
            if reachable:
                log.warning("fleet: %s", exc.message)
            reachable = False
        else:
            if not reachable:
                log.warning("fleet: the shared state (Redis) answers again")
            reachable = True
        await anyio.sleep(HEARTBEAT_S)
