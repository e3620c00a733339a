"""api/collector.py: the `gc_thresholds` setting applied, start-up frozen, garbage not."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from context_engine.api.collector import tune_collector


@pytest.fixture
def collector_restored() -> Iterator[None]:
    thresholds = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*thresholds)


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_thresholds_are_applied_and_what_exists_is_frozen(collector_restored: None) -> None:
    kept = _Cycle()
    frozen = tune_collector((12_345, 6, 7))
    assert gc.get_threshold() == (12_345, 6, 7)
    assert frozen == gc.get_freeze_count() > 0
    assert not any(o is kept for o in gc.get_objects())  # frozen: no collection walks it


def test_garbage_made_before_is_collected_not_frozen(collector_restored: None) -> None:
    gc.disable()  # nothing collects the cycle before tune_collector does
    try:
        _Cycle()
        collected: list[int] = []

        def count(phase: str, info: dict[str, int]) -> None:
            if phase == "stop":
                collected.append(info["collected"])

        gc.callbacks.append(count)
        try:
            tune_collector(gc.get_threshold())
        finally:
            gc.callbacks.remove(count)
        assert sum(collected) >= 2  # the object and its __dict__
    finally:
        gc.enable()
