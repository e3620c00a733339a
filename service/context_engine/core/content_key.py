"""An item's content as a plain tuple: a dict key equal exactly when the items are.

Items are frozen pydantic models, and whatever assembly derives from one (its excerpt,
block, cost, pointer) is a function of its class and field values. A memo keyed on the
item itself pays pydantic's `__hash__` and `__eq__`, which are Python code; the same
values in a tuple hash and compare in C (a string caches its hash, so an item read once
and looked up again costs no rehash of its text).

Rule 1: `content_key(a) == content_key(b)` exactly when `type(a) is type(b)` and `a == b`
under pydantic's equality (extra fields are forbidden and items have no private
attributes, so its equality is the fields' values compared in order).
Rule 2: the key holds the item's field values, not the item. Looking it up raises
TypeError when a value cannot be hashed, as hashing the item would; building it raises
KeyError for an instance that lacks a field (model_construct without it).
Rule 3: ContentMemo is a memo keyed so: an equal item read again as a new object (a
checkpoint read afresh, a history read by another replica) hits it in C.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from operator import itemgetter
from typing import Any, Generic, TypeVar

from pydantic import BaseModel

from . import memo_budget

__all__ = ["ContentMemo", "content_key"]

V = TypeVar("V")

# Per class: its fields' values, in declaration order, read from the instance dict in C.
_GETTERS: dict[type[BaseModel], Callable[[dict[str, Any]], object]] = {}


def content_key(item: BaseModel) -> tuple[type[BaseModel], object]:
    """(the item's class, its field values in field order)."""
    kind = type(item)
    getter = _GETTERS.get(kind)
    if getter is None:
        getter = _GETTERS[kind] = itemgetter(*kind.model_fields)
    return (kind, getter(item.__dict__))


class ContentMemo(Generic[V]):
    """`function(item, *args)` remembered per (content_key(item), *args), bounded by
    entries and charged to the render memos' byte budget as an item memo
    (core/memo_budget.py), which empties it with the item memos. An item whose key cannot
    be hashed or built is computed without the memo. `function` must be pure on the
    item's content and the arguments, and never return None (None marks a miss)."""

    def __init__(self, function: Callable[..., V], maxsize: int) -> None:
        self._function = function
        self._maxsize = maxsize
        self._values: dict[tuple[object, ...], V] = {}
        memo_budget.register(self, memo_budget.ITEM)

    def __call__(self, item: BaseModel, *args: Hashable) -> V:
        try:
            key = (content_key(item), *args)
            found = self._values.get(key)
        except (KeyError, TypeError):
            return self._function(item, *args)
        if found is None:
            found = self._function(item, *args)
            charge = memo_budget.weight(key) + memo_budget.weight(found)
            # Reading the oldest entry and dropping it: not between another thread's steps
            # (core/memo_budget.py, LOCK).
            with memo_budget.LOCK:
                memo_budget.admit()
                if len(self._values) >= self._maxsize:
                    self._values.pop(next(iter(self._values)))  # the oldest first
                self._values[key] = found
                memo_budget.charge(charge, memo_budget.ITEM)
        return found

    def peek(self, item: BaseModel, *args: Hashable) -> V | None:
        """What `self(item, *args)` remembers, or None: nothing is computed or stored."""
        try:
            return self._values.get((content_key(item), *args))
        except (KeyError, TypeError):
            return None

    def cache_clear(self) -> None:
        self._values.clear()
