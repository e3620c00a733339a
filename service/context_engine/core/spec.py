"""What Region A is resolved from: the PlanSpec and its parts, validated and canonical.

Validation here is the second gate (api/convert.py is the first): every model is frozen,
sets are stored sorted, and JSON documents are parsed so they hash canonically.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, field_validator

from .canonical import canonical_bytes, sha256_hex
from .enums import SessionKind, SideEffect
from .trust import TrustLevel

__all__ = [
    "AgentSpec",
    "MemoryItemSpec",
    "MemorySnapshotSpec",
    "PersonaSpec",
    "PlanSpec",
    "PlatformPolicySpec",
    "Principal",
    "SessionEnvironment",
    "SkillSpec",
    "ToolSpec",
]


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


def _sorted_unique(values: tuple[str, ...]) -> tuple[str, ...]:
    # A set dumped in iteration order would follow the process's hash seed (ADR-0134).
    return tuple(sorted(set(values)))


class ToolSpec(_Frozen):
    name: str
    description: str = ""
    input_schema: dict[str, Any]
    output_schema: dict[str, Any] | None = None
    side_effect: SideEffect = SideEffect.UNSPECIFIED
    required_scopes: tuple[str, ...] = ()
    server: str = ""
    model_visible: bool = True
    builtin: bool = False
    session_binding: str = ""
    policy: dict[str, Any] = {}

    _sort_scopes = field_validator("required_scopes")(_sorted_unique)

    def canonical(self) -> dict[str, Any]:
        """The full pinned spec, as hashed into the plan's identity."""
        return self.model_dump(mode="json")


class AgentSpec(_Frozen):
    agent_id: str = ""
    version: str = ""
    instructions: str = ""
    enabled_tools: tuple[str, ...] = ()
    deferred_tools: tuple[str, ...] = ()


class Principal(_Frozen):
    principal_id: str = ""
    scopes: tuple[str, ...] = ()
    scope_label: str = ""

    _sort_scopes = field_validator("scopes")(_sorted_unique)


class PersonaSpec(_Frozen):
    revision: str = ""
    entries: tuple[str, ...] = ()


class SkillSpec(_Frozen):
    name: str
    description: str = ""
    version: str = ""
    trust: TrustLevel = TrustLevel.TRUSTED_CONFIGURATION


class MemoryItemSpec(_Frozen):
    item_id: str
    text: str
    source: str = ""
    person_ids: tuple[str, ...] = ()


class MemorySnapshotSpec(_Frozen):
    snapshot_id: str = ""
    recall_trace_id: str = ""
    watermark: int = 0
    items: tuple[MemoryItemSpec, ...] = ()


class SessionEnvironment(_Frozen):
    kind: SessionKind = SessionKind.INTERACTIVE
    surface: str = ""
    browser_profile_id: str = ""
    allowed_origins: tuple[str, ...] = ()
    bound_capabilities: tuple[str, ...] = ()
    time_zone: str = "UTC"

    _sort_bound = field_validator("bound_capabilities")(_sorted_unique)


class PlatformPolicySpec(_Frozen):
    version: str
    text: str


class PlanSpec(_Frozen):
    model_id: str
    agent: AgentSpec = AgentSpec()
    principal: Principal = Principal()
    tools: tuple[ToolSpec, ...] = ()
    persona: PersonaSpec = PersonaSpec()
    skills: tuple[SkillSpec, ...] = ()
    snapshot: MemorySnapshotSpec = MemorySnapshotSpec()
    environment: SessionEnvironment = SessionEnvironment()
    policy: PlatformPolicySpec
    policy_cap_tokens: int = 0
    reserve_output_tokens: int = 0

    def sha256(self) -> str:
        return sha256_hex(canonical_bytes(self.model_dump(mode="json")))

    def meaning_sha256(self) -> str:
        """sha256 of the spec with what no plan reads the order of put in one order: the
        tools (the roster ranks them by its own rules), the deferred tools (a set), the
        enabled tools' repeats (their first occurrence counts), a memory's person ids
        (never rendered). Plan's spec_matches compares it: a worker building its tool list
        from a map sent another order every turn, was told its spec differed, and rotated,
        re-caching the whole prefix for nothing (an audit)."""
        agent = self.agent.model_copy(
            update={
                "enabled_tools": tuple(dict.fromkeys(self.agent.enabled_tools)),
                "deferred_tools": tuple(sorted(set(self.agent.deferred_tools))),
            }
        )
        snapshot = self.snapshot.model_copy(
            update={
                "items": tuple(
                    i.model_copy(update={"person_ids": tuple(sorted(i.person_ids))})
                    for i in self.snapshot.items
                )
            }
        )
        tools = tuple(sorted(self.tools, key=lambda t: t.name))
        same = self.model_copy(update={"agent": agent, "snapshot": snapshot, "tools": tools})
        return same.sha256()
