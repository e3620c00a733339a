"""The pure core: items, the row table, canonical bytes, envelopes, plans and assembly.

No I/O, no clock, no randomness, no asyncio: time, secrets and token counters arrive as
arguments. Nothing here imports grpc, asyncpg, opentelemetry or the generated stubs
(tests/unit/test_core_purity.py keeps it so).
"""

from .assemble import Assembled, BuildInputs, StepContext, assemble, split_run_items
from .canonical import canonical_bytes, sha256_hex
from .checkpoint import Checkpoint
from .enums import PlanReason, SessionKind, SideEffect
from .errors import (
    BudgetExceededError,
    ConflictError,
    EngineError,
    InvalidFieldError,
    NotFoundError,
    PreconditionError,
    RequestError,
)
from .plan import ContextPlan, ModelFacts, make_plan, session_key
from .request import Block, CacheBreakpoint, Message, ModelRequest, ToolDefinition
from .rows import ROWS, Region, Row
from .seeding import carried_history, seed_cut
from .spec import PlanSpec
from .trust import TrustLevel

__all__ = [
    "ROWS",
    "Assembled",
    "Block",
    "BudgetExceededError",
    "BuildInputs",
    "CacheBreakpoint",
    "Checkpoint",
    "ConflictError",
    "ContextPlan",
    "EngineError",
    "InvalidFieldError",
    "Message",
    "ModelFacts",
    "ModelRequest",
    "NotFoundError",
    "PlanReason",
    "PlanSpec",
    "PreconditionError",
    "Region",
    "RequestError",
    "Row",
    "SessionKind",
    "SideEffect",
    "StepContext",
    "ToolDefinition",
    "TrustLevel",
    "assemble",
    "canonical_bytes",
    "carried_history",
    "make_plan",
    "seed_cut",
    "session_key",
    "sha256_hex",
    "split_run_items",
]
