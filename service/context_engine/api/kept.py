"""What a replica may keep across requests: values that can never change once written.

A checkpoint version is never rewritten, and the session log below a run's pinned seed
sequence is append-only, so the parsed checkpoint and the carried history read for a
(run, version) or (session, seed cut, summary floor) are the same on every Build. Keeping
them spares the read and the parse, and hands the core the same item objects every time,
so its render and cost memos hit. What is kept of a carried history is the part read,
newest first, as far back as the window reached (core/log_tail.py LogTail): a later Build
with a wider window reads further back and keeps that. The log below a later run's seed
extends the log below an earlier one's, so the tail read for the latest run per (session,
floor) is kept too and extended by the events since rather than read again
(Engine._carried). Plans are immutable per (tenant, session, epoch) and kept the same way.
The one value kept that does change is a run's head (Engine.build): it is never trusted,
only confirmed by the record of the Build made from it (store/records.py).

The bound is on memory, in approximate bytes (`approximate_bytes`: each object at its
size in memory), not on entries or items: one item can be a 3 MB tool result, so a
bound on items let a replica keep ~200,000 of them. The weight is computed once, when a
value is put (after the read it spares, which costs as much).
"""

from __future__ import annotations

import dataclasses
import sys
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

from pydantic import BaseModel

__all__ = ["DEFAULT_CACHE_BYTES", "Kept", "approximate_bytes"]

# The replica_cache_bytes setting's default (config.py): checkpoints, carried histories,
# loaded skills, plans and working-state folds together.
DEFAULT_CACHE_BYTES = 256 * 1024 * 1024

_SCALAR = 32  # a number, enum member, None or datetime (many are shared: an over-estimate)


def approximate_bytes(value: object) -> int:
    """Roughly the memory `value` holds: every object at its size in memory
    (sys.getsizeof: a str or bytes with its characters, a tuple, list or dict with its
    slots), a model with its `__dict__` and the set of fields it was given, a dataclass
    with its `__dict__` where it has one, and a fixed cost per scalar. A value shared by
    several entries is counted in each (an over-estimate: the bound errs toward keeping
    less). A flat 64 bytes a model counted less than half of what one holds (its
    `__dict__` and fields set cost about a kilobyte), so a cache of short items held about
    twice its bound (an audit)."""
    total = 0
    pending: list[object] = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, str | bytes):
            total += sys.getsizeof(item)
        elif isinstance(item, BaseModel):
            fields = item.__dict__
            total += sys.getsizeof(item) + sys.getsizeof(fields)
            total += sys.getsizeof(item.__pydantic_fields_set__)
            pending.extend(fields.values())
        elif isinstance(item, tuple | list | set | frozenset):
            total += sys.getsizeof(item)
            pending.extend(item)
        elif isinstance(item, dict):
            total += sys.getsizeof(item)
            pending.extend(item.keys())
            pending.extend(item.values())
        elif dataclasses.is_dataclass(item) and not isinstance(item, type):
            total += sys.getsizeof(item) + sys.getsizeof(getattr(item, "__dict__", ()))
            pending.extend(getattr(item, f.name) for f in dataclasses.fields(item))
        else:
            total += _SCALAR
    return total


class Kept:
    """A least-recently-used map bounded by the total weight of its values (the engine
    weighs them in approximate bytes)."""

    def __init__(self, max_weight: int) -> None:
        self._max = max_weight
        self._weight = 0
        self._entries: OrderedDict[Hashable, tuple[Any, int]] = OrderedDict()

    def get(self, key: Hashable) -> Any | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        return entry[0]

    def get_weighed(self, key: Hashable) -> tuple[Any, int] | None:
        """`get`, with the weight the value was put with."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        return entry

    def put(self, key: Hashable, value: Any, weight: int) -> None:
        if weight > self._max:
            return  # larger than the whole budget: not kept
        old = self._entries.pop(key, None)
        if old is not None:
            self._weight -= old[1]
        self._entries[key] = (value, weight)
        self._weight += weight
        while self._weight > self._max:
            _, (_, dropped) = self._entries.popitem(last=False)
            self._weight -= dropped

    def drop(self, key: Hashable) -> None:
        """Forget the entry under `key`, if any."""
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._weight -= entry[1]

    def drop_where(self, doomed: Callable[[Hashable], bool]) -> None:
        """Forget every entry whose key `doomed` names."""
        for key in [k for k in self._entries if doomed(k)]:
            self._weight -= self._entries.pop(key)[1]
