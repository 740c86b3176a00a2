"""A session call's `error`: why it did not complete normally, in data a model can act on.

A thrown error is what the runner described (its name, message and stack); the runner is the session's
program and can send anything, so its description is checked here (an object of exactly those keys, of
strings, stack possibly null) and each field cut to ERROR_FIELD_CAP bytes. Anything else becomes a
generic error: the call threw, and stderr says what. A call that did not complete (an interrupt, a kill,
the end of the process) gets its error from what the service saw, never from the container.
"""

from __future__ import annotations

from typing import Any

from metaagent.sandbox.session_container import CallOutcome
from metaagent.sessions.models import CallError

ERROR_FIELD_CAP = 4096  # bytes of each of name, message and stack
_THROWN_KEYS = frozenset({"name", "message", "stack"})
_UNDESCRIBED = CallError(
    name="Error", message="The call threw an error that the session could not describe; stderr shows what it printed"
)
_KEPT = "the session keeps its state"
_GONE = "its state and files are gone; create a new session to go on"


def call_error(
    outcome: CallOutcome, *, timed_out: bool, killed: bool, timeout_s: int, memory_mb: int
) -> CallError | None:
    """The `error` of a call's answer: None when it completed normally."""
    if outcome.status == "ok":
        return None
    if outcome.status == "threw":
        return thrown_error(outcome.thrown)
    if outcome.status == "interrupted":
        if timed_out:
            return CallError(
                name="Timeout",
                message=f"The call ran past timeout_s={timeout_s} and was interrupted; {_KEPT} (what it defined "
                "before the interrupt stays). Retry with a larger timeout_s, or do the work in smaller calls",
            )
        if killed:
            return CallError(
                name="Killed", message=f"The call was killed (DELETE /executions) and interrupted; {_KEPT}"
            )
        return CallError(name="Killed", message=f"The call was interrupted by a signal from its own code; {_KEPT}")
    return _ended_error(outcome, timeout_s, memory_mb)


def _ended_error(outcome: CallOutcome, timeout_s: int, memory_mb: int) -> CallError:
    reason = outcome.ended
    if reason == "timeout":
        return CallError(
            name="Timeout",
            message=f"The call ran past timeout_s={timeout_s} and could not be interrupted (a loop in a timer or "
            f"a getter, say), so the session was ended: {_GONE}",
        )
    if reason == "oom" or outcome.oom_killed:
        return CallError(
            name="OutOfMemory",
            message=f"The call ran out of memory (memory_mb={memory_mb}) and the session ended: {_GONE}, with a "
            "larger memory_mb or code that holds less at once",
        )
    if reason == "exited":
        return CallError(
            name="Exited",
            message=f"The session's process exited with code {outcome.exit_code} during the call (process.exit, "
            f"or a crash), and the session ended: {_GONE}",
        )
    if reason == "closed":
        message = "The session was closed (DELETE /sessions) during the call"
    elif reason == "killed" and outcome.killed:
        message = "The call was killed (DELETE /executions) and could not be interrupted, so the session was ended"
    elif reason == "lifetime":
        message = "The session reached its lifetime cap (METAAGENT_SESSION_MAX_LIFETIME_S) during the call"
    elif reason == "stopped":
        message = "The service stopped during the call and ended its sessions"
    else:
        message = f"The session was ended during the call ({reason or 'killed'})"
    return CallError(name="Killed", message=f"{message}: {_GONE}")


def thrown_error(raw: Any) -> CallError:
    """The container's description of a thrown error, checked and capped; a generic error when malformed."""
    if not isinstance(raw, dict) or set(raw) != _THROWN_KEYS:
        return _UNDESCRIBED
    name, message, stack = raw["name"], raw["message"], raw["stack"]
    if not isinstance(name, str) or not isinstance(message, str) or not (stack is None or isinstance(stack, str)):
        return _UNDESCRIBED
    return CallError(
        name=_capped(name) or "Error",
        message=_capped(message),
        stack=None if stack is None else _capped(stack),
    )


def _capped(text: str) -> str:
    """At most ERROR_FIELD_CAP bytes of UTF-8 (a character the cut would split is left out)."""
    if len(text) * 4 <= ERROR_FIELD_CAP:
        return text
    data = text.encode("utf-8", "replace")
    if len(data) <= ERROR_FIELD_CAP:
        return text
    return data[:ERROR_FIELD_CAP].decode("utf-8", "ignore")


__all__ = ["ERROR_FIELD_CAP", "call_error", "thrown_error"]
