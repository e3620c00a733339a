"""The tool roster: selection, order, caps, the deferred index and canonical identity.

Table-driven cases pin each rule of core/roster.py; a hypothesis property checks the
invariants over generated rosters; the production-shaped roster runs through make_plan
with real measurements; a subprocess probe checks one hash across PYTHONHASHSEEDs.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from context_engine.core.canonical import canonical_bytes
from context_engine.core.enums import PlanReason, SessionKind, SideEffect
from context_engine.core.errors import InvalidFieldError, PreconditionError, RequestError
from context_engine.core.plan import ContextPlan, ModelFacts, make_plan
from context_engine.core.roster import (
    SKILL_LOAD,
    TOOL_CALL,
    Roster,
    first_sentence,
    index_line,
    resolve_roster,
)
from context_engine.core.rows import Row
from context_engine.core.spec import (
    AgentSpec,
    PlanSpec,
    PlatformPolicySpec,
    Principal,
    SessionEnvironment,
    SkillSpec,
    ToolSpec,
)
from context_engine.core.tool_schema import (
    PROVIDER_FRAMING_TOKENS,
    definition_item,
    definition_tokens,
    visible_input_schema,
)
from context_engine.core.trust import TrustLevel

REPO = Path(__file__).resolve().parents[2]
MODEL = ModelFacts("m", "anthropic", 200_000, 8_192)
SECRET = b"s" * 32
READ, WRITE = SideEffect.NETWORK_READ, SideEffect.NETWORK_WRITE


def count(text: str) -> int:
    """The shipped heuristic: three UTF-8 bytes per token, rounded up."""
    return math.ceil(len(text.encode("utf-8")) / 3)


def tool(name: str, **kw: Any) -> ToolSpec:
    kw.setdefault("input_schema", {"type": "object"})
    kw.setdefault("side_effect", SideEffect.NONE)
    kw.setdefault("description", f"The {name} tool.")
    return ToolSpec(name=name, **kw)


# --- table-driven roster cases -------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    id: str
    tools: tuple[ToolSpec, ...]
    enabled: tuple[str, ...] = ()
    deferred: tuple[str, ...] = ()
    scopes: tuple[str, ...] = ()
    bound: tuple[str, ...] = ()
    profile: str = ""
    kind: SessionKind = SessionKind.INTERACTIVE
    has_skills: bool = False
    cost: dict[str, int] = field(default_factory=dict)  # definition tokens; default 100
    index_cost: dict[str, int] = field(default_factory=dict)  # index tokens; default 10
    defined: tuple[str, ...] | None = None  # sorted by name, as the roster renders them
    index: tuple[str, ...] | None = None  # in index order
    skipped: tuple[str, ...] | None = None  # in rank order
    fails: tuple[str, dict[str, str]] | None = None  # (reason, metadata subset)


def _n(prefix: str, count_: int) -> tuple[str, ...]:
    return tuple(f"{prefix}{i:02d}" for i in range(count_))


_EXPLICIT_31 = _n("cfg.", 31)
_EXPLICIT_28 = _n("cfg.", 28)
_EXPLICIT_30 = _n("cfg.", 30)
_DISCOVERED = (
    tool("x.write", side_effect=WRITE, server="a"),
    tool("y.read", side_effect=READ, server="b"),
    tool("b.read", side_effect=SideEffect.NONE, server="b"),
    tool("z.read", side_effect=SideEffect.WORKSPACE_READ, server="a"),
    tool("u.unspecified", side_effect=SideEffect.UNSPECIFIED),
)
_BROWSER = tuple(
    tool(n, builtin=True) for n in ("browser.act", "browser.navigate", "browser.observe")
)

CASES: tuple[Case, ...] = (
    Case(
        "hidden tools go before anything else, even explicitly enabled ones",
        tools=(tool("a"), tool("hidden", model_visible=False)),
        enabled=("hidden", "a"),
        defined=("a",),
        index=(),
        skipped=(),
    ),
    Case(
        "unauthorized and unbound tools are absent, not skipped",
        tools=(
            tool("mail.send", required_scopes=("mail.send",)),
            tool("mail.read", required_scopes=("mail.read",)),
            tool("site.fill", session_binding="website_profile"),
        ),
        scopes=("mail.read",),
        defined=("mail.read",),
        index=(),
        skipped=(),
    ),
    Case(
        "a selected session binding admits its tool",
        tools=(tool("site.fill", session_binding="website_profile"),),
        bound=("website_profile",),
        defined=("site.fill",),
    ),
    Case(
        "an operational session pins an empty set",
        tools=(tool("a"), tool(TOOL_CALL, builtin=True)),
        enabled=("a", TOOL_CALL),
        deferred=("a",),
        kind=SessionKind.OPERATIONAL,
        defined=(),
        index=(),
        skipped=(),
    ),
    Case(
        "explicit tools take slots in first-occurrence order, not name order",
        tools=tuple(tool(n) for n in _EXPLICIT_31),
        enabled=(*reversed(_EXPLICIT_31), "cfg.30"),
        defined=tuple(sorted(_EXPLICIT_31[1:])),
        index=(),
        skipped=("cfg.00",),
    ),
    Case(
        "configured deferrals go to the index when the agent enables tool.call",
        tools=(tool("a"), tool("b", builtin=True), tool(TOOL_CALL, builtin=True)),
        enabled=(TOOL_CALL, "a", "b"),
        deferred=("b",),
        defined=("a", TOOL_CALL),
        index=("b",),
        skipped=(),
    ),
    Case(
        "an agent without tool.call defers nothing and records its skips",
        tools=(tool("a"), tool("b"), tool(TOOL_CALL, builtin=True)),
        enabled=("a", "b"),
        deferred=("b",),
        defined=("a",),
        index=(),
        skipped=("b",),
    ),
    Case(
        "tool.call is not advertised while nothing is deferred",
        tools=(tool("a"), tool(TOOL_CALL, builtin=True)),
        enabled=(TOOL_CALL, "a"),
        defined=("a",),
        index=(),
        skipped=(),
    ),
    Case(
        "discovered tools: reads first, then by server, then by name; overflow indexed so",
        tools=(*(tool(n) for n in _EXPLICIT_28), tool(TOOL_CALL, builtin=True), *_DISCOVERED),
        enabled=(*_EXPLICIT_28, TOOL_CALL),
        defined=tuple(sorted((*_EXPLICIT_28, TOOL_CALL, "z.read"))),
        index=("b.read", "y.read", "x.write", "u.unspecified"),
        skipped=(),
    ),
    Case(
        "without tool.call the same overflow is skipped in the same order",
        tools=(*(tool(n) for n in _EXPLICIT_28), *_DISCOVERED),
        enabled=_EXPLICIT_28,
        defined=tuple(sorted((*_EXPLICIT_28, "z.read", "b.read"))),
        index=(),
        skipped=("y.read", "x.write", "u.unspecified"),
    ),
    Case(
        "a discovered tool over the token cap is skipped and a smaller one after it fits",
        tools=(tool("big.read"), tool("c.read"), tool("small.write", side_effect=WRITE)),
        cost={"big.read": 9_001, "c.read": 100, "small.write": 40},
        defined=("c.read", "small.write"),
        skipped=("big.read",),
    ),
    Case(
        "an explicitly enabled tool over the token cap fails the plan",
        tools=(tool("a"), tool("huge")),
        enabled=("a", "huge"),
        cost={"a": 100, "huge": 8_901},
        fails=("PREFIX_CLASS_OVER_CAP", {"class": "tool_definitions", "tool": "huge"}),
    ),
    Case(
        "an explicitly enabled tool past the thirtieth slot is cut like a discovered one",
        tools=tuple(tool(n) for n in _EXPLICIT_31),
        enabled=_EXPLICIT_31,
        cost={"cfg.30": 50_000},  # never measured: the item cap binds first
        defined=_EXPLICIT_31[:30],
        skipped=("cfg.30",),
    ),
    Case(
        "a website-profile session defines the browser tools first, whatever the deferrals",
        tools=(*(tool(n) for n in _EXPLICIT_30), *_BROWSER, tool(TOOL_CALL, builtin=True)),
        enabled=(TOOL_CALL, *_EXPLICIT_30),
        deferred=("browser.act",),
        profile="profile-1",
        defined=tuple(
            ("browser.act", "browser.navigate", "browser.observe", TOOL_CALL, *_EXPLICIT_30[:26])
        ),
        index=_EXPLICIT_30[26:],
        skipped=(),
    ),
    Case(
        "a website-profile session that cannot have a browser tool fails",
        tools=(
            tool("browser.navigate"),
            tool("browser.observe"),
            tool("browser.act", required_scopes=("web.act",)),
        ),
        profile="profile-1",
        fails=("INVALID_FIELD", {"class": "tool_definitions", "missing": "browser.act"}),
    ),
    Case(
        "a required browser tool over the token cap fails",
        tools=_BROWSER,
        profile="profile-1",
        cost={"browser.observe": 9_001},
        fails=("PREFIX_CLASS_OVER_CAP", {"class": "tool_definitions"}),
    ),
    Case(
        "skill.load is not a candidate while the skill catalog is empty",
        tools=(tool(SKILL_LOAD, builtin=True), tool("a")),
        enabled=(SKILL_LOAD, "a"),
        defined=("a",),
        skipped=(),
    ),
    Case(
        "skill.load is advertised while the catalog has a skill",
        tools=(tool(SKILL_LOAD, builtin=True), tool("a")),
        enabled=(SKILL_LOAD, "a"),
        has_skills=True,
        defined=("a", SKILL_LOAD),
    ),
    Case(
        "the index holds 40 entries; the 41st is skipped",
        tools=(tool(TOOL_CALL, builtin=True), *(tool(n) for n in _n("d.", 41))),
        enabled=(TOOL_CALL,),
        deferred=_n("d.", 41),
        defined=(TOOL_CALL,),
        index=_n("d.", 40),
        skipped=("d.40",),
    ),
    Case(
        "the index holds 2,000 tokens, first fit in order",
        tools=(tool(TOOL_CALL, builtin=True), *(tool(n) for n in _n("d.", 5))),
        enabled=(TOOL_CALL,),
        deferred=_n("d.", 5),
        index_cost={"d.00": 600, "d.01": 600, "d.02": 600, "d.03": 600, "d.04": 200},
        defined=(TOOL_CALL,),
        index=("d.00", "d.01", "d.02", "d.04"),
        skipped=("d.03",),
    ),
    Case(
        "when nothing fits the index, tool.call is not advertised either",
        tools=(tool(TOOL_CALL, builtin=True), tool("a"), tool("b")),
        enabled=(TOOL_CALL, "a"),
        deferred=("b",),
        index_cost={"b": 2_001},
        defined=("a",),
        index=(),
        skipped=("b",),
    ),
    Case(
        "tool.call is charged after the explicit tools: no room for it skips the overflow",
        tools=(tool(TOOL_CALL, builtin=True), tool("a"), tool("b"), tool("c.read")),
        enabled=(TOOL_CALL, "a", "b"),
        cost={"a": 4_000, "b": 4_950, "c.read": 100, TOOL_CALL: 100},
        defined=("a", "b"),
        index=(),
        skipped=("c.read",),
    ),
    Case(
        "no room for tool.call beside the explicit tools skips the configured deferrals too",
        tools=(tool(TOOL_CALL, builtin=True), tool("a"), tool("b"), tool("d")),
        enabled=(TOOL_CALL, "a", "b", "d"),
        deferred=("d",),
        cost={"a": 4_500, "b": 4_500, TOOL_CALL: 1},
        defined=("a", "b"),
        index=(),
        skipped=("d",),
    ),
    Case(
        "tool.call fits beside the explicit tools: the discovered overflow is indexed",
        tools=(tool(TOOL_CALL, builtin=True), tool("a"), tool("b"), tool("c.read")),
        enabled=(TOOL_CALL, "a", "b"),
        cost={"a": 4_000, "b": 4_800, "c.read": 300, TOOL_CALL: 100},
        defined=("a", "b", TOOL_CALL),
        index=("c.read",),
        skipped=(),
    ),
)


def _spec(case: Case) -> PlanSpec:
    return PlanSpec(
        model_id="m",
        agent=AgentSpec(enabled_tools=case.enabled, deferred_tools=case.deferred),
        principal=Principal(scopes=case.scopes),
        tools=case.tools,
        environment=SessionEnvironment(
            kind=case.kind, bound_capabilities=case.bound, browser_profile_id=case.profile
        ),
        policy=PlatformPolicySpec(version="v", text="policy"),
    )


def _resolve(case: Case) -> Roster:
    return resolve_roster(
        _spec(case),
        has_skills=case.has_skills,
        definition_tokens=lambda t: case.cost.get(t.name, 100),
        index_tokens=lambda t: case.index_cost.get(t.name, 10),
    )


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_roster_case(case: Case) -> None:
    if case.fails is not None:
        with pytest.raises(RequestError) as caught:
            _resolve(case)
        reason, metadata = case.fails
        assert caught.value.reason == reason
        # INVALID_FIELD is the request's fault (INVALID_ARGUMENT); the rest are the state's.
        expected = InvalidFieldError if reason == "INVALID_FIELD" else PreconditionError
        assert type(caught.value) is expected
        assert metadata.items() <= caught.value.metadata.items()
        # Every roster refusal names the field a caller fixes (BadRequest), as the other
        # over-cap errors do: the tools are the caller's spec.tools.
        assert caught.value.field == "spec.tools"
        return
    roster = _resolve(case)
    names = [t.name for t in roster.defined]
    assert names == sorted(names)
    if case.defined is not None:
        assert tuple(names) == tuple(sorted(case.defined))
    if case.index is not None:
        assert tuple(t.name for t in roster.deferred) == case.index
    if case.skipped is not None:
        assert roster.skipped == case.skipped


# --- invariants over generated rosters ----------------------------------------------------

_EFFECTS = st.sampled_from(list(SideEffect))


@st.composite
def rosters(draw: st.DrawFn) -> tuple[PlanSpec, dict[str, int], dict[str, int], bool]:
    names = draw(st.lists(st.sampled_from(_n("t.", 60)), unique=True, min_size=0, max_size=60))
    with_call = draw(st.booleans())
    tools = [
        tool(
            n,
            side_effect=draw(_EFFECTS),
            server=draw(st.sampled_from(["", "mcp.a", "mcp.b"])),
            required_scopes=draw(st.sampled_from([(), ("s1",), ("s2",)])),
            model_visible=draw(st.sampled_from([True, True, True, False])),
        )
        for n in names
    ]
    if with_call:
        tools.append(tool(TOOL_CALL, builtin=True))
    enabled = draw(st.lists(st.sampled_from(names), max_size=40)) if names else []
    if with_call and draw(st.booleans()):
        enabled.append(TOOL_CALL)
    deferred = draw(st.lists(st.sampled_from(names), max_size=10)) if names else []
    cost = {n: draw(st.integers(1, 700)) for n in [*names, TOOL_CALL]}
    index_cost = {n: draw(st.integers(1, 120)) for n in names}
    spec = PlanSpec(
        model_id="m",
        agent=AgentSpec(enabled_tools=tuple(enabled), deferred_tools=tuple(deferred)),
        principal=Principal(scopes=draw(st.sampled_from([(), ("s1",), ("s1", "s2")]))),
        tools=tuple(tools),
        policy=PlatformPolicySpec(version="v", text="p"),
    )
    return spec, cost, index_cost, draw(st.booleans())


@settings(max_examples=300, deadline=None)
@given(rosters())
def test_roster_invariants(drawn: tuple[PlanSpec, dict[str, int], dict[str, int], bool]) -> None:
    spec, cost, index_cost, has_skills = drawn
    try:
        roster = resolve_roster(
            spec,
            has_skills=has_skills,
            definition_tokens=lambda t: cost[t.name],
            index_tokens=lambda t: index_cost[t.name],
        )
    except PreconditionError as error:
        # Only an explicitly enabled tool can fail the plan, by tokens, and never because
        # of tool.call: the same roster fails without it.
        assert error.metadata["class"] == "tool_definitions"
        assert error.metadata["tool"] in spec.agent.enabled_tools
        assert error.metadata["tool"] != TOOL_CALL
        assert error.metadata["limit"] == "tokens"
        without_call = AgentSpec(
            enabled_tools=tuple(n for n in spec.agent.enabled_tools if n != TOOL_CALL),
            deferred_tools=spec.agent.deferred_tools,
        )
        with pytest.raises(PreconditionError):
            resolve_roster(
                spec.model_copy(update={"agent": without_call}),
                has_skills=has_skills,
                definition_tokens=lambda t: cost[t.name],
                index_tokens=lambda t: index_cost[t.name],
            )
        return
    granted = set(spec.principal.scopes)
    candidates = {
        t.name
        for t in spec.tools
        if t.model_visible and granted.issuperset(t.required_scopes) and t.name != TOOL_CALL
    }
    defined = [t.name for t in roster.defined]
    deferred = [t.name for t in roster.deferred]
    # Every candidate is advertised once or named as skipped: none leaves silently.
    advertised = [n for n in defined if n != TOOL_CALL] + deferred + list(roster.skipped)
    assert sorted(advertised) == sorted(candidates)
    assert defined == sorted(defined)
    # The caps hold.
    assert len(defined) <= 30 and sum(cost[n] for n in defined) <= 9_000
    assert len(deferred) <= 40 and sum(index_cost[n] for n in deferred) <= 2_000
    # tool.call only while something is deferred and the agent enables it; and the
    # index only with tool.call.
    assert (TOOL_CALL in defined) == bool(deferred)
    if deferred:
        assert TOOL_CALL in spec.agent.enabled_tools
    # No slot left empty while a tool is skipped, unless a cap's tokens bind.
    used = sum(cost[n] for n in defined)
    index_used = sum(index_cost[n] for n in deferred)
    for name in roster.skipped:
        if deferred:
            assert len(deferred) == 40 or index_cost[name] > 2_000 - index_used
        elif name not in spec.agent.deferred_tools:
            assert len(defined) == 30 or cost[name] > 9_000 - used


# --- the index line ------------------------------------------------------------------------


def test_index_line_lists_required_in_schema_order_then_optional_by_name() -> None:
    search = tool(
        "web.search",
        description="Search the web for pages. Returns at most ten results.\nMore text.",
        input_schema={
            "type": "object",
            "properties": {
                "site": {"type": "string"},
                "query": {"type": "string"},
                "limit": {"type": "integer"},
                "after": {"type": "string"},
            },
            "required": ["query", "after"],
        },
    )
    assert (
        index_line(search) == "web.search(query, after, limit?, site?): Search the web for pages."
    )
    assert index_line(tool("clock.now", description="")) == "clock.now()"


class _CountedName(str):
    """A parameter name that counts how often it is hashed (each set or dict it enters)."""

    hashes = 0

    def __hash__(self) -> int:
        _CountedName.hashes += 1
        return str.__hash__(self)


def test_index_line_reads_the_required_names_a_bounded_number_of_times() -> None:
    """The set of required names was rebuilt for every property (`set(required)` inside
    the generator): a wide discovered schema cost properties x required, at every Plan and
    Rotate. Counted, not timed: each required name is hashed a constant number of times,
    whatever the number of properties."""
    names = [f"p{i}" for i in range(2_000)]
    required = [_CountedName(n) for n in names[::2]]
    wide = tool(
        "wide.tool",
        description="Wide.",
        input_schema={
            "type": "object",
            "properties": {name: {} for name in names},
            "required": required,
        },
    )
    _CountedName.hashes = 0
    line = index_line(wide)
    assert line.startswith("wide.tool(p0, p2, p4,") and "p1?" in line
    assert _CountedName.hashes <= 3 * len(required), _CountedName.hashes


@pytest.mark.parametrize(
    ("text", "sentence"),
    [
        ("Fetch a page. Then more.", "Fetch a page."),
        ("Fetch a page!  Really", "Fetch a page!"),
        ("Reads v1.2 files. Fast.", "Reads v1.2 files."),
        ("no terminator here", "no terminator here"),
        ("  spread\n over lines. x", "spread over lines."),
        ("", ""),
    ],
)
def test_first_sentence(text: str, sentence: str) -> None:
    assert first_sentence(text) == sentence


# --- the provider-visible form -------------------------------------------------------------


def test_visible_schema_drops_generated_titles_and_empty_defaults_only() -> None:
    schema = {
        "title": "WebSearchArgs",
        "type": "object",
        "properties": {
            "max_results": {"title": "Max Results", "type": "integer", "default": 10},
            "q": {"title": "Search phrase", "type": "string", "minLength": 1},
            "tags": {"type": "array", "items": {"type": "string"}, "default": []},
            "note": {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None},
            "strict": {"type": "boolean", "default": False, "title": "strict"},
            "title": {"type": "string", "default": ""},
            "default": {"type": "string", "enum": [{"title": "Kept"}]},
            "mode": {"$ref": "#/$defs/Mode", "default": "fast"},
        },
        "required": ["q"],
        "$defs": {"Mode": {"title": "Mode", "enum": ["fast", "slow"], "description": "How."}},
        "additionalProperties": False,
    }
    assert visible_input_schema(schema) == {
        "type": "object",
        "properties": {
            "max_results": {"type": "integer", "default": 10},
            "q": {"title": "Search phrase", "type": "string", "minLength": 1},
            "tags": {"type": "array", "items": {"type": "string"}},
            "note": {"anyOf": [{"type": "string"}, {"type": "null"}]},
            "strict": {"type": "boolean", "default": False},
            "title": {"type": "string"},
            "default": {"type": "string", "enum": [{"title": "Kept"}]},
            "mode": {"$ref": "#/$defs/Mode", "default": "fast"},
        },
        "required": ["q"],
        "$defs": {"Mode": {"enum": ["fast", "slow"], "description": "How."}},
        "additionalProperties": False,
    }


def test_hidden_parts_of_a_tool_cost_nothing_and_are_never_sent() -> None:
    lean = tool(
        "mail.search", input_schema={"type": "object", "properties": {"q": {"type": "string"}}}
    )
    heavy = lean.model_copy(
        update={
            "output_schema": {"type": "object", "description": "x" * 5_000},
            "policy": {"timeout_ms": 30_000, "notes": "y" * 5_000},
            "required_scopes": ("mail.read", "mail.admin"),
        }
    )
    assert definition_item(heavy) == definition_item(lean)
    assert definition_tokens(definition_item(heavy), count) == definition_tokens(
        definition_item(lean), count
    )
    item = definition_item(lean)
    assert (
        definition_tokens(item, count)
        >= count(
            canonical_bytes(
                {
                    "name": item.name,
                    "description": item.description,
                    "input_schema": json.loads(item.input_schema_json),
                }
            ).decode()
        )
        + PROVIDER_FRAMING_TOKENS
    )


def test_the_tool_class_is_reported_and_budgeted_by_the_measure_that_admitted_it() -> None:
    """The roster admits a definition by its conservative larger provider form plus provider
    framing (definition_tokens). The plan's tool_definitions usage, and the prefix_tokens
    that Build subtracts from the window as exact, counted the engine's own smaller
    ToolDefinition JSON without framing: at least 8 tokens per tool too few."""
    schema = {
        "type": "object",
        "properties": {"q": {"type": "string"}, "n": {"type": "integer"}},
        "required": ["q"],
    }
    tools = tuple(tool(f"t{i:02d}", description="Search.", input_schema=schema) for i in range(20))
    plan = make_plan(
        PlanSpec(model_id="m", tools=tools, policy=_policy()),
        session_id="s",
        epoch=1,
        reason=PlanReason.SESSION_OPENED,
        secret=SECRET,
        model=MODEL,
        count_tokens=count,
    )
    classes = {c.class_name: c for c in plan.prefix_classes}
    usage = classes["tool_definitions"]
    assert usage.items == 20
    assert usage.tokens == sum(definition_tokens(definition_item(t), count) for t in tools)
    assert plan.prefix_tokens == sum(c.tokens for c in plan.prefix_classes)


def _policy() -> PlatformPolicySpec:
    return PlatformPolicySpec(version="v1", text="Platform policy.")


def _plan(spec: PlanSpec, secret: bytes = SECRET, model: ModelFacts = MODEL) -> ContextPlan:
    return make_plan(
        spec,
        session_id="s",
        epoch=1,
        reason=PlanReason.SESSION_OPENED,
        secret=secret,
        model=model,
        count_tokens=count,
    )


def test_full_pinned_spec_is_in_the_hash_but_only_the_visible_part_in_the_prompt() -> None:
    base = tool(
        "mail.search",
        input_schema={"type": "object", "title": "Args", "properties": {"q": {"type": "string"}}},
        required_scopes=("mail.read", "mail.list"),
    )
    spec = PlanSpec(
        model_id="m",
        tools=(base,),
        principal=Principal(scopes=("mail.read", "mail.list")),
        policy=_policy(),
    )
    first = _plan(spec)
    for change in (
        {"output_schema": {"type": "object"}},
        {"policy": {"timeout_ms": 10}},
        {"side_effect": SideEffect.NETWORK_READ},
    ):
        changed = _plan(spec.model_copy(update={"tools": (base.model_copy(update=change),)}))
        assert changed.prefix_sha256 != first.prefix_sha256, change
        assert changed.tool_schema_sha256 != first.tool_schema_sha256, change
        assert changed.tools == first.tools, change
        assert changed.prefix_classes == first.prefix_classes, change
    # The same scopes handed over in another order pin the same plan (ADR-0134).
    reordered = ToolSpec.model_validate(
        {**base.model_dump(), "required_scopes": ["mail.list", "mail.read", "mail.list"]}
    )
    assert (
        _plan(spec.model_copy(update={"tools": (reordered,)})).prefix_sha256 == first.prefix_sha256
    )
    assert json.loads(first.tools[0].input_schema_json) == {
        "type": "object",
        "properties": {"q": {"type": "string"}},
    }
    (pinned,) = first.pinned_tools
    assert pinned.required_scopes == ("mail.list", "mail.read") and pinned.defined


# --- the production-shaped roster -----------------------------------------------------------

# The owner's configured roster (People, Email mode, scheduling, web, workspace): 26 tools.
_CONFIGURED = [
    "people.search",
    "people.get",
    "people.upsert",
    "people.merge",
    "email.search",
    "email.read",
    "email.draft",
    "email.send",
    "email.label",
    "email.unsubscribe",
    "email.mode.set",
    "calendar.list",
    "calendar.create",
    "calendar.update",
    "schedule.create",
    "schedule.list",
    "schedule.cancel",
    "web.search",
    "web.fetch",
    "workspace.read_file",
    "workspace.write_file",
    "workspace.search",
    "clock.now",
    "tasks.list",
    "tasks.update",
    "memory.search",
]
_DISCOVERED_MCP = (
    ("mcp.bland_read.list_calls", READ, "mcp.bland_read"),
    ("mcp.bland_read.get_call", READ, "mcp.bland_read"),
    ("mcp.bland.place_call", SideEffect.EXTERNAL_ACTION, "mcp.bland"),
    ("mcp.drive.search", READ, "mcp.drive"),
    ("mcp.drive.upload", WRITE, "mcp.drive"),
    ("mcp.slack.post", WRITE, "mcp.slack"),
    ("mcp.slack.history", READ, "mcp.slack"),
)


def _realistic(name: str, side_effect: SideEffect, server: str = "", *, builtin: bool) -> ToolSpec:
    words = name.replace(".", " ").replace("_", " ")
    return ToolSpec(
        name=name,
        description=(
            f"Use {words} to act on the owner's {words} data. It returns a structured result "
            "and fails with a reason the owner can read."
        ),
        input_schema={
            "type": "object",
            "properties": {
                "query": {"type": "string", "description": f"What to {words}; free text."},
                "limit": {"type": "integer", "minimum": 1, "maximum": 50, "default": 10},
                "cursor": {"type": "string", "description": "Opaque cursor from a previous page."},
                "fields": {"type": "array", "items": {"type": "string"}, "default": []},
                "account": {"type": "string", "description": "Account to use."},
            },
            "required": ["query"],
            "additionalProperties": False,
        },
        output_schema={"type": "object", "properties": {"items": {"type": "array"}}},
        side_effect=side_effect,
        server=server,
        builtin=builtin,
        policy={"timeout_ms": 20_000},
    )


def _production_spec(*, with_tool_call: bool) -> PlanSpec:
    configured = [_realistic(n, SideEffect.NETWORK_READ, builtin=True) for n in _CONFIGURED]
    discovered = [_realistic(n, e, s, builtin=False) for n, e, s in _DISCOVERED_MCP]
    control = [_realistic(TOOL_CALL, SideEffect.NONE, builtin=True)] if with_tool_call else []
    enabled = (*_CONFIGURED, *([TOOL_CALL] if with_tool_call else []))
    return PlanSpec(
        model_id="m",
        agent=AgentSpec(agent_id="owner", version="1", instructions="Help.", enabled_tools=enabled),
        principal=Principal(scopes=()),
        tools=(*configured, *discovered, *control),
        policy=_policy(),
    )


def _definition_tokens(plan: ContextPlan, names: list[str]) -> int:
    by_name = {t.name: t for t in plan.tools}
    return sum(definition_tokens(by_name[n], count) for n in names)


def test_production_shaped_roster_leaves_no_slot_empty_while_a_tool_is_skipped() -> None:
    plan = _plan(_production_spec(with_tool_call=False))
    configured_tokens = _definition_tokens(plan, _CONFIGURED)
    assert len(_CONFIGURED) == 26 and 5_700 <= configured_tokens <= 6_300
    assert len(plan.tool_names) == 30  # the item cap binds before the token cap
    assert set(_CONFIGURED) <= set(plan.tool_names)
    # The four discovered slots go to reads, by server then name; the rest are skipped.
    assert sorted(set(plan.tool_names) - set(_CONFIGURED)) == [
        "mcp.bland_read.get_call",
        "mcp.bland_read.list_calls",
        "mcp.drive.search",
        "mcp.slack.history",
    ]
    assert plan.skipped_tool_names == ("mcp.bland.place_call", "mcp.drive.upload", "mcp.slack.post")
    assert plan.deferred_tool_names == ()


def test_production_shaped_roster_with_tool_call_defers_instead_of_skipping() -> None:
    plan = _plan(_production_spec(with_tool_call=True))
    assert len(plan.tool_names) == 30 and TOOL_CALL in plan.tool_names
    assert set(_CONFIGURED) <= set(plan.tool_names)
    assert plan.skipped_tool_names == ()
    assert plan.deferred_tool_names == (
        "mcp.slack.history",
        "mcp.bland.place_call",
        "mcp.drive.upload",
        "mcp.slack.post",
    )
    index = [b for b in plan.system if b.row is Row.DEFERRED_TOOL_INDEX]
    assert [b.item_id for b in index] == [f"tool:{n}" for n in plan.deferred_tool_names]
    # Discovered tools' entries are external content, in envelopes.
    assert all(b.trust is TrustLevel.EXTERNAL_UNTRUSTED for b in index)
    assert all(b.text.startswith("<untrusted ") for b in index)
    assert "mcp.slack.history(query, account?, cursor?, fields?, limit?): Use " in index[0].text
    pinned = {p.name: p.defined for p in plan.pinned_tools}
    assert sum(pinned.values()) == 30 and len(pinned) == 34


def test_tool_call_never_makes_an_explicit_roster_that_fits_fail_the_plan() -> None:
    """Explicit tools a and b fit the 9,000-token class together; a discovered tool c does
    not. Enabling tool.call (so that c could be indexed) charged tool.call's definition
    before the explicit tools, and b then "exceeded" the cap: a discovered tool made the
    session fail to open. Spec: explicitly enabled capabilities fail at plan time only if
    they exceed the cap. tool.call's tokens come after theirs; it is left out (and c
    skipped) when it does not fit beside them."""

    def cost(t: ToolSpec) -> int:
        return definition_tokens(definition_item(t), count)

    call = tool(TOOL_CALL, builtin=True)
    a = tool("a", description="w" * 12_000)
    b = tool("b", description="w" * 3 * (9_000 - cost(a) - 58))
    assert cost(a) + cost(b) <= 9_000 < cost(a) + cost(b) + cost(call)
    spec = PlanSpec(
        model_id="m",
        agent=AgentSpec(enabled_tools=("a", "b")),
        tools=(a, b, tool("c"), call),
        policy=PlatformPolicySpec(version="v", text="Policy."),
    )
    without = _plan(spec)
    assert (without.tool_names, without.skipped_tool_names) == (("a", "b"), ("c",))
    enabled = AgentSpec(enabled_tools=("a", "b", TOOL_CALL))
    with_call = _plan(spec.model_copy(update={"agent": enabled}))
    assert with_call.tool_names == ("a", "b")
    assert (with_call.deferred_tool_names, with_call.skipped_tool_names) == ((), ("c",))
    # With room for tool.call, c is indexed instead of skipped; a and b keep definitions.
    big_c = tool("c", description="Big. " + "w" * 16_000)
    smaller = spec.model_copy(
        update={"agent": enabled, "tools": (a, tool("b", description="Short."), big_c, call)}
    )
    indexed = _plan(smaller)
    assert indexed.tool_names == ("a", "b", TOOL_CALL)
    assert (indexed.deferred_tool_names, indexed.skipped_tool_names) == (("c",), ())


def test_builtin_index_entries_are_trusted_configuration() -> None:
    spec = PlanSpec(
        model_id="m",
        agent=AgentSpec(enabled_tools=(TOOL_CALL,), deferred_tools=("clock.now",)),
        tools=(tool(TOOL_CALL, builtin=True), tool("clock.now", builtin=True)),
        policy=_policy(),
    )
    (entry,) = [b for b in _plan(spec).system if b.row is Row.DEFERRED_TOOL_INDEX]
    assert entry.trust is TrustLevel.TRUSTED_CONFIGURATION
    assert entry.text.endswith("clock.now(): The clock.now tool.")


def test_empty_index_and_catalog_render_no_bytes() -> None:
    bare = PlanSpec(model_id="m", tools=(tool("a"),), policy=_policy())
    with_call = bare.model_copy(
        update={
            "tools": (tool("a"), tool(TOOL_CALL, builtin=True), tool(SKILL_LOAD, builtin=True)),
            "agent": AgentSpec(enabled_tools=(TOOL_CALL, SKILL_LOAD, "a")),
        }
    )
    first, second = _plan(bare), _plan(with_call)
    assert second.tool_names == ("a",)  # nothing deferred, no skills: no control tools
    assert second.system == first.system
    assert not any(b.row in (Row.DEFERRED_TOOL_INDEX, Row.SKILL_CATALOG) for b in second.system)
    skilled = _plan(with_call.model_copy(update={"skills": (SkillSpec(name="triage"),)}))
    assert skilled.tool_names == ("a", SKILL_LOAD)


def test_origins_reach_row_14_only_when_the_plan_offers_browser_navigate() -> None:
    env = SessionEnvironment(allowed_origins=("https://a.example",))
    offered = PlanSpec(
        model_id="m", tools=(tool("browser.navigate"),), environment=env, policy=_policy()
    )
    assert _plan(offered).allowed_origins == ("https://a.example",)
    hidden = offered.model_copy(update={"tools": (tool("browser.navigate", model_visible=False),)})
    assert _plan(hidden).allowed_origins == ()


# --- one plan identity across hash seeds ----------------------------------------------------

_PROBE = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, %(tests)r)
    from context_engine.core.enums import SideEffect
    from context_engine.core.spec import ToolSpec
    from test_roster import _plan, _production_spec

    SCOPES = {"mail.read", "mail.send", "calendar.read", "web", "people.read", "drive"}
    spec = _production_spec(with_tool_call=True)
    # Scopes handed over as sets, in this process's hash order.
    tools = tuple(
        ToolSpec.model_validate({**t.model_dump(), "required_scopes": list(SCOPES)})
        for t in spec.tools
    )
    spec = spec.model_copy(update={"tools": tools, "principal": spec.principal.model_validate(
        {"scopes": list(SCOPES)})})
    plan = _plan(spec)
    print(json.dumps({"prefix_sha256": plan.prefix_sha256,
                      "tool_schema_sha256": plan.tool_schema_sha256,
                      "pinned": [p.model_dump(mode="json") for p in plan.pinned_tools],
                      "deferred": list(plan.deferred_tool_names),
                      "order": list(SCOPES)}))
    """
)


def _probe(seed: str) -> dict[str, Any]:
    code = _PROBE % {"tests": str(Path(__file__).resolve().parent)}
    proc = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "PYTHONHASHSEED": seed},
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    result: dict[str, Any] = json.loads(proc.stdout)
    return result


def test_the_same_roster_hashes_identically_under_different_hash_seeds() -> None:
    runs = [_probe(seed) for seed in ("0", "1", "12345")]
    assert len({r["prefix_sha256"] for r in runs}) == 1
    assert len({r["tool_schema_sha256"] for r in runs}) == 1
    assert runs[0]["pinned"] == runs[1]["pinned"] == runs[2]["pinned"]
    assert runs[0]["deferred"] == runs[2]["deferred"]
    # The probe is only meaningful if the sets really iterated differently.
    assert len({tuple(r["order"]) for r in runs}) > 1


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "object", "anyOf": [{"required": ["a"]}, {"required": ["b"]}]},
        {"type": "object", "oneOf": [{"required": ["a"]}]},
        {"type": "object", "allOf": [{"required": ["a"]}]},
        {"type": "array"},
        {},
        # Schema keywords holding what is no schema (an audit: sent as they were, they fail
        # the providers' validation of every request).
        {"type": "object", "properties": "q"},
        {"type": "object", "properties": {"q": {"type": "string"}}, "required": "q"},
        {"type": "object", "properties": {"q": {"type": "string"}}, "required": [1, 2]},
        {"type": "object", "properties": [{"q": {}}]},
        {"type": "object", "properties": {"q": {"type": "array", "items": "string"}}},
        {"type": "object", "properties": {"q": {"anyOf": {"type": "string"}}}},
        {"type": "object", "properties": {"q": {"properties": {"r": 3}}}},
    ],
)
def test_a_schema_the_providers_refuse_is_refused_by_the_plan_itself(
    schema: dict[str, Any],
) -> None:
    """make_plan refuses what the API refuses at Plan, so a pinned spec from before the
    check, rebuilt by a Rotate without spec or an admission, fails naming the tool's
    schema (the shell reports it as the session's state) instead of planning a tool
    Anthropic refuses on every request."""
    spec = PlanSpec(
        model_id="m",
        agent=AgentSpec(enabled_tools=("ok.tool", "bad.tool")),
        tools=(tool("ok.tool"), tool("bad.tool", input_schema=schema)),
        policy=_policy(),
    )
    with pytest.raises(InvalidFieldError) as caught:
        _plan(spec)
    assert caught.value.field == "spec.tools[1].input_schema_json"
    nested = {"type": "object", "properties": {"n": {"anyOf": [{"type": "string"}]}}}
    fine = spec.model_copy(
        update={"tools": (tool("ok.tool"), tool("bad.tool", input_schema=nested))}
    )
    assert _plan(fine).tool_names == ("bad.tool", "ok.tool")


@pytest.mark.parametrize("key", ["filter[id]", "$top", "@odata.type", "日付", "k" * 65, ""])
def test_a_property_name_anthropic_refuses_is_refused_for_an_anthropic_model_only(
    key: str,
) -> None:
    """Anthropic checks the names under an input schema's top-level properties against
    ^[a-zA-Z0-9_.-]{1,64}$ and refuses the whole request (an audit: MCP servers ship
    "filter[id]" and "$top"); OpenAI takes them. So the plan of an Anthropic model refuses
    the tool, naming its schema, and an OpenAI model's plans it."""
    schema = {"type": "object", "properties": {key: {"type": "string"}, "ok_name-1.x": {}}}
    spec = PlanSpec(
        model_id="m",
        agent=AgentSpec(enabled_tools=("bad.tool", "ok.tool")),
        tools=(tool("bad.tool", input_schema=schema),),
        policy=_policy(),
    )
    anthropic, openai = replace(MODEL, provider="anthropic"), replace(MODEL, provider="openai")
    with pytest.raises(InvalidFieldError) as caught:
        _plan(spec, model=anthropic)
    assert caught.value.field == "spec.tools[0].input_schema_json"
    assert "Anthropic refuses" in str(caught.value)
    assert _plan(spec, model=openai).tool_names == ("bad.tool",)
    # A tool the request never sends as a definition (hidden, or deferred to the index) is
    # not held to it (a review: such a tool failed the plan). One whose scope is not
    # granted yet is: a run's grant may define it, and its admission would fail then.
    hidden = tool("bad.tool", input_schema=schema, model_visible=False)
    quiet = spec.model_copy(update={"tools": (tool("ok.tool"), hidden)})
    assert _plan(quiet, model=anthropic).tool_names == ("ok.tool",)
    deferring = spec.model_copy(
        update={
            "tools": (tool("ok.tool"), tool("bad.tool", input_schema=schema), tool("tool.call")),
            "agent": AgentSpec(
                enabled_tools=("ok.tool", "tool.call"), deferred_tools=("bad.tool",)
            ),
        }
    )
    assert "bad.tool" in _plan(deferring, model=anthropic).deferred_tool_names
    ungranted = tool("bad.tool", input_schema=schema, required_scopes=("not.granted",))
    with pytest.raises(InvalidFieldError):
        _plan(spec.model_copy(update={"tools": (tool("ok.tool"), ungranted)}), model=anthropic)
    # Nor a tool no admission can send: an operational session's (it pins no tools), or
    # one bound to a capability the session does not select (an audit: they failed Plan).
    operational = spec.model_copy(
        update={"environment": SessionEnvironment(kind=SessionKind.OPERATIONAL)}
    )
    assert _plan(operational, model=anthropic).tool_names == ()
    unbound = tool("bad.tool", input_schema=schema, session_binding="website_profile")
    elsewhere = spec.model_copy(update={"tools": (tool("ok.tool"), unbound)})
    assert _plan(elsewhere, model=anthropic).tool_names == ("ok.tool",)


@pytest.mark.parametrize(
    "array",
    [
        {"type": "array"},
        {"type": ["string", "array"]},
        {"type": "object", "properties": {"inner": {"type": "array"}}},
        {"anyOf": [{"type": "string"}, {"type": "array"}]},
        {"type": "array", "items": {"type": "array"}},
    ],
)
def test_an_array_schema_without_items_is_refused_for_an_openai_model_only(
    array: dict[str, object],
) -> None:
    """OpenAI refuses a function whose parameters hold an array schema without items
    ("array schema missing items"), strict or not, on every request (an audit: MCP
    servers ship them); Anthropic takes it. The plan of an OpenAI model refuses the tool,
    naming its schema and where the array is."""
    schema = {"type": "object", "properties": {"tags": array}}
    spec = PlanSpec(
        model_id="m",
        agent=AgentSpec(enabled_tools=("bad.tool",)),
        tools=(tool("bad.tool", input_schema=schema),),
        policy=_policy(),
    )
    anthropic, openai = replace(MODEL, provider="anthropic"), replace(MODEL, provider="openai")
    with pytest.raises(InvalidFieldError) as caught:
        _plan(spec, model=openai)
    assert caught.value.field == "spec.tools[0].input_schema_json"
    assert "array schema without items (properties.tags" in str(caught.value)
    assert _plan(spec, model=anthropic).tool_names == ("bad.tool",)
    given = {"type": "object", "properties": {"tags": {"type": "array", "items": {}}}}
    fine = spec.model_copy(update={"tools": (tool("bad.tool", input_schema=given),)})
    assert _plan(fine, model=openai).tool_names == ("bad.tool",)


@pytest.mark.parametrize(
    ("bad", "keyword"),
    [
        ({"type": "integer", "minimum": 0, "exclusiveMinimum": True}, "exclusiveMinimum"),
        ({"type": "int"}, "type"),
        ({"type": ["string", "string"]}, "type"),
        ({"type": "string", "minLength": -1}, "minLength"),
        ({"type": "string", "maxLength": 2.5}, "maxLength"),
        ({"type": "number", "multipleOf": 0}, "multipleOf"),
        ({"type": "array", "items": {}, "uniqueItems": "yes"}, "uniqueItems"),
        ({"type": "object", "required": ["a", "a"]}, "required"),
        ({"type": "object", "required": None}, "required"),
    ],
)
def test_a_keyword_value_json_schema_does_not_allow_is_refused_for_an_anthropic_model(
    bad: dict[str, object], keyword: str
) -> None:
    """Anthropic refuses an input schema that is not valid JSON Schema draft 2020-12 ("JSON
    schema is invalid") on every request: a draft-4 boolean exclusiveMinimum (MCP servers
    ship them), a type no JSON Schema has, a negative length. Plan took them (an audit).
    The plan of an Anthropic model refuses the tool, naming the keyword and where."""
    schema = {"type": "object", "properties": {"n": bad}}
    spec = PlanSpec(
        model_id="m",
        agent=AgentSpec(enabled_tools=("bad.tool",)),
        tools=(tool("bad.tool", input_schema=schema),),
        policy=_policy(),
    )
    with pytest.raises(InvalidFieldError) as caught:
        _plan(spec, model=replace(MODEL, provider="anthropic"))
    assert caught.value.field == "spec.tools[0].input_schema_json"
    assert f"has a {keyword} that is not" in str(caught.value)
    assert f"(properties.n.{keyword})" in str(caught.value)
    fine = {"type": "integer", "minimum": 0, "exclusiveMaximum": 10, "multipleOf": 2}
    good = schema | {"properties": {"n": fine}, "required": ["n"]}
    ok = spec.model_copy(update={"tools": (tool("bad.tool", input_schema=good),)})
    assert _plan(ok, model=replace(MODEL, provider="anthropic")).tool_names == ("bad.tool",)
