"""The running service's parts, built once in the app's lifespan and shared by HTTP routes and MCP."""

from __future__ import annotations

from dataclasses import dataclass

from metaagent.access import ExecutionQuota
from metaagent.audit import AuditLog
from metaagent.egress.allowlist import AllowList
from metaagent.egress.guard import EgressGuard
from metaagent.executions import ExecutionRegistry
from metaagent.sandbox.engine import Engine
from metaagent.sandbox.provision import SandboxImage
from metaagent.settings import Settings
from metaagent.tools.code_interpreter import CodeInterpreter
from metaagent.tools.embeddings import EmbeddingsTool
from metaagent.tools.http import HttpTool
from metaagent.tools.search import SearchTool


@dataclass
class Services:
    settings: Settings
    allowlist: AllowList
    audit: AuditLog
    guard: EgressGuard
    http: HttpTool
    engine: Engine
    image: SandboxImage
    executions: ExecutionRegistry
    interpreter: CodeInterpreter
    search: SearchTool
    embeddings: EmbeddingsTool
    execution_quota: ExecutionQuota
