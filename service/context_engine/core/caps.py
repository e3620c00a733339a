"""The budget allocator's cap table: every class except history is capped absolutely.

Rule 1: only history scales with the window (it takes the remainder, floor 8,000).
Rule 2: Region A classes never yield: over a cap, the plan fails naming the class.
Rule 3: the prefix classes sum to a hard ceiling of 22,000 tokens: the spec's seven Region A
classes (`CEILING_CLASSES`), whose caps sum to exactly that. Framing is not one of them: it
is counted in prefix_tokens (the budget) and bounded by its own cap, never the ceiling.
Rule 4: the output reserve is subtracted first (8,192 or the model's default).
One table; the allocator, the planner and the docs read it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from .rows import Region

__all__ = [
    "CEILING_CLASSES",
    "CLASS_CAPS",
    "HISTORY_FLOOR_TOKENS",
    "PREFIX_CEILING_TOKENS",
    "SAFETY_MARGIN_PPM",
    "TOOL_RESULTS_BODY_SHARE_PPM",
    "ClassCap",
    "Yields",
]


class Yields(Enum):
    NEVER_FAILS_PLAN = "never; fails at plan time"
    AT_EPOCH = "only at an epoch boundary"
    NEVER = "never"
    NEVER_LOAD_FAILS = "never; the load fails instead"
    FIRST = "first"
    SECOND = "second"
    THIRD = "third"
    FOURTH = "fourth"


@dataclass(frozen=True, slots=True)
class ClassCap:
    name: str
    region: Region
    cap_tokens: int  # 0: uncapped (history takes the remainder; user message uncapped)
    cap_items: int  # 0: no item cap
    yields: Yields


CLASS_CAPS: dict[str, ClassCap] = {
    c.name: c
    for c in (
        ClassCap("platform_policy", Region.PREFIX, 2_000, 0, Yields.NEVER_FAILS_PLAN),
        # Framing is platform policy's companion text; it shares no cap in the spec's table,
        # so it is bounded here by what the builder ships (see framing.py) and counted in
        # prefix_tokens, but not against the ceiling (Rule 3): the engine's own text must
        # not make a prefix whose every class is within its cap fail.
        ClassCap("framing", Region.PREFIX, 1_000, 0, Yields.NEVER_FAILS_PLAN),
        ClassCap("agent_instructions", Region.PREFIX, 4_000, 0, Yields.NEVER_FAILS_PLAN),
        ClassCap("persona", Region.PREFIX, 2_000, 30, Yields.NEVER_FAILS_PLAN),
        ClassCap("tool_definitions", Region.PREFIX, 9_000, 30, Yields.AT_EPOCH),
        ClassCap("deferred_tool_index", Region.PREFIX, 2_000, 40, Yields.AT_EPOCH),
        ClassCap("skill_catalog", Region.PREFIX, 1_500, 20, Yields.AT_EPOCH),
        ClassCap("memory_snapshot", Region.PREFIX, 1_500, 40, Yields.AT_EPOCH),
        ClassCap("skill_bodies", Region.BODY, 6_000, 2, Yields.NEVER_LOAD_FAILS),
        ClassCap("working_state", Region.BODY, 1_000, 0, Yields.NEVER),
        ClassCap("knowledge", Region.BODY, 3_000, 3, Yields.FIRST),
        ClassCap("recall", Region.BODY, 2_000, 0, Yields.SECOND),
        ClassCap("tool_results", Region.BODY, 0, 0, Yields.THIRD),  # 25% of body
        ClassCap("history", Region.BODY, 0, 0, Yields.FOURTH),  # remainder, floor below
        ClassCap("user_message", Region.BODY, 0, 0, Yields.NEVER),
    )
}

PREFIX_CEILING_TOKENS = 22_000
# The classes the ceiling sums (the spec's table); their caps sum to the ceiling.
CEILING_CLASSES = (
    "platform_policy",
    "agent_instructions",
    "persona",
    "tool_definitions",
    "deferred_tool_index",
    "skill_catalog",
    "memory_snapshot",
)
HISTORY_FLOOR_TOKENS = 8_000
TOOL_RESULTS_BODY_SHARE_PPM = 250_000  # 25% of the body
SAFETY_MARGIN_PPM = 50_000  # 5%
DEFAULT_OUTPUT_RESERVE = 8_192
