"""What assembly derives from a run's carried history, worked out once per history.

Every Build of a run reads the same carried history: the shell keeps it and hands the core
the same tuple of the same frozen items each time (api/kept.py). Everything assembly
derives from that history item by item — the legacy excerpts that replace oversized
results, each item's placement check, its estimated cost as rendered, its pointer's cost,
its rendered block, and the least cost that bounds the window — depends only on
the history and on the plan secret, the token counter, the pinned estimator factor and
the inline limit. So it is derived once per such key and looked up after that; a Build's
own work is then the run's new items plus the output.

Pure: no I/O, no clock. The table is keyed on the history tuple's identity and holds the
tuple itself, so an entry is only ever used for the very object it was derived from (an
id is never reused while the object it names is alive); equal but distinct histories
derive their own, equal, entries. tests/unit/test_budget.py checks assembly with and
without the table decides identically.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .excerpts import legacy_excerpt
from .items import ContextItem, ConversationItem, ToolResult, check_placement
from .request import Block
from .rows import Row
from .yield_ladder import pointer_for

__all__ = ["CarriedView", "carried_view"]

# (row, item, rendered as truncated) -> estimated tokens; the same port as pressure.Cost.
Cost = Callable[[Row, ContextItem, bool], int]
Render = Callable[[Row, ContextItem, bool], Block]


@dataclass(frozen=True, slots=True)
class CarriedView:
    history: tuple[ConversationItem, ...]  # the tuple this was derived from (kept alive)
    start: int  # history[:start] no decision can depend on (see carried_view)
    shown: tuple[ConversationItem, ...]  # history[start:], legacy excerpts substituted
    excerpted: tuple[ToolResult, ...]  # the legacy excerpts among `shown`
    # (id(item), truncated) -> cost, for shown items and their pointers, and -> block, for
    # shown items; the ids stay valid because `shown` and `pointers` keep them alive.
    costs: dict[tuple[int, bool], int]
    blocks: dict[tuple[int, bool], Block]
    pointers: tuple[ToolResult, ...]
    checked: frozenset[int]  # id() of shown items whose placement in row 10 is checked


def carried_view(
    history: tuple[ConversationItem, ...],
    key: tuple[object, ...],
    cost: Cost,
    render: Render,
    inline_maximum_bytes: int,
    reach: int,
) -> CarriedView:
    """The view of `history` under `key` (secret, counter, factor, limit, reach), from the
    table or derived now. `cost` and `render` must be the pure functions `key` determines.

    Only the history a fitting request can reach is derived. `reach` is the larger of the
    body budget and history's floor. Walking newest first, the least an item can cost is
    its pointer's cost (a tool result, as its legacy excerpt where it has one) or its own.
    Once those least costs alone exceed `reach`, no suffix that starts earlier can fit the
    body, and history stays above its floor however much yields — so neither the ladder,
    the fit nor the cut decides anything differently without the older items, and they
    are not excerpted, placed or costed at all (`start`). This is what makes a Build's work
    independent of the session's length. The boundary item itself is kept (it is what
    exceeds `reach`). tests/unit/test_budget.py checks the equivalence.
    """
    slot = (id(history), reach, *key)
    entry = _TABLE.get(slot)
    if entry is not None and entry.history is history:
        return entry
    view = _derive(history, cost, render, inline_maximum_bytes, reach)
    if len(_TABLE) >= _TABLE_SIZE:
        _TABLE.pop(next(iter(_TABLE)), None)  # oldest first (insertion order)
    _TABLE[slot] = view
    return view


# Bounded: a replica serves many runs; each entry is one run's carried history.
_TABLE_SIZE = 512
_TABLE: dict[tuple[object, ...], CarriedView] = {}


def _derive(
    history: tuple[ConversationItem, ...], cost: Cost, render: Render, limit: int, reach: int
) -> CarriedView:
    shown: list[ConversationItem] = []
    excerpted: list[ToolResult] = []
    costs: dict[tuple[int, bool], int] = {}
    blocks: dict[tuple[int, bool], Block] = {}
    pointers: list[ToolResult] = []
    least, start = 0, 0
    for index in range(len(history) - 1, -1, -1):
        item = history[index]
        excerpt = legacy_excerpt(item, limit) if isinstance(item, ToolResult) else None
        if excerpt is not None:
            item = excerpt
            excerpted.append(excerpt)
        truncated = excerpt is not None
        tokens = cost(Row.CONVERSATION, item, truncated)
        costs[(id(item), truncated)] = tokens
        if isinstance(item, ToolResult):
            pointer = pointer_for(item)
            pointer_tokens = cost(Row.CONVERSATION, pointer, True)
            costs[(id(pointer), True)] = pointer_tokens
            pointers.append(pointer)
            tokens = min(tokens, pointer_tokens)
        shown.append(item)
        least += tokens
        if least > reach:
            start = index
            break
    shown.reverse()
    excerpted.reverse()
    marked = {id(e) for e in excerpted}
    for item in shown:
        check_placement(item, Row.CONVERSATION)
        truncated = id(item) in marked
        blocks[(id(item), truncated)] = render(Row.CONVERSATION, item, truncated)
    return CarriedView(
        history=history,
        start=start,
        shown=tuple(shown),
        excerpted=tuple(excerpted),
        costs=costs,
        blocks=blocks,
        pointers=tuple(pointers),
        checked=frozenset(id(i) for i in shown),
    )
