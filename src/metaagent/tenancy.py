"""Tenancy: who may see and stop what. One rule, for every resource that belongs to a caller.

With API keys, each record (an execution; the sessions of a later issue alike) belongs to the key that
started it, and to every other key it does not exist: listing leaves it out, and reading or stopping it
answers exactly the 404 of an id that was never there, so an id says nothing about whose it is. An
operator's key (`name:key:admin` in `METAAGENT_API_KEYS`) sees and stops everything. Without keys there
is one caller, the local one, and everything is its own.

Resources use `visible_to` for listings and `check_access` for a record named by id, with the owner the
record carries (the key id its `caller` field holds).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Caller:
    """The caller of one request: its key's id (None on a service without keys), and whether that key is
    an operator's, which may see everything."""

    key_id: str | None
    operator: bool = False


LOCAL = Caller(None)  # the one caller of a service without keys


def may_access(caller: Caller, owner: str | None) -> bool:
    """The ownership rule: the owner's own key, an operator's key, or a service without keys."""
    return caller.key_id is None or caller.operator or owner == caller.key_id


def visible_to(caller: Caller, records: Iterable[T], owner: Callable[[T], str | None]) -> list[T]:
    """The records `caller` may see, in their order."""
    return [record for record in records if may_access(caller, owner(record))]


def check_access(caller: Caller, record: T, owner: str | None, not_found: Callable[[], Exception]) -> T:
    """`record` if `caller` may see it; otherwise the very error of an unknown id (`not_found()`)."""
    if not may_access(caller, owner):
        raise not_found()
    return record
