"""Which tools a plan advertises, resolved once at session open and pinned on the plan.

Rule 1: tools with model_visible=false are removed before anything else looks at them.
Rule 2: authorization and the session environment filter next. A tool whose required scopes
are not all granted, or whose session binding has no selected binding, is absent: it was
never a candidate, so it is not "skipped" either.
Rule 3: an operational session's typed tasks send no tools to a model: it pins an empty set.
Rule 4: skill.load is a candidate only while the pinned skill catalog is non-empty, and
tool.call only while something is deferred and the agent enables it (a control tool with no
valid argument only invites guessed names).
Rule 5: definitions are handed out in one order (`_ORIGIN_ORDER`): in a session bound to a
website profile the browser tools first (required), then tool.call when it is needed, then
the agent's enabled_tools in first-occurrence order minus its configured deferrals, then
discovered tools: reads first, then by server or device, then by name (`_discovered_key`).
Rule 6: definitions fit 30 items and 9,000 tokens, measured on the provider-visible form.
What happens to a tool that does not fit is a table (`_WHEN_FULL`): a required or explicit
tool over the token cap fails the plan; anything else overflows to the index.
Rule 7: with tool.call, every candidate without a definition becomes an index entry, the
configured deferrals first and then the overflow, in the order above, under 40 entries and
2,000 tokens. Without tool.call nothing is deferred. Whatever fits neither is skipped and
its name recorded on the plan event: no tool leaves the roster silently.
Rule 8: tool.call takes its definition slot ahead of the explicit tools (an explicit tool
it pushes past the thirtieth slot is indexed), but its tokens are charged after theirs:
whether an explicit roster fits is decided without tool.call, so a discovered tool that
brings tool.call in can never fail the plan. When tool.call does not fit beside the
required and explicit definitions, nothing is deferred, as without tool.call.
Rule 9: the defined set renders sorted by name; index entries render in index order.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict

from .canonical import canonical_bytes, sha256_hex
from .caps import CLASS_CAPS
from .enums import SessionKind, SideEffect
from .errors import InvalidFieldError, PreconditionError
from .spec import PlanSpec, ToolSpec

__all__ = [
    "BROWSER_TOOLS",
    "SKILL_LOAD",
    "TOOL_CALL",
    "PinnedTool",
    "Roster",
    "advertisable",
    "first_sentence",
    "fit_in_order",
    "index_line",
    "pinned_tools",
    "resolve_roster",
    "scope_hashes",
    "unknown_tool_names",
]

TOOL_CALL = "tool.call"
SKILL_LOAD = "skill.load"
# ADR-0130: a session bound to a website profile must define these, in this order.
BROWSER_TOOLS = ("browser.navigate", "browser.observe", "browser.act")

_DEFINITIONS = CLASS_CAPS["tool_definitions"]
_INDEX = CLASS_CAPS["deferred_tool_index"]

Measure = Callable[[ToolSpec], int]
T = TypeVar("T")


class _Origin(Enum):
    REQUIRED = "required"  # browser tools of a website-profile session
    EXPLICIT = "explicit"  # named in AgentSpec.enabled_tools
    DISCOVERED = "discovered"  # everything else the principal may use


class _Full(Enum):
    FAIL = "fail the plan"
    OVERFLOW = "overflow to the index"


# What a candidate that does not fit the definition class becomes: (item cap, token cap).
# A configured tool past the thirtieth slot is cut as silently as a discovered one; an
# explicitly enabled capability over the token cap is a configuration error. (tool.call is
# not in the table: it is defined only where it fits, Rule 8.)
_WHEN_FULL: dict[_Origin, tuple[_Full, _Full]] = {
    _Origin.REQUIRED: (_Full.FAIL, _Full.FAIL),
    _Origin.EXPLICIT: (_Full.OVERFLOW, _Full.FAIL),
    _Origin.DISCOVERED: (_Full.OVERFLOW, _Full.OVERFLOW),
}

# Reads keep their definitions: a deferred tool costs an extra model step, and a read is
# usually a request's first. UNSPECIFIED is treated as the most consequential.
_SIDE_EFFECT_RANK: dict[SideEffect, int] = {
    SideEffect.NONE: 0,
    SideEffect.WORKSPACE_READ: 0,
    SideEffect.NETWORK_READ: 0,
    SideEffect.WORKSPACE_WRITE: 1,
    SideEffect.NETWORK_WRITE: 1,
    SideEffect.EXTERNAL_ACTION: 1,
    SideEffect.UNSPECIFIED: 2,
}


@dataclass(frozen=True, slots=True)
class Roster:
    defined: tuple[ToolSpec, ...]  # advertised by definition, sorted by name
    deferred: tuple[ToolSpec, ...]  # advertised by index entry, in index order
    skipped: tuple[str, ...]  # fit neither; recorded on the plan event, in rank order


class PinnedTool(BaseModel):
    """What a worker's call-time policy check needs about one advertised tool.

    A revoked tool stays pinned and advertised; the worker denies the call.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    defined: bool  # True: row 5 definition; False: row 6 index entry
    required_scopes: tuple[str, ...]
    side_effect: SideEffect
    builtin: bool
    spec_sha256: str  # of the tool's canonical pinned spec


@dataclass(frozen=True, slots=True)
class _Candidate:
    tool: ToolSpec
    origin: _Origin


def scope_hashes(scopes: Iterable[str]) -> tuple[str, ...]:
    """authority_scope_hashes: sorted SHA-256 hex of each distinct scope (outside the prompt)."""
    return tuple(sorted({sha256_hex(s.encode("utf-8")) for s in scopes}))


def pinned_tools(roster: Roster) -> tuple[PinnedTool, ...]:
    """The pinned view: definitions (sorted by name), then index entries (index order)."""
    return tuple(
        PinnedTool(
            name=tool.name,
            defined=defined,
            required_scopes=tool.required_scopes,
            side_effect=tool.side_effect,
            builtin=tool.builtin,
            spec_sha256=sha256_hex(canonical_bytes(tool.canonical())),
        )
        for defined, tools in ((True, roster.defined), (False, roster.deferred))
        for tool in tools
    )


def fit_in_order(
    items: Sequence[T], *, cap_items: int, cap_tokens: int, measure: Callable[[T], int]
) -> tuple[tuple[T, ...], tuple[T, ...]]:
    """First-fit in order under an item cap and a token cap: (fitted, left out).

    An item that does not fit is left out and the next one is tried, so a large entry never
    leaves a slot empty that a smaller one after it could have used.
    """
    fitted: list[T] = []
    left: list[T] = []
    tokens = 0
    for item in items:
        if len(fitted) < cap_items:
            cost = measure(item)
            if tokens + cost <= cap_tokens:
                fitted.append(item)
                tokens += cost
                continue
        left.append(item)
    return tuple(fitted), tuple(left)


def unknown_tool_names(spec: PlanSpec) -> tuple[str, ...]:
    """Names the agent enables or defers that no tool in spec.tools defines, once each in
    first mention order: they refer to nothing (a typo, a tool of a server that is absent).
    A defined tool withheld by Rules 1-4 is not one: it is absent by design."""
    defined = {t.name for t in spec.tools}
    named = (*spec.agent.enabled_tools, *spec.agent.deferred_tools)
    return tuple(n for n in dict.fromkeys(named) if n not in defined)


def advertisable(spec: PlanSpec) -> tuple[ToolSpec, ...]:
    """The tools a plan of `spec` could advertise under some grant: the model-visible ones,
    bound where a binding is asked, none in an operational session (Rules 1-3); not
    skill.load without a catalog, nor tool.call the agent does not enable, nor a tool it
    defers without tool.call, which no grant brings in (Rules 4 and 7: a review found
    Plan refusing such a tool's wire-name twin), but for the browser tools, which a
    profile's admission defines whatever is deferred (Rule 5; another review). What a
    run's grant can bring in, so what Plan checks beside the roster it resolves."""
    if spec.environment.kind is SessionKind.OPERATIONAL:
        return ()
    bound = set(spec.environment.bound_capabilities)
    indexes = TOOL_CALL in spec.agent.enabled_tools
    deferred = set(spec.agent.deferred_tools)
    could_show: dict[str, bool] = {
        SKILL_LOAD: bool(spec.skills),
        TOOL_CALL: indexes,
        **dict.fromkeys(BROWSER_TOOLS, True),
    }
    return tuple(
        t
        for t in spec.tools
        if t.model_visible
        and (not t.session_binding or t.session_binding in bound)
        and could_show.get(t.name, indexes or t.name not in deferred)
    )


def resolve_roster(
    spec: PlanSpec,
    *,
    has_skills: bool,
    definition_tokens: Measure,
    index_tokens: Measure,
) -> Roster:
    """Select, order and cap the tools a plan advertises (Rules 1-9).

    `definition_tokens` measures a tool's provider-visible definition; `index_tokens` its
    rendered index entry. Both are the plan's exact counts, passed in so this stays pure.

    Raises:
        PreconditionError: PREFIX_CLASS_OVER_CAP (class tool_definitions, field spec.tools)
            when a required or explicitly enabled tool exceeds the token cap, or a required
            browser tool cannot be defined.
        InvalidFieldError: spec.tools, when a website-profile session lacks a browser tool.
    """
    if spec.environment.kind is SessionKind.OPERATIONAL:
        return Roster((), (), ())
    candidates = _candidates(spec, has_skills)
    required = _required(spec, candidates)
    definition_tokens = _by_name_once(definition_tokens)  # a tool is measured once
    enabled = tuple(dict.fromkeys(spec.agent.enabled_tools))
    taken = {t.name for t in required} | {TOOL_CALL}
    deferrals = set(spec.agent.deferred_tools) - taken
    explicit = [
        _Candidate(candidates[n], _Origin.EXPLICIT)
        for n in enabled
        if n in candidates and n not in taken
    ]
    discovered = [
        _Candidate(t, _Origin.DISCOVERED)
        for t in sorted(candidates.values(), key=_discovered_key)
        if t.name not in taken and t.name not in enabled
    ]
    configured = [c.tool for c in (*explicit, *discovered) if c.tool.name in deferrals]
    head = [
        *(_Candidate(t, _Origin.REQUIRED) for t in required),
        *(c for c in explicit if c.tool.name not in deferrals),
    ]
    tail = [c for c in discovered if c.tool.name not in deferrals]

    # Without tool.call: this pass alone decides whether a required or explicit tool fails.
    defined, overflow = _define([*head, *tail], definition_tokens)
    tool_call = candidates.get(TOOL_CALL) if TOOL_CALL in enabled else None
    if tool_call is not None and (configured or overflow):
        with_call = _define_with_call(tool_call, head, tail, definition_tokens)
        if with_call is not None:
            call_defined, call_overflow = with_call
            deferred, unindexed = fit_in_order(
                [*configured, *call_overflow],
                cap_items=_INDEX.cap_items,
                cap_tokens=_INDEX.cap_tokens,
                measure=index_tokens,
            )
            if deferred:  # tool.call is advertised only while the plan defers something
                return Roster(_by_name(call_defined), deferred, tuple(t.name for t in unindexed))
    skipped = (*configured, *overflow)
    return Roster(_by_name(defined), (), tuple(t.name for t in skipped))


def _define_with_call(
    tool_call: ToolSpec, head: list[_Candidate], tail: list[_Candidate], measure: Measure
) -> tuple[tuple[ToolSpec, ...], tuple[ToolSpec, ...]] | None:
    """Rule 8: (defined with tool.call, overflow in rank order), or None when tool.call does
    not fit beside the required and explicit definitions.

    The head (required, then explicit) is defined one slot short, the slot tool.call takes;
    its tokens are charged before tool.call's. That head is a prefix of the pass without
    tool.call, which has already admitted every tool of it, so nothing here can fail.
    """
    defined, overflow = _define(head, measure, item_cap=_DEFINITIONS.cap_items - 1)
    used = sum(measure(t) for t in defined)
    call_tokens = measure(tool_call)
    if used + call_tokens > _DEFINITIONS.cap_tokens:
        return None
    more, more_overflow = _define(
        tail,
        measure,
        item_cap=_DEFINITIONS.cap_items - len(defined) - 1,
        tokens_used=used + call_tokens,
    )
    return (*defined, tool_call, *more), (*overflow, *more_overflow)


def _candidates(spec: PlanSpec, has_skills: bool) -> dict[str, ToolSpec]:
    """Rules 1, 2 and 4 (skill.load); first occurrence of a name wins."""
    granted = set(spec.principal.scopes)
    bound = set(spec.environment.bound_capabilities)
    visible = [t for t in spec.tools if t.model_visible]
    authorized = [
        t
        for t in visible
        if granted.issuperset(t.required_scopes)
        and (not t.session_binding or t.session_binding in bound)
    ]
    out: dict[str, ToolSpec] = {}
    for tool in authorized:
        if tool.name == SKILL_LOAD and not has_skills:
            continue
        out.setdefault(tool.name, tool)
    return out


def _required(spec: PlanSpec, candidates: dict[str, ToolSpec]) -> list[ToolSpec]:
    if not spec.environment.browser_profile_id:
        return []
    missing = [n for n in BROWSER_TOOLS if n not in candidates]
    if missing:
        raise InvalidFieldError(
            "a session bound to a website profile must define "
            + ", ".join(BROWSER_TOOLS)
            + f"; not available to this principal and session: {', '.join(missing)}",
            field="spec.tools",
            metadata={"class": "tool_definitions", "missing": ",".join(missing)},
        )
    return [candidates[n] for n in BROWSER_TOOLS]


def _by_name_once(measure: Measure) -> Measure:
    """`measure`, computed once per tool name (candidate names are unique)."""
    costs: dict[str, int] = {}

    def once(tool: ToolSpec) -> int:
        if tool.name not in costs:
            costs[tool.name] = measure(tool)
        return costs[tool.name]

    return once


def _discovered_key(tool: ToolSpec) -> tuple[int, str, str]:
    return (_SIDE_EFFECT_RANK[tool.side_effect], tool.server, tool.name)


def _define(
    ranked: Sequence[_Candidate],
    measure: Measure,
    *,
    item_cap: int = _DEFINITIONS.cap_items,
    tokens_used: int = 0,
) -> tuple[tuple[ToolSpec, ...], tuple[ToolSpec, ...]]:
    """Hand out definition slots in rank order: (defined, overflow in rank order).

    `item_cap` is what is left of the item cap, `tokens_used` what is spent of the token cap.
    """
    defined: list[ToolSpec] = []
    overflow: list[ToolSpec] = []
    tokens = tokens_used
    for candidate in ranked:
        at_item_cap, over_token_cap = _WHEN_FULL[candidate.origin]
        if len(defined) >= item_cap:
            _refuse_or_overflow(at_item_cap, candidate, "items", overflow)
            continue
        cost = measure(candidate.tool)
        if tokens + cost > _DEFINITIONS.cap_tokens:
            _refuse_or_overflow(
                over_token_cap, candidate, "tokens", overflow, used=tokens, cost=cost
            )
            continue
        defined.append(candidate.tool)
        tokens += cost
    return tuple(defined), tuple(overflow)


def _refuse_or_overflow(
    action: _Full,
    candidate: _Candidate,
    limit: str,
    overflow: list[ToolSpec],
    *,
    used: int = 0,
    cost: int = 0,
) -> None:
    if action is _Full.OVERFLOW:
        overflow.append(candidate.tool)
        return
    cap = _DEFINITIONS.cap_items if limit == "items" else _DEFINITIONS.cap_tokens
    raise PreconditionError(
        f"{candidate.origin.value} tool {candidate.tool.name!r} does not fit the tool"
        f" definitions class ({limit} cap {cap:,}; {used:,} tokens used, it needs {cost:,})",
        # The field a caller fixes, as every other over-cap error names one (plan.py
        # _FIELD_OF_CLASS: tool_definitions -> spec.tools).
        field="spec.tools",
        reason="PREFIX_CLASS_OVER_CAP",
        metadata={
            "class": "tool_definitions",
            "tool": candidate.tool.name,
            "limit": limit,
            "cap": str(cap),
            "tokens": str(used + cost),
        },
    )


def _by_name(tools: Iterable[ToolSpec]) -> tuple[ToolSpec, ...]:
    return tuple(sorted(tools, key=lambda t: t.name))


# --- the deferred index line ---------------------------------------------------------------

_SENTENCE_END = re.compile(r"[.!?](?=\s|$)")


def first_sentence(text: str) -> str:
    """The description's first sentence, whitespace collapsed (all of it when it has none)."""
    flat = " ".join(text.split())
    end = _SENTENCE_END.search(flat)
    return flat[: end.end()] if end else flat


def index_line(tool: ToolSpec) -> str:
    """`name(required..., optional?...): First sentence.`

    Required parameters follow the schema's `required` array; optional ones follow by name,
    never in the order of `properties`: the plan event stores the spec as jsonb, which keeps
    array order but not object key order, and the prefix must re-render from it.
    """
    schema: dict[str, Any] = tool.input_schema
    listed = schema.get("required")
    required = (
        list(dict.fromkeys(r for r in listed if isinstance(r, str)))
        if isinstance(listed, list)
        else []
    )
    properties = schema.get("properties")
    names = properties.keys() if isinstance(properties, dict) else ()
    is_required = set(required)  # once: a wide schema made this per-name rebuild quadratic
    optional = sorted(n for n in names if n not in is_required)
    params = ", ".join([*required, *(f"{n}?" for n in optional)])
    sentence = first_sentence(tool.description)
    head = f"{tool.name}({params})"
    return f"{head}: {sentence}" if sentence else head
