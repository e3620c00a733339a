"""Fitting the body into its budget: never-yield first, then the ladder, then the cut.

Rule 1 (never-yield): the current user message (the run's own user messages and trailing
input), the working-state block, the correction lines, loaded skill bodies, runtime
metadata and the active loop's turn (the latest model turn that called tools: its text,
reasoning and calls, and the results in so far, `assemble.active_turn`; compaction never
takes it either) are paid first. So is recall's floor (its `recall_floor_lines`
best-ranked lines, which the ladder never trims), though recall above it yields. If they
alone exceed the body, the request fails with BUDGET_EXCEEDED naming the largest of their
classes (`active_turn` for the turn, `recall` for the floor) — the rule the prefix
follows, for the same reason: no yield and no compaction could make them fit.
Rule 2 (the run is not history): the active run's earlier exchanges are never cut; only
their tool results may yield (to pointers). The summary is never cut either. If these do
not fit after every cheaper yield, the body needs compaction.
Rule 3 (the ladder): yield_ladder.run_ladder, in its fixed order, no further than needed.
Rule 4 (the cut): carried history takes the remainder and select_history picks the suffix;
the floor is protected by the ladder, so the remainder is at least min(floor, history).
The floor (8,000 tokens) counts the history the request carries whatever the cut (the
summary, the run's own exchanges: history-class items), and carried history, as the cut
counts it (its results included), is protected only for the rest (before
context-assembler@20, for 8,000 tokens on top: a run of 10,000 tokens of its own exchanges
dropped every knowledge passage, or asked for a compaction, to keep 8,000 more of carried
history).
Rule 5 (purity): costs come from the `cost` argument (a pure, conservative estimate of an
item as rendered) and, for carried history, from its Segment (core/carried.py: the same
estimate, derived once per run); identical inputs give identical decisions.
Rule 6 (row 13): correction lines share in-turn recall's 2,000-token cap (the spec's row
13 is both; the caps table names recall alone). They never yield, so recall holds what
they leave, and lines over the cap alone (or with recall's floor) are INVALID_FIELD
(before context-assembler@29 they were uncapped: 100 lines of 285 tokens were sent).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from itertools import chain

from .budget import ContextBudget
from .caps import CLASS_CAPS
from .carried import Retained, Segment
from .errors import BudgetExceededError, InvalidFieldError
from .items import (
    ContextItem,
    CorrectionLineItem,
    KnowledgePassageItem,
    RecallLineItem,
    ToolResult,
    UserMessage,
)
from .plan import ClassUsage
from .rows import Row
from .yield_ladder import Body, Truncatable, YieldStep, pointer_for, run_ladder

__all__ = ["BODY_CLASSES", "Cost", "Fitted", "PressureReport", "fit_body", "window_reach"]

# (row, item, rendered as truncated) -> estimated tokens, conservative and pure.
Cost = Callable[[Row, ContextItem, bool], int]
Placed = tuple[Row, ContextItem]

# Body classes in the order they are reported; the never-yield ones are marked.
BODY_CLASSES: tuple[tuple[str, bool], ...] = (
    ("history", False),
    ("tool_results", False),
    ("skill_bodies", True),
    ("working_state", True),
    ("corrections", True),
    ("recall", False),
    ("knowledge", False),
    ("runtime_metadata", True),
    ("user_message", True),
)
_NEVER_YIELD = frozenset(name for name, never in BODY_CLASSES if never)


@dataclass(frozen=True, slots=True)
class PressureReport:
    fits: bool
    steps: tuple[YieldStep, ...]
    body_tokens_before: int
    body_tokens_after: int
    body_budget_tokens: int
    legacy_tool_excerpts: tuple[str, ...]
    history_cut_index: int
    history_items_dropped: int

    @property
    def yielded(self) -> bool:
        return bool(self.steps)

    def to_json(self) -> dict[str, object]:
        return {
            "fits": self.fits,
            "steps": [
                {"step": s.step, "tokens_freed": s.tokens_freed, "item_ids": list(s.item_ids)}
                for s in self.steps
            ],
            "body_tokens_before": self.body_tokens_before,
            "body_tokens_after": self.body_tokens_after,
            "body_budget_tokens": self.body_budget_tokens,
            "legacy_tool_excerpts": list(self.legacy_tool_excerpts),
            "history_cut_index": self.history_cut_index,
            "history_items_dropped": self.history_items_dropped,
        }


@dataclass(frozen=True, slots=True)
class Fitted:
    placed: tuple[Placed, ...]  # what the request carries, pointers substituted
    truncated: frozenset[int]  # id() of placed items that render marked truncated
    report: PressureReport
    usage: tuple[ClassUsage, ...]
    body_tokens: int  # estimated body tokens of the request (or of the need, if unfit)
    # The carried suffix the request carries (None if it does not fit) and where in
    # `placed` it starts: rendering reuses its merged messages.
    retained: Retained | None = None
    retained_at: int = 0

    @property
    def fits(self) -> bool:
        return self.report.fits


def _check_row_13(corrections: int, floor: int, lines: int) -> None:
    """Every class but history is capped absolutely, row 13 (in-turn recall and correction
    lines) at recall's 2,000 tokens. Correction lines never yield, nor does recall's
    floor, so either over the cap would hold the row over it for good (an audit: twelve
    floor lines took 3,312 tokens, squeezing history and tool results; another: 100
    correction lines took 28,500 uncapped): refused, naming the field the caller sets."""
    cap = CLASS_CAPS["recall"].cap_tokens
    if corrections > cap:
        raise InvalidFieldError(
            f"step.corrections: the correction lines cost {corrections} tokens, over the"
            f" {cap}-token cap they share with in-turn recall; send fewer or shorter ones",
            field="step.corrections",
            metadata={"corrections_tokens": str(corrections), "cap_tokens": str(cap)},
        )
    if corrections + floor > cap:
        beside = f" beside {corrections} tokens of correction lines" if corrections else ""
        raise InvalidFieldError(
            f"step.recall_floor_lines: the floor's {lines} recall lines cost {floor} tokens,"
            f"{beside} over in-turn recall's {cap}-token cap; lower the floor (the lines"
            " above it still yield)",
            field="step.recall_floor_lines",
            metadata={
                "floor_tokens": str(floor),
                "corrections_tokens": str(corrections),
                "cap_tokens": str(cap),
            },
        )


def fit_body(
    head: Sequence[Placed],
    carried: Segment,
    tail: Sequence[Placed],
    *,
    pending: Sequence[ContextItem],
    budget: ContextBudget,
    cost: Cost,
    recall_floor_lines: int = 0,
    skipped: int = 0,
    refuse_floor_over_cap: bool = True,
) -> Fitted:
    """Decide what of the placed Region B items the request carries.

    The candidates in row order are `head` (the summary), the carried history `carried`
    (core/carried.py: its items, costs and classes derived once per run), then `tail` (the
    run's items and the fresh rows). `pending` names (by identity) the active loop's turn
    among `tail` (assemble.active_turn; never yields); carried items are never pending.
    Carried items above the summary floor that lie beyond the window (`skipped`,
    CarriedView.skipped) are reported as cut.

    Raises:
        BudgetExceededError: the never-yield set (recall's floor included) alone exceeds
            the body; metadata "class" names its largest class.
        InvalidFieldError: the correction lines, or they and recall's floor, cost more
            than recall's cap (Rule 6; unless `refuse_floor_over_cap` is False: a rebuild
            of a request sent before Build refused it).
    """
    others = [*head, *tail]
    pending_ids = {id(i) for i in pending}
    # Costs first: rendering is what rejects an item type assembly cannot render.
    costs = [cost(row, item, False) for row, item in others]
    classes = [_class_of(row, item) for row, item in others]
    never = [
        kind in _NEVER_YIELD or id(item) in pending_ids
        for (_, item), kind in zip(others, classes, strict=True)
    ]
    # Recall's floor (its best-ranked lines, in arrival order) is never trimmed either: a
    # set that does not fit with it cannot be made to by any yield or compaction.
    floor = max(0, recall_floor_lines)
    recall_at = [n for n, kind in enumerate(classes) if kind == "recall"]
    unyielding = list(never)
    for n in recall_at[:floor]:
        unyielding[n] = True
    # Correction lines share row 13's cap with recall, which yields to them (Rule 6).
    corrections = sum(c for c, kind in zip(costs, classes, strict=True) if kind == "corrections")
    if refuse_floor_over_cap:
        floor_tokens = sum(costs[n] for n in recall_at[:floor])
        _check_row_13(corrections, floor_tokens, len(recall_at[:floor]))
    _check_never_yield(others, classes, costs, unyielding, pending_ids, budget)

    run_results: list[Truncatable] = []
    knowledge: list[tuple[ContextItem, int]] = []
    recall: list[tuple[ContextItem, int]] = []
    fixed = 0
    pending_results = 0  # the active turn's: never yield, count toward the class cap
    paid_history = 0  # the summary and the run's exchanges: history the floor need not add
    for (row, item), kind, spent, keep in zip(others, classes, costs, never, strict=True):
        if kind == "history":
            paid_history += spent
        if keep:
            fixed += spent
            if kind == "tool_results":
                pending_results += spent
        elif kind == "knowledge":
            knowledge.append((item, spent))
        elif kind == "recall":
            recall.append((item, spent))
        elif isinstance(item, ToolResult):
            run_results.append(Truncatable(-1, spent, _pointer_cost(row, item, cost), item))
        else:
            fixed += spent  # the summary and the run's earlier exchanges: never cut
    # Lowest-ranked passages drop first; the stable sort keeps arrival order within a rank.
    knowledge.sort(key=lambda pair: _rank(pair[0]))

    def carried_results() -> list[Truncatable]:
        return [
            Truncatable(n, full, pointer, item, sequence=item.sequence)
            for n, full, pointer in carried.results
            for item in (carried.items[n],)
        ]

    # The active turn's results count toward their class's cap while they alone are within
    # it: past it no yield brings the class within, and truncating every older result for
    # the one step they are active, only for them to come back whole the next (when they
    # yield first, as the run's), changed cached history twice for nothing (a review). The
    # others are then capped alone.
    counted_pending = pending_results if pending_results < budget.tool_result_tokens else 0
    body = Body(
        budget=budget.body_tokens,
        fixed=fixed,
        # The floor is the history class's: what is paid of it already counts (Rule 4).
        history_floor=max(0, budget.history_tokens - paid_history),
        tool_result_cap=budget.tool_result_tokens,
        pending_result_tokens=counted_pending,
        recall_cap=max(0, CLASS_CAPS["recall"].cap_tokens - corrections),
        knowledge=knowledge,
        recall=recall,
        recall_floor=floor,
        carried_costs=carried.costs,
        run_results=run_results,
        carried_results=None,
        carried_source=carried_results,
        carried_result_tokens=carried.result_tokens_from,
        cut_at=carried.cutter(),
    )
    fits = run_ladder(body)
    cut = body.cut() if fits else len(carried.items)
    dropped = {id(i) for i, _ in knowledge[body.knowledge_kept :]}
    dropped |= {id(i) for i, _ in recall[body.recall_kept :]}
    pointers = {id(t.item): t for t in run_results if t.truncated}
    made = body.carried_results or ()  # None: no carried result was looked at, so none yielded
    # Only those the request carries: a result the ladder truncated before the cut settled
    # past it (an orphan the summary floor split from its call) is not in it at all.
    yielded = tuple(t.carried_index for t in made if t.truncated and t.carried_index >= cut)

    truncated: set[int] = set(carried.excerpted)
    tokens: dict[str, int] = {}
    counts: dict[str, int] = {}

    def emit(row: Row, item: ContextItem, kind: str, spent: int) -> Placed | None:
        if id(item) in dropped:
            return None
        if id(item) in pointers:
            spent = pointers[id(item)].pointer_cost
            item = pointer_for(_as_result(item))
            truncated.add(id(item))
        tokens[kind] = tokens.get(kind, 0) + spent
        counts[kind] = counts.get(kind, 0) + 1
        return (row, item)

    emitted = [
        emit(row, item, kind, c)
        for (row, item), kind, c in zip(others, classes, costs, strict=True)
    ]
    before = [p for p in emitted[: len(head)] if p is not None]
    behind = [p for p in emitted[len(head) :] if p is not None]
    # The carried suffix as derived for this cut and these yields: no per-item work here.
    retained = carried.retained(cut, yielded) if fits else None
    if retained is not None:
        truncated |= retained.pointers
        for kind, n in retained.counts.items():
            tokens[kind] = tokens.get(kind, 0) + retained.tokens[kind]
            counts[kind] = counts.get(kind, 0) + n
    # One pass over the suffix (a list extended and then copied touched each item twice).
    placed = tuple(chain(before, retained.pairs, behind)) if retained is not None else ()
    after = sum(tokens.values()) if fits else body.need()
    report = PressureReport(
        fits=fits,
        steps=tuple(body.steps),
        body_tokens_before=sum(costs) + carried.total,
        body_tokens_after=after,
        body_budget_tokens=budget.body_tokens,
        legacy_tool_excerpts=tuple(i.item_id for i in carried.excerpted_items),
        history_cut_index=skipped + cut,
        history_items_dropped=skipped + cut,
    )
    return Fitted(
        placed=placed,
        truncated=frozenset(truncated),
        report=report,
        usage=_usage(tokens, counts, budget),
        body_tokens=after,
        retained=retained,
        retained_at=len(before),
    )


def window_reach(budget: ContextBudget) -> int:
    """The most tokens any decision about carried history looks at: the larger of the body
    budget and history's floor (core/carried.py leaves what lies beyond it uncosted)."""
    return max(budget.body_tokens, budget.history_tokens)


# --- classification ---------------------------------------------------------------------


def _class_of(row: Row, item: ContextItem) -> str:
    """The budget class of one placed item other than carried history (whose class is
    history, or tool_results for a result: core/carried.py). Exhaustive over rows; an
    unknown row raises."""
    if isinstance(item, ToolResult):
        return "tool_results"
    match row:
        case Row.COMPACTED_SUMMARY:
            return "history"
        case Row.CONVERSATION:
            if isinstance(item, UserMessage):
                return "user_message"  # the run's own user message(s)
            return "history"
        case Row.SKILL_BODIES:
            return "skill_bodies"
        case Row.WORKING_STATE:
            return "working_state"
        case Row.RECALL if isinstance(item, CorrectionLineItem):
            return "corrections"
        case Row.RECALL if isinstance(item, RecallLineItem):
            return "recall"
        case Row.RECALL if isinstance(item, KnowledgePassageItem):
            return "knowledge"
        case Row.RUNTIME_METADATA:
            return "runtime_metadata"
        case Row.USER_INPUT:
            return "user_message"
    raise TypeError(f"no budget class for {type(item).__name__} in row {row.value}")


_PENDING = "active_turn"


def _check_never_yield(
    placed: Sequence[Placed],
    classes: Sequence[str],
    costs: Sequence[int],
    never: Sequence[bool],
    pending_ids: set[int],
    budget: ContextBudget,
) -> None:
    """Raise BUDGET_EXCEEDED when the never-yield set alone exceeds the body.

    The class named is the largest never-yield class (`active_turn` for the active loop's
    turn, `recall` for recall's floor; ties by name): the one whose removal comes closest
    to making the set fit, and the only one whose removal can when any single one can. Not
    "a class over its own cap": the never-yield caps are enforced where those classes are
    admitted, on their own measure (the working state's raw text at render_block, skill
    bodies at load), while the costs here are as rendered (envelope, framing, correction
    factor), so a class within its cap could read as over it and be blamed for a user
    message that is the real overflow.
    """
    totals: dict[str, int] = {}
    for (_, item), kind, tokens, keep in zip(placed, classes, costs, never, strict=True):
        if keep:
            name = _PENDING if id(item) in pending_ids else kind
            totals[name] = totals.get(name, 0) + tokens
    spent = sum(totals.values())
    if spent <= budget.body_tokens:
        return
    offender = max(totals, key=lambda n: (totals[n], n))
    raise BudgetExceededError(
        f"the never-yield set needs {spent} tokens but the body has {budget.body_tokens};"
        f" {offender} alone takes {totals[offender]}",
        metadata={
            "class": offender,
            "class_tokens": str(totals[offender]),
            "never_yield_tokens": str(spent),
            "body_budget_tokens": str(budget.body_tokens),
        },
    )


def _pointer_cost(row: Row, item: ToolResult, cost: Cost) -> int:
    return cost(row, pointer_for(item), True)


def _as_result(item: ContextItem) -> ToolResult:
    assert isinstance(item, ToolResult)
    return item


def _rank(item: ContextItem) -> int:
    return item.rank if isinstance(item, KnowledgePassageItem) else 0


def _usage(
    tokens: dict[str, int], counts: dict[str, int], budget: ContextBudget
) -> tuple[ClassUsage, ...]:
    return tuple(
        _class_usage(name, tokens.get(name, 0), counts.get(name, 0), budget.tool_result_tokens)
        for name, _ in BODY_CLASSES
    )


@lru_cache(maxsize=4096)  # frozen values; a run's Builds repeat most of them
def _class_usage(name: str, tokens: int, items: int, tool_result_tokens: int) -> ClassUsage:
    cap = CLASS_CAPS.get(name)
    cap_tokens = cap.cap_tokens if cap is not None else 0
    if name == "tool_results":
        cap_tokens = tool_result_tokens
    elif name == "corrections":
        cap_tokens = CLASS_CAPS["recall"].cap_tokens  # row 13's, shared with recall (Rule 6)
    return ClassUsage(
        class_name=name,
        tokens=tokens,
        items=items,
        cap_tokens=cap_tokens,
        cap_items=cap.cap_items if cap is not None else 0,
    )
