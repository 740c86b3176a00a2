"""What route handlers take from the running app."""

from __future__ import annotations

from fastapi import Request

from metaagent.services import Services


def services(request: Request) -> Services:
    """The running service's parts, built by the lifespan."""
    found: Services = request.app.state.services
    return found
