"""The budget allocator: where the integers of ContextBudget come from.

Rule 1: total = min(model context window, policy cap); a policy cap of 0 means the window.
Rule 2: the output reserve comes off the top as a subtraction, never a share.
Rule 3: every class except history is capped absolutely (caps.CLASS_CAPS); the tool-result
class is the one "partly scaling" cap: 25% of the body.
Rule 4: only history scales: it takes whatever the body has left, with a floor of 8,000
tokens that the cheaper classes yield to protect (yield_ladder.py).
Rule 5: the prefix is measured exactly at plan time; only the body is estimated, so the
safety margin (5%) is held on the body, on top of an estimator that already rounds up.
Rule 6: integers only (ppm for ratios): these numbers decide the history cut, and a float
whose repr can vary must never decide a cut.
Rule 7: what a request costs beyond its prefix and its blocks (`framing_tokens`: the reply
priming and a provider's placeholder turn, core/body_estimate.py Rule 6) comes off the
body before its items are fitted, as the reserve does: it is paid on every request.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from .caps import (
    CLASS_CAPS,
    HISTORY_FLOOR_TOKENS,
    SAFETY_MARGIN_PPM,
    TOOL_RESULTS_BODY_SHARE_PPM,
)

__all__ = ["PPM", "ContextBudget", "allocate", "ceil_ppm"]

PPM = 1_000_000


def ceil_ppm(value: int, ppm: int) -> int:
    """ceil(value * ppm / 1e6) in integers: the conservative direction for an estimate."""
    return -(-value * ppm // PPM)


@dataclass(frozen=True, slots=True)
class ContextBudget:
    """The spec's ContextBudget (Section 11.3 plus the allocator's additions), in tokens.

    `history_tokens` here is the history class's floor; the remainder it actually receives
    is decided per request once the never-yield set and the yielding classes are paid
    (pressure.fit_body), and is what select_history reads.
    """

    total_tokens: int  # min(window, policy cap)
    reserve_output_tokens: int
    input_tokens: int  # total - reserve: what prefix + body may use
    prefix_tokens: int  # exact, from the plan
    body_tokens: int  # input - prefix - margin - framing: what the estimated body may use
    margin_tokens: int
    platform_tokens: int
    agent_tokens: int
    tool_tokens: int
    skill_catalog_tokens: int
    skill_body_tokens: int
    retrieved_context_tokens: int  # frozen snapshot + elastic in-turn recall
    history_tokens: int  # the floor; the remainder is computed per request
    working_state_tokens: int
    tool_result_tokens: int  # 25% of the body
    knowledge_tokens: int
    safety_margin_ppm: int = SAFETY_MARGIN_PPM
    framing_tokens: int = 0  # Rule 7

    @property
    def safety_margin_ratio(self) -> str:
        """The spec's float field, as an exact decimal string (never used in arithmetic)."""
        return f"{self.safety_margin_ppm / PPM:.6f}"


@lru_cache(maxsize=1024)  # pure arithmetic on five ints, asked for on every Build
def allocate(
    *,
    context_window: int,
    policy_cap_tokens: int,
    reserve_output_tokens: int,
    prefix_tokens: int,
    safety_margin_ppm: int = SAFETY_MARGIN_PPM,
    framing_tokens: int = 0,
) -> ContextBudget:
    """Divide one request's capacity. Pure arithmetic; never raises.

    A budget whose body is zero or negative is representable: the never-yield check in
    pressure.fit_body turns it into BUDGET_EXCEEDED naming the class that did not fit.
    Plan refuses a capacity that gives a new plan such a body (plan.require_capacity).
    """
    total = min(context_window, policy_cap_tokens) if policy_cap_tokens > 0 else context_window
    input_tokens = total - reserve_output_tokens
    available = input_tokens - prefix_tokens
    margin = ceil_ppm(available, safety_margin_ppm) if available > 0 else 0
    body = available - margin - framing_tokens
    caps = CLASS_CAPS
    return ContextBudget(
        total_tokens=total,
        reserve_output_tokens=reserve_output_tokens,
        input_tokens=input_tokens,
        prefix_tokens=prefix_tokens,
        body_tokens=body,
        margin_tokens=margin,
        platform_tokens=caps["platform_policy"].cap_tokens,
        agent_tokens=caps["agent_instructions"].cap_tokens,
        tool_tokens=caps["tool_definitions"].cap_tokens,
        skill_catalog_tokens=caps["skill_catalog"].cap_tokens,
        skill_body_tokens=caps["skill_bodies"].cap_tokens,
        retrieved_context_tokens=caps["memory_snapshot"].cap_tokens + caps["recall"].cap_tokens,
        history_tokens=HISTORY_FLOOR_TOKENS,
        working_state_tokens=caps["working_state"].cap_tokens,
        tool_result_tokens=max(0, body * TOOL_RESULTS_BODY_SHARE_PPM // PPM),
        knowledge_tokens=caps["knowledge"].cap_tokens,
        safety_margin_ppm=safety_margin_ppm,
        framing_tokens=framing_tokens,
    )
