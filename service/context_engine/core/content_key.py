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
"""

from __future__ import annotations

from collections.abc import Callable
from operator import itemgetter
from typing import Any

from pydantic import BaseModel

__all__ = ["content_key"]

# Per class: its fields' values, in declaration order, read from the instance dict in C.
_GETTERS: dict[type[BaseModel], Callable[[dict[str, Any]], object]] = {}


def content_key(item: BaseModel) -> tuple[type[BaseModel], object]:
    """(the item's class, its field values in field order)."""
    kind = type(item)
    getter = _GETTERS.get(kind)
    if getter is None:
        getter = _GETTERS[kind] = itemgetter(*kind.model_fields)
    return (kind, getter(item.__dict__))
