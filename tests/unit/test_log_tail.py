"""core/log_tail.py: the carried history of a range's newest events, and the count of what
the older ones carry, are what carried_history over the whole range gives, for every way of
reading it (a first page, pages further back, extensions to a later run's seed); and a
Build assembled from the newest pages is the Build assembled from the whole range: the
same request bytes and the same pressure figures (history_items_dropped among them).

The logs are generated messy on purpose: tool pairs far apart (a call, many events, then its
result), call ids reused within and across runs, results without a call, calls never
answered, results that fail, reasoning items, summary floors anywhere (a pair straddling
one included). What the log records with each event is modelled here from its definition
(migrations/0012_history_pairs.sql); tests/integration/test_log_tail.py checks the real
trigger against the same properties.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime

import pytest
from hypothesis import given, settings, target
from hypothesis import strategies as st

from context_engine.core import (
    BudgetExceededError,
    BuildInputs,
    Checkpoint,
    EngineError,
    TrustLevel,
    assemble,
)
from context_engine.core.assemble import Assembled, carried_reaches
from context_engine.core.items import (
    AssistantMessage,
    ConversationItem,
    ReasoningItem,
    SummaryItem,
    ToolCall,
    ToolResult,
    UserMessage,
)
from context_engine.core.log_tail import FloorFacts, Logged, LogTail
from context_engine.core.seeding import carried_history

from .strategies import count_tokens, least_room, messy_logs, small_plan

GATE = settings(max_examples=300, deadline=None)
SECRET = b"t" * 32
NOW = datetime(2026, 3, 1, 12, tzinfo=UTC)


def _text(size: int) -> str:
    return ("lorem ipsum dolor " * (size // 18 + 1))[:size]


# --- generated logs ---------------------------------------------------------------------


def recorded(log: Sequence[ConversationItem]) -> list[Logged]:
    """What the log records with each event (migrations/0012_history_pairs.sql), from its
    definition: a result answers the previous event of its (run, call id) if that is a
    call; the running count adds 1 per message and 2 per result that answers a call."""
    previous: dict[tuple[str, str], ConversationItem] = {}
    total = 0
    out = []
    for item in log:
        answers = None
        if isinstance(item, ToolCall | ToolResult):
            key = (item.run_id, item.call_id)
            before = previous.get(key)
            if isinstance(item, ToolResult) and isinstance(before, ToolCall):
                answers = before.sequence
            previous[key] = item
        if isinstance(item, UserMessage | AssistantMessage):
            total += 1
        elif answers is not None:
            total += 2
        out.append(Logged(item, answers, total))
    return out


def facts(rows: Sequence[Logged], floor: int, below: int) -> FloorFacts:
    """What the store reads at a floor (store/events.py, read_floor_facts), from its rule."""
    at = [r.carried_through for r in rows if r.item.sequence <= floor]
    straddling = sum(
        1
        for r in rows
        if floor < r.item.sequence < below and r.answers is not None and r.answers <= floor
    )
    return FloorFacts(weight=at[-1] if at else 0, straddling=straddling)


def in_range(rows: Sequence[Logged], floor: int, below: int) -> list[Logged]:
    return [r for r in rows if floor < r.item.sequence < below]


def _sequences(draw: st.DrawFn, log: Sequence[ConversationItem], count: int) -> list[int]:
    """`count` sequences in log order to cut at: anywhere in the log, before it or past it."""
    top = (log[-1].sequence if log else 0) + 2
    return sorted(draw(st.lists(st.integers(0, top), min_size=count, max_size=count)))


def _check(tail: LogTail, rows: Sequence[Logged]) -> None:
    """The tail is the whole range's carried history, its newest part as the same objects."""
    whole = carried_history([r.item for r in in_range(rows, tail.floor, tail.below)])
    assert tail.before + len(tail.history) == len(whole)
    assert len(tail.history) == len(whole[tail.before :])
    assert all(a is b for a, b in zip(tail.history, whole[tail.before :], strict=True))
    if tail.complete:
        assert tail.before == 0


def _read(rows: Sequence[Logged], floor: int, below: int, page: int) -> LogTail:
    """As api/log_tail.py reads: the newest `page` events of the range."""
    found = in_range(rows, floor, below)
    newest = found[max(0, len(found) - page) :]
    return LogTail.read(
        floor, below, newest, complete=len(newest) == len(found), facts=facts(rows, floor, below)
    )


def _older(rows: Sequence[Logged], tail: LogTail, page: int) -> LogTail:
    found = in_range(rows, tail.floor, tail.start)
    older = found[max(0, len(found) - page) :]
    return tail.prepended(older, complete=len(older) == len(found))


# --- the tail is the whole range's carried history --------------------------------------


@GATE
@given(st.data())
def test_every_way_of_reading_a_range_carries_what_the_whole_range_carries(
    data: st.DataObject,
) -> None:
    log = data.draw(messy_logs())
    rows = recorded(log)
    floor, *belows = _sequences(data.draw, log, 1 + data.draw(st.integers(1, 3)))
    belows = [max(b, floor) for b in belows]
    tail = _read(rows, floor, belows[0], data.draw(st.integers(1, 8)))
    _check(tail, rows)
    for below in belows[1:]:
        # A later run on the same replica: the events since, and maybe some further back.
        tail = tail.extended(in_range(rows, max(floor, tail.below - 1), below), below)
        _check(tail, rows)
        if not tail.complete and data.draw(st.booleans()):
            tail = _older(rows, tail, data.draw(st.integers(1, 8)))
            _check(tail, rows)
    while not tail.complete:
        tail = _older(rows, tail, data.draw(st.integers(1, 8)))
        _check(tail, rows)
    assert tail.history == carried_history([r.item for r in in_range(rows, floor, tail.below)])


def test_pairs_across_the_read_and_across_the_floor_count_where_seeding_counts_them() -> None:
    """The four ways a pair can lie against the events read and the floor, by hand."""
    u = [
        UserMessage(item_id=f"u{n}", text="q", sequence=s, run_id="r")
        for n, s in enumerate((1, 5, 9))
    ]
    c1 = ToolCall(
        item_id="c1", call_id="a", tool_name="t", arguments_json="{}", sequence=2, run_id="r"
    )
    c2 = ToolCall(
        item_id="c2", call_id="b", tool_name="t", arguments_json="{}", sequence=3, run_id="r"
    )
    dead = ToolCall(
        item_id="c3", call_id="d", tool_name="t", arguments_json="{}", sequence=4, run_id="r"
    )

    def result(item_id: str, call_id: str, sequence: int) -> ToolResult:
        return ToolResult(
            item_id=item_id,
            call_id=call_id,
            tool_name="t",
            content="x",
            trust=TrustLevel.USER,
            sequence=sequence,
            run_id="r",
        )

    r1, r2 = result("r1", "a", 6), result("r2", "b", 8)  # c1 and c2 answered far later
    rows = recorded([u[0], c1, c2, dead, u[1], r1, r2, u[2]])
    # Floor 2: c1 is summarized, so r1 is half a pair; c2 (unread) pairs with r2 (read).
    tail = _read(rows, floor=2, below=10, page=3)  # reads r1, r2, u2
    assert tail.history == (r2, u[2])
    assert tail.before == 2  # c2 and u1: not r1's call, not the dead call
    _check(tail, rows)


def test_a_call_pending_at_one_run_is_carried_once_a_later_run_reads_its_answer() -> None:
    asked = UserMessage(item_id="u1", text="go", sequence=1, run_id="r1")
    call = ToolCall(
        item_id="c1", call_id="k1", tool_name="t", arguments_json="{}", sequence=2, run_id="r1"
    )
    answer = ToolResult(
        item_id="t1",
        call_id="k1",
        tool_name="t",
        content="x",
        trust=TrustLevel.USER,
        sequence=3,
        run_id="r1",
    )
    rows = recorded([asked, call, answer])
    first = _read(rows, floor=0, below=3, page=10)
    assert first.history == (asked,)  # half a pair is not carried (core/seeding.py, Rule 3)
    later = first.extended(rows[2:], below=4)
    assert later.history == (asked, call, answer)
    assert later.history[:2] == (asked, call) and later.history[0] is asked


# --- a Build from the newest pages is the Build from the whole range ---------------------


@dataclass(frozen=True)
class Case:
    log: list[ConversationItem]
    floor: int
    below: int
    run: list[ConversationItem]
    body_room: int
    reserve: int
    pages: list[int]  # the first page, then each page further back


@st.composite
def cases(draw: st.DrawFn) -> Case:
    log = draw(messy_logs(max_events=80))
    top = (log[-1].sequence if log else 0) + 1
    floor = draw(st.sampled_from([0, 0, *(i.sequence for i in log)]))
    below = max(floor + 1, draw(st.integers(1, top)))
    run_id = "current"
    sequence = max(below, top)
    run: list[ConversationItem] = [
        UserMessage(
            item_id="now", text=_text(draw(st.integers(5, 800))), sequence=sequence, run_id=run_id
        )
    ]
    if draw(st.booleans()):
        run += [
            ToolCall(
                item_id="now-c",
                call_id="c0",  # the ids an earlier run used: pairing is per run
                tool_name="web.fetch",
                arguments_json="{}",
                sequence=sequence + 1,
                run_id=run_id,
            ),
            ToolResult(
                item_id="now-r",
                call_id="c0",
                tool_name="web.fetch",
                content=_text(draw(st.sampled_from([10, 3_000]))),
                trust=TrustLevel.EXTERNAL_UNTRUSTED,
                is_error=draw(st.booleans()),
                sequence=sequence + 2,
                run_id=run_id,
            ),
            ReasoningItem(
                item_id="now-rs", provider="anthropic", opaque='{"type":"thinking"}', run_id=run_id
            ),
            AssistantMessage(item_id="now-a", text="Done.", sequence=sequence + 3, run_id=run_id),
        ]
    return Case(
        log=log,
        floor=floor,
        below=below,
        run=run,
        body_room=draw(st.integers(least_room(), 12_000)),
        reserve=draw(st.integers(1, 4_000)),
        pages=draw(st.lists(st.integers(1, 12), min_size=1, max_size=8)),
    )


def _inputs(case: Case, carried: tuple[ConversationItem, ...], before: int) -> BuildInputs:
    prefix = small_plan(200_000, 0, case.reserve, secret=SECRET).prefix_tokens
    summary = SummaryItem(item_id="summary", text="Earlier.") if case.floor else None
    return BuildInputs(
        tenant_id="t",
        plan=small_plan(
            200_000, prefix + case.reserve + case.body_room, case.reserve, secret=SECRET
        ),
        secret=SECRET,
        checkpoint=Checkpoint(
            run_id="current",
            version=1,
            items=tuple(case.run),
            summary=summary,
            replaced_through_sequence=case.floor,
        ),
        carried=carried,
        carried_before=before,
        now=NOW,
        count_tokens=count_tokens,
    )


def _outcome(inputs: BuildInputs) -> Assembled | str:
    try:
        return assemble(inputs)
    except BudgetExceededError as exc:
        return f"budget exceeded: {exc}"


@GATE
@given(cases())
def test_a_build_from_the_newest_pages_is_the_build_from_the_whole_range(case: Case) -> None:
    """Read as a Build reads (the first page, then pages further back until
    carried_reaches), the request bytes, the fit, the yields, the legacy excerpts, the cut
    and the items it drops are those of the whole range's carried history."""
    rows = recorded(case.log)
    whole = carried_history([r.item for r in in_range(rows, case.floor, case.below)])
    reference = _outcome(_inputs(case, whole, 0))

    pages = iter(case.pages)
    tail = _read(rows, case.floor, case.below, next(pages))
    inputs = _inputs(case, tail.history, tail.before)
    try:
        while not carried_reaches(inputs):
            tail = _older(rows, tail, next(pages, 12))
            inputs = replace(inputs, carried=tail.history, carried_before=tail.before)
    except BudgetExceededError as exc:
        assert reference == f"budget exceeded: {exc}"
        return
    # Toward builds whose pages stop well short of the floor (the case this is about).
    target(float(tail.before), label="carried items before the pages read")
    bounded = _outcome(inputs)
    assert bounded == reference
    if isinstance(bounded, Assembled) and isinstance(reference, Assembled):
        assert bounded.request_sha256 == reference.request_sha256
        assert bounded.pressure == reference.pressure  # history_items_dropped included


def test_a_long_session_builds_from_a_few_pages_what_it_builds_from_its_whole_log() -> None:
    """Five hundred turns (user, tool call, result, answer) behind a 16,000-token window:
    the pages a Build reads stop far short of the start, and the request, the fit and the
    items it reports cut are those of the whole log."""
    log: list[ConversationItem] = []
    for t in range(500):
        run, base = f"r{t}", 4 * t
        log += [
            UserMessage(item_id=f"u{t}", text=f"Question {t}?", sequence=base + 1, run_id=run),
            ToolCall(
                item_id=f"c{t}",
                call_id="c1",  # every run reuses the id: pairing is per run
                tool_name="web.fetch",
                arguments_json="{}",
                sequence=base + 2,
                run_id=run,
            ),
            ToolResult(
                item_id=f"t{t}",
                call_id="c1",
                tool_name="web.fetch",
                content=_text(200),
                trust=TrustLevel.EXTERNAL_UNTRUSTED,
                sequence=base + 3,
                run_id=run,
            ),
            AssistantMessage(item_id=f"a{t}", text=f"Answer {t}.", sequence=base + 4, run_id=run),
        ]
    now = UserMessage(item_id="now", text="And now?", sequence=2_001, run_id="current")
    case = Case(log, 0, 2_001, [now], body_room=12_000, reserve=4_000, pages=[64])
    rows = recorded(log)
    reference = _outcome(_inputs(case, carried_history(log), 0))
    tail = _read(rows, 0, 2_001, 64)
    reads = 1
    inputs = _inputs(case, tail.history, tail.before)
    while not carried_reaches(inputs):
        tail, reads = _older(rows, tail, 64 * 4**reads), reads + 1
        inputs = replace(inputs, carried=tail.history, carried_before=tail.before)
    assert tail.before > 500 and reads == 3  # 64, 256 and 1,024 of the 2,000 events
    built = _outcome(inputs)
    assert isinstance(built, Assembled) and isinstance(reference, Assembled)
    assert built == reference
    assert built.pressure is not None and built.pressure.history_items_dropped > 500


def test_assembly_refuses_a_history_that_stops_short_of_the_window() -> None:
    """A shell that hands too little (carried_before > 0, the walk never stopping within
    what it handed) gets an EngineError, never a request cut in the wrong place."""
    item = UserMessage(item_id="u", text="short", sequence=5, run_id="r")
    case = Case(
        log=[],
        floor=0,
        below=10,
        run=[UserMessage(item_id="now", text="q", sequence=10, run_id="c")],
        body_room=4_000,
        reserve=100,
        pages=[1],
    )
    inputs = _inputs(case, (item,), 3)
    assert not carried_reaches(inputs)
    with pytest.raises(EngineError, match="stops short of the window"):
        assemble(inputs)
    assert carried_reaches(replace(inputs, carried_before=0))
