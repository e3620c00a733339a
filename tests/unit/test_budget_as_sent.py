"""Budget conformance measured independently of the engine's estimator (an audit: the gate
in test_budget.py missed an estimator that ignored the factor, or left a call's arguments
or a result's text uncounted, and a budget without its 5% margin).

test_budget.py's conformance gate measures the assembled body with the engine's own
`block_tokens` at the pinned factor, so an estimator bug (the factor ignored, a block
field left uncounted) moves the engine and the gate together and passes. Here the body is
measured as it is sent: the request is rendered by its provider's adapter
(providers.render) and the texts the model reads in the payload's messages are counted
with the test's own raw counter, the correction factor applied by the test.

What is counted, and why it is a lower bound of what a correct engine must estimate
(core/body_estimate.py Rules 1, 2 and 6):

* every text the payload's messages carry: text blocks, tool-call ids, wire names and
  arguments, tool-result ids and content (with the failed-call line where the provider
  sends it), and Anthropic's no-tools text form of a pair as one string. Each comes from
  one neutral block whose estimate counts the same pieces or more (the form's fixed words,
  the "-99" suffix, a result's tool name and artifact reference, a failed line the
  provider sends as a field), and the counter rounds up per text, so a joined string
  never counts more than its pieces (ceil is subadditive). Left out: reasoning payloads
  (replayed opaque), the system blocks and tools (the prefix, counted exactly at plan
  time) and Anthropic's placeholder turn (the request framing, outside the body);
* the factor once over the whole sum, rounded up: never more than the engine's per-block
  rounding up (a sum of ceilings is at least the ceiling of the sum);
* MESSAGE_FRAMING_TOKENS per message the payload sends (an Anthropic turn, an OpenAI
  input item), where the engine charges it per block: every such message holds at least
  one block of its own (OpenAI sends one input item per block).

So a correct engine's estimate is never below this measure, and it is within the body
budget. The budget is computed here from the plan's figures (window, policy cap, output
reserve, exact prefix) with the allocator's spec (core/budget.py: the reserve off the
top, the request framing and a 5% margin off what the prefix leaves), not by allocate().
Attachments (none here) are outside the measure; the estimate's 5% margin for what Rule 6
leaves uncounted (a displaced pair's words, Rule 9 of providers/anthropic.py) does not
arise in these sessions, whose pairs are never split by another run's turn."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from context_engine.core import (
    BudgetExceededError,
    BuildInputs,
    Checkpoint,
    ContextPlan,
    ModelFacts,
    PlanReason,
    PlanSpec,
    StepContext,
    TrustLevel,
    assemble,
    make_plan,
)
from context_engine.core.caps import HISTORY_FLOOR_TOKENS
from context_engine.core.enums import SideEffect
from context_engine.core.errors import InvalidFieldError
from context_engine.core.estimator import MESSAGE_FRAMING_TOKENS, REQUEST_FRAMING_TOKENS
from context_engine.core.fixed_texts import HISTORY_CUT_PLACEHOLDER
from context_engine.core.items import (
    AssistantMessage,
    ConversationItem,
    CorrectionLineItem,
    KnowledgePassageItem,
    RecallLineItem,
    SummaryItem,
    ToolCall,
    ToolResult,
    UserMessage,
    WorkingStateItem,
)
from context_engine.core.request import ModelRequest
from context_engine.core.spec import AgentSpec, PlatformPolicySpec, ToolSpec
from context_engine.providers import render

from .strategies import least_room
from .test_budget import _Ids, _text

GATE = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
SECRET = b"k" * 32
NOW = datetime(2026, 3, 1, 12, tzinfo=UTC)
PPM = 1_000_000
SAFETY_MARGIN_PPM = 50_000  # core/budget.py Rule 5: 5% of what the prefix leaves
TOOL = "web.fetch"


def count(text: str) -> int:
    """The raw counter (4 UTF-8 bytes per token, rounded up): subadditive, so a joined
    string never counts more than its pieces."""
    return -(-len(text.encode("utf-8")) // 4)


def scaled(raw: int, factor_ppm: int) -> int:
    """raw under the correction factor, rounded up (the test's own arithmetic)."""
    return -(-raw * factor_ppm // PPM)


# --- the independent measure ------------------------------------------------------------


def _canonical(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, sort_keys=True)


def _anthropic_texts(payload: dict[str, Any]) -> tuple[list[str], int]:
    turns = payload["messages"]
    first = turns[0]["content"] if turns else []
    if len(first) == 1 and first[0].get("text") == HISTORY_CUT_PLACEHOLDER:
        turns = turns[1:]  # the placeholder turn: request framing, outside the body
    texts: list[str] = []
    for turn in turns:
        for part in turn["content"]:
            kind = part["type"]
            if kind == "text":
                texts.append(part["text"])
            elif kind == "tool_use":
                texts += [part["id"], part["name"], _canonical(part["input"])]
            elif kind == "tool_result":
                texts.append(part["tool_use_id"])
                content = part.get("content", "")
                if isinstance(content, str):
                    texts.append(content)
                else:
                    texts += [c.get("text", "") for c in content]
            # thinking / redacted_thinking: replayed opaque, not counted (a lower bound)
    return texts, len(turns)


def _openai_texts(payload: dict[str, Any]) -> tuple[list[str], int]:
    texts: list[str] = []
    for item in payload["input"]:
        kind = item.get("type")
        if kind == "message":
            content = item["content"]
            if isinstance(content, str):
                texts.append(content)
            else:
                texts += [c.get("text", "") for c in content]
        elif kind == "function_call":
            texts += [item["call_id"], item["name"], item["arguments"]]
        elif kind == "function_call_output":
            texts += [item["call_id"], item["output"]]
        # reasoning: replayed opaque, not counted
    # One input item per neutral block that sends anything (providers/openai.py Rule 3):
    # each is a message to the model, framed on its own.
    return texts, len(payload["input"])


def sent_body_tokens(request: ModelRequest, factor_ppm: int) -> int:
    """A lower bound of the body a correct engine estimates for `request`: the texts its
    provider payload's messages carry, counted raw, scaled once, plus per-message framing."""
    payload = json.loads(render(request).body)
    texts, turns = (
        _anthropic_texts(payload) if request.provider == "anthropic" else _openai_texts(payload)
    )
    raw = sum(count(t) for t in texts if t)
    return scaled(raw, factor_ppm) + MESSAGE_FRAMING_TOKENS * turns


def sent_system_tokens(request: ModelRequest) -> int:
    """The system blocks as the payload carries them, counted raw: Anthropic's `system`
    blocks each, OpenAI's `instructions` as the one text it joins them into."""
    payload = json.loads(render(request).body)
    if request.provider == "anthropic":
        return sum(count(b["text"]) for b in payload.get("system", []))
    return count(payload.get("instructions", ""))


@dataclass(frozen=True)
class Budget:
    total: int
    input: int
    framing: int
    body: int


def spec_budget(plan: ContextPlan, factor_ppm: int) -> Budget:
    """core/budget.py from the plan's figures: total = min(window, cap) (a cap of 0: the
    window), the reserve off the top, then the request framing (reply priming and the
    placeholder turn, its text scaled: core/body_estimate.py Rule 6) and the 5% margin on
    what the prefix leaves, rounded up."""
    cap = plan.policy_cap_tokens
    total = min(plan.context_window, cap) if cap > 0 else plan.context_window
    input_tokens = total - plan.max_output_tokens
    available = input_tokens - plan.prefix_tokens
    margin = -(-available * SAFETY_MARGIN_PPM // PPM) if available > 0 else 0
    framing = (
        REQUEST_FRAMING_TOKENS
        + scaled(count(HISTORY_CUT_PLACEHOLDER), factor_ppm)
        + MESSAGE_FRAMING_TOKENS
    )
    return Budget(total, input_tokens, framing, available - margin - framing)


# --- generated sessions -----------------------------------------------------------------


@dataclass
class Session:
    provider: str  # "anthropic" | "openai"
    tools: bool  # whether the plan defines the pairs' tool (Anthropic: blocks, else text)
    carried: list[ConversationItem]
    run: list[ConversationItem]
    summary: SummaryItem | None
    floor: int
    step: StepContext
    working_state: WorkingStateItem | None
    body_room: int
    reserve: int
    factor_ppm: int
    limit: str


# Arguments as a client sends them (canonical JSON objects): mostly short, some long, so a
# call's arguments can weigh as much as a result.
_ARGUMENTS = st.one_of(
    st.sampled_from(["{}", '{"q":"x"}', '{"a":[1,2],"b":{"c":null}}']),
    st.integers(100, 6_000).map(lambda n: _canonical({"q": _text(n), "n": n})),
)


@st.composite
def _loop(draw: st.DrawFn, ids: _Ids, run_id: str) -> list[ConversationItem]:
    items: list[ConversationItem] = []
    calls = []
    for _ in range(draw(st.integers(1, 3))):
        item_id, seq = ids.next("c")
        call = ToolCall(
            item_id=item_id,
            call_id=f"call_{item_id}",
            tool_name=TOOL,
            arguments_json=draw(_ARGUMENTS),
            sequence=seq,
            run_id=run_id,
        )
        items.append(call)
        calls.append(call)
    for call in draw(st.permutations(calls)):
        item_id, seq = ids.next("t")
        size = draw(st.sampled_from([10, 400, 3_000, 20_000, 60_000]))
        items.append(
            ToolResult(
                item_id=item_id,
                call_id=call.call_id,
                tool_name=TOOL,
                content=_text(size),
                trust=draw(st.sampled_from([TrustLevel.EXTERNAL_UNTRUSTED, TrustLevel.USER])),
                is_error=draw(st.booleans()),
                artifact_ref=draw(st.sampled_from(["", f"a/{item_id}"])),
                context_content=_text(300) if draw(st.booleans()) and size > 1_000 else "",
                sequence=seq,
                run_id=run_id,
            )
        )
    return items


@st.composite
def sessions(draw: st.DrawFn) -> Session:
    ids = _Ids()
    carried: list[ConversationItem] = []
    runs: list[list[ConversationItem]] = []
    for r in range(draw(st.integers(0, 3))):
        run_id = f"r{r}"
        item_id, seq = ids.next("u")
        items: list[ConversationItem] = [
            UserMessage(
                item_id=item_id,
                text=_text(draw(st.integers(5, 4_000))),
                sequence=seq,
                run_id=run_id,
            )
        ]
        for _ in range(draw(st.integers(0, 4))):
            items += draw(_loop(ids, run_id))
        item_id, seq = ids.next("a")
        items.append(
            AssistantMessage(
                item_id=item_id,
                text=_text(draw(st.integers(5, 8_000))),
                sequence=seq,
                run_id=run_id,
            )
        )
        runs.append(items)
        carried += items
    summary, floor = None, 0
    summarized: bool = draw(st.booleans())
    if runs and summarized:
        floor = runs[draw(st.integers(0, len(runs) - 1))][-1].sequence
        summary = SummaryItem(item_id="summary", text=_text(draw(st.integers(10, 3_000))))
    item_id, seq = ids.next("u")
    run: list[ConversationItem] = [
        UserMessage(
            item_id=item_id, text=_text(draw(st.integers(5, 2_000))), sequence=seq, run_id="current"
        )
    ]
    for _ in range(draw(st.integers(0, 5))):
        if draw(st.booleans()):
            item_id, seq = ids.next("a")
            run.append(
                AssistantMessage(item_id=item_id, text=_text(200), sequence=seq, run_id="current")
            )
        run += draw(_loop(ids, "current"))
    if draw(st.booleans()):
        item_id, seq = ids.next("u")
        run.append(UserMessage(item_id=item_id, text=_text(100), sequence=seq, run_id="current"))
    n_recall = draw(st.integers(0, 6))
    step = StepContext(
        recall=tuple(
            RecallLineItem(item_id=f"rec{n}", text=_text(draw(st.integers(10, 3_000))))
            for n in range(n_recall)
        ),
        corrections=tuple(
            CorrectionLineItem(item_id=f"cor{n}", text=_text(80))
            for n in range(draw(st.integers(0, 2)))
        ),
        knowledge=tuple(
            KnowledgePassageItem(
                item_id=f"kn{n}",
                text=_text(draw(st.integers(10, 8_000))),
                rank=draw(st.integers(0, 4)),
            )
            for n in range(draw(st.integers(0, 5)))
        ),
    )
    working_state = (
        WorkingStateItem(item_id="working-state", text=_text(draw(st.integers(10, 3_000))))
        if draw(st.booleans())
        else None
    )
    return Session(
        provider=draw(st.sampled_from(["anthropic", "openai"])),
        tools=draw(st.booleans()),
        carried=carried,
        run=run,
        summary=summary,
        floor=floor,
        step=step,
        working_state=working_state,
        # Mostly room for the never-yield set, so most examples build and many cut.
        body_room=draw(st.integers(least_room(count), 60_000) | st.integers(12_000, 80_000)),
        reserve=draw(st.integers(16, 9_000)),
        factor_ppm=draw(st.sampled_from([1_000_000, 1_000_000, 1_300_000, 3_000_000])),
        limit=draw(st.sampled_from(["cap", "window", "window_under_cap"])),
    )


@st.composite
def cut_sessions(draw: st.DrawFn) -> Session:
    """A session whose request cuts a long carried history of plain turns (a few small
    tool pairs among them), with room for part of it: the cut fills the body to within one
    turn of its budget, so a budget a few percent too large shows in what is sent (the
    general sessions above mostly leave a whole yielded unit of room unused)."""
    ids = _Ids()
    carried: list[ConversationItem] = []
    pairs = draw(st.booleans())
    for r in range(draw(st.integers(1, 3))):
        run_id = f"r{r}"
        for _ in range(draw(st.integers(10, 30))):
            item_id, seq = ids.next("u")
            size = draw(st.integers(40, 3_000))
            carried.append(
                UserMessage(item_id=item_id, text=_text(size), sequence=seq, run_id=run_id)
            )
            if pairs and draw(st.integers(0, 4)) == 0:
                item_id, seq = ids.next("c")
                call_id = f"call_{item_id}"
                carried.append(
                    ToolCall(
                        item_id=item_id,
                        call_id=call_id,
                        tool_name=TOOL,
                        arguments_json='{"q":"x"}',
                        sequence=seq,
                        run_id=run_id,
                    )
                )
                item_id, seq = ids.next("t")
                carried.append(
                    ToolResult(
                        item_id=item_id,
                        call_id=call_id,
                        tool_name=TOOL,
                        content=_text(draw(st.integers(200, 3_000))),
                        trust=TrustLevel.USER,
                        sequence=seq,
                        run_id=run_id,
                    )
                )
            item_id, seq = ids.next("a")
            size = draw(st.integers(40, 3_000))
            carried.append(
                AssistantMessage(item_id=item_id, text=_text(size), sequence=seq, run_id=run_id)
            )
    item_id, seq = ids.next("u")
    run: list[ConversationItem] = [
        UserMessage(item_id=item_id, text=_text(40), sequence=seq, run_id="current")
    ]
    history = sum(count(getattr(i, "text", "") or getattr(i, "content", "")) for i in carried)
    # Room for the question, the runtime row and history's floor (a body that cannot hold
    # the floor asks for compaction), and for none to all of the rest of the history.
    least = least_room(count) + (HISTORY_FLOOR_TOKENS + 1_000) * 11 // 10
    factor = draw(st.sampled_from([1_000_000, 1_300_000]))
    return Session(
        provider=draw(st.sampled_from(["anthropic", "openai"])),
        tools=draw(st.booleans()),
        carried=carried,
        run=run,
        summary=None,
        floor=0,
        step=StepContext(),
        working_state=None,
        body_room=draw(st.integers(least, least + max(1, history * factor // PPM))),
        reserve=draw(st.integers(16, 2_000)),
        factor_ppm=factor,
        limit=draw(st.sampled_from(["cap", "window", "window_under_cap"])),
    )


@st.composite
def tight_sessions(draw: st.DrawFn) -> Session:
    """A short question and fine-grained step context (recall lines and passages of a few
    dozen tokens, which yield one by one) against a body near the least a plan accepts:
    where the margin is smallest and a few tokens of budget too many show."""
    run: list[ConversationItem] = [
        UserMessage(
            item_id="u1", text=_text(draw(st.integers(5, 200))), sequence=1, run_id="current"
        )
    ]
    step = StepContext(
        recall=tuple(
            RecallLineItem(item_id=f"rec{n}", text=_text(draw(st.integers(10, 300))))
            for n in range(draw(st.integers(0, 12)))
        ),
        knowledge=tuple(
            KnowledgePassageItem(
                item_id=f"kn{n}",
                text=_text(draw(st.integers(10, 400))),
                rank=draw(st.integers(0, 4)),
            )
            for n in range(draw(st.integers(0, 5)))
        ),
    )
    return Session(
        provider=draw(st.sampled_from(["anthropic", "openai"])),
        tools=draw(st.booleans()),
        carried=[],
        run=run,
        summary=None,
        floor=0,
        step=step,
        working_state=None,
        body_room=least_room(count) + draw(st.integers(0, 1_000)),
        reserve=draw(st.integers(16, 2_000)),
        factor_ppm=draw(st.sampled_from([1_000_000, 1_300_000])),
        limit=draw(st.sampled_from(["cap", "window", "window_under_cap"])),
    )


def _plan(session: Session, window: int, cap: int) -> ContextPlan:
    tools = (
        (ToolSpec(name=TOOL, input_schema={"type": "object"}, side_effect=SideEffect.NONE),)
        if session.tools
        else ()
    )
    spec = PlanSpec(
        model_id="m",
        agent=AgentSpec(
            agent_id="a",
            version="1",
            instructions="Be brief.",
            enabled_tools=(TOOL,) if session.tools else (),
        ),
        policy=PlatformPolicySpec(version="v1", text="Platform policy."),
        tools=tools,
        policy_cap_tokens=cap,
        reserve_output_tokens=session.reserve,
    )
    return make_plan(
        spec,
        session_id="s",
        epoch=1,
        reason=PlanReason.SESSION_OPENED,
        secret=SECRET,
        model=ModelFacts("m", session.provider, window, 8_192),
        count_tokens=count,
    )


def _build(session: Session, window: int = 200_000) -> tuple[ContextPlan, BuildInputs]:
    probe = _plan(session, window, 0)
    limit = probe.prefix_tokens + session.reserve + session.body_room
    window, cap = {
        "cap": (window, limit),
        "window": (limit, 0),
        "window_under_cap": (limit, limit + 50_000),
    }[session.limit]
    plan = _plan(session, window, cap)
    assert bool(plan.tools) == session.tools
    inputs = BuildInputs(
        tenant_id="t",
        plan=plan,
        secret=SECRET,
        checkpoint=Checkpoint(
            run_id="current",
            version=1,
            items=tuple(session.run),
            summary=session.summary,
            replaced_through_sequence=session.floor,
            estimator_factor_ppm=session.factor_ppm,
        ),
        carried=tuple(session.carried),
        now=NOW,
        step=session.step,
        working_state=session.working_state,
        count_tokens=count,
        inline_maximum_bytes=16_384,
    )
    return plan, inputs


# --- the gate ---------------------------------------------------------------------------


def _check(session: Session) -> bool:
    """The gate on one session; whether it built a request."""
    plan, inputs = _build(session)
    budget = spec_budget(plan, session.factor_ppm)
    try:
        built = assemble(inputs)
    except (BudgetExceededError, InvalidFieldError):
        return False  # refusals: test_budget.py checks what they name
    assert built.input_budget_tokens == budget.input
    if built.needs_compaction:
        assert built.request is None
        return False
    request = built.request
    assert request is not None
    sent = sent_body_tokens(request, session.factor_ppm)
    # The engine's estimate covers what is sent (the factor applied, every field counted).
    assert sent <= built.body_estimated_tokens, (sent, built.body_estimated_tokens)
    # What is sent fits the body the allocator's spec grants, and the whole request the
    # window less the reserve.
    assert sent <= budget.body, (sent, budget.body)
    # And the prefix's system blocks as sent within the plan's exact measure of them (an
    # audit: OpenAI's instructions join them with separators the plan left uncounted).
    system = sum(c.tokens for c in plan.prefix_classes if c.class_name != "tool_definitions")
    assert sent_system_tokens(request) <= system, (sent_system_tokens(request), system)
    assert plan.prefix_tokens + budget.framing + sent + plan.max_output_tokens <= budget.total
    return True


# Each gate counts only the examples that built a request (assume): a strategy that
# stopped making them fails hypothesis's health check rather than passing on refusals.


@GATE
@given(sessions())
def test_the_body_as_sent_is_within_the_estimate_and_the_budget(session: Session) -> None:
    assume(_check(session))


@GATE
@given(cut_sessions())
def test_a_cut_history_as_sent_is_within_the_budget(session: Session) -> None:
    assume(_check(session))


@GATE
@given(tight_sessions())
def test_a_body_near_the_least_as_sent_is_within_the_budget(session: Session) -> None:
    assume(_check(session))


def test_the_joins_of_openai_instructions_count_on_the_framing_class_alone() -> None:
    """context-builder@6 counts the blank lines OpenAI's `instructions` join the system
    blocks with. On each block's class, an instructions row at its cap failed and a
    snapshot at its cap lost a memory once rebuilt (a review): only the framing class
    takes them, so every other class measures as it does for Anthropic, whose blocks are
    sent apart, and the plan's figure holds the joined text."""
    from context_engine.core.plan import SYSTEM_JOINS
    from context_engine.core.spec import MemoryItemSpec, MemorySnapshotSpec

    memories = tuple(
        MemoryItemSpec(item_id=f"m{n}", text=f"Memory {n} of the client.") for n in range(70)
    )
    spec = PlanSpec(
        model_id="m",
        agent=AgentSpec(agent_id="a", version="1", instructions="Be brief. " * 40),
        policy=PlatformPolicySpec(version="v1", text="Platform policy."),
        snapshot=MemorySnapshotSpec(snapshot_id="s", items=memories),
    )

    def plan_for(provider: str) -> ContextPlan:
        return make_plan(
            spec,
            session_id="s",
            epoch=1,
            reason=PlanReason.SESSION_OPENED,
            secret=SECRET,
            model=ModelFacts("m", provider, 200_000, 8_192),
            count_tokens=count,
        )

    anthropic, openai = plan_for("anthropic"), plan_for("openai")
    assert openai.skipped_memory_ids == anthropic.skipped_memory_ids != ()  # the cap binds
    by_name = {c.class_name: c for c in anthropic.prefix_classes}
    for usage in openai.prefix_classes:
        if usage.class_name != "framing":
            assert usage == by_name[usage.class_name]
    joined = SYSTEM_JOINS["openai"].join(b.text for b in openai.system if b.text)
    assert openai.prefix_tokens - anthropic.prefix_tokens == count(joined) - sum(
        count(b.text) for b in openai.system
    )
    assert openai.prefix_tokens > anthropic.prefix_tokens
