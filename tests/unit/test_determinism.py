"""Hard gate 1 (determinism): the same inputs give the same bytes, in any process.

Build twice, plan twice, plan from reordered sets, build across midnight, and plan under
two hash seeds in fresh interpreters; the hashes and the bytes must not move.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import subprocess
import sys
import textwrap
from datetime import UTC, date, datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import rfc8785
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from context_engine.core import (
    Checkpoint,
    ContextPlan,
    PlanSpec,
    Row,
    assemble,
    canonical_bytes,
    sha256_hex,
)
from context_engine.core.enums import PlanReason
from context_engine.core.envelope import new_plan_secret
from context_engine.core.estimator import heuristic_count
from context_engine.core.items import KnowledgePassageItem, RuntimeMetadataItem
from context_engine.core.plan import ModelFacts, make_plan
from context_engine.core.rows import ROW_TABLE, Region
from context_engine.core.spec import (
    AgentSpec,
    MemoryItemSpec,
    MemorySnapshotSpec,
    PlatformPolicySpec,
)
from context_engine.tokenizers import build_counters

from .strategies import (
    FIXED_ZONES,
    SCENARIO_SETTINGS,
    SETTINGS,
    Scenario,
    aware_datetimes,
    plan_specs,
    scenarios,
    secrets,
)

REPO = Path(__file__).resolve().parents[2]
_EMPTY = Checkpoint(run_id="r", version=1)
_NOON = datetime(2026, 1, 1, 12, tzinfo=UTC)


def _request_bytes(assembled: Any) -> bytes:
    return canonical_bytes(assembled.request.canonical())


# --- fixtures ------------------------------------------------------------------------------


def _minimal() -> Scenario:
    from context_engine.core.items import UserMessage
    from context_engine.core.spec import PlatformPolicySpec

    spec = PlanSpec(model_id="m", policy=PlatformPolicySpec(version="v1", text="policy"))
    checkpoint = Checkpoint(
        run_id="r", version=1, items=(UserMessage(item_id="u1", text="hello", sequence=1),)
    )
    return Scenario(spec=spec, secret=b"s" * 32, checkpoint=checkpoint, carried=(), now=_NOON)


# --- Build -------------------------------------------------------------------------------


@SCENARIO_SETTINGS
@given(scenarios())
def test_assemble_twice_gives_identical_bytes_and_hash(sc: Scenario) -> None:
    plan = sc.plan()
    first = assemble(sc.inputs(plan))
    second = assemble(sc.inputs(plan))
    assert first.request_sha256 == second.request_sha256
    assert _request_bytes(first) == _request_bytes(second)
    # The recorded hash is the hash of those canonical bytes in parts (core/request.py
    # Rule 1): the messages, system blocks and tools by their own SHA-256.
    canonical = first.request.canonical()
    hashed = first.request.hashed()
    for part, key in (("messages", "messages_sha256"), ("system", "system_sha256")):
        assert hashed[key] == sha256_hex(canonical_bytes(canonical[part]))
    assert first.request_sha256 == sha256_hex(canonical_bytes(hashed))
    assert first.placed == second.placed


@SCENARIO_SETTINGS
@given(scenarios())
def test_assemble_from_stored_plan_and_checkpoint_gives_identical_bytes(sc: Scenario) -> None:
    """A retry rebuilds from what was persisted (plan event, checkpoint row, log), not from
    the objects in memory; the request must be the same bytes."""
    plan = sc.plan()
    original = assemble(sc.inputs(plan))
    stored_plan = ContextPlan.model_validate_json(plan.model_dump_json())
    stored_checkpoint = Checkpoint.model_validate_json(sc.checkpoint.model_dump_json())
    reloaded = assemble(
        sc.inputs(stored_plan, checkpoint=stored_checkpoint, carried=tuple(sc.carried))
    )
    assert reloaded.request_sha256 == original.request_sha256
    assert _request_bytes(reloaded) == _request_bytes(original)


# --- Plan --------------------------------------------------------------------------------


@st.composite
def _specs_with_secret(draw: st.DrawFn) -> tuple[PlanSpec, bytes]:
    secret = draw(secrets)
    return draw(plan_specs(secret)), secret


@SETTINGS
@given(_specs_with_secret())
def test_make_plan_twice_gives_identical_prefix(arg: tuple[PlanSpec, bytes]) -> None:
    spec, secret = arg
    sc = Scenario(spec=spec, secret=secret, checkpoint=_EMPTY, carried=(), now=_NOON)
    first, second = sc.plan(), sc.plan()
    assert first.prefix_sha256 == second.prefix_sha256
    assert first.prefix_document == second.prefix_document
    assert first == second
    # prefix_sha256 is recomputable from the document by any JCS implementation.
    assert first.prefix_sha256 == sha256_hex(first.prefix_document.encode("utf-8"))
    assert rfc8785.dumps(json.loads(first.prefix_document)).decode() == first.prefix_document


def _reordered(spec: PlanSpec, draw: st.DrawFn) -> PlanSpec:
    """The same spec with every set-valued field given in another order, with repeats,
    validated from scratch as the API layer would."""

    def shuffle(values: Any) -> list[Any]:
        values = list(values)
        repeated = values + draw(st.lists(st.sampled_from(values), max_size=2)) if values else []
        return list(draw(st.permutations(repeated)))

    raw = spec.model_dump(mode="python")
    raw["principal"]["scopes"] = shuffle(raw["principal"]["scopes"])
    raw["environment"]["bound_capabilities"] = shuffle(raw["environment"]["bound_capabilities"])
    for tool in raw["tools"]:
        tool["required_scopes"] = shuffle(tool["required_scopes"])
    return PlanSpec.model_validate(raw)


@SETTINGS
@given(_specs_with_secret(), st.data())
def test_plan_is_independent_of_scope_and_capability_order(
    arg: tuple[PlanSpec, bytes], data: st.DataObject
) -> None:
    spec, secret = arg
    other = _reordered(spec, data.draw)
    a = Scenario(spec=spec, secret=secret, checkpoint=_EMPTY, carried=(), now=_NOON).plan()
    b = Scenario(spec=other, secret=secret, checkpoint=_EMPTY, carried=(), now=_NOON).plan()
    assert a.prefix_sha256 == b.prefix_sha256
    assert a.prefix_document == b.prefix_document
    # Nothing else about the plan moves either (spec hash, authority hashes, tool names).
    assert a.model_dump() == b.model_dump()


def _reverse_keys(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _reverse_keys(value[k]) for k in reversed(list(value))}
    if isinstance(value, list):
        return [_reverse_keys(v) for v in value]
    return value


@SETTINGS
@given(_specs_with_secret(), st.data())
def test_prefix_is_independent_of_tool_order_and_schema_key_order(
    arg: tuple[PlanSpec, bytes], data: st.DataObject
) -> None:
    spec, secret = arg
    raw = spec.model_dump(mode="python")
    raw["tools"] = [
        {
            **t,
            "input_schema": _reverse_keys(t["input_schema"]),
            "policy": _reverse_keys(t["policy"]),
        }
        for t in data.draw(st.permutations(raw["tools"]))
    ]
    other = PlanSpec.model_validate(raw)
    a = Scenario(spec=spec, secret=secret, checkpoint=_EMPTY, carried=(), now=_NOON).plan()
    b = Scenario(spec=other, secret=secret, checkpoint=_EMPTY, carried=(), now=_NOON).plan()
    assert a.prefix_sha256 == b.prefix_sha256
    assert a.prefix_document == b.prefix_document
    assert a.tool_schema_sha256 == b.tool_schema_sha256
    assert a.tool_names == b.tool_names == tuple(sorted(a.tool_names))


# --- the clock ----------------------------------------------------------------------------


def _row14(assembled: Any) -> list[RuntimeMetadataItem]:
    return [i for r, i in assembled.placed if r is Row.RUNTIME_METADATA]


def _body_blocks(assembled: Any) -> list[Any]:
    return [b for m in assembled.request.messages for b in m.blocks]


@SCENARIO_SETTINGS
@given(
    scenarios(),
    st.sampled_from(FIXED_ZONES),
    st.dates(min_value=date(2000, 1, 1), max_value=date(2099, 12, 31)),
    st.integers(1, 3600),
)
def test_crossing_midnight_changes_row_14_and_nothing_in_region_a(
    sc: Scenario, zone: timezone, day: date, seconds: int
) -> None:
    before = datetime(day.year, day.month, day.day, 23, 59, 59, tzinfo=zone)
    after = before + timedelta(seconds=seconds)
    assert after.date() != before.date()

    plan = sc.plan()
    dump_before = plan.model_dump()
    late = assemble(sc.inputs(plan, now=before))
    early = assemble(sc.inputs(plan, now=after))

    # Region A: the plan, the system blocks, the tools and their breakpoints are untouched.
    assert plan.model_dump() == dump_before
    assert late.request.system == early.request.system
    assert late.request.tools == early.request.tools
    prefix_marks = ("after_system", "after_tools")
    assert [c for c in late.request.cache_breakpoints if c.name in prefix_marks] == [
        c for c in early.request.cache_breakpoints if c.name in prefix_marks
    ]
    assert all(ROW_TABLE[b.row].region is Region.PREFIX for b in late.request.system)

    # Region B: row 14 carries the new date; every other block is byte-identical.
    (r_late,), (r_early,) = _row14(late), _row14(early)
    assert r_late.date == before.date().isoformat()
    assert r_early.date == after.date().isoformat()
    blocks_late, blocks_early = _body_blocks(late), _body_blocks(early)
    assert len(blocks_late) == len(blocks_early)
    changed = [
        (x.row, y.row)
        for x, y in zip(blocks_late, blocks_early, strict=True)
        if x.canonical() != y.canonical()
    ]
    assert changed == [(Row.RUNTIME_METADATA, Row.RUNTIME_METADATA)]
    assert late.request_sha256 != early.request_sha256


@SCENARIO_SETTINGS
@given(scenarios(), aware_datetimes(), aware_datetimes())
def test_region_a_never_depends_on_now(sc: Scenario, one: datetime, two: datetime) -> None:
    plan = sc.plan()
    a = assemble(sc.inputs(plan, now=one))
    b = assemble(sc.inputs(plan, now=two))
    assert a.request.system == b.request.system
    assert a.request.tools == b.request.tools
    # The date is the session-local one the clock argument carries, not UTC's.
    assert _row14(a)[0].date == one.date().isoformat()
    assert _row14(b)[0].date == two.date().isoformat()


def test_row_14_uses_the_local_date_not_utc() -> None:
    sc = _minimal()
    kiritimati = timezone(timedelta(hours=14))
    local = datetime(2026, 3, 1, 0, 30, tzinfo=kiritimati)  # 2026-02-28 10:30 UTC
    assembled = assemble(sc.inputs(now=local))
    (runtime,) = _row14(assembled)
    assert runtime.date == "2026-03-01"
    assert runtime.weekday == "Sunday"
    text = next(b.text for b in _body_blocks(assembled) if b.row is Row.RUNTIME_METADATA)
    assert "2026-03-01 (Sunday)" in text
    assert "2026-02-28" not in text


# --- hash seeds --------------------------------------------------------------------------

_PROBE = textwrap.dedent(
    """
    import json
    from datetime import datetime, timezone

    from context_engine.core import (
        BuildInputs, Checkpoint, ModelFacts, PlanReason, PlanSpec, assemble, make_plan,
    )
    from context_engine.core.items import ToolCall, ToolResult, UserMessage
    from context_engine.core.spec import (
        AgentSpec, Principal, PlatformPolicySpec, SessionEnvironment, SkillSpec, ToolSpec,
    )
    from context_engine.core.trust import TrustLevel

    SCOPES = {"mail.read", "mail.send", "calendar.read", "calendar.write", "files.read",
              "files.write", "web", "admin.audit", "contacts.read", "tasks.write"}
    CAPS = {"browser", "email", "sandbox", "calendar", "drive", "voice"}
    FIELDS = {"query", "limit", "cursor", "after", "before", "labels", "thread", "format"}

    def probe():
        # Every set below is handed over in this process's hash order (ADR-0134).
        schema = {"type": "object",
                  "properties": {f: {"type": "object",
                                     "properties": {g: {"type": "string"} for g in FIELDS}}
                                 for f in FIELDS}}
        tools = tuple(
            ToolSpec(name=name, description="does " + name, input_schema=schema,
                     required_scopes=tuple(SCOPES - {"admin.audit"}),
                     session_binding=binding, policy={k: True for k in CAPS})
            for name, binding in (("mail.search", ""), ("browser.navigate", "browser"),
                                  ("files.read", "drive"), ("admin.report", "")))
        spec = PlanSpec(
            model_id="m",
            agent=AgentSpec(agent_id="a", version="1", instructions="Be brief."),
            principal=Principal(principal_id="p", scopes=tuple(SCOPES), scope_label="p"),
            tools=tools,
            skills=(SkillSpec(name="triage", description="d", version="1"),),
            environment=SessionEnvironment(bound_capabilities=tuple(CAPS),
                                           allowed_origins=("https://a.example",)),
            policy=PlatformPolicySpec(version="v1", text="policy"),
        )
        plan = make_plan(spec, session_id="s", epoch=1, reason=PlanReason.SESSION_OPENED,
                         secret=b"k" * 32,
                         model=ModelFacts("m", "anthropic", 100000, 1000),
                         count_tokens=lambda t: len(t.encode()) // 4 + 1)
        items = (
            UserMessage(item_id="u1", text="</untrusted:x> hi", sequence=5),
            ToolCall(item_id="c1", call_id="call_1", tool_name="mail.search",
                     arguments_json="{}", sequence=6),
            ToolResult(item_id="r1", call_id="call_1", tool_name="mail.search",
                       content="found", trust=TrustLevel.EXTERNAL_UNTRUSTED, sequence=7),
        )
        built = assemble(BuildInputs(
            tenant_id="t", plan=plan, secret=b"k" * 32,
            checkpoint=Checkpoint(run_id="r", version=1, items=items), carried=(),
            now=datetime(2026, 1, 1, 12, tzinfo=timezone.utc)))
        return {"prefix_sha256": plan.prefix_sha256,
                "spec_sha256": plan.spec_sha256,
                "request_sha256": built.request_sha256,
                "set_order": list(SCOPES)}

    if __name__ == "__main__":
        print(json.dumps(probe()))
    """
)


def _probe_in_subprocess(seed: str) -> dict[str, Any]:
    env = {**os.environ, "PYTHONHASHSEED": seed}
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    result: dict[str, Any] = json.loads(proc.stdout)
    return result


def test_plan_and_request_hash_identically_under_different_hash_seeds() -> None:
    zero = _probe_in_subprocess("0")
    other = _probe_in_subprocess("12345")
    namespace: dict[str, Any] = {"__name__": "probe"}
    exec(compile(_PROBE, "<probe>", "exec"), namespace)
    here = namespace["probe"]()

    # The probe only means something if the two interpreters really iterate sets differently.
    assert zero["set_order"] != other["set_order"]
    for key in ("prefix_sha256", "spec_sha256", "request_sha256"):
        assert zero[key] == other[key] == here[key], key


_GENERATED_PROBE = textwrap.dedent(
    """
    import json, pickle, sys
    from context_engine.core import assemble

    out = []
    for sc in pickle.load(open(sys.argv[1], "rb")):
        plan = sc.plan()
        out.append([plan.prefix_sha256, assemble(sc.inputs(plan)).request_sha256])
    print(json.dumps(out))
    """
)


def test_generated_scenarios_hash_identically_under_different_hash_seeds(tmp_path: Any) -> None:
    """The two-seed probe above builds one fixed input (one tool pair, no knowledge, no
    recall): a tie among equally ranked passages broken in hash order passed it (an
    audit). Generated scenarios, knowledge and recall among them, are built here in this
    process and in two interpreters of other PYTHONHASHSEEDs, and must hash alike."""
    drawn: list[Scenario] = []

    @settings(max_examples=25, deadline=None, database=None, derandomize=True)
    @given(scenarios())
    def collect(sc: Scenario) -> None:
        drawn.append(sc)

    collect()
    assert any(sc.step.recall for sc in drawn)
    # And passages that tie on rank, which few draws make: an order that rests on hashing
    # shows only among equals.
    tied = tuple(
        KnowledgePassageItem(item_id=f"tie-{n}", text=f"Passage {n}.", rank=0) for n in range(4)
    )
    drawn += [
        dataclasses.replace(sc, step=dataclasses.replace(sc.step, knowledge=tied))
        for sc in drawn[:5]
    ]
    pickled = tmp_path / "scenarios.pickle"
    pickled.write_bytes(pickle.dumps(drawn))
    here = []
    for sc in drawn:
        plan = sc.plan()
        here.append([plan.prefix_sha256, assemble(sc.inputs(plan)).request_sha256])
    for seed in ("1", "4242"):
        proc = subprocess.run(
            [sys.executable, "-c", _GENERATED_PROBE, str(pickled)],
            env={**os.environ, "PYTHONHASHSEED": seed},
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout) == here, f"PYTHONHASHSEED={seed}"


def test_a_tool_blocks_run_id_is_not_hashed() -> None:
    """Blocks carry their run id (pairing by run and call id) since 2026-11-30; the request
    hash leaves it out, so every request recorded before still rebuilds to its hash."""
    from context_engine.core.request import Block
    from context_engine.core.rows import Row
    from context_engine.core.trust import TrustLevel

    def call(run_id: str) -> Block:
        return Block(
            Row.CONVERSATION,
            TrustLevel.MODEL,
            "tool_call",
            "i1",
            3,
            call_id="c1",
            tool_name="web.fetch",
            arguments_json="{}",
            run_id=run_id,
        )

    assert call("run-a").canonical() == call("").canonical()
    assert "run_id" not in call("run-a").canonical()


# --- the plan's secret -------------------------------------------------------------------

_O200K = build_counters()["o200k_base"].count_text


def _plan_under(spec: PlanSpec, secret: bytes, count: Any = _O200K) -> ContextPlan:
    return make_plan(
        spec,
        session_id="s",
        epoch=1,
        reason=PlanReason.SESSION_OPENED,
        secret=secret,
        model=ModelFacts("gpt-4o", "openai", 128_000, 4_096),
        count_tokens=count,
    )


def test_a_snapshot_at_its_cap_pins_the_same_memories_under_every_secret() -> None:
    """core/envelope.py Rule 1: which memories fit the snapshot's 1,500 tokens does not
    depend on the plan's secret. With hex nonces the same spec pinned other memories after
    a rebuilding rotation (an audit: one short memory's envelope counted 33 to 52 tokens
    under o200k, by its nonce)."""
    items = tuple(
        MemoryItemSpec(item_id=f"m{n}", text=f"Memory {n}: the client prefers train {n * 7}.")
        for n in range(60)
    )
    spec = PlanSpec(
        model_id="gpt-4o",
        agent=AgentSpec(agent_id="a", version="1", instructions="Be brief."),
        policy=PlatformPolicySpec(version="v1", text="Platform policy."),
        snapshot=MemorySnapshotSpec(snapshot_id="snap", items=items),
    )
    plans = [_plan_under(spec, new_plan_secret(bytes([n]) * 32)) for n in range(12)]
    assert plans[0].skipped_memory_ids  # the cap binds
    for plan in plans[1:]:
        assert plan.skipped_memory_ids == plans[0].skipped_memory_ids
        assert plan.prefix_tokens == plans[0].prefix_tokens
        assert plan.prefix_classes == plans[0].prefix_classes
        assert plan.prefix_sha256 != plans[0].prefix_sha256  # the nonces differ


@SCENARIO_SETTINGS
@given(scenarios(), st.binary(min_size=16, max_size=32), st.sampled_from(["o200k", "heuristic"]))
def test_the_same_inputs_under_another_secret_cut_and_count_the_same(
    sc: Scenario, other: bytes, counter: str
) -> None:
    """Under secrets new_plan_secret makes, a Build's plan and body count the same tokens,
    keep the same items and yield the same under every secret: only the nonces differ."""
    count = {"o200k": _O200K, "heuristic": heuristic_count}[counter]
    one, two = new_plan_secret(sc.secret), new_plan_secret(other)
    assume(one != two)
    plans = [_plan_under(sc.spec, s, count) for s in (one, two)]
    first, second = (
        assemble(dataclasses.replace(sc.inputs(plan), secret=secret, count_tokens=count))
        for plan, secret in zip(plans, (one, two), strict=True)
    )
    assert plans[0].prefix_tokens == plans[1].prefix_tokens
    assert plans[0].skipped_memory_ids == plans[1].skipped_memory_ids
    assert plans[0].skill_pins == plans[1].skill_pins
    assert first.needs_compaction == second.needs_compaction
    assert first.estimated_input_tokens == second.estimated_input_tokens
    assert first.budget == second.budget
    assert [(row, item.item_id) for row, item in first.placed] == [
        (row, item.item_id) for row, item in second.placed
    ]
    assert first.pressure == second.pressure
