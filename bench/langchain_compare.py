"""Against what users would pick instead: assembling the same fifty-turn history to the same
token budget with LangChain's `trim_messages` + its token counter, in-process, versus our
full core assembly (budget, history cut, envelopes, hashing, cache breakpoints), in-process.
Prints time per call for both and the ratio. Bar: ours no slower than their trimming alone.

LangChain is installed only in the bench environment (`make bench` creates .venv-bench).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime

import context_engine.core as core
from context_engine.core.items import AssistantMessage, ToolCall, ToolResult, UserMessage
from context_engine.core.trust import TrustLevel
from context_engine.models import ModelCatalog

MODEL = "gpt-4o"
BUDGET_TOKENS = 24_000


def _history(turns: int) -> list[tuple[str, str, str]]:
    return [
        (
            f"Question {t}: which trains leave Paris for Lyon after {t % 24}:00?",
            f"Result {t}: " + f"TGV 66{t:02d} departs 08:{t:02d}, arrives 10:{t:02d}. " * 12,
            f"Answer {t}: the best option is TGV 66{t:02d}.",
        )
        for t in range(turns)
    ]


def _ours(turns: int) -> Callable[[], object]:
    catalog = ModelCatalog.builtin()
    spec = core.PlanSpec(
        model_id=MODEL,
        policy={"version": "p", "text": "Be helpful."},
        agent={"agent_id": "a", "version": "1", "instructions": "You plan train trips."},
        policy_cap_tokens=BUDGET_TOKENS + 8_192,
    )
    plan = core.make_plan(
        spec,
        session_id="s",
        epoch=1,
        reason=core.PlanReason.SESSION_OPENED,
        secret=b"secret",
        model=catalog.facts(MODEL),
        count_tokens=catalog.counter(MODEL),
    )
    carried = []
    seq = 1
    for t, (q, result, answer) in enumerate(_history(turns)):
        carried += [
            UserMessage(item_id=f"u{t}", text=q, sequence=seq),
            ToolCall(
                item_id=f"c{t}",
                call_id=f"c{t}",
                tool_name="trains",
                arguments_json="{}",
                sequence=seq + 1,
            ),
            ToolResult(
                item_id=f"r{t}",
                call_id=f"c{t}",
                tool_name="trains",
                content=result,
                trust=TrustLevel.EXTERNAL_UNTRUSTED,
                sequence=seq + 2,
            ),
            AssistantMessage(item_id=f"a{t}", text=answer, sequence=seq + 3),
        ]
        seq += 4
    checkpoint = core.Checkpoint(
        run_id="r",
        version=1,
        items=(UserMessage(item_id="now", text="And tomorrow?", sequence=seq),),
    )
    inputs = core.BuildInputs(
        tenant_id="t",
        plan=plan,
        secret=b"secret",
        checkpoint=checkpoint,
        carried=tuple(carried),
        now=datetime(2026, 11, 29, tzinfo=UTC),
    )
    return lambda: core.assemble(inputs)


def _theirs(turns: int) -> Callable[[], object]:
    from langchain_core.messages import (
        AIMessage,
        HumanMessage,
        SystemMessage,
        ToolMessage,
        trim_messages,
    )
    from langchain_core.messages.utils import count_tokens_approximately

    messages: list[object] = [SystemMessage("You plan train trips.")]
    for t, (q, result, answer) in enumerate(_history(turns)):
        messages += [
            HumanMessage(q),
            AIMessage("", tool_calls=[{"id": f"c{t}", "name": "trains", "args": {}}]),
            ToolMessage(result, tool_call_id=f"c{t}"),
            AIMessage(answer),
        ]
    messages.append(HumanMessage("And tomorrow?"))
    return lambda: trim_messages(
        messages,
        max_tokens=BUDGET_TOKENS,
        strategy="last",
        token_counter=count_tokens_approximately,
        include_system=True,
        start_on="human",
    )


def _per_call_ms(fn: Callable[[], object], seconds: float) -> float:
    for _ in range(5):
        fn()
    calls, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        fn()
        calls += 1
    return (time.perf_counter() - started) / calls * 1000


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--turns", type=int, default=50)
    parser.add_argument("--seconds", type=float, default=3.0)
    args = parser.parse_args(argv)
    try:
        theirs = _theirs(args.turns)
    except ImportError:
        print("langchain-core is not installed: run `make bench` (it uses .venv-bench)")
        return 2
    ours_ms = _per_call_ms(_ours(args.turns), args.seconds)
    theirs_ms = _per_call_ms(theirs, args.seconds)
    ratio = ours_ms / theirs_ms
    print(f"vs LangChain: {args.turns}-turn history to {BUDGET_TOKENS} tokens, in-process")
    print(f"  LangChain trim_messages + count_tokens_approximately: {theirs_ms:7.3f} ms/call")
    print(f"  context-engine full assembly:                        {ours_ms:7.3f} ms/call")
    ok = ratio <= 1.0
    print(f"  ours / theirs = {ratio:.2f}  (bar <= 1.00: {'PASS' if ok else 'FAIL'})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
