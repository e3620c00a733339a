"""The bridge marker (core/cache_hints.py, Rule 8): a step whose latest model turn spans
more than a provider's lookback still reads the previous step's entry.

Measured through the Anthropic renderer and the fake provider's prompt cache
(fake_provider/cache.py, which models the ~20-block lookback): a run of ten or more
parallel calls per step read nothing of its own history at each step and wrote it all
again, growing with the run. With the bridge, each step reads everything before its
latest turn and writes only that turn.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from context_engine.core import StepContext, assemble
from context_engine.core.build_record import unbridged
from context_engine.core.cache_hints import LOOKBACK_ITEMS, MAX_MARKERS
from context_engine.core.items import (
    AssistantMessage,
    ConversationItem,
    ToolCall,
    ToolResult,
    UserMessage,
)
from context_engine.core.trust import TrustLevel
from context_engine.fake_provider.anthropic_api import parse_request
from context_engine.fake_provider.cache import AnthropicPromptCache
from context_engine.providers import render

from .test_budget import Session, _build, _text

_HEADERS = {"anthropic-version": "2023-06-01", "x-api-key": "k"}


class _Run:
    """One carried exchange, then a run's steps of `calls` parallel calls each."""

    def __init__(self, calls: int) -> None:
        self.calls, self.sequence = calls, 0
        self.carried: list[ConversationItem] = [
            UserMessage(item_id="cu", text=_text(3000), sequence=self._next(), run_id="old"),
            AssistantMessage(item_id="ca", text=_text(3000), sequence=self._next(), run_id="old"),
        ]
        self.items: list[ConversationItem] = [
            UserMessage(item_id="u", text=_text(400), sequence=self._next(), run_id="current")
        ]

    def _next(self) -> int:
        self.sequence += 1
        return self.sequence

    def step(self, n: int) -> None:
        """The model's turn (text and calls), then every call's result."""
        self.items.append(
            AssistantMessage(
                item_id=f"a{n}", text="checking", sequence=self._next(), run_id="current"
            )
        )
        calls = [
            ToolCall(
                item_id=f"c{n}_{j}",
                call_id=f"k{n}_{j}",
                tool_name="web.fetch",
                arguments_json='{"q":"x"}',
                sequence=self._next(),
                run_id="current",
            )
            for j in range(self.calls)
        ]
        self.items += calls
        self.items += [
            ToolResult(
                item_id=f"r{c.item_id}",
                call_id=c.call_id,
                tool_name="web.fetch",
                content=_text(600),
                trust=TrustLevel.USER,
                sequence=self._next(),
                run_id="current",
            )
            for c in calls
        ]

    def request(self, budget: int | None = None):  # type: ignore[no-untyped-def]
        session = Session(
            carried=self.carried,
            run=list(self.items),
            summary=None,
            floor=0,
            step=StepContext(),
            working_state=None,
            body_room=150_000,
            reserve=8_192,
            factor_ppm=1_000_000,
        )
        built = assemble(replace(_build(session)[1], cache_marker_budget=budget))
        assert built.request is not None
        return built.request


def _sent(request, cache: AnthropicPromptCache, now: float):  # type: ignore[no-untyped-def]
    parsed = parse_request(json.loads(render(request, 4).body), _HEADERS)
    return cache.apply(parsed.model, parsed.blocks, messages_salt=parsed.messages_salt, now=now)


@pytest.mark.parametrize("calls", [4, 9, 12])
def test_each_step_reads_the_run_so_far_and_writes_only_its_latest_turn(calls: int) -> None:
    run, cache = _Run(calls), AnthropicPromptCache()
    reads, writes = [], []
    for n in range(5):
        used = _sent(run.request(), cache, now=10.0 * n)
        reads.append(used.cache_read_input_tokens)
        writes.append(used.ephemeral_5m_input_tokens)
        run.step(n)
    # From the third request on, each reads all the previous one sent, and writes as much
    # as a step adds (the same every step), not the run's whole portion again.
    assert reads[2] < reads[3] < reads[4]
    assert writes[2] == writes[3] == writes[4]


def test_the_bridge_closes_the_item_before_the_latest_turn_in_after_tools_place() -> None:
    run = _Run(9)  # a turn of 19 items: 1 text, 9 calls, 9 results
    for n in range(2):
        run.step(n)
    request = run.request()
    names = [bp.name for bp in request.cache_breakpoints]
    assert names == ["after_system", "carried_history", "run", "bridge"]
    assert len(names) == MAX_MARKERS
    (bridge,) = [bp for bp in request.cache_breakpoints if bp.name == "bridge"]
    (run_marker,) = [bp for bp in request.cache_breakpoints if bp.name == "run"]
    latest = run.items.index(next(i for i in run.items if i.item_id == "a1"))
    assert bridge.through_item == run.items[latest - 1].item_id  # step 0's last result
    assert run_marker.through_item == run.items[-1].item_id
    # A rebuild of a record made before the bridge: after_tools back, the bridge gone.
    older = unbridged(request)
    assert [bp.name for bp in older.cache_breakpoints] == [
        "after_system",
        "after_tools",
        "carried_history",
        "run",
    ]
    assert unbridged(older) is older


@pytest.mark.parametrize("calls", [1, (LOOKBACK_ITEMS - 1) // 2])
def test_a_turn_within_the_lookback_needs_no_bridge(calls: int) -> None:
    run = _Run(calls)
    for n in range(3):
        run.step(n)
    names = [bp.name for bp in run.request().cache_breakpoints]
    assert names == ["after_system", "after_tools", "carried_history", "run"]


def test_a_smaller_budget_gets_no_bridge_and_the_markers_it_had() -> None:
    """A model reading fewer than four markers gets none: beside after_system and the
    carried marker, the run marker alone (past every earlier entry's lookback) would be
    written at the premium and never read, where before the bridge the budget dropped it
    (a review). Its request keeps the markers it had, after_tools among them."""
    run = _Run(12)
    for n in range(2):
        run.step(n)
    assert "bridge" in [bp.name for bp in run.request(4).cache_breakpoints]
    for budget in (1, 2, 3):
        names = [bp.name for bp in run.request(budget).cache_breakpoints]
        assert names == ["after_system", "after_tools", "carried_history", "run"], budget
