"""The fifteen-row order, the two regions, and trust labels on every placed item.

Region A (rows 1-8) lives only in `request.system` and `request.tools`; Region B (rows
9-15) only in `request.messages`, in row order, with the run's exchanges before the fresh
rows 11-14 and an unanswered user message last.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any, ClassVar

import pytest
from hypothesis import given

from context_engine.core import (
    Assembled,
    Checkpoint,
    EngineError,
    PlanSpec,
    Region,
    Row,
    StepContext,
    TrustLevel,
    assemble,
    split_run_items,
)
from context_engine.core.assemble import active_turn
from context_engine.core.envelope import item_nonce
from context_engine.core.items import (
    AssistantMessage,
    ContextItem,
    ConversationItem,
    DelegatedMessage,
    KnowledgePassageItem,
    ReasoningItem,
    RecallLineItem,
    RuntimeMetadataItem,
    SnapshotItem,
    SummaryItem,
    ToolCall,
    ToolDefinitionItem,
    ToolResult,
    UserMessage,
    check_placement,
    trust_of,
)
from context_engine.core.rows import ROW_TABLE, ROWS
from context_engine.core.spec import PlatformPolicySpec
from context_engine.providers import render

from .strategies import SCENARIO_SETTINGS, Scenario, scenarios

_ORDER = {spec.row: n for n, spec in enumerate(ROWS)}
_MODEL_OUTPUT = (AssistantMessage, ToolCall, ReasoningItem)
_FRESH_ROWS = {Row.SKILL_BODIES, Row.WORKING_STATE, Row.RECALL, Row.RUNTIME_METADATA}


def _blocks(assembled: Assembled) -> list[Any]:
    return [b for m in assembled.request.messages for b in m.blocks]


def _index(assembled: Assembled, item: ContextItem) -> int:
    matches = [n for n, (_, placed) in enumerate(assembled.placed) if placed is item]
    assert len(matches) == 1, (item.item_id, matches)
    return matches[0]


# --- order, regions, trust over generated builds ------------------------------------------


@SCENARIO_SETTINGS
@given(scenarios(carried_reasoning=True))
def test_rows_are_in_table_order_and_regions_are_where_they_belong(sc: Scenario) -> None:
    plan = sc.plan()
    assembled = assemble(sc.inputs(plan))
    rows = [row for row, _ in assembled.placed]
    assert [_ORDER[r] for r in rows] == sorted(_ORDER[r] for r in rows)

    # Region B: one block per placed item, same order, same rows, only in messages.
    blocks = _blocks(assembled)
    assert [(b.row, b.item_id) for b in blocks] == [(r, i.item_id) for r, i in assembled.placed]
    for row, item in assembled.placed:
        assert ROW_TABLE[row].region is Region.BODY
        assert type(item).REGION is Region.BODY
        assert row in type(item).ROWS
    # Region A: only in system and tools, exactly as the plan rendered it.
    request = assembled.request
    assert all(ROW_TABLE[b.row].region is Region.PREFIX for b in request.system)
    assert request.system == tuple(b.to_block() for b in plan.system)
    assert [t.name for t in request.tools] == list(plan.tool_names)
    # The whole definitions, not their names alone: a description that changed with the
    # conversation passed this gate (an audit).
    assert [(t.name, t.description, t.input_schema_json) for t in request.tools] == [
        (t.name, t.description, t.input_schema_json) for t in plan.tools
    ]
    assert [_ORDER[b.row] for b in request.system] == sorted(_ORDER[b.row] for b in request.system)
    assert request.system[0].row is Row.PLATFORM_POLICY
    assert request.system[1].row is Row.FRAMING

    # Exactly one runtime row; messages alternate roles after merging.
    assert rows.count(Row.RUNTIME_METADATA) == 1
    roles = [m.role for m in request.messages]
    assert all(a != b for a, b in itertools.pairwise(roles))
    placed = iter(assembled.placed)
    for message in request.messages:
        for _ in message.blocks:
            _, item = next(placed)
            assert (message.role == "assistant") is isinstance(item, _MODEL_OUTPUT), item


@SCENARIO_SETTINGS
@given(scenarios(), scenarios())
def test_region_a_is_the_plans_whatever_the_conversation(one: Scenario, other: Scenario) -> None:
    """Prefix stability: one plan built against two generated conversations (histories,
    runs, steps, skill bodies, working states) sends the same system blocks and tool
    definitions, and the provider payload renders them the same. Determinism compared the
    tools only between builds of one conversation, so a description that changed with the
    conversation passed every gate (an audit)."""
    plan = one.plan()
    first = assemble(one.inputs(plan)).request
    second = assemble(other.inputs(plan)).request
    assert first is not None and second is not None
    assert first.system == second.system == tuple(b.to_block() for b in plan.system)
    assert first.tools == second.tools
    rendered = [json.loads(render(r).body) for r in (first, second)]
    assert rendered[0].get("tools") == rendered[1].get("tools")
    if plan.provider == "anthropic":
        # The system blocks, but for where the cache markers land (a request's own).
        unmarked = [
            [{k: v for k, v in b.items() if k != "cache_control"} for b in r["system"]]
            for r in rendered
        ]
        assert unmarked[0] == unmarked[1]


@SCENARIO_SETTINGS
@given(scenarios(carried_reasoning=True))
def test_every_block_carries_its_items_trust(sc: Scenario) -> None:
    plan = sc.plan()
    assembled = assemble(sc.inputs(plan))
    for (row, item), block in zip(assembled.placed, _blocks(assembled), strict=True):
        assert block.trust is trust_of(item)
        if ROW_TABLE[row].trust is not None:
            assert block.trust is ROW_TABLE[row].trust
        if isinstance(item, ToolResult | KnowledgePassageItem):
            assert block.trust is item.trust
    for block in assembled.request.system:
        fixed = ROW_TABLE[block.row].trust
        if fixed is not None:
            assert block.trust is fixed
    skills = {f"skill:{s.name}": s.trust for s in sc.spec.skills}
    for block in assembled.request.system:
        if block.row is Row.SKILL_CATALOG:
            assert block.trust is skills[block.item_id]


# --- where the run's own items go ---------------------------------------------------------


@SCENARIO_SETTINGS
@given(scenarios(modes=("fresh",)))
def test_a_fresh_run_puts_its_user_message_last_after_row_14(sc: Scenario) -> None:
    (user,) = sc.checkpoint.items
    assembled = assemble(sc.inputs())
    (row_last, last), (row_before, before) = assembled.placed[-1], assembled.placed[-2]
    assert (row_last, last) == (Row.USER_INPUT, user)
    assert row_before is Row.RUNTIME_METADATA and isinstance(before, RuntimeMetadataItem)
    final = assembled.request.messages[-1]
    assert final.role == "user"
    assert (final.blocks[-1].row, final.blocks[-1].item_id) == (Row.USER_INPUT, user.item_id)
    assert [
        i for r, i in assembled.placed if isinstance(i, UserMessage) and r is Row.USER_INPUT
    ] == [user]


@SCENARIO_SETTINGS
@given(scenarios(modes=("loop",)))
def test_a_tool_loop_keeps_its_user_message_before_the_fresh_rows(sc: Scenario) -> None:
    items = sc.checkpoint.items
    original = items[0]
    assert isinstance(original, UserMessage)
    last_result = max(n for n, i in enumerate(items) if isinstance(i, ToolResult))
    supplemental = list(items[last_result + 1 :])
    assert all(isinstance(i, UserMessage) for i in supplemental)

    assembled = assemble(sc.inputs())
    placed_rows = dict((id(i), r) for r, i in assembled.placed)
    assert placed_rows[id(original)] is Row.CONVERSATION
    first_fresh = min(n for n, (r, _) in enumerate(assembled.placed) if r in _FRESH_ROWS)
    # The original message and every call/result exchange precede rows 11-14.
    for item in items[: last_result + 1]:
        if isinstance(item, ReasoningItem) and id(item) not in placed_rows:
            continue  # an earlier turn's reasoning, dropped (tested below)
        assert placed_rows[id(item)] is Row.CONVERSATION
        assert _index(assembled, item) < first_fresh
    # Supplemental input stays last, in order, in row 15.
    tail = assembled.placed[len(assembled.placed) - len(supplemental) :] if supplemental else []
    assert [i for _, i in tail] == supplemental
    assert all(r is Row.USER_INPUT for r, _ in tail)
    if not supplemental:
        assert assembled.placed[-1][0] is Row.RUNTIME_METADATA


def _spec() -> PlanSpec:
    return PlanSpec(model_id="m", policy=PlatformPolicySpec(version="v1", text="policy"))


def _scenario(items: tuple[ConversationItem, ...], **kwargs: Any) -> Scenario:
    return Scenario(
        spec=_spec(),
        secret=b"s" * 32,
        checkpoint=Checkpoint(run_id="r", version=1, items=items),
        carried=kwargs.pop("carried", ()),
        now=datetime(2026, 1, 1, 12, tzinfo=UTC),
        step=StepContext(recall=(RecallLineItem(item_id="recall-1", text="likes tea"),)),
        **kwargs,
    )


_U1 = UserMessage(item_id="u1", text="find the invoice", sequence=10, run_id="r")
_C1 = ToolCall(
    item_id="c1", call_id="call_1", tool_name="mail.search", arguments_json="{}", sequence=11
)
_R1 = ToolResult(
    item_id="t1",
    call_id="call_1",
    tool_name="mail.search",
    content="invoice #7",
    trust=TrustLevel.EXTERNAL_UNTRUSTED,
    sequence=12,
)
_U2 = UserMessage(item_id="u2", text="also the receipt", sequence=13, run_id="r")


def _layout(assembled: Assembled) -> list[tuple[int, str]]:
    return [(int(r), i.item_id) for r, i in assembled.placed]


def test_the_fresh_rows_follow_the_exchange_on_every_step() -> None:
    step1 = assemble(_scenario((_U1,)).inputs())
    assert _layout(step1) == [(13, "recall-1"), (14, "runtime"), (15, "u1")]

    step2 = assemble(_scenario((_U1, _C1, _R1)).inputs())
    assert _layout(step2) == [(10, "u1"), (10, "c1"), (10, "t1"), (13, "recall-1"), (14, "runtime")]
    roles = [(m.role, [b.item_id for b in m.blocks]) for m in step2.request.messages]
    assert roles == [
        ("user", ["u1"]),
        ("assistant", ["c1"]),
        ("user", ["t1", "recall-1", "runtime"]),
    ]

    step3 = assemble(_scenario((_U1, _C1, _R1, _U2)).inputs())
    assert _layout(step3) == [
        (10, "u1"),
        (10, "c1"),
        (10, "t1"),
        (13, "recall-1"),
        (14, "runtime"),
        (15, "u2"),
    ]


def test_split_run_items_keeps_only_the_unanswered_suffix_as_trailing_input() -> None:
    assert split_run_items((_U1,)) == ((), (_U1,))
    assert split_run_items((_U1, _C1, _R1)) == ((_U1, _C1, _R1), ())
    assert split_run_items((_U1, _C1, _R1, _U2)) == ((_U1, _C1, _R1), (_U2,))
    assert split_run_items(()) == ((), ())


# --- reasoning -----------------------------------------------------------------------------


def _latest_turn_reasoning(items: tuple[ConversationItem, ...]) -> list[str]:
    """The reasoning ids replayed: those of the latest model turn that sent output (a
    call, or text that is not blank) and of the latest model turn, a model turn being a
    contiguous stretch of model output in the run's completed items; with no turn that
    sent output, the latest turn's."""
    completed, _ = split_run_items(items)
    turns: list[tuple[int, int]] = []
    for n, item in enumerate(completed):
        if isinstance(item, _MODEL_OUTPUT):
            if turns and turns[-1][1] == n:
                turns[-1] = (turns[-1][0], n + 1)
            else:
                turns.append((n, n + 1))
    if not turns:
        return []

    def sent(turn: tuple[int, int]) -> bool:
        return any(
            isinstance(i, ToolCall) or (isinstance(i, AssistantMessage) and i.text.strip())
            for i in completed[turn[0] : turn[1]]
        )

    output = next((t for t in reversed(turns) if sent(t)), turns[-1])
    kept = sorted({*range(*output), *range(turns[-1][0], len(completed))})
    return [completed[n].item_id for n in kept if isinstance(completed[n], ReasoningItem)]


@SCENARIO_SETTINGS
@given(scenarios(modes=("loop", "answered"), carried_reasoning=True))
def test_only_the_latest_model_turns_reasoning_is_replayed(sc: Scenario) -> None:
    assembled = assemble(sc.inputs())
    replayed = [b.item_id for b in _blocks(assembled) if b.kind == "reasoning"]
    assert replayed == _latest_turn_reasoning(sc.checkpoint.items)
    carried_reasoning = {i.item_id for i in sc.carried if isinstance(i, ReasoningItem)}
    assert not carried_reasoning & set(replayed)
    for block in _blocks(assembled):
        if block.kind == "reasoning":
            assert block.trust is TrustLevel.MODEL and block.opaque and not block.text


def test_a_turn_of_reasoning_alone_keeps_the_reasoning_of_the_turn_before_it() -> None:
    """A model turn that sent reasoning alone (thinking cut off at max_tokens, an empty
    end_turn) was taken for the latest, and the tool loop's turn before it lost its
    reasoning: its call went to Anthropic without the thinking that must lead it, and every
    later request of the run was refused (a review). The turn that sent output keeps it;
    blank text is no output."""

    def thinking(item_id: str) -> ReasoningItem:
        return ReasoningItem(
            item_id=item_id,
            provider="anthropic",
            opaque=f'{{"type":"thinking","thinking":"t","signature":"{item_id}"}}',
        )

    blank = AssistantMessage(item_id="blank", text="  ", sequence=16)
    nudge = UserMessage(item_id="u3", text="Go on.", sequence=17)
    for items, replayed in (
        ((_U1, thinking("s1"), _C1, _R1, thinking("s2")), ["s1", "s2"]),
        ((_U1, thinking("s1"), _C1, _R1, thinking("s2"), blank, _U2), ["s1", "s2"]),
        # The turns between keep none: no provider replays them (a review: counted, they
        # filled the body for good).
        ((_U1, thinking("s1"), _C1, _R1, thinking("s2"), nudge, thinking("s3")), ["s1", "s3"]),
    ):
        assembled = assemble(_scenario(items).inputs())
        assert [b.item_id for b in _blocks(assembled) if b.kind == "reasoning"] == replayed
        assert _latest_turn_reasoning(items) == replayed
        # The tool loop's turn stays the active one: compaction stops before it (a review:
        # a cut through it dropped the thinking its call must follow).
        assert active_turn(items)[:2] == (items[1], _C1)


def test_reasoning_of_earlier_turns_and_earlier_runs_is_dropped() -> None:
    def reasoning(item_id: str) -> ReasoningItem:
        return ReasoningItem(
            item_id=item_id, provider="openai", opaque=f'{{"id":"{item_id}","type":"reasoning"}}'
        )

    earlier_run = (
        UserMessage(item_id="old-u", text="hi", sequence=1, run_id="r0"),
        reasoning("old-rs"),
        AssistantMessage(item_id="old-a", text="hello", sequence=2, run_id="r0"),
    )
    c2 = ToolCall(item_id="c2", call_id="call_2", tool_name="t", arguments_json="{}", sequence=14)
    r2 = ToolResult(
        item_id="t2",
        call_id="call_2",
        tool_name="t",
        content="x",
        trust=TrustLevel.PLATFORM,
        sequence=15,
    )
    items = (_U1, reasoning("rs-1"), _C1, _R1, reasoning("rs-2a"), c2, reasoning("rs-2b"), r2)
    assembled = assemble(_scenario(items, carried=earlier_run).inputs())
    replayed = [b.item_id for b in _blocks(assembled) if b.kind == "reasoning"]
    assert replayed == ["rs-2a", "rs-2b"]
    # Supplemental input after the loop does not change which turn is the latest.
    assembled = assemble(_scenario((*items, _U2), carried=earlier_run).inputs())
    assert [b.item_id for b in _blocks(assembled) if b.kind == "reasoning"] == ["rs-2a", "rs-2b"]


# --- the region-assignment table is enforced ---------------------------------------------


class _Undeclared(ContextItem):
    text: str = ""


class _NoTrust(ContextItem):
    REGION: ClassVar[Region] = Region.BODY
    ROWS: ClassVar[frozenset[Row]] = frozenset({Row.RECALL})
    text: str = ""


class _UserTrustedRuntime(ContextItem):
    REGION: ClassVar[Region] = Region.BODY
    ROWS: ClassVar[frozenset[Row]] = frozenset({Row.RUNTIME_METADATA})
    FIXED_TRUST: ClassVar[TrustLevel | None] = TrustLevel.USER
    text: str = ""


class _OwnTrustRuntime(ContextItem):
    """Per-item trust in a row that requires one: the verdict turns on the item's field."""

    REGION: ClassVar[Region] = Region.BODY
    ROWS: ClassVar[frozenset[Row]] = frozenset({Row.RUNTIME_METADATA})
    FIXED_TRUST: ClassVar[TrustLevel | None] = None
    trust: TrustLevel = TrustLevel.PLATFORM


class _DeclaredButUnrenderable(ContextItem):
    REGION: ClassVar[Region] = Region.BODY
    ROWS: ClassVar[frozenset[Row]] = frozenset({Row.RECALL})
    FIXED_TRUST: ClassVar[TrustLevel | None] = TrustLevel.MEMORY
    text: str = ""


@pytest.mark.parametrize("row", list(Row))
def test_check_placement_refuses_an_item_class_that_declares_nothing(row: Row) -> None:
    with pytest.raises(EngineError, match="declares no REGION, ROWS, FIXED_TRUST"):
        check_placement(_Undeclared(text="x"), row)
    with pytest.raises(EngineError, match="declares no FIXED_TRUST"):
        check_placement(_NoTrust(text="x"), row)


def _wrong_rows() -> Iterator[tuple[ContextItem, Row]]:
    user = UserMessage(item_id="u", text="x")
    snapshot = SnapshotItem(item_id="m", text="x")
    tool = ToolDefinitionItem(item_id="t", name="t", description="", input_schema_json="{}")
    summary = SummaryItem(text="s")
    for row in Row:
        for item in (user, snapshot, tool, summary):
            if row not in type(item).ROWS:
                yield item, row


@pytest.mark.parametrize(("item", "row"), list(_wrong_rows()))
def test_check_placement_refuses_an_item_in_the_wrong_row(item: ContextItem, row: Row) -> None:
    with pytest.raises(EngineError):
        check_placement(item, row)


def test_check_placement_accepts_every_declared_row_and_refuses_a_trust_mismatch() -> None:
    check_placement(UserMessage(item_id="u", text="x"), Row.CONVERSATION)
    check_placement(UserMessage(item_id="u", text="x"), Row.USER_INPUT)
    check_placement(SnapshotItem(item_id="m", text="x"), Row.MEMORY_SNAPSHOT)
    with pytest.raises(EngineError, match="row 14 requires PLATFORM, got USER"):
        check_placement(_UserTrustedRuntime(text="x"), Row.RUNTIME_METADATA)


def _placements() -> Iterator[tuple[ContextItem, Row]]:
    """Every item class (this file's undeclared and mismatched ones too) in every row, at
    every trust level where the item carries its own."""
    classes, pending = [], list(ContextItem.__subclasses__())
    while pending:
        cls = pending.pop()
        classes.append(cls)
        pending += cls.__subclasses__()
    for cls in classes:
        trusts = list(TrustLevel) if "trust" in cls.model_fields else [None]
        for trust in trusts:
            item = cls.model_construct(trust=trust) if trust is not None else cls.model_construct()
            for row in Row:
                yield item, row


def _verdict(check: object, item: ContextItem, row: Row) -> str:
    try:
        check(item, row)  # type: ignore[operator]
    except EngineError as refused:
        return str(refused)
    return "passed"


def test_a_remembered_placement_is_the_verdict_of_checking_it_afresh() -> None:
    """check_placement remembers a placement that passed by (class, row, trust field):
    over every class, row and trust, its verdict, first and again, is the full check's,
    and a refusal is never remembered."""
    from context_engine.core import items as items_module

    items_module._PASSED.clear()
    verdicts = [
        (_verdict(check_placement, item, row), _verdict(check_placement, item, row))
        for item, row in _placements()
    ]
    expected = [_verdict(items_module._check_placement, item, row) for item, row in _placements()]
    assert [first for first, _ in verdicts] == expected
    assert [again for _, again in verdicts] == expected
    assert "passed" in expected and any(v != "passed" for v in expected)
    own = [
        (item.trust, first)  # type: ignore[attr-defined]
        for (item, row), (first, _) in zip(_placements(), verdicts, strict=True)
        if isinstance(item, _OwnTrustRuntime) and row is Row.RUNTIME_METADATA
    ]
    assert own[0] == (TrustLevel.PLATFORM, "passed")
    assert all(verdict != "passed" for trust, verdict in own if trust is not TrustLevel.PLATFORM)


def test_a_childs_message_is_the_parents_in_the_user_role_in_its_own_envelope() -> None:
    """core/trust.py, Rule 2: a child run's instruction is the run's user-role opening
    turn, answered (row 10) or not (row 15), but at MODEL trust in a <delegated> envelope
    with its item's nonce: neither bare (the platform's voice) nor <user> (the user's)."""
    secret = b"s" * 32
    asked = DelegatedMessage(item_id="instruction:r", text="find the invoice", run_id="r")
    check_placement(asked, Row.USER_INPUT)
    check_placement(asked, Row.CONVERSATION)
    for items, row in (((asked,), Row.USER_INPUT), ((asked, _C1, _R1), Row.CONVERSATION)):
        assembled = assemble(_scenario(items).inputs())
        block = next(b for b in _blocks(assembled) if b.item_id == asked.item_id)
        assert (block.row, block.trust) == (row, TrustLevel.MODEL)
        nonce = item_nonce(secret, asked.item_id)
        assert block.text == (
            f'<delegated source="parent agent" id="instruction:r" nonce="{nonce}">\n'
            f"find the invoice\n</delegated:{nonce}>"
        )
        asking = next(m for m in assembled.request.messages if block in m.blocks)
        assert asking.role == "user"


@pytest.mark.parametrize(
    "smuggled",
    [
        _Undeclared(item_id="rogue", text="x"),
        _NoTrust(item_id="rogue", text="x"),
        SnapshotItem(item_id="memory:x", text="Region A item in Region B"),
        UserMessage(item_id="u-x", text="a user message is not a recall line"),
    ],
)
def test_assemble_refuses_a_misplaced_item_before_rendering(smuggled: ContextItem) -> None:
    sc = _scenario((_U1,))
    with pytest.raises(EngineError):
        assemble(sc.inputs(step=StepContext(recall=(smuggled,))))  # type: ignore[arg-type]


def test_assemble_raises_on_an_item_type_it_cannot_render() -> None:
    sc = _scenario((_U1,))
    rogue = _DeclaredButUnrenderable(item_id="rogue", text="x")
    with pytest.raises(TypeError, match="no Region B renderer"):
        assemble(sc.inputs(step=StepContext(recall=(rogue,))))  # type: ignore[arg-type]


# --- untrusted tool output stays in its envelope -------------------------------------------

CANARY = "CANARY-5b0e1f9c-untrusted-payload"


def _with_canary(item: ConversationItem) -> ConversationItem:
    if isinstance(item, ToolResult) and item.trust is TrustLevel.EXTERNAL_UNTRUSTED:
        return item.model_copy(
            update={
                "content": item.content + CANARY + item.content,
                "context_content": item.context_content and CANARY + item.context_content,
            }
        )
    return item


def _strings(value: Any, path: str = "") -> Iterator[tuple[str, str]]:
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _strings(v, f"{path}.{k}")
    elif isinstance(value, list):
        for n, v in enumerate(value):
            yield from _strings(v, f"{path}[{n}]")
    elif isinstance(value, str):
        yield path, value


@SCENARIO_SETTINGS
@given(scenarios(modes=("loop",)))
def test_untrusted_tool_output_appears_only_inside_its_envelope(sc: Scenario) -> None:
    items = list(sc.checkpoint.items)
    first = next(n for n, i in enumerate(items) if isinstance(i, ToolResult))
    items[first] = items[first].model_copy(update={"trust": TrustLevel.EXTERNAL_UNTRUSTED})
    checkpoint = sc.checkpoint.model_copy(update={"items": tuple(_with_canary(i) for i in items)})
    carried = tuple(_with_canary(i) for i in sc.carried)
    assembled = assemble(sc.inputs(checkpoint=checkpoint, carried=carried))

    expected = {
        i.item_id
        for r, i in assembled.placed
        if isinstance(i, ToolResult) and i.trust is TrustLevel.EXTERNAL_UNTRUSTED
    }
    assert expected
    seen = set()
    for path, text in _strings(assembled.request.canonical()):
        if CANARY not in text:
            continue
        assert path.startswith(".messages[") and path.endswith(".text"), path
    for block in _blocks(assembled):
        if CANARY not in block.text:
            continue
        assert block.kind == "tool_result" and block.trust is TrustLevel.EXTERNAL_UNTRUSTED
        nonce = item_nonce(sc.secret, block.item_id)
        head, sep, _ = block.text.partition(">\n")
        assert head.startswith("<untrusted ") and CANARY not in head and sep
        assert block.text.endswith(f"\n</untrusted:{nonce}>")
        assert block.text.count(f"</untrusted:{nonce}>") == 1
        inside = block.text[len(head) + 2 : -len(f"\n</untrusted:{nonce}>")]
        assert block.text.count(CANARY) == inside.count(CANARY) >= 1
        seen.add(block.item_id)
    assert seen == expected
