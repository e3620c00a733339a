"""Small closed vocabularies shared by the plan and the API. Numbering matches the proto."""

from __future__ import annotations

from enum import IntEnum

__all__ = ["PlanReason", "SessionKind", "SideEffect"]


class SideEffect(IntEnum):
    UNSPECIFIED = 0
    NONE = 1
    WORKSPACE_READ = 2
    NETWORK_READ = 3
    WORKSPACE_WRITE = 4
    NETWORK_WRITE = 5
    EXTERNAL_ACTION = 6


class SessionKind(IntEnum):
    UNSPECIFIED = 0
    INTERACTIVE = 1
    SCHEDULED = 2
    OPERATIONAL = 3


class PlanReason(IntEnum):
    UNSPECIFIED = 0
    SESSION_OPENED = 1
    MODEL_CHANGED = 2
    AGENT_CHANGED = 3
    PERSONA_CHANGED = 4
    OPERATOR_REVOCATION = 5
    SNAPSHOT_INVALIDATED = 6
    RUN_AUTHORITY_CHANGED = 7
    BROWSER_PROFILE_CHANGED = 8
    PREFIX_HASH_CANONICALIZED = 9
    BUILDER_UPGRADED = 10
