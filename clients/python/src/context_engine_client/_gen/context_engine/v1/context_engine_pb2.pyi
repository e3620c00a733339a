import datetime
from collections.abc import Iterable as _Iterable
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar

from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper

DESCRIPTOR: _descriptor.FileDescriptor

class TrustLevel(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRUST_LEVEL_UNSPECIFIED: _ClassVar[TrustLevel]
    TRUST_LEVEL_PLATFORM: _ClassVar[TrustLevel]
    TRUST_LEVEL_TRUSTED_CONFIGURATION: _ClassVar[TrustLevel]
    TRUST_LEVEL_USER: _ClassVar[TrustLevel]
    TRUST_LEVEL_MODEL: _ClassVar[TrustLevel]
    TRUST_LEVEL_MEMORY: _ClassVar[TrustLevel]
    TRUST_LEVEL_EXTERNAL_UNTRUSTED: _ClassVar[TrustLevel]

class Region(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REGION_UNSPECIFIED: _ClassVar[Region]
    REGION_PREFIX: _ClassVar[Region]
    REGION_BODY: _ClassVar[Region]

class Row(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROW_UNSPECIFIED: _ClassVar[Row]
    ROW_PLATFORM_POLICY: _ClassVar[Row]
    ROW_FRAMING: _ClassVar[Row]
    ROW_AGENT_INSTRUCTIONS: _ClassVar[Row]
    ROW_PERSONA: _ClassVar[Row]
    ROW_TOOL_DEFINITIONS: _ClassVar[Row]
    ROW_DEFERRED_TOOL_INDEX: _ClassVar[Row]
    ROW_SKILL_CATALOG: _ClassVar[Row]
    ROW_MEMORY_SNAPSHOT: _ClassVar[Row]
    ROW_COMPACTED_SUMMARY: _ClassVar[Row]
    ROW_CONVERSATION: _ClassVar[Row]
    ROW_SKILL_BODIES: _ClassVar[Row]
    ROW_WORKING_STATE: _ClassVar[Row]
    ROW_RECALL: _ClassVar[Row]
    ROW_RUNTIME_METADATA: _ClassVar[Row]
    ROW_USER_INPUT: _ClassVar[Row]

class Provider(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PROVIDER_UNSPECIFIED: _ClassVar[Provider]
    PROVIDER_ANTHROPIC: _ClassVar[Provider]
    PROVIDER_OPENAI: _ClassVar[Provider]

class SideEffect(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SIDE_EFFECT_UNSPECIFIED: _ClassVar[SideEffect]
    SIDE_EFFECT_NONE: _ClassVar[SideEffect]
    SIDE_EFFECT_WORKSPACE_READ: _ClassVar[SideEffect]
    SIDE_EFFECT_NETWORK_READ: _ClassVar[SideEffect]
    SIDE_EFFECT_WORKSPACE_WRITE: _ClassVar[SideEffect]
    SIDE_EFFECT_NETWORK_WRITE: _ClassVar[SideEffect]
    SIDE_EFFECT_EXTERNAL_ACTION: _ClassVar[SideEffect]

class SessionKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SESSION_KIND_UNSPECIFIED: _ClassVar[SessionKind]
    SESSION_KIND_INTERACTIVE: _ClassVar[SessionKind]
    SESSION_KIND_SCHEDULED: _ClassVar[SessionKind]
    SESSION_KIND_OPERATIONAL: _ClassVar[SessionKind]

class PlanReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PLAN_REASON_UNSPECIFIED: _ClassVar[PlanReason]
    PLAN_REASON_SESSION_OPENED: _ClassVar[PlanReason]
    PLAN_REASON_MODEL_CHANGED: _ClassVar[PlanReason]
    PLAN_REASON_AGENT_CHANGED: _ClassVar[PlanReason]
    PLAN_REASON_PERSONA_CHANGED: _ClassVar[PlanReason]
    PLAN_REASON_OPERATOR_REVOCATION: _ClassVar[PlanReason]
    PLAN_REASON_SNAPSHOT_INVALIDATED: _ClassVar[PlanReason]
    PLAN_REASON_RUN_AUTHORITY_CHANGED: _ClassVar[PlanReason]
    PLAN_REASON_BROWSER_PROFILE_CHANGED: _ClassVar[PlanReason]
    PLAN_REASON_PREFIX_HASH_CANONICALIZED: _ClassVar[PlanReason]
    PLAN_REASON_BUILDER_UPGRADED: _ClassVar[PlanReason]

class ErrorReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ERROR_REASON_UNSPECIFIED: _ClassVar[ErrorReason]
    ERROR_REASON_INVALID_FIELD: _ClassVar[ErrorReason]
    ERROR_REASON_SESSION_NOT_FOUND: _ClassVar[ErrorReason]
    ERROR_REASON_RUN_NOT_FOUND: _ClassVar[ErrorReason]
    ERROR_REASON_PLAN_NOT_FOUND: _ClassVar[ErrorReason]
    ERROR_REASON_PREFIX_CLASS_OVER_CAP: _ClassVar[ErrorReason]
    ERROR_REASON_PREFIX_OVER_CEILING: _ClassVar[ErrorReason]
    ERROR_REASON_CHECKPOINT_VERSION_CONFLICT: _ClassVar[ErrorReason]
    ERROR_REASON_EPOCH_CONFLICT: _ClassVar[ErrorReason]
    ERROR_REASON_ORPHANED_TOOL_ITEM: _ClassVar[ErrorReason]
    ERROR_REASON_UNKNOWN_ITEM_KIND: _ClassVar[ErrorReason]
    ERROR_REASON_IDEMPOTENCY_KEY_REUSED: _ClassVar[ErrorReason]
    ERROR_REASON_UNKNOWN_MODEL: _ClassVar[ErrorReason]
    ERROR_REASON_BUDGET_EXCEEDED: _ClassVar[ErrorReason]
    ERROR_REASON_RUN_STATE: _ClassVar[ErrorReason]
    ERROR_REASON_SKILL_LIMIT: _ClassVar[ErrorReason]
    ERROR_REASON_SKILL_NOT_IN_CATALOG: _ClassVar[ErrorReason]
    ERROR_REASON_WORKING_STATE_CAP: _ClassVar[ErrorReason]
    ERROR_REASON_CONSTRAINT_PROTECTED: _ClassVar[ErrorReason]
    ERROR_REASON_COMPACTION_DEPTH_EXCEEDED: _ClassVar[ErrorReason]
    ERROR_REASON_SUMMARY_LAUNDERS_UNTRUSTED: _ClassVar[ErrorReason]
    ERROR_REASON_COMPACTION_MISMATCH: _ClassVar[ErrorReason]
    ERROR_REASON_REQUEST_TOO_LARGE: _ClassVar[ErrorReason]
    ERROR_REASON_REQUEST_NOT_FOUND: _ClassVar[ErrorReason]
    ERROR_REASON_SHUTTING_DOWN: _ClassVar[ErrorReason]
    ERROR_REASON_STORE_UNAVAILABLE: _ClassVar[ErrorReason]
    ERROR_REASON_REQUEST_REDACTED: _ClassVar[ErrorReason]
    ERROR_REASON_PERSON_ERASED: _ClassVar[ErrorReason]
    ERROR_REASON_TOOL_NAME_COLLISION: _ClassVar[ErrorReason]
    ERROR_REASON_PREFIX_OVER_CAPACITY: _ClassVar[ErrorReason]
    ERROR_REASON_SKILL_ALREADY_LOADED: _ClassVar[ErrorReason]
    ERROR_REASON_UNAUTHENTICATED: _ClassVar[ErrorReason]
    ERROR_REASON_TENANT_MISMATCH: _ClassVar[ErrorReason]

class Writer(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WRITER_UNSPECIFIED: _ClassVar[Writer]
    WRITER_MODEL: _ClassVar[Writer]
    WRITER_USER: _ClassVar[Writer]
    WRITER_RUNTIME: _ClassVar[Writer]

class TaskStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TASK_STATUS_UNSPECIFIED: _ClassVar[TaskStatus]
    TASK_STATUS_OPEN: _ClassVar[TaskStatus]
    TASK_STATUS_IN_PROGRESS: _ClassVar[TaskStatus]
    TASK_STATUS_BLOCKED: _ClassVar[TaskStatus]
    TASK_STATUS_DONE: _ClassVar[TaskStatus]
    TASK_STATUS_CANCELLED: _ClassVar[TaskStatus]

TRUST_LEVEL_UNSPECIFIED: TrustLevel
TRUST_LEVEL_PLATFORM: TrustLevel
TRUST_LEVEL_TRUSTED_CONFIGURATION: TrustLevel
TRUST_LEVEL_USER: TrustLevel
TRUST_LEVEL_MODEL: TrustLevel
TRUST_LEVEL_MEMORY: TrustLevel
TRUST_LEVEL_EXTERNAL_UNTRUSTED: TrustLevel
REGION_UNSPECIFIED: Region
REGION_PREFIX: Region
REGION_BODY: Region
ROW_UNSPECIFIED: Row
ROW_PLATFORM_POLICY: Row
ROW_FRAMING: Row
ROW_AGENT_INSTRUCTIONS: Row
ROW_PERSONA: Row
ROW_TOOL_DEFINITIONS: Row
ROW_DEFERRED_TOOL_INDEX: Row
ROW_SKILL_CATALOG: Row
ROW_MEMORY_SNAPSHOT: Row
ROW_COMPACTED_SUMMARY: Row
ROW_CONVERSATION: Row
ROW_SKILL_BODIES: Row
ROW_WORKING_STATE: Row
ROW_RECALL: Row
ROW_RUNTIME_METADATA: Row
ROW_USER_INPUT: Row
PROVIDER_UNSPECIFIED: Provider
PROVIDER_ANTHROPIC: Provider
PROVIDER_OPENAI: Provider
SIDE_EFFECT_UNSPECIFIED: SideEffect
SIDE_EFFECT_NONE: SideEffect
SIDE_EFFECT_WORKSPACE_READ: SideEffect
SIDE_EFFECT_NETWORK_READ: SideEffect
SIDE_EFFECT_WORKSPACE_WRITE: SideEffect
SIDE_EFFECT_NETWORK_WRITE: SideEffect
SIDE_EFFECT_EXTERNAL_ACTION: SideEffect
SESSION_KIND_UNSPECIFIED: SessionKind
SESSION_KIND_INTERACTIVE: SessionKind
SESSION_KIND_SCHEDULED: SessionKind
SESSION_KIND_OPERATIONAL: SessionKind
PLAN_REASON_UNSPECIFIED: PlanReason
PLAN_REASON_SESSION_OPENED: PlanReason
PLAN_REASON_MODEL_CHANGED: PlanReason
PLAN_REASON_AGENT_CHANGED: PlanReason
PLAN_REASON_PERSONA_CHANGED: PlanReason
PLAN_REASON_OPERATOR_REVOCATION: PlanReason
PLAN_REASON_SNAPSHOT_INVALIDATED: PlanReason
PLAN_REASON_RUN_AUTHORITY_CHANGED: PlanReason
PLAN_REASON_BROWSER_PROFILE_CHANGED: PlanReason
PLAN_REASON_PREFIX_HASH_CANONICALIZED: PlanReason
PLAN_REASON_BUILDER_UPGRADED: PlanReason
ERROR_REASON_UNSPECIFIED: ErrorReason
ERROR_REASON_INVALID_FIELD: ErrorReason
ERROR_REASON_SESSION_NOT_FOUND: ErrorReason
ERROR_REASON_RUN_NOT_FOUND: ErrorReason
ERROR_REASON_PLAN_NOT_FOUND: ErrorReason
ERROR_REASON_PREFIX_CLASS_OVER_CAP: ErrorReason
ERROR_REASON_PREFIX_OVER_CEILING: ErrorReason
ERROR_REASON_CHECKPOINT_VERSION_CONFLICT: ErrorReason
ERROR_REASON_EPOCH_CONFLICT: ErrorReason
ERROR_REASON_ORPHANED_TOOL_ITEM: ErrorReason
ERROR_REASON_UNKNOWN_ITEM_KIND: ErrorReason
ERROR_REASON_IDEMPOTENCY_KEY_REUSED: ErrorReason
ERROR_REASON_UNKNOWN_MODEL: ErrorReason
ERROR_REASON_BUDGET_EXCEEDED: ErrorReason
ERROR_REASON_RUN_STATE: ErrorReason
ERROR_REASON_SKILL_LIMIT: ErrorReason
ERROR_REASON_SKILL_NOT_IN_CATALOG: ErrorReason
ERROR_REASON_WORKING_STATE_CAP: ErrorReason
ERROR_REASON_CONSTRAINT_PROTECTED: ErrorReason
ERROR_REASON_COMPACTION_DEPTH_EXCEEDED: ErrorReason
ERROR_REASON_SUMMARY_LAUNDERS_UNTRUSTED: ErrorReason
ERROR_REASON_COMPACTION_MISMATCH: ErrorReason
ERROR_REASON_REQUEST_TOO_LARGE: ErrorReason
ERROR_REASON_REQUEST_NOT_FOUND: ErrorReason
ERROR_REASON_SHUTTING_DOWN: ErrorReason
ERROR_REASON_STORE_UNAVAILABLE: ErrorReason
ERROR_REASON_REQUEST_REDACTED: ErrorReason
ERROR_REASON_PERSON_ERASED: ErrorReason
ERROR_REASON_TOOL_NAME_COLLISION: ErrorReason
ERROR_REASON_PREFIX_OVER_CAPACITY: ErrorReason
ERROR_REASON_SKILL_ALREADY_LOADED: ErrorReason
ERROR_REASON_UNAUTHENTICATED: ErrorReason
ERROR_REASON_TENANT_MISMATCH: ErrorReason
WRITER_UNSPECIFIED: Writer
WRITER_MODEL: Writer
WRITER_USER: Writer
WRITER_RUNTIME: Writer
TASK_STATUS_UNSPECIFIED: TaskStatus
TASK_STATUS_OPEN: TaskStatus
TASK_STATUS_IN_PROGRESS: TaskStatus
TASK_STATUS_BLOCKED: TaskStatus
TASK_STATUS_DONE: TaskStatus
TASK_STATUS_CANCELLED: TaskStatus

class PlanSpec(_message.Message):
    __slots__ = (
        "agent",
        "environment",
        "model_id",
        "persona",
        "policy",
        "policy_cap_tokens",
        "principal",
        "reserve_output_tokens",
        "skills",
        "snapshot",
        "tools",
    )
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    AGENT_FIELD_NUMBER: _ClassVar[int]
    PRINCIPAL_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    PERSONA_FIELD_NUMBER: _ClassVar[int]
    SKILLS_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    ENVIRONMENT_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    POLICY_CAP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RESERVE_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    agent: AgentSpec
    principal: Principal
    tools: _containers.RepeatedCompositeFieldContainer[ToolSpec]
    persona: Persona
    skills: _containers.RepeatedCompositeFieldContainer[SkillCatalogEntry]
    snapshot: MemorySnapshot
    environment: SessionEnvironment
    policy: PlatformPolicy
    policy_cap_tokens: int
    reserve_output_tokens: int
    def __init__(
        self,
        model_id: str | None = ...,
        agent: AgentSpec | _Mapping | None = ...,
        principal: Principal | _Mapping | None = ...,
        tools: _Iterable[ToolSpec | _Mapping] | None = ...,
        persona: Persona | _Mapping | None = ...,
        skills: _Iterable[SkillCatalogEntry | _Mapping] | None = ...,
        snapshot: MemorySnapshot | _Mapping | None = ...,
        environment: SessionEnvironment | _Mapping | None = ...,
        policy: PlatformPolicy | _Mapping | None = ...,
        policy_cap_tokens: int | None = ...,
        reserve_output_tokens: int | None = ...,
    ) -> None: ...

class AgentSpec(_message.Message):
    __slots__ = ("agent_id", "deferred_tools", "enabled_tools", "instructions", "version")
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    INSTRUCTIONS_FIELD_NUMBER: _ClassVar[int]
    ENABLED_TOOLS_FIELD_NUMBER: _ClassVar[int]
    DEFERRED_TOOLS_FIELD_NUMBER: _ClassVar[int]
    agent_id: str
    version: str
    instructions: str
    enabled_tools: _containers.RepeatedScalarFieldContainer[str]
    deferred_tools: _containers.RepeatedScalarFieldContainer[str]
    def __init__(
        self,
        agent_id: str | None = ...,
        version: str | None = ...,
        instructions: str | None = ...,
        enabled_tools: _Iterable[str] | None = ...,
        deferred_tools: _Iterable[str] | None = ...,
    ) -> None: ...

class Principal(_message.Message):
    __slots__ = ("principal_id", "scope_label", "scopes")
    PRINCIPAL_ID_FIELD_NUMBER: _ClassVar[int]
    SCOPES_FIELD_NUMBER: _ClassVar[int]
    SCOPE_LABEL_FIELD_NUMBER: _ClassVar[int]
    principal_id: str
    scopes: _containers.RepeatedScalarFieldContainer[str]
    scope_label: str
    def __init__(
        self,
        principal_id: str | None = ...,
        scopes: _Iterable[str] | None = ...,
        scope_label: str | None = ...,
    ) -> None: ...

class ToolSpec(_message.Message):
    __slots__ = (
        "builtin",
        "description",
        "input_schema_json",
        "model_visible",
        "name",
        "output_schema_json",
        "policy_json",
        "required_scopes",
        "server",
        "session_binding",
        "side_effect",
    )
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    INPUT_SCHEMA_JSON_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_SCHEMA_JSON_FIELD_NUMBER: _ClassVar[int]
    SIDE_EFFECT_FIELD_NUMBER: _ClassVar[int]
    REQUIRED_SCOPES_FIELD_NUMBER: _ClassVar[int]
    SERVER_FIELD_NUMBER: _ClassVar[int]
    MODEL_VISIBLE_FIELD_NUMBER: _ClassVar[int]
    BUILTIN_FIELD_NUMBER: _ClassVar[int]
    SESSION_BINDING_FIELD_NUMBER: _ClassVar[int]
    POLICY_JSON_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    input_schema_json: str
    output_schema_json: str
    side_effect: SideEffect
    required_scopes: _containers.RepeatedScalarFieldContainer[str]
    server: str
    model_visible: bool
    builtin: bool
    session_binding: str
    policy_json: str
    def __init__(
        self,
        name: str | None = ...,
        description: str | None = ...,
        input_schema_json: str | None = ...,
        output_schema_json: str | None = ...,
        side_effect: SideEffect | str | None = ...,
        required_scopes: _Iterable[str] | None = ...,
        server: str | None = ...,
        model_visible: bool | None = ...,
        builtin: bool | None = ...,
        session_binding: str | None = ...,
        policy_json: str | None = ...,
    ) -> None: ...

class Persona(_message.Message):
    __slots__ = ("entries", "revision")
    REVISION_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    revision: str
    entries: _containers.RepeatedScalarFieldContainer[str]
    def __init__(
        self, revision: str | None = ..., entries: _Iterable[str] | None = ...
    ) -> None: ...

class SkillCatalogEntry(_message.Message):
    __slots__ = ("description", "name", "trust", "version")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TRUST_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    version: str
    trust: TrustLevel
    def __init__(
        self,
        name: str | None = ...,
        description: str | None = ...,
        version: str | None = ...,
        trust: TrustLevel | str | None = ...,
    ) -> None: ...

class MemorySnapshot(_message.Message):
    __slots__ = ("items", "recall_trace_id", "snapshot_id", "watermark")
    SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    RECALL_TRACE_ID_FIELD_NUMBER: _ClassVar[int]
    WATERMARK_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    snapshot_id: str
    recall_trace_id: str
    watermark: int
    items: _containers.RepeatedCompositeFieldContainer[MemoryItem]
    def __init__(
        self,
        snapshot_id: str | None = ...,
        recall_trace_id: str | None = ...,
        watermark: int | None = ...,
        items: _Iterable[MemoryItem | _Mapping] | None = ...,
    ) -> None: ...

class MemoryItem(_message.Message):
    __slots__ = ("item_id", "person_ids", "source", "text")
    ITEM_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    PERSON_IDS_FIELD_NUMBER: _ClassVar[int]
    item_id: str
    text: str
    source: str
    person_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(
        self,
        item_id: str | None = ...,
        text: str | None = ...,
        source: str | None = ...,
        person_ids: _Iterable[str] | None = ...,
    ) -> None: ...

class SessionEnvironment(_message.Message):
    __slots__ = (
        "allowed_origins",
        "bound_capabilities",
        "browser_profile_id",
        "kind",
        "surface",
        "time_zone",
    )
    KIND_FIELD_NUMBER: _ClassVar[int]
    SURFACE_FIELD_NUMBER: _ClassVar[int]
    BROWSER_PROFILE_ID_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_ORIGINS_FIELD_NUMBER: _ClassVar[int]
    BOUND_CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    TIME_ZONE_FIELD_NUMBER: _ClassVar[int]
    kind: SessionKind
    surface: str
    browser_profile_id: str
    allowed_origins: _containers.RepeatedScalarFieldContainer[str]
    bound_capabilities: _containers.RepeatedScalarFieldContainer[str]
    time_zone: str
    def __init__(
        self,
        kind: SessionKind | str | None = ...,
        surface: str | None = ...,
        browser_profile_id: str | None = ...,
        allowed_origins: _Iterable[str] | None = ...,
        bound_capabilities: _Iterable[str] | None = ...,
        time_zone: str | None = ...,
    ) -> None: ...

class PlatformPolicy(_message.Message):
    __slots__ = ("text", "version")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    version: str
    text: str
    def __init__(self, version: str | None = ..., text: str | None = ...) -> None: ...

class ContextPlan(_message.Message):
    __slots__ = (
        "authority_scope_hashes",
        "builder_version",
        "cache_breakpoints",
        "created_at",
        "deferred_tool_names",
        "epoch",
        "invalidated",
        "model_id",
        "pinned_tools",
        "policy_version",
        "prefix_classes",
        "prefix_document",
        "prefix_sha256",
        "prefix_tokens",
        "provider",
        "reason",
        "recall_trace_id",
        "session_id",
        "session_kind",
        "skill_pins",
        "skipped_tool_names",
        "snapshot_id",
        "snapshot_watermark",
        "spec_sha256",
        "tool_names",
        "tool_schema_sha256",
    )
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    PREFIX_SHA256_FIELD_NUMBER: _ClassVar[int]
    PREFIX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    PROVIDER_FIELD_NUMBER: _ClassVar[int]
    TOOL_NAMES_FIELD_NUMBER: _ClassVar[int]
    TOOL_SCHEMA_SHA256_FIELD_NUMBER: _ClassVar[int]
    AUTHORITY_SCOPE_HASHES_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_WATERMARK_FIELD_NUMBER: _ClassVar[int]
    SKILL_PINS_FIELD_NUMBER: _ClassVar[int]
    CACHE_BREAKPOINTS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    BUILDER_VERSION_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_TOOL_NAMES_FIELD_NUMBER: _ClassVar[int]
    DEFERRED_TOOL_NAMES_FIELD_NUMBER: _ClassVar[int]
    SPEC_SHA256_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CLASSES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_DOCUMENT_FIELD_NUMBER: _ClassVar[int]
    PINNED_TOOLS_FIELD_NUMBER: _ClassVar[int]
    RECALL_TRACE_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_KIND_FIELD_NUMBER: _ClassVar[int]
    INVALIDATED_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    epoch: int
    prefix_sha256: str
    prefix_tokens: int
    model_id: str
    provider: Provider
    tool_names: _containers.RepeatedScalarFieldContainer[str]
    tool_schema_sha256: str
    authority_scope_hashes: _containers.RepeatedScalarFieldContainer[str]
    snapshot_id: str
    snapshot_watermark: int
    skill_pins: _containers.RepeatedCompositeFieldContainer[SkillPin]
    cache_breakpoints: _containers.RepeatedCompositeFieldContainer[CacheBreakpoint]
    policy_version: str
    builder_version: str
    created_at: _timestamp_pb2.Timestamp
    reason: PlanReason
    skipped_tool_names: _containers.RepeatedScalarFieldContainer[str]
    deferred_tool_names: _containers.RepeatedScalarFieldContainer[str]
    spec_sha256: str
    prefix_classes: _containers.RepeatedCompositeFieldContainer[ClassUsage]
    prefix_document: bytes
    pinned_tools: _containers.RepeatedCompositeFieldContainer[PinnedTool]
    recall_trace_id: str
    session_kind: SessionKind
    invalidated: bool
    def __init__(
        self,
        session_id: str | None = ...,
        epoch: int | None = ...,
        prefix_sha256: str | None = ...,
        prefix_tokens: int | None = ...,
        model_id: str | None = ...,
        provider: Provider | str | None = ...,
        tool_names: _Iterable[str] | None = ...,
        tool_schema_sha256: str | None = ...,
        authority_scope_hashes: _Iterable[str] | None = ...,
        snapshot_id: str | None = ...,
        snapshot_watermark: int | None = ...,
        skill_pins: _Iterable[SkillPin | _Mapping] | None = ...,
        cache_breakpoints: _Iterable[CacheBreakpoint | _Mapping] | None = ...,
        policy_version: str | None = ...,
        builder_version: str | None = ...,
        created_at: datetime.datetime | _timestamp_pb2.Timestamp | _Mapping | None = ...,
        reason: PlanReason | str | None = ...,
        skipped_tool_names: _Iterable[str] | None = ...,
        deferred_tool_names: _Iterable[str] | None = ...,
        spec_sha256: str | None = ...,
        prefix_classes: _Iterable[ClassUsage | _Mapping] | None = ...,
        prefix_document: bytes | None = ...,
        pinned_tools: _Iterable[PinnedTool | _Mapping] | None = ...,
        recall_trace_id: str | None = ...,
        session_kind: SessionKind | str | None = ...,
        invalidated: bool | None = ...,
    ) -> None: ...

class PinnedTool(_message.Message):
    __slots__ = ("defined", "name", "required_scopes", "side_effect", "spec_sha256")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DEFINED_FIELD_NUMBER: _ClassVar[int]
    REQUIRED_SCOPES_FIELD_NUMBER: _ClassVar[int]
    SIDE_EFFECT_FIELD_NUMBER: _ClassVar[int]
    SPEC_SHA256_FIELD_NUMBER: _ClassVar[int]
    name: str
    defined: bool
    required_scopes: _containers.RepeatedScalarFieldContainer[str]
    side_effect: SideEffect
    spec_sha256: str
    def __init__(
        self,
        name: str | None = ...,
        defined: bool | None = ...,
        required_scopes: _Iterable[str] | None = ...,
        side_effect: SideEffect | str | None = ...,
        spec_sha256: str | None = ...,
    ) -> None: ...

class SkillPin(_message.Message):
    __slots__ = ("name", "version")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: str
    def __init__(self, name: str | None = ..., version: str | None = ...) -> None: ...

class CacheBreakpoint(_message.Message):
    __slots__ = (
        "name",
        "priority",
        "through_input_item",
        "through_item",
        "through_sequence",
        "ttl",
    )
    NAME_FIELD_NUMBER: _ClassVar[int]
    THROUGH_ITEM_FIELD_NUMBER: _ClassVar[int]
    THROUGH_INPUT_ITEM_FIELD_NUMBER: _ClassVar[int]
    TTL_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    THROUGH_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    name: str
    through_item: str
    through_input_item: str
    ttl: str
    priority: int
    through_sequence: int
    def __init__(
        self,
        name: str | None = ...,
        through_item: str | None = ...,
        through_input_item: str | None = ...,
        ttl: str | None = ...,
        priority: int | None = ...,
        through_sequence: int | None = ...,
    ) -> None: ...

class ClassUsage(_message.Message):
    __slots__ = ("cap_items", "cap_tokens", "class_name", "items", "tokens")
    CLASS_NAME_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    CAP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CAP_ITEMS_FIELD_NUMBER: _ClassVar[int]
    class_name: str
    tokens: int
    items: int
    cap_tokens: int
    cap_items: int
    def __init__(
        self,
        class_name: str | None = ...,
        tokens: int | None = ...,
        items: int | None = ...,
        cap_tokens: int | None = ...,
        cap_items: int | None = ...,
    ) -> None: ...

class PlanRequest(_message.Message):
    __slots__ = ("session_id", "spec", "tenant_id")
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    tenant_id: str
    session_id: str
    spec: PlanSpec
    def __init__(
        self,
        tenant_id: str | None = ...,
        session_id: str | None = ...,
        spec: PlanSpec | _Mapping | None = ...,
    ) -> None: ...

class PlanResponse(_message.Message):
    __slots__ = ("created", "plan", "spec_matches")
    PLAN_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    SPEC_MATCHES_FIELD_NUMBER: _ClassVar[int]
    plan: ContextPlan
    created: bool
    spec_matches: bool
    def __init__(
        self,
        plan: ContextPlan | _Mapping | None = ...,
        created: bool | None = ...,
        spec_matches: bool | None = ...,
    ) -> None: ...

class GetPlanRequest(_message.Message):
    __slots__ = ("epoch", "session_id", "tenant_id")
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    tenant_id: str
    session_id: str
    epoch: int
    def __init__(
        self, tenant_id: str | None = ..., session_id: str | None = ..., epoch: int | None = ...
    ) -> None: ...

class GetPlanResponse(_message.Message):
    __slots__ = ("plan",)
    PLAN_FIELD_NUMBER: _ClassVar[int]
    plan: ContextPlan
    def __init__(self, plan: ContextPlan | _Mapping | None = ...) -> None: ...

class RotateRequest(_message.Message):
    __slots__ = (
        "detail",
        "from_epoch",
        "idempotency_key",
        "reason",
        "session_id",
        "spec",
        "tenant_id",
    )
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    FROM_EPOCH_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_KEY_FIELD_NUMBER: _ClassVar[int]
    tenant_id: str
    session_id: str
    from_epoch: int
    reason: PlanReason
    spec: PlanSpec
    detail: str
    idempotency_key: str
    def __init__(
        self,
        tenant_id: str | None = ...,
        session_id: str | None = ...,
        from_epoch: int | None = ...,
        reason: PlanReason | str | None = ...,
        spec: PlanSpec | _Mapping | None = ...,
        detail: str | None = ...,
        idempotency_key: str | None = ...,
    ) -> None: ...

class RotateResponse(_message.Message):
    __slots__ = ("plan",)
    PLAN_FIELD_NUMBER: _ClassVar[int]
    plan: ContextPlan
    def __init__(self, plan: ContextPlan | _Mapping | None = ...) -> None: ...

class ConversationItem(_message.Message):
    __slots__ = (
        "assistant_message",
        "item_id",
        "reasoning",
        "tool_call",
        "tool_result",
        "user_message",
    )
    ITEM_ID_FIELD_NUMBER: _ClassVar[int]
    USER_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    ASSISTANT_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_FIELD_NUMBER: _ClassVar[int]
    TOOL_RESULT_FIELD_NUMBER: _ClassVar[int]
    REASONING_FIELD_NUMBER: _ClassVar[int]
    item_id: str
    user_message: UserMessage
    assistant_message: AssistantMessage
    tool_call: ToolCall
    tool_result: ToolResult
    reasoning: ReasoningItem
    def __init__(
        self,
        item_id: str | None = ...,
        user_message: UserMessage | _Mapping | None = ...,
        assistant_message: AssistantMessage | _Mapping | None = ...,
        tool_call: ToolCall | _Mapping | None = ...,
        tool_result: ToolResult | _Mapping | None = ...,
        reasoning: ReasoningItem | _Mapping | None = ...,
    ) -> None: ...

class UserMessage(_message.Message):
    __slots__ = ("attachments", "text")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    ATTACHMENTS_FIELD_NUMBER: _ClassVar[int]
    text: str
    attachments: _containers.RepeatedCompositeFieldContainer[Attachment]
    def __init__(
        self, text: str | None = ..., attachments: _Iterable[Attachment | _Mapping] | None = ...
    ) -> None: ...

class Attachment(_message.Message):
    __slots__ = ("kind", "pages", "ref", "text_length")
    KIND_FIELD_NUMBER: _ClassVar[int]
    REF_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    TEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    kind: str
    ref: str
    pages: int
    text_length: int
    def __init__(
        self,
        kind: str | None = ...,
        ref: str | None = ...,
        pages: int | None = ...,
        text_length: int | None = ...,
    ) -> None: ...

class AssistantMessage(_message.Message):
    __slots__ = ("text",)
    TEXT_FIELD_NUMBER: _ClassVar[int]
    text: str
    def __init__(self, text: str | None = ...) -> None: ...

class ToolCall(_message.Message):
    __slots__ = ("arguments_json", "call_id", "task_id", "tool_name")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    TOOL_NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_JSON_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    call_id: str
    tool_name: str
    arguments_json: str
    task_id: str
    def __init__(
        self,
        call_id: str | None = ...,
        tool_name: str | None = ...,
        arguments_json: str | None = ...,
        task_id: str | None = ...,
    ) -> None: ...

class ToolResult(_message.Message):
    __slots__ = (
        "artifact_ref",
        "call_id",
        "content",
        "context_content",
        "is_error",
        "source",
        "tool_name",
        "trust",
    )
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    TOOL_NAME_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    TRUST_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    IS_ERROR_FIELD_NUMBER: _ClassVar[int]
    ARTIFACT_REF_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_CONTENT_FIELD_NUMBER: _ClassVar[int]
    call_id: str
    tool_name: str
    content: str
    trust: TrustLevel
    source: str
    is_error: bool
    artifact_ref: str
    context_content: str
    def __init__(
        self,
        call_id: str | None = ...,
        tool_name: str | None = ...,
        content: str | None = ...,
        trust: TrustLevel | str | None = ...,
        source: str | None = ...,
        is_error: bool | None = ...,
        artifact_ref: str | None = ...,
        context_content: str | None = ...,
    ) -> None: ...

class ReasoningItem(_message.Message):
    __slots__ = ("opaque", "provider")
    PROVIDER_FIELD_NUMBER: _ClassVar[int]
    OPAQUE_FIELD_NUMBER: _ClassVar[int]
    provider: Provider
    opaque: bytes
    def __init__(
        self, provider: Provider | str | None = ..., opaque: bytes | None = ...
    ) -> None: ...

class Run(_message.Message):
    __slots__ = ("epoch", "parent_run_id", "run_id", "seed_event_sequence", "session_id")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PARENT_RUN_ID_FIELD_NUMBER: _ClassVar[int]
    SEED_EVENT_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    session_id: str
    parent_run_id: str
    seed_event_sequence: int
    epoch: int
    def __init__(
        self,
        run_id: str | None = ...,
        session_id: str | None = ...,
        parent_run_id: str | None = ...,
        seed_event_sequence: int | None = ...,
        epoch: int | None = ...,
    ) -> None: ...

class ChildSeed(_message.Message):
    __slots__ = ("instruction", "parent_run_id")
    PARENT_RUN_ID_FIELD_NUMBER: _ClassVar[int]
    INSTRUCTION_FIELD_NUMBER: _ClassVar[int]
    parent_run_id: str
    instruction: str
    def __init__(self, parent_run_id: str | None = ..., instruction: str | None = ...) -> None: ...

class StartRunRequest(_message.Message):
    __slots__ = (
        "admission",
        "child",
        "idempotency_key",
        "run_id",
        "seed_item_id",
        "session_id",
        "tenant_id",
        "user_message",
    )
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_KEY_FIELD_NUMBER: _ClassVar[int]
    USER_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    CHILD_FIELD_NUMBER: _ClassVar[int]
    SEED_ITEM_ID_FIELD_NUMBER: _ClassVar[int]
    ADMISSION_FIELD_NUMBER: _ClassVar[int]
    tenant_id: str
    session_id: str
    run_id: str
    idempotency_key: str
    user_message: UserMessage
    child: ChildSeed
    seed_item_id: str
    admission: RunAdmission
    def __init__(
        self,
        tenant_id: str | None = ...,
        session_id: str | None = ...,
        run_id: str | None = ...,
        idempotency_key: str | None = ...,
        user_message: UserMessage | _Mapping | None = ...,
        child: ChildSeed | _Mapping | None = ...,
        seed_item_id: str | None = ...,
        admission: RunAdmission | _Mapping | None = ...,
    ) -> None: ...

class RunAdmission(_message.Message):
    __slots__ = ("browser_profile_id", "scopes")
    SCOPES_FIELD_NUMBER: _ClassVar[int]
    BROWSER_PROFILE_ID_FIELD_NUMBER: _ClassVar[int]
    scopes: _containers.RepeatedScalarFieldContainer[str]
    browser_profile_id: str
    def __init__(
        self, scopes: _Iterable[str] | None = ..., browser_profile_id: str | None = ...
    ) -> None: ...

class StartRunResponse(_message.Message):
    __slots__ = ("checkpoint_version", "rotated_plan", "run")
    RUN_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_VERSION_FIELD_NUMBER: _ClassVar[int]
    ROTATED_PLAN_FIELD_NUMBER: _ClassVar[int]
    run: Run
    checkpoint_version: int
    rotated_plan: ContextPlan
    def __init__(
        self,
        run: Run | _Mapping | None = ...,
        checkpoint_version: int | None = ...,
        rotated_plan: ContextPlan | _Mapping | None = ...,
    ) -> None: ...

class AppendItemsRequest(_message.Message):
    __slots__ = (
        "expected_checkpoint_version",
        "idempotency_key",
        "items",
        "run_id",
        "session_id",
        "tenant_id",
    )
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_CHECKPOINT_VERSION_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_KEY_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    tenant_id: str
    session_id: str
    run_id: str
    expected_checkpoint_version: int
    idempotency_key: str
    items: _containers.RepeatedCompositeFieldContainer[ConversationItem]
    def __init__(
        self,
        tenant_id: str | None = ...,
        session_id: str | None = ...,
        run_id: str | None = ...,
        expected_checkpoint_version: int | None = ...,
        idempotency_key: str | None = ...,
        items: _Iterable[ConversationItem | _Mapping] | None = ...,
    ) -> None: ...

class AppendItemsResponse(_message.Message):
    __slots__ = ("checkpoint_version", "item_ids", "sequences")
    CHECKPOINT_VERSION_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    ITEM_IDS_FIELD_NUMBER: _ClassVar[int]
    checkpoint_version: int
    sequences: _containers.RepeatedScalarFieldContainer[int]
    item_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(
        self,
        checkpoint_version: int | None = ...,
        sequences: _Iterable[int] | None = ...,
        item_ids: _Iterable[str] | None = ...,
    ) -> None: ...

class StepContext(_message.Message):
    __slots__ = ("corrections", "knowledge", "recall", "recall_floor_lines")
    RECALL_FIELD_NUMBER: _ClassVar[int]
    CORRECTIONS_FIELD_NUMBER: _ClassVar[int]
    KNOWLEDGE_FIELD_NUMBER: _ClassVar[int]
    RECALL_FLOOR_LINES_FIELD_NUMBER: _ClassVar[int]
    recall: _containers.RepeatedCompositeFieldContainer[RecallLine]
    corrections: _containers.RepeatedCompositeFieldContainer[RecallLine]
    knowledge: _containers.RepeatedCompositeFieldContainer[KnowledgePassage]
    recall_floor_lines: int
    def __init__(
        self,
        recall: _Iterable[RecallLine | _Mapping] | None = ...,
        corrections: _Iterable[RecallLine | _Mapping] | None = ...,
        knowledge: _Iterable[KnowledgePassage | _Mapping] | None = ...,
        recall_floor_lines: int | None = ...,
    ) -> None: ...

class RecallLine(_message.Message):
    __slots__ = ("item_id", "person_ids", "source", "text")
    ITEM_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    PERSON_IDS_FIELD_NUMBER: _ClassVar[int]
    item_id: str
    text: str
    source: str
    person_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(
        self,
        item_id: str | None = ...,
        text: str | None = ...,
        source: str | None = ...,
        person_ids: _Iterable[str] | None = ...,
    ) -> None: ...

class KnowledgePassage(_message.Message):
    __slots__ = ("citation", "item_id", "text", "trust")
    ITEM_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    CITATION_FIELD_NUMBER: _ClassVar[int]
    TRUST_FIELD_NUMBER: _ClassVar[int]
    item_id: str
    text: str
    citation: str
    trust: TrustLevel
    def __init__(
        self,
        item_id: str | None = ...,
        text: str | None = ...,
        citation: str | None = ...,
        trust: TrustLevel | str | None = ...,
    ) -> None: ...

class BuildRequest(_message.Message):
    __slots__ = ("checkpoint_version", "now", "run_id", "session_id", "step", "tenant_id")
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_VERSION_FIELD_NUMBER: _ClassVar[int]
    NOW_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    tenant_id: str
    session_id: str
    run_id: str
    checkpoint_version: int
    now: _timestamp_pb2.Timestamp
    step: StepContext
    def __init__(
        self,
        tenant_id: str | None = ...,
        session_id: str | None = ...,
        run_id: str | None = ...,
        checkpoint_version: int | None = ...,
        now: datetime.datetime | _timestamp_pb2.Timestamp | _Mapping | None = ...,
        step: StepContext | _Mapping | None = ...,
    ) -> None: ...

class ModelRequest(_message.Message):
    __slots__ = (
        "cache_breakpoints",
        "max_output_tokens",
        "messages",
        "model_id",
        "provider",
        "session_key",
        "system",
        "tools",
    )
    PROVIDER_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    SYSTEM_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    CACHE_BREAKPOINTS_FIELD_NUMBER: _ClassVar[int]
    MAX_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SESSION_KEY_FIELD_NUMBER: _ClassVar[int]
    provider: Provider
    model_id: str
    system: _containers.RepeatedCompositeFieldContainer[ContentBlock]
    tools: _containers.RepeatedCompositeFieldContainer[ToolDefinition]
    messages: _containers.RepeatedCompositeFieldContainer[Message]
    cache_breakpoints: _containers.RepeatedCompositeFieldContainer[CacheBreakpoint]
    max_output_tokens: int
    session_key: str
    def __init__(
        self,
        provider: Provider | str | None = ...,
        model_id: str | None = ...,
        system: _Iterable[ContentBlock | _Mapping] | None = ...,
        tools: _Iterable[ToolDefinition | _Mapping] | None = ...,
        messages: _Iterable[Message | _Mapping] | None = ...,
        cache_breakpoints: _Iterable[CacheBreakpoint | _Mapping] | None = ...,
        max_output_tokens: int | None = ...,
        session_key: str | None = ...,
    ) -> None: ...

class Message(_message.Message):
    __slots__ = ("blocks", "role")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    role: str
    blocks: _containers.RepeatedCompositeFieldContainer[ContentBlock]
    def __init__(
        self, role: str | None = ..., blocks: _Iterable[ContentBlock | _Mapping] | None = ...
    ) -> None: ...

class ContentBlock(_message.Message):
    __slots__ = (
        "item_id",
        "reasoning",
        "row",
        "run_id",
        "source_sequence",
        "text",
        "tool_call",
        "tool_result",
        "trust",
    )
    ROW_FIELD_NUMBER: _ClassVar[int]
    TRUST_FIELD_NUMBER: _ClassVar[int]
    ITEM_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCE_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_FIELD_NUMBER: _ClassVar[int]
    TOOL_RESULT_FIELD_NUMBER: _ClassVar[int]
    REASONING_FIELD_NUMBER: _ClassVar[int]
    row: Row
    trust: TrustLevel
    item_id: str
    source_sequence: int
    run_id: str
    text: str
    tool_call: ToolCall
    tool_result: ToolResult
    reasoning: ReasoningItem
    def __init__(
        self,
        row: Row | str | None = ...,
        trust: TrustLevel | str | None = ...,
        item_id: str | None = ...,
        source_sequence: int | None = ...,
        run_id: str | None = ...,
        text: str | None = ...,
        tool_call: ToolCall | _Mapping | None = ...,
        tool_result: ToolResult | _Mapping | None = ...,
        reasoning: ReasoningItem | _Mapping | None = ...,
    ) -> None: ...

class ToolDefinition(_message.Message):
    __slots__ = ("description", "input_schema_json", "name")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    INPUT_SCHEMA_JSON_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    input_schema_json: str
    def __init__(
        self,
        name: str | None = ...,
        description: str | None = ...,
        input_schema_json: str | None = ...,
    ) -> None: ...

class BuildResponse(_message.Message):
    __slots__ = (
        "budget",
        "checkpoint_version",
        "epoch",
        "estimated_input_tokens",
        "input_budget_tokens",
        "needs_compaction",
        "prefix_sha256",
        "prefix_tokens",
        "pressure",
        "provider_api",
        "provider_payload",
        "request",
        "request_sequence",
        "request_sha256",
    )
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    PREFIX_SHA256_FIELD_NUMBER: _ClassVar[int]
    PREFIX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_VERSION_FIELD_NUMBER: _ClassVar[int]
    REQUEST_SHA256_FIELD_NUMBER: _ClassVar[int]
    REQUEST_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    NEEDS_COMPACTION_FIELD_NUMBER: _ClassVar[int]
    PRESSURE_FIELD_NUMBER: _ClassVar[int]
    BUDGET_FIELD_NUMBER: _ClassVar[int]
    PROVIDER_PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    PROVIDER_API_FIELD_NUMBER: _ClassVar[int]
    ESTIMATED_INPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    INPUT_BUDGET_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request: ModelRequest
    prefix_sha256: str
    prefix_tokens: int
    epoch: int
    checkpoint_version: int
    request_sha256: str
    request_sequence: int
    needs_compaction: bool
    pressure: PressureReport
    budget: _containers.RepeatedCompositeFieldContainer[ClassUsage]
    provider_payload: bytes
    provider_api: str
    estimated_input_tokens: int
    input_budget_tokens: int
    def __init__(
        self,
        request: ModelRequest | _Mapping | None = ...,
        prefix_sha256: str | None = ...,
        prefix_tokens: int | None = ...,
        epoch: int | None = ...,
        checkpoint_version: int | None = ...,
        request_sha256: str | None = ...,
        request_sequence: int | None = ...,
        needs_compaction: bool | None = ...,
        pressure: PressureReport | _Mapping | None = ...,
        budget: _Iterable[ClassUsage | _Mapping] | None = ...,
        provider_payload: bytes | None = ...,
        provider_api: str | None = ...,
        estimated_input_tokens: int | None = ...,
        input_budget_tokens: int | None = ...,
    ) -> None: ...

class PressureReport(_message.Message):
    __slots__ = (
        "body_budget_tokens",
        "body_tokens_after",
        "body_tokens_before",
        "fits",
        "history_cut_index",
        "history_items_dropped",
        "legacy_tool_excerpts",
        "steps",
    )
    FITS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    BODY_TOKENS_BEFORE_FIELD_NUMBER: _ClassVar[int]
    BODY_TOKENS_AFTER_FIELD_NUMBER: _ClassVar[int]
    BODY_BUDGET_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LEGACY_TOOL_EXCERPTS_FIELD_NUMBER: _ClassVar[int]
    HISTORY_CUT_INDEX_FIELD_NUMBER: _ClassVar[int]
    HISTORY_ITEMS_DROPPED_FIELD_NUMBER: _ClassVar[int]
    fits: bool
    steps: _containers.RepeatedCompositeFieldContainer[YieldStep]
    body_tokens_before: int
    body_tokens_after: int
    body_budget_tokens: int
    legacy_tool_excerpts: _containers.RepeatedScalarFieldContainer[str]
    history_cut_index: int
    history_items_dropped: int
    def __init__(
        self,
        fits: bool | None = ...,
        steps: _Iterable[YieldStep | _Mapping] | None = ...,
        body_tokens_before: int | None = ...,
        body_tokens_after: int | None = ...,
        body_budget_tokens: int | None = ...,
        legacy_tool_excerpts: _Iterable[str] | None = ...,
        history_cut_index: int | None = ...,
        history_items_dropped: int | None = ...,
    ) -> None: ...

class YieldStep(_message.Message):
    __slots__ = ("item_ids", "step", "tokens_freed")
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FREED_FIELD_NUMBER: _ClassVar[int]
    ITEM_IDS_FIELD_NUMBER: _ClassVar[int]
    step: str
    tokens_freed: int
    item_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(
        self,
        step: str | None = ...,
        tokens_freed: int | None = ...,
        item_ids: _Iterable[str] | None = ...,
    ) -> None: ...

class GetBuildRequest(_message.Message):
    __slots__ = ("request_sequence", "session_id", "tenant_id")
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    tenant_id: str
    session_id: str
    request_sequence: int
    def __init__(
        self,
        tenant_id: str | None = ...,
        session_id: str | None = ...,
        request_sequence: int | None = ...,
    ) -> None: ...

class ReportUsageRequest(_message.Message):
    __slots__ = (
        "cache_creation_input_tokens",
        "cache_read_input_tokens",
        "idempotency_key",
        "input_tokens",
        "model_id",
        "output_tokens",
        "request_sequence",
        "session_id",
        "tenant_id",
    )
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    INPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_READ_INPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_CREATION_INPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_KEY_FIELD_NUMBER: _ClassVar[int]
    tenant_id: str
    session_id: str
    request_sequence: int
    model_id: str
    input_tokens: int
    cache_read_input_tokens: int
    cache_creation_input_tokens: int
    output_tokens: int
    idempotency_key: str
    def __init__(
        self,
        tenant_id: str | None = ...,
        session_id: str | None = ...,
        request_sequence: int | None = ...,
        model_id: str | None = ...,
        input_tokens: int | None = ...,
        cache_read_input_tokens: int | None = ...,
        cache_creation_input_tokens: int | None = ...,
        output_tokens: int | None = ...,
        idempotency_key: str | None = ...,
    ) -> None: ...

class ReportUsageResponse(_message.Message):
    __slots__ = ("absorbed", "cached_prefix_ppm", "factor_ppm", "samples", "signed_error_ppm")
    FACTOR_PPM_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    SIGNED_ERROR_PPM_FIELD_NUMBER: _ClassVar[int]
    CACHED_PREFIX_PPM_FIELD_NUMBER: _ClassVar[int]
    ABSORBED_FIELD_NUMBER: _ClassVar[int]
    factor_ppm: int
    samples: int
    signed_error_ppm: int
    cached_prefix_ppm: int
    absorbed: bool
    def __init__(
        self,
        factor_ppm: int | None = ...,
        samples: int | None = ...,
        signed_error_ppm: int | None = ...,
        cached_prefix_ppm: int | None = ...,
        absorbed: bool | None = ...,
    ) -> None: ...

class LoadSkillRequest(_message.Message):
    __slots__ = ("body", "name", "run_id", "session_id", "tenant_id", "trust")
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    BODY_FIELD_NUMBER: _ClassVar[int]
    TRUST_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    tenant_id: str
    session_id: str
    name: str
    body: str
    trust: TrustLevel
    run_id: str
    def __init__(
        self,
        tenant_id: str | None = ...,
        session_id: str | None = ...,
        name: str | None = ...,
        body: str | None = ...,
        trust: TrustLevel | str | None = ...,
        run_id: str | None = ...,
    ) -> None: ...

class LoadSkillResponse(_message.Message):
    __slots__ = ("loaded", "newly_loaded")
    LOADED_FIELD_NUMBER: _ClassVar[int]
    NEWLY_LOADED_FIELD_NUMBER: _ClassVar[int]
    loaded: _containers.RepeatedScalarFieldContainer[str]
    newly_loaded: bool
    def __init__(
        self, loaded: _Iterable[str] | None = ..., newly_loaded: bool | None = ...
    ) -> None: ...

class EraseSubjectRequest(_message.Message):
    __slots__ = ("person_id", "tenant_id")
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    PERSON_ID_FIELD_NUMBER: _ClassVar[int]
    tenant_id: str
    person_id: str
    def __init__(self, tenant_id: str | None = ..., person_id: str | None = ...) -> None: ...

class EraseSubjectResponse(_message.Message):
    __slots__ = ("bound_run_ids", "invalidated_session_ids", "redacted_items", "redacted_requests")
    INVALIDATED_SESSION_IDS_FIELD_NUMBER: _ClassVar[int]
    BOUND_RUN_IDS_FIELD_NUMBER: _ClassVar[int]
    REDACTED_ITEMS_FIELD_NUMBER: _ClassVar[int]
    REDACTED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    invalidated_session_ids: _containers.RepeatedScalarFieldContainer[str]
    bound_run_ids: _containers.RepeatedScalarFieldContainer[str]
    redacted_items: int
    redacted_requests: int
    def __init__(
        self,
        invalidated_session_ids: _Iterable[str] | None = ...,
        bound_run_ids: _Iterable[str] | None = ...,
        redacted_items: int | None = ...,
        redacted_requests: int | None = ...,
    ) -> None: ...

class TaskState(_message.Message):
    __slots__ = ("status", "task_id", "title")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    TITLE_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    title: str
    status: TaskStatus
    def __init__(
        self,
        task_id: str | None = ...,
        title: str | None = ...,
        status: TaskStatus | str | None = ...,
    ) -> None: ...

class Fact(_message.Message):
    __slots__ = ("source_event_ids", "statement", "trust")
    STATEMENT_FIELD_NUMBER: _ClassVar[int]
    SOURCE_EVENT_IDS_FIELD_NUMBER: _ClassVar[int]
    TRUST_FIELD_NUMBER: _ClassVar[int]
    statement: str
    source_event_ids: _containers.RepeatedScalarFieldContainer[int]
    trust: TrustLevel
    def __init__(
        self,
        statement: str | None = ...,
        source_event_ids: _Iterable[int] | None = ...,
        trust: TrustLevel | str | None = ...,
    ) -> None: ...

class WorkingStateUpdate(_message.Message):
    __slots__ = (
        "add_constraints",
        "add_facts",
        "add_questions",
        "next_action",
        "objective",
        "remove_constraints",
        "resolve_questions",
        "upsert_tasks",
    )
    OBJECTIVE_FIELD_NUMBER: _ClassVar[int]
    ADD_CONSTRAINTS_FIELD_NUMBER: _ClassVar[int]
    UPSERT_TASKS_FIELD_NUMBER: _ClassVar[int]
    ADD_FACTS_FIELD_NUMBER: _ClassVar[int]
    RESOLVE_QUESTIONS_FIELD_NUMBER: _ClassVar[int]
    NEXT_ACTION_FIELD_NUMBER: _ClassVar[int]
    REMOVE_CONSTRAINTS_FIELD_NUMBER: _ClassVar[int]
    ADD_QUESTIONS_FIELD_NUMBER: _ClassVar[int]
    objective: str
    add_constraints: _containers.RepeatedScalarFieldContainer[str]
    upsert_tasks: _containers.RepeatedCompositeFieldContainer[TaskState]
    add_facts: _containers.RepeatedCompositeFieldContainer[Fact]
    resolve_questions: _containers.RepeatedScalarFieldContainer[str]
    next_action: str
    remove_constraints: _containers.RepeatedScalarFieldContainer[str]
    add_questions: _containers.RepeatedScalarFieldContainer[str]
    def __init__(
        self,
        objective: str | None = ...,
        add_constraints: _Iterable[str] | None = ...,
        upsert_tasks: _Iterable[TaskState | _Mapping] | None = ...,
        add_facts: _Iterable[Fact | _Mapping] | None = ...,
        resolve_questions: _Iterable[str] | None = ...,
        next_action: str | None = ...,
        remove_constraints: _Iterable[str] | None = ...,
        add_questions: _Iterable[str] | None = ...,
    ) -> None: ...

class WorkingStateEntry(_message.Message):
    __slots__ = ("source_sequence", "text", "trust", "writer")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    WRITER_FIELD_NUMBER: _ClassVar[int]
    SOURCE_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    TRUST_FIELD_NUMBER: _ClassVar[int]
    text: str
    writer: Writer
    source_sequence: int
    trust: TrustLevel
    def __init__(
        self,
        text: str | None = ...,
        writer: Writer | str | None = ...,
        source_sequence: int | None = ...,
        trust: TrustLevel | str | None = ...,
    ) -> None: ...

class WorkingState(_message.Message):
    __slots__ = ("constraints", "facts", "next_action", "objective", "open_questions", "tasks")
    OBJECTIVE_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINTS_FIELD_NUMBER: _ClassVar[int]
    TASKS_FIELD_NUMBER: _ClassVar[int]
    FACTS_FIELD_NUMBER: _ClassVar[int]
    OPEN_QUESTIONS_FIELD_NUMBER: _ClassVar[int]
    NEXT_ACTION_FIELD_NUMBER: _ClassVar[int]
    objective: WorkingStateEntry
    constraints: _containers.RepeatedCompositeFieldContainer[WorkingStateEntry]
    tasks: _containers.RepeatedCompositeFieldContainer[TaskState]
    facts: _containers.RepeatedCompositeFieldContainer[Fact]
    open_questions: _containers.RepeatedCompositeFieldContainer[WorkingStateEntry]
    next_action: str
    def __init__(
        self,
        objective: WorkingStateEntry | _Mapping | None = ...,
        constraints: _Iterable[WorkingStateEntry | _Mapping] | None = ...,
        tasks: _Iterable[TaskState | _Mapping] | None = ...,
        facts: _Iterable[Fact | _Mapping] | None = ...,
        open_questions: _Iterable[WorkingStateEntry | _Mapping] | None = ...,
        next_action: str | None = ...,
    ) -> None: ...

class UpdateWorkingStateRequest(_message.Message):
    __slots__ = (
        "expected_checkpoint_version",
        "idempotency_key",
        "run_id",
        "session_id",
        "tenant_id",
        "update",
        "writer",
    )
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_CHECKPOINT_VERSION_FIELD_NUMBER: _ClassVar[int]
    WRITER_FIELD_NUMBER: _ClassVar[int]
    UPDATE_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_KEY_FIELD_NUMBER: _ClassVar[int]
    tenant_id: str
    session_id: str
    run_id: str
    expected_checkpoint_version: int
    writer: Writer
    update: WorkingStateUpdate
    idempotency_key: str
    def __init__(
        self,
        tenant_id: str | None = ...,
        session_id: str | None = ...,
        run_id: str | None = ...,
        expected_checkpoint_version: int | None = ...,
        writer: Writer | str | None = ...,
        update: WorkingStateUpdate | _Mapping | None = ...,
        idempotency_key: str | None = ...,
    ) -> None: ...

class UpdateWorkingStateResponse(_message.Message):
    __slots__ = ("checkpoint_version", "event_sequence", "state")
    CHECKPOINT_VERSION_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    EVENT_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    checkpoint_version: int
    state: WorkingState
    event_sequence: int
    def __init__(
        self,
        checkpoint_version: int | None = ...,
        state: WorkingState | _Mapping | None = ...,
        event_sequence: int | None = ...,
    ) -> None: ...

class ListControlToolsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListControlToolsResponse(_message.Message):
    __slots__ = ("tools",)
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    tools: _containers.RepeatedCompositeFieldContainer[ToolSpec]
    def __init__(self, tools: _Iterable[ToolSpec | _Mapping] | None = ...) -> None: ...

class ElidedSpan(_message.Message):
    __slots__ = ("artifact_ref", "byte_length", "event_id", "item_id", "trust")
    ITEM_ID_FIELD_NUMBER: _ClassVar[int]
    TRUST_FIELD_NUMBER: _ClassVar[int]
    BYTE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    ARTIFACT_REF_FIELD_NUMBER: _ClassVar[int]
    EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    item_id: str
    trust: TrustLevel
    byte_length: int
    artifact_ref: str
    event_id: int
    def __init__(
        self,
        item_id: str | None = ...,
        trust: TrustLevel | str | None = ...,
        byte_length: int | None = ...,
        artifact_ref: str | None = ...,
        event_id: int | None = ...,
    ) -> None: ...

class CompactionResult(_message.Message):
    __slots__ = (
        "compactor_version",
        "depth",
        "elided",
        "prompt_version",
        "replaced_through_sequence",
        "source_event_ids",
        "summary",
        "tokens_after",
        "tokens_before",
    )
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    SOURCE_EVENT_IDS_FIELD_NUMBER: _ClassVar[int]
    ELIDED_FIELD_NUMBER: _ClassVar[int]
    REPLACED_THROUGH_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    DEPTH_FIELD_NUMBER: _ClassVar[int]
    TOKENS_BEFORE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_AFTER_FIELD_NUMBER: _ClassVar[int]
    COMPACTOR_VERSION_FIELD_NUMBER: _ClassVar[int]
    PROMPT_VERSION_FIELD_NUMBER: _ClassVar[int]
    summary: str
    source_event_ids: _containers.RepeatedScalarFieldContainer[int]
    elided: _containers.RepeatedCompositeFieldContainer[ElidedSpan]
    replaced_through_sequence: int
    depth: int
    tokens_before: int
    tokens_after: int
    compactor_version: str
    prompt_version: str
    def __init__(
        self,
        summary: str | None = ...,
        source_event_ids: _Iterable[int] | None = ...,
        elided: _Iterable[ElidedSpan | _Mapping] | None = ...,
        replaced_through_sequence: int | None = ...,
        depth: int | None = ...,
        tokens_before: int | None = ...,
        tokens_after: int | None = ...,
        compactor_version: str | None = ...,
        prompt_version: str | None = ...,
    ) -> None: ...

class PrepareCompactionRequest(_message.Message):
    __slots__ = ("checkpoint_version", "run_id", "session_id", "tenant_id", "through_sequence")
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_VERSION_FIELD_NUMBER: _ClassVar[int]
    THROUGH_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    tenant_id: str
    session_id: str
    run_id: str
    checkpoint_version: int
    through_sequence: int
    def __init__(
        self,
        tenant_id: str | None = ...,
        session_id: str | None = ...,
        run_id: str | None = ...,
        checkpoint_version: int | None = ...,
        through_sequence: int | None = ...,
    ) -> None: ...

class PrepareCompactionResponse(_message.Message):
    __slots__ = (
        "checkpoint_version",
        "depth",
        "elided",
        "open_questions",
        "prompt",
        "prompt_version",
        "replaced_through_sequence",
        "retained_constraints",
        "source_event_ids",
        "summarizer_input",
        "tokens_before",
    )
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_VERSION_FIELD_NUMBER: _ClassVar[int]
    SUMMARIZER_INPUT_FIELD_NUMBER: _ClassVar[int]
    ELIDED_FIELD_NUMBER: _ClassVar[int]
    RETAINED_CONSTRAINTS_FIELD_NUMBER: _ClassVar[int]
    OPEN_QUESTIONS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_EVENT_IDS_FIELD_NUMBER: _ClassVar[int]
    REPLACED_THROUGH_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    DEPTH_FIELD_NUMBER: _ClassVar[int]
    TOKENS_BEFORE_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_VERSION_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    prompt_version: str
    summarizer_input: str
    elided: _containers.RepeatedCompositeFieldContainer[ElidedSpan]
    retained_constraints: _containers.RepeatedScalarFieldContainer[str]
    open_questions: _containers.RepeatedScalarFieldContainer[str]
    source_event_ids: _containers.RepeatedScalarFieldContainer[int]
    replaced_through_sequence: int
    depth: int
    tokens_before: int
    checkpoint_version: int
    def __init__(
        self,
        prompt: str | None = ...,
        prompt_version: str | None = ...,
        summarizer_input: str | None = ...,
        elided: _Iterable[ElidedSpan | _Mapping] | None = ...,
        retained_constraints: _Iterable[str] | None = ...,
        open_questions: _Iterable[str] | None = ...,
        source_event_ids: _Iterable[int] | None = ...,
        replaced_through_sequence: int | None = ...,
        depth: int | None = ...,
        tokens_before: int | None = ...,
        checkpoint_version: int | None = ...,
    ) -> None: ...

class CommitCompactionRequest(_message.Message):
    __slots__ = (
        "expected_checkpoint_version",
        "idempotency_key",
        "result",
        "run_id",
        "session_id",
        "tenant_id",
    )
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_CHECKPOINT_VERSION_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_KEY_FIELD_NUMBER: _ClassVar[int]
    tenant_id: str
    session_id: str
    run_id: str
    expected_checkpoint_version: int
    result: CompactionResult
    idempotency_key: str
    def __init__(
        self,
        tenant_id: str | None = ...,
        session_id: str | None = ...,
        run_id: str | None = ...,
        expected_checkpoint_version: int | None = ...,
        result: CompactionResult | _Mapping | None = ...,
        idempotency_key: str | None = ...,
    ) -> None: ...

class CommitCompactionResponse(_message.Message):
    __slots__ = ("checkpoint_version", "event_sequence")
    CHECKPOINT_VERSION_FIELD_NUMBER: _ClassVar[int]
    EVENT_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    checkpoint_version: int
    event_sequence: int
    def __init__(
        self, checkpoint_version: int | None = ..., event_sequence: int | None = ...
    ) -> None: ...

class OfferFactCandidatesRequest(_message.Message):
    __slots__ = ("idempotency_key", "session_id", "tenant_id")
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_KEY_FIELD_NUMBER: _ClassVar[int]
    tenant_id: str
    session_id: str
    idempotency_key: str
    def __init__(
        self,
        tenant_id: str | None = ...,
        session_id: str | None = ...,
        idempotency_key: str | None = ...,
    ) -> None: ...

class FactCandidate(_message.Message):
    __slots__ = ("authority", "fact", "run_id")
    FACT_FIELD_NUMBER: _ClassVar[int]
    AUTHORITY_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    fact: Fact
    authority: str
    run_id: str
    def __init__(
        self,
        fact: Fact | _Mapping | None = ...,
        authority: str | None = ...,
        run_id: str | None = ...,
    ) -> None: ...

class OfferFactCandidatesResponse(_message.Message):
    __slots__ = ("candidates", "event_sequence")
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    EVENT_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    candidates: _containers.RepeatedCompositeFieldContainer[FactCandidate]
    event_sequence: int
    def __init__(
        self,
        candidates: _Iterable[FactCandidate | _Mapping] | None = ...,
        event_sequence: int | None = ...,
    ) -> None: ...
