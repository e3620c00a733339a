"""The plan: Region A resolved, rendered once, measured exactly and hashed.

Rule 1: prefix_sha256 = SHA-256 of the RFC 8785 bytes of the prefix document, which holds
every rendered Region A block, the model-visible tool definitions and the full pinned tool
specs. A worker can recompute it from `prefix_document` with any JCS library.
Rule 2: the prefix is counted with the model's tokenizer at plan time and the count is
stored; Build never re-estimates it. Tool definitions count as the roster admits them: the
conservative larger provider form plus framing (tool_schema.definition_tokens).
Rule 3: nothing time-dependent, random or per-request enters the prefix. The plan secret
that keys envelope nonces is an argument and never enters a prompt or the document.
"""

from __future__ import annotations

import json
import re
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from pydantic import BaseModel, ConfigDict

from .body_estimate import request_framing
from .budget import PPM, allocate
from .canonical import canonical_bytes, sha256_hex
from .caps import CEILING_CLASSES, CLASS_CAPS, PREFIX_CEILING_TOKENS
from .compaction import APART, CALLABLE_NAME, holds_fragment
from .enums import PlanReason, SessionKind
from .envelope import escape_content, wrap
from .errors import InvalidFieldError, PreconditionError
from .framing import BUILDER_VERSION, FRAMING_TEXT
from .invisible import blanks_as_spaces, drop_invisible
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
from .roster import (
    PinnedTool,
    Roster,
    advertisable,
    first_sentence,
    index_line,
    pinned_tools,
    resolve_roster,
    scope_hashes,
)
from .rows import Row
from .skills import pin_catalog
from .snapshot import memory_item_id, pin_snapshot
from .spec import MemoryItemSpec, PlanSpec, SkillSpec, ToolSpec
from .tool_schema import (
    SCHEMA_LISTS,
    SCHEMA_MAPS,
    SCHEMA_ONE,
    definition_item,
    definition_tokens,
    input_schema_problem,
)
from .trust import TrustLevel, envelope_tag

__all__ = [
    "CapacityError",
    "ClassUsage",
    "ContextPlan",
    "ModelFacts",
    "PrefixData",
    "make_plan",
    "prefix_data",
    "session_key",
    "skill_room",
]

TokenCounter = Callable[[str], int]


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """What the plan needs to know about its model (from the model registry)."""

    model_id: str
    provider: str  # "anthropic" | "openai"
    context_window: int
    default_output_reserve: int
    max_output_tokens: int = 0  # the most a request may ask it to write; 0: not known


# The least output a provider's API accepts a request to ask for (OpenAI refuses a
# max_output_tokens below 16: "Expected a value >= 16"); a reserve is sent as that limit.
MIN_OUTPUT_TOKENS = {"openai": 16}


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
    # Sorted SHA-256 of the principal's scopes, outside the prompt; None on a legacy plan.
    authority_scope_hashes: tuple[str, ...] | None = None
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
    # What a worker's call-time policy check needs: every advertised tool, defined first.
    pinned_tools: tuple[PinnedTool, ...] = ()
    # Catalog entries and snapshot items that fit no slot at plan time (no silent leaving).
    skipped_skill_names: tuple[str, ...] = ()
    skipped_memory_ids: tuple[str, ...] = ()
    # Set by an erasure that redacted this plan's snapshot: the next plan rotates.
    invalidated: bool = False


class CapacityError(InvalidFieldError):
    """A capacity that leaves no room for a body (require_capacity). INVALID_FIELD naming
    the spec's field where the spec is in the request (Plan, Rotate); where the spec is
    the session's own and the request only made the engine rebuild the plan (a run's
    admission, the rotation after an erasure) the shell answers `as_state()` instead."""

    def as_state(self, rebuilt: str) -> PreconditionError:
        """FAILED_PRECONDITION PREFIX_OVER_CAPACITY: the session's spec, rebuilt
        `rebuilt`, does not fit; the request names no field at fault."""
        m = self.metadata
        return PreconditionError(
            f"the session's plan, rebuilt {rebuilt}, leaves no room for a request body: its"
            f" {int(m['prefix_tokens']):,}-token prefix, the"
            f" {int(m['reserve_output_tokens']):,}-token output reserve, the body's 5% margin"
            f" and the request's {int(m['framing_tokens']):,}-token framing fill the"
            f" {int(m['capacity_tokens']):,}-token capacity. Nothing was written; rotate"
            " with a spec that fits (a larger policy cap, a smaller reserve, fewer tools)",
            reason="PREFIX_OVER_CAPACITY",
            metadata=m,
        )


@lru_cache(maxsize=4096)
def session_key(tenant_id: str, session_id: str) -> str:
    """CacheHints.session_key: shared by every run, step and epoch of one session only.
    Memoized: a pure function of two strings, asked for on every Build."""
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
    factor_ppm: int | None = PPM,
) -> ContextPlan:
    """Resolve, render, measure and hash Region A. Pure: same arguments, same plan.
    `factor_ppm`: the estimator factor the capacity is checked at (require_capacity; the
    plan itself does not depend on it), or None for a caller that checks it itself.

    Raises:
        PreconditionError: PREFIX_CLASS_OVER_CAP naming the class (tool_definitions for a
            required or explicitly enabled tool over the token cap; persona).
        CapacityError: INVALID_FIELD naming spec.reserve_output_tokens or
            spec.policy_cap_tokens, when the capacity leaves no room for a body beside the
            prefix (require_capacity); the shell turns it into PREFIX_OVER_CAPACITY where
            the spec is not the caller's (CapacityError.as_state).
    """
    _check_input_schemas(spec)
    catalog, left_skills = pin_catalog(
        spec.skills, lambda s: count_tokens(_render_text(_catalog_entry(s), secret))
    )
    memories, left_memories = pin_snapshot(
        spec.snapshot.items, lambda m: count_tokens(_render_text(_memory_entry(m), secret))
    )
    roster = resolve_roster(
        spec,
        has_skills=bool(catalog),
        definition_tokens=lambda t: definition_tokens(definition_item(t), count_tokens),
        index_tokens=lambda t: count_tokens(_render_text(_index_entry(t), secret)),
    )
    rendered = _render_rows(spec, roster, catalog, memories)
    _check_persona(spec, rendered, secret, count_tokens)
    _check_input_schemas(spec, model.provider, _definable(spec, roster))
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
    classes = _class_usage(system, tools, count_tokens, SYSTEM_JOINS.get(model.provider))
    reserve = spec.reserve_output_tokens or model.default_output_reserve
    _check_reserve(spec, model, reserve)
    prefix_tokens = sum(c.tokens for c in classes)
    offers_browser = "browser.navigate" in {t.name for t in roster.defined} | {
        t.name for t in roster.deferred
    }
    # Row 14 names the allowed origins only where the plan offers browser.navigate.
    origins = spec.environment.allowed_origins if offers_browser else ()
    plan = ContextPlan(
        session_id=session_id,
        epoch=epoch,
        reason=reason,
        prefix_sha256=sha256_hex(document_bytes),
        prefix_tokens=prefix_tokens,
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
        authority_scope_hashes=scope_hashes(spec.principal.scopes),
        snapshot_id=spec.snapshot.snapshot_id,
        snapshot_watermark=spec.snapshot.watermark,
        recall_trace_id=spec.snapshot.recall_trace_id,
        skill_pins=tuple((s.name, s.version) for s in catalog),
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
        allowed_origins=origins,
        pinned_tools=pinned_tools(roster),
        skipped_skill_names=tuple(s.name for s in left_skills),
        skipped_memory_ids=tuple(m.item_id for m in left_memories),
    )
    if factor_ppm is not None:
        require_capacity(plan, count_tokens, factor_ppm)
    return plan


# --- rendering -------------------------------------------------------------------------

_Rendered = list[tuple[Row, ContextItem]]


def _render_rows(
    spec: PlanSpec,
    roster: Roster,
    catalog: tuple[SkillSpec, ...],
    memories: tuple[MemoryItemSpec, ...],
) -> _Rendered:
    """Region A items in row order. Empty rows render no item at all (no bytes): an empty
    persona, index, catalog or snapshot leaves the prefix byte-identical to one without."""
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
    out += [(Row.DEFERRED_TOOL_INDEX, _index_entry(t)) for t in roster.deferred]
    out += [(Row.SKILL_CATALOG, _catalog_entry(s)) for s in catalog]
    out += [(Row.MEMORY_SNAPSHOT, _memory_entry(m)) for m in memories]
    return out


def _index_entry(tool: ToolSpec) -> DeferredIndexEntry:
    """Row 6: builtin entries are trusted configuration; a discovered tool's description is
    external content and renders enveloped."""
    trust = TrustLevel.TRUSTED_CONFIGURATION if tool.builtin else TrustLevel.EXTERNAL_UNTRUSTED
    return DeferredIndexEntry(
        item_id=f"tool:{tool.name}", name=tool.name, line=index_line(tool), trust=trust
    )


def _catalog_entry(skill: SkillSpec) -> SkillCatalogItem:
    return SkillCatalogItem(
        item_id=f"skill:{skill.name}",
        name=skill.name,
        description=skill.description,
        version=skill.version,
        trust=skill.trust,
    )


def _memory_entry(memory: MemoryItemSpec) -> SnapshotItem:
    return SnapshotItem(
        item_id=memory_item_id(memory.item_id), text=memory.text, source=memory.source
    )


def _check_persona(spec: PlanSpec, rendered: _Rendered, secret: bytes, count: TokenCounter) -> None:
    """The persona row never yields: over 30 entries or 2,000 tokens the plan fails."""
    cap = CLASS_CAPS["persona"]
    tokens = sum(count(_render_text(i, secret)) for r, i in rendered if r is Row.PERSONA)
    entries = len(spec.persona.entries)
    if entries > cap.cap_items or tokens > cap.cap_tokens:
        raise PreconditionError(
            f"the persona row ({entries} entries, {tokens:,} tokens) is over its cap"
            f" ({cap.cap_items} entries / {cap.cap_tokens:,} tokens); it is never truncated",
            field="spec.persona.entries",
            reason="PREFIX_CLASS_OVER_CAP",
            metadata={"class": "persona", "tokens": str(tokens), "items": str(entries)},
        )


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
            # The principal edits the persona: an entry's delimiter syntax is escaped and
            # its further lines indented under its dash, so it neither forges an envelope
            # nor starts a line of the platform's in the prefix (an audit; context-builder@4).
            return "Persona:\n" + "\n".join(_persona_line(e) for e in item.entries)
        case DeferredIndexEntry():
            body = f"Deferred tool (call it through tool.call; ? marks optional): {item.line}"
            return _entry(body, trust, item.item_id, "tool-index", secret)
        case SkillCatalogItem():
            body = f"Skill {item.name} ({item.version}): {item.description}"
            return _entry(body, trust, item.item_id, "skill-catalog", secret)
        case SnapshotItem():
            body = f"[{item.source}] {item.text}" if item.source else item.text
            return wrap(
                body, trust=trust, item_id=item.item_id, source="memory:snapshot", secret=secret
            )
    raise TypeError(f"no Region A renderer for {type(item).__name__}")


def _persona_line(entry: str) -> str:
    return "- " + "\n  ".join(escape_content(entry).splitlines() or [""])


def _entry(body: str, trust: TrustLevel, item_id: str, source: str, secret: bytes) -> str:
    """A catalog or index entry in its envelope; rendered bare (TRUSTED_CONFIGURATION), its
    delimiter syntax escaped as an envelope's content is: a skill's or a tool's author
    wrote it, not the platform, and it forged a <user> envelope in the prefix (a review;
    context-builder@3). Its Region B counterpart: core/assemble.py `_render`."""
    if trust is TrustLevel.TRUSTED_CONFIGURATION:
        body = escape_content(body)
    return wrap(body, trust=trust, item_id=item_id, source=source, secret=secret)


@dataclass(frozen=True, slots=True)
class PrefixData:
    """The content of one enveloped Region A entry, without the platform's words around it."""

    item_id: str
    row: Row
    trust: TrustLevel
    text: str


# What each enveloped row shows of the plan's spec, by the entry's item id (as
# _render_text lays it out): a discovered tool's description's first sentence, a catalog
# entry's version and description, a snapshot entry's source and text. A tool's name and
# parameter names and a skill's name are left out, and cut from the entry's own text
# (_unnamed): the model repeats them to call the tool (its own call's arguments name the
# parameters) or load the skill, and held as untrusted text they would elide every such
# call, or every call naming a parameter its description mentions.
_PREFIX_CONTENT: dict[Row, Callable[[PlanSpec], dict[str, tuple[str, ...]]]] = {
    Row.DEFERRED_TOOL_INDEX: lambda spec: {
        f"tool:{t.name}": (
            _unnamed(first_sentence(t.description), _called_names(t.name, t.input_schema)),
        )
        for t in spec.tools
    },
    Row.SKILL_CATALOG: lambda spec: {
        f"skill:{s.name}": (_unnamed(f"({s.version}): {s.description}", (s.name,)),)
        for s in spec.skills
    },
    # A memory's text and its source apart, as a recall line's (compaction.shown_texts):
    # as one "[source] text", a short memory was never held whole (quoted_whole), and its
    # echo passed into a summary (a review).
    Row.MEMORY_SNAPSHOT: lambda spec: {
        memory_item_id(m.item_id): (m.text, m.source) if m.source else (m.text,)
        for m in spec.snapshot.items
    },
}


def prefix_data(plan: ContextPlan, spec: PlanSpec) -> tuple[PrefixData, ...]:
    """What the model reads inside `plan`'s enveloped prefix entries (`spec`: the spec the
    plan was made from, as stored with it): the content below trusted configuration that
    every request on the plan shows. Compaction holds the model's answers and a summary to
    it (core/compaction.py, Rule 3). An entry of another row is given as rendered. Then
    each discovered tool's definition (_definition_data)."""
    content: dict[Row, dict[str, tuple[str, ...]]] = {}
    out = []
    for block in plan.system:
        if envelope_tag(block.trust) is None:
            continue
        if block.row in _PREFIX_CONTENT and block.row not in content:
            content[block.row] = _PREFIX_CONTENT[block.row](spec)
        texts = content.get(block.row, {}).get(block.item_id, (block.text,))
        out += [PrefixData(block.item_id, block.row, block.trust, text) for text in texts]
    return (*out, *_definition_data(plan, spec))


def _definition_data(plan: ContextPlan, spec: PlanSpec) -> list[PrefixData]:
    """A discovered tool's definition (not builtin: its server wrote it) as its index line
    would be held: external content, though row 5 renders it as configuration, bare. Its
    description and every text its schema shows the model (_schema_texts); not its name,
    its parameter names or a name-shaped value an argument is limited to, which the
    model's own calls repeat."""
    builtin = {t.name for t in spec.tools if t.builtin}
    out = []
    for tool in plan.tools:
        if tool.name in builtin:
            continue
        schema = json.loads(tool.input_schema_json)
        texts, values = _schema_texts(schema)
        # Apart, as compaction joins texts: no fragment spans two of them, so a run of
        # short enum values reads as no sentence the server wrote (a review).
        shown = APART.join(t for t in (tool.description, *texts) if t)
        names = (*_called_names(tool.name, schema), *(v for v in values if _NAME.fullmatch(v)))
        out.append(
            PrefixData(
                f"tool-definition:{tool.name}",
                Row.TOOL_DEFINITIONS,
                TrustLevel.EXTERNAL_UNTRUSTED,
                _unnamed(shown, tuple(dict.fromkeys(names))),
            )
        )
    return out


# A name the model repeats to call (compaction.CALLABLE_NAME): anything else (a sentence
# used as a "name") is not cut.
_NAME = CALLABLE_NAME
# A run of name characters, in a text already read as a reader reads it (NFKC: a
# fullwidth letter or low line is its ASCII one; invisible characters dropped).
_RUN = re.compile(r"[A-Za-z0-9_.-]+")


def _called_names(name: str, schema: Any) -> tuple[str, ...]:
    """A tool's name and the property names its schema declares, at any depth of schema
    keywords (core/tool_schema.py's), that look like names (_NAME)."""
    found = [name]
    pending = [schema]
    while pending:
        node = pending.pop()
        if not isinstance(node, dict):
            continue
        properties = node.get("properties")
        if isinstance(properties, dict):
            found += [key for key in properties if isinstance(key, str)]
        for key, value in node.items():
            if key in SCHEMA_MAPS and isinstance(value, dict):
                pending += value.values()
            elif key in SCHEMA_LISTS and isinstance(value, list):
                pending += value
            elif key in SCHEMA_ONE:
                pending.append(value)
    return tuple(n for n in dict.fromkeys(found) if _NAME.fullmatch(n))


def _unnamed(text: str, names: tuple[str, ...]) -> str:
    """`text` with each of `names` cut out (a line break in its place), so no fragment held
    of it is a name: a call naming a parameter the text mentions is no quote of it. Only
    names that could make a call a quote, alone or in the call's JSON (`{"name":"`:
    compaction.holds_fragment); a shorter one cannot, and cutting it ("the", "a" as
    parameter names) would leave a description nothing to hold. A name is found as a
    reader finds it: in the text read as compaction compares it (invisible characters
    dropped, NFKC), in any case, beside any punctuation or other script, and that read
    text is what is held where a name was cut. Only this entry's text: the name stays held
    wherever else it occurs."""
    wanted = {n.casefold() for n in names if holds_fragment(n) or holds_fragment(f'{{"{n}":"')}
    if not wanted:
        return text
    read = unicodedata.normalize("NFKC", drop_invisible(blanks_as_spaces(text)))
    cut = False

    def without(run: re.Match[str]) -> str:
        nonlocal cut
        word = run.group()
        if word.strip(".-").casefold() not in wanted:
            return word
        cut = True
        # The dots and dashes around it (a sentence's full stop, an option's "--") stay.
        head, tail = len(word) - len(word.lstrip(".-")), len(word.rstrip(".-"))
        return f"{word[:head]}\n{word[tail:]}"

    cut_text = _RUN.sub(without, read)
    return cut_text if cut else text


# Schema keywords whose strings are structure (a type, a format, a pointer, a pattern, the
# names a value must have), not text a server writes to the model.
_STRUCTURE = frozenset(
    {
        "type",
        "format",
        "pattern",
        "required",
        "dependentRequired",
        "contentEncoding",
        "contentMediaType",
        "$ref",
        "$schema",
        "$id",
        "$anchor",
        "$dynamicRef",
        "$dynamicAnchor",
    }
)
# Keywords whose values are the only ones an argument may take: the model's call sends one
# verbatim. An example's or a default's value is held whole, name-shaped or not: a call
# that copies one is elided (the safe way to err), and an account number offered as an
# example stays held.
_VALUES = frozenset({"enum", "const"})


def _schema_texts(schema: Any) -> tuple[list[str], list[str]]:
    """What a JSON schema shows the model in its own words, depth first in key order: every
    string (and key of a data object) but the structure's (_STRUCTURE) and the parameter
    names (a schema map's keys); and, of those, the values an argument is limited to
    (_VALUES). Descriptions alone were held before; a server's text in a title, an
    enum, an example or a default reached the model unheld, and a summary could restate
    it as trusted text (a documented gap)."""
    texts: list[str] = []
    values: list[str] = []
    pending: list[Any] = [schema]
    while pending:
        node = pending.pop()
        if not isinstance(node, dict):
            continue
        subschemas: list[Any] = []
        for key, value in node.items():
            if key in SCHEMA_MAPS and isinstance(value, dict):
                subschemas += value.values()
            elif key in SCHEMA_LISTS and isinstance(value, list):
                subschemas += value
            elif key in SCHEMA_ONE and isinstance(value, dict):
                subschemas.append(value)
            elif key not in _STRUCTURE:
                strings = _strings(value)
                texts += strings
                values += strings if key in _VALUES else []
        pending += reversed(subschemas)  # popped in key order: depth first
    return texts, values


def _strings(data: Any) -> list[str]:
    """Every string in JSON data, a key of an object among them, in order."""
    if isinstance(data, str):
        return [data]
    if isinstance(data, list):
        return [text for value in data for text in _strings(value)]
    if isinstance(data, dict):
        return [text for key, value in data.items() for text in (key, *_strings(value))]
    return []


def _definition(tool: ToolSpec) -> ToolDefinitionItem:
    return definition_item(tool)  # the provider-visible form (tool_schema.py)


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


# Where a caller fixes each prefix class (the BadRequest field of an over-cap error).
_FIELD_OF_CLASS: dict[str, str] = {
    "platform_policy": "spec.policy.text",
    "agent_instructions": "spec.agent.instructions",
    "persona": "spec.persona.entries",
    "tool_definitions": "spec.tools",
    "deferred_tool_index": "spec.tools",
    "skill_catalog": "spec.skills",
    "memory_snapshot": "spec.snapshot.items",
}


# The providers whose request carries Region A's blocks joined into one text, by what joins
# them: OpenAI's `instructions` (providers/openai.py), a blank line between blocks.
SYSTEM_JOINS: dict[str, str] = {"openai": "\n\n"}


def _block_tokens(
    system: tuple[PrefixBlock, ...], count: TokenCounter, joined_by: str | None
) -> list[int]:
    """Each system block's tokens, and, where the provider joins them into one text
    (`joined_by`), what the joined text costs beyond their sum (the separators, about a
    token each), on the framing block. Left out, an OpenAI request with 20 skills went 8
    tokens over its budget (an audit). On the framing block, the engine's own text far
    under its 1,000-token cap (about 311, and a prefix has about 100 blocks at most), so
    no class a spec fills to its cap is pushed over it, and an entry a cap admits costs
    what it did (a review: counted on each block, an instructions row at its cap failed,
    and a snapshot at its cap lost a memory)."""
    tokens = [count(b.text) for b in system]
    joined = [b.text for b in system if b.text]  # an empty block is not joined
    if joined_by is None or len(joined) < 2:
        return tokens
    beyond = count(joined_by.join(joined)) - sum(tokens)
    if beyond > 0:
        rows = [b.row for b in system]
        tokens[rows.index(Row.FRAMING) if Row.FRAMING in rows else -1] += beyond
    return tokens


def _class_usage(
    system: tuple[PrefixBlock, ...],
    tools: tuple[ToolDefinitionItem, ...],
    count: TokenCounter,
    joined_by: str | None,
) -> tuple[ClassUsage, ...]:
    """Measure each prefix class exactly against its cap, and refuse a prefix that does
    not fit: prefix classes never yield (no truncation, ever). System blocks are measured
    as their provider is sent them (_block_tokens).

    Raises:
        PreconditionError: PREFIX_CLASS_OVER_CAP for a class over its item or token cap,
            PREFIX_OVER_CEILING for a prefix whose ceiling classes (all but framing) sum
            over 22,000 tokens (naming its largest class; metadata ceiling_classes_tokens
            the sum, ceiling_limit_tokens the ceiling); metadata "class" names the class.
    """
    tokens: dict[str, int] = {}
    items: dict[str, int] = {}
    for block, block_tokens in zip(system, _block_tokens(system, count, joined_by), strict=True):
        name = _CLASS_OF_ROW[block.row]
        tokens[name] = tokens.get(name, 0) + block_tokens
        items[name] = items.get(name, 0) + 1
    # The measure the roster admitted them by (tool_schema.py, Rule 3): the largest provider
    # form plus provider framing. prefix_tokens is subtracted as exact: never the smaller one.
    tokens["tool_definitions"] = sum(definition_tokens(t, count) for t in tools)
    items["tool_definitions"] = len(tools)
    order = [*_CLASS_OF_ROW.values(), "tool_definitions"]
    classes = tuple(
        ClassUsage(
            class_name=n,
            tokens=tokens.get(n, 0),
            items=items.get(n, 0),
            cap_tokens=CLASS_CAPS[n].cap_tokens,
            cap_items=CLASS_CAPS[n].cap_items,
        )
        for n in order
    )
    _check_prefix_caps(classes)
    return classes


def _check_prefix_caps(classes: tuple[ClassUsage, ...]) -> None:
    for c in classes:
        over_items = c.cap_items and c.items > c.cap_items
        if over_items or (c.cap_tokens and c.tokens > c.cap_tokens):
            what = (
                f"{c.items} items (cap {c.cap_items})"
                if over_items
                else f"{c.tokens} tokens (cap {c.cap_tokens})"
            )
            raise PreconditionError(
                f"prefix class {c.class_name} is {what}; the prefix never yields:"
                " shorten it or take content out of it",
                field=_FIELD_OF_CLASS.get(c.class_name),
                reason="PREFIX_CLASS_OVER_CAP",
                metadata=_cap_metadata(c),
            )
    # The spec's classes only: framing counts in prefix_tokens, not against the ceiling.
    ceiling = [c for c in classes if c.class_name in CEILING_CLASSES]
    total = sum(c.tokens for c in ceiling)
    if total > PREFIX_CEILING_TOKENS:
        largest = max(ceiling, key=lambda c: (c.tokens, c.class_name))
        raise PreconditionError(
            f"the prefix classes sum to {total} tokens, over their {PREFIX_CEILING_TOKENS}-token"
            f" ceiling; the largest is {largest.class_name} ({largest.tokens} tokens)",
            field=_FIELD_OF_CLASS.get(largest.class_name),
            reason="PREFIX_OVER_CEILING",
            metadata={
                **_cap_metadata(largest),
                "ceiling_classes_tokens": str(total),
                "ceiling_limit_tokens": str(PREFIX_CEILING_TOKENS),
                # The sum again under its first, misleading name (it is not the ceiling):
                # kept for clients that read it.
                "ceiling_tokens": str(total),
            },
        )


def skill_room(
    plan: ContextPlan, spec: PlanSpec, count_tokens: TokenCounter, factor_ppm: int
) -> int:
    """What the plan's body leaves beside the runtime row and the least run seed every
    request carries, as Build pays them at `factor_ppm` (the tenant's learned correction,
    which checkpoints written now pin): the most its loaded skill bodies, which never
    yield, can cost (core/skills.py Rule 4, skill_cost). A load past it would fail every
    later Build of the session (an audit: one loaded at 5,500 tokens into a 3,936-token
    body; another, with the seed left out, failed a one-character message under the
    server's id). By Build's own arithmetic (assemble._budget), the runtime row at its
    widest date and the seed at its least (assemble.least_seed_cost)."""
    from .assemble import least_seed_cost, runtime_row_cost  # assemble imports this module

    body = allocate(
        context_window=plan.context_window,
        policy_cap_tokens=plan.policy_cap_tokens,
        reserve_output_tokens=plan.max_output_tokens,
        prefix_tokens=plan.prefix_tokens,
        framing_tokens=request_framing(count_tokens, factor_ppm),
    ).body_tokens
    row = runtime_row_cost(
        spec.environment.time_zone,
        spec.principal.scope_label,
        spec.environment.surface,
        plan.allowed_origins,
        count_tokens,
        factor_ppm,
    )
    return body - row - least_seed_cost(count_tokens, factor_ppm)


def _least_body(plan: ContextPlan, count_tokens: TokenCounter, factor_ppm: int) -> int:
    """What every request's body holds, whatever its step, at `factor_ppm`: row 14
    (runtime metadata) on any day (assemble.runtime_row_cost), and the run's seed, at
    least a one-character message (assemble.least_seed_cost). Neither yields."""
    from .assemble import least_seed_cost, runtime_row_cost  # assemble imports this module

    row = runtime_row_cost(
        plan.time_zone,
        plan.principal_scope,
        plan.surface,
        plan.allowed_origins,
        count_tokens,
        factor_ppm,
    )
    return row + least_seed_cost(count_tokens, factor_ppm)


def require_capacity(plan: ContextPlan, count_tokens: TokenCounter, factor_ppm: int) -> None:
    """Refuse a plan whose every Build would fail: capacity (min(window, policy cap)) less
    the output reserve, the exact prefix, the body's safety margin and the request's
    framing (core/budget.py Rule 7) must leave the body room for the runtime metadata row
    and the least run seed every request carries (_least_body), by the allocator's own
    arithmetic (budget.allocate). An audit found a 1-token body accepted, every Build
    failing BUDGET_EXCEEDED naming runtime_metadata, which no caller can shrink; a later
    one, a body holding the row alone failing the shortest run. A body smaller than the
    history floor is accepted: history and the yielding classes give way, and what else
    never yields is checked per request (BUDGET_EXCEEDED).

    The framing, row and seed are scaled by `factor_ppm` as Build scales them: a run's
    checkpoints pin the tenant's estimator factor when it starts (Rule 4), and checked at
    the neutral factor, a tenant whose factor had risen was given a capacity every Build
    failed (an audit). make_plan checks at the factor it is given; the shell's Plan checks
    a new session's at the factor its runs will pin, read under the session's lock, and an
    existing session's spec at the neutral factor.

    The field at fault: the reserve when even the whole window leaves no body (the reserve
    is the model's default when the spec gives none; a smaller one is the fix), else the
    policy cap.

    Raises:
        CapacityError: spec.reserve_output_tokens or spec.policy_cap_tokens.
    """
    framing = request_framing(count_tokens, factor_ppm)
    least_body = _least_body(plan, count_tokens, factor_ppm)
    reserve, prefix_tokens = plan.max_output_tokens, plan.prefix_tokens

    def body(policy_cap: int) -> int:
        return allocate(
            context_window=plan.context_window,
            policy_cap_tokens=policy_cap,
            reserve_output_tokens=reserve,
            prefix_tokens=prefix_tokens,
            framing_tokens=framing,
        ).body_tokens

    if body(plan.policy_cap_tokens) >= least_body:
        return
    capacity = (
        min(plan.context_window, plan.policy_cap_tokens)
        if plan.policy_cap_tokens > 0
        else plan.context_window
    )
    metadata = {
        "capacity_tokens": str(capacity),
        "context_window": str(plan.context_window),
        "reserve_output_tokens": str(reserve),
        "prefix_tokens": str(prefix_tokens),
        "framing_tokens": str(framing),
        "least_body_tokens": str(least_body),
        "estimator_factor_ppm": str(factor_ppm),
    }
    # The figures above are the factor's: say so where it is not the neutral one.
    scaled = "" if factor_ppm == PPM else f" (scaled by the estimator's {factor_ppm / PPM:.2f})"
    if body(0) < least_body:
        raise CapacityError(
            f"an output reserve of {reserve:,} tokens leaves no room for the request in"
            f" {plan.model_id}'s {plan.context_window:,}-token window beside the"
            f" {prefix_tokens:,}-token prefix and the request's framing{scaled}: reserve less",
            field="spec.reserve_output_tokens",
            metadata=metadata,
        )
    raise CapacityError(
        f"a policy cap of {plan.policy_cap_tokens:,} tokens leaves no room for the request"
        f" beside the {reserve:,}-token output reserve, the {prefix_tokens:,}-token prefix"
        f" and the request's framing{scaled}: raise it (0: the model's window)",
        field="spec.policy_cap_tokens",
        metadata=metadata,
    )


def _definable(spec: PlanSpec, roster: Roster) -> set[str]:
    """The tools a plan of `spec` defines, now or once a run's grant admits them: every
    model-visible tool the agent does not defer, and those the roster defines. A hidden
    tool is never sent, and a deferred one only as an index line (a review); an ungranted
    one may be granted at a run's admission, whose rebuild would then fail the run where
    Plan could have told the caller (a second review). Not an operational session's
    tools, nor a tool bound to a capability the session does not select: no admission
    sends them, only a Rotate with a new spec, which is checked again (an audit: they
    failed a Plan that could never send them)."""
    deferred = set(spec.agent.deferred_tools)
    named = {t.name for t in advertisable(spec) if t.name not in deferred}
    return named | {t.name for t in roster.defined}


def _check_input_schemas(
    spec: PlanSpec, provider: str = "", defined: frozenset[str] | set[str] | None = None
) -> None:
    """Every candidate tool's input schema is one the providers take (the API checks the
    caller's spec too; this holds a pinned spec rebuilt by a Rotate without spec, an
    admission or a lineage's continuation to the same rule: a review). With `provider`,
    the tools `defined` (those the request sends as definitions) are held to that
    provider's own rules too: a hidden, ungranted or deferred tool is never sent, so its
    property names are not refused (a review).

    Raises:
        InvalidFieldError: INVALID_FIELD naming spec.tools[i].input_schema_json.
    """
    for i, tool in enumerate(spec.tools):
        if defined is not None and tool.name not in defined:
            continue
        problem = input_schema_problem(tool.input_schema, provider)
        if problem is not None:
            field = f"spec.tools[{i}].input_schema_json"
            raise InvalidFieldError(f"{field} {problem}", field=field)


def _check_reserve(spec: PlanSpec, model: ModelFacts, reserve: int) -> None:
    """The output reserve is sent as the request's output limit (Anthropic's max_tokens,
    OpenAI's max_output_tokens), so one the provider refuses would fail every request of
    the plan: above the model's maximum output, or below the provider's least (an audit).

    Raises:
        InvalidFieldError: INVALID_FIELD naming spec.reserve_output_tokens.
    """
    least = MIN_OUTPUT_TOKENS.get(model.provider, 1)
    most = model.max_output_tokens or reserve
    if least <= reserve <= most:
        return
    bound = (
        f"above {spec.model_id}'s maximum output of {most:,}"
        if reserve > most
        else (f"below the {least} {model.provider} accepts")
    )
    raise InvalidFieldError(
        f"an output reserve of {reserve:,} tokens is {bound}: the provider would refuse every"
        " request",
        field="spec.reserve_output_tokens",
        metadata={
            "reserve_output_tokens": str(reserve),
            "max_output_tokens": str(model.max_output_tokens),
            "min_output_tokens": str(least),
        },
    )


def _cap_metadata(c: ClassUsage) -> dict[str, str]:
    return {
        "class": c.class_name,
        "tokens": str(c.tokens),
        "items": str(c.items),
        "cap_tokens": str(c.cap_tokens),
        "cap_items": str(c.cap_items),
    }
