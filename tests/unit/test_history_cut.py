"""History-cut determinism gate: the retained set is a contiguous suffix that fits, never
below the summary floor, never with an orphaned tool call or result, identical across two
calls on the same input — property-tested over generated item lists."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from context_engine.core.history_cut import (
    negated_suffix_sums,
    past_split_pairs,
    select_history,
    suffix_cut,
)
from context_engine.core.items import (
    AssistantMessage,
    ContextItem,
    ConversationItem,
    ReasoningItem,
    ToolCall,
    ToolResult,
    UserMessage,
)
from context_engine.core.trust import TrustLevel

GATE = settings(max_examples=300, deadline=None)


class CostTable:
    """A pure estimator over a fixed table of costs by item id (and a call counter that
    proves the function consults it per item)."""

    def __init__(self, costs: dict[str, int]) -> None:
        self.costs = costs

    def estimate(self, items: Sequence[ContextItem], model_id: str) -> int:
        assert model_id == "m"
        return sum(self.costs[i.item_id] for i in items)


@dataclass
class History:
    items: list[ConversationItem]
    costs: dict[str, int]


@st.composite
def histories(draw: st.DrawFn) -> History:
    """Runs of user messages, assistant text and tool loops (parallel calls answered in any
    order), with strictly increasing sequences and call ids reused across runs."""
    items: list[ConversationItem] = []
    costs: dict[str, int] = {}
    seq = 0

    def add(item: ConversationItem, cost: int) -> None:
        items.append(item)
        costs[item.item_id] = cost

    cost = st.integers(0, 400)
    for run in range(draw(st.integers(0, 5))):
        run_id = f"r{run}"
        seq += draw(st.integers(1, 3))
        add(UserMessage(item_id=f"u{seq}", text="u", sequence=seq, run_id=run_id), draw(cost))
        for turn in range(draw(st.integers(0, 3))):
            calls = []
            for n in range(draw(st.integers(1, 3))):
                seq += 1
                call = ToolCall(
                    item_id=f"c{seq}",
                    call_id=f"call_{turn}_{n}",  # reused by every run on purpose
                    tool_name="t",
                    arguments_json="{}",
                    sequence=seq,
                    run_id=run_id,
                )
                add(call, draw(cost))
                calls.append(call)
            for call in draw(st.permutations(calls)):
                seq += 1
                add(
                    ToolResult(
                        item_id=f"t{seq}",
                        call_id=call.call_id,
                        tool_name="t",
                        content="x",
                        trust=TrustLevel.EXTERNAL_UNTRUSTED,
                        sequence=seq,
                        run_id=run_id,
                    ),
                    draw(st.integers(0, 3_000)),
                )
        seq += 1
        add(AssistantMessage(item_id=f"a{seq}", text="a", sequence=seq, run_id=run_id), draw(cost))
    return History(items, costs)


@st.composite
def cut_inputs(draw: st.DrawFn) -> tuple[History, int, int]:
    history = draw(histories())
    sequences = [i.sequence for i in history.items]
    floor = draw(st.sampled_from([0, *sequences])) if sequences and draw(st.booleans()) else 0
    total = sum(history.costs.values())
    budget = draw(st.integers(-10, total + 10))
    return history, floor, budget


def _orphans(items: Sequence[ConversationItem]) -> list[str]:
    calls = {(i.run_id, i.call_id) for i in items if isinstance(i, ToolCall)}
    results = {(i.run_id, i.call_id) for i in items if isinstance(i, ToolResult)}
    return sorted(f"{r}/{c}" for r, c in calls ^ results)


def _floor_index(items: Sequence[ConversationItem], floor: int) -> int:
    covered = [n for n, i in enumerate(items) if floor > 0 and i.sequence <= floor]
    return covered[-1] + 1 if covered else 0


@GATE
@given(cut_inputs())
def test_the_cut_is_a_suffix_that_fits_above_the_floor_without_orphans(
    case: tuple[History, int, int],
) -> None:
    history, floor, budget = case
    estimator = CostTable(history.costs)
    cut = select_history(history.items, floor, budget, estimator, "m")
    assert 0 <= cut <= len(history.items)
    retained = history.items[cut:]  # an index can only describe a suffix
    assert estimator.estimate(retained, "m") <= max(budget, 0) or not retained
    assert all(i.sequence > floor for i in retained) or floor == 0
    assert _orphans(retained) == []
    # Identical across two calls on the same input (and on a copy of it).
    assert select_history(list(history.items), floor, budget, CostTable(history.costs), "m") == cut


@GATE
@given(cut_inputs())
def test_the_cut_is_the_largest_pair_safe_suffix_that_fits(
    case: tuple[History, int, int],
) -> None:
    """Every longer suffix above the floor either exceeds the budget or splits a pair."""
    history, floor, budget = case
    estimator = CostTable(history.costs)
    cut = select_history(history.items, floor, budget, estimator, "m")
    for start in range(_floor_index(history.items, floor), cut):
        longer = history.items[start:]
        assert estimator.estimate(longer, "m") > budget or _orphans(longer), start


def test_rule_3_moves_the_cut_later_past_the_orphaned_result_never_earlier() -> None:
    run = "r"
    items: list[ConversationItem] = [
        UserMessage(item_id="u", text="u", sequence=1, run_id=run),
        ToolCall(
            item_id="c", call_id="k", tool_name="t", arguments_json="{}", sequence=2, run_id=run
        ),
        ToolResult(
            item_id="t",
            call_id="k",
            tool_name="t",
            content="x",
            trust=TrustLevel.USER,
            sequence=3,
            run_id=run,
        ),
        AssistantMessage(item_id="a", text="a", sequence=4, run_id=run),
    ]
    costs = {"u": 1, "c": 100, "t": 1, "a": 1}
    # The scan admits a and t, stops at c: the pair is split, so t goes too.
    assert select_history(items, 0, 3, CostTable(costs), "m") == 3
    # With room for the call, the pair stays whole.
    assert select_history(items, 0, 102, CostTable(costs), "m") == 1


def test_the_floor_excludes_covered_items_and_a_pair_it_splits() -> None:
    run = "r"
    items: list[ConversationItem] = [
        ToolCall(
            item_id="c", call_id="k", tool_name="t", arguments_json="{}", sequence=5, run_id=run
        ),
        ToolResult(
            item_id="t",
            call_id="k",
            tool_name="t",
            content="x",
            trust=TrustLevel.USER,
            sequence=6,
            run_id=run,
        ),
        AssistantMessage(item_id="a", text="a", sequence=7, run_id=run),
    ]
    costs = {"c": 1, "t": 1, "a": 1}
    assert select_history(items, 5, 10**6, CostTable(costs), "m") == 2
    assert select_history(items, 0, 10**6, CostTable(costs), "m") == 0
    assert select_history(items, 7, 10**6, CostTable(costs), "m") == 3


def test_an_unlogged_item_does_not_pull_the_floor_past_logged_items_above_it() -> None:
    """A reasoning item has sequence 0 (checkpoint only): no summary covers it, and the
    items logged above the floor before it stay (a compaction audit: [x@5, y@50,
    reasoning@0, z@51] under floor 40 kept only z)."""
    items: list[ConversationItem] = [
        AssistantMessage(item_id="x", text="x", sequence=5, run_id="r"),
        AssistantMessage(item_id="y", text="y", sequence=50, run_id="r"),
        ReasoningItem(item_id="rs", provider="anthropic", opaque="{}", run_id="r"),
        AssistantMessage(item_id="z", text="z", sequence=51, run_id="r"),
    ]
    costs = {"x": 1, "y": 1, "rs": 1, "z": 1}
    assert select_history(items, 40, 10**6, CostTable(costs), "m") == 1


@GATE
@given(cut_inputs())
def test_the_bisected_cut_assembly_uses_is_select_history(
    case: tuple[History, int, int],
) -> None:
    """core/carried.py cuts a carried segment (all above the floor) by bisecting its
    suffix sums (history_cut.suffix_cut), then rule 3: the same index the scan returns."""
    history, floor, budget = case
    above = [i for i in history.items if floor == 0 or i.sequence > floor]
    costs = [history.costs[i.item_id] for i in above]
    bisected = past_split_pairs(above, suffix_cut(negated_suffix_sums(costs), budget))
    assert bisected == select_history(above, 0, budget, CostTable(history.costs), "m")
