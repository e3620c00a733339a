"""A memo keyed on an argument's identity, for frozen values that arrive as the same object.

`functools.lru_cache` keys on equality, so every lookup hashes the argument; a content
block hashes thirteen fields, and a fifty-turn request looks up two hundred blocks in
three places. The carried history's blocks are the same objects on every Build of a run
(core/carried.py keeps them), so an identity lookup answers first and the equality memo
behind it still catches equal values that are distinct objects. Each entry holds its key
object, so an id is never reused while its entry exists: a hit by id is the same object.
Pure: only how often `function` runs changes, never what a call returns. A value of None
is never remembered by identity (None marks a miss). What an entry computes is charged to
the process's render-memo byte budget (core/memo_budget.py), which empties every memo
when it is spent.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import compress, repeat
from operator import is_
from typing import Generic, TypeVar

from . import memo_budget

__all__ = ["RUNS_IN_FLIGHT", "IdentityMemo", "RecentMemo"]

# The entries of each RecentMemo of a run's carried interior: the runs a replica builds
# in turn and still finds composed. Past it (or its byte share), a run's next Build
# composes its interior again from the per-message memos (a join of their fragments).
RUNS_IN_FLIGHT = 256

K = TypeVar("K")
V = TypeVar("V")


class IdentityMemo(Generic[K, V]):
    def __init__(
        self,
        function: Callable[[K], V],
        maxsize: int = 16_384,
        *,
        by_value: bool = True,
        weigh_depth: int = memo_budget.DEPTH,
    ) -> None:
        # by_value=False: keys that are not hashable (or costly to hash) are only ever
        # remembered by identity; an equal but distinct key computes afresh.
        # The equality memo's keys are this memo's, charged where they were made.
        self._by_value = (
            memo_budget.bounded_cache(maxsize, keys_charged=True)(function)
            if by_value
            else function
        )
        # How deep a stored value is weighed (memo_budget.weight; by_value=False only,
        # below): 1 for a value whose members are its texts and flat containers of shared
        # references, as a run's layout, where weighing each of a thousand anchors cost
        # more than making them.
        self._depth = weigh_depth
        self._weighs = not by_value
        # Two tables cleared together: `_keys` keeps every key alive, so while its entry
        # exists no other object can have its id, and `_values` can answer by id alone.
        self._keys: dict[int, K] = {}
        self._values: dict[int, V] = {}
        self._maxsize = maxsize
        memo_budget.register(self)

    def __call__(self, key: K) -> V:
        value = self._values.get(id(key))
        if value is not None:
            return value
        return self._store(key)

    def many(self, keys: Sequence[K]) -> list[V]:
        """[self(k) for k in keys], the lookups done without a Python call per key."""
        values = list(map(self._values.get, map(id, keys)))
        # Misses (new objects) are few; find them without a Python call per key (`None in
        # values` would call each value's __eq__).
        missing = list(map(is_, values, repeat(None)))
        if True in missing:
            for n in compress(range(len(values)), missing):
                values[n] = self._store(keys[n])
        return values  # type: ignore[return-value]

    def cache_clear(self) -> None:
        """Forget every entry held by identity (memo_budget empties memos with it)."""
        # Values first: a lookup (which takes no lock) must never find a value whose key
        # is no longer kept alive, as another object could have its id by then.
        self._values.clear()
        self._keys.clear()

    def _store(self, key: K) -> V:
        value = self._by_value(key)
        charge = memo_budget.weight(value, self._depth) if self._weighs else memo_budget.ENTRY
        # Two tables written, and one emptied at the bound: not between another thread's
        # steps (core/memo_budget.py, LOCK). The key before its value, for the lookups.
        with memo_budget.LOCK:
            memo_budget.admit()
            if len(self._values) >= self._maxsize:
                self.cache_clear()  # the equality memo still holds the values
            self._keys[id(key)] = key
            self._values[id(key)] = value
            memo_budget.charge(charge)
        # The key (a block, message or item) was charged where it was made or read: a
        # memoized rendering, an interned message, the kept history (core/memo_budget.py).
        # With by_value the value is the equality memo's, weighed and charged there (its
        # key only as a slot: core/memo_budget.py, keys_charged): this table adds its two
        # slots. Weighing it again here counted it twice, and each of a run's new blocks
        # and messages paid for the weighing twice.
        return value


class RecentMemo(Generic[K, V]):
    """A memo by identity of what the runs in flight look up on each of their Builds and
    never again once they move on: the composed text, wire bytes and layout of a run's
    carried interior (ModelRequest.repeated), tens to hundreds of kilobytes each, made for
    every new run (its history is the previous run's plus its turns, a new tuple). The
    least recently used entry goes first once `maxsize` are held or they would hold more
    than a `share` of the ledger's limit, and what it was charged is refunded
    (memo_budget.refund), so the ledger counts the runs in flight, not every run a replica
    has built. (As an IdentityMemo, bounded only by entries and without refund, the
    interiors of ended runs were most of what a new run's Build charged, about 160 of
    235 KB in bench.load's sessions, and filled the ledger every few seconds: each time,
    every session in flight derived its window afresh.)

    Pure as IdentityMemo is: each entry holds its key, so a hit by id is the same object,
    and only how often `function` runs changes. A value is weighed `weigh_depth` levels
    down (memo_budget.weight), as IdentityMemo's by_value=False does.
    """

    def __init__(
        self,
        function: Callable[[K], V],
        maxsize: int = RUNS_IN_FLIGHT,
        *,
        share: int = 16,
        weigh_depth: int = memo_budget.DEPTH,
    ) -> None:
        self._function = function
        self._maxsize = maxsize
        self._share = share  # at most limit // share bytes (one entry may pass it alone)
        self._depth = weigh_depth
        # id -> (key, value, charge), least recently used first (dicts keep insertion order).
        self._entries: dict[int, tuple[K, V, int]] = {}
        self._bytes = 0  # what the entries held now were charged
        memo_budget.register(self)

    def __call__(self, key: K) -> V:
        entries = self._entries
        # A hit reorders the entries, so it too holds the lock (core/memo_budget.py, LOCK):
        # an eviction reading the oldest entry must not see the table change under it.
        with memo_budget.LOCK:
            found = entries.pop(id(key), None)
            if found is not None:
                entries[id(key)] = found  # now the most recently used
                return found[1]
        value = self._function(key)
        # The key (a tuple of interned messages, charged where they were made) is not
        # weighed, as IdentityMemo's by_value=False does not weigh its keys.
        charge = memo_budget.weight(value, self._depth) + memo_budget.ENTRY
        with memo_budget.LOCK:
            memo_budget.admit()
            # Another thread may have stored the same key meanwhile: replaced, refunded.
            self._drop(id(key))
            room = memo_budget.limit() // self._share - charge
            while entries and (len(entries) >= self._maxsize or self._bytes > room):
                self._drop(next(iter(entries)))
            entries[id(key)] = (key, value, charge)
            self._bytes += charge
            memo_budget.charge(charge)
        return value

    def _drop(self, slot: int) -> None:
        """Forget the entry at `slot`, if any, and refund its charge (LOCK held)."""
        dropped = self._entries.pop(slot, None)
        if dropped is not None:
            self._bytes -= dropped[2]
            memo_budget.refund(dropped[2])

    def __len__(self) -> int:
        return len(self._entries)

    def held(self) -> int:
        """What the entries held now were charged, in approximate bytes."""
        return self._bytes

    def cache_clear(self) -> None:
        """Forget every entry (memo_budget empties memos with it; it resets their count)."""
        self._entries.clear()
        self._bytes = 0
