"""Every error the service raises on purpose, in one tree, each with the HTTP status it maps to.

    MetaAgentError                       500 unless a subclass says otherwise
    ├── AuditWriteFailed                 500: an audit record could not be written, so the request fails
    ├── ConfigError                      refuses to start (exit status 2)
    ├── RequestRefused                   400: policy says no; the caller can change the request
    │   ├── EgressRefused                a URL, scheme or address the egress policy forbids
    │   │   └── HostBlocked              the host is not on the allow-list ("Blocked host: <host>")
    │   └── PackageRefused               an npm package the package policy forbids
    ├── Forbidden                        403: the caller's key may not see this (an operator's may)
    ├── InvalidRequest                   422: a request body that is not strict JSON (names the field)
    ├── NotFound                         404
    ├── Gone                             410: a session that has ended (its `reason` says how)
    ├── PayloadTooLarge                  413
    ├── InsufficientStorage              507: a session's workspace is full
    ├── AtCapacity                       429, with Retry-After
    │   └── ReplicaFull                  this replica's slots and queue are full (a fleet hands the call on)
    ├── ClientGone                       499: the caller disconnected; its work was cancelled
    ├── UpstreamError                    502: an allowed upstream failed (DNS, refused, TLS, bad answer)
    │   └── UpstreamTimeout              504: an allowed upstream was too slow
    └── Unavailable                      503: something the service needs is missing (engine, key, image)

    ServiceError (a MetaAgentError)      raised by `metaagent.Client`: the service answered an error status

Messages say what happened and what to do; they never contain a secret. `extra` holds additional
fields for the JSON body (`{"error": message, **extra}`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from typing import Any


class MetaAgentError(Exception):
    status_code = 500

    def __init__(self, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.message = message
        self.extra = extra

    def body(self) -> dict[str, Any]:
        return {"error": self.message, **self.extra}


class AuditWriteFailed(MetaAgentError):
    """An audit record could not be written: the request fails (500, logged) rather than go unrecorded."""


class ConfigError(MetaAgentError):
    """The configuration cannot be used; `problems` lists each bad entry with its fix."""

    def __init__(self, message: str, problems: list[str] | None = None) -> None:
        super().__init__(message)
        self.problems = problems or []

    @classmethod
    def malformed_entries(cls, setting: str, problems: list[str]) -> ConfigError:
        """A list setting with bad entries: one problem, with its fix, per entry."""
        noun = "entry" if len(problems) == 1 else "entries"
        return cls(f"{setting} has {len(problems)} malformed {noun}", problems)

    def __str__(self) -> str:
        return "\n".join([self.message, *(f"  - {p}" for p in self.problems)])


class RequestRefused(MetaAgentError):
    status_code = 400


class EgressRefused(RequestRefused):
    pass


class HostBlocked(EgressRefused):
    """The seed's `Blocked host: <host>`; `reason`, when given (a host that cannot be read), goes in a
    field of its own, so that clients matching on the seed's text keep working."""

    def __init__(self, host: str, hint: str | None = None, reason: str | None = None) -> None:
        message = f"Blocked host: {host}"
        if hint:
            message = f"{message} ({hint})"
        extra = {"host": host} if reason is None else {"host": host, "reason": reason}
        super().__init__(message, **extra)
        self.host = host
        self.reason = reason


class PackageRefused(RequestRefused):
    pass


class Forbidden(MetaAgentError):
    status_code = 403


class InvalidRequest(MetaAgentError):
    """A 422 shaped as a model's validation failure: `{"error": "Invalid request: <field>: ...", "details"}`."""

    status_code = 422

    @classmethod
    def for_field(cls, field: str, problem: str) -> InvalidRequest:
        return cls(f"Invalid request: {field}: {problem}", details=[{"field": field, "message": problem}])


class NotFound(MetaAgentError):
    status_code = 404


class Gone(MetaAgentError):
    status_code = 410


class PayloadTooLarge(MetaAgentError):
    status_code = 413


class InsufficientStorage(MetaAgentError):
    status_code = 507


class AtCapacity(MetaAgentError):
    status_code = 429

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message, retry_after_s=retry_after_s)
        self.retry_after_s = retry_after_s


class ReplicaFull(AtCapacity):
    """This replica's execution slots and queue are full. In a fleet another replica may take the call;
    the caller sees the 429 only when every replica is full."""


class ClientGone(MetaAgentError):
    """The caller hung up; nobody reads this answer (499, as nginx logs it)."""

    status_code = 499


class UpstreamError(MetaAgentError):
    status_code = 502


class UpstreamTimeout(UpstreamError):
    status_code = 504


class Unavailable(MetaAgentError):
    status_code = 503


class ServiceError(MetaAgentError):
    """Raised by `metaagent.Client`: the service answered `status_code` with `{"error": message, **extra}`."""

    def __init__(self, status_code: int, message: str, **extra: Any) -> None:
        super().__init__(message, **extra)
        self.status_code = status_code

    def __str__(self) -> str:
        return f"{self.status_code}: {self.message}"


def describe_validation_errors(
    errors: Iterable[Mapping[str, Any]], root: tuple[str, ...] = ("body",)
) -> tuple[str, list[dict[str, str]]]:
    """The 422 message ("Invalid request: <sentence>; ...") and one detail per field, from pydantic's errors.

    Each problem is a plain sentence that names the field ("timeout_s must be at most 300 (got 900)"),
    without pydantic's "Value error, " and "Assertion failed, " prefixes. A value is quoted back only
    when it is a number, a boolean or null (a string may be a secret the caller put in the wrong field).
    `root` is where the request's fields sit in each error's `loc`: under FastAPI's ("body",) for an HTTP
    body, at the top () for a model validated directly (MCP arguments), where "body" is a field's name.
    """
    details = [_detail(e, root) for e in errors]
    summary = "; ".join(d["message"] for d in details[:5])
    if len(details) > 5:
        summary += f"; and {len(details) - 5} more (see details)"
    return f"Invalid request: {summary}", details


def _detail(error: Mapping[str, Any], root: tuple[str, ...]) -> dict[str, str]:
    if error.get("type") == "json_invalid":  # its loc holds the character offset, not a field
        return {"field": "body", "message": f"the body is {_json_problem(error)}"}
    loc = tuple(error["loc"])
    path = loc[len(root) :] if loc[: len(root)] == root else loc
    field = ".".join(str(p) for p in path)
    return {"field": field or "body", "message": _sentence(field, error)}


_TYPE_NAMES = {
    "int_type": "an integer",
    "int_parsing": "an integer",
    "float_type": "a number",
    "float_parsing": "a number",
    "string_type": "a string",
    "bool_type": "true or false",
    "bool_parsing": "true or false",
    "list_type": "an array",
    "dict_type": "a JSON object",
    "model_type": "a JSON object",
    "model_attributes_type": "a JSON object",
    "none_required": "null",
}
_BOUNDS = {
    "less_than_equal": ("le", "at most"),
    "less_than": ("lt", "less than"),
    "greater_than_equal": ("ge", "at least"),
    "greater_than": ("gt", "greater than"),
}
# pydantic's own sentences begin with the kind of value they are about: "Input should be ...".
_PYDANTIC_SUBJECT = re.compile(r"^(?:Input|String|List|Value|Tuple|Set|Dictionary|Data|Object) should\b")


def _sentence(field: str, error: Mapping[str, Any]) -> str:
    kind, ctx, given = error.get("type"), error.get("ctx") or {}, error.get("input")
    subject = field or "the body"  # no field: the request as a whole
    if kind == "missing":
        return f"{field} is required" if field else "a JSON body is required"
    if kind == "extra_forbidden":
        return f"{field} is not a field of this request; leave it out"
    if kind in ("value_error", "assertion_error") and "error" in ctx:
        reason = str(ctx["error"])  # the validator's own words, without pydantic's "Value error, "
        return f"{field} is not valid: {reason}" if field else reason
    if kind in _TYPE_NAMES:
        return f"{subject} must be {_TYPE_NAMES[kind]}{_got(given)}"
    if kind in _BOUNDS:
        key, words = _BOUNDS[kind]
        bound = ctx.get(key)
        shown = int(bound) if isinstance(bound, float) and bound.is_integer() else bound  # 0, not 0.0
        return f"{subject} must be {words} {shown}{_got(given)}"
    if kind in ("string_too_short", "string_too_long"):
        bound = ctx.get("min_length") if kind == "string_too_short" else ctx.get("max_length")
        if kind == "string_too_short" and bound == 1:
            return f"{subject} must not be empty"
        size = f" (got {len(given)})" if isinstance(given, str) else ""
        words = "at least" if kind == "string_too_short" else "at most"
        return f"{subject} must be {words} {bound} characters long{size}"
    if kind in ("too_short", "too_long"):
        bound = ctx.get("min_length") if kind == "too_short" else ctx.get("max_length")
        words = "at least" if kind == "too_short" else "at most"
        actual = ctx.get("actual_length", len(given) if isinstance(given, list | dict) else None)
        items = "item" if bound == 1 else "items"
        return f"{subject} must have {words} {bound} {items}" + (f" (got {actual})" if actual is not None else "")
    if kind in ("literal_error", "enum"):
        shown = f" (got {json.dumps(given)})" if isinstance(given, str) and len(given) <= 40 else _got(given)
        return f"{subject} must be {ctx.get('expected')}{shown}"
    message = str(error["msg"])
    if _PYDANTIC_SUBJECT.match(message):
        return _PYDANTIC_SUBJECT.sub(f"{subject} must", message)
    return f"{subject}: {message}"  # the service's own words (a PydanticCustomError), named by field


def _got(value: Any) -> str:
    """ " (got 900)" for a number, a boolean or null; the JSON type for anything else."""
    if value is None or isinstance(value, bool | int | float):
        return f" (got {json.dumps(value)})"
    kinds = {str: "a string", list: "an array", dict: "an object"}
    return next((f" (got {name})" for kind, name in kinds.items() if isinstance(value, kind)), "")


def _json_problem(error: Mapping[str, Any]) -> str:
    reason = (error.get("ctx") or {}).get("error") or "JSON decode error"
    offset = error["loc"][-1] if error.get("loc") else None
    where = f" at character {offset}" if isinstance(offset, int) else ""
    return f"not valid JSON ({reason}{where}); send a JSON object"


def sole_error(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The one error inside a task group's exception group, or the group itself when there are several.

    anyio task groups wrap even a single failure in a group; callers and the HTTP error handlers expect
    the error itself (a 503 from the engine, say), not a group that would become a 500.
    """
    leaves: list[BaseException] = []
    pending: list[BaseException] = [group]
    while pending:
        current = pending.pop()
        if isinstance(current, BaseExceptionGroup):
            pending.extend(current.exceptions)
        else:
            leaves.append(current)
    return leaves[0] if len(leaves) == 1 else group
