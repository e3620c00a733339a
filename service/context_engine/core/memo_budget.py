"""One byte budget for every render memo in the process.

The core and the providers memoize renderings of frozen items (a block's JSON, its wire
bytes, an escaped text, a provider layout). Each memo is bounded by entries, but an entry
holds an item and its rendering, and an item may be a multi-megabyte tool result: bounded
by entries alone, a long-lived replica that has seen many large distinct items holds
gigabytes nobody sized a container for. So every memo also charges what it stores to this
one ledger, and when the ledger passes its limit the next miss empties memos and starts
the count again. Emptying costs only recomputation (a memo changes how often a function
runs, never what it returns), and the runs being built re-fill them on their next Build.

The memos are of two kinds, and the ledger keeps a count for each. *Item* memos hold what
is derived from one item's content (its rendering, its token count): the expensive part of
a history's first Build (tens of milliseconds for a window of a few hundred items), shared
by every run and replica read of equal items. *Composed* memos hold what is put together
from those per message, request or run (merged messages, canonical and wire fragments,
layouts, views): a run's first Build recomputes them from the item memos in a few
milliseconds (bench.langchain_compare's cold case), and a run that has ended never looks
them up again, so they are most of what fills the ledger when many short runs are served.
Passing the limit empties the composed memos; the item memos are emptied too only when
they alone hold more than half the limit. Emptying everything at once made every session's
next Build derive its window afresh, with 32 sessions in flight all on one event loop,
each time the ledger filled (bench.load's Build p99 was about 2 s; docs/performance.md,
The load's tail).

Only misses are charged, and weighed shallowly (`weight`: text and bytes at their size in
memory, containers and objects two levels deep at a fixed cost per reference), so a hit
costs nothing more. The weight is approximate and errs high (measured against what emptying
the memos frees: 1.1 times it for a chat of short items, 1.5 to 1.8 for results of a few
hundred characters; test_memo_budget.py holds it to at least 1): an object held by two memos
is charged to each, and an entry a memo drops by its own entry bound is not refunded, so
the memos empty sooner, never later. Two exceptions keep the count from filling with what
nobody holds twice or at all: the equality memo behind an IdentityMemo does not charge its
key again (a block or message, charged where it was made; `bounded_cache(keys_charged=
True)`), and a RecentMemo (a run's carried interior) refunds each entry it drops
(`refund`), as the interiors of ended runs were most of what a new run's Build charged.
The first exception can err low: an equality memo keeps the first equal key it saw alive
while its entry lasts, and the charge for that key's texts may be gone by then (emptied
with the interned messages and views, or dropped by a ContentMemo's entry bound). Its
value, a rendering of those texts, is charged, so what such a memo holds is at most about
twice its count, within its 16,384 entries. The limit is the server's `render_memo_bytes`
setting.

The memos are shared by the event loop and the worker threads Plan and compaction run
their CPU work in (asyncio.to_thread): both render and count. A lookup is one dict read,
atomic under the GIL, and takes no lock. What changes a memo or the count in steps another
thread must not come between holds `LOCK`: admit and emptying, charge and refund (a +=),
a store that reads its oldest entry to evict it (ContentMemo, RecentMemo, the carried
views) or writes two tables (IdentityMemo). Unlocked, a worker's admit emptying the memos
in the middle of a store on the loop made that store raise (a dict changed size while its
oldest entry was read, a key popped twice), and an identity memo answered a new object
that had a dead key's id with that key's value. A store that is one dict write whose entry
holds its own key (VariantMemo, the interned messages, the run memo of the heuristic
counter, the walk's facts) needs no lock: emptying between its check of the bound and its
write leaves only a memo emptied early. The value a miss stores is computed before the
lock is taken, so a worker's long rendering never holds up the loop's stores; the lock is
reentrant, as admit empties memos inside a store. (This leans on the GIL: a free-threaded
build would need the lookups locked too.)
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Collection
from functools import lru_cache, wraps
from threading import RLock
from typing import Any, Literal, Protocol, TypeVar

__all__ = [
    "COMPOSED",
    "DEFAULT_LIMIT",
    "DEPTH",
    "ENTRY",
    "ITEM",
    "LOCK",
    "Kind",
    "admit",
    "bounded_cache",
    "charge",
    "clear_all",
    "held",
    "limit",
    "refund",
    "register",
    "set_limit",
    "weight",
]

DEFAULT_LIMIT = 256 * 1024 * 1024  # config.py render_memo_bytes

_OBJECT = 56  # a small object's header; what a reference to a non-text value is charged
DEPTH = 2  # levels weighed below the value itself
ENTRY = 2 * _OBJECT  # a table's entry whose key and value are charged elsewhere

LOCK = RLock()  # held by every change to the memos made in more than one step (above)


class _Clearable(Protocol):
    def cache_clear(self) -> None: ...


Kind = Literal["composed", "item"]
COMPOSED: Kind = "composed"  # put together per message, request or run
ITEM: Kind = "item"  # derived from one item's content


class _Ledger:
    def __init__(self) -> None:
        self.held: dict[Kind, int] = {COMPOSED: 0, ITEM: 0}
        self.limit = DEFAULT_LIMIT
        self.memos: dict[Kind, list[_Clearable]] = {COMPOSED: [], ITEM: []}


_ledger = _Ledger()

F = TypeVar("F", bound=Callable[..., Any])


def register(memo: _Clearable, kind: Kind = COMPOSED) -> None:
    """A memo `clear_all` empties; `kind` says when the ledger empties it (above)."""
    _ledger.memos[kind].append(memo)


def set_limit(limit: int) -> None:
    """The bytes all memos may hold together (0: memos keep nothing past one miss)."""
    _ledger.limit = limit
    admit()


def limit() -> int:
    """The bytes all memos may hold together (set_limit)."""
    return _ledger.limit


def held(kind: Kind | None = None) -> int:
    """What the memos (of `kind`, or all) are charged with now, in approximate bytes."""
    return _ledger.held[kind] if kind else sum(_ledger.held.values())


def _clear(kind: Kind) -> None:
    with LOCK:
        for memo in _ledger.memos[kind]:
            memo.cache_clear()
        _ledger.held[kind] = 0


def clear_all() -> None:
    with LOCK:
        _clear(COMPOSED)
        _clear(ITEM)


def charge(nbytes: int, kind: Kind = COMPOSED) -> None:
    """Charge a stored entry to the memos of `kind`. Over the limit, memos are emptied at
    the next `admit`."""
    with LOCK:  # += reads and writes: two threads' charges must not lose one
        _ledger.held[kind] += nbytes


def refund(nbytes: int, kind: Kind = COMPOSED) -> None:
    """An entry charged to the memos of `kind` since they were last emptied is gone: its
    charge no longer counts toward the limit (core/identity_memo.py RecentMemo)."""
    with LOCK:
        _ledger.held[kind] = max(_ledger.held[kind] - nbytes, 0)


def admit() -> None:
    """Called before a miss stores: over the limit, empties the composed memos, and the
    item memos too if they alone hold more than half the limit."""
    with LOCK:
        if sum(_ledger.held.values()) > _ledger.limit:
            _clear(COMPOSED)
            if _ledger.held[ITEM] > _ledger.limit // 2:
                _clear(ITEM)


def weight(value: object, depth: int = DEPTH) -> int:
    """Approximate bytes `value` holds: str and bytes at sys.getsizeof, containers and
    objects (their __dict__ or __slots__) at a fixed cost plus their members', `depth`
    levels down; at the last level a container's members cost a fixed amount each (counted,
    not visited), and a callable (a token counter, a renderer: shared, not the memo's)
    costs a fixed amount whatever it holds."""
    total = 0
    shapes, getsizeof = _SHAPES, sys.getsizeof
    pending: list[tuple[object, int]] = [(value, depth)]
    while pending:
        item, level = pending.pop()
        shape = shapes.get(type(item)) or _new_shape(item)
        how = shape[0]
        if how == _TEXT:
            total += getsizeof(item)
            continue
        total += _OBJECT
        members: Collection[object]
        if how == _LEAF:
            continue
        if how == _SEQUENCE:
            members = item  # type: ignore[assignment]
        elif how == _MAPPING:
            mapping: dict[object, object] = item  # type: ignore[assignment]
            members = (*mapping.keys(), *mapping.values()) if level > 0 else mapping
        elif how == _ATTRIBUTES:
            members = item.__dict__.values()
        else:  # _SLOTS: the class's own __slots__, by name
            members = [getattr(item, n, None) for n in shape[1]]
        if level == 0:
            total += _OBJECT * len(members) * (2 if how == _MAPPING else 1)
            continue
        # A text or a leaf is weighed here, not pushed and popped: most of what an item
        # holds is one or the other, and a history's first Build weighs every item it
        # derives (core/carried.py: about a sixth of that Build, a quarter less so).
        for member in members:
            member_how = (shapes.get(type(member)) or _new_shape(member))[0]
            if member_how == _TEXT:
                total += getsizeof(member)
            elif member_how == _LEAF:
                total += _OBJECT
            else:
                pending.append((member, level - 1))
    return total


def _new_shape(item: object) -> tuple[int, tuple[str, ...]]:
    shape = _SHAPES[type(item)] = _shape_of(item)
    return shape


# How weight() reads a value, by its type: the memos weigh the same few types (items,
# blocks, strings, numbers, enums) over and over, and asking each value what it is cost
# more than the weighing (an int has no __slots__, and getattr finds that out by raising).
# Each test _shape_of makes is a property of the type, so it is made once per type.
_TEXT, _LEAF, _SEQUENCE, _MAPPING, _ATTRIBUTES, _SLOTS = range(6)
_SHAPES: dict[type, tuple[int, tuple[str, ...]]] = {}


def _shape_of(item: object) -> tuple[int, tuple[str, ...]]:
    """How `item` and every value of its type are weighed, and for _SLOTS the names of
    its class's own __slots__. _LEAF: a callable, or an object with neither."""
    if isinstance(item, str | bytes):
        return _TEXT, ()
    if callable(item):
        return _LEAF, ()
    if isinstance(item, tuple | list | frozenset | set):
        return _SEQUENCE, ()
    if isinstance(item, dict):
        return _MAPPING, ()
    if getattr(item, "__dict__", None) is not None:
        return _ATTRIBUTES, ()
    if slots := getattr(type(item), "__slots__", None):
        return _SLOTS, (slots,) if isinstance(slots, str) else tuple(slots)
    return _LEAF, ()


def bounded_cache(
    maxsize: int, kind: Kind = COMPOSED, *, keys_charged: bool = False
) -> Callable[[F], F]:
    """functools.lru_cache(maxsize) whose entries are charged to the ledger as memos of
    `kind`: the function runs only on a miss, so the hit path is lru_cache's own.
    `keys_charged`: the arguments are objects charged where they were made (a block, a
    message: IdentityMemo's keys), so an entry is charged its value and its slot, not its
    key's texts again."""

    def decorate(function: F) -> F:
        @wraps(function)
        def on_miss(*args: Any, **kwargs: Any) -> Any:
            admit()
            value = function(*args, **kwargs)
            key = ENTRY if keys_charged else weight(args)
            charge(key + weight(value), kind)
            return value

        cached = lru_cache(maxsize=maxsize)(on_miss)
        register(cached, kind)
        return cached  # type: ignore[return-value]

    return decorate
