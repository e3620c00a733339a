"""Build: a pure function from (plan, checkpoint, carried history, step context, clock) to a
provider-neutral ModelRequest. Called twice on the same inputs it returns the same bytes.

Rule 1 (order): rows 9 and 10 come first — the summary, then retained carried history and
the run's completed exchanges (its original user message once the run has tool calls and
results). Fresh rows 11-14 follow those exchanges; they are never inserted back before the
run's original user message. An unanswered trailing user message stays last (row 15).
Rule 2 (regions): every placed item's declared region, rows and trust are asserted against
the row table before anything renders.
Rule 3 (clock): the date in row 14 comes from the `now` argument, already in the session's
time zone (the shell resolves the zone; reading tz data is I/O).
Rule 4 (pairs): the assembled request is validated for orphaned tool items before it leaves.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Literal

from .canonical import canonical_bytes, sha256_hex
from .checkpoint import Checkpoint
from .enums import SessionKind
from .envelope import wrap
from .items import (
    AssistantMessage,
    ContextItem,
    ConversationItem,
    CorrectionLineItem,
    KnowledgePassageItem,
    ReasoningItem,
    RecallLineItem,
    RuntimeMetadataItem,
    SkillBodyItem,
    SummaryItem,
    ToolCall,
    ToolResult,
    UserMessage,
    WorkingStateItem,
    check_placement,
    trust_of,
)
from .plan import ContextPlan, session_key
from .request import Block, CacheBreakpoint, Message, ModelRequest, ToolDefinition
from .rows import Row
from .validate import validate_tool_pairs

__all__ = ["Assembled", "BuildInputs", "StepContext", "assemble", "split_run_items"]

Role = Literal["user", "assistant"]

_INPUT_TYPES = (UserMessage, ToolResult)


@dataclass(frozen=True, slots=True)
class StepContext:
    recall: tuple[RecallLineItem, ...] = ()
    corrections: tuple[CorrectionLineItem, ...] = ()
    knowledge: tuple[KnowledgePassageItem, ...] = ()


@dataclass(frozen=True, slots=True)
class BuildInputs:
    tenant_id: str
    plan: ContextPlan
    secret: bytes  # the plan's nonce secret; never rendered
    checkpoint: Checkpoint
    carried: tuple[ConversationItem, ...]  # the run's carried history, oldest first
    now: datetime  # aware, in the session's time zone
    step: StepContext = StepContext()
    skill_bodies: tuple[SkillBodyItem, ...] = ()
    working_state: WorkingStateItem | None = None


@dataclass(frozen=True, slots=True)
class Assembled:
    request: ModelRequest
    request_sha256: str
    placed: tuple[tuple[Row, ContextItem], ...]  # every Region B item, in order


def split_run_items(
    items: Sequence[ConversationItem],
) -> tuple[tuple[ConversationItem, ...], tuple[UserMessage, ...]]:
    """Split a run's items into completed exchanges and the unanswered trailing user input.

    The trailing input is the maximal suffix of user messages: before the model has
    answered anything they are the request's last word; once it has, they still are.
    """
    cut = len(items)
    while cut > 0 and isinstance(items[cut - 1], UserMessage):
        cut -= 1
    trailing = tuple(i for i in items[cut:] if isinstance(i, UserMessage))
    return tuple(items[:cut]), trailing


def assemble(inputs: BuildInputs) -> Assembled:
    """Assemble the run's next request.

    Raises:
        EngineError: an item type without a declared region, or in the wrong row.
        PreconditionError: the request would carry an orphaned tool call or result.
    """
    placed = _place(inputs)
    for row, item in placed:
        check_placement(item, row)
    messages = _messages(placed, inputs.secret)
    validate_tool_pairs(messages)
    plan = inputs.plan
    ttl = "1h" if plan.session_kind is SessionKind.SCHEDULED else "5m"
    request = ModelRequest(
        provider=plan.provider,
        model_id=plan.model_id,
        system=tuple(b.to_block() for b in plan.system),
        tools=tuple(ToolDefinition(t.name, t.description, t.input_schema_json) for t in plan.tools),
        messages=messages,
        max_output_tokens=plan.max_output_tokens,
        session_key=session_key(inputs.tenant_id, plan.session_id),
        cache_breakpoints=(
            CacheBreakpoint("after_system", through_item="row:system", ttl=ttl, priority=0),
            CacheBreakpoint("after_tools", through_item="row:tools", ttl=ttl, priority=1),
        ),
    )
    digest = sha256_hex(canonical_bytes(request.canonical()))
    return Assembled(request=request, request_sha256=digest, placed=tuple(placed))


def _place(inputs: BuildInputs) -> list[tuple[Row, ContextItem]]:
    """Region B items in the fixed order of the row table."""
    checkpoint = inputs.checkpoint
    floor = checkpoint.replaced_through_sequence
    completed, trailing = split_run_items(checkpoint.items)
    placed: list[tuple[Row, ContextItem]] = []
    if checkpoint.summary is not None:
        placed.append((Row.COMPACTED_SUMMARY, checkpoint.summary))
    # Items the summary covers are represented by it; admitting them again would state the
    # same turns twice in two voices.
    placed += [(Row.CONVERSATION, i) for i in inputs.carried if i.sequence > floor]
    placed += [(Row.CONVERSATION, i) for i in _latest_turn_reasoning_only(completed)]
    placed += [(Row.SKILL_BODIES, s) for s in inputs.skill_bodies]
    if inputs.working_state is not None:
        placed.append((Row.WORKING_STATE, inputs.working_state))
    step = inputs.step
    placed += [(Row.RECALL, c) for c in step.corrections]
    placed += [(Row.RECALL, r) for r in step.recall]
    placed += [(Row.RECALL, k) for k in sorted(step.knowledge, key=lambda k: k.rank)]
    placed.append((Row.RUNTIME_METADATA, _runtime(inputs)))
    placed += [(Row.USER_INPUT, u) for u in trailing]
    return placed


def _latest_turn_reasoning_only(items: tuple[ConversationItem, ...]) -> list[ConversationItem]:
    """Drop reasoning items except those of the latest model turn (ADR-0007).

    The latest model turn is the last run of model output (assistant text, tool calls,
    reasoning) before any trailing inputs (user messages, tool results).
    """
    end = len(items)
    while end > 0 and isinstance(items[end - 1], _INPUT_TYPES):
        end -= 1
    start = end
    while start > 0 and not isinstance(items[start - 1], _INPUT_TYPES):
        start -= 1
    return [i for n, i in enumerate(items) if not isinstance(i, ReasoningItem) or n >= start]


def _runtime(inputs: BuildInputs) -> RuntimeMetadataItem:
    plan = inputs.plan
    return RuntimeMetadataItem(
        item_id="runtime",
        date=inputs.now.date().isoformat(),
        weekday=inputs.now.strftime("%A"),
        time_zone=plan.time_zone,
        principal_scope=plan.principal_scope,
        surface=plan.surface,
        allowed_origins=plan.allowed_origins,
    )


# --- rendering -------------------------------------------------------------------------

_ASSISTANT_TYPES = (AssistantMessage, ToolCall, ReasoningItem)


def _messages(placed: list[tuple[Row, ContextItem]], secret: bytes) -> tuple[Message, ...]:
    """Render placed items to blocks and merge consecutive same-role blocks into messages."""
    out: list[tuple[Role, list[Block]]] = []
    for row, item in placed:
        role: Role = "assistant" if isinstance(item, _ASSISTANT_TYPES) else "user"
        block = _render(row, item, secret)
        if out and out[-1][0] == role:
            out[-1][1].append(block)
        else:
            out.append((role, [block]))
    return tuple(Message(role, tuple(blocks)) for role, blocks in out)


def _render(row: Row, item: ContextItem, secret: bytes) -> Block:
    """One Region B item's block. Exhaustive; an unknown item type raises."""
    trust = trust_of(item)
    seq = getattr(item, "sequence", 0)

    def text(body: str, source: str) -> Block:
        rendered = wrap(body, trust=trust, item_id=item.item_id, source=source, secret=secret)
        return Block(row, trust, "text", item.item_id, seq, text=rendered)

    match item:
        case UserMessage():
            return text(item.text, "user")
        case AssistantMessage():
            return Block(row, trust, "text", item.item_id, seq, text=item.text)
        case ToolCall():
            return Block(
                row,
                trust,
                "tool_call",
                item.item_id,
                seq,
                call_id=item.call_id,
                tool_name=item.tool_name,
                arguments_json=item.arguments_json,
            )
        case ToolResult():
            content = item.context_content or item.content
            source = item.source or f"tool:{item.tool_name}"
            return Block(
                row,
                trust,
                "tool_result",
                item.item_id,
                seq,
                text=wrap(content, trust=trust, item_id=item.item_id, source=source, secret=secret),
                call_id=item.call_id,
                tool_name=item.tool_name,
                is_error=item.is_error,
                artifact_ref=item.artifact_ref,
            )
        case ReasoningItem():
            return Block(
                row,
                trust,
                "reasoning",
                item.item_id,
                seq,
                provider=item.provider,
                opaque=item.opaque,
            )
        case SummaryItem():
            return text(
                "Summary of earlier conversation (platform record):\n" + item.text, "summary"
            )
        case SkillBodyItem():
            return text(
                f"Skill {item.name} ({item.version}) loaded:\n{item.body}", f"skill:{item.name}"
            )
        case WorkingStateItem():
            return text(item.text, "working-state")
        case CorrectionLineItem():
            return text(
                f"Correction (overrides the snapshot): {item.text}", item.source or "memory"
            )
        case RecallLineItem():
            return text(item.text, item.source or "memory")
        case KnowledgePassageItem():
            return text(item.text, item.citation or "knowledge")
        case RuntimeMetadataItem():
            return text(_runtime_text(item), "runtime")
    raise TypeError(f"no Region B renderer for {type(item).__name__}")


def _runtime_text(item: RuntimeMetadataItem) -> str:
    lines = [
        "Runtime context:",
        f"- today: {item.date} ({item.weekday}), time zone {item.time_zone}",
    ]
    if item.principal_scope:
        lines.append(f"- acting for: {item.principal_scope}")
    if item.surface:
        lines.append(f"- surface: {item.surface}")
    if item.allowed_origins:
        lines.append("- browser.navigate accepts: " + ", ".join(item.allowed_origins))
    return "\n".join(lines)
