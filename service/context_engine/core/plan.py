"""The plan: Region A resolved, rendered once, measured exactly and hashed.

Rule 1: prefix_sha256 = SHA-256 of the RFC 8785 bytes of the prefix document, which holds
every rendered Region A block, the model-visible tool definitions and the full pinned tool
specs. A worker can recompute it from `prefix_document` with any JCS library.
Rule 2: the prefix is counted with the model's tokenizer at plan time and the count is
stored; Build never re-estimates it.
Rule 3: nothing time-dependent, random or per-request enters the prefix. The plan secret
that keys envelope nonces is an argument and never enters a prompt or the document.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict

from .canonical import canonical_bytes, sha256_hex
from .enums import PlanReason, SessionKind
from .envelope import escape_content, wrap
from .framing import BUILDER_VERSION, FRAMING_TEXT
from .items import (
    AgentInstructionsItem,
    ContextItem,
    DeferredIndexEntry,
    FramingItem,
    PersonaItem,
    PlatformPolicyItem,
    SkillCatalogItem,
    SnapshotItem,
    ToolDefinitionItem,
    check_placement,
    trust_of,
)
from .request import Block, ToolDefinition
from .roster import Roster, resolve_roster
from .rows import Row
from .spec import PlanSpec, ToolSpec
from .trust import TrustLevel

__all__ = ["ClassUsage", "ContextPlan", "ModelFacts", "make_plan", "session_key"]

TokenCounter = Callable[[str], int]


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """What the plan needs to know about its model (from the model registry)."""

    model_id: str
    provider: str  # "anthropic" | "openai"
    context_window: int
    default_output_reserve: int


class ClassUsage(BaseModel):
    model_config = ConfigDict(frozen=True)
    class_name: str
    tokens: int
    items: int = 0
    cap_tokens: int = 0
    cap_items: int = 0


class PrefixBlock(BaseModel):
    model_config = ConfigDict(frozen=True)
    row: Row
    trust: TrustLevel
    item_id: str
    text: str

    def to_block(self) -> Block:
        return Block(
            row=self.row, trust=self.trust, kind="text", item_id=self.item_id, text=self.text
        )


class ContextPlan(BaseModel):
    """One session's pinned prefix for one epoch. Immutable; stored as a plan event."""

    model_config = ConfigDict(frozen=True)

    session_id: str
    epoch: int
    reason: PlanReason
    prefix_sha256: str
    prefix_tokens: int
    prefix_document: str  # canonical JSON text; its SHA-256 is prefix_sha256
    model_id: str
    provider: str
    context_window: int
    max_output_tokens: int
    policy_cap_tokens: int
    tool_names: tuple[str, ...]
    deferred_tool_names: tuple[str, ...]
    skipped_tool_names: tuple[str, ...]
    tool_schema_sha256: str
    authority_scope_hashes: tuple[str, ...]
    snapshot_id: str
    snapshot_watermark: int
    recall_trace_id: str
    skill_pins: tuple[tuple[str, str], ...]
    policy_version: str
    builder_version: str
    spec_sha256: str
    prefix_classes: tuple[ClassUsage, ...]
    system: tuple[PrefixBlock, ...]
    tools: tuple[ToolDefinitionItem, ...]
    # Row 14 inputs that are session-stable (they render in Region B, not here).
    session_kind: SessionKind
    principal_scope: str
    surface: str
    time_zone: str
    allowed_origins: tuple[str, ...]


def session_key(tenant_id: str, session_id: str) -> str:
    """CacheHints.session_key: shared by every run, step and epoch of one session only."""
    return "session-" + sha256_hex(canonical_bytes([tenant_id, session_id]))[:32]


def make_plan(
    spec: PlanSpec,
    *,
    session_id: str,
    epoch: int,
    reason: PlanReason,
    secret: bytes,
    model: ModelFacts,
    count_tokens: TokenCounter,
) -> ContextPlan:
    """Resolve, render, measure and hash Region A. Pure: same arguments, same plan."""
    roster = resolve_roster(spec)
    rendered = _render_rows(spec, roster, secret)
    tools = tuple(_definition(t) for t in roster.defined)
    for row, item in rendered:
        check_placement(item, row)
    for tool in tools:
        check_placement(tool, Row.TOOL_DEFINITIONS)
    system = tuple(
        PrefixBlock(row=row, trust=trust_of(item), item_id=item.item_id, text=text)
        for (row, item), text in zip(rendered, _texts(rendered, secret), strict=True)
    )
    pinned = [t.canonical() for t in (*roster.defined, *roster.deferred)]
    document: dict[str, Any] = {
        "builder_version": BUILDER_VERSION,
        "model_id": spec.model_id,
        "provider": model.provider,
        "policy_version": spec.policy.version,
        "system": [b.to_block().canonical() for b in system],
        "tools": [_tool_json(t) for t in tools],
        "tool_specs": pinned,
    }
    document_bytes = canonical_bytes(document)
    classes = _class_usage(system, tools, count_tokens)
    reserve = spec.reserve_output_tokens or model.default_output_reserve
    offers_browser = "browser.navigate" in {t.name for t in roster.defined} | {
        t.name for t in roster.deferred
    }
    return ContextPlan(
        session_id=session_id,
        epoch=epoch,
        reason=reason,
        prefix_sha256=sha256_hex(document_bytes),
        prefix_tokens=sum(c.tokens for c in classes),
        prefix_document=document_bytes.decode("utf-8"),
        model_id=spec.model_id,
        provider=model.provider,
        context_window=model.context_window,
        max_output_tokens=reserve,
        policy_cap_tokens=spec.policy_cap_tokens,
        tool_names=tuple(t.name for t in roster.defined),
        deferred_tool_names=tuple(t.name for t in roster.deferred),
        skipped_tool_names=roster.skipped,
        tool_schema_sha256=sha256_hex(canonical_bytes(pinned)),
        authority_scope_hashes=tuple(
            sorted(sha256_hex(s.encode("utf-8")) for s in spec.principal.scopes)
        ),
        snapshot_id=spec.snapshot.snapshot_id,
        snapshot_watermark=spec.snapshot.watermark,
        recall_trace_id=spec.snapshot.recall_trace_id,
        skill_pins=tuple((s.name, s.version) for s in spec.skills),
        policy_version=spec.policy.version,
        builder_version=BUILDER_VERSION,
        spec_sha256=spec.sha256(),
        prefix_classes=classes,
        system=system,
        tools=tools,
        session_kind=spec.environment.kind,
        principal_scope=spec.principal.scope_label,
        surface=spec.environment.surface,
        time_zone=spec.environment.time_zone,
        allowed_origins=spec.environment.allowed_origins if offers_browser else (),
    )


# --- rendering -------------------------------------------------------------------------

_Rendered = list[tuple[Row, ContextItem]]


def _render_rows(spec: PlanSpec, roster: Roster, secret: bytes) -> _Rendered:
    """Region A items in row order. Empty rows render no item at all (no bytes)."""
    out: _Rendered = [
        (
            Row.PLATFORM_POLICY,
            PlatformPolicyItem(version=spec.policy.version, text=spec.policy.text),
        ),
        (Row.FRAMING, FramingItem(text=FRAMING_TEXT)),
    ]
    if spec.agent.instructions:
        out.append(
            (
                Row.AGENT_INSTRUCTIONS,
                AgentInstructionsItem(
                    agent_id=spec.agent.agent_id,
                    version=spec.agent.version,
                    text=spec.agent.instructions,
                ),
            )
        )
    if spec.persona.entries:
        out.append(
            (Row.PERSONA, PersonaItem(revision=spec.persona.revision, entries=spec.persona.entries))
        )
    for tool in roster.deferred:
        trust = TrustLevel.TRUSTED_CONFIGURATION if tool.builtin else TrustLevel.EXTERNAL_UNTRUSTED
        out.append(
            (
                Row.DEFERRED_TOOL_INDEX,
                DeferredIndexEntry(
                    item_id=f"tool:{tool.name}", name=tool.name, line=tool.name, trust=trust
                ),
            )
        )
    for skill in spec.skills:
        out.append(
            (
                Row.SKILL_CATALOG,
                SkillCatalogItem(
                    item_id=f"skill:{skill.name}",
                    name=skill.name,
                    description=skill.description,
                    version=skill.version,
                    trust=skill.trust,
                ),
            )
        )
    for memory in spec.snapshot.items:
        out.append(
            (
                Row.MEMORY_SNAPSHOT,
                SnapshotItem(
                    item_id=f"memory:{memory.item_id}", text=memory.text, source=memory.source
                ),
            )
        )
    return out


def _texts(rendered: _Rendered, secret: bytes) -> list[str]:
    return [_render_text(item, secret) for _, item in rendered]


def _render_text(item: ContextItem, secret: bytes) -> str:
    """One item's bytes. Exhaustive over Region A item types; an unknown type raises."""
    trust = trust_of(item)
    match item:
        case PlatformPolicyItem() | FramingItem():
            return item.text
        case AgentInstructionsItem():
            return f"Agent instructions ({item.agent_id} {item.version}):\n{item.text}"
        case PersonaItem():
            return "Persona:\n" + "\n".join(f"- {e}" for e in item.entries)
        case DeferredIndexEntry():
            body = f"Deferred tool (call through tool.call): {item.line}"
            return wrap(body, trust=trust, item_id=item.item_id, source="tool-index", secret=secret)
        case SkillCatalogItem():
            body = f"Skill {item.name} ({item.version}): {item.description}"
            return wrap(
                body, trust=trust, item_id=item.item_id, source="skill-catalog", secret=secret
            )
        case SnapshotItem():
            body = f"[{item.source}] {item.text}" if item.source else item.text
            return wrap(
                body, trust=trust, item_id=item.item_id, source="memory:snapshot", secret=secret
            )
    raise TypeError(f"no Region A renderer for {type(item).__name__}")


def _definition(tool: ToolSpec) -> ToolDefinitionItem:
    return ToolDefinitionItem(
        item_id=f"tool:{tool.name}",
        name=tool.name,
        description=escape_content(tool.description),
        input_schema_json=canonical_bytes(tool.input_schema).decode("utf-8"),
    )


def _tool_json(tool: ToolDefinitionItem) -> dict[str, Any]:
    return ToolDefinition(tool.name, tool.description, tool.input_schema_json).canonical()


_CLASS_OF_ROW: dict[Row, str] = {
    Row.PLATFORM_POLICY: "platform_policy",
    Row.FRAMING: "framing",
    Row.AGENT_INSTRUCTIONS: "agent_instructions",
    Row.PERSONA: "persona",
    Row.DEFERRED_TOOL_INDEX: "deferred_tool_index",
    Row.SKILL_CATALOG: "skill_catalog",
    Row.MEMORY_SNAPSHOT: "memory_snapshot",
}


def _class_usage(
    system: tuple[PrefixBlock, ...],
    tools: tuple[ToolDefinitionItem, ...],
    count: TokenCounter,
) -> tuple[ClassUsage, ...]:
    tokens: dict[str, int] = {}
    items: dict[str, int] = {}
    for block in system:
        name = _CLASS_OF_ROW[block.row]
        tokens[name] = tokens.get(name, 0) + count(block.text)
        items[name] = items.get(name, 0) + 1
    tokens["tool_definitions"] = sum(
        count(canonical_bytes(_tool_json(t)).decode("utf-8")) for t in tools
    )
    items["tool_definitions"] = len(tools)
    order = [*_CLASS_OF_ROW.values(), "tool_definitions"]
    return tuple(
        ClassUsage(class_name=n, tokens=tokens.get(n, 0), items=items.get(n, 0)) for n in order
    )
