"""What a replica may keep across requests: values that can never change once written.

A checkpoint version is never rewritten, and the session log below a run's pinned seed
sequence is append-only, so the parsed checkpoint and the projected carried history of a
(run, version) or (session, seed cut, summary floor) are the same on every Build. Keeping
them spares the parse, and hands the core the same item objects every time, so its
render and cost memos hit. The log below a later run's seed extends the log below an
earlier one's (the log is append-only), so the longest prefix read per (session, floor) is
kept too and extended rather than read again (Engine._logged). The bound is on items
held, not entries: a 5,000-turn history weighs what it holds.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

__all__ = ["Kept"]


class Kept:
    """A least-recently-used map bounded by the total weight of its values."""

    def __init__(self, max_weight: int = 200_000) -> None:
        self._max = max_weight
        self._weight = 0
        self._entries: OrderedDict[Hashable, tuple[Any, int]] = OrderedDict()

    def get(self, key: Hashable) -> Any | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        return entry[0]

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

    def drop_where(self, doomed: Callable[[Hashable], bool]) -> None:
        """Forget every entry whose key `doomed` names."""
        for key in [k for k in self._entries if doomed(k)]:
            self._weight -= self._entries.pop(key)[1]
