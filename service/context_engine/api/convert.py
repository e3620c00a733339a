"""Proto <-> core conversion: the one seam, validating first.

Every function that reads a request either returns valid core values or raises
InvalidFieldError naming the field path as the caller spelled it. Nothing below this
module imports the generated stubs.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from enum import IntEnum
from functools import lru_cache
from typing import Any, TypedDict, TypeVar
from uuid import UUID

from google.protobuf.timestamp_pb2 import Timestamp
from pydantic import ValidationError

from .._gen.context_engine.v1 import context_engine_pb2 as pb
from ..core import items as ci
from ..core.assemble import StepContext
from ..core.attachment_sends import MessageAttachments
from ..core.cache_hints import prefix_breakpoints
from ..core.canonical import MAX_SAFE_INTEGER, canonical_json_text, parse_json_object
from ..core.enums import PlanReason, SessionKind, SideEffect
from ..core.epochs import Admission
from ..core.errors import InvalidFieldError
from ..core.estimator import PDF_PAGE_TOKENS, TEXT_FILE_TOKENS_PER_BYTE
from ..core.plan import ClassUsage, ContextPlan
from ..core.pressure import PressureReport
from ..core.request import Block, CacheBreakpoint, Message, ModelRequest, ToolDefinition
from ..core.roster import PinnedTool
from ..core.rows import Row
from ..core.spec import (
    AgentSpec,
    MemoryItemSpec,
    MemorySnapshotSpec,
    PersonaSpec,
    PlanSpec,
    PlatformPolicySpec,
    Principal,
    SessionEnvironment,
    SkillSpec,
    ToolSpec,
)
from ..core.tool_schema import input_schema_problem
from ..core.trust import TrustLevel
from ..core.working_state import UPDATE_TOOL_NAME

__all__ = [
    "block_from_proto",
    "block_to_proto",
    "budget_to_proto",
    "class_usage_to_proto",
    "item_from_proto",
    "items_from_proto",
    "parse_uuid",
    "plan_spec_from_proto",
    "plan_to_proto",
    "pressure_to_proto",
    "provider_to_proto",
    "request_from_proto",
    "request_to_proto",
    "step_from_proto",
    "timestamp_to_datetime",
    "tool_to_proto",
]

_PROVIDER_TO_PROTO = {"anthropic": pb.PROVIDER_ANTHROPIC, "openai": pb.PROVIDER_OPENAI}
_PROVIDER_FROM_PROTO = {v: k for k, v in _PROVIDER_TO_PROTO.items()}


def parse_uuid(value: str, field: str, *, required: bool = True) -> UUID | None:
    if not value:
        if required:
            raise InvalidFieldError(f"{field} is required", field=field)
        return None
    try:
        return _uuid(value)
    except ValueError:
        raise InvalidFieldError(f"{field} is not a UUID", field=field) from None


# A worker names the same session and run on every call of a run: each id is parsed once
# (UUIDs are immutable; a string that is not one raises and is not kept).
_uuid = lru_cache(maxsize=4096)(UUID)


def require_expected_version(value: int) -> int:
    """expected_checkpoint_version: the latest version the caller saw, so at least 1."""
    if value < 1:
        raise InvalidFieldError(
            "expected_checkpoint_version must be the latest version (>= 1)",
            field="expected_checkpoint_version",
        )
    return value


# Identifiers are keys of PostgreSQL indexes, and a btree entry must fit in a third of a
# page: 200 characters (at most 800 bytes of UTF-8) leaves room for the rest of the key.
MAX_ID_CHARS = 200


# Persisting a snapshot or recording a request holds one advisory lock per person its
# memories name (store/snapshots.py, migrations/0008_request_people.sql), from PostgreSQL's
# shared lock table (about 64 per connection by default): a bound per snapshot and per step
# keeps one call from exhausting it for everyone else.
MAX_PEOPLE_NAMED = 256


# An envelope's attribution (a tool result's source, a passage's citation): a URL or a
# name, shown in the envelope's source attribute on every request that carries it, and not
# held against a summary (core/compaction.py: a summary may cite it). Past the 2,000 or
# so characters many servers and CDNs accept in a URL; a longer one (browsers keep far
# longer) is cut by the clients' tool_result helpers rather than sent.
MAX_ATTRIBUTION_CHARS = 2_048


# What a one-line value may not hold: a line break, a tab or another control character.
# The runtime row (a surface, a principal's label) renders at PLATFORM trust, and an
# artifact reference on the summary row's pointer lines: a line of their own there read as
# the platform's words (an adversarial audit).
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")
# An artifact reference: a store's key, at most this long, with no whitespace.
MAX_ARTIFACT_REF_CHARS = 512


def _one_line(value: str, field: str) -> str:
    """Raises InvalidFieldError: `value` holds a line break or another control character."""
    if _CONTROL.search(value):
        raise InvalidFieldError(
            f"{field} must be one line (no line break, tab or control character)", field=field
        )
    return value


def _artifact_ref(value: str, field: str) -> str:
    """Raises InvalidFieldError: longer than MAX_ARTIFACT_REF_CHARS, or with whitespace."""
    if len(value) > MAX_ARTIFACT_REF_CHARS or any(c.isspace() for c in value):
        raise InvalidFieldError(
            f"{field} must be a reference: at most {MAX_ARTIFACT_REF_CHARS} characters,"
            " no whitespace",
            field=field,
        )
    return _one_line(value, field)


def _provider_item_id(value: str, field: str) -> str:
    """A provider's output item id (OpenAI's msg_/fc_ ids), sent verbatim beside its
    reasoning: held to MAX_ID_CHARS, with no whitespace or control character.

    Raises:
        InvalidFieldError: longer, or holding one.
    """
    if any(c.isspace() for c in value):
        raise InvalidFieldError(f"{field} must be an id: no whitespace", field=field)
    return _one_line(require_id(value, field, required=False), field)


def _attribution(value: str, field: str) -> str:
    """Raises InvalidFieldError: longer than MAX_ATTRIBUTION_CHARS."""
    if len(value) > MAX_ATTRIBUTION_CHARS:
        raise InvalidFieldError(
            f"{field} is longer than {MAX_ATTRIBUTION_CHARS} characters", field=field
        )
    return value


# A list of scopes (a principal's, a run's admission, a tool's required ones). Each distinct
# scope becomes a 66-byte hash in the plan (authority_scope_hashes), which every GetPlan,
# Rotate and rotated StartRun answers again: unbounded, a 3.6 MB Plan of 600,000 scopes
# made every 48-byte GetPlan answer 39.6 MB (an audit). Far past any real authorization.
MAX_SCOPES = 1_024


def _scopes(values: Sequence[str], field: str) -> tuple[str, ...]:
    """Raises InvalidFieldError: more than MAX_SCOPES scopes (metadata limit, entries), or
    an empty one (naming it: an empty scope grants or requires nothing a caller meant)."""
    if len(values) > MAX_SCOPES:
        raise InvalidFieldError(
            f"{field} lists {len(values)} scopes; at most {MAX_SCOPES}",
            field=field,
            metadata={"limit": str(MAX_SCOPES), "entries": str(len(values))},
        )
    for n, scope in enumerate(values):
        if not scope:
            raise InvalidFieldError(f"{field} must not hold an empty scope", field=f"{field}[{n}]")
    return tuple(values)


def require_id(value: str, field: str, *, required: bool = True) -> str:
    """An identifier the caller chose (tenant, idempotency key, person, skill name).

    Raises:
        InvalidFieldError: empty when required, or longer than MAX_ID_CHARS.
    """
    if not value:
        if required:
            raise InvalidFieldError(f"{field} is required", field=field)
        return value
    if len(value) > MAX_ID_CHARS:
        raise InvalidFieldError(f"{field} is longer than {MAX_ID_CHARS} characters", field=field)
    return value


def require_tenant(request: object) -> str:
    return require_id(str(getattr(request, "tenant_id", "")), "tenant_id")


def require_uuid(value: str, field: str) -> UUID:
    parsed = parse_uuid(value, field)
    assert parsed is not None
    return parsed


def _trust(value: int, field: str) -> TrustLevel:
    try:
        return TrustLevel(value)
    except ValueError:
        raise InvalidFieldError(
            f"{field} must be a TrustLevel other than UNSPECIFIED", field=field
        ) from None


# Trust a caller's content rendered in the user role (a tool result, a knowledge passage, a
# skill catalog entry whose body a load renders) may not claim: never the platform's own text
# (PLATFORM), and never the model's words (MODEL renders bare, and bare text in the user
# role could forge a user envelope). The same two a skill body may not claim
# (core/skills.py, Rule 6).
_NEVER_DOCUMENT_TRUST = frozenset({TrustLevel.PLATFORM, TrustLevel.MODEL})


def _result_trust(value: int, field: str) -> TrustLevel:
    """A tool result's trust. Not MODEL or PLATFORM (_NEVER_DOCUMENT_TRUST): a result
    renders in the user role, where the model's words would render bare and could forge a
    user envelope, and no tool speaks as the platform. A delegated agent's answer is
    evidence: label it by where it came from."""
    trust = _trust(value, field)
    if trust in _NEVER_DOCUMENT_TRUST:
        raise InvalidFieldError(
            f"{field}: a tool result cannot carry {trust.name} trust (it renders in the user"
            " role, as neither the model's nor the platform's words); label it by its source,"
            " e.g. EXTERNAL_UNTRUSTED",
            field=field,
        )
    return trust


def _catalog_trust(value: int, field: str) -> TrustLevel:
    """A skill catalog entry's trust. Not PLATFORM or MODEL: a loaded body takes its entry's
    trust and renders in the user role, where either would render bare (LoadSkill refuses
    both for the body itself; an entry must not hand them over)."""
    trust = _trust(value, field)
    if trust in _NEVER_DOCUMENT_TRUST:
        raise InvalidFieldError(
            f"{field}: a skill catalog entry cannot carry {trust.name} trust (its body would"
            " render bare in the user role); use TRUSTED_CONFIGURATION or lower",
            field=field,
        )
    return trust


def _passage_trust(value: int, field: str) -> TrustLevel:
    """A knowledge passage's trust: EXTERNAL_UNTRUSTED when unspecified."""
    if not value:
        return TrustLevel.EXTERNAL_UNTRUSTED
    trust = _trust(value, field)
    if trust in _NEVER_DOCUMENT_TRUST:
        raise InvalidFieldError(
            f"{field}: a knowledge passage cannot carry {trust.name} trust (it is a document"
            " rendered in the user role); label it by its source, e.g. EXTERNAL_UNTRUSTED",
            field=field,
        )
    return trust


_E = TypeVar("_E", bound=IntEnum)


def known_enum(cls: type[_E], value: int, field: str) -> _E:
    """An enum number as the core's enum. Proto3 enums are open, so a number the core does
    not know (UNSPECIFIED too, where the core has no member for it) is the caller's invalid
    field, not an internal error."""
    try:
        return cls(value)
    except ValueError:
        raise InvalidFieldError(
            f"{field} is not a {cls.__name__} this engine accepts", field=field
        ) from None


def _json_object(text: str, field: str, *, default: dict[str, Any] | None = None) -> dict[str, Any]:
    if not text:
        if default is not None:
            return default
        raise InvalidFieldError(f"{field} is required", field=field)
    try:
        return parse_json_object(text)
    except RecursionError:
        raise InvalidFieldError(f"{field} must be a JSON object", field=field) from None
    except ValueError as exc:  # the parser's own words: a position or a rule, never content
        raise InvalidFieldError(f"{field} must be a JSON object: {exc}", field=field) from None


def _object_schema(text: str, field: str) -> dict[str, Any]:
    """A tool's input schema, parsed; one a provider would refuse on every request is
    refused here, naming the field (core/tool_schema.py input_schema_problem)."""
    schema = _json_object(text, field, default={"type": "object"})
    problem = input_schema_problem(schema)
    if problem is not None:
        raise InvalidFieldError(f"{field} {problem}", field=field)
    return schema


_T = TypeVar("_T")


def _validated(build: Callable[[], _T], field: str) -> _T:
    try:
        return build()
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        path = f"{field}.{where}" if where else field
        raise InvalidFieldError(f"{path}: {first.get('msg', 'invalid')}", field=path) from None


# --- plan spec -----------------------------------------------------------------------------


def _tool_spec(tool: pb.ToolSpec, path: str) -> ToolSpec:
    return _validated(
        lambda: ToolSpec(
            name=tool.name,
            description=tool.description,
            input_schema=_object_schema(tool.input_schema_json, f"{path}.input_schema_json"),
            output_schema=(
                _json_object(tool.output_schema_json, f"{path}.output_schema_json")
                if tool.output_schema_json
                else None
            ),
            side_effect=known_enum(SideEffect, tool.side_effect, f"{path}.side_effect"),
            required_scopes=_scopes(tool.required_scopes, f"{path}.required_scopes"),
            server=tool.server,
            model_visible=tool.model_visible if tool.HasField("model_visible") else True,
            builtin=tool.builtin,
            session_binding=tool.session_binding,
            policy=_json_object(tool.policy_json, f"{path}.policy_json", default={}),
        ),
        path,
    )


def plan_spec_from_proto(
    spec: pb.PlanSpec, default_policy: PlatformPolicySpec, field: str = "spec"
) -> PlanSpec:
    if not spec.model_id:
        raise InvalidFieldError("spec.model_id is required", field=f"{field}.model_id")
    names: set[str] = set()
    tools: list[ToolSpec] = []
    for n, tool in enumerate(spec.tools):
        path = f"{field}.tools[{n}]"
        if not tool.name:
            raise InvalidFieldError(f"{path}.name is required", field=f"{path}.name")
        if tool.name in names:
            raise InvalidFieldError(f"tool {tool.name!r} is listed twice", field=f"{path}.name")
        if tool.name == UPDATE_TOOL_NAME and not tool.builtin:
            # The engine applies that tool's calls (a relayed call, the clients' tool loops):
            # a server's tool of that name would never see its own (a review).
            raise InvalidFieldError(
                f"{tool.name!r} is the engine's control tool (ListControlTools): a tool a"
                " server provides cannot take its name",
                field=f"{path}.name",
            )
        names.add(tool.name)
        tools.append(_tool_spec(tool, path))
    skills = []
    skill_names: set[str] = set()
    for n, skill in enumerate(spec.skills):
        path = f"{field}.skills[{n}]"
        require_id(skill.name, f"{path}.name")
        # Like a tool, a skill is listed once: two entries would pin two catalog blocks under
        # one item id, and a load could not say which entry's version and trust it takes.
        if skill.name in skill_names:
            raise InvalidFieldError(f"skill {skill.name!r} is listed twice", field=f"{path}.name")
        skill_names.add(skill.name)
        trust = (
            _catalog_trust(skill.trust, f"{path}.trust")
            if skill.trust
            else TrustLevel.TRUSTED_CONFIGURATION
        )
        skills.append(
            SkillSpec(
                name=skill.name, description=skill.description, version=skill.version, trust=trust
            )
        )
    people = {p for item in spec.snapshot.items for p in item.person_ids}
    if len(people) > MAX_PEOPLE_NAMED:
        raise InvalidFieldError(
            f"{field}.snapshot.items name {len(people)} people; at most"
            f" {MAX_PEOPLE_NAMED} per snapshot",
            field=f"{field}.snapshot.items",
        )
    snapshot_items = []
    memory_ids: set[str] = set()
    for n, item in enumerate(spec.snapshot.items):
        path = f"{field}.snapshot.items[{n}]"
        # Rendered as `memory:<id>` in every request, and a key an erasure and a compaction
        # compare: bounded as a recall line's is.
        require_id(item.item_id, f"{path}.item_id")
        # Listed once, as a tool or a skill is: two entries would render two blocks under
        # one item id (`memory:ID`), and an erasure or a compaction could not tell them apart.
        if item.item_id in memory_ids:
            raise InvalidFieldError(
                f"memory {item.item_id!r} is listed twice", field=f"{path}.item_id"
            )
        memory_ids.add(item.item_id)
        snapshot_items.append(
            MemoryItemSpec(
                item_id=item.item_id,
                text=item.text,
                source=_attribution(item.source, f"{path}.source"),
                person_ids=tuple(
                    require_id(p, f"{path}.person_ids[{k}]") for k, p in enumerate(item.person_ids)
                ),
            )
        )
    if spec.policy.version and not spec.policy.text:
        # A named policy without its text is not the server's policy under that name: the
        # plan would record the default's version, and the worker believe its own in force.
        raise InvalidFieldError(
            f"{field}.policy names version {spec.policy.version!r} but has no text; send"
            " the text, or leave policy unset for the engine's built-in policy",
            field=f"{field}.policy.text",
        )
    if spec.snapshot.watermark < 0:
        raise InvalidFieldError(
            f"{field}.snapshot.watermark must not be negative", field=f"{field}.snapshot.watermark"
        )
    policy = (
        PlatformPolicySpec(version=spec.policy.version or "custom", text=spec.policy.text)
        if spec.HasField("policy") and spec.policy.text
        else default_policy
    )
    env = spec.environment
    for name, value in (
        ("policy_cap_tokens", spec.policy_cap_tokens),
        ("reserve_output_tokens", spec.reserve_output_tokens),
    ):
        if value < 0:
            raise InvalidFieldError(f"{field}.{name} must not be negative", field=f"{field}.{name}")
    return _validated(
        lambda: PlanSpec(
            model_id=spec.model_id,
            agent=AgentSpec(
                agent_id=spec.agent.agent_id,
                version=spec.agent.version,
                instructions=spec.agent.instructions,
                enabled_tools=tuple(spec.agent.enabled_tools),
                deferred_tools=tuple(spec.agent.deferred_tools),
            ),
            principal=Principal(
                principal_id=spec.principal.principal_id,
                scopes=_scopes(spec.principal.scopes, "spec.principal.scopes"),
                scope_label=_one_line(spec.principal.scope_label, f"{field}.principal.scope_label"),
            ),
            tools=tuple(tools),
            persona=PersonaSpec(
                revision=spec.persona.revision, entries=tuple(spec.persona.entries)
            ),
            skills=tuple(skills),
            snapshot=MemorySnapshotSpec(
                snapshot_id=spec.snapshot.snapshot_id,
                recall_trace_id=spec.snapshot.recall_trace_id,
                watermark=spec.snapshot.watermark,
                items=tuple(snapshot_items),
            ),
            environment=SessionEnvironment(
                kind=known_enum(SessionKind, env.kind, f"{field}.environment.kind")
                if env.kind
                else SessionKind.INTERACTIVE,
                surface=_one_line(env.surface, f"{field}.environment.surface"),
                browser_profile_id=require_id(
                    env.browser_profile_id,
                    f"{field}.environment.browser_profile_id",
                    required=False,
                ),
                allowed_origins=tuple(
                    _one_line(o, f"{field}.environment.allowed_origins[{n}]")
                    for n, o in enumerate(env.allowed_origins)
                ),
                bound_capabilities=tuple(env.bound_capabilities),
                time_zone=env.time_zone or "UTC",
            ),
            policy=policy,
            policy_cap_tokens=spec.policy_cap_tokens,
            reserve_output_tokens=spec.reserve_output_tokens,
        ),
        field,
    )


def plan_reason_from_proto(value: int, field: str) -> PlanReason:
    try:
        reason = PlanReason(value)
    except ValueError:
        reason = PlanReason.UNSPECIFIED
    if reason in (PlanReason.UNSPECIFIED, PlanReason.SESSION_OPENED):
        raise InvalidFieldError(f"{field} must name why the epoch rotates", field=field)
    return reason


def plan_to_proto(plan: ContextPlan, created_at: datetime | None = None) -> pb.ContextPlan:
    out = pb.ContextPlan(
        session_id=plan.session_id,
        epoch=plan.epoch,
        prefix_sha256=plan.prefix_sha256,
        prefix_tokens=plan.prefix_tokens,
        model_id=plan.model_id,
        provider=_PROVIDER_TO_PROTO.get(plan.provider, pb.PROVIDER_UNSPECIFIED),
        tool_names=plan.tool_names,
        tool_schema_sha256=plan.tool_schema_sha256,
        authority_scope_hashes=plan.authority_scope_hashes or (),
        snapshot_id=plan.snapshot_id,
        snapshot_watermark=plan.snapshot_watermark,
        skill_pins=[pb.SkillPin(name=n, version=v) for n, v in plan.skill_pins],
        policy_version=plan.policy_version,
        builder_version=plan.builder_version,
        reason=pb.PlanReason.ValueType(plan.reason),
        skipped_tool_names=plan.skipped_tool_names,
        deferred_tool_names=plan.deferred_tool_names,
        spec_sha256=plan.spec_sha256,
        prefix_classes=[class_usage_to_proto(c) for c in plan.prefix_classes],
        prefix_document=plan.prefix_document.encode("utf-8"),
        pinned_tools=[_pinned_tool(t) for t in plan.pinned_tools],
        recall_trace_id=plan.recall_trace_id,
        session_kind=pb.SessionKind.ValueType(plan.session_kind),
        invalidated=plan.invalidated,
        cache_breakpoints=map(breakpoint_to_proto, prefix_breakpoints(plan.session_kind)),
    )
    if created_at is not None:
        out.created_at.FromDatetime(created_at)
    return out


def _pinned_tool(tool: PinnedTool) -> pb.PinnedTool:
    return pb.PinnedTool(
        name=tool.name,
        defined=tool.defined,
        required_scopes=tool.required_scopes,
        side_effect=pb.SideEffect.ValueType(tool.side_effect),
        spec_sha256=tool.spec_sha256,
    )


def admission_from_proto(admission: pb.RunAdmission) -> Admission:
    """A StartRun's RunAdmission (present): the run's effective scopes and selected
    browser profile, both stated (an empty list or string means none)."""
    return Admission(
        scopes=_scopes(admission.scopes, "admission.scopes"),
        browser_profile_id=require_id(
            admission.browser_profile_id, "admission.browser_profile_id", required=False
        ),
    )


def class_usage_to_proto(c: ClassUsage) -> pb.ClassUsage:
    return pb.ClassUsage(
        class_name=c.class_name,
        tokens=c.tokens,
        items=c.items,
        cap_tokens=c.cap_tokens,
        cap_items=c.cap_items,
    )


# --- conversation items --------------------------------------------------------------------


def item_from_proto(item: pb.ConversationItem, field: str, new_id: str) -> ci.ConversationItem:
    """One item; `new_id` is used when the caller left item_id empty. A chosen id is held
    to MAX_ID_CHARS, as every other id is: it goes into the item's envelope on every
    Build, and a 300,000-character one made each Build of its run BUDGET_EXCEEDED,
    naming no field (an audit)."""
    item_id = require_id(item.item_id, f"{field}.item_id", required=False) or new_id
    kind = item.WhichOneof("kind")
    if kind is None:
        raise InvalidFieldError(
            f"{field} has no kind set (user_message, assistant_message, tool_call, tool_result"
            " or reasoning)",
            field=f"{field}.kind",
            reason="UNKNOWN_ITEM_KIND",
        )
    if kind == "user_message":
        return user_message_from_proto(item.user_message, item_id, f"{field}.user_message")
    if kind == "assistant_message":
        message = item.assistant_message
        return ci.AssistantMessage(
            item_id=item_id,
            text=message.text,
            provider_item_id=_provider_item_id(
                message.provider_item_id, f"{field}.assistant_message.provider_item_id"
            ),
        )
    if kind == "tool_call":
        call = item.tool_call
        path = f"{field}.tool_call"
        require_id(call.call_id, f"{path}.call_id")  # indexed (migrations/0012)
        _require(call.tool_name, f"{path}.tool_name")
        arguments = _json_object(call.arguments_json, f"{path}.arguments_json", default={})
        return ci.ToolCall(
            item_id=item_id,
            call_id=call.call_id,
            tool_name=call.tool_name,
            arguments_json=canonical_json_text(json.dumps(arguments)),
            task_id=call.task_id,
            provider_item_id=_provider_item_id(call.provider_item_id, f"{path}.provider_item_id"),
        )
    if kind == "tool_result":
        result = item.tool_result
        path = f"{field}.tool_result"
        require_id(result.call_id, f"{path}.call_id")  # indexed (migrations/0012)
        return ci.ToolResult(
            item_id=item_id,
            call_id=result.call_id,
            tool_name=result.tool_name,
            content=result.content,
            trust=_result_trust(result.trust, f"{path}.trust"),
            source=_attribution(result.source, f"{path}.source"),
            is_error=result.is_error,
            artifact_ref=_artifact_ref(result.artifact_ref, f"{path}.artifact_ref"),
            context_content=result.context_content,
        )
    if kind == "reasoning":
        reasoning = item.reasoning
        path = f"{field}.reasoning"
        provider = _PROVIDER_FROM_PROTO.get(reasoning.provider)
        if provider is None:
            raise InvalidFieldError(f"{path}.provider is required", field=f"{path}.provider")
        if not reasoning.opaque:
            raise InvalidFieldError(f"{path}.opaque is required", field=f"{path}.opaque")
        # The core keeps the provider's JSON text verbatim (items.ReasoningItem.opaque);
        # the renderers replay it as the JSON object it is, so it must be one, and one of
        # the provider's reasoning types (anything else would replay as a message or a
        # call the hashed request does not show).
        try:
            opaque = reasoning.opaque.decode("utf-8")
            payload = parse_json_object(opaque)
        except (ValueError, RecursionError):
            raise InvalidFieldError(
                f"{path}.opaque must be the provider's reasoning item as a JSON object",
                field=f"{path}.opaque",
            ) from None
        allowed = ci.REASONING_TYPES[provider]
        kind = payload.get("type")
        if not isinstance(kind, str) or kind not in allowed:
            raise InvalidFieldError(
                f'{path}.opaque must be a {provider} reasoning item: its "type" must be'
                f" {' or '.join(repr(t) for t in sorted(allowed))}",
                field=f"{path}.opaque",
            )
        for key, json_type in ci.REASONING_FIELDS[kind].items():
            if not isinstance(payload.get(key), json_type):
                raise InvalidFieldError(
                    f'{path}.opaque: a {kind!r} item must hold "{key}"'
                    f" ({'a string' if json_type is str else 'an array'}), as the provider sent"
                    " it: replayed without it, every later request of the run is refused",
                    field=f"{path}.opaque",
                )
        unknown = sorted(payload.keys() - ci.REASONING_KEYS[kind])
        if unknown:
            raise InvalidFieldError(
                f"{path}.opaque: a {kind!r} item holds {unknown[0]!r}, which the provider's"
                f" {kind!r} type does not define (it holds only"
                f" {', '.join(sorted(ci.REASONING_KEYS[kind]))}): replayed with it, every"
                " later request of the run is refused",
                field=f"{path}.opaque",
            )
        return ci.ReasoningItem(item_id=item_id, provider=provider, opaque=opaque)
    raise InvalidFieldError(
        f"{field} has an unknown kind {kind!r}", field=field, reason="UNKNOWN_ITEM_KIND"
    )


# The size each attachment kind is counted by (core/estimator.py): required, at least 1, and
# at most what its content's tokens can be counted in (2^53 - 1). A PDF without its pages was
# counted at one and sent whole, a text file without its length at none (an audit: a silent
# overflow); pages past 2^63 / 3,200 overflowed the placement's token field, and every Build
# the message reached failed INTERNAL.
_SIZE_OF_KIND: dict[str, tuple[str, int]] = {
    "image": ("", 0),
    "pdf": ("pages", MAX_SAFE_INTEGER // PDF_PAGE_TOKENS),
    "text_file": ("text_length", MAX_SAFE_INTEGER // TEXT_FILE_TOKENS_PER_BYTE),
}


def user_message_from_proto(message: pb.UserMessage, item_id: str, field: str) -> ci.UserMessage:
    attachments = []
    for n, a in enumerate(message.attachments):
        path = f"{field}.attachments[{n}]"
        if a.kind not in _SIZE_OF_KIND:
            raise InvalidFieldError(
                f"{path}.kind must be image, pdf or text_file", field=f"{path}.kind"
            )
        for count in ("pages", "text_length"):
            if getattr(a, count) < 0:  # named as the range check below names it (an audit)
                raise InvalidFieldError(
                    f"{path}.{count} must not be negative", field=f"{path}.{count}"
                )
        size, most = _SIZE_OF_KIND[a.kind]
        if size and not 1 <= getattr(a, size) <= most:
            raise InvalidFieldError(
                f"{path}.{size} is required for a {a.kind}, from 1 to {most}: Build counts"
                f" its content by it",
                field=f"{path}.{size}",
            )
        attachments.append(
            ci.Attachment(kind=a.kind, ref=a.ref, pages=a.pages, text_length=a.text_length)
        )
    if not message.text and not attachments:
        raise InvalidFieldError(f"{field} is empty", field=f"{field}.text")
    return ci.UserMessage(item_id=item_id, text=message.text, attachments=tuple(attachments))


def items_from_proto(
    items: Sequence[pb.ConversationItem], new_ids: Sequence[str], field: str = "items"
) -> list[ci.ConversationItem]:
    if not items:
        raise InvalidFieldError(f"{field} must not be empty", field=field)
    return [item_from_proto(item, f"{field}[{n}]", new_ids[n]) for n, item in enumerate(items)]


def _require(value: str, field: str) -> None:
    if not value:
        raise InvalidFieldError(f"{field} is required", field=field)


# --- build ----------------------------------------------------------------------------------


# A clock the plan's time zone can render: datetime's own range, less a margin for the
# largest UTC offset on either side (a zone east of UTC pushes 9999-12-31 past year 9999).
_EARLIEST = datetime(1, 1, 3, tzinfo=UTC)
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_END = datetime(9999, 12, 30, tzinfo=UTC)  # exclusive


def timestamp_to_datetime(ts: Timestamp, field: str) -> datetime:
    """The caller's clock, as an aware UTC datetime.

    Raises:
        InvalidFieldError: nanos outside [0, 1e9), or a date outside what every time zone
            can render (from 0001-01-03 up to, not including, 9999-12-30 UTC).
    """
    # What Timestamp.ToDatetime(tzinfo=UTC) gives, computed directly (it costs a few
    # microseconds a call in protobuf's Python code, and Build reads one per call).
    instant: datetime | None = None
    if 0 <= ts.nanos < 1_000_000_000:
        try:
            instant = _EPOCH + timedelta(seconds=ts.seconds, microseconds=ts.nanos // 1000)
        except OverflowError:  # seconds far outside any date
            instant = None
    if instant is None or not _EARLIEST <= instant < _END:
        raise InvalidFieldError(
            f"{field} must be a valid Timestamp from 0001-01-03 up to 9999-12-30 UTC"
            " (nanos in [0, 999999999])",
            field=field,
        )
    return instant


def _check_people_named(step: pb.StepContext) -> None:
    """At most MAX_PEOPLE_NAMED distinct people across the step's recall and correction
    lines (each costs a lock-table entry while the request is recorded).

    Raises:
        InvalidFieldError: naming the line, recall's first, whose people take the count
            past the limit, so a caller can tell which list to shorten.
    """
    named: set[str] = set()
    for field, values in (("recall", step.recall), ("corrections", step.corrections)):
        for n, line in enumerate(values):
            named.update(line.person_ids)
            if len(named) > MAX_PEOPLE_NAMED:
                total = {p for ln in (*step.recall, *step.corrections) for p in ln.person_ids}
                raise InvalidFieldError(
                    f"step's recall and correction lines name {len(total)} people; at most"
                    f" {MAX_PEOPLE_NAMED} (step.{field}[{n}] takes them past it)",
                    field=f"step.{field}[{n}].person_ids",
                )


def _unique_ids(step: pb.StepContext, fields: tuple[str, ...]) -> None:
    """A step line's id names one line: the ladder gives lines up, and cache markers and
    compaction name them, by id (two lines under one id were one to them). Recall and
    correction lines share one namespace (each becomes "memory:<id>"). An empty id is left
    for the line's own check, which names it missing."""
    first: dict[str, str] = {}
    for field in fields:
        for n, line in enumerate(getattr(step, field)):
            at = f"step.{field}[{n}]"
            if line.item_id in first:
                raise InvalidFieldError(
                    f"{at}.item_id {line.item_id!r} repeats {first[line.item_id]}'s",
                    field=f"{at}.item_id",
                )
            if line.item_id:
                first[line.item_id] = at


def step_from_proto(step: pb.StepContext) -> StepContext:
    if not step.ListFields():  # most steps carry no recall, corrections or knowledge
        return _NO_STEP

    def lines(values: Sequence[pb.RecallLine], cls: type[Any], field: str) -> tuple[Any, ...]:
        out = []
        for n, line in enumerate(values):
            path = f"step.{field}[{n}]"
            require_id(line.item_id, f"{path}.item_id")
            people = tuple(
                require_id(p, f"{path}.person_ids[{k}]") for k, p in enumerate(line.person_ids)
            )
            out.append(
                cls(
                    item_id=f"memory:{line.item_id}",
                    text=line.text,
                    source=_attribution(line.source, f"{path}.source"),
                    person_ids=people,
                )
            )
        return tuple(out)

    _check_people_named(step)
    _unique_ids(step, ("recall", "corrections"))
    _unique_ids(step, ("knowledge",))

    knowledge = []
    for n, passage in enumerate(step.knowledge):
        path = f"step.knowledge[{n}]"
        require_id(passage.item_id, f"{path}.item_id")
        knowledge.append(
            ci.KnowledgePassageItem(
                item_id=f"knowledge:{passage.item_id}",
                text=passage.text,
                citation=_attribution(passage.citation, f"{path}.citation"),
                trust=_passage_trust(passage.trust, f"{path}.trust"),
                rank=n,
            )
        )
    if step.recall_floor_lines < 0:
        raise InvalidFieldError(
            "step.recall_floor_lines must not be negative", field="step.recall_floor_lines"
        )
    return StepContext(
        recall=lines(step.recall, ci.RecallLineItem, "recall"),
        corrections=lines(step.corrections, ci.CorrectionLineItem, "corrections"),
        knowledge=tuple(knowledge),
        recall_floor_lines=step.recall_floor_lines,
    )


_NO_STEP = StepContext()


def pressure_to_proto(report: PressureReport) -> pb.PressureReport:
    return pb.PressureReport(
        fits=report.fits,
        steps=[
            pb.YieldStep(step=s.step, tokens_freed=s.tokens_freed, item_ids=s.item_ids)
            for s in report.steps
        ],
        body_tokens_before=report.body_tokens_before,
        body_tokens_after=report.body_tokens_after,
        body_budget_tokens=report.body_budget_tokens,
        legacy_tool_excerpts=report.legacy_tool_excerpts,
        history_cut_index=report.history_cut_index,
        history_items_dropped=report.history_items_dropped,
    )


def placements_to_proto(
    sends: Sequence[MessageAttachments], paths: Sequence[str]
) -> list[pb.AttachmentPlacement]:
    """BuildResponse.attachment_placements: each message's attachments (core/
    attachment_sends.py) with the payload path of its text (api/engine.py)."""
    return [
        pb.AttachmentPlacement(
            item_id=m.item_id,
            source_sequence=m.source_sequence,
            payload_path=path,
            share_tokens=m.share_tokens,
            attachments=[
                pb.AttachmentSend(
                    attachment=pb.Attachment(
                        kind=a.attachment.kind,
                        ref=a.attachment.ref,
                        pages=a.attachment.pages,
                        text_length=a.attachment.text_length,
                    ),
                    content_tokens=a.content_tokens,
                    content=a.content,
                )
                for a in m.sends
            ],
        )
        for m, path in zip(sends, paths, strict=True)
    ]


def budget_to_proto(budget: Sequence[ClassUsage]) -> list[pb.ClassUsage]:
    return [class_usage_to_proto(c) for c in budget]


def block_to_proto(block: Block) -> pb.ContentBlock:
    out = pb.ContentBlock(
        row=pb.Row.ValueType(block.row),
        trust=pb.TrustLevel.ValueType(block.trust),
        item_id=block.item_id,
        source_sequence=block.source_sequence,
        run_id=block.run_id,
    )
    if block.kind == "text":
        out.text = block.text
        out.provider_item_id = block.provider_item_id
    elif block.kind == "tool_call":
        out.tool_call.CopyFrom(
            pb.ToolCall(
                call_id=block.call_id,
                tool_name=block.tool_name,
                arguments_json=block.arguments_json,
                provider_item_id=block.provider_item_id,
            )
        )
    elif block.kind == "tool_result":
        out.tool_result.CopyFrom(
            pb.ToolResult(
                call_id=block.call_id,
                tool_name=block.tool_name,
                content=block.text,
                trust=pb.TrustLevel.ValueType(block.trust),
                is_error=block.is_error,
                artifact_ref=block.artifact_ref,
            )
        )
    elif block.kind == "reasoning":
        out.reasoning.CopyFrom(
            pb.ReasoningItem(
                provider=_PROVIDER_TO_PROTO[block.provider], opaque=block.opaque.encode("utf-8")
            )
        )
    return out


def breakpoint_to_proto(bp: CacheBreakpoint) -> pb.CacheBreakpoint:
    return pb.CacheBreakpoint(
        name=bp.name,
        through_item=bp.through_item,
        through_input_item=bp.through_input_item,
        ttl=bp.ttl,
        priority=bp.priority,
        through_sequence=bp.through_sequence,
    )


def provider_to_proto(provider: str) -> pb.Provider:
    return _PROVIDER_TO_PROTO.get(provider, pb.PROVIDER_UNSPECIFIED)


def tool_to_proto(tool: ToolDefinition) -> pb.ToolDefinition:
    return pb.ToolDefinition(
        name=tool.name, description=tool.description, input_schema_json=tool.input_schema_json
    )


def request_to_proto(request: ModelRequest) -> pb.ModelRequest:
    """Field by field; Build composes the same message from cached bytes (api/wire.py)."""
    return pb.ModelRequest(
        provider=provider_to_proto(request.provider),
        model_id=request.model_id,
        system=[block_to_proto(b) for b in request.system],
        tools=[tool_to_proto(t) for t in request.tools],
        messages=[
            pb.Message(role=m.role, blocks=[block_to_proto(b) for b in m.blocks])
            for m in request.messages
        ],
        cache_breakpoints=[breakpoint_to_proto(b) for b in request.cache_breakpoints],
        max_output_tokens=request.max_output_tokens,
        session_key=request.session_key,
    )


class _BlockHead(TypedDict):
    item_id: str
    source_sequence: int


def block_from_proto(block: pb.ContentBlock) -> Block:
    """The inverse of block_to_proto (for explain, which reads recorded BuildResponses)."""
    row, trust = Row(block.row), TrustLevel(block.trust)
    base: _BlockHead = {"item_id": block.item_id, "source_sequence": block.source_sequence}
    kind = block.WhichOneof("kind")
    if kind == "tool_call":
        c = block.tool_call
        return Block(
            row,
            trust,
            "tool_call",
            **base,
            call_id=c.call_id,
            tool_name=c.tool_name,
            arguments_json=c.arguments_json,
            run_id=block.run_id,
            provider_item_id=c.provider_item_id,
        )
    if kind == "tool_result":
        r = block.tool_result
        return Block(
            row,
            trust,
            "tool_result",
            **base,
            text=r.content,
            call_id=r.call_id,
            tool_name=r.tool_name,
            is_error=r.is_error,
            artifact_ref=r.artifact_ref,
            run_id=block.run_id,
        )
    if kind == "reasoning":
        return Block(
            row,
            trust,
            "reasoning",
            **base,
            provider=_PROVIDER_FROM_PROTO.get(block.reasoning.provider, ""),
            opaque=block.reasoning.opaque.decode("utf-8"),
        )
    return Block(
        row, trust, "text", **base, text=block.text, provider_item_id=block.provider_item_id
    )


def request_from_proto(request: pb.ModelRequest) -> ModelRequest:
    """The inverse of request_to_proto (for explain)."""
    return ModelRequest(
        provider=_PROVIDER_FROM_PROTO.get(request.provider, ""),
        model_id=request.model_id,
        system=tuple(block_from_proto(b) for b in request.system),
        tools=tuple(
            ToolDefinition(t.name, t.description, t.input_schema_json) for t in request.tools
        ),
        messages=tuple(
            Message(
                "assistant" if m.role == "assistant" else "user",
                tuple(block_from_proto(b) for b in m.blocks),
            )
            for m in request.messages
        ),
        max_output_tokens=request.max_output_tokens,
        session_key=request.session_key,
        cache_breakpoints=tuple(
            CacheBreakpoint(
                b.name,
                through_item=b.through_item,
                ttl=b.ttl,
                priority=b.priority,
                through_input_item=b.through_input_item,
                through_sequence=b.through_sequence,
            )
            for b in request.cache_breakpoints
        ),
    )
