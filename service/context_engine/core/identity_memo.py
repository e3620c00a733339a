"""A memo keyed on an argument's identity, for frozen values that arrive as the same object.

`functools.lru_cache` keys on equality, so every lookup hashes the argument; a content
block hashes thirteen fields, and a fifty-turn request looks up two hundred blocks in
three places. The carried history's blocks are the same objects on every Build of a run
(core/carried.py keeps them), so an identity lookup answers first and the equality memo
behind it still catches equal values that are distinct objects. Each entry holds its key
object, so an id is never reused while its entry exists, and the hit is checked with `is`.
Pure: only how often `function` runs changes, never what a call returns.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache
from typing import Generic, TypeVar

__all__ = ["IdentityMemo"]

K = TypeVar("K")
V = TypeVar("V")


class IdentityMemo(Generic[K, V]):
    def __init__(self, function: Callable[[K], V], maxsize: int = 16_384) -> None:
        self._by_value = lru_cache(maxsize=maxsize)(function)
        self._by_id: dict[int, tuple[K, V]] = {}
        self._maxsize = maxsize

    def __call__(self, key: K) -> V:
        hit = self._by_id.get(id(key))
        if hit is not None and hit[0] is key:
            return hit[1]
        value = self._by_value(key)
        if len(self._by_id) >= self._maxsize:
            self._by_id.clear()  # the equality memo still holds the values
        self._by_id[id(key)] = (key, value)
        return value
