"""Deterministic ids and a manual clock, so runs against the fake are reproducible.

Ids are ``<prefix>_fake<counter>`` with one counter per prefix (``msg``, ``toolu``, ``resp``,
``fc``, ``call``, ``rs``, ``req``); ``reset()`` restarts them.
"""

from __future__ import annotations

import threading
from collections import defaultdict

__all__ = ["IdFactory", "ManualClock"]


class IdFactory:
    def __init__(self) -> None:
        self._counters: defaultdict[str, int] = defaultdict(int)
        self._lock = threading.Lock()

    def next(self, prefix: str) -> str:
        with self._lock:
            self._counters[prefix] += 1
            return f"{prefix}_fake{self._counters[prefix]:06d}"

    def reset(self) -> None:
        with self._lock:
            self._counters.clear()


class ManualClock:
    """A clock for ``FakeProvider(clock=...)``: returns ``now`` seconds until advanced."""

    def __init__(self, start: float = 1_767_225_600.0) -> None:  # 2026-01-01T00:00:00Z
        self._now = float(start)
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            return self._now

    def advance(self, seconds: float) -> float:
        if seconds < 0:
            raise ValueError("a clock does not go backwards")
        with self._lock:
            self._now += seconds
            return self._now
