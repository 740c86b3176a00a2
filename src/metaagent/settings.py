"""The service's configuration: one frozen model, read from `.env`, `.env.local` and the environment.

Later sources win: `.env` < `.env.local` < real environment variables. Lists (`ALLOW_HTTP_HOSTS`,
`METAAGENT_NPM_ALLOWED_PACKAGES`, `METAAGENT_API_KEYS`) are kept as raw text here and parsed by the
modules that own their rules, so that a malformed value produces that module's helpful message rather
than a generic JSON error.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, get_args

from pydantic import AliasChoices, Field, SecretStr, ValidationError, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

KIB = 1024
MIB = 1024 * KIB


LANGUAGES = ("javascript", "python")  # every language the sandbox knows, and the default of `languages`
POOL_SIZE_MAX = 64
POOL_GROWTH = 4  # the default ceiling of the warm pool, per execution slot


def default_state_dir() -> Path:
    """Where a service keeps what it writes: $XDG_STATE_HOME/metaagent, by default ~/.local/state/metaagent."""
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "metaagent"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="METAAGENT_",
        env_file=(".env", ".env.local"),
        env_file_encoding="utf-8",
        extra="ignore",
        frozen=True,
    )

    # Egress.
    allow_http_hosts: Annotated[str, NoDecode] = Field(
        default="", validation_alias=AliasChoices("ALLOW_HTTP_HOSTS", "allow_http_hosts")
    )
    allow_private_networks: bool = False
    http_max_response_bytes: int = Field(default=4 * MIB, gt=0)
    http_max_redirects: int = Field(default=5, ge=0, le=20)

    # Credentials of the upstream tools. Never logged, returned or passed to a sandbox.
    serper_api_key: SecretStr | None = Field(
        default=None, validation_alias=AliasChoices("SERPER_API_KEY", "serper_api_key")
    )
    openai_api_key: SecretStr | None = Field(
        default=None, validation_alias=AliasChoices("OPENAI_API_KEY", "openai_api_key")
    )
    serper_base_url: str = "https://google.serper.dev"
    openai_base_url: str = Field(
        default="https://api.openai.com/v1",
        validation_alias=AliasChoices("OPENAI_BASE_URL", "openai_base_url"),
    )
    # Search and embeddings: each upstream attempt's deadline, and retries of 429/5xx answers.
    upstream_timeout_s: float = Field(default=30.0, gt=0, le=300)
    upstream_max_retries: int = Field(default=2, ge=0, le=10)
    upstream_max_retry_wait_s: float = Field(default=10.0, ge=0, le=300)
    # OpenAI takes at most 2048 inputs and 300k tokens per request; a token is at least one UTF-8 byte.
    embeddings_batch_size: int = Field(default=2048, ge=1, le=2048)
    embeddings_batch_max_bytes: int = Field(default=300_000, ge=1)
    # Decoded answers are counted while they stream in and refused past these sizes: a real Serper answer
    # is well under 1 MiB; 2048 embeddings of 3072 dimensions in base64 are about 34 MB (each batch is also
    # held to what its own inputs and dimensions can need).
    search_max_response_bytes: int = Field(default=4 * MIB, ge=64 * KIB)
    embeddings_max_response_bytes: int = Field(default=64 * MIB, ge=64 * KIB)
    # The outbound connection pool of the http, search and embeddings tools (see metaagent.egress.pool).
    egress_connections_per_host: int = Field(default=8, ge=1, le=1024)
    egress_max_connections: int = Field(default=64, ge=1, le=4096)
    egress_pool_wait_s: float = Field(default=5.0, gt=0, le=120)

    # Code interpreter. `languages`: those it serves (`metaagent.languages.served`), each with its own image
    # (checked or built at start-up, and by `metaagent sandbox build`) and warm pool; JavaScript always.
    # `sandbox_image` overrides JavaScript's image tag only.
    languages: Annotated[tuple[str, ...], NoDecode] = LANGUAGES
    sandbox_image: str | None = None
    sandbox_cache_dir: Path = Path("/var/cache/metaagent")
    sandbox_build_on_start: bool = True
    sandbox_cpus: float = Field(default=0.5, gt=0, le=8)
    # The isolation runtime: runc, runsc (gVisor) or auto; metaagent.sandbox.runtime checks the value.
    sandbox_runtime: str = "auto"
    max_concurrent_executions: int | None = Field(default=None, ge=1)
    execution_queue_size: int = Field(default=32, ge=0)
    kill_grace_s: float = Field(default=5.0, ge=0, le=60)
    # Warm pool: containers of the default configuration, started ahead of demand. Its size follows demand
    # between a floor (None: one per slot, as many as can run at once) and a ceiling (`pool_size`; None:
    # POOL_GROWTH per slot, for what a burst or an agent loop takes beyond them), and its idle and starting
    # containers hold at most `pool_memory_mb` (None: a quarter of the host's memory); see sandbox.sizing.
    pool_enabled: bool = True
    pool_size: int | None = Field(default=None, ge=0, le=POOL_SIZE_MAX)
    pool_min: int | None = Field(default=None, ge=0, le=POOL_SIZE_MAX)
    pool_memory_mb: int | None = Field(default=None, ge=1, le=1024 * 1024)

    # Sessions: how many may be open (None: 2 x the execution concurrency) and per key (None: an equal
    # share of that among the API keys, at least 1; all of it without keys), calls waiting per session,
    # the lifetime cap, each container's /workspace tmpfs (every container has one, so that a warm
    # container can serve a session), and the largest file upload.
    session_max: int | None = Field(default=None, ge=1)
    sessions_per_key: int | None = Field(default=None, ge=1)
    session_queue: int = Field(default=8, ge=0)
    session_max_lifetime_s: int = Field(default=3600, ge=60, le=86400)
    session_workspace_mb: int = Field(default=100, ge=1, le=4096)
    session_max_file_mb: int = Field(default=25, ge=1, le=4096)
    # A file request the session's runner does not begin to answer in this time ends the session (the
    # program blocks its event loop).
    session_file_timeout_s: float = Field(default=30.0, gt=0, le=600)

    # Access: API keys (`metaagent.access` parses them), executions one key may have running or queued,
    # and the largest request body accepted (413 past it, counted while it streams in).
    api_keys: Annotated[SecretStr | None, NoDecode] = None
    api_keys_file: Path | None = None
    max_executions_per_key: int = Field(default=16, ge=1)
    max_request_body_bytes: int = Field(default=8 * MIB, ge=1024)

    # npm packages for sandboxed code (see metaagent.packages). Unset: the documented default list.
    npm_allowed_packages: Annotated[str | None, NoDecode] = None
    npm_registry: str = "https://registry.npmjs.org/"
    npm_install_timeout_s: float = Field(default=30.0, gt=0, le=300)
    npm_max_install_mb: int = Field(default=50, ge=1, le=1024)  # the seed's 50 MB app directory
    npm_cache_max_sets: int = Field(default=32, ge=1)

    # Network for sandboxed code (executions that ask for `network`): per execution, tunnels open at once,
    # bytes moved in both directions and new tunnels per second; a PEM bundle of CAs the sandbox trusts
    # besides the image's.
    sandbox_max_tunnels: int = Field(default=8, ge=1, le=64)
    sandbox_max_tunnel_bytes: int = Field(default=64 * MIB, ge=1)
    sandbox_tunnel_rate: float = Field(default=50.0, gt=0, le=10_000)
    sandbox_extra_ca_certs: Path | None = None

    # Connections (see metaagent.serving): the request line and headers must arrive within
    # `client_header_timeout_s`, each chunk of a request body within `client_body_timeout_s` of the one
    # before (and a client whose answer fills the service's buffer must take some within it), an idle
    # kept-alive connection is closed after `keep_alive_timeout_s`, and at most `max_connections` are
    # open at once (None: half the process's open-file limit).
    client_header_timeout_s: float = Field(default=10.0, gt=0, le=300)
    client_body_timeout_s: float = Field(default=30.0, gt=0, le=600)
    keep_alive_timeout_s: float = Field(default=5.0, gt=0, le=300)
    max_connections: int | None = Field(default=None, ge=1)

    # More than one machine (metaagent.fleet): the Redis server the replicas share (unset: one machine, its
    # state in memory), the URL at which the other replicas reach this one, and the secret they present to
    # each other. With Redis, the other two are required.
    redis_url: SecretStr | None = None  # a URL may carry Redis's password
    node_url: str | None = None
    fleet_token: SecretStr | None = None

    # Operations.
    # A service's state, never the directory it was started from (a checkout would collect it).
    audit_log: Path = Field(default_factory=lambda: default_state_dir() / "audit.jsonl")
    log_format: str = Field(default="text", pattern="^(text|json)$")
    # Host headers every route accepts besides the loopback names (DNS-rebinding protection); `*` turns the
    # check off. METAAGENT_MCP_ALLOWED_HOSTS is its older name, still read.
    allowed_hosts: Annotated[str, NoDecode] = Field(
        default="",
        validation_alias=AliasChoices(
            "METAAGENT_ALLOWED_HOSTS", "METAAGENT_MCP_ALLOWED_HOSTS", "allowed_hosts", "mcp_allowed_hosts"
        ),
    )
    # MCP sessions (streamable HTTP): all of them at once (default: 4 x (concurrency + queue)), one key's
    # share (default: the total divided among the keys), and the idle time after which one is closed.
    mcp_max_sessions: int | None = Field(default=None, ge=1, le=100_000)
    mcp_sessions_per_key: int | None = Field(default=None, ge=1, le=100_000)
    mcp_session_idle_timeout_s: float = Field(default=300.0, ge=1, le=86_400)

    @field_validator("languages", mode="before")
    @classmethod
    def _parse_languages(cls, value: object) -> object:
        if not isinstance(value, str):
            return value
        text = value.strip()
        if text.startswith("["):
            try:
                return json.loads(text)
            except json.JSONDecodeError as exc:
                raise ValueError(f"not a JSON array ({exc.msg}): give one, or names separated by commas") from None
        return tuple(part.strip() for part in text.split(",") if part.strip())

    @field_validator("languages")
    @classmethod
    def _check_languages(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        unknown = [name for name in value if name not in LANGUAGES]
        if unknown:
            raise ValueError(f"unknown language {unknown[0]!r}: give a list of {', '.join(LANGUAGES)}")
        if "javascript" not in value:
            raise ValueError("javascript must be enabled (the runtime self-test and npm packages use its image)")
        return tuple(dict.fromkeys(value))

    def effective_concurrency(self, cpu_count: int) -> int:
        """Concurrent executions: as many containers as the CPUs hold at `sandbox_cpus` each."""
        if self.max_concurrent_executions is not None:
            return self.max_concurrent_executions
        return max(1, int(cpu_count / self.sandbox_cpus))

    def effective_session_max(self, cpu_count: int) -> int:
        return self.session_max if self.session_max is not None else 2 * self.effective_concurrency(cpu_count)

    def effective_sessions_per_key(self, cpu_count: int, key_count: int) -> int:
        """Sessions one key may hold: the setting, else an equal share of the total among the keys (at
        least 1), so that no key can hold every session. Operator keys are held only to the total."""
        if self.sessions_per_key is not None:
            return self.sessions_per_key
        return max(1, self.effective_session_max(cpu_count) // max(1, key_count))

    def effective_mcp_max_sessions(self, cpu_count: int) -> int:
        """MCP sessions at once: a few per execution the service can run or queue, so agents that hold a
        session each always fit, and a flood of unclosed `initialize` requests cannot hold much memory."""
        if self.mcp_max_sessions is not None:
            return self.mcp_max_sessions
        return 4 * (self.effective_concurrency(cpu_count) + self.execution_queue_size)

    def effective_pool_size(self, cpu_count: int) -> int:
        """The warm pool's ceiling (0: no pool); `metaagent.sandbox.sizing.pool_limits` has the rest."""
        if not self.pool_enabled:
            return 0
        if self.pool_size is not None:
            return self.pool_size
        return min(POOL_SIZE_MAX, POOL_GROWTH * self.effective_concurrency(cpu_count))


def environment_name(field_name: str) -> str:
    """The environment variable that sets a field (its first alias, or METAAGENT_ + its name)."""
    field = Settings.model_fields.get(field_name)
    alias = field.validation_alias if field is not None else None
    if isinstance(alias, AliasChoices):
        return str(alias.choices[0])
    return f"METAAGENT_{field_name.upper()}"


def _is_secret(field_name: str) -> bool:
    field = Settings.model_fields.get(field_name)
    annotation = field.annotation if field is not None else None
    return annotation is SecretStr or SecretStr in get_args(annotation)


def describe_settings_error(exc: ValidationError) -> str:
    """Each bad setting by its environment variable, with what is wrong with it and the value given
    (never a secret's)."""
    problems = []
    for error in exc.errors():
        field = str(error["loc"][0]) if error["loc"] else ""
        given = "" if not field or _is_secret(field) else f" (got {error.get('input')!r})"
        problems.append(f"{environment_name(field) if field else 'settings'}: {error['msg']}{given}")
    return "; ".join(problems)
