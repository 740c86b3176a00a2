"""The HTTP service: `create_app(settings)` composes it; nothing starts until the lifespan runs.

Configuration is read and validated here (a ConfigError stops start-up before anything runs); the
running parts are built by `metaagent.services`, the routes live in `metaagent.api`, one module per
resource, and the tools come from `metaagent.catalogue`.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from metaagent import __version__
from metaagent.access import KeyRing, RequireApiKey
from metaagent.api import executions, health, sessions
from metaagent.api.errors import install_error_handlers
from metaagent.api.tools import tools_router
from metaagent.body_limit import LimitRequestBody
from metaagent.catalogue import TOOLS
from metaagent.disconnects import LogHangUps
from metaagent.egress.allowlist import AllowList
from metaagent.fleet.replica import fleet_config
from metaagent.fleet.routing import AcceptFleetRequests, RouteToOwner
from metaagent.hosts import CheckHostAndOrigin, transport_security
from metaagent.languages import served
from metaagent.mcp_server import SessionLimits, build_server, mount_mcp
from metaagent.packages.install import check_registry
from metaagent.packages.policy import PackagePolicy
from metaagent.sandbox.network import read_extra_ca_certs
from metaagent.sandbox.runtime import RuntimeChoice
from metaagent.sandbox.sizing import PoolLimits, host_memory_mb, pool_limits
from metaagent.services import Configuration, running_services
from metaagent.settings import MIB, Settings
from metaagent.tools.code_interpreter import pool_memory_mb

__all__ = ["TOOLS", "create_app"]


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()
    keys = KeyRing.from_settings(settings)  # read once; only their hashes are kept
    fleet = fleet_config(settings)
    config = Configuration(
        settings=settings,
        allowlist=AllowList.parse(settings.allow_http_hosts),
        package_policy=PackagePolicy.parse(settings.npm_allowed_packages),
        extra_ca_pem=read_extra_ca_certs(settings.sandbox_extra_ca_certs),
        runtime=RuntimeChoice.parse(settings.sandbox_runtime),
        pool_limits=lane_pool_limits(settings),
        key_count=len(keys),
        fleet=fleet,
    )
    check_registry(settings.npm_registry)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with running_services(config) as services, mcp_sessions.run():
            app.state.services = services
            app.state.stop_executions = services.begin_stop
            yield

    app = FastAPI(
        title="MetaAgent tools",
        version=__version__,
        description="Tools for AI agents that cannot endanger the machine they run on.",
        lifespan=lifespan,
    )
    install_error_handlers(app)
    app.state.keys = keys
    app.state.configuration = config
    security = transport_security(settings.allowed_hosts)  # one setting: every route and /mcp alike
    # Outermost last: a request another replica forwarded is recognised first (by the fleet's secret; it
    # carries its caller), then the Host and Origin check runs (421/403 before anything else), then the key
    # check, so a caller without a key gets a 401 before any body is read; a request for what another
    # replica holds goes there once its caller is known (metaagent.fleet.routing).
    app.add_middleware(RouteToOwner, peers=lambda: getattr(getattr(app.state, "services", None), "peers", None))
    app.add_middleware(
        LimitRequestBody,
        max_bytes=settings.max_request_body_bytes,
        max_file_bytes=settings.session_max_file_mb * MIB,
    )
    app.add_middleware(RequireApiKey, keys=keys)
    app.add_middleware(CheckHostAndOrigin, security=security)
    app.add_middleware(AcceptFleetRequests, token=fleet.token if fleet else None)
    app.add_middleware(LogHangUps)  # outermost: a hang-up anywhere inside is one info line
    app.include_router(tools_router(TOOLS))
    app.include_router(executions.router)
    app.include_router(sessions.router)
    app.include_router(health.router)
    app.state.mcp_server = build_server(TOOLS, lambda: app.state.services)

    async def forget_mcp_session(session_id: str) -> None:
        await app.state.services.fleet.withdraw("mcp", session_id)

    mcp_sessions = mount_mcp(app, app.state.mcp_server, security, session_limits(settings, keys), forget_mcp_session)
    app.state.mcp_endpoint = mcp_sessions
    return app


def lane_pool_limits(settings: Settings) -> dict[str, PoolLimits]:
    """Each served language's warm pool limits, the memory budget split evenly among them (sandbox.sizing)."""
    languages = served(settings.languages)
    cpu_count, host_mb = os.cpu_count() or 1, host_memory_mb()
    return {
        name: pool_limits(
            settings,
            cpu_count=cpu_count,
            host_mb=host_mb,
            container_mb=pool_memory_mb(language),
            lanes=len(languages),
        )
        for name, language in languages.items()
    }


def session_limits(settings: Settings, keys: KeyRing) -> SessionLimits:
    """MCP sessions: the cap from the service's own limits, split among the keys unless set."""
    total = settings.effective_mcp_max_sessions(os.cpu_count() or 1)
    per_key = settings.mcp_sessions_per_key or max(1, total // max(1, len(keys)))
    return SessionLimits(total=total, per_key=min(per_key, total), idle_timeout_s=settings.mcp_session_idle_timeout_s)
