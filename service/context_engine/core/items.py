"""A closed set of typed context items, one or more per assembly row.

Every concrete item class declares, as class attributes:
  REGION       the region it lives in,
  ROWS         the rows it may occupy (a user message is row 10 once answered, 15 before),
  FIXED_TRUST  its trust level, or None when the trust is the item's own `trust` field.
Assembly asserts all three (`check_placement`); a class that does not declare them cannot be
assembled. Conversation items are also the persisted form in events and checkpoints, with a
`kind` discriminator so an unknown kind fails validation instead of being skipped.
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from .errors import EngineError
from .rows import ROW_TABLE, Region, Row
from .trust import TrustLevel

__all__ = [
    "REASONING_FIELDS",
    "REASONING_KEYS",
    "REASONING_TYPES",
    "AgentInstructionsItem",
    "AssistantMessage",
    "Attachment",
    "ContextItem",
    "ConversationItem",
    "CorrectionLineItem",
    "DeferredIndexEntry",
    "DelegatedMessage",
    "FramingItem",
    "KnowledgePassageItem",
    "PersonaItem",
    "PlatformPolicyItem",
    "ReasoningItem",
    "RecallLineItem",
    "RuntimeMetadataItem",
    "SkillBodyItem",
    "SkillCatalogItem",
    "SnapshotItem",
    "SummaryItem",
    "ToolCall",
    "ToolDefinitionItem",
    "ToolResult",
    "UserMessage",
    "WorkingStateItem",
    "check_placement",
    "excerpted",
    "trust_of",
]

_A, _B = Region.PREFIX, Region.BODY


class ContextItem(BaseModel):
    """Base of every item. Declares nothing itself, so it cannot be assembled."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    REGION: ClassVar[Region]
    ROWS: ClassVar[frozenset[Row]]
    FIXED_TRUST: ClassVar[TrustLevel | None]

    item_id: str = ""


def trust_of(item: ContextItem) -> TrustLevel:
    """The item's trust: its class's fixed level, else its own `trust` field."""
    fixed = type(item).FIXED_TRUST
    if fixed is not None:
        return fixed
    trust = getattr(item, "trust", None)
    if not isinstance(trust, TrustLevel):
        raise EngineError(f"{type(item).__name__} declares per-item trust but has none")
    return trust


def check_placement(item: ContextItem, row: Row) -> None:
    """Assert the item's declared region, rows and trust agree with the table.

    Raises:
        EngineError: the class declares no region/rows/trust, or they disagree with `row`.
    """
    # The verdict is a function of the item's class, the row and the item's own trust
    # field (class attributes and the row table are constants), so a placement that passed
    # is remembered by those three and not worked out again for every item of every Build.
    passed = (type(item), row, item.__dict__.get("trust"))
    try:
        if passed in _PASSED:
            return
    except TypeError:  # a trust value that cannot be hashed: check it every time
        _check_placement(item, row)
        return
    _check_placement(item, row)
    _PASSED.add(passed)


# (class, row, trust field) of every placement that passed; classes, rows and trust levels
# are few, so this stays small.
_PASSED: set[tuple[type, Row, object]] = set()


def _check_placement(item: ContextItem, row: Row) -> None:
    cls = type(item)
    missing = [a for a in ("REGION", "ROWS", "FIXED_TRUST") if not hasattr(cls, a)]
    if missing:
        raise EngineError(f"{cls.__name__} declares no {', '.join(missing)}; refusing it")
    spec = ROW_TABLE[row]
    if cls.REGION is not spec.region or row not in cls.ROWS:
        raise EngineError(f"{cls.__name__} may not occupy row {row.value} ({spec.content})")
    if spec.trust is not None and trust_of(item) is not spec.trust:
        raise EngineError(f"row {row.value} requires {spec.trust.name}, got {trust_of(item).name}")


# --- Region A: rendered once per plan -------------------------------------------------


class PlatformPolicyItem(ContextItem):
    REGION = _A
    ROWS = frozenset({Row.PLATFORM_POLICY})
    FIXED_TRUST = TrustLevel.PLATFORM
    version: str
    text: str


class FramingItem(ContextItem):
    REGION = _A
    ROWS = frozenset({Row.FRAMING})
    FIXED_TRUST = TrustLevel.PLATFORM
    text: str


class AgentInstructionsItem(ContextItem):
    REGION = _A
    ROWS = frozenset({Row.AGENT_INSTRUCTIONS})
    FIXED_TRUST = TrustLevel.TRUSTED_CONFIGURATION
    agent_id: str
    version: str
    text: str


class PersonaItem(ContextItem):
    REGION = _A
    ROWS = frozenset({Row.PERSONA})
    FIXED_TRUST = TrustLevel.TRUSTED_CONFIGURATION
    revision: str
    entries: tuple[str, ...]


class ToolDefinitionItem(ContextItem):
    """The model-visible form of a pinned tool."""

    REGION = _A
    ROWS = frozenset({Row.TOOL_DEFINITIONS})
    FIXED_TRUST = TrustLevel.TRUSTED_CONFIGURATION
    name: str
    description: str
    input_schema_json: str  # canonical JSON


class DeferredIndexEntry(ContextItem):
    REGION = _A
    ROWS = frozenset({Row.DEFERRED_TOOL_INDEX})
    FIXED_TRUST = None
    name: str
    line: str
    trust: TrustLevel


class SkillCatalogItem(ContextItem):
    REGION = _A
    ROWS = frozenset({Row.SKILL_CATALOG})
    FIXED_TRUST = None
    name: str
    description: str
    version: str
    trust: TrustLevel


class SnapshotItem(ContextItem):
    REGION = _A
    ROWS = frozenset({Row.MEMORY_SNAPSHOT})
    FIXED_TRUST = TrustLevel.MEMORY
    text: str
    source: str = ""


# --- Region B: conversation items (persisted in events and checkpoints) ---------------


class Attachment(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    kind: Literal["image", "pdf", "text_file"]
    ref: str
    pages: int = 0
    text_length: int = 0


class _Logged(ContextItem):
    """A conversation item: carries the session sequence and run it was logged under."""

    REGION = _B
    sequence: int = 0  # 0: not in the session log (a reasoning item, or not yet logged)
    run_id: str = ""


class UserMessage(_Logged):
    ROWS = frozenset({Row.CONVERSATION, Row.USER_INPUT})
    FIXED_TRUST = TrustLevel.USER
    kind: Literal["user_message"] = "user_message"
    text: str
    attachments: tuple[Attachment, ...] = ()


class DelegatedMessage(UserMessage):
    """A user-role message of a child run: its parent agent's words (the instruction it
    seeded the child with, and any it adds later), which may rest on untrusted content the
    parent read. Still the run's own user message (it never yields, compaction keeps it
    verbatim), but at MODEL trust in an envelope of its own (core/trust.py, Rule 2), never
    with the user's authority.

    Never persisted: the log and checkpoints hold it as the UserMessage it was written as,
    and Build reads a child run's user messages as this (core/seeding.py, Rule 4), so a
    checkpoint reads the same in every version and GetBuild can still render an older
    assembler's request as it was sent."""

    FIXED_TRUST = TrustLevel.MODEL


# The provider's id of a model output item (OpenAI's msg_/fc_ ids), sent only beside the
# reasoning it was produced with (providers/openai.py, Rule 4). Stored only when set: a
# replica that predates the field reads every item and checkpoint written without one
# (extra="forbid" would refuse the key).
def _provider_item_id() -> str:
    return Field("", exclude_if=lambda value: not value)


class AssistantMessage(_Logged):
    ROWS = frozenset({Row.CONVERSATION})
    FIXED_TRUST = TrustLevel.MODEL
    kind: Literal["assistant_message"] = "assistant_message"
    text: str
    provider_item_id: str = _provider_item_id()


class ToolCall(_Logged):
    ROWS = frozenset({Row.CONVERSATION})
    FIXED_TRUST = TrustLevel.MODEL
    kind: Literal["tool_call"] = "tool_call"
    call_id: str
    tool_name: str
    arguments_json: str  # canonical JSON object
    task_id: str = ""  # the working-state task the call works on (runtime task transitions)
    provider_item_id: str = _provider_item_id()


class ToolResult(_Logged):
    ROWS = frozenset({Row.CONVERSATION})
    FIXED_TRUST = None
    kind: Literal["tool_result"] = "tool_result"
    call_id: str
    tool_name: str
    content: str
    trust: TrustLevel
    source: str = ""
    is_error: bool = False
    artifact_ref: str = ""
    context_content: str = ""


def excerpted(result: ToolResult) -> bool:
    """Whether the tool pipeline's excerpt (context_content) stands in for the result's
    content when it is sent: its envelope is then marked truncated (core/assemble.py)."""
    return bool(result.context_content) and result.context_content != result.content


# The "type" a provider's reasoning payload carries: replayed verbatim, a payload of any
# other type (a message, a tool call) would reach the provider as that, while the hashed
# request shows an opaque MODEL reasoning block. AppendItems refuses it; so do renderers.
REASONING_TYPES: dict[str, frozenset[str]] = {
    "anthropic": frozenset({"thinking", "redacted_thinking"}),
    "openai": frozenset({"reasoning"}),
}
# What each type must hold to be replayed (the providers' request types: Anthropic's
# ThinkingBlockParam and RedactedThinkingBlockParam, OpenAI's ResponseReasoningItemParam):
# key -> the JSON type of its value. A payload missing one passed AppendItems and then
# failed every later request of its run at the provider (400).
REASONING_FIELDS: dict[str, dict[str, type]] = {
    "thinking": {"thinking": str, "signature": str},
    "redacted_thinking": {"data": str},
    "reasoning": {"id": str, "summary": list},
}
# Every key each type may hold (the same request types): a key the provider does not define
# is refused there (400), on every later request of the run, and a "cache_control" one
# carried a fifth breakpoint onto a thinking block, which may carry none (an audit).
REASONING_KEYS: dict[str, frozenset[str]] = {
    "thinking": frozenset({"type", "thinking", "signature"}),
    "redacted_thinking": frozenset({"type", "data"}),
    "reasoning": frozenset({"type", "id", "summary", "content", "encrypted_content", "status"}),
}


class ReasoningItem(_Logged):
    """Provider-opaque; replayed verbatim within its run, never rendered into text. `opaque`
    is a JSON object whose "type" is one of REASONING_TYPES[provider]."""

    ROWS = frozenset({Row.CONVERSATION})
    FIXED_TRUST = TrustLevel.MODEL
    kind: Literal["reasoning"] = "reasoning"
    provider: Literal["anthropic", "openai"]
    opaque: str  # the provider's JSON payload, verbatim


ConversationItem = Annotated[
    UserMessage | AssistantMessage | ToolCall | ToolResult | ReasoningItem,
    Field(discriminator="kind"),
]


# --- Region B: per-request rows ---------------------------------------------------------


class SummaryItem(ContextItem):
    REGION = _B
    ROWS = frozenset({Row.COMPACTED_SUMMARY})
    FIXED_TRUST = TrustLevel.PLATFORM
    text: str
    source_event_ids: tuple[int, ...] = ()
    depth: int = 1


class SkillBodyItem(ContextItem):
    REGION = _B
    ROWS = frozenset({Row.SKILL_BODIES})
    FIXED_TRUST = None
    name: str
    version: str
    body: str
    trust: TrustLevel


class WorkingStateItem(ContextItem):
    """The rendered working-state block; each entry inside keeps its own trust."""

    REGION = _B
    ROWS = frozenset({Row.WORKING_STATE})
    FIXED_TRUST = None
    text: str
    trust: TrustLevel = TrustLevel.PLATFORM


class RecallLineItem(ContextItem):
    REGION = _B
    ROWS = frozenset({Row.RECALL})
    FIXED_TRUST = TrustLevel.MEMORY
    text: str
    source: str = ""
    # Whom the line is about: never rendered; recorded with the request, where an erasure
    # finds it (core/build_record.py, Rule 4).
    person_ids: tuple[str, ...] = ()


class CorrectionLineItem(ContextItem):
    REGION = _B
    ROWS = frozenset({Row.RECALL})
    FIXED_TRUST = TrustLevel.MEMORY
    text: str
    source: str = ""
    # Whom the line is about: never rendered; recorded with the request, where an erasure
    # finds it (core/build_record.py, Rule 4).
    person_ids: tuple[str, ...] = ()


class KnowledgePassageItem(ContextItem):
    REGION = _B
    ROWS = frozenset({Row.RECALL})
    FIXED_TRUST = None
    text: str
    citation: str = ""
    trust: TrustLevel = TrustLevel.EXTERNAL_UNTRUSTED
    rank: int = 0  # 0 is the best-ranked passage


class RuntimeMetadataItem(ContextItem):
    REGION = _B
    ROWS = frozenset({Row.RUNTIME_METADATA})
    FIXED_TRUST = TrustLevel.PLATFORM
    date: str  # ISO date in the session's time zone
    weekday: str
    time_zone: str
    principal_scope: str = ""
    surface: str = ""
    allowed_origins: tuple[str, ...] = ()
