"""The cyclic garbage collector, tuned for a server with many calls in flight.

CPython collects its youngest generation every 700 net allocations. A replica with tens
of calls in flight always has each call's objects alive (its request, the rows read, the
request being assembled), so every young collection found them live and promoted them;
two promotions later they were "long-lived", and once those pending objects reach a
quarter of the oldest generation CPython collects all of it. Under bench.load that was a
full collection every second or two, 0.2–0.3 s each with every call stalled behind it: 31
to 40 in a minute, 6–9 s of the server's time (docs/performance.md, The collector, and a
run's first Build). With the youngest threshold at 10,000 a call's objects are mostly
freed by reference counting before a collection sees them: in the same minute two to
four full collections ran.

Start-up's objects (modules, classes, schemas, the model registry, the engine and its
pool) live as long as the process: `gc.freeze()`, called once before the server serves,
moves them out of every later collection, so a full collection walks what serving made,
not the interpreter's own. A frozen object that becomes unreachable is still freed by
reference counting; only one that later joins a garbage cycle would never be collected,
and start-up's objects are not dropped while the process serves.
"""

from __future__ import annotations

import gc

__all__ = ["tune_collector"]


def tune_collector(thresholds: tuple[int, int, int]) -> int:
    """Apply the `gc_thresholds` setting and freeze what exists now (call once, after
    start-up). Returns how many objects were frozen."""
    gc.set_threshold(*thresholds)
    gc.collect()  # start-up's own garbage is freed, not frozen
    gc.freeze()
    return gc.get_freeze_count()
