"""The yield ladder in isolation: a synthetic overflow yields in the specified order and no
further than needed (Budget conformance gate), over generated bodies of token costs."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from itertools import pairwise

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from context_engine.core import BuildInputs, Checkpoint
from context_engine.core.assemble import assemble
from context_engine.core.caps import CLASS_CAPS, Yields
from context_engine.core.items import (
    AssistantMessage,
    RecallLineItem,
    SummaryItem,
    ToolCall,
    ToolResult,
    UserMessage,
)
from context_engine.core.trust import TrustLevel
from context_engine.core.yield_ladder import (
    CARRIED_CAP_QUANTUM,
    LADDER,
    RUN_CAP_QUANTUM,
    Body,
    Truncatable,
    YieldStep,
    pointer_for,
    run_ladder,
)

from .strategies import count_tokens, small_plan

GATE = settings(max_examples=200, deadline=None)
ORDER = [r.step for r in LADDER]
KNOWLEDGE = CLASS_CAPS["knowledge"]
RECALL = CLASS_CAPS["recall"]


def _suffix_cut(costs: Sequence[int], tokens: int) -> int:
    used = 0
    for index in range(len(costs) - 1, -1, -1):
        if used + costs[index] > tokens:
            return index + 1
        used += costs[index]
    return 0


def _item(n: int) -> RecallLineItem:
    return RecallLineItem(item_id=f"i{n}", text="x")


@dataclass
class Spec:
    budget: int
    fixed: int
    floor: int
    cap: int
    knowledge: list[int]
    recall: list[int]
    recall_floor: int
    carried: list[tuple[int, int | None]]  # (cost, pointer cost if a tool result)
    run: list[tuple[int, int]]
    pending: int = 0  # the active turn's results: paid with `fixed`, counted toward the cap

    def body(self) -> Body:
        carried_costs = [c for c, _ in self.carried]
        carried_results = [
            Truncatable(n, c, p, _item(1000 + n), sequence=n + 1)  # as logged: one apart
            for n, (c, p) in enumerate(self.carried)
            if p is not None
        ]
        return Body(
            budget=self.budget,
            fixed=self.fixed + self.pending,
            history_floor=self.floor,
            tool_result_cap=self.cap,
            knowledge=[(_item(n), c) for n, c in enumerate(self.knowledge)],
            recall=[(_item(100 + n), c) for n, c in enumerate(self.recall)],
            recall_floor=self.recall_floor,
            carried_costs=carried_costs,
            run_results=[
                Truncatable(-1, c, p, _item(2000 + n)) for n, (c, p) in enumerate(self.run)
            ],
            carried_results=carried_results,
            cut_at=_suffix_cut,
            pending_result_tokens=self.pending,
        )


@st.composite
def specs(draw: st.DrawFn) -> Spec:
    result = st.integers(0, 4_000).flatmap(
        lambda c: st.tuples(st.just(c), st.integers(0, min(c, 60)))
    )
    carried = draw(
        st.lists(
            st.one_of(
                st.tuples(st.integers(0, 2_000), st.none()), result.map(lambda t: (t[0], t[1]))
            ),
            max_size=12,
        )
    )
    recall = draw(st.lists(st.integers(0, 900), max_size=6))
    return Spec(
        budget=draw(st.integers(0, 30_000)),
        fixed=draw(st.integers(0, 6_000)),
        floor=draw(st.sampled_from([0, 500, 8_000])),
        cap=draw(st.integers(0, 8_000)),
        knowledge=draw(st.lists(st.integers(0, 2_000), max_size=5)),
        recall=recall,
        recall_floor=draw(st.integers(0, len(recall) + 1)),
        carried=carried,
        run=draw(st.lists(result, max_size=6)),
        pending=draw(st.sampled_from([0, 0, 40, 1_000, 5_000])),
    )


def _with(
    body: Body,
    *,
    knowledge: int | None = None,
    recall: int | None = None,
    truncated: int | None = None,
) -> Body:
    """A copy of the final body with one rung rolled back: `truncated` keeps only that many
    of the truncations, in the order they happened (and un-pins the cut the cap pass
    pinned: the body as it was before that pass, measured with history at its floor)."""
    other = copy.copy(body)
    other.knowledge_kept = body.knowledge_kept if knowledge is None else knowledge
    other.recall_kept = body.recall_kept if recall is None else recall
    if truncated is not None:
        other.pinned_cut = None
        order = _truncation_order(body)
        keep = {id(t) for t in order[:truncated]}
        other.carried_results = [copy.copy(t) for t in body.carried_results]
        other.run_results = [copy.copy(t) for t in body.run_results]
        other.carried_costs = list(body.carried_costs)
        for old, new in zip(
            [*body.carried_results, *body.run_results],
            [*other.carried_results, *other.run_results],
            strict=True,
        ):
            new.truncated = id(old) in keep
            new.held = new.held and new.truncated  # an undone quantum holds nothing back
            if new.carried_index >= 0:
                # A cap truncation never moved the cut: history counts it at full cost.
                moved = new.truncated and not new.for_cap
                other.carried_costs[new.carried_index] = new.cost if moved else new.full_cost
    return other


def _truncation_order(body: Body) -> list[Truncatable]:
    ids = [i for s in body.steps if s.step == "truncate_tool_results" for i in s.item_ids]
    by_id = {t.item.item_id: t for t in (*body.carried_results, *body.run_results)}
    return [by_id[i] for i in ids]


def _capped_first(spec: Spec) -> int:
    """How many truncations the cap took before any rung yielded: the run's results, oldest
    first, up to the edge (they are in every request)."""
    edge = _run_cap_edge(spec)
    return sum(1 for full, pointer in spec.run[:edge] if full - pointer > 0)


def _run_total(spec: Spec, edge: int) -> int:
    """The run's and the active turn's results with the run's first `edge` truncated."""
    return spec.pending + sum(
        pointer if n < edge and full - pointer > 0 else full
        for n, (full, pointer) in enumerate(spec.run)
    )


def _run_cap_edge(spec: Spec) -> int:
    """Rule 6 (core/yield_ladder.py), from the spec alone: how many of the run's results,
    by position, the cap truncates: the least multiple of RUN_CAP_QUANTUM at which they
    and the active turn's are within the cap, or all of them."""
    return next(
        (n for n in range(0, len(spec.run), RUN_CAP_QUANTUM) if _run_total(spec, n) <= spec.cap),
        len(spec.run),
    )


def _recall_capped(spec: Spec) -> int:
    """How many recall lines the cap left before knowledge yielded: the lowest-ranked
    trimmed, never below the floor, until recall is within its cap (it is absolute)."""
    total, kept = sum(spec.recall), len(spec.recall)
    while kept > spec.recall_floor and total > RECALL.cap_tokens:
        kept -= 1
        total -= spec.recall[kept]
    return kept


def _knowledge_over_cap(body: Body) -> bool:
    return (
        body.knowledge_kept > KNOWLEDGE.cap_items or body.knowledge_tokens() > KNOWLEDGE.cap_tokens
    )


@GATE
@given(specs())
def test_steps_follow_the_ladder_once_each(spec: Spec) -> None:
    body = spec.body()
    fits = run_ladder(body)
    names = [s.step for s in body.steps]
    assert names == sorted(names, key=ORDER.index) and len(set(names)) == len(names)
    assert fits == body.fits()
    assert ("compact" in names) == (not fits)
    for step in body.steps:
        assert step.step == "compact" or (step.item_ids and step.tokens_freed >= 0)


def _for_the_fit(body: Body) -> list[Truncatable]:
    """The truncations made for the fit: neither the run's results capped before the rungs
    nor the results in the request capped once the body fit."""
    return [t for t in _truncation_order(body) if not t.for_cap]


# The run's result alone is within the cap (so whole through the rungs); the passage drops
# for the fit; then the carried result in the request and the run's result are over the
# cap, and the run's result (truncated for it) frees 390 tokens of what is paid: the
# passage comes back. It stayed dropped before (the body 560 of 1,000 tokens).
CAPPED_LATE = Spec(
    budget=1_000,
    fixed=250,
    floor=8_000,
    cap=500,
    knowledge=[60],
    recall=[],
    recall_floor=0,
    carried=[(300, 200)],
    run=[(400, 10)],
)


# The passage drops for the fit (history at its floor, the carried result whole); then the
# carried result, in the request, is over the cap and becomes a pointer, freeing 230 tokens
# of the request the pinned cut makes: the passage comes back. It stayed dropped before (a
# carried result truncated for the cap freed nothing the fit counted: the body 670 of 1,000).
CAPPED_CARRIED = Spec(
    budget=1_000,
    fixed=650,
    floor=300,
    cap=100,
    knowledge=[150],
    recall=[],
    recall_floor=0,
    carried=[(250, 20)],
    run=[],
)


# A passage and a recall line both yield for the fit; the cap pass then truncates the
# carried and the run's results, and the pinned request has room for one of them: the
# recall line, which comes back first (context-assembler@7 let the passage back instead,
# as the line's cost would have moved the cut it held).
RECALL_FIRST = Spec(
    budget=1_000,
    fixed=700,
    floor=0,
    cap=240,
    knowledge=[200],
    recall=[280],
    recall_floor=0,
    carried=[(60, 10)],
    run=[(240, 0)],
)


# Carried results truncated both for the fit and, once it fits, for the cap: the pinned
# request counts each truncated result once, as its pointer (a measure that took the fit's
# savings a second time found 2,022 tokens in a 2,574-token request, over the 2,445 budget).
FIT_AND_CAP = Spec(
    budget=2_445,
    fixed=927,
    floor=8_000,
    cap=801,
    knowledge=[371, 179, 180],
    recall=[240],
    recall_floor=0,
    carried=[(556, 4), (26, 19), (536, 55)],
    run=[(532, 2), (1, 0), (29, 16), (567, 35)],
)


# The body fits only once the run's result (within its cap, so whole until the third rung)
# is a pointer, which frees far more than the passage dropped before it: the passage and
# the recall line come back. They stayed dropped before (the body 610 of 1,000 tokens).
TAKEN_BACK = Spec(
    budget=1_000,
    fixed=600,
    floor=0,
    cap=450,
    knowledge=[60, 50],
    recall=[40],
    recall_floor=0,
    carried=[],
    run=[(450, 10)],
)


# Found by hypothesis: the second pass takes the run's results past the cap's need (held
# back); the gate's rolled-back body kept counting what they held back after undoing them.
HELD_THEN_UNDONE = Spec(
    budget=10_769,
    fixed=0,
    floor=0,
    cap=5_863,
    knowledge=[835],
    recall=[],
    recall_floor=1,
    carried=[(0, 0), (41, 3), (716, 0), (120, 0), (82, None)],
    run=[(203, 1), (47, 0), (301, 0), (2_775, 0), (2_535, 0)],
)


@GATE
@given(specs())
@example(TAKEN_BACK)
@example(CAPPED_LATE)
@example(CAPPED_CARRIED)
@example(HELD_THEN_UNDONE)
def test_each_rung_yields_no_further_than_needed(spec: Spec) -> None:
    body = spec.body()
    run_ladder(body)
    order = _truncation_order(body)
    # Knowledge: one more passage back would break its cap or the fit, as the body ends
    # (recall kept, results truncated; once the cap pass pinned the cut, the request that
    # cut makes), not only as it stood when knowledge yielded: what a later unit freed
    # brought back what it could.
    if body.knowledge_kept < len(body.knowledge):
        more = _with(body, knowledge=body.knowledge_kept + 1)
        assert _knowledge_over_cap(more) or not more.fits()
    # Recall: one more line back would break its cap or the fit; never below its floor.
    assert body.recall_kept >= min(body.recall_floor, len(body.recall))
    if body.recall_kept < len(body.recall):
        more = _with(body, recall=body.recall_kept + 1)
        assert more.recall_tokens() > RECALL.cap_tokens or not more.fits()
    # Tool results: undoing the last truncation would break the fit or the class cap; the
    # run's cap takes whole quanta of its results (Rule 6), and a quantum fewer would leave
    # them over the cap.
    capped = _capped_first(spec)
    older_first = any(t.for_cap for t in body.run_results)
    last = order[-1] if order else None
    if len(order) > capped and not (older_first and last and last.carried_index >= 0):
        start = len(order) - 1
        if last is not None and last.for_cap:
            # The request's cap pass takes whole quanta of each kind (Rule 6): undo the
            # last one, from its first truncation on.
            older = last.carried_index >= 0
            run_at = {id(t): n for n, t in enumerate(body.run_results)}

            def at(t: Truncatable) -> int:  # where Rule 6 counts it
                return t.sequence if t.carried_index >= 0 else run_at[id(t)]

            quantum = CARRIED_CAP_QUANTUM if older else RUN_CAP_QUANTUM
            first = at(last) // quantum * quantum
            start = min(
                n
                for n, t in enumerate(order)
                if n >= capped and t.for_cap and (t.carried_index >= 0) == older and at(t) >= first
            )
        undone = _with(body, truncated=start)
        assert not undone.fits() or undone.tool_results_over_cap()
    if older_first and body.fits():
        # Oldest first across the passes: a run result the cap took leaves no older
        # (carried) result in the request whole that would save something.
        assert all(
            t.truncated or t.saving <= 0 for t in body.carried() if t.carried_index >= body.cut()
        )
    edge = _run_cap_edge(spec)
    assert edge % RUN_CAP_QUANTUM == 0 or edge == len(spec.run)
    if edge:
        fewer = (edge - 1) // RUN_CAP_QUANTUM * RUN_CAP_QUANTUM
        assert _run_total(spec, fewer) > spec.cap


@GATE
@given(specs())
@example(TAKEN_BACK)
def test_a_later_rung_yields_for_pressure_only_once_earlier_ones_cannot(spec: Spec) -> None:
    body = spec.body()
    fits = run_ladder(body)
    capped = _capped_first(spec)
    assert [t.item.item_id for t in _truncation_order(body)[:capped]] == [
        t.item.item_id for t in body.run_results if t.saving > 0
    ][:capped]
    recall_capped = _recall_capped(spec)
    if _for_the_fit(body):
        # A result was truncated for the fit only because every earlier rung, fully
        # yielded, left the body over (what it freed may have brought some back).
        exhausted = _with(
            body, knowledge=0, recall=min(body.recall_floor, len(body.recall)), truncated=capped
        )
        assert not exhausted.fits()
    if body.recall_kept < recall_capped:
        # Recall was trimmed for the fit only because every passage dropped left it over.
        assert not _with(body, knowledge=0, recall=recall_capped, truncated=capped).fits()
    if not fits:
        # Compaction is reported only when every cheaper yield is exhausted.
        assert body.knowledge_kept == 0
        assert body.recall_kept == min(body.recall_floor, len(body.recall))
        assert all(t.truncated or t.saving <= 0 for t in body.run_results)


def test_what_a_truncation_freed_brings_back_what_the_earlier_rungs_gave_up() -> None:
    body = TAKEN_BACK.body()
    assert run_ladder(body)
    assert (body.knowledge_kept, body.recall_kept) == (2, 1)
    assert body.steps == [YieldStep("truncate_tool_results", 440, ("i2000",))]
    assert body.need() == 600 + 10 + 60 + 50 + 40


def test_a_run_result_the_cap_pass_truncates_brings_back_what_fits() -> None:
    body = CAPPED_LATE.body()
    assert run_ladder(body)
    assert body.knowledge_kept == 1
    assert body.steps == [YieldStep("truncate_tool_results", 490, ("i1000", "i2000"))]
    assert body.need() == 250 + 10 + 60 + 200  # the carried result as its pointer


def test_after_the_cap_pass_a_recall_line_comes_back_before_a_passage() -> None:
    body = RECALL_FIRST.body()
    assert run_ladder(body)
    assert (body.recall_kept, body.knowledge_kept) == (1, 0)
    assert body.steps[0] == YieldStep("drop_knowledge", 200, ("i0",))
    assert body.need() == 700 + 0 + 280 + 10


def test_a_carried_result_the_cap_pass_truncates_brings_back_what_fits() -> None:
    body = CAPPED_CARRIED.body()
    assert run_ladder(body)
    assert (body.knowledge_kept, body.cut()) == (1, 0)
    assert body.steps == [YieldStep("truncate_tool_results", 230, ("i1000",))]
    assert body.need() == 650 + 150 + 20


def test_what_comes_back_stops_at_the_first_that_does_not_fit_and_the_steps_say_so() -> None:
    # The truncation leaves 100 tokens: the recall line (40) comes back, then the best-ranked
    # passage (70) does not fit in the 60 left, so the lower-ranked one (10) stays out too.
    spec = replace(TAKEN_BACK, fixed=890, knowledge=[70, 10])
    body = spec.body()
    assert run_ladder(body)
    assert (body.knowledge_kept, body.recall_kept) == (0, 1)
    assert body.steps == [
        YieldStep("drop_knowledge", 80, ("i1", "i0")),
        YieldStep("truncate_tool_results", 440, ("i2000",)),
    ]


def test_the_ladder_table_is_the_caps_tables_yield_order() -> None:
    assert [CLASS_CAPS[r.class_name].yields for r in LADDER] == [
        Yields.FIRST,
        Yields.SECOND,
        Yields.THIRD,
        Yields.FOURTH,
    ]


def test_a_pointer_keeps_label_envelope_facts_byte_count_and_artifact() -> None:
    result = ToolResult(
        item_id="tr1",
        call_id="c1",
        tool_name="web.fetch",
        content="é" * 2_000,
        trust=TrustLevel.EXTERNAL_UNTRUSTED,
        source="tool:web.fetch",
        artifact_ref="a/9d02",
        sequence=42,
        is_error=True,
        context_content="excerpt",
    )
    pointer = pointer_for(result)
    assert pointer.content == (
        "[truncated] tool.result tr1 web.fetch (external_untrusted, 4,000 bytes) -> artifact:a/9d02"
    )
    assert pointer.context_content == ""
    same = (
        "item_id",
        "call_id",
        "tool_name",
        "trust",
        "source",
        "artifact_ref",
        "sequence",
        "is_error",
    )
    assert all(getattr(pointer, f) == getattr(result, f) for f in same)
    no_artifact = pointer_for(result.model_copy(update={"artifact_ref": ""}))
    assert no_artifact.content.endswith("-> event 42")


def test_run_results_over_their_cap_are_truncated_before_knowledge_yields() -> None:
    """A class cap is a cap: two run results over the tool-result cap are truncated for it
    whatever else happens, so the passage that fits once they are must not drop first (the
    cap pass used to run only after the fit, so knowledge dropped for tokens it frees)."""
    spec = Spec(
        budget=10_000,
        fixed=1_000,
        floor=0,
        cap=2_500,
        knowledge=[500],
        recall=[],
        recall_floor=0,
        carried=[],
        run=[(5_000, 20), (5_000, 20), (30, 20)],
    )
    body = spec.body()
    assert run_ladder(body)
    assert body.knowledge_kept == 1
    # The third too: the cap takes the run's results four at a time (Rule 6).
    assert [(s.step, s.item_ids) for s in body.steps] == [
        ("truncate_tool_results", ("i2000", "i2001", "i2002"))
    ]


def _tool_loop_step(
    carried: list[tuple[int, int | None]], step: int, budget: int = 200_000
) -> tuple[Spec, Body]:
    """A tool loop's request at `step`: a 1,000-token result a step (30 as a pointer)
    against a 10,000-token cap, after `carried` earlier runs' items; the ladder run."""
    spec = Spec(
        budget=budget,
        fixed=1_000,
        floor=0,
        cap=10_000,
        knowledge=[],
        recall=[],
        recall_floor=0,
        carried=list(carried),
        run=[(1_000, 30)] * step,
    )
    body = spec.body()
    assert run_ladder(body)
    return spec, body


def test_a_tool_loop_changes_its_truncated_results_once_every_four_steps() -> None:
    """Rule 6: a tool loop appends a result a step. Truncating no further than needed made
    one more of the run's oldest results a pointer at every step once the run was over its
    cap: a change the previous request's cache markers covered, so each step sent the run
    again uncached (an audit: 1-3% read from cache). The cap takes them in steps of
    RUN_CAP_QUANTUM: the truncated results change once every few steps, always the run's
    oldest, and within the cap."""
    truncated_by_step = []
    for step in range(1, 41):
        spec, body = _tool_loop_step([], step)
        ids = tuple(i for s in body.steps for i in s.item_ids)
        assert ids == tuple(t.item.item_id for t in body.run_results[: len(ids)])  # oldest
        assert sum(t.cost for t in body.run_results) <= spec.cap
        truncated_by_step.append(len(ids))
    changes = [n for n in range(1, 40) if truncated_by_step[n] != truncated_by_step[n - 1]]
    assert truncated_by_step[:10] == [0] * 10  # within the cap: nothing
    # Each step needs a little more than one more pointer (a step adds 1,000 tokens, a
    # pointer frees 970): a change every three or four steps, four results at a time, where
    # no further than needed changed them at each of the 30 steps over the cap.
    assert RUN_CAP_QUANTUM == 4
    assert len(changes) <= 10
    assert all(b - a >= 3 for a, b in pairwise(changes))
    assert all(truncated_by_step[n] - truncated_by_step[n - 1] == 4 for n in changes)


@pytest.mark.parametrize("carried", [[(400, 30)] * 10, [(1_500, 30)] * 6], ids=["10x400", "6x1500"])
def test_a_tool_loop_over_earlier_runs_results_changes_them_once(
    carried: list[tuple[int, int | None]],
) -> None:
    """Rule 6 across the passes: the room the run's quantum frees let earlier runs'
    results come back whole, one more or fewer at each step, so their history (before the
    run) re-cached at 34 of 39 steps (a review). Once the run's cap takes one of its
    results, the older ones are pointers too: the request's results change at most once
    every three steps, and an earlier run's result, once a pointer, stays one."""
    states = []
    for step in range(1, 41):
        _, body = _tool_loop_step(carried, step)
        states.append(
            (
                tuple(t.truncated for t in body.carried_results),
                tuple(t.truncated for t in body.run_results),
            )
        )
    # A change to what the previous request held (the new step's own result aside).
    changed = [
        n
        for n in range(1, 40)
        if states[n][0] != states[n - 1][0]
        or states[n][1][: len(states[n - 1][1])] != states[n - 1][1]
    ]
    assert len(changed) <= 16
    # Once the run's cap binds (before, earlier runs' results go a quantum a step while a
    # step adds more than a quantum of them frees).
    bound = next(n for n, (_, run) in enumerate(states) if any(run))
    assert all(b - a >= 3 for a, b in pairwise(n for n in changed if n >= bound))
    for before, after in pairwise(states):
        assert all(a <= b for a, b in zip(before[0], after[0], strict=True))  # stays a pointer


def test_the_quanta_leave_the_history_cut_where_minimal_truncation_puts_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What a quantum frees past the cap's need is held back (Body.held_back()): counted
    free, it let the cut of a carried history larger than its room move at every step of
    a tool loop, back and forth with each quantum, and every such step re-sent the request
    from the cut (a review). The cut is the one truncating no further than needed gives."""
    import context_engine.core.yield_ladder as ladder

    carried: list[tuple[int, int | None]] = [(900, None)] * 60  # messages: no results
    quanta = []
    for quantum in (ladder.RUN_CAP_QUANTUM, 1):
        monkeypatch.setattr(ladder, "RUN_CAP_QUANTUM", quantum)
        cuts = []
        for step in range(1, 41):
            cuts.append(_tool_loop_step(carried, step, budget=40_000)[1].cut())
        quanta.append(cuts)
    assert quanta[0] == quanta[1]


# Four run results over a 10,000 cap, all four pointers: 32,040 as sent (an audit).
HELD_FITS = Spec(
    budget=40_000,
    fixed=32_000,
    floor=0,
    cap=10_000,
    knowledge=[],
    recall=[],
    recall_floor=0,
    carried=[],
    run=[(12_000, 10), (9_000, 10), (9_000, 10), (9_000, 10)],
)
# Fits with the quantum's hold once knowledge is within its cap of three passages (a review).
HELD_OVER_KNOWLEDGE_CAP = Spec(
    budget=25_500,
    fixed=10_000,
    floor=8_000,
    cap=5_000,
    knowledge=[1_000] * 4,
    recall=[],
    recall_floor=0,
    carried=[(500, None)] * 30,
    run=[(2_000, 10)] * 5,
)


def test_what_the_quanta_hold_back_is_spent_before_anything_yields_for_the_fit() -> None:
    """Rule 6: a result the cap's quantum truncated past its need is a pointer already;
    paid whole, it made a body that fitted as sent ask for a compaction (an audit: budget
    40,000, 32,000 fixed, four run results of 12,000 and 9,000 tokens over a 10,000 cap,
    all four pointers: 32,040 as sent, and `compact`)."""
    spec = HELD_FITS
    body = spec.body()
    assert run_ladder(body)
    assert all(t.truncated for t in body.run_results)  # what the cap took, no more
    assert [s.step for s in body.steps] == ["truncate_tool_results"]
    # The same with a passage: it is not dropped for what the quantum holds back.
    spec = replace(spec, budget=40_500, knowledge=[400])
    body = spec.body()
    assert run_ladder(body)
    assert body.knowledge_kept == 1 and [s.step for s in body.steps] == ["truncate_tool_results"]


def test_a_passage_over_knowledges_cap_releases_no_hold() -> None:
    """The hold is released only where the body does not fit with it as the request can
    carry it: a fourth passage, which knowledge's cap drops anyway, released it and moved
    the cut (a review: top-five retrieval did so on every Build)."""
    capped, three = (
        spec.body()
        for spec in (
            HELD_OVER_KNOWLEDGE_CAP,
            replace(HELD_OVER_KNOWLEDGE_CAP, knowledge=[1_000] * 3),
        )
    )
    assert run_ladder(capped) and run_ladder(three)
    assert any(t.held for t in three.run_results)
    assert [t.held for t in capped.run_results] == [t.held for t in three.run_results]
    assert capped.cut() == three.cut() and capped.knowledge_kept == 3


def test_recall_over_its_cap_is_trimmed_before_knowledge_yields() -> None:
    """Recall's cap is absolute too: lines over it are trimmed whatever else happens, so
    the passage that fits once they are must not drop first (recall used to be measured
    whole when knowledge yielded: the passage dropped, then recall was trimmed to its cap
    anyway, leaving a body of 2,500 against a budget of 4,000)."""
    spec = Spec(
        budget=4_000,
        fixed=1_000,
        floor=0,
        cap=8_000,
        knowledge=[500],
        recall=[1_500, 1_500],
        recall_floor=0,
        carried=[],
        run=[],
    )
    body = spec.body()
    assert run_ladder(body)
    assert body.knowledge_kept == 1 and body.recall_kept == 1
    assert [(s.step, s.item_ids, s.tokens_freed) for s in body.steps] == [
        ("trim_recall", ("i101",), 1_500)
    ]
    # Where the fit needs more, recall still yields for pressure after knowledge; what the
    # cap trimmed and what the fit did are one step, lowest-ranked first. The last line
    # trimmed (1,500) freed more than the 100 still over: the passage comes back.
    tight = Spec(**{**spec.__dict__, "budget": 2_400, "recall": [1_500, 1_000, 900]})
    body = tight.body()
    assert run_ladder(body)
    assert [(s.step, s.item_ids, s.tokens_freed) for s in body.steps] == [
        ("trim_recall", ("i102", "i101", "i100"), 3_400),
    ]
    assert (body.knowledge_kept, body.recall_kept, body.need()) == (1, 0, 1_500)


class _Counted(int):
    """A line cost that counts every addition it takes part in (sum() and running totals),
    so a test can bound the ladder's work without a clock."""

    additions = 0

    def __radd__(self, other: int) -> int:
        _Counted.additions += 1
        return int(other) + int(self)

    def __add__(self, other: int) -> int:
        _Counted.additions += 1
        return int(self) + int(other)


def test_trimming_recall_and_dropping_knowledge_read_each_cost_a_bounded_number_of_times() -> None:
    """Both rungs re-summed every kept unit (recall_tokens, knowledge_tokens, fits) for each
    unit they dropped: quadratic in the lines a Build carries (25,000 recall lines held the
    event loop for 9 s). With running totals each cost is added a constant number of times,
    counted here, not timed: 4,000 lines took ~16 million additions before, fewer than
    4 per line now."""
    lines = 4_000
    body = Body(
        budget=100_000,
        fixed=0,
        history_floor=8_000,
        tool_result_cap=25_000,
        knowledge=[(_item(n), _Counted(5)) for n in range(lines)],
        recall=[(_item(lines + n), _Counted(5)) for n in range(lines)],
        recall_floor=0,
        carried_costs=[],
        run_results=[],
        carried_results=[],
        cut_at=_suffix_cut,
    )
    _Counted.additions = 0
    run_ladder(body)
    assert body.recall_kept * 5 <= RECALL.cap_tokens < len(body.recall) * 5  # it did trim
    assert body.knowledge_kept <= KNOWLEDGE.cap_items < len(body.knowledge)  # it did drop
    assert _Counted.additions < 4 * 2 * lines, _Counted.additions


def _request_tokens(body: Body) -> int:
    """The request a body the cap pass pinned makes, measured from its parts rather than by
    Body.need: what is paid, and the carried history from the pinned cut with each result
    as it is sent (its pointer once truncated, for the fit or for the cap)."""
    assert body.pinned_cut is not None
    results = {t.carried_index: t for t in body.carried_results or ()}
    history = 0
    for n in range(body.pinned_cut, len(body.carried_costs)):
        t = results.get(n)
        if t is None:
            history += body.carried_costs[n]
        else:
            history += t.pointer_cost if t.truncated else t.full_cost
    return body.paid() + history


def _fits(body: Body) -> bool:
    """Body.fits, re-measured independently once the cap pass has pinned the cut."""
    if body.pinned_cut is None:
        return body.fits()
    return _request_tokens(body) <= body.budget


def _reference_take_back(body: Body, given_up: dict[str, tuple[int, list[str]]]) -> None:
    """What the last unit yielded freed beyond the overflow: recall lines, then passages,
    best-ranked first, while one more still fits (after the cap pass, in the request the
    cut it pinned makes) and keeps its class within its cap."""
    for name, units, kept in (
        ("trim_recall", body.recall, "recall_kept"),
        ("drop_knowledge", body.knowledge, "knowledge_kept"),
    ):
        while given_up[name][1]:
            setattr(body, kept, getattr(body, kept) + 1)
            over = (
                body.recall_tokens() > RECALL.cap_tokens
                if name == "trim_recall"
                else _knowledge_over_cap(body)
            )
            if over or not _fits(body):
                setattr(body, kept, getattr(body, kept) - 1)
                break
            item, cost = units[getattr(body, kept) - 1]
            step_freed, step_ids = given_up[name]
            assert step_ids[-1] == item.item_id
            given_up[name] = (step_freed - cost, step_ids[:-1])


def _over_cap(body: Body) -> bool:
    """The results in the request the cut makes, the active turn's included, over the
    class cap: measured whole, not from Body's running totals."""
    in_request = sum(t.cost for t in body.results_in_request(body.cut()))
    return in_request + body.pending_result_tokens > body.tool_result_cap


def _quantum(count: int, quantum: int) -> int:
    """`count` rounded up to a multiple of `quantum`."""
    return (count + quantum - 1) // quantum * quantum


def _reference_ladder(body: Body) -> bool:
    """The ladder as first written: every condition re-measured from the body after every
    unit (quadratic, obviously the rules). run_ladder must take exactly its steps."""
    run_total, capped = body.run_result_tokens() + body.pending_result_tokens, []
    for n, t in enumerate(body.run_results):
        if run_total <= body.tool_result_cap and n % RUN_CAP_QUANTUM == 0:
            break
        if t.saving > 0:
            t.held = run_total <= body.tool_result_cap  # the quantum's: not the cut's
            t.truncated = t.for_cap = True
            run_total -= t.saving
            capped.append(t)
    recall_capped: list[str] = []
    while body.recall_kept > body.recall_floor and body.recall_tokens() > RECALL.cap_tokens:
        body.recall_kept -= 1
        recall_capped.append(body.recall[body.recall_kept][0].item_id)
    knowledge_capped: list[str] = []
    while body.knowledge_kept > 0 and _knowledge_over_cap(body):
        body.knowledge_kept -= 1
        knowledge_capped.append(body.knowledge[body.knowledge_kept][0].item_id)
    for t in body.run_results:  # what the quanta hold back, before anything yields
        if t.held and not body.fits():
            t.held = False
    given_up: dict[str, tuple[int, list[str]]] = {}
    for name, units in (("drop_knowledge", body.knowledge), ("trim_recall", body.recall)):
        ids = recall_capped if name == "trim_recall" else knowledge_capped
        freed = sum(c for item, c in units if item.item_id in ids)
        while True:
            if name == "drop_knowledge":
                more = body.knowledge_kept > 0 and (_knowledge_over_cap(body) or not body.fits())
            else:
                more = body.recall_kept > body.recall_floor and (
                    body.recall_tokens() > RECALL.cap_tokens or not body.fits()
                )
            if not more:
                break
            if name == "drop_knowledge":
                body.knowledge_kept -= 1
                item, cost = units[body.knowledge_kept]
            else:
                body.recall_kept -= 1
                item, cost = units[body.recall_kept]
            freed, ids = freed + cost, [*ids, item.item_id]
        given_up[name] = (freed, ids)
    freed, ids = sum(t.saving for t in capped), [t.item.item_id for t in capped]
    while not body.fits():
        paid, history = body.paid(), body.history_total()
        need = paid + min(body.history_floor, history)
        chosen = next(
            (
                t
                for t in (*body.carried_results, *body.run_results)
                if not t.truncated
                and t.saving > 0
                and (
                    t.carried_index < 0 or paid + min(body.history_floor, history - t.saving) < need
                )
            ),
            None,
        )
        if chosen is None:
            break
        chosen.truncated = True
        if chosen.carried_index >= 0:
            body.carried_costs[chosen.carried_index] = chosen.pointer_cost
        freed, ids = freed + chosen.saving, [*ids, chosen.item.item_id]
    if body.fits():
        _reference_take_back(body, given_up)
    if body.fits():
        # The cap: the oldest whole result in the request, with the cut read afresh, until
        # the request's results are within the cap or none is left that saves something;
        # once the run's cap took one of its results, every carried one; and on to a
        # multiple of RUN_CAP_QUANTUM of each kind this pass took (Rule 6).
        older = any(t.for_cap for t in body.run_results)
        capped_in_request = _over_cap(body) or older
        position = {id(t): n for n, t in enumerate(body.run_results)}
        edges = {True: 0, False: 0}  # carried: a session sequence; run: a position
        while True:
            chosen = next(
                (
                    t
                    for t in body.results_in_request(body.cut())
                    if not t.truncated and t.saving > 0
                ),
                None,
            )
            if chosen is None:
                break
            kind = chosen.carried_index >= 0
            at = chosen.sequence if kind else position[id(chosen)]
            if not (_over_cap(body) or (older and kind) or at < edges[kind]):
                break
            edges[kind] = max(
                edges[kind], _quantum(at + 1, CARRIED_CAP_QUANTUM if kind else RUN_CAP_QUANTUM)
            )
            chosen.held = not kind and not _over_cap(body)  # a quantum's: the cut stays
            chosen.truncated = chosen.for_cap = True
            freed, ids = freed + chosen.saving, [*ids, chosen.item.item_id]
            capped_in_request = True
        if capped_in_request:
            body.pinned_cut = body.cut()  # the request it chose its results from
            _reference_take_back(body, given_up)
    for name, (step_freed, step_ids) in given_up.items():
        if step_ids:
            body.steps.append(YieldStep(name, step_freed, tuple(step_ids)))
    if ids:
        body.steps.append(YieldStep("truncate_tool_results", freed, tuple(ids)))
    if not _fits(body):
        body.steps.append(YieldStep("compact", 0, ()))
        return False
    return True


@st.composite
def crowded_specs(draw: st.DrawFn) -> Spec:
    """Many small units around the floor, so carried results become worth truncating only
    after later ones were (history falling back under its floor)."""
    spec = draw(specs())
    result = st.tuples(st.integers(1, 400), st.integers(0, 40))
    spec.carried = draw(
        st.lists(st.one_of(st.tuples(st.integers(0, 300), st.none()), result), max_size=40)
    )
    spec.run = draw(st.lists(result, max_size=20))
    spec.recall = draw(st.lists(st.integers(0, 300), max_size=30))
    spec.recall_floor = draw(st.integers(0, len(spec.recall) + 1))
    spec.floor = draw(st.sampled_from([0, 300, 1_000, 3_000, 8_000]))
    spec.budget = draw(st.integers(0, 12_000))
    return spec


# Found by the gate on 2026-12-03: the cap pass truncated the run result i2000, which
# lowered what is paid, moved the cut one item earlier and brought the carried result
# i1000 (2 tokens) into the request; measured only at the pass's start, the pass stopped
# at 595 tokens of results against a cap of 594, where re-measuring truncates i2001 too.
CUT_MOVED_BY_THE_CAP = Spec(
    budget=3947,
    fixed=0,
    floor=0,
    cap=594,
    knowledge=[0, 0, 1106, 35],
    recall=[136, 300, 300, 300],
    recall_floor=0,
    carried=[(2, 0), (0, None), (128, None), (162, None), (209, 0), (342, 0), (400, 40)],
    run=[(74, 34), (1, 0), (1, 0), (5, 0), (112, 25), (400, 0)],
)


# Found by a review the same day: truncating the run result i2000 for the cap moved the
# cut to the start and brought the carried result i1000 (100 tokens, a 0-token pointer)
# in; the pass went on over the results it started with only, and the request kept 155
# tokens of results against a cap of 50 with i1000 whole.
CARRIED_BROUGHT_IN_BY_THE_CAP = Spec(
    budget=160,
    fixed=0,
    floor=0,
    cap=50,
    knowledge=[],
    recall=[],
    recall_floor=0,
    carried=[(100, 0), (60, 55)],
    run=[(40, 0), (40, 0)],
)


@GATE
@given(st.one_of(specs(), crowded_specs()))
@example(CAPPED_CARRIED)
@example(CAPPED_LATE)
@example(FIT_AND_CAP)
@example(RECALL_FIRST)
def test_a_pinned_body_measures_the_request_it_makes(spec: Spec) -> None:
    """Once the cap pass has pinned the cut, what the body takes is the request it makes,
    each carried result as it is sent (its pointer once truncated for the fit or the cap),
    and that request is within the budget."""
    body = spec.body()
    fits = run_ladder(body)
    if body.pinned_cut is not None:
        assert fits and body.need() == _request_tokens(body) <= body.budget


@GATE
@given(st.one_of(specs(), crowded_specs()))
@example(CUT_MOVED_BY_THE_CAP)
@example(CARRIED_BROUGHT_IN_BY_THE_CAP)
def test_a_body_that_fits_holds_its_results_within_the_cap_or_none_is_left_to_truncate(
    spec: Spec,
) -> None:
    """The class cap is a cap (docs/architecture.md, the ladder): whatever the cut keeps,
    the results in the request are within it, unless every one of them is already a pointer
    or would save nothing as one."""
    body = spec.body()
    if run_ladder(body):
        in_request = body.results_in_request(body.cut())
        total = sum(t.cost for t in in_request) + body.pending_result_tokens
        assert total <= body.tool_result_cap or all(
            t.truncated or t.saving <= 0 for t in in_request
        )


@GATE
@given(st.one_of(specs(), crowded_specs()))
@example(CUT_MOVED_BY_THE_CAP)
@example(CARRIED_BROUGHT_IN_BY_THE_CAP)
@example(TAKEN_BACK)
@example(CAPPED_LATE)
@example(HELD_FITS)
@example(replace(HELD_FITS, budget=0, fixed=0, cap=1, run=[(1, 0), (1, 0)]))
@example(HELD_OVER_KNOWLEDGE_CAP)
def test_the_ladder_takes_exactly_the_steps_of_re_measuring_after_every_unit(
    spec: Spec,
) -> None:
    """The rungs keep running totals (and a heap of the carried results worth truncating)
    instead of re-measuring the body after every unit, which was quadratic; the answer
    must be the same, unit for unit."""
    body, reference = spec.body(), spec.body()
    assert run_ladder(body) == _reference_ladder(reference)
    assert body.steps == reference.steps
    assert (body.knowledge_kept, body.recall_kept) == (
        reference.knowledge_kept,
        reference.recall_kept,
    )
    assert body.carried_costs == reference.carried_costs
    assert [(t.truncated, t.for_cap) for t in (*body.carried_results, *body.run_results)] == [
        (t.truncated, t.for_cap) for t in (*reference.carried_results, *reference.run_results)
    ]


def test_truncating_for_pressure_re_measures_nothing_per_result() -> None:
    """Truncating tool results for the fit re-scanned the results from the oldest and
    re-summed the body per truncation: quadratic (4,000 results: 7 s on the event loop).
    Counted, not timed: each result's cost now takes part in a bounded number of additions."""
    n = 2_000
    carried = [Truncatable(i, _Counted(100), _Counted(10), _item(3000 + i)) for i in range(n)]
    body = Body(
        budget=50_000,
        fixed=0,
        history_floor=8_000,
        tool_result_cap=10**9,
        knowledge=[],
        recall=[],
        recall_floor=0,
        carried_costs=[_Counted(100) for _ in range(n)],
        run_results=[
            Truncatable(-1, _Counted(100), _Counted(10), _item(6000 + i)) for i in range(n)
        ],
        carried_results=carried,
        cut_at=_suffix_cut,
    )
    _Counted.additions = 0
    assert run_ladder(body)
    assert sum(t.truncated for t in body.run_results) > n // 2  # it did truncate
    assert _Counted.additions < 10 * 2 * n, _Counted.additions


def test_capping_the_results_in_the_request_re_measures_nothing_per_result() -> None:
    """The cap pass read the cut again after every run result it truncated, and reading it
    re-summed every run result (paid) and copied the history's costs: quadratic in the
    run's results, on the event loop (2,000 results: ~4 million additions). Counted, not
    timed: each result's cost now takes part in a bounded number of additions, and the cut
    is read at most once per run result truncated."""
    n = 2_000
    reads = 0

    def cut_at(costs: Sequence[int], tokens: int) -> int:
        nonlocal reads
        reads += 1
        return 0  # all the history fits (the cut's own work is not what is counted)

    body = Body(
        budget=10**9,
        fixed=0,
        history_floor=0,
        # Over the run's results alone by nothing (_cap_run_results truncates none), so
        # the carried results' pointers leave the pass truncating run results after them.
        tool_result_cap=10 * n,
        knowledge=[],
        recall=[],
        recall_floor=0,
        carried_costs=[_Counted(100) for _ in range(n)],
        run_results=[Truncatable(-1, _Counted(10), _Counted(1), _item(6000 + i)) for i in range(n)],
        carried_results=[
            Truncatable(i, _Counted(100), _Counted(10), _item(3000 + i)) for i in range(n)
        ],
        cut_at=cut_at,
    )
    _Counted.additions = reads = 0
    assert run_ladder(body)
    assert sum(t.truncated for t in body.run_results) > n // 2  # it did truncate them
    assert _Counted.additions < 10 * 3 * n, _Counted.additions
    assert reads <= n + 2, reads


def test_a_result_truncated_then_cut_away_leaves_the_kept_history_as_it_is() -> None:
    """A summary floor that covers a call but not its result (a checkpoint compacted
    elsewhere) leaves the result an orphan at the carried history's start, which the cut
    must pass. Under pressure the ladder truncated it to a pointer first, and the request
    then wrote that pointer at its index less the cut, -1: over the newest kept item (here
    the assistant's answer), or the pair check failed on a body that fits."""
    secret = b"k" * 16
    plan = small_plan(5000, 0, 1000, secret=secret)
    carried = (
        UserMessage(item_id="u1", text="fetch it", sequence=1, run_id="r0"),
        ToolCall(
            item_id="tc1",
            call_id="c1",
            tool_name="web.fetch",
            arguments_json="{}",
            sequence=2,
            run_id="r0",
        ),
        ToolResult(
            item_id="tr1",
            call_id="c1",
            tool_name="web.fetch",
            content="x " * 8000,
            trust=TrustLevel.EXTERNAL_UNTRUSTED,
            sequence=3,
            run_id="r0",
        ),
        AssistantMessage(item_id="a1", text="Here is the page.", sequence=4, run_id="r0"),
    )
    checkpoint = Checkpoint(
        run_id="r1",
        version=1,
        summary=SummaryItem(item_id="summary", text="Fetched a page."),
        replaced_through_sequence=2,  # the call, not its result
        items=(UserMessage(item_id="u2", text="thanks", sequence=5, run_id="r1"),),
    )
    assembled = assemble(
        BuildInputs(
            tenant_id="t",
            plan=plan,
            secret=secret,
            checkpoint=checkpoint,
            carried=carried,
            now=datetime(2024, 1, 1, tzinfo=UTC),
            count_tokens=count_tokens,
        )
    )
    assert assembled.request is not None
    kept = [item.item_id for _, item in assembled.placed]
    assert kept == ["summary", "a1", "runtime", "u2"]  # the answer kept whole, no pointer
    assert assembled.pressure.history_cut_index == 1
    # Nor does the report say it was truncated: the request does not carry it.
    truncations = [s for s in assembled.pressure.steps if s.step == "truncate_tool_results"]
    assert all("tr1" not in s.item_ids for s in truncations)
    assert assembled.pressure.body_tokens_after <= assembled.pressure.body_budget_tokens
