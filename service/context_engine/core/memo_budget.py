"""One byte budget for every render memo in the process.

The core and the providers memoize renderings of frozen items (a block's JSON, its wire
bytes, an escaped text, a provider layout). Each memo is bounded by entries, but an entry
holds an item and its rendering, and an item may be a multi-megabyte tool result: bounded
by entries alone, a long-lived replica that has seen many large distinct items holds
gigabytes nobody sized a container for. So every memo also charges what it stores to this
one ledger, and when the ledger passes its limit the next miss empties every memo and
starts the count again. Emptying costs only recomputation (a memo changes how often a
function runs, never what it returns), and the runs being built re-fill them on their next
Build.

Only misses are charged, and weighed shallowly (`weight`: text and bytes at their size in
memory, containers and objects two levels deep at a fixed cost per reference), so a hit
costs nothing more. The weight is approximate and errs high: an object held by two memos
is charged to each, and an entry a memo drops by its own entry bound is not refunded, so
the memos empty sooner, never later. The limit is the server's `render_memo_bytes`
setting.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Collection
from functools import lru_cache, wraps
from itertools import repeat
from typing import Any, Protocol, TypeVar

__all__ = [
    "DEFAULT_LIMIT",
    "admit",
    "bounded_cache",
    "charge",
    "clear_all",
    "held",
    "register",
    "set_limit",
    "weight",
]

DEFAULT_LIMIT = 256 * 1024 * 1024  # config.py render_memo_bytes

_OBJECT = 56  # a small object's header; what a reference to a non-text value is charged
_DEPTH = 2  # levels weighed below the value itself


class _Clearable(Protocol):
    def cache_clear(self) -> None: ...


class _Ledger:
    def __init__(self) -> None:
        self.held = 0
        self.limit = DEFAULT_LIMIT
        self.memos: list[_Clearable] = []


_ledger = _Ledger()

F = TypeVar("F", bound=Callable[..., Any])


def register(memo: _Clearable) -> None:
    """A memo `clear_all` empties."""
    _ledger.memos.append(memo)


def set_limit(limit: int) -> None:
    """The bytes all memos may hold together (0: memos keep nothing past one miss)."""
    _ledger.limit = limit
    if _ledger.held > limit:
        clear_all()


def held() -> int:
    """What the memos are charged with now, in approximate bytes."""
    return _ledger.held


def clear_all() -> None:
    for memo in _ledger.memos:
        memo.cache_clear()
    _ledger.held = 0


def charge(nbytes: int) -> None:
    """Charge a stored entry. Over the limit, every memo is emptied at the next `admit`."""
    _ledger.held += nbytes


def admit() -> None:
    """Called before a miss stores: empties every memo if the ledger is over its limit."""
    if _ledger.held > _ledger.limit:
        clear_all()


def weight(value: object, depth: int = _DEPTH) -> int:
    """Approximate bytes `value` holds: str and bytes at sys.getsizeof, containers and
    objects (their __dict__ or __slots__) at a fixed cost plus their members', `depth`
    levels down; at the last level a container's members cost a fixed amount each (counted,
    not visited), and a callable (a token counter, a renderer: shared, not the memo's)
    costs a fixed amount whatever it holds."""
    total = 0
    pending: list[tuple[object, int]] = [(value, depth)]
    while pending:
        item, level = pending.pop()
        if isinstance(item, str | bytes):
            total += sys.getsizeof(item)
            continue
        total += _OBJECT
        if callable(item):
            continue
        if isinstance(item, tuple | list | frozenset | set):
            members: Collection[object] = item
        elif isinstance(item, dict):
            members = (*item.keys(), *item.values()) if level > 0 else item
        elif (attributes := getattr(item, "__dict__", None)) is not None:
            members = attributes.values()
        elif slots := getattr(type(item), "__slots__", None):
            names = (slots,) if isinstance(slots, str) else slots
            members = [getattr(item, n, None) for n in names]
        else:
            continue
        if level > 0:
            pending.extend(zip(members, repeat(level - 1)))
        else:
            total += _OBJECT * len(members) * (2 if isinstance(item, dict) else 1)
    return total


def bounded_cache(maxsize: int) -> Callable[[F], F]:
    """functools.lru_cache(maxsize) whose entries are charged to the ledger: the function
    runs only on a miss, so the hit path is lru_cache's own."""

    def decorate(function: F) -> F:
        @wraps(function)
        def on_miss(*args: Any, **kwargs: Any) -> Any:
            admit()
            value = function(*args, **kwargs)
            charge(weight(args) + weight(value))
            return value

        cached = lru_cache(maxsize=maxsize)(on_miss)
        register(cached)
        return cached  # type: ignore[return-value]

    return decorate
