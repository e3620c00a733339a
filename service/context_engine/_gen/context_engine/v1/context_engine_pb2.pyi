import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

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
    ERROR_REASON_SESSION_BUSY: _ClassVar[ErrorReason]

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
ERROR_REASON_SESSION_BUSY: ErrorReason
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
    __slots__ = ("model_id", "agent", "principal", "tools", "persona", "skills", "snapshot", "environment", "policy", "policy_cap_tokens", "reserve_output_tokens")
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
    def __init__(self, model_id: _Optional[str] = ..., agent: _Optional[_Union[AgentSpec, _Mapping]] = ..., principal: _Optional[_Union[Principal, _Mapping]] = ..., tools: _Optional[_Iterable[_Union[ToolSpec, _Mapping]]] = ..., persona: _Optional[_Union[Persona, _Mapping]] = ..., skills: _Optional[_Iterable[_Union[SkillCatalogEntry, _Mapping]]] = ..., snapshot: _Optional[_Union[MemorySnapshot, _Mapping]] = ..., environment: _Optional[_Union[SessionEnvironment, _Mapping]] = ..., policy: _Optional[_Union[PlatformPolicy, _Mapping]] = ..., policy_cap_tokens: _Optional[int] = ..., reserve_output_tokens: _Optional[int] = ...) -> None: ...

class AgentSpec(_message.Message):
    __slots__ = ("agent_id", "version", "instructions", "enabled_tools", "deferred_tools")
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
    def __init__(self, agent_id: _Optional[str] = ..., version: _Optional[str] = ..., instructions: _Optional[str] = ..., enabled_tools: _Optional[_Iterable[str]] = ..., deferred_tools: _Optional[_Iterable[str]] = ...) -> None: ...

class Principal(_message.Message):
    __slots__ = ("principal_id", "scopes", "scope_label")
    PRINCIPAL_ID_FIELD_NUMBER: _ClassVar[int]
    SCOPES_FIELD_NUMBER: _ClassVar[int]
    SCOPE_LABEL_FIELD_NUMBER: _ClassVar[int]
    principal_id: str
    scopes: _containers.RepeatedScalarFieldContainer[str]
    scope_label: str
    def __init__(self, principal_id: _Optional[str] = ..., scopes: _Optional[_Iterable[str]] = ..., scope_label: _Optional[str] = ...) -> None: ...

class ToolSpec(_message.Message):
    __slots__ = ("name", "description", "input_schema_json", "output_schema_json", "side_effect", "required_scopes", "server", "model_visible", "builtin", "session_binding", "policy_json")
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
    def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ..., input_schema_json: _Optional[str] = ..., output_schema_json: _Optional[str] = ..., side_effect: _Optional[_Union[SideEffect, str]] = ..., required_scopes: _Optional[_Iterable[str]] = ..., server: _Optional[str] = ..., model_visible: _Optional[bool] = ..., builtin: _Optional[bool] = ..., session_binding: _Optional[str] = ..., policy_json: _Optional[str] = ...) -> None: ...

class Persona(_message.Message):
    __slots__ = ("revision", "entries")
    REVISION_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    revision: str
    entries: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, revision: _Optional[str] = ..., entries: _Optional[_Iterable[str]] = ...) -> None: ...

class SkillCatalogEntry(_message.Message):
    __slots__ = ("name", "description", "version", "trust")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TRUST_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    version: str
    trust: TrustLevel
    def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ..., version: _Optional[str] = ..., trust: _Optional[_Union[TrustLevel, str]] = ...) -> None: ...

class MemorySnapshot(_message.Message):
    __slots__ = ("snapshot_id", "recall_trace_id", "watermark", "items")
    SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    RECALL_TRACE_ID_FIELD_NUMBER: _ClassVar[int]
    WATERMARK_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    snapshot_id: str
    recall_trace_id: str
    watermark: int
    items: _containers.RepeatedCompositeFieldContainer[MemoryItem]
    def __init__(self, snapshot_id: _Optional[str] = ..., recall_trace_id: _Optional[str] = ..., watermark: _Optional[int] = ..., items: _Optional[_Iterable[_Union[MemoryItem, _Mapping]]] = ...) -> None: ...

class MemoryItem(_message.Message):
    __slots__ = ("item_id", "text", "source", "person_ids")
    ITEM_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    PERSON_IDS_FIELD_NUMBER: _ClassVar[int]
    item_id: str
    text: str
    source: str
    person_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, item_id: _Optional[str] = ..., text: _Optional[str] = ..., source: _Optional[str] = ..., person_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class SessionEnvironment(_message.Message):
    __slots__ = ("kind", "surface", "browser_profile_id", "allowed_origins", "bound_capabilities", "time_zone")
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
    def __init__(self, kind: _Optional[_Union[SessionKind, str]] = ..., surface: _Optional[str] = ..., browser_profile_id: _Optional[str] = ..., allowed_origins: _Optional[_Iterable[str]] = ..., bound_capabilities: _Optional[_Iterable[str]] = ..., time_zone: _Optional[str] = ...) -> None: ...

class PlatformPolicy(_message.Message):
    __slots__ = ("version", "text")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    version: str
    text: str
    def __init__(self, version: _Optional[str] = ..., text: _Optional[str] = ...) -> None: ...

class ContextPlan(_message.Message):
    __slots__ = ("session_id", "epoch", "prefix_sha256", "prefix_tokens", "model_id", "provider", "tool_names", "tool_schema_sha256", "authority_scope_hashes", "snapshot_id", "snapshot_watermark", "skill_pins", "cache_breakpoints", "policy_version", "builder_version", "created_at", "reason", "skipped_tool_names", "deferred_tool_names", "spec_sha256", "prefix_classes", "prefix_document", "pinned_tools", "recall_trace_id", "session_kind", "invalidated")
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
    def __init__(self, session_id: _Optional[str] = ..., epoch: _Optional[int] = ..., prefix_sha256: _Optional[str] = ..., prefix_tokens: _Optional[int] = ..., model_id: _Optional[str] = ..., provider: _Optional[_Union[Provider, str]] = ..., tool_names: _Optional[_Iterable[str]] = ..., tool_schema_sha256: _Optional[str] = ..., authority_scope_hashes: _Optional[_Iterable[str]] = ..., snapshot_id: _Optional[str] = ..., snapshot_watermark: _Optional[int] = ..., skill_pins: _Optional[_Iterable[_Union[SkillPin, _Mapping]]] = ..., cache_breakpoints: _Optional[_Iterable[_Union[CacheBreakpoint, _Mapping]]] = ..., policy_version: _Optional[str] = ..., builder_version: _Optional[str] = ..., created_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., reason: _Optional[_Union[PlanReason, str]] = ..., skipped_tool_names: _Optional[_Iterable[str]] = ..., deferred_tool_names: _Optional[_Iterable[str]] = ..., spec_sha256: _Optional[str] = ..., prefix_classes: _Optional[_Iterable[_Union[ClassUsage, _Mapping]]] = ..., prefix_document: _Optional[bytes] = ..., pinned_tools: _Optional[_Iterable[_Union[PinnedTool, _Mapping]]] = ..., recall_trace_id: _Optional[str] = ..., session_kind: _Optional[_Union[SessionKind, str]] = ..., invalidated: _Optional[bool] = ...) -> None: ...

class PinnedTool(_message.Message):
    __slots__ = ("name", "defined", "required_scopes", "side_effect", "spec_sha256")
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
    def __init__(self, name: _Optional[str] = ..., defined: _Optional[bool] = ..., required_scopes: _Optional[_Iterable[str]] = ..., side_effect: _Optional[_Union[SideEffect, str]] = ..., spec_sha256: _Optional[str] = ...) -> None: ...

class SkillPin(_message.Message):
    __slots__ = ("name", "version")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: str
    def __init__(self, name: _Optional[str] = ..., version: _Optional[str] = ...) -> None: ...

class CacheBreakpoint(_message.Message):
    __slots__ = ("name", "through_item", "through_input_item", "ttl", "priority", "through_sequence")
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
    def __init__(self, name: _Optional[str] = ..., through_item: _Optional[str] = ..., through_input_item: _Optional[str] = ..., ttl: _Optional[str] = ..., priority: _Optional[int] = ..., through_sequence: _Optional[int] = ...) -> None: ...

class ClassUsage(_message.Message):
    __slots__ = ("class_name", "tokens", "items", "cap_tokens", "cap_items")
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
    def __init__(self, class_name: _Optional[str] = ..., tokens: _Optional[int] = ..., items: _Optional[int] = ..., cap_tokens: _Optional[int] = ..., cap_items: _Optional[int] = ...) -> None: ...

class PlanRequest(_message.Message):
    __slots__ = ("tenant_id", "session_id", "spec")
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    tenant_id: str
    session_id: str
    spec: PlanSpec
    def __init__(self, tenant_id: _Optional[str] = ..., session_id: _Optional[str] = ..., spec: _Optional[_Union[PlanSpec, _Mapping]] = ...) -> None: ...

class PlanResponse(_message.Message):
    __slots__ = ("plan", "created", "spec_matches", "unknown_tool_names")
    PLAN_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    SPEC_MATCHES_FIELD_NUMBER: _ClassVar[int]
    UNKNOWN_TOOL_NAMES_FIELD_NUMBER: _ClassVar[int]
    plan: ContextPlan
    created: bool
    spec_matches: bool
    unknown_tool_names: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, plan: _Optional[_Union[ContextPlan, _Mapping]] = ..., created: _Optional[bool] = ..., spec_matches: _Optional[bool] = ..., unknown_tool_names: _Optional[_Iterable[str]] = ...) -> None: ...

class GetPlanRequest(_message.Message):
    __slots__ = ("tenant_id", "session_id", "epoch")
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    tenant_id: str
    session_id: str
    epoch: int
    def __init__(self, tenant_id: _Optional[str] = ..., session_id: _Optional[str] = ..., epoch: _Optional[int] = ...) -> None: ...

class GetPlanResponse(_message.Message):
    __slots__ = ("plan",)
    PLAN_FIELD_NUMBER: _ClassVar[int]
    plan: ContextPlan
    def __init__(self, plan: _Optional[_Union[ContextPlan, _Mapping]] = ...) -> None: ...

class RotateRequest(_message.Message):
    __slots__ = ("tenant_id", "session_id", "from_epoch", "reason", "spec", "detail", "idempotency_key")
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
    def __init__(self, tenant_id: _Optional[str] = ..., session_id: _Optional[str] = ..., from_epoch: _Optional[int] = ..., reason: _Optional[_Union[PlanReason, str]] = ..., spec: _Optional[_Union[PlanSpec, _Mapping]] = ..., detail: _Optional[str] = ..., idempotency_key: _Optional[str] = ...) -> None: ...

class RotateResponse(_message.Message):
    __slots__ = ("plan", "unknown_tool_names")
    PLAN_FIELD_NUMBER: _ClassVar[int]
    UNKNOWN_TOOL_NAMES_FIELD_NUMBER: _ClassVar[int]
    plan: ContextPlan
    unknown_tool_names: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, plan: _Optional[_Union[ContextPlan, _Mapping]] = ..., unknown_tool_names: _Optional[_Iterable[str]] = ...) -> None: ...

class ConversationItem(_message.Message):
    __slots__ = ("item_id", "user_message", "assistant_message", "tool_call", "tool_result", "reasoning")
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
    def __init__(self, item_id: _Optional[str] = ..., user_message: _Optional[_Union[UserMessage, _Mapping]] = ..., assistant_message: _Optional[_Union[AssistantMessage, _Mapping]] = ..., tool_call: _Optional[_Union[ToolCall, _Mapping]] = ..., tool_result: _Optional[_Union[ToolResult, _Mapping]] = ..., reasoning: _Optional[_Union[ReasoningItem, _Mapping]] = ...) -> None: ...

class UserMessage(_message.Message):
    __slots__ = ("text", "attachments")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    ATTACHMENTS_FIELD_NUMBER: _ClassVar[int]
    text: str
    attachments: _containers.RepeatedCompositeFieldContainer[Attachment]
    def __init__(self, text: _Optional[str] = ..., attachments: _Optional[_Iterable[_Union[Attachment, _Mapping]]] = ...) -> None: ...

class Attachment(_message.Message):
    __slots__ = ("kind", "ref", "pages", "text_length")
    KIND_FIELD_NUMBER: _ClassVar[int]
    REF_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    TEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    kind: str
    ref: str
    pages: int
    text_length: int
    def __init__(self, kind: _Optional[str] = ..., ref: _Optional[str] = ..., pages: _Optional[int] = ..., text_length: _Optional[int] = ...) -> None: ...

class AssistantMessage(_message.Message):
    __slots__ = ("text", "provider_item_id")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    PROVIDER_ITEM_ID_FIELD_NUMBER: _ClassVar[int]
    text: str
    provider_item_id: str
    def __init__(self, text: _Optional[str] = ..., provider_item_id: _Optional[str] = ...) -> None: ...

class ToolCall(_message.Message):
    __slots__ = ("call_id", "tool_name", "arguments_json", "task_id", "provider_item_id")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    TOOL_NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_JSON_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    PROVIDER_ITEM_ID_FIELD_NUMBER: _ClassVar[int]
    call_id: str
    tool_name: str
    arguments_json: str
    task_id: str
    provider_item_id: str
    def __init__(self, call_id: _Optional[str] = ..., tool_name: _Optional[str] = ..., arguments_json: _Optional[str] = ..., task_id: _Optional[str] = ..., provider_item_id: _Optional[str] = ...) -> None: ...

class ToolResult(_message.Message):
    __slots__ = ("call_id", "tool_name", "content", "trust", "source", "is_error", "artifact_ref", "context_content")
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
    def __init__(self, call_id: _Optional[str] = ..., tool_name: _Optional[str] = ..., content: _Optional[str] = ..., trust: _Optional[_Union[TrustLevel, str]] = ..., source: _Optional[str] = ..., is_error: _Optional[bool] = ..., artifact_ref: _Optional[str] = ..., context_content: _Optional[str] = ...) -> None: ...

class ReasoningItem(_message.Message):
    __slots__ = ("provider", "opaque")
    PROVIDER_FIELD_NUMBER: _ClassVar[int]
    OPAQUE_FIELD_NUMBER: _ClassVar[int]
    provider: Provider
    opaque: bytes
    def __init__(self, provider: _Optional[_Union[Provider, str]] = ..., opaque: _Optional[bytes] = ...) -> None: ...

class Run(_message.Message):
    __slots__ = ("run_id", "session_id", "parent_run_id", "seed_event_sequence", "epoch")
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
    def __init__(self, run_id: _Optional[str] = ..., session_id: _Optional[str] = ..., parent_run_id: _Optional[str] = ..., seed_event_sequence: _Optional[int] = ..., epoch: _Optional[int] = ...) -> None: ...

class ChildSeed(_message.Message):
    __slots__ = ("parent_run_id", "instruction")
    PARENT_RUN_ID_FIELD_NUMBER: _ClassVar[int]
    INSTRUCTION_FIELD_NUMBER: _ClassVar[int]
    parent_run_id: str
    instruction: str
    def __init__(self, parent_run_id: _Optional[str] = ..., instruction: _Optional[str] = ...) -> None: ...

class StartRunRequest(_message.Message):
    __slots__ = ("tenant_id", "session_id", "run_id", "idempotency_key", "user_message", "child", "seed_item_id", "admission")
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
    def __init__(self, tenant_id: _Optional[str] = ..., session_id: _Optional[str] = ..., run_id: _Optional[str] = ..., idempotency_key: _Optional[str] = ..., user_message: _Optional[_Union[UserMessage, _Mapping]] = ..., child: _Optional[_Union[ChildSeed, _Mapping]] = ..., seed_item_id: _Optional[str] = ..., admission: _Optional[_Union[RunAdmission, _Mapping]] = ...) -> None: ...

class RunAdmission(_message.Message):
    __slots__ = ("scopes", "browser_profile_id")
    SCOPES_FIELD_NUMBER: _ClassVar[int]
    BROWSER_PROFILE_ID_FIELD_NUMBER: _ClassVar[int]
    scopes: _containers.RepeatedScalarFieldContainer[str]
    browser_profile_id: str
    def __init__(self, scopes: _Optional[_Iterable[str]] = ..., browser_profile_id: _Optional[str] = ...) -> None: ...

class StartRunResponse(_message.Message):
    __slots__ = ("run", "checkpoint_version", "rotated_plan")
    RUN_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_VERSION_FIELD_NUMBER: _ClassVar[int]
    ROTATED_PLAN_FIELD_NUMBER: _ClassVar[int]
    run: Run
    checkpoint_version: int
    rotated_plan: ContextPlan
    def __init__(self, run: _Optional[_Union[Run, _Mapping]] = ..., checkpoint_version: _Optional[int] = ..., rotated_plan: _Optional[_Union[ContextPlan, _Mapping]] = ...) -> None: ...

class AppendItemsRequest(_message.Message):
    __slots__ = ("tenant_id", "session_id", "run_id", "expected_checkpoint_version", "idempotency_key", "items")
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
    def __init__(self, tenant_id: _Optional[str] = ..., session_id: _Optional[str] = ..., run_id: _Optional[str] = ..., expected_checkpoint_version: _Optional[int] = ..., idempotency_key: _Optional[str] = ..., items: _Optional[_Iterable[_Union[ConversationItem, _Mapping]]] = ...) -> None: ...

class AppendItemsResponse(_message.Message):
    __slots__ = ("checkpoint_version", "sequences", "item_ids")
    CHECKPOINT_VERSION_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    ITEM_IDS_FIELD_NUMBER: _ClassVar[int]
    checkpoint_version: int
    sequences: _containers.RepeatedScalarFieldContainer[int]
    item_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, checkpoint_version: _Optional[int] = ..., sequences: _Optional[_Iterable[int]] = ..., item_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class StepContext(_message.Message):
    __slots__ = ("recall", "corrections", "knowledge", "recall_floor_lines")
    RECALL_FIELD_NUMBER: _ClassVar[int]
    CORRECTIONS_FIELD_NUMBER: _ClassVar[int]
    KNOWLEDGE_FIELD_NUMBER: _ClassVar[int]
    RECALL_FLOOR_LINES_FIELD_NUMBER: _ClassVar[int]
    recall: _containers.RepeatedCompositeFieldContainer[RecallLine]
    corrections: _containers.RepeatedCompositeFieldContainer[RecallLine]
    knowledge: _containers.RepeatedCompositeFieldContainer[KnowledgePassage]
    recall_floor_lines: int
    def __init__(self, recall: _Optional[_Iterable[_Union[RecallLine, _Mapping]]] = ..., corrections: _Optional[_Iterable[_Union[RecallLine, _Mapping]]] = ..., knowledge: _Optional[_Iterable[_Union[KnowledgePassage, _Mapping]]] = ..., recall_floor_lines: _Optional[int] = ...) -> None: ...

class RecallLine(_message.Message):
    __slots__ = ("item_id", "text", "source", "person_ids")
    ITEM_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    PERSON_IDS_FIELD_NUMBER: _ClassVar[int]
    item_id: str
    text: str
    source: str
    person_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, item_id: _Optional[str] = ..., text: _Optional[str] = ..., source: _Optional[str] = ..., person_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class KnowledgePassage(_message.Message):
    __slots__ = ("item_id", "text", "citation", "trust")
    ITEM_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    CITATION_FIELD_NUMBER: _ClassVar[int]
    TRUST_FIELD_NUMBER: _ClassVar[int]
    item_id: str
    text: str
    citation: str
    trust: TrustLevel
    def __init__(self, item_id: _Optional[str] = ..., text: _Optional[str] = ..., citation: _Optional[str] = ..., trust: _Optional[_Union[TrustLevel, str]] = ...) -> None: ...

class BuildRequest(_message.Message):
    __slots__ = ("tenant_id", "session_id", "run_id", "checkpoint_version", "now", "step")
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
    def __init__(self, tenant_id: _Optional[str] = ..., session_id: _Optional[str] = ..., run_id: _Optional[str] = ..., checkpoint_version: _Optional[int] = ..., now: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., step: _Optional[_Union[StepContext, _Mapping]] = ...) -> None: ...

class ModelRequest(_message.Message):
    __slots__ = ("provider", "model_id", "system", "tools", "messages", "cache_breakpoints", "max_output_tokens", "session_key")
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
    def __init__(self, provider: _Optional[_Union[Provider, str]] = ..., model_id: _Optional[str] = ..., system: _Optional[_Iterable[_Union[ContentBlock, _Mapping]]] = ..., tools: _Optional[_Iterable[_Union[ToolDefinition, _Mapping]]] = ..., messages: _Optional[_Iterable[_Union[Message, _Mapping]]] = ..., cache_breakpoints: _Optional[_Iterable[_Union[CacheBreakpoint, _Mapping]]] = ..., max_output_tokens: _Optional[int] = ..., session_key: _Optional[str] = ...) -> None: ...

class Message(_message.Message):
    __slots__ = ("role", "blocks")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    role: str
    blocks: _containers.RepeatedCompositeFieldContainer[ContentBlock]
    def __init__(self, role: _Optional[str] = ..., blocks: _Optional[_Iterable[_Union[ContentBlock, _Mapping]]] = ...) -> None: ...

class ContentBlock(_message.Message):
    __slots__ = ("row", "trust", "item_id", "source_sequence", "run_id", "provider_item_id", "text", "tool_call", "tool_result", "reasoning")
    ROW_FIELD_NUMBER: _ClassVar[int]
    TRUST_FIELD_NUMBER: _ClassVar[int]
    ITEM_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCE_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    PROVIDER_ITEM_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_FIELD_NUMBER: _ClassVar[int]
    TOOL_RESULT_FIELD_NUMBER: _ClassVar[int]
    REASONING_FIELD_NUMBER: _ClassVar[int]
    row: Row
    trust: TrustLevel
    item_id: str
    source_sequence: int
    run_id: str
    provider_item_id: str
    text: str
    tool_call: ToolCall
    tool_result: ToolResult
    reasoning: ReasoningItem
    def __init__(self, row: _Optional[_Union[Row, str]] = ..., trust: _Optional[_Union[TrustLevel, str]] = ..., item_id: _Optional[str] = ..., source_sequence: _Optional[int] = ..., run_id: _Optional[str] = ..., provider_item_id: _Optional[str] = ..., text: _Optional[str] = ..., tool_call: _Optional[_Union[ToolCall, _Mapping]] = ..., tool_result: _Optional[_Union[ToolResult, _Mapping]] = ..., reasoning: _Optional[_Union[ReasoningItem, _Mapping]] = ...) -> None: ...

class ToolDefinition(_message.Message):
    __slots__ = ("name", "description", "input_schema_json")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    INPUT_SCHEMA_JSON_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    input_schema_json: str
    def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ..., input_schema_json: _Optional[str] = ...) -> None: ...

class BuildResponse(_message.Message):
    __slots__ = ("request", "prefix_sha256", "prefix_tokens", "epoch", "checkpoint_version", "request_sha256", "request_sequence", "needs_compaction", "pressure", "budget", "provider_payload", "provider_api", "estimated_input_tokens", "input_budget_tokens", "attachment_placements")
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
    ATTACHMENT_PLACEMENTS_FIELD_NUMBER: _ClassVar[int]
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
    attachment_placements: _containers.RepeatedCompositeFieldContainer[AttachmentPlacement]
    def __init__(self, request: _Optional[_Union[ModelRequest, _Mapping]] = ..., prefix_sha256: _Optional[str] = ..., prefix_tokens: _Optional[int] = ..., epoch: _Optional[int] = ..., checkpoint_version: _Optional[int] = ..., request_sha256: _Optional[str] = ..., request_sequence: _Optional[int] = ..., needs_compaction: _Optional[bool] = ..., pressure: _Optional[_Union[PressureReport, _Mapping]] = ..., budget: _Optional[_Iterable[_Union[ClassUsage, _Mapping]]] = ..., provider_payload: _Optional[bytes] = ..., provider_api: _Optional[str] = ..., estimated_input_tokens: _Optional[int] = ..., input_budget_tokens: _Optional[int] = ..., attachment_placements: _Optional[_Iterable[_Union[AttachmentPlacement, _Mapping]]] = ...) -> None: ...

class AttachmentPlacement(_message.Message):
    __slots__ = ("item_id", "source_sequence", "payload_path", "share_tokens", "attachments")
    ITEM_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCE_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_PATH_FIELD_NUMBER: _ClassVar[int]
    SHARE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ATTACHMENTS_FIELD_NUMBER: _ClassVar[int]
    item_id: str
    source_sequence: int
    payload_path: str
    share_tokens: int
    attachments: _containers.RepeatedCompositeFieldContainer[AttachmentSend]
    def __init__(self, item_id: _Optional[str] = ..., source_sequence: _Optional[int] = ..., payload_path: _Optional[str] = ..., share_tokens: _Optional[int] = ..., attachments: _Optional[_Iterable[_Union[AttachmentSend, _Mapping]]] = ...) -> None: ...

class AttachmentSend(_message.Message):
    __slots__ = ("attachment", "content_tokens", "content")
    ATTACHMENT_FIELD_NUMBER: _ClassVar[int]
    CONTENT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    attachment: Attachment
    content_tokens: int
    content: bool
    def __init__(self, attachment: _Optional[_Union[Attachment, _Mapping]] = ..., content_tokens: _Optional[int] = ..., content: _Optional[bool] = ...) -> None: ...

class PressureReport(_message.Message):
    __slots__ = ("fits", "steps", "body_tokens_before", "body_tokens_after", "body_budget_tokens", "legacy_tool_excerpts", "history_cut_index", "history_items_dropped")
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
    def __init__(self, fits: _Optional[bool] = ..., steps: _Optional[_Iterable[_Union[YieldStep, _Mapping]]] = ..., body_tokens_before: _Optional[int] = ..., body_tokens_after: _Optional[int] = ..., body_budget_tokens: _Optional[int] = ..., legacy_tool_excerpts: _Optional[_Iterable[str]] = ..., history_cut_index: _Optional[int] = ..., history_items_dropped: _Optional[int] = ...) -> None: ...

class YieldStep(_message.Message):
    __slots__ = ("step", "tokens_freed", "item_ids")
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FREED_FIELD_NUMBER: _ClassVar[int]
    ITEM_IDS_FIELD_NUMBER: _ClassVar[int]
    step: str
    tokens_freed: int
    item_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, step: _Optional[str] = ..., tokens_freed: _Optional[int] = ..., item_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class GetBuildRequest(_message.Message):
    __slots__ = ("tenant_id", "session_id", "request_sequence")
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    tenant_id: str
    session_id: str
    request_sequence: int
    def __init__(self, tenant_id: _Optional[str] = ..., session_id: _Optional[str] = ..., request_sequence: _Optional[int] = ...) -> None: ...

class ReportUsageRequest(_message.Message):
    __slots__ = ("tenant_id", "session_id", "request_sequence", "model_id", "input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens", "output_tokens", "idempotency_key")
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
    def __init__(self, tenant_id: _Optional[str] = ..., session_id: _Optional[str] = ..., request_sequence: _Optional[int] = ..., model_id: _Optional[str] = ..., input_tokens: _Optional[int] = ..., cache_read_input_tokens: _Optional[int] = ..., cache_creation_input_tokens: _Optional[int] = ..., output_tokens: _Optional[int] = ..., idempotency_key: _Optional[str] = ...) -> None: ...

class ReportUsageResponse(_message.Message):
    __slots__ = ("factor_ppm", "samples", "signed_error_ppm", "cached_prefix_ppm", "absorbed", "reuse_ppm")
    FACTOR_PPM_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    SIGNED_ERROR_PPM_FIELD_NUMBER: _ClassVar[int]
    CACHED_PREFIX_PPM_FIELD_NUMBER: _ClassVar[int]
    ABSORBED_FIELD_NUMBER: _ClassVar[int]
    REUSE_PPM_FIELD_NUMBER: _ClassVar[int]
    factor_ppm: int
    samples: int
    signed_error_ppm: int
    cached_prefix_ppm: int
    absorbed: bool
    reuse_ppm: int
    def __init__(self, factor_ppm: _Optional[int] = ..., samples: _Optional[int] = ..., signed_error_ppm: _Optional[int] = ..., cached_prefix_ppm: _Optional[int] = ..., absorbed: _Optional[bool] = ..., reuse_ppm: _Optional[int] = ...) -> None: ...

class LoadSkillRequest(_message.Message):
    __slots__ = ("tenant_id", "session_id", "name", "body", "trust", "run_id")
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
    def __init__(self, tenant_id: _Optional[str] = ..., session_id: _Optional[str] = ..., name: _Optional[str] = ..., body: _Optional[str] = ..., trust: _Optional[_Union[TrustLevel, str]] = ..., run_id: _Optional[str] = ...) -> None: ...

class LoadSkillResponse(_message.Message):
    __slots__ = ("loaded", "newly_loaded")
    LOADED_FIELD_NUMBER: _ClassVar[int]
    NEWLY_LOADED_FIELD_NUMBER: _ClassVar[int]
    loaded: _containers.RepeatedScalarFieldContainer[str]
    newly_loaded: bool
    def __init__(self, loaded: _Optional[_Iterable[str]] = ..., newly_loaded: _Optional[bool] = ...) -> None: ...

class EraseSubjectRequest(_message.Message):
    __slots__ = ("tenant_id", "person_id")
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    PERSON_ID_FIELD_NUMBER: _ClassVar[int]
    tenant_id: str
    person_id: str
    def __init__(self, tenant_id: _Optional[str] = ..., person_id: _Optional[str] = ...) -> None: ...

class EraseSubjectResponse(_message.Message):
    __slots__ = ("invalidated_session_ids", "bound_run_ids", "redacted_items", "redacted_requests", "redacted_request_run_ids")
    INVALIDATED_SESSION_IDS_FIELD_NUMBER: _ClassVar[int]
    BOUND_RUN_IDS_FIELD_NUMBER: _ClassVar[int]
    REDACTED_ITEMS_FIELD_NUMBER: _ClassVar[int]
    REDACTED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    REDACTED_REQUEST_RUN_IDS_FIELD_NUMBER: _ClassVar[int]
    invalidated_session_ids: _containers.RepeatedScalarFieldContainer[str]
    bound_run_ids: _containers.RepeatedScalarFieldContainer[str]
    redacted_items: int
    redacted_requests: int
    redacted_request_run_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, invalidated_session_ids: _Optional[_Iterable[str]] = ..., bound_run_ids: _Optional[_Iterable[str]] = ..., redacted_items: _Optional[int] = ..., redacted_requests: _Optional[int] = ..., redacted_request_run_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class TaskState(_message.Message):
    __slots__ = ("task_id", "title", "status")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    TITLE_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    title: str
    status: TaskStatus
    def __init__(self, task_id: _Optional[str] = ..., title: _Optional[str] = ..., status: _Optional[_Union[TaskStatus, str]] = ...) -> None: ...

class Fact(_message.Message):
    __slots__ = ("statement", "source_event_ids", "trust", "writer", "source_sequence", "source_item_ids")
    STATEMENT_FIELD_NUMBER: _ClassVar[int]
    SOURCE_EVENT_IDS_FIELD_NUMBER: _ClassVar[int]
    TRUST_FIELD_NUMBER: _ClassVar[int]
    WRITER_FIELD_NUMBER: _ClassVar[int]
    SOURCE_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    SOURCE_ITEM_IDS_FIELD_NUMBER: _ClassVar[int]
    statement: str
    source_event_ids: _containers.RepeatedScalarFieldContainer[int]
    trust: TrustLevel
    writer: Writer
    source_sequence: int
    source_item_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, statement: _Optional[str] = ..., source_event_ids: _Optional[_Iterable[int]] = ..., trust: _Optional[_Union[TrustLevel, str]] = ..., writer: _Optional[_Union[Writer, str]] = ..., source_sequence: _Optional[int] = ..., source_item_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class WorkingStateUpdate(_message.Message):
    __slots__ = ("objective", "add_constraints", "upsert_tasks", "add_facts", "resolve_questions", "next_action", "remove_constraints", "add_questions")
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
    def __init__(self, objective: _Optional[str] = ..., add_constraints: _Optional[_Iterable[str]] = ..., upsert_tasks: _Optional[_Iterable[_Union[TaskState, _Mapping]]] = ..., add_facts: _Optional[_Iterable[_Union[Fact, _Mapping]]] = ..., resolve_questions: _Optional[_Iterable[str]] = ..., next_action: _Optional[str] = ..., remove_constraints: _Optional[_Iterable[str]] = ..., add_questions: _Optional[_Iterable[str]] = ...) -> None: ...

class WorkingStateEntry(_message.Message):
    __slots__ = ("text", "writer", "source_sequence", "trust")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    WRITER_FIELD_NUMBER: _ClassVar[int]
    SOURCE_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    TRUST_FIELD_NUMBER: _ClassVar[int]
    text: str
    writer: Writer
    source_sequence: int
    trust: TrustLevel
    def __init__(self, text: _Optional[str] = ..., writer: _Optional[_Union[Writer, str]] = ..., source_sequence: _Optional[int] = ..., trust: _Optional[_Union[TrustLevel, str]] = ...) -> None: ...

class WorkingState(_message.Message):
    __slots__ = ("objective", "constraints", "tasks", "facts", "open_questions", "next_action")
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
    def __init__(self, objective: _Optional[_Union[WorkingStateEntry, _Mapping]] = ..., constraints: _Optional[_Iterable[_Union[WorkingStateEntry, _Mapping]]] = ..., tasks: _Optional[_Iterable[_Union[TaskState, _Mapping]]] = ..., facts: _Optional[_Iterable[_Union[Fact, _Mapping]]] = ..., open_questions: _Optional[_Iterable[_Union[WorkingStateEntry, _Mapping]]] = ..., next_action: _Optional[str] = ...) -> None: ...

class UpdateWorkingStateRequest(_message.Message):
    __slots__ = ("tenant_id", "session_id", "run_id", "expected_checkpoint_version", "writer", "update", "idempotency_key", "tool_arguments_json")
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_CHECKPOINT_VERSION_FIELD_NUMBER: _ClassVar[int]
    WRITER_FIELD_NUMBER: _ClassVar[int]
    UPDATE_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_KEY_FIELD_NUMBER: _ClassVar[int]
    TOOL_ARGUMENTS_JSON_FIELD_NUMBER: _ClassVar[int]
    tenant_id: str
    session_id: str
    run_id: str
    expected_checkpoint_version: int
    writer: Writer
    update: WorkingStateUpdate
    idempotency_key: str
    tool_arguments_json: str
    def __init__(self, tenant_id: _Optional[str] = ..., session_id: _Optional[str] = ..., run_id: _Optional[str] = ..., expected_checkpoint_version: _Optional[int] = ..., writer: _Optional[_Union[Writer, str]] = ..., update: _Optional[_Union[WorkingStateUpdate, _Mapping]] = ..., idempotency_key: _Optional[str] = ..., tool_arguments_json: _Optional[str] = ...) -> None: ...

class UpdateWorkingStateResponse(_message.Message):
    __slots__ = ("checkpoint_version", "state", "event_sequence")
    CHECKPOINT_VERSION_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    EVENT_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    checkpoint_version: int
    state: WorkingState
    event_sequence: int
    def __init__(self, checkpoint_version: _Optional[int] = ..., state: _Optional[_Union[WorkingState, _Mapping]] = ..., event_sequence: _Optional[int] = ...) -> None: ...

class ListControlToolsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListControlToolsResponse(_message.Message):
    __slots__ = ("tools",)
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    tools: _containers.RepeatedCompositeFieldContainer[ToolSpec]
    def __init__(self, tools: _Optional[_Iterable[_Union[ToolSpec, _Mapping]]] = ...) -> None: ...

class ElidedSpan(_message.Message):
    __slots__ = ("item_id", "trust", "byte_length", "artifact_ref", "event_id")
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
    def __init__(self, item_id: _Optional[str] = ..., trust: _Optional[_Union[TrustLevel, str]] = ..., byte_length: _Optional[int] = ..., artifact_ref: _Optional[str] = ..., event_id: _Optional[int] = ...) -> None: ...

class CompactionResult(_message.Message):
    __slots__ = ("summary", "source_event_ids", "elided", "replaced_through_sequence", "depth", "tokens_before", "tokens_after", "compactor_version", "prompt_version")
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
    def __init__(self, summary: _Optional[str] = ..., source_event_ids: _Optional[_Iterable[int]] = ..., elided: _Optional[_Iterable[_Union[ElidedSpan, _Mapping]]] = ..., replaced_through_sequence: _Optional[int] = ..., depth: _Optional[int] = ..., tokens_before: _Optional[int] = ..., tokens_after: _Optional[int] = ..., compactor_version: _Optional[str] = ..., prompt_version: _Optional[str] = ...) -> None: ...

class PrepareCompactionRequest(_message.Message):
    __slots__ = ("tenant_id", "session_id", "run_id", "checkpoint_version", "through_sequence")
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
    def __init__(self, tenant_id: _Optional[str] = ..., session_id: _Optional[str] = ..., run_id: _Optional[str] = ..., checkpoint_version: _Optional[int] = ..., through_sequence: _Optional[int] = ...) -> None: ...

class PrepareCompactionResponse(_message.Message):
    __slots__ = ("prompt", "prompt_version", "summarizer_input", "elided", "retained_constraints", "open_questions", "source_event_ids", "replaced_through_sequence", "depth", "tokens_before", "checkpoint_version")
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
    def __init__(self, prompt: _Optional[str] = ..., prompt_version: _Optional[str] = ..., summarizer_input: _Optional[str] = ..., elided: _Optional[_Iterable[_Union[ElidedSpan, _Mapping]]] = ..., retained_constraints: _Optional[_Iterable[str]] = ..., open_questions: _Optional[_Iterable[str]] = ..., source_event_ids: _Optional[_Iterable[int]] = ..., replaced_through_sequence: _Optional[int] = ..., depth: _Optional[int] = ..., tokens_before: _Optional[int] = ..., checkpoint_version: _Optional[int] = ...) -> None: ...

class CommitCompactionRequest(_message.Message):
    __slots__ = ("tenant_id", "session_id", "run_id", "expected_checkpoint_version", "result", "idempotency_key")
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
    def __init__(self, tenant_id: _Optional[str] = ..., session_id: _Optional[str] = ..., run_id: _Optional[str] = ..., expected_checkpoint_version: _Optional[int] = ..., result: _Optional[_Union[CompactionResult, _Mapping]] = ..., idempotency_key: _Optional[str] = ...) -> None: ...

class CommitCompactionResponse(_message.Message):
    __slots__ = ("checkpoint_version", "event_sequence")
    CHECKPOINT_VERSION_FIELD_NUMBER: _ClassVar[int]
    EVENT_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    checkpoint_version: int
    event_sequence: int
    def __init__(self, checkpoint_version: _Optional[int] = ..., event_sequence: _Optional[int] = ...) -> None: ...

class OfferFactCandidatesRequest(_message.Message):
    __slots__ = ("tenant_id", "session_id", "idempotency_key")
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_KEY_FIELD_NUMBER: _ClassVar[int]
    tenant_id: str
    session_id: str
    idempotency_key: str
    def __init__(self, tenant_id: _Optional[str] = ..., session_id: _Optional[str] = ..., idempotency_key: _Optional[str] = ...) -> None: ...

class FactCandidate(_message.Message):
    __slots__ = ("fact", "authority", "run_id")
    FACT_FIELD_NUMBER: _ClassVar[int]
    AUTHORITY_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    fact: Fact
    authority: str
    run_id: str
    def __init__(self, fact: _Optional[_Union[Fact, _Mapping]] = ..., authority: _Optional[str] = ..., run_id: _Optional[str] = ...) -> None: ...

class OfferFactCandidatesResponse(_message.Message):
    __slots__ = ("candidates", "event_sequence")
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    EVENT_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    candidates: _containers.RepeatedCompositeFieldContainer[FactCandidate]
    event_sequence: int
    def __init__(self, candidates: _Optional[_Iterable[_Union[FactCandidate, _Mapping]]] = ..., event_sequence: _Optional[int] = ...) -> None: ...
