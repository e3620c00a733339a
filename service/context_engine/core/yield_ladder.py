"""The yield ladder: what gives up tokens when the body will not fit, in a fixed order.

Rule 1 (order): knowledge passages, then in-turn recall, then tool results, then history
compaction. Cheapest and most recoverable loss first; the table below is the order, and it
is checked against the caps table's Yields column so the two cannot drift apart.
Rule 2 (no further than needed): a rung yields one unit at a time and stops as soon as its
class is within its cap and the body fits; a later rung never yields for pressure while an
earlier one can still free tokens (a class over its own cap yields regardless). "Fits"
counts carried history at its floor, min(the floor, what it has), the floor being what is
left of 8,000 beside the history already paid (Rule 5), so the cheaper classes yield to
protect the floor and history takes the rest (once the cap pass has pinned the cut, the
history that cut keeps, and what was given up may take the rest). Recall over its cap, and
the run's own tool results where they and the active turn's are over the tool-result cap
(they are in every request), are cut to their caps before any rung yields for pressure:
knowledge (and, for the results' cap, recall) never drops for tokens a cap frees anyway.
Carried results are in the request only above the cut, which the rungs decide, so they are
capped last.
Units yield whole, so the one that makes the body fit can free more than was still over:
what the earlier rungs gave up and now fits comes back (recall, then knowledge,
best-ranked first), so no rung has yielded more than the fit needed; and again after the
cap pass, which pins the history cut it read: what comes back then fits the request that
cut makes, whose results the pass truncated (carried ones too) free room.
Rule 3 (units): a knowledge passage drops whole, lowest-ranked first (a shortened passage
is a misquotation); recall drops its lowest-ranked lines, never below its floor (which
core/pressure.py therefore pays with the never-yield set: a floor that does not fit is
BUDGET_EXCEEDED, never a needs_compaction no compaction could answer); a tool
result becomes a typed pointer, oldest first, keeping its envelope, label, byte count and
artifact reference (the pair stays whole: call and pointer still match). A carried result
truncated for the class cap does not move the history cut: the freed tokens are not spent
on older history, so history stays the recent suffix rather than a run of old pointers;
what the earlier rungs gave up may take them (Rule 2).
Rule 4 (compaction is a write): the last rung only reports; Build never compacts inline.
Rule 5 (what a class holds): the tool-result class is every result in the request, the
active turn's too: those never yield, so while they are in, older results yield to hold
the class within its cap (before context-assembler@20 the cap measured the others alone,
and a request could carry 12,070 tokens of results against a 9,883-token cap). Only while
they alone are within the cap: past it no yield could hold the class, and the others are
capped alone, as before (core/pressure.py passes 0 then). History's
floor is what the carried history must keep of it beside the history already paid (the
summary, the run's own exchanges: core/pressure.py), not 8,000 tokens of carried history
on top of them.
Rule 6 (the run's results move in steps): the results the run's cap truncates are its
oldest, up to a multiple of RUN_CAP_QUANTUM of them (counted by position, whole or not),
the least such that the run's and the active turn's results are within the cap. A tool
loop appends a result a step, and "no further than needed" truncated one more old result
at every step once the run was over its cap: a change early in the run, which the
previous request's cache markers covered, so each such step sent the whole run again
uncached (an audit: 1-3% of a 44k-token request read from cache, against 92% before the
cap bound). In steps, the run's bytes change once every few steps; the quantum's extra
pointers are the run's oldest results, which the model can fetch again. The cap's
second pass (the results in the request) does the same: what it takes of the run's
results goes on to a multiple of RUN_CAP_QUANTUM of them, and of the carried ones up to a
multiple of CARRIED_CAP_QUANTUM session sequences (a position among them would move with
the window and the cut). And oldest first holds across the two passes: once the run's cap
made one of its results a pointer, every carried result in the request (all older) is one
too, whatever room the quantum left: that room otherwise brought earlier runs' results
back whole, one more or fewer each step, and their history re-cached at most steps (a
review: 34 of 39; 10 of 39 now). What a quantum frees past the cap's need is held back
(Truncatable.held, Body.held_back): the fit and the history cut count those results
whole, so the cut
stays where minimal truncation puts it instead of swinging with each quantum (a review:
it moved at every step of a loop whose carried history outgrew its room); the request is
that much under the budget. The second pass stops at a carried result in the request it
may not take (within the cap, not older-first) even where the run's quantum is not
complete: a transient of a result the fit already truncated or that saves nothing. Since
context-assembler@25; the fit (Rule 2) still yields no further than needed, and what is
held back is spent first when the body does not fit with it (since @27: _release_holds).
Changing the order, a unit or a stopping rule changes what a request keeps: bump
core/build_record.py ASSEMBLER_VERSION (its Rule 8), so recorded requests are not rebuilt
by rules they were not cut by.
Cost: a Build may carry tens of thousands of recall lines or tool results, on the event
loop, so the rungs keep running totals rather than re-measuring the body per unit: linear
in the units (the tool-result rung O(n log n), plus one reading of the cut, linear in the
carried items, per run result truncated for the cap, and a measure of the request the
pinned cut makes), with the answer of re-measuring each time
(tests/unit/test_yield_ladder.py compares the two).
"""

from __future__ import annotations

import heapq
from bisect import bisect_left
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from operator import attrgetter

from .caps import CLASS_CAPS, Yields
from .items import ContextItem, ToolResult
from .memo_budget import bounded_cache

__all__ = [
    "CARRIED_CAP_QUANTUM",
    "LADDER",
    "RUN_CAP_QUANTUM",
    "Body",
    "Rung",
    "Truncatable",
    "YieldStep",
    "pointer_for",
    "run_ladder",
    "typed_pointer",
]


@dataclass(frozen=True, slots=True)
class Rung:
    step: str  # the PressureReport step name
    class_name: str  # the caps-table class that yields


LADDER: tuple[Rung, ...] = (
    Rung("drop_knowledge", "knowledge"),
    Rung("trim_recall", "recall"),
    Rung("truncate_tool_results", "tool_results"),
    Rung("compact", "history"),
)

_ORDER = (Yields.FIRST, Yields.SECOND, Yields.THIRD, Yields.FOURTH)
assert [CLASS_CAPS[r.class_name].yields for r in LADDER] == list(_ORDER), (
    "the ladder must follow the caps table's yield order"
)


@dataclass(frozen=True, slots=True)
class YieldStep:
    step: str
    tokens_freed: int
    item_ids: tuple[str, ...]


def typed_pointer(result: ToolResult) -> ToolResult:
    """The typed pointer a truncated result becomes: same call, trust, tool, error flag and
    artifact reference; the content says what existed, how large, and where it lives."""
    size = len(result.content.encode("utf-8"))
    where = f"artifact:{result.artifact_ref}" if result.artifact_ref else f"event {result.sequence}"
    text = (
        f"[truncated] tool.result {result.item_id} {result.tool_name} "
        f"({result.trust.name.lower()}, {size:,} bytes) -> {where}"
    )
    return result.model_copy(update={"content": text, "context_content": ""})


# Memoized for the run's results, which a run's Builds cost and place again each step
# (core/carried.py calls typed_pointer: it keeps its pointers per item content).
pointer_for = bounded_cache(8192)(typed_pointer)


@dataclass(slots=True)
class Truncatable:
    """One tool result the third rung may turn into a pointer."""

    carried_index: int  # index into Body.carried_costs, or -1 for a run result
    full_cost: int
    pointer_cost: int
    item: ContextItem
    truncated: bool = False
    for_cap: bool = False  # truncated to meet the class cap (not for the fit)
    sequence: int = 0  # a carried result's session sequence: where Rule 6 counts it
    # A run result a quantum took past the cap's need: the fit and the cut count it whole
    # (Body.held_back, Rule 6).
    held: bool = False

    @property
    def cost(self) -> int:
        return self.pointer_cost if self.truncated else self.full_cost

    @property
    def saving(self) -> int:
        return self.full_cost - self.pointer_cost


CutAt = Callable[[Sequence[int], int], int]


@dataclass(slots=True)
class Body:
    """The body's yieldable state, in estimated tokens. Mutated only by run_ladder."""

    budget: int  # the body budget (after the margin)
    fixed: int  # never-yield set + summary + the run's non-result items
    history_floor: int
    tool_result_cap: int
    knowledge: list[tuple[ContextItem, int]]  # best-ranked first
    recall: list[tuple[ContextItem, int]]  # best-ranked first
    recall_floor: int  # lines never trimmed, from the best-ranked
    # Each carried item as the cut counts it (oldest first). fit_body hands the carried
    # view's tuple as it is (a Build that yields nothing never copies it); the fit pass
    # makes it a list when it first changes one (_for_pressure).
    carried_costs: Sequence[int]
    run_results: list[Truncatable]  # the run's truncatable results, oldest first
    # Carried results, oldest first; with `carried_source`, made by it on first use (a
    # Build whose body fits without yielding never needs them one by one).
    carried_results: list[Truncatable] | None
    cut_at: CutAt  # (carried costs, history tokens) -> cut index
    carried_source: Callable[[], list[Truncatable]] | None = None
    # Full tokens of the carried results at index >= a cut (none truncated), where known
    # without making them (core/carried.py Segment.result_tokens_from).
    carried_result_tokens: Callable[[int], int] | None = None
    # The active turn's results (never yield, paid in `fixed`): they count toward the
    # tool-result cap, so older results yield to hold the class within it (Rule 5).
    pending_result_tokens: int = 0
    # What of row 13's cap (in-turn recall's 2,000 tokens) recall may hold: the cap less
    # the correction lines, which share the row and never yield (core/pressure.py).
    recall_cap: int = CLASS_CAPS["recall"].cap_tokens
    knowledge_kept: int = 0
    recall_kept: int = 0
    steps: list[YieldStep] = field(default_factory=list)
    # The history cut the cap pass read, which nothing moves after it (None before it):
    # from then on the body is the request that cut makes (`retained_tokens`).
    pinned_cut: int | None = None
    _cut_cache: tuple[tuple[int, ...], int, int] | None = None

    def __post_init__(self) -> None:
        self.knowledge_kept = len(self.knowledge)
        self.recall_kept = len(self.recall)

    def carried(self) -> list[Truncatable]:
        """The carried results, made now if they were left to `carried_source`."""
        if self.carried_results is None:
            assert self.carried_source is not None
            self.carried_results = self.carried_source()
        return self.carried_results

    # --- measures ---------------------------------------------------------------------

    def knowledge_tokens(self) -> int:
        return sum(c for _, c in self.knowledge[: self.knowledge_kept])

    def recall_tokens(self) -> int:
        return sum(c for _, c in self.recall[: self.recall_kept])

    def run_result_tokens(self) -> int:
        return sum(t.cost for t in self.run_results)

    def held_back(self) -> int:
        """What the run's results truncated past the cap's need free (Rule 6's quanta,
        Truncatable.held): paid as if they were whole, so the fit and the history cut
        decide as minimal truncation would rather than swinging with each quantum (a
        review: the cut moved at 39 of 39 steps, 14 before). The request is smaller than
        the budget by at most this."""
        return sum(t.saving for t in self.run_results if t.held)

    def history_total(self) -> int:
        return sum(self.carried_costs)

    def paid(self) -> int:
        """Everything but history; and what the cap's quanta freed past its need
        (held_back): the fit and the cut spend it as if those results were still whole."""
        return (
            self.fixed
            + self.run_result_tokens()
            + self.knowledge_tokens()
            + self.recall_tokens()
            + self.held_back()
        )

    def need(self) -> int:
        """What the body takes: history at its floor; once the cap pass has pinned the cut,
        the carried history that cut keeps, as the request carries it."""
        if self.pinned_cut is not None:
            return self.paid() + self.retained_tokens(self.pinned_cut)
        return self.paid() + min(self.history_floor, self.history_total())

    def fits(self) -> bool:
        return self.need() <= self.budget

    def history_tokens(self) -> int:
        """What the history cut reads: the remainder (>= the floor whenever the body fits,
        until the cap pass pins the cut: what comes back after it may take the rest)."""
        return self.budget - self.paid()

    def cut(self) -> int:
        if self.pinned_cut is not None:
            return self.pinned_cut
        return self.cut_for(tuple(self.carried_costs), self.history_tokens())

    def retained_tokens(self, cut: int) -> int:
        """The carried history from `cut` as the request carries it: a result truncated for
        the cap as its pointer (the cut counts it whole: Rule 3)."""
        capped = sum(
            t.saving for t in self.carried() if t.truncated and t.for_cap and t.carried_index >= cut
        )
        return sum(self.carried_costs[cut:]) - capped

    def cut_for(self, costs: tuple[int, ...], history_tokens: int) -> int:
        """cut() given its inputs, for a caller that keeps them as running totals (measuring
        them costs a pass over the history and the run's results)."""
        # Memoized on its exact inputs: saves time, can never change the answer.
        key = (costs, history_tokens)
        if self._cut_cache is None or self._cut_cache[:2] != key:
            self._cut_cache = (*key, self.cut_at(costs, history_tokens))
        return self._cut_cache[2]

    def results_in_request(self, cut: int) -> list[Truncatable]:
        retained = [t for t in self.carried() if t.carried_index >= cut]
        return retained + self.run_results

    def result_tokens_in_request(self, cut: int) -> int:
        """The tool-result class in the request `cut` makes: the active turn's results and
        sum(t.cost for t in results_in_request(cut)), without making the carried results
        when none has been (so none is truncated) and their tokens are known by cut."""
        pending = self.pending_result_tokens
        if self.carried_results is None and self.carried_result_tokens is not None:
            return self.carried_result_tokens(cut) + self.run_result_tokens() + pending
        return sum(t.cost for t in self.results_in_request(cut)) + pending

    def tool_results_over_cap(self) -> bool:
        return self.result_tokens_in_request(self.cut()) > self.tool_result_cap


@dataclass(slots=True)
class _Yielded:
    """What one rung gave up so far: tokens freed and item ids, in the order yielded, with
    each one's cost and, for a carried result, its index in the carried history (-1
    otherwise)."""

    freed: int = 0
    ids: list[str] = field(default_factory=list)
    costs: list[int] = field(default_factory=list)
    indexes: list[int] = field(default_factory=list)

    def add(self, item_id: str, cost: int, carried_index: int = -1) -> None:
        self.freed += cost
        self.ids.append(item_id)
        self.costs.append(cost)
        self.indexes.append(carried_index)

    def pop(self) -> None:
        self.freed -= self.costs.pop()
        self.ids.pop()
        self.indexes.pop()

    def before_cut(self, cut: int) -> None:
        """Forget the carried results before `cut`: a result truncated before the cut
        settled past it (an orphan a summary floor split from its call) is not in the
        request (core/pressure.py), so neither is its truncation in the report."""
        kept = [n for n, at in enumerate(self.indexes) if not 0 <= at < cut]
        if len(kept) == len(self.ids):
            return
        self.ids = [self.ids[n] for n in kept]
        self.costs = [self.costs[n] for n in kept]
        self.indexes = [self.indexes[n] for n in kept]
        self.freed = sum(self.costs)

    def step(self, name: str) -> YieldStep | None:
        return YieldStep(name, self.freed, tuple(self.ids)) if self.ids else None


# Rule 6: the run's results the cap truncates, a multiple of this many (by position); and
# the carried results, up to a multiple of this many session sequences (a tool exchange
# logs two or three events: some three or four results).
RUN_CAP_QUANTUM = 4
CARRIED_CAP_QUANTUM = 8


def run_ladder(body: Body) -> bool:
    """Yield in the ladder's order, no further than needed but for the tool-result cap's
    quanta (Rule 6). Returns whether the body fits; the steps taken are appended to
    body.steps."""
    if _nothing_yields(body):
        return True  # most Builds: every rung would stop before it starts
    results = _cap_run_results(body)
    recall = _cap_recall(body)
    knowledge = _cap_knowledge(body)
    _release_holds(body)
    _drop_knowledge(body, knowledge)
    _trim_recall(body, recall)
    _truncate_for_fit(body, results)
    if body.fits():
        _take_back(body, knowledge, recall)
        # Oldest first (Rule 6): once the run's cap made one of its results a pointer, the
        # carried results in the request, all older, go too.
        older = any(t.for_cap for t in body.run_results)
        if older or body.tool_results_over_cap():
            _cap_results_in_request(body, results, older_first=older)
            # The results it truncated lower what the request takes, with the cut it pinned.
            _take_back(body, knowledge, recall)
    fits = body.fits()
    if fits:
        results.before_cut(body.cut())
    steps = (knowledge.step("drop_knowledge"), recall.step("trim_recall"))
    body.steps += [s for s in (*steps, results.step("truncate_tool_results")) if s is not None]
    if not fits:
        body.steps.append(YieldStep("compact", 0, ()))
        return False
    return True


def _nothing_yields(body: Body) -> bool:
    """Whether every rung's stopping condition holds before it starts, so run_ladder would
    yield nothing and find the body fitting: the run's results and the active turn's
    within the tool-result cap
    (_cap_run_results), recall within its cap (_cap_recall, _trim_recall), knowledge
    within its caps and the body fitting with history at its floor (_drop_knowledge, and
    then no rung yields for the fit), and the results in the request within the cap (no
    cap pass). Each measure is taken once here; the rungs take them again as they go, a
    pass over the carried history each time."""
    knowledge_cap = CLASS_CAPS["knowledge"]
    run, recall = body.run_result_tokens(), body.recall_tokens()
    knowledge = body.knowledge_tokens()
    if run + body.pending_result_tokens > body.tool_result_cap or recall > body.recall_cap:
        return False
    if len(body.knowledge) > knowledge_cap.cap_items or knowledge > knowledge_cap.cap_tokens:
        return False
    paid = body.fixed + run + knowledge + recall
    if paid + min(body.history_floor, body.history_total()) > body.budget:
        return False
    return not body.tool_results_over_cap()


def _cap_knowledge(body: Body) -> _Yielded:
    """Drop the lowest-ranked passages until knowledge is within its class cap, which is
    absolute: what _release_holds then judges is the body as the request can carry it (a
    review: top-five retrieval released the holds for two passages the cap dropped anyway,
    and the cut moved). Reported with the knowledge rung's step."""
    cap = CLASS_CAPS["knowledge"]
    dropped = _Yielded()
    kept = body.knowledge_tokens()
    while body.knowledge_kept > 0 and (
        body.knowledge_kept > cap.cap_items or kept > cap.cap_tokens
    ):
        body.knowledge_kept -= 1
        item, cost = body.knowledge[body.knowledge_kept]
        kept -= cost
        dropped.add(item.item_id, cost)
    return dropped


def _drop_knowledge(body: Body, dropped: _Yielded) -> None:
    """For the fit, adding to what _cap_knowledge dropped: one step reports both."""
    # Running totals, not the measures: only knowledge_kept moves here, and re-summing the
    # kept passages per dropped one made the rung quadratic. Same integers, same answer.
    kept = body.knowledge_tokens()
    rest = body.need() - kept  # what fits() counts besides the kept passages
    while body.knowledge_kept > 0 and rest + kept > body.budget:
        body.knowledge_kept -= 1
        item, cost = body.knowledge[body.knowledge_kept]
        kept -= cost
        dropped.add(item.item_id, cost)


def _cap_recall(body: Body) -> _Yielded:
    """Trim recall's lowest-ranked lines, never below its floor, until it is within its
    class cap. Its cap is absolute, so however the rungs yield the request holds no more
    than this: trimming first is what keeps knowledge from dropping for tokens the cap
    frees anyway (as _cap_run_results does for the run's results). Reported with the
    recall rung's step."""
    cap = body.recall_cap
    kept = body.recall_tokens()
    trimmed = _Yielded()
    while body.recall_kept > body.recall_floor and kept > cap:
        body.recall_kept -= 1
        item, cost = body.recall[body.recall_kept]
        kept -= cost
        trimmed.add(item.item_id, cost)
    return trimmed


def _trim_recall(body: Body, trimmed: _Yielded) -> None:
    """For the fit (and the cap, which _cap_recall has met already), adding to what
    _cap_recall trimmed before knowledge yielded: one step reports both."""
    # One pass with running totals (as _drop_knowledge): re-summing the kept lines for every
    # dropped one was quadratic in the recall lines, on the event loop (25,000 lines: 9 s).
    kept = body.recall_tokens()
    rest = body.need() - kept  # what fits() counts besides the kept lines
    while body.recall_kept > body.recall_floor and (
        kept > body.recall_cap or rest + kept > body.budget
    ):
        body.recall_kept -= 1
        item, cost = body.recall[body.recall_kept]
        kept -= cost
        trimmed.add(item.item_id, cost)


def _quantum_edge(count: int, quantum: int) -> int:
    """`count` rounded up to a multiple of `quantum` (Rule 6)."""
    return -(-count // quantum) * quantum


def _cap_run_results(body: Body) -> _Yielded:
    """Truncate the run's results, oldest first, until they and the active turn's are within
    the class cap, and on to the next multiple of RUN_CAP_QUANTUM of them (Rule 6).

    They are in every request (the run is never cut), so whatever history the cut keeps,
    the cap takes at least these: doing it before the rungs yield for pressure is what keeps
    knowledge and recall from dropping for tokens the cap frees anyway. Carried results are
    in the request only above the cut, which the rungs decide; they are capped afterwards.
    Reported with the tool-result rung's step.
    """
    total = body.run_result_tokens() + body.pending_result_tokens
    truncated = _Yielded()
    for n, candidate in enumerate(body.run_results):
        if total <= body.tool_result_cap and n % RUN_CAP_QUANTUM == 0:
            break
        if candidate.truncated or candidate.saving <= 0:
            continue
        # Past the need, the quantum's: the cut does not spend it.
        candidate.held = total <= body.tool_result_cap
        candidate.truncated = candidate.for_cap = True
        total -= candidate.saving
        truncated.add(candidate.item.item_id, candidate.saving)
    return truncated


def _release_holds(body: Body) -> None:
    """Before anything yields for the fit, spend what the cap's quanta hold back (Rule 6),
    oldest first, until the body fits: those results are pointers already, so this changes
    no byte sent, only where the cut may go. Held, a body that fitted only with it dropped
    a passage, truncated a newer result or asked for a compaction, for a request that
    fitted as it stood (an audit: 7 of 3,000 generated sessions)."""
    for held in [t for t in body.run_results if t.held]:  # fewer than RUN_CAP_QUANTUM
        if body.fits():
            return
        held.held = False


def _truncate_for_fit(body: Body, truncated: _Yielded) -> None:
    """Oldest first, for the fit, adding to what _cap_run_results truncated before the
    rungs ran (one step reports both)."""
    for chosen in _for_pressure(body):
        chosen.truncated = True
        truncated.add(chosen.item.item_id, chosen.saving, chosen.carried_index)


def _take_back(body: Body, dropped: _Yielded, trimmed: _Yielded) -> None:
    """Re-admit what the earlier rungs gave up and the body now has room for: recall lines,
    then knowledge passages (the reverse of the order they yielded in), each best-ranked
    first, stopping at the first that does not fit again or would break its class cap.

    A rung yields whole units, so the unit that made the body fit can free more than was
    still over: a recall line trimmed after the passages were dropped, or a result made a
    pointer (whole) after both. What yielded before it was then given up for nothing ("no
    more than necessary"). Left out, a roomier body could keep fewer passages than a tighter
    one whose smaller tool-result cap (25% of the body) had made the same result a pointer
    before knowledge yielded. Only what did not fit comes back, so the kept lines and
    passages stay the best-ranked, and the rungs' steps report the net. Before the cap pass
    the last unit a rung gave up for the fit never comes back (without it the body did not
    fit), and a later rung still yields only once the earlier ones, fully yielded, could not
    make it fit.

    After the cap pass the room is the request's with the cut it pinned (Body.need): the
    results it truncated, carried ones too, free room for what was given up, and the
    history the request keeps stays what the pass read (its results were chosen from it).
    Recall lines come back first there too, so where a line and a passage compete for that
    room the line takes it (context-assembler@7 let the passage back instead, where the
    line's cost would have moved the cut it held).
    """
    if not (dropped.ids or trimmed.ids):
        return  # most Builds: nothing yielded, and measuring the room is a pass over the body
    room = body.budget - body.need()  # what fits() still allows
    knowledge = CLASS_CAPS["knowledge"]
    for units, given_up, kept_field, cap_items, cap_tokens in (
        (body.recall, trimmed, "recall_kept", 0, body.recall_cap),
        (body.knowledge, dropped, "knowledge_kept", knowledge.cap_items, knowledge.cap_tokens),
    ):
        kept = getattr(body, kept_field)
        tokens = sum(c for _, c in units[:kept])
        while given_up.ids and (cap_items == 0 or kept < cap_items):
            item, cost = units[kept]
            if cost > room or tokens + cost > cap_tokens:
                break
            kept, tokens, room = kept + 1, tokens + cost, room - cost
            _give_back(given_up, item.item_id, cost)
        setattr(body, kept_field, kept)


def _give_back(yielded: _Yielded, item_id: str, cost: int) -> None:
    # The best-ranked of those a rung gave up is the one it gave up last.
    assert yielded.ids[-1] == item_id and yielded.costs[-1] == cost
    yielded.pop()


_CARRIED_INDEX = attrgetter("carried_index")


def _cap_results_in_request(body: Body, truncated: _Yielded, *, older_first: bool = False) -> None:
    """While the results in the request are over the class cap, truncate the oldest of
    them that is whole and saves something (for_cap), adding to `truncated`, and on to
    each kind's quantum edge; and with `older_first` (the run's cap truncated one of its
    results), every carried result in the request whatever the total: each is older than
    that result (Rule 6).

    Truncating for the cap never changes whether the body fits (it only lowers what is
    paid), nor the carried costs the cut reads: a carried result truncated for the cap
    stays where the cut counts it. But a run result truncated lowers what is paid, so the
    history the cut keeps may grow (the cut only moves earlier: more room keeps more
    history), and the carried results it brings in are in the request: they count toward
    the cap, and being older than every result still waiting, they are the next to go.
    Measured only at the pass's start, the pass stopped short of the cap once a truncated
    run result let a carried one in, and never truncated it (a 155-token request against a
    cap of 50, the result worth 100 left whole). One queue and a running total take
    exactly the results a re-scan of the request after every truncation takes
    (tests/unit/test_yield_ladder.py: the reference ladder). The cut is read again only
    after a run result, the one truncation that can move it, and from running totals: the
    history's costs stay put, its allowance grows by the result's saving. Measuring both
    per run result re-summed the run's results: quadratic (2,000: 4 million additions).
    The pass ends by pinning the cut it read (Body.pinned_cut): what comes back after it
    is admitted into that request's room, never by moving the cut.
    """
    costs = tuple(body.carried_costs)
    allowance = body.history_tokens()
    cut = body.cut_for(costs, allowance)
    waiting = deque(body.results_in_request(cut))  # oldest first
    total = sum(t.cost for t in waiting) + body.pending_result_tokens
    # Rule 6: what this pass takes goes on to a quantum's edge: of the run's results by
    # position, as the run's cap does; of the carried ones by session sequence, which,
    # unlike a position among them, no window or cut moves.
    position = {id(t): n for n, t in enumerate(body.run_results)}
    edges = {True: 0, False: 0}  # carried (a sequence), run (a position)
    while waiting:
        candidate = waiting[0]  # the oldest result in the request
        saving, older = candidate.saving, candidate.carried_index >= 0
        if candidate.truncated or saving <= 0:
            waiting.popleft()
            continue
        at = candidate.sequence if older else position[id(candidate)]
        if not (total > body.tool_result_cap or (older_first and older) or at < edges[older]):
            break
        waiting.popleft()
        needed = total > body.tool_result_cap
        candidate.truncated = candidate.for_cap = True
        total -= saving
        truncated.add(candidate.item.item_id, saving, candidate.carried_index)
        quantum = CARRIED_CAP_QUANTUM if older else RUN_CAP_QUANTUM
        edges[older] = max(edges[older], _quantum_edge(at + 1, quantum))
        if older:
            continue
        if not needed:  # a quantum's: held back from the cut, which stays where it is
            candidate.held = True
            continue
        allowance += saving
        if (moved := body.cut_for(costs, allowance)) < cut:
            carried = body.carried()  # oldest first, so the newly kept are one slice
            first = bisect_left(carried, moved, key=_CARRIED_INDEX)
            brought = carried[first : bisect_left(carried, cut, key=_CARRIED_INDEX)]
            waiting.extendleft(reversed(brought))
            total += sum(t.cost for t in brought)
            cut = moved
    body.pinned_cut = cut  # the request the pass chose its results from


def _for_pressure(body: Body) -> Iterator[Truncatable]:
    """The results to truncate for the fit, in order: each time the oldest result whose
    truncation lowers what the body needs, until it fits or none does. Carried results are
    older than every result of the run; the caller marks each one truncated.

    A run result always lowers the need. A carried one lowers it only while history is
    within its floor after the saving (beyond the floor it frees nothing the fit counts):
    saving > history - floor. History only shrinks here, so a carried result once eligible
    stays so, and an earlier one may become eligible after a later one's truncation: the
    eligible are kept in a heap by age and admitted largest saving first. Running totals
    and the heap make this O(n log n); re-scanning the results and re-summing the body per
    truncation was quadratic (4,000 results: 7 s on the event loop).
    """
    floor = body.history_floor
    paid, history = body.paid(), body.history_total()
    if paid + min(floor, history) <= body.budget:
        return  # it fits: nothing is truncated for the fit
    carried = [t for t in body.carried() if not t.truncated and t.saving > 0]
    by_saving = sorted(range(len(carried)), key=lambda n: -carried[n].saving)
    admitted = 0
    eligible: list[int] = []  # indices into `carried`, a heap: the oldest first
    run = (t for t in body.run_results if not t.truncated and t.saving > 0)
    while paid + min(floor, history) > body.budget:
        while admitted < len(by_saving) and carried[by_saving[admitted]].saving > history - floor:
            heapq.heappush(eligible, by_saving[admitted])
            admitted += 1
        if eligible:
            chosen = carried[heapq.heappop(eligible)]
            costs = body.carried_costs
            if not isinstance(costs, list):  # the view's tuple until now (Body.carried_costs)
                costs = body.carried_costs = list(costs)
            history -= costs[chosen.carried_index] - chosen.pointer_cost
            costs[chosen.carried_index] = chosen.pointer_cost
        else:
            # No carried result can help now, nor later: only carried truncations move
            # history. The run's results go oldest first.
            next_run = next(run, None)
            if next_run is None:
                return
            chosen = next_run
            paid -= chosen.saving
        yield chosen
