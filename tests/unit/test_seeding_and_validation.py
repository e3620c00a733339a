"""What a run carries from the session, and the validators that keep tool pairs whole.

carried_history: reasoning items never cross a run boundary; half a tool pair is not
carried; everything else keeps its order. validate_append and validate_tool_pairs: a call
and its result are one unit, at append time and before a request leaves.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import UTC, datetime

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from context_engine.core import (
    Block,
    Checkpoint,
    InvalidFieldError,
    Message,
    PlanSpec,
    PreconditionError,
    RequestError,
    Row,
    TrustLevel,
    assemble,
    carried_history,
    seed_cut,
)
from context_engine.core.items import (
    AssistantMessage,
    Attachment,
    ConversationItem,
    DelegatedMessage,
    ReasoningItem,
    ToolCall,
    ToolResult,
    UserMessage,
    trust_of,
)
from context_engine.core.seeding import delegated, instruction_item_id
from context_engine.core.spec import PlatformPolicySpec
from context_engine.core.validate import (
    ClosedRun,
    closed_run,
    validate_append,
    validate_block_runs,
    validate_tool_pairs,
)

from .strategies import (
    SCENARIO_SETTINGS,
    SETTINGS,
    Ledger,
    Scenario,
    run_items,
    scenarios,
    session_logs,
)


def _pairing_violations(items: Sequence[tuple[str, str]]) -> list[str]:
    """Strict pairing over (kind, call_id) in order: every call answered exactly once by a
    later result, no call id pending twice, no result without a pending call."""
    pending: set[str] = set()
    problems: list[str] = []
    for kind, call_id in items:
        if kind == "call":
            if call_id in pending:
                problems.append(f"call {call_id} issued while already pending")
            pending.add(call_id)
        elif kind == "result":
            if call_id not in pending:
                problems.append(f"result {call_id} without a pending call")
            pending.discard(call_id)
    problems += [f"call {c} never answered" for c in sorted(pending)]
    return problems


def _item_pairs(items: Sequence[ConversationItem]) -> list[tuple[str, str]]:
    return [
        ("call" if isinstance(i, ToolCall) else "result", i.call_id)
        for i in items
        if isinstance(i, ToolCall | ToolResult)
    ]


def _block_pairs(messages: Sequence[Message]) -> list[tuple[str, str]]:
    return [
        ("call" if b.kind == "tool_call" else "result", b.call_id)
        for m in messages
        for b in m.blocks
        if b.kind in ("tool_call", "tool_result")
    ]


# --- carried_history ---------------------------------------------------------------------


@SETTINGS
@given(session_logs(reasoning=True, dangling=True, max_runs=4))
def test_carried_history_drops_reasoning_and_half_pairs_and_keeps_order(
    log: list[ConversationItem],
) -> None:
    carried = carried_history(log)
    answered = {i.call_id for i in log if isinstance(i, ToolResult)}
    expected = tuple(
        i
        for i in log
        if not isinstance(i, ReasoningItem)
        and not (isinstance(i, ToolCall) and i.call_id not in answered)
    )
    assert carried == expected
    assert not any(isinstance(i, ReasoningItem) for i in carried)
    assert _pairing_violations(_item_pairs(carried)) == []
    sequences = [i.sequence for i in carried]
    assert sequences == sorted(set(sequences)) and all(s > 0 for s in sequences)
    assert carried_history(carried) == carried


def test_carried_history_examples() -> None:
    u1 = UserMessage(item_id="u1", text="a", sequence=1, run_id="r1")
    rs = ReasoningItem(item_id="rs", provider="anthropic", opaque="{}", run_id="r1")
    c1 = ToolCall(
        item_id="c1", call_id="k1", tool_name="t", arguments_json="{}", sequence=2, run_id="r1"
    )
    t1 = ToolResult(
        item_id="t1",
        call_id="k1",
        tool_name="t",
        content="x",
        trust=TrustLevel.EXTERNAL_UNTRUSTED,
        sequence=3,
        run_id="r1",
    )
    a1 = AssistantMessage(item_id="a1", text="done", sequence=4, run_id="r1")
    u2 = UserMessage(item_id="u2", text="b", sequence=5, run_id="r2")
    died = ToolCall(
        item_id="c2", call_id="k2", tool_name="t", arguments_json="{}", sequence=6, run_id="r2"
    )
    stray = ToolResult(
        item_id="t9",
        call_id="k9",
        tool_name="t",
        content="?",
        trust=TrustLevel.PLATFORM,
        sequence=7,
        run_id="r2",
    )
    assert carried_history([u1, rs, c1, t1, a1, u2, died, stray]) == (u1, c1, t1, a1, u2)
    assert carried_history([]) == ()


def test_carried_history_pairs_calls_within_their_own_run() -> None:
    """Call ids are unique per run only (validate_append checks "in this run"), so a run
    that died with call k1 pending and a later run that reused k1 must not make the dead
    call look answered. (The fake provider's ids restart per instance: call_fake000001.)"""
    log = [
        UserMessage(item_id="u1", text="a", sequence=1, run_id="r1"),
        ToolCall(
            item_id="r1-c",
            call_id="call_fake000001",
            tool_name="t",
            arguments_json="{}",
            sequence=2,
            run_id="r1",
        ),
        UserMessage(item_id="u2", text="b", sequence=3, run_id="r2"),
        ToolCall(
            item_id="r2-c",
            call_id="call_fake000001",
            tool_name="t",
            arguments_json="{}",
            sequence=4,
            run_id="r2",
        ),
        ToolResult(
            item_id="r2-t",
            call_id="call_fake000001",
            tool_name="t",
            content="ok",
            trust=TrustLevel.EXTERNAL_UNTRUSTED,
            sequence=5,
            run_id="r2",
        ),
    ]
    carried = carried_history(log)
    assert "r1-c" not in [i.item_id for i in carried]
    assert _pairing_violations(_item_pairs(carried)) == []


def test_no_request_carries_a_dead_runs_call_whose_id_was_reused() -> None:
    """Tool-pair integrity gate end to end: seed from such a log and build."""
    log = [
        UserMessage(item_id="u1", text="a", sequence=1, run_id="r1"),
        ToolCall(
            item_id="r1-c",
            call_id="call_1",
            tool_name="t",
            arguments_json="{}",
            sequence=2,
            run_id="r1",
        ),
        UserMessage(item_id="u2", text="b", sequence=3, run_id="r2"),
        ToolCall(
            item_id="r2-c",
            call_id="call_1",
            tool_name="t",
            arguments_json="{}",
            sequence=4,
            run_id="r2",
        ),
        ToolResult(
            item_id="r2-t",
            call_id="call_1",
            tool_name="t",
            content="ok",
            trust=TrustLevel.EXTERNAL_UNTRUSTED,
            sequence=5,
            run_id="r2",
        ),
        AssistantMessage(item_id="r2-a", text="done", sequence=6, run_id="r2"),
    ]
    current = UserMessage(item_id="u3", text="c", sequence=7, run_id="r3")
    sc = Scenario(
        spec=PlanSpec(model_id="m", policy=PlatformPolicySpec(version="v", text="p")),
        secret=b"s" * 32,
        checkpoint=Checkpoint(run_id="r3", version=1, items=(current,)),
        carried=carried_history([i for i in log if i.sequence < seed_cut(current.sequence)]),
        now=datetime(2026, 1, 1, tzinfo=UTC),
    )
    # It builds (a refusal here passed the gate, whatever assembly did: an audit): the
    # dead run's lone call is not carried, the later run's pair is, whole.
    assembled = assemble(sc.inputs())
    assert assembled.request is not None
    assert _pairing_violations(_block_pairs(assembled.request.messages)) == []
    ids = {b.item_id for m in assembled.request.messages for b in m.blocks}
    assert {"r2-c", "r2-t"} <= ids and "r1-c" not in ids


# --- seed_cut ----------------------------------------------------------------------------


@given(st.integers(min_value=0, max_value=2**62))
def test_seed_cut_is_the_pinned_sequence(sequence: int) -> None:
    assert seed_cut(sequence) == sequence


@SETTINGS
@given(session_logs(reasoning=True, dangling=True))
def test_a_child_run_seeds_from_nothing(log: list[ConversationItem]) -> None:
    assert seed_cut(None) == 0
    below = [i for i in log if i.sequence < seed_cut(None)]
    assert below == []
    assert carried_history(below) == ()


def test_a_childs_user_messages_are_read_as_its_parents_and_nothing_else_changes() -> None:
    """Rule 4: a child's instruction, and a user message added to it later, are its parent
    agent's words (MODEL); every field is kept, the model's own items are the same objects,
    and a checkpoint with no user message is returned as it is."""
    asked = UserMessage(item_id=instruction_item_id("c"), text="Find hotels", run_id="c")
    answer = AssistantMessage(item_id="a", text="Searching.", sequence=4, run_id="c")
    more = UserMessage(
        item_id="u",
        text="Under 120 euros",
        sequence=5,
        run_id="c",
        attachments=(Attachment(kind="image", ref="blob:1"),),
    )
    read = delegated((asked, answer, more))
    assert [type(i) for i in read] == [DelegatedMessage, AssistantMessage, DelegatedMessage]
    assert read[1] is answer
    assert [i.model_dump() for i in read] == [i.model_dump() for i in (asked, answer, more)]
    assert {trust_of(i) for i in (read[0], read[2])} == {TrustLevel.MODEL}
    assert delegated(read) == read and delegated((answer,)) == (answer,)
    assert asked.item_id == "instruction:c"


@SETTINGS
@given(session_logs(reasoning=False, dangling=True))
def test_a_top_level_run_seeds_strictly_below_its_own_message(log: list[ConversationItem]) -> None:
    logged = [i for i in log if i.sequence]
    current = UserMessage(
        item_id="current", text="now", sequence=(logged[-1].sequence if logged else 0) + 1
    )
    below = [i for i in [*log, current] if i.sequence and i.sequence < seed_cut(current.sequence)]
    assert current not in below
    assert below == logged


# --- validate_append ---------------------------------------------------------------------


@st.composite
def _runs(draw: st.DrawFn) -> list[ConversationItem]:
    mode = draw(st.sampled_from(["fresh", "loop", "answered", "dangling"]))
    return draw(run_items(Ledger(), None, "r", mode))


@SETTINGS
@given(_runs(), st.data())
def test_a_well_formed_run_appends_cleanly_at_any_split(
    items: list[ConversationItem], data: st.DataObject
) -> None:
    cut = data.draw(st.integers(0, len(items)))
    validate_append(items[:cut], items[cut:])


def _call(item_id: str, call_id: str) -> ToolCall:
    return ToolCall(item_id=item_id, call_id=call_id, tool_name="t", arguments_json="{}")


def _result(item_id: str, call_id: str) -> ToolResult:
    return ToolResult(
        item_id=item_id,
        call_id=call_id,
        tool_name="t",
        content="x",
        trust=TrustLevel.EXTERNAL_UNTRUSTED,
    )


_U = UserMessage(item_id="u", text="hi")


@pytest.mark.parametrize(
    ("existing", "new", "field", "reason", "words"),
    [
        pytest.param(
            [_U],
            [AssistantMessage(item_id="a", text="x"), _result("t", "k1")],
            "items[1].tool_result.call_id",
            "ORPHANED_TOOL_ITEM",
            "has no call",
            id="result-without-call",
        ),
        pytest.param(
            [_U, _call("c", "k1"), _result("t", "k1")],
            [_result("t2", "k1")],
            "items[0].tool_result.call_id",
            "ORPHANED_TOOL_ITEM",
            "already answered",
            id="result-for-answered-call",
        ),
        pytest.param(
            [_U],
            [_call("c1", "k1"), _result("t1", "k1"), _result("t2", "k1")],
            "items[2].tool_result.call_id",
            "ORPHANED_TOOL_ITEM",
            "already answered",
            id="second-result-in-one-append",
        ),
        pytest.param(
            [_U],
            [_call("c1", "k1"), _result("t1", "k1"), _call("c2", "k1")],
            "items[2].tool_call.call_id",
            "INVALID_FIELD",
            "already used",
            id="duplicate-call-id-in-append",
        ),
        pytest.param(
            [_U, _call("c1", "k1")],
            [_result("t1", "k1"), _call("c2", "k1")],
            "items[1].tool_call.call_id",
            "INVALID_FIELD",
            "already used",
            id="duplicate-call-id-against-existing",
        ),
        pytest.param(
            [_U],
            [AssistantMessage(item_id="u", text="x")],
            "items[0].item_id",
            "INVALID_FIELD",
            "already used",
            id="duplicate-item-id-against-existing",
        ),
        pytest.param(
            [_U],
            [_call("c1", "k1"), _result("c1", "k1")],
            "items[1].item_id",
            "INVALID_FIELD",
            "already used",
            id="duplicate-item-id-in-append",
        ),
        pytest.param(
            [_U, _call("c1", "k1"), _call("c2", "k2"), _result("t1", "k1")],
            [AssistantMessage(item_id="a", text="one answered, going on")],
            "items[0]",
            "ORPHANED_TOOL_ITEM",
            "'k2' has no result",
            id="next-turn-with-a-call-unanswered",
        ),
        pytest.param(
            [_U],
            [_call("c1", "k1"), _call("c2", "k2"), _result("t2", "k2"), _call("c3", "k3")],
            "items[3]",
            "ORPHANED_TOOL_ITEM",
            "'k1' has no result",
            id="next-turn-in-one-append",
        ),
        pytest.param(
            [_U, _call("c1", "k1")],
            [_result("t1", "k1").model_copy(update={"tool_name": "clock.now"})],
            "items[0].tool_result.tool_name",
            "INVALID_FIELD",
            "the call called 't'",
            id="result-naming-another-tool",
        ),
    ],
)
def test_validate_append_rejects_with_the_field_path_and_reason(
    existing: list[ConversationItem],
    new: list[ConversationItem],
    field: str,
    reason: str,
    words: str,
) -> None:
    with pytest.raises(InvalidFieldError) as caught:
        validate_append(existing, new)
    error = caught.value
    assert isinstance(error, RequestError)
    assert (error.field, error.reason) == (field, reason)
    assert words in error.message


def test_a_result_that_names_no_tool_is_logged_with_its_calls_name() -> None:
    """The envelope names a result's source by its tool: one sent without the name takes
    its call's (in the append or before it), and the rest pass as they are."""
    unnamed = _result("t1", "k1").model_copy(update={"tool_name": ""})
    other = ToolCall(item_id="c2", call_id="k2", tool_name="web.fetch", arguments_json="{}")
    logged = validate_append(
        [_U, _call("c1", "k1")],
        [unnamed, other, _result("t2", "k2").model_copy(update={"tool_name": ""})],
    )
    assert [getattr(i, "tool_name", None) for i in logged] == ["t", "web.fetch", "web.fetch"]
    assert logged[1] is other


def test_a_turn_goes_on_while_its_calls_wait_and_inputs_come_in_any_order() -> None:
    """Only a new model turn waits for the last one's results: the turn itself may go on
    after its calls (text, another call), and a user's message may come among results."""
    late = AssistantMessage(item_id="a2", text="still this turn")
    validate_append([_U, _call("c1", "k1")], [late, _call("c2", "k2")])
    validate_append(
        [_U, _call("c1", "k1"), _call("c2", "k2"), _result("t1", "k1")],
        [UserMessage(item_id="u2", text="also this"), _result("t2", "k2"), late],
    )


@SETTINGS
@given(_runs(), st.data())
def test_validate_append_names_the_offending_index(
    items: list[ConversationItem], data: st.DataObject
) -> None:
    cut = data.draw(st.integers(0, len(items)))
    existing, new = items[:cut], list(items[cut:])
    at = data.draw(st.integers(0, len(new)))
    bad = data.draw(st.sampled_from(["orphan", "dup-id"]))
    if bad == "orphan":
        new.insert(at, _result("stray", "no-such-call"))
        field, reason = f"items[{at}].tool_result.call_id", "ORPHANED_TOOL_ITEM"
    else:
        # A user message: it may come anywhere (a model item among a turn's results is
        # refused for that first).
        new.insert(at, UserMessage(item_id=items[0].item_id, text="again"))
        # The error names the later of the two items sharing the id.
        later = at if (cut > 0 or at > 0) else 1
        field, reason = f"items[{later}].item_id", "INVALID_FIELD"
    with pytest.raises(InvalidFieldError) as caught:
        validate_append(existing, new)
    assert (caught.value.field, caught.value.reason) == (field, reason)


# --- validate_tool_pairs -----------------------------------------------------------------


def _call_block(call_id: str, run_id: str = "") -> Block:
    return Block(
        Row.CONVERSATION,
        TrustLevel.MODEL,
        "tool_call",
        f"c-{call_id}",
        call_id=call_id,
        tool_name="t",
        arguments_json="{}",
        run_id=run_id,
    )


def _result_block(call_id: str, run_id: str = "") -> Block:
    return Block(
        Row.CONVERSATION,
        TrustLevel.EXTERNAL_UNTRUSTED,
        "tool_result",
        f"t-{call_id}",
        text="x",
        call_id=call_id,
        tool_name="t",
        run_id=run_id,
    )


def _messages(*groups: tuple[str, list[Block]]) -> tuple[Message, ...]:
    return tuple(Message(role, tuple(blocks)) for role, blocks in groups)  # type: ignore[arg-type]


def test_validate_tool_pairs_accepts_complete_pairs() -> None:
    validate_tool_pairs(
        _messages(
            ("assistant", [_call_block("a"), _call_block("b")]),
            ("user", [_result_block("b"), _result_block("a")]),
        )
    )


@pytest.mark.parametrize(
    ("messages", "call_id"),
    [
        pytest.param(_messages(("assistant", [_call_block("a")])), "a", id="pending-call"),
        pytest.param(
            _messages(("assistant", [_call_block("b"), _call_block("a")]), ("user", [])),
            "a",
            id="two-pending-names-the-first-sorted",
        ),
        pytest.param(_messages(("user", [_result_block("a")])), "a", id="result-without-call"),
        pytest.param(
            _messages(("user", [_result_block("a")]), ("assistant", [_call_block("a")])),
            "a",
            id="result-before-its-call",
        ),
        pytest.param(
            _messages(
                ("assistant", [_call_block("a")]),
                ("user", [_result_block("a")]),
                ("user", [_result_block("a")]),
            ),
            "a",
            id="answered-twice",
        ),
    ],
)
def test_validate_tool_pairs_rejects_orphans(messages: tuple[Message, ...], call_id: str) -> None:
    with pytest.raises(PreconditionError) as caught:
        validate_tool_pairs(messages)
    assert caught.value.reason == "ORPHANED_TOOL_ITEM"
    assert caught.value.metadata == {"call_id": call_id}


def test_validate_tool_pairs_rejects_a_call_id_pending_twice() -> None:
    """Two calls with one id and one result: one call is unanswered."""
    messages = _messages(
        ("assistant", [_call_block("a")]),
        ("user", [Block(Row.CONVERSATION, TrustLevel.USER, "text", "u", text="more")]),
        ("assistant", [_call_block("a")]),
        ("user", [_result_block("a")]),
    )
    with pytest.raises(PreconditionError) as caught:
        validate_tool_pairs(messages)
    assert caught.value.reason == "ORPHANED_TOOL_ITEM"


def test_validate_tool_pairs_pairs_by_run_and_call_id() -> None:
    """Call ids are unique within a run only: two runs' pending `call_0`s are two pairs,
    and one run's result never answers the other run's call."""
    validate_tool_pairs(
        _messages(
            ("assistant", [_call_block("call_0", "run-a"), _call_block("call_0", "run-b")]),
            ("user", [_result_block("call_0", "run-b"), _result_block("call_0", "run-a")]),
        )
    )
    with pytest.raises(PreconditionError) as caught:
        validate_tool_pairs(
            _messages(
                ("assistant", [_call_block("call_0", "run-a")]),
                ("user", [_result_block("call_0", "run-b")]),
            )
        )
    assert caught.value.metadata == {"call_id": "call_0"}


_BLOCKS = st.lists(
    st.tuples(st.booleans(), st.sampled_from("abc"), st.sampled_from(["", "run-2"])).map(
        lambda t: _call_block(t[1], t[2]) if t[0] else _result_block(t[1], t[2])
    ),
    max_size=10,
)


def _outcome(check: Callable[[], None]) -> str:
    try:
        check()
    except PreconditionError as error:
        return f"{error.reason} {error.metadata}"
    return "ok"


@settings(max_examples=400, deadline=None)
@given(st.lists(_BLOCKS, min_size=1, max_size=4), st.data())
def test_validating_in_runs_with_closed_runs_skipped_is_validating_the_whole(
    runs: list[list[Block]], data: st.DataObject
) -> None:
    """Assembly validates a request as runs of blocks, passing over a carried suffix whose
    pairs close on their own (validate.ClosedRun): the same verdict, naming the same call,
    as walking every block."""
    given_runs: list[Sequence[Block] | ClosedRun] = []
    for run in runs:
        closed = closed_run(run)
        given_runs.append(closed if closed is not None and data.draw(st.booleans()) else run)
    whole = _messages(("user", [b for run in runs for b in run]))
    assert _outcome(lambda: validate_block_runs(given_runs)) == _outcome(
        lambda: validate_tool_pairs(whole)
    )


def test_assemble_refuses_a_run_with_a_pending_call() -> None:
    items = (
        UserMessage(item_id="u1", text="go", sequence=1),
        ToolCall(item_id="c1", call_id="k1", tool_name="t", arguments_json="{}", sequence=2),
    )
    sc = Scenario(
        spec=PlanSpec(model_id="m", policy=PlatformPolicySpec(version="v", text="p")),
        secret=b"s" * 32,
        checkpoint=Checkpoint(run_id="r", version=1, items=items),
        carried=(),
        now=datetime(2026, 1, 1, tzinfo=UTC),
    )
    with pytest.raises(PreconditionError) as caught:
        assemble(sc.inputs())
    assert caught.value.reason == "ORPHANED_TOOL_ITEM"
    assert caught.value.metadata == {"call_id": "k1"}


@SCENARIO_SETTINGS
@given(scenarios(modes=("fresh", "loop", "answered")))
def test_no_assembled_request_has_an_unpaired_tool_item(sc: Scenario) -> None:
    assembled = assemble(sc.inputs())
    assert _pairing_violations(_block_pairs(assembled.request.messages)) == []
    # Every call's result is in the very next message (what Anthropic requires).
    messages = assembled.request.messages
    for n, message in enumerate(messages):
        calls = {b.call_id for b in message.blocks if b.kind == "tool_call"}
        if calls:
            following = messages[n + 1].blocks if n + 1 < len(messages) else ()
            assert calls <= {b.call_id for b in following if b.kind == "tool_result"}
