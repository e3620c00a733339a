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

Pure: no I/O, no clock. The table of views is keyed on the history tuple's identity. A
view keeps the window's items themselves (not the older ones, which a long session has by
the thousand and no decision reads but by their count) and is used for a history only if
that history has the same length and the very same objects in the window
(CarriedView.holds): what the view derived depends on nothing else, and a history whose id
is reused after it died is told apart. Equal but distinct histories derive their own,
equal, views. What a view holds per item (the walk's facts: excerpt, cost, block, pointer
and its cost and block) is a function of the item's class and field values, so it is kept
per item content (core/content_key.py): equal items (the same objects in a new run's
history, or a fresh read of turns seen before) find it with one C-level hash and compare
of their fields, where a memo keyed on the item would hash and compare the pydantic model
in Python. tests/unit/test_budget.py checks assembly with and without the view table
decides identically, that a view serves exactly the histories it holds, and that the
request equals what rendering, merging and marking every placed item one by one gives;
tests/unit/test_content_key.py that facts found by content are those derived afresh.
"""

from __future__ import annotations

import sys
import weakref
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from itertools import accumulate, compress, islice, repeat
from operator import attrgetter, is_, is_not, itemgetter

from . import memo_budget
from .body_estimate import share_attachment_budget
from .content_key import content_key
from .estimator import ATTACHMENT_TOKEN_BUDGET
from .excerpts import excerpt_of
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
from .yield_ladder import typed_pointer

__all__ = ["CarriedView", "Retained", "Segment", "carried_view"]

# (row, item, rendered as truncated) -> its block; (block, item) -> its estimated tokens;
# item -> the attachment content those tokens count (core/body_estimate.py Rule 4).
# None stores: the walk's facts are the memo for carried items (see _KNOWN). The
# renderer may look up a block made before (core/assemble.py _rendered_before).
Render = Callable[[Row, ContextItem, bool], Block]
Count = Callable[[Block, ContextItem], int]
Attached = Callable[[ContextItem], int]


@dataclass(frozen=True, slots=True)
class CarriedView:
    start: int  # history[:start] no decision can depend on (see carried_view)
    window: tuple[ConversationItem, ...]  # history[start:], the very objects (kept alive)
    shown: tuple[ConversationItem, ...]  # the window, legacy excerpts substituted
    facts: tuple[_Facts, ...]  # what was derived for each of `shown`, in order
    excerpted: tuple[ToolResult, ...]  # the legacy excerpts among `shown`
    # Whether the walk stopped within the history (its least costs passed the reach):
    # nothing before the window, read or not, can decide anything.
    reached: bool = False
    _segments: dict[int, Segment] = field(default_factory=dict, compare=False, repr=False)

    def covered(self, before: int) -> bool:
        """Whether the history holds everything a fitting request can reach, when `before`
        carried items above the summary floor precede it that the shell did not read
        (core/log_tail.py): the walk stopped within it, or nothing precedes it."""
        return self.reached or not before

    def holds(self, history: tuple[ConversationItem, ...]) -> bool:
        """Whether this view is `history`'s: the same length and the same objects in the
        window. Everything the view derived depends on those alone (the items before the
        window only on how many there are), so the view need not keep the history's older
        items alive to be sure of it."""
        window = self.window
        if len(history) != self.start + len(window):
            return False
        return all(map(is_, islice(history, self.start, None), window))

    def segment(self, floor: int) -> Segment:
        """The shown items a Build places under summary floor `floor`, derived once."""
        found = self._segments.get(floor)
        if found is None:
            found = self._segments[floor] = _segment(self, floor)
        return found

    def skipped(self, history: tuple[ConversationItem, ...], floor: int) -> int:
        """How many of `history`'s items before the window lie above summary floor
        `floor` (reported as cut). The history is in log order, so a bisection, not a
        count one by one (a long session's new run)."""
        return self.start - bisect_right(history, floor, hi=self.start, key=_SEQUENCE)


@dataclass(frozen=True, slots=True)
class Segment:
    """The carried items a Build places (those above the summary floor), oldest first, with
    what fit_body reads of each. Carried items are never in the never-yield set: their
    class is history, or tool_results for a result, and each renders as its facts' block
    (a yielded result as its pointer's)."""

    items: tuple[ConversationItem, ...]
    costs: tuple[int, ...]  # each item as placed (a legacy excerpt costed truncated)
    results: tuple[tuple[int, int, int], ...]  # (index, full cost, pointer cost) per result
    result_sums: tuple[int, ...]  # the results' full costs as prefix sums, from 0
    excerpted: frozenset[int]  # id() of legacy excerpts among items (render truncated)
    excerpted_items: tuple[ToolResult, ...]  # every legacy excerpt the view made
    total: int  # sum(costs)
    facts: tuple[_Facts, ...]  # per item: its block and its pointer's, as derived
    is_result: tuple[bool, ...]  # per item: a tool result (class tool_results)
    # -(sum of costs[i:]) for i in 0..len: ascending, so the cut is one bisection.
    _negated_suffix: tuple[int, ...]
    # (index, attachment content) of the messages with attachments, oldest first.
    attached: tuple[tuple[int, int], ...] = ()
    _settled: dict[int, int] = field(default_factory=dict, compare=False, repr=False)
    _retained: dict[tuple[int, tuple[int, ...]], Retained] = field(
        default_factory=dict, compare=False, repr=False
    )
    _shared: dict[int, Segment] = field(default_factory=dict, compare=False, repr=False)

    def sharing(self, room: int) -> Segment:
        """These items costed with `room` of the request's attachment budget left by the
        newer items (core/body_estimate.py Rule 4): the costs of messages whose content
        is beyond their share lowered. Itself when none is (a history without
        attachments, or room for all of them); derived once per room."""
        if not self.attached:
            return self
        found = self._shared.get(room)
        if found is None:
            found = self._shared[room] = _shared(self, room)
        return found

    def cutter(self) -> Cutter:
        """The cut over these items for one Build's yield ladder (its `cut_at`)."""
        return Cutter(self)

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


class Cutter:
    """history_cut.select_history over a segment's items at `costs` (their own, or with
    some results yielded to pointers), the summary floor already applied (every item is
    above it): rule 1 by one bisection (history_cut.suffix_cut), then rule 3.

    Made per Build, it keeps the suffix sums of the last costs other than the items' own.
    The ladder's cap pass reads the cut once per run result it truncates, all at one costs
    tuple (the results yielded for pressure), and summing the history again for each read
    made the pass O(results x history). The tuple is matched by identity first, as the
    pass hands over the same one: comparing is itself a pass over the history. Per Build,
    not on the segment, so no shared memo holds a second history-long tuple."""

    __slots__ = ("_costs", "_negated", "_segment")

    def __init__(self, segment: Segment) -> None:
        self._segment = segment
        self._costs: tuple[int, ...] = segment.costs
        self._negated = segment._negated_suffix

    def __call__(self, costs: Sequence[int], history_tokens: int) -> int:
        return self._segment.settle(suffix_cut(self._negated_for(costs), history_tokens))

    def _negated_for(self, costs: Sequence[int]) -> tuple[int, ...]:
        segment = self._segment
        if costs is self._costs:
            return self._negated
        if costs is segment.costs:
            return segment._negated_suffix
        costs = tuple(costs)
        if costs == segment.costs:
            return segment._negated_suffix
        if costs != self._costs:
            self._costs, self._negated = costs, negated_suffix_sums(costs)
        return self._negated


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
    # Its user messages that carry attachments, in order (core/attachment_sends.py).
    attached: tuple[UserMessage, ...] = ()


def carried_view(
    history: tuple[ConversationItem, ...],
    key: tuple[object, ...],
    count: Count,
    attached: Attached,
    render: Render,
    inline_maximum_bytes: int,
    reach: int,
) -> CarriedView:
    """The view of `history` under `key` (secret, counter, factor, image figure, fixed
    texts counted: core/body_estimate.py FixedTexts; with the
    limit and reach), from the table or derived now. `count`, `attached` and `render` must
    be the pure functions `key` determines.

    Only the history a fitting request can reach is derived. `reach` is the larger of the
    body budget and history's floor. Walking newest first, the least an item can cost is
    its pointer's cost (a tool result, as its legacy excerpt where it has one) or its own
    (a message with attachments, without their content: newer messages may take the
    request's attachment budget).
    Once those least costs alone exceed `reach`, no suffix that starts earlier can fit the
    body, and history stays above its floor however much yields — so neither the ladder,
    the fit nor the cut decides anything differently without the older items, and they
    are not excerpted, placed or costed at all (`start`). This is what makes a Build's work
    independent of the session's length. The boundary item itself is kept (it is what
    exceeds `reach`). tests/unit/test_budget.py checks the equivalence.
    """
    slot = (id(history), reach, inline_maximum_bytes, *key)
    entry = _TABLE.get(slot)
    if entry is not None and entry.holds(history):
        return entry
    view = _derive(
        history, (*key, inline_maximum_bytes), count, attached, render, inline_maximum_bytes, reach
    )
    memo_budget.admit()  # the walk's facts were charged after its own admit
    charge = _view_weight(view)
    # The oldest view read and dropped: not between another thread's steps
    # (core/memo_budget.py, LOCK).
    with memo_budget.LOCK:
        if len(_TABLE) >= _TABLE_SIZE:
            _TABLE.pop(next(iter(_TABLE)), None)  # oldest first (insertion order)
        _TABLE[slot] = view
        memo_budget.charge(charge)
    return view


def _segment(view: CarriedView, floor: int) -> Segment:
    # Whole-tuple passes through C-level maps over what the walk derived: this runs once
    # per view and floor, over every item of the window (a run's first Build pays it).
    items, facts = view.shown, view.facts
    above = list(map(floor.__lt__, map(_SEQUENCE, facts)))
    if not all(above):
        items, facts = tuple(compress(items, above)), tuple(compress(facts, above))
    costs = tuple(map(_TOKENS, facts))
    contents = tuple(map(_ATTACHED, facts))
    is_result = tuple(map(_IS_RESULT, facts))
    at = list(compress(range(len(items)), is_result))
    pointer_costs = map(_POINTER_TOKENS, compress(facts, is_result))
    result_costs = list(compress(costs, is_result))
    return Segment(
        items=items,
        costs=costs,
        results=tuple(zip(at, result_costs, pointer_costs, strict=True)),
        result_sums=tuple(accumulate(result_costs, initial=0)),
        excerpted=frozenset(map(id, view.excerpted)),
        excerpted_items=view.excerpted,
        total=sum(costs),
        facts=facts,
        is_result=is_result,
        _negated_suffix=negated_suffix_sums(costs),
        attached=tuple((n, c) for n, c in enumerate(contents) if c) if any(contents) else (),
    )


def _shared(segment: Segment, room: int) -> Segment:
    """Segment.sharing: the messages' costs lowered by what block_tokens counted of their
    attachment content beyond their share, newest first from `room`. Only messages change,
    never a result, so the results' sums stand."""
    indexes = [n for n, _ in segment.attached]
    lowered, _ = share_attachment_budget([c for _, c in segment.attached], room)
    if not any(lowered):
        return segment
    costs = list(segment.costs)
    for n, by in zip(indexes, lowered, strict=True):
        costs[n] -= by
    return replace(
        segment,
        costs=tuple(costs),
        total=sum(costs),
        _negated_suffix=negated_suffix_sums(costs),
        attached=(),  # shared already: sharing() answers itself
        _settled={},
        _retained={},
        _shared={},
    )


_SEQUENCE = attrgetter("sequence")  # of an item, or of its facts (the same number)
_INDEX = itemgetter(0)
_RUN_ID = attrgetter("run_id")
_TOKENS = attrgetter("tokens")
_ATTACHED = attrgetter("attached")
_IS_RESULT = attrgetter("is_result")
_POINTER_TOKENS = attrgetter("pointer_tokens")
_BLOCK = attrgetter("block")
_CLASSES = ("history", "tool_results")  # by "is a tool result"


def _retained(segment: Segment, cut: int, yielded: frozenset[int]) -> Retained:
    # C-level passes over the suffix; only the yielded results are looked at one by one.
    pairs: Sequence[tuple[Row, ConversationItem]]
    pairs = tuple(zip(repeat(Row.CONVERSATION), segment.items[cut:]))
    blocks: Sequence[Block] = tuple(map(_BLOCK, segment.facts[cut:]))
    costs: Sequence[int] = segment.costs[cut:]
    if yielded:  # a few results become their pointers: the rest is slices
        pairs, blocks, costs = list(pairs), list(blocks), list(costs)
        for n in yielded:
            facts = segment.facts[n]
            assert facts.pointer is not None and facts.pointer_block is not None
            pairs[n - cut] = (Row.CONVERSATION, facts.pointer)
            blocks[n - cut] = facts.pointer_block
            costs[n - cut] = facts.pointer_tokens
    tokens, counts = _class_totals(costs, segment.is_result[cut:])
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
        # Only a user message has attachments: a C-level pass, as above.
        attached=tuple(compress(items, map(getattr, items, repeat("attachments"), repeat(())))),
    )


def _class_totals(
    costs: Sequence[int], flags: Sequence[bool]
) -> tuple[dict[str, int], dict[str, int]]:
    """Tokens and items per class (a result's `flags` entry is true), classes in order of
    first appearance (as a walk over the items would insert them)."""
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


class _Views(dict[tuple[object, ...], CarriedView]):
    def cache_clear(self) -> None:
        self.clear()


# Bounded: a replica serves many runs; each entry is one run's carried history. A view
# keeps its window's item objects alive after the history that held them is gone (an
# evicted replica cache entry, a caller's fresh history), and an item shown as its excerpt
# is held whole, so the views are charged to the render memos' byte budget and emptied
# with them (core/memo_budget.py), not bounded by their count alone.
_TABLE_SIZE = 512
_TABLE = _Views()
memo_budget.register(_TABLE)


def _view_weight(view: CarriedView) -> int:
    """Approximate bytes `view` holds past its facts (charged with _KNOWN): its window's
    items, each charged once while it lives (_HELD): a run's history is the previous run's
    objects plus its new turns, and charging every view for its whole window counted the
    same items once per run (130 KB for a run's first Build over a 280-item window, whose
    new turns were four). An item shown as itself renders into its block, so the block's
    strings, at their size in memory, stand for the item's (its envelope makes them err
    high), plus a fixed cost per item, and nothing is walked; an item shown as its excerpt
    is weighed itself, as it may be megabytes. An item another view was charged for costs its three
    slots here. Where the walk stored the item's facts just now, the same strings are
    charged to _KNOWN's key and facts as well: the count errs high, so composed memos
    empty sooner, never later. Segments and suffixes a view derives later (`segment`,
    `Segment.retained`) hold the same blocks and are not charged again."""
    window = view.window
    held = list(map(_HELD.__contains__, map(id, window)))
    if False not in held:
        return _SHARED_ITEM_COST * len(window)
    new = [not h for h in held]
    for item in compress(window, new):
        _hold(item)
    facts = tuple(compress(view.facts, new))
    blocks = tuple(map(_BLOCK, facts))
    texts = sum(sum(map(sys.getsizeof, map(field, blocks))) for field in _BLOCK_TEXTS)
    shown_whole = map(is_not, map(_EXCERPT, facts), repeat(None))
    whole = sum(map(memo_budget.weight, compress(compress(window, new), shown_whole)))
    fresh = len(facts)
    charged = _ITEM_COST + _HELD_COST
    return texts + whole + charged * fresh + _SHARED_ITEM_COST * (len(window) - fresh)


class _Ref(weakref.ref):  # type: ignore[type-arg]
    """A weak reference that knows its entry's key: one callback for all of them, no
    closure per item."""

    __slots__ = ("key",)
    key: int


class _Held(dict[int, _Ref]):
    def cache_clear(self) -> None:
        self.clear()


# id -> a weak reference to each window item some view was charged for. The reference's
# callback drops the entry when the item dies, before its id can be reused (CPython calls
# it before the memory is freed, for cyclic garbage too); emptied with the views (a
# composed memo), so after the ledger's count restarts each item is charged again by the
# first view that holds it. An entry lives as long as its item, so what it costs itself
# (_HELD_COST) is charged with the item.
_HELD = _Held()
memo_budget.register(_HELD)


def _forget(ref: _Ref) -> None:
    if _HELD.get(ref.key) is ref:
        _HELD.pop(ref.key, None)  # the memos may have been emptied since, by another thread


def _hold(item: ConversationItem) -> None:
    ref = _Ref(item, _forget)
    ref.key = id(item)
    _HELD[ref.key] = ref


@dataclass(frozen=True, slots=True)
class _Facts:
    """What the walk derives from one carried item, under one context: a function of the
    item's class and field values (core/content_key.py), never of the object."""

    sequence: int  # the item's
    excerpt: ToolResult | None  # the legacy excerpt the request shows instead, if any
    tokens: int  # what the item as shown (the excerpt, if any) costs as rendered
    attached: int  # the attachment content `tokens` counts, before the request's budget
    block: Block  # the item as shown, rendered
    is_result: bool  # a tool result: it has a pointer
    pointer: ToolResult | None  # a result's typed pointer (of the item as shown)
    pointer_tokens: int
    pointer_block: Block | None  # the pointer rendered (truncated)
    # The least the item can cost: its pointer's, if less than its own; a message's,
    # its attachment content left out (other messages may take the request's budget).
    least: int


class _Known(dict[tuple[object, ...], dict[tuple[object, ...], _Facts]]):
    def cache_clear(self) -> None:
        self.clear()


# Per context, an item's content key -> its facts. A context is a plan's secret and counter,
# so a replica has one per session epoch it serves; the bound is on items across all of
# them. An entry holds its key's field values (the item's texts) and its renderings, not
# the item. It is the one memo of what a carried item renders and costs (the walk calls
# functions that store nothing), so each entry is charged to the render memos' byte
# budget as an item memo, and emptied with the item memos (core/memo_budget.py).
_KNOWN_ITEMS = 131_072
_KNOWN = _Known()
memo_budget.register(_KNOWN, memo_budget.ITEM)


def _kept_facts(key: tuple[object, ...], facts: _Facts) -> _Facts:
    memo_budget.charge(memo_budget.weight(key) + memo_budget.weight(facts), memo_budget.ITEM)
    return facts


def _facts(
    item: ConversationItem, count: Count, attached: Attached, render: Render, limit: int
) -> _Facts:
    excerpt = excerpt_of(item, limit) if isinstance(item, ToolResult) else None
    shown = excerpt if excerpt is not None else item
    truncated = excerpt is not None
    # Rendering first: it is what rejects an item type assembly cannot render.
    block = render(Row.CONVERSATION, shown, truncated)
    tokens = count(block, shown)
    check_placement(shown, Row.CONVERSATION)
    if not isinstance(item, ToolResult):  # shown is its excerpt or the item itself
        content = attached(item)
        least = tokens - min(content, ATTACHMENT_TOKEN_BUDGET)
        return _Facts(item.sequence, excerpt, tokens, content, block, False, None, 0, None, least)
    # The pointer says what the result holds, not its excerpt: its own byte count.
    pointer = typed_pointer(item)
    pointer_block = render(Row.CONVERSATION, pointer, True)
    pointer_tokens = count(pointer_block, pointer)
    return _Facts(
        sequence=item.sequence,
        excerpt=excerpt,
        tokens=tokens,
        attached=0,
        block=block,
        is_result=True,
        pointer=pointer,
        pointer_tokens=pointer_tokens,
        pointer_block=pointer_block,
        least=min(tokens, pointer_tokens),
    )


def _derive(
    history: tuple[ConversationItem, ...],
    context: tuple[object, ...],
    count: Count,
    attached: Attached,
    render: Render,
    limit: int,
    reach: int,
) -> CarriedView:
    # What was derived for an item is looked up by its content under the same context
    # (secret, counter, factor, inline limit): a run's history is the previous run's plus
    # its turns, and a replica that reads a session afresh, or another session's copy of
    # the same turns, reads equal items as new objects. The key is one C-level hash of the
    # item's field values (their texts' hashes are cached on the strings), where each memo
    # behind `cost` and `render` would hash and compare the pydantic model in Python.
    # Before the walk stores. A counter with a memo of its own (the heuristic's) admits
    # again during the walk; should that empty _KNOWN, the facts stored in `known` after it
    # are charged and dropped with it, which only overstates the ledger.
    memo_budget.admit()
    if sum(map(len, _KNOWN.values())) >= _KNOWN_ITEMS:
        _KNOWN.clear()  # bounded across contexts, as well as by the budget
    known = _KNOWN.setdefault(context, {})
    found: list[_Facts] = []
    least, start, reached = 0, 0, False
    for index in range(len(history) - 1, -1, -1):
        item = history[index]
        try:
            key = content_key(item)
            facts = known.get(key)
        except (KeyError, TypeError):  # a field missing or unhashable: derived, not kept
            facts = _facts(item, count, attached, render, limit)
        if facts is None:
            facts = known[key] = _kept_facts(key, _facts(item, count, attached, render, limit))
        found.append(facts)
        least += facts.least
        if least > reach:
            start, reached = index, True
            break
    found.reverse()
    shown = list(history[start:])
    excerpted: list[ToolResult] = []
    for n in compress(range(len(found)), map(is_not, map(_EXCERPT, found), repeat(None))):
        excerpt = found[n].excerpt
        assert excerpt is not None
        shown[n] = excerpt
        excerpted.append(excerpt)
    return CarriedView(
        start=start,
        window=history[start:],
        shown=tuple(shown),
        facts=tuple(found),
        excerpted=tuple(excerpted),
        reached=reached,
    )


_EXCERPT = attrgetter("excerpt")
_BLOCK = attrgetter("block")
_BLOCK_TEXTS = tuple(map(attrgetter, ("text", "arguments_json", "opaque")))
_ITEM_COST = 256  # an item's object, its fields' small values and its slot in the window
_SHARED_ITEM_COST = 24  # its slots in a view's window, shown and facts
_HELD_COST = 176  # its _HELD entry: the reference, its key and the table's slot
