"""What assembly derives from a run's carried history, worked out once per history.

Every Build of a run reads the same carried history: the shell keeps it and hands the core
the same tuple of the same frozen items each time (api/kept.py). Everything assembly
derives from that history item by item — the legacy excerpts that replace oversized
results, each item's placement check, its estimated cost as rendered, its pointer's cost,
its rendered block, and the least cost that bounds the window — depends only on
the history and on the plan secret, the token counter, the pinned estimator factor and
the inline limit. So it is derived once per such key and looked up after that; a Build's
own work is then the run's new items plus the output.

Three layers, each derived once and kept on the one before:
- CarriedView: the reachable window of the history, costed and rendered (per key).
- Segment: the items above a summary floor, with their costs, classes and suffix sums,
  so the history cut is one bisection (per floor).
- Retained: the suffix a request carries after a cut, some results yielded to pointers,
  with its per-class totals, its blocks merged into messages, whether its tool pairs close
  on their own, and the two items its cache markers can name (per cut and yields). A run's
  steps mostly repeat one cut and one set of yields, so a Build walks only its own items.

Pure: no I/O, no clock. The table is keyed on the history tuple's identity and holds the
tuple itself, so an entry is only ever used for the very object it was derived from (an
id is never reused while the object it names is alive); equal but distinct histories
derive their own, equal, entries. tests/unit/test_budget.py checks assembly with and
without the table decides identically, and that the request equals what rendering,
merging and marking every placed item one by one gives.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import accumulate, compress, repeat
from operator import attrgetter, itemgetter

from .excerpts import legacy_excerpt
from .history_cut import negated_suffix_sums, past_split_pairs, suffix_cut
from .items import (
    ContextItem,
    ConversationItem,
    ReasoningItem,
    ToolResult,
    UserMessage,
    check_placement,
)
from .messages import grouped
from .request import Block, Message
from .rows import Row
from .validate import ClosedRun, closed_run
from .yield_ladder import pointer_for

__all__ = ["CarriedView", "Retained", "Segment", "carried_view"]

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
    pointer_costs: dict[int, int]  # id(tool result among shown) -> its pointer's cost
    render: Render
    # Carried items above the floor that precede `history` (the shell read only the log's
    # newest events: core/log_tail.py), and whether the walk stopped within `history`.
    before: int = 0
    reached: bool = False
    _segments: dict[int, Segment] = field(default_factory=dict, compare=False, repr=False)

    @property
    def covered(self) -> bool:
        """Whether `history` holds everything a fitting request can reach: the walk stopped
        within it, or nothing precedes it. Otherwise the older items decide too."""
        return self.reached or not self.before

    def segment(self, floor: int) -> Segment:
        """The shown items a Build places under summary floor `floor`, derived once."""
        found = self._segments.get(floor)
        if found is None:
            found = self._segments[floor] = _segment(self, floor)
        return found


@dataclass(frozen=True, slots=True)
class Segment:
    """The carried items a Build places (those above the summary floor), oldest first, with
    what fit_body reads of each. Carried items are never in the never-yield set: their
    class is history, or tool_results for a result, and each renders as `blocks` holds."""

    items: tuple[ConversationItem, ...]
    pairs: tuple[tuple[Row, ConversationItem], ...]  # (Row.CONVERSATION, item) per item
    costs: tuple[int, ...]  # each item as placed (a legacy excerpt costed truncated)
    classes: tuple[str, ...]  # "tool_results" for a result, else "history"
    results: tuple[tuple[int, int, int], ...]  # (index, full cost, pointer cost) per result
    result_sums: tuple[int, ...]  # the results' full costs as prefix sums, from 0
    excerpted: frozenset[int]  # id() of legacy excerpts among items (render truncated)
    excerpted_items: tuple[ToolResult, ...]  # every legacy excerpt the view made
    total: int  # sum(costs)
    skipped: int  # items above the floor that lie beyond the window (reported as cut)
    blocks: dict[tuple[int, bool], Block]  # the view's rendered blocks
    item_blocks: tuple[Block, ...]  # each item's block, as placed
    is_result: tuple[bool, ...]  # per item: a tool result (class tool_results)
    # -(sum of costs[i:]) for i in 0..len: ascending, so the cut is one bisection.
    _negated_suffix: tuple[int, ...]
    render: Render  # the view's renderer, for pointers
    _settled: dict[int, int] = field(default_factory=dict, compare=False, repr=False)
    _retained: dict[tuple[int, tuple[int, ...]], Retained] = field(
        default_factory=dict, compare=False, repr=False
    )

    def cut(self, history_tokens: int, costs: Sequence[int]) -> int:
        """history_cut.select_history over these items at `costs` (their own, or with some
        results yielded to pointers), the summary floor already applied (every item is
        above it): rule 1 by one bisection (history_cut.suffix_cut), then rule 3."""
        negated = self._negated_suffix
        if tuple(costs) != self.costs:
            negated = negated_suffix_sums(costs)
        return self.settle(suffix_cut(negated, history_tokens))

    def result_tokens_from(self, cut: int) -> int:
        """The full tokens of the results at index >= `cut` (results are few of the items;
        the sums are made once per segment, the index found by bisection)."""
        first = bisect_left(self.results, cut, key=_INDEX)
        return self.result_sums[-1] - self.result_sums[first]

    def settle(self, cut: int) -> int:
        """history_cut.past_split_pairs at `cut`; it depends only on the items."""
        found = self._settled.get(cut)
        if found is None:
            found = self._settled[cut] = past_split_pairs(self.items, cut)
        return found

    def retained(self, cut: int, yielded: tuple[int, ...]) -> Retained:
        """items[cut:] as a request carries them, the results at indexes `yielded` as their
        pointers. A run's Builds mostly repeat one (cut, yielded) until the run moves on."""
        key = (cut, yielded)
        found = self._retained.get(key)
        if found is None:
            if len(self._retained) >= _RETAINED_PER_SEGMENT:
                self._retained.clear()
            found = self._retained[key] = _retained(self, cut, frozenset(yielded))
        return found


_INPUT_TYPES = (UserMessage, ToolResult)


_RETAINED_PER_SEGMENT = 64


@dataclass(frozen=True, slots=True)
class Retained:
    """A carried suffix as the request carries it, some results yielded to pointers,
    derived once: its rows, its per-class totals, its blocks merged into messages, and the
    at most two items the cache markers can name within it (cache_hints.history_window
    reads only those)."""

    pairs: tuple[tuple[Row, ConversationItem], ...]
    tokens: dict[str, int]  # class -> estimated tokens
    counts: dict[str, int]  # class -> items
    pointers: frozenset[int]  # id() of the pointers among pairs (they render truncated)
    blocks: tuple[Block, ...]
    closed: ClosedRun | None  # the blocks, if their tool pairs are whole on their own
    messages: tuple[Message, ...]  # consecutive same-role blocks merged
    # messages[1:-1]: what the request carries unchanged whatever it merges at either end
    # (ModelRequest.repeated), one tuple object for every Build of this cut and yields.
    interior: tuple[Message, ...]
    run_ids: frozenset[str]
    has_reasoning: bool
    # The last nameable item and the last input with an id, in order: every marker a
    # window over these items can produce names one of them (see history_window).
    markable: tuple[tuple[Row, ConversationItem], ...]


def carried_view(
    history: tuple[ConversationItem, ...],
    key: tuple[object, ...],
    cost: Cost,
    render: Render,
    inline_maximum_bytes: int,
    reach: int,
    before: int = 0,
) -> CarriedView:
    """The view of `history` under `key` (secret, counter, factor, limit, reach), from the
    table or derived now. `cost` and `render` must be the pure functions `key` determines.
    `before`: how many carried items above the summary floor precede `history`, the newest
    part of the run's carried history (see `CarriedView.covered`).

    Only the history a fitting request can reach is derived. `reach` is the larger of the
    body budget and history's floor. Walking newest first, the least an item can cost is
    its pointer's cost (a tool result, as its legacy excerpt where it has one) or its own.
    Once those least costs alone exceed `reach`, no suffix that starts earlier can fit the
    body, and history stays above its floor however much yields — so neither the ladder,
    the fit nor the cut decides anything differently without the older items, and they
    are not excerpted, placed or costed at all (`start`). This is what makes a Build's work
    independent of the session's length. The boundary item itself is kept (it is what
    exceeds `reach`). tests/unit/test_budget.py checks the equivalence. The same holds for
    the items before `history`: once the walk stops within it they decide nothing, and only
    their number (`before`) is reported, as cut.
    """
    slot = (id(history), reach, before, *key)
    entry = _TABLE.get(slot)
    if entry is not None and entry.history is history:
        return entry
    context = (*key, inline_maximum_bytes)
    view = _derive(history, context, cost, render, inline_maximum_bytes, reach, before)
    if len(_TABLE) >= _TABLE_SIZE:
        _TABLE.pop(next(iter(_TABLE)), None)  # oldest first (insertion order)
    _TABLE[slot] = view
    return view


def _segment(view: CarriedView, floor: int) -> Segment:
    # Whole-tuple passes through C-level maps: this runs once per run and floor, over
    # every item of the window (a run's first Build pays it).
    items = tuple(compress(view.shown, map(floor.__lt__, map(_SEQUENCE, view.shown))))
    excerpted = frozenset(map(id, view.excerpted))
    ids = list(map(id, items))
    keys = list(zip(ids, map(excerpted.__contains__, ids), strict=True))
    costs = tuple(map(view.costs.__getitem__, keys))
    results = {t for t in set(map(type, items)) if issubclass(t, ToolResult)}
    is_result = tuple(map(results.__contains__, map(type, items)))
    at = list(compress(range(len(items)), is_result))
    pointer_costs = map(view.pointer_costs.__getitem__, compress(ids, is_result))
    result_costs = list(map(costs.__getitem__, at))
    return Segment(
        items=items,
        pairs=tuple(zip(repeat(Row.CONVERSATION), items)),
        costs=costs,
        classes=tuple(map(_CLASSES.__getitem__, is_result)),
        results=tuple(zip(at, result_costs, pointer_costs, strict=True)),
        result_sums=tuple(accumulate(result_costs, initial=0)),
        excerpted=excerpted,
        excerpted_items=view.excerpted,
        total=sum(costs),
        # The history is in log order, so the items above the floor and before the window
        # are found by bisection, not counted one by one (a long session's new run); those
        # before `history` (all above the floor) are counted by the shell.
        skipped=view.before
        + view.start
        - bisect_right(view.history, floor, hi=view.start, key=_SEQUENCE),
        blocks=view.blocks,
        item_blocks=tuple(map(view.blocks.__getitem__, keys)),
        is_result=is_result,
        render=view.render,
        _negated_suffix=negated_suffix_sums(costs),
    )


_SEQUENCE = attrgetter("sequence")
_INDEX = itemgetter(0)
_RUN_ID = attrgetter("run_id")
_CLASSES = ("history", "tool_results")  # by "is a tool result"


def _retained(segment: Segment, cut: int, yielded: frozenset[int]) -> Retained:
    pairs: Sequence[tuple[Row, ConversationItem]]
    blocks: Sequence[Block]
    if yielded:
        pairs, tokens, counts, blocks = _yielding(segment, cut, yielded)
    else:  # nothing yielded, the common case: slices and two sums
        pairs, blocks = segment.pairs[cut:], segment.item_blocks[cut:]
        tokens, counts = _class_totals(segment, cut)
    items = tuple(map(itemgetter(1), pairs))
    markable = sorted({*_last(items, _named), *_last(items, _named_input)})
    messages = grouped(items, blocks)
    return Retained(
        pairs=tuple(pairs),
        tokens=tokens,
        counts=counts,
        pointers=frozenset(id(pairs[n - cut][1]) for n in yielded),
        blocks=tuple(blocks),
        closed=closed_run(blocks),
        messages=messages,
        interior=messages[1:-1],
        run_ids=frozenset(map(_RUN_ID, items)),
        has_reasoning=any(issubclass(t, ReasoningItem) for t in set(map(type, items))),
        markable=tuple((Row.CONVERSATION, items[n]) for n in markable),
    )


def _yielding(
    segment: Segment, cut: int, yielded: frozenset[int]
) -> tuple[list[tuple[Row, ConversationItem]], dict[str, int], dict[str, int], list[Block]]:
    """items[cut:]'s rows, class totals and blocks, the results at `yielded` as pointers."""
    pairs = list(segment.pairs[cut:])
    tokens: dict[str, int] = {}
    counts: dict[str, int] = {}
    blocks: list[Block] = []
    pointer_costs = {n: pointer for n, _, pointer in segment.results}
    for n in range(cut, len(segment.items)):
        kind, item = segment.classes[n], segment.items[n]
        if n in yielded:
            assert isinstance(item, ToolResult)
            item = pointer_for(item)
            pairs[n - cut] = (Row.CONVERSATION, item)
            cost = pointer_costs[n]
            blocks.append(segment.render(Row.CONVERSATION, item, True))
        else:
            cost = segment.costs[n]
            blocks.append(segment.item_blocks[n])
        tokens[kind] = tokens.get(kind, 0) + cost
        counts[kind] = counts.get(kind, 0) + 1
    return pairs, tokens, counts, blocks


def _class_totals(segment: Segment, cut: int) -> tuple[dict[str, int], dict[str, int]]:
    """Tokens and items per class over items[cut:], classes in order of first appearance
    (as a walk over the items would insert them)."""
    costs, flags = segment.costs[cut:], segment.is_result[cut:]
    result_tokens = sum(compress(costs, flags))
    results = sum(flags)
    totals = {
        True: (result_tokens, results),
        False: (sum(costs) - result_tokens, len(costs) - results),
    }
    order = (flags[0], not flags[0]) if flags else ()
    present = [flag for flag in order if totals[flag][1]]
    tokens = {_CLASSES[flag]: totals[flag][0] for flag in present}
    counts = {_CLASSES[flag]: totals[flag][1] for flag in present}
    return tokens, counts


def _named(item: ConversationItem) -> bool:
    return bool(item.item_id)


def _named_input(item: ConversationItem) -> bool:
    return bool(item.item_id) and isinstance(item, _INPUT_TYPES)


def _last(items: Sequence[ConversationItem], test: Callable[[ConversationItem], bool]) -> list[int]:
    """[the index of the last item passing `test`], or []; found from the end."""
    for n in range(len(items) - 1, -1, -1):
        if test(items[n]):
            return [n]
    return []


# Bounded: a replica serves many runs; each entry is one run's carried history.
_TABLE_SIZE = 512
_TABLE: dict[tuple[object, ...], CarriedView] = {}

# Per context, id(item) -> (item, its facts); each entry holds its item, so an id is not
# reused while it exists. A context is a plan's secret and counter, so a replica has one per
# session epoch it serves; the bound is on items across all of them.
_KNOWN_ITEMS = 131_072
_KNOWN: dict[tuple[object, ...], dict[int, tuple[ConversationItem, _Facts]]] = {}


@dataclass(frozen=True, slots=True)
class _Facts:
    """What the walk derives from one carried item, under one context."""

    shown: ConversationItem  # the item, or its legacy excerpt
    truncated: bool  # `shown` is a legacy excerpt (renders marked truncated)
    tokens: int  # what `shown` costs as rendered
    pointer: ToolResult | None  # a result's typed pointer
    pointer_tokens: int
    block: Block  # `shown` rendered


def _facts(item: ConversationItem, cost: Cost, render: Render, limit: int) -> _Facts:
    excerpt = legacy_excerpt(item, limit) if isinstance(item, ToolResult) else None
    shown = excerpt if excerpt is not None else item
    truncated = excerpt is not None
    tokens = cost(Row.CONVERSATION, shown, truncated)
    pointer, pointer_tokens = None, 0
    if isinstance(shown, ToolResult):
        pointer = pointer_for(shown)
        pointer_tokens = cost(Row.CONVERSATION, pointer, True)
    check_placement(shown, Row.CONVERSATION)
    return _Facts(
        shown,
        truncated,
        tokens,
        pointer,
        pointer_tokens,
        render(Row.CONVERSATION, shown, truncated),
    )


def _derive(
    history: tuple[ConversationItem, ...],
    context: tuple[object, ...],
    cost: Cost,
    render: Render,
    limit: int,
    reach: int,
    before: int,
) -> CarriedView:
    # A run's history is the previous run's plus its turns, as the same item objects
    # (api/kept.py), so what was derived for an item is looked up by identity under the
    # same context (secret, counter, factor, inline limit) instead of derived again.
    if sum(map(len, _KNOWN.values())) >= _KNOWN_ITEMS:
        _KNOWN.clear()  # bounded across contexts: each holds its items and their blocks
    known = _KNOWN.setdefault(context, {})
    shown: list[ConversationItem] = []
    excerpted: list[ToolResult] = []
    costs: dict[tuple[int, bool], int] = {}
    blocks: dict[tuple[int, bool], Block] = {}
    pointers: list[ToolResult] = []
    pointer_costs: dict[int, int] = {}
    least, start, reached = 0, 0, False
    for index in range(len(history) - 1, -1, -1):
        item = history[index]
        entry = known.get(id(item))
        if entry is None or entry[0] is not item:
            entry = known[id(item)] = (item, _facts(item, cost, render, limit))
        facts = entry[1]
        shown_item, truncated, tokens = facts.shown, facts.truncated, facts.tokens
        if truncated:
            assert isinstance(shown_item, ToolResult)
            excerpted.append(shown_item)
        costs[(id(shown_item), truncated)] = tokens
        blocks[(id(shown_item), truncated)] = facts.block
        if facts.pointer is not None:
            costs[(id(facts.pointer), True)] = facts.pointer_tokens
            pointers.append(facts.pointer)
            pointer_costs[id(shown_item)] = facts.pointer_tokens
            tokens = min(tokens, facts.pointer_tokens)
        shown.append(shown_item)
        least += tokens
        if least > reach:
            start, reached = index, True
            break
    shown.reverse()
    excerpted.reverse()
    return CarriedView(
        history=history,
        start=start,
        shown=tuple(shown),
        excerpted=tuple(excerpted),
        costs=costs,
        blocks=blocks,
        pointers=tuple(pointers),
        pointer_costs=pointer_costs,
        render=render,
        before=before,
        reached=reached,
    )
