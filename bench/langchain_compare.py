"""Against what users would pick instead: assembling the same hundred-turn history (400
items) to the same token budget with LangChain's `trim_messages` + its token counter,
in-process, versus our full core assembly (budget, history cut, envelopes, hashing, cache
breakpoints) with the model's own token counter, in-process, as Build runs it.

The budget (10,000 input tokens by default) is small enough that both trim: each side's
kept history and tokens (by its own counter: the two count the same text differently) are
printed, and the run fails if either keeps everything. (At fifty turns no budget works:
LangChain's estimate of the whole history is about 9,100 tokens, and below about 9,000 our
history floor of 8,000 tokens no longer fits, so the request needs compaction.) Every call
gets inputs built outside the timer; only the assembly (or the trimming) is timed.
Two figures for ours:

- next step: what a replica hands `assemble` on a run's next Build: the same plan and the
  same carried-history objects (kept per run), a checkpoint read afresh (new objects) that
  has one more tool call and result than the step before (runs of eight steps, repeated);
- cold: a fresh, equal history every call (new carried items, a new checkpoint, the same
  plan): nothing is found by identity; memos keyed on values can still hit, as they do in
  a process that has assembled that history before;
- first sight: the same, with every memo of the process emptied before each call (outside
  the timer): the history rendered, counted and hashed from nothing, as a replica's first
  Build of a session after a restart does it (an audit: "cold" alone read as this and
  was not). Ours counts with the model's exact tokenizer (tiktoken); theirs estimates.

LangChain has no memo: it gets a fresh, equal message list every call. Bar: ours no slower
than their trimming alone, evaluated on each figure (the same BuildInputs object repeated,
which this benchmark timed before, is a memo hit on every call and is not measured).

Informational, not the bar: where langchain-openai is installed (`make bench` installs it),
their trimming with the exact counter LangChain offers for this model as well,
`ChatOpenAI.get_num_tokens_from_messages` (tiktoken o200k_base, read from the rank file the
engine ships, never downloaded): the same exactness as ours, against which each of our
figures is printed as a ratio too. The bar stays the estimate's, the faster of the two.

LangChain is installed only in the bench environment (`make bench` creates .venv-bench).
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import hashlib
import itertools
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import context_engine.core as core
from context_engine.core import memo_budget
from context_engine.core.items import (
    AssistantMessage,
    ConversationItem,
    ToolCall,
    ToolResult,
    UserMessage,
)
from context_engine.core.trust import TrustLevel
from context_engine.models import ModelCatalog

MODEL = "gpt-4o"
BUDGET_TOKENS = 10_000
RESERVE_TOKENS = 4_096
STEPS = 8  # steps per run in the next-step case
CATALOG = ModelCatalog.builtin()


def _history(turns: int) -> list[tuple[str, str, str]]:
    return [
        (
            f"Question {t}: which trains leave Paris for Lyon after {t % 24}:00?",
            f"Result {t}: " + f"TGV 66{t:02d} departs 08:{t:02d}, arrives 10:{t:02d}. " * 12,
            f"Answer {t}: the best option is TGV 66{t:02d}.",
        )
        for t in range(turns)
    ]


def _plan(budget: int) -> core.ContextPlan:
    spec = core.PlanSpec(
        model_id=MODEL,
        policy={"version": "p", "text": "Be helpful."},
        agent={"agent_id": "a", "version": "1", "instructions": "You plan train trips."},
        policy_cap_tokens=budget + RESERVE_TOKENS,
        reserve_output_tokens=RESERVE_TOKENS,
    )
    return core.make_plan(
        spec,
        session_id="s",
        epoch=1,
        reason=core.PlanReason.SESSION_OPENED,
        secret=b"secret",
        model=CATALOG.facts(MODEL),
        count_tokens=CATALOG.counter(MODEL),
    )


def _carried(turns: int) -> tuple[ConversationItem, ...]:
    """The session's history before the run, as new objects."""
    carried: list[ConversationItem] = []
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
    return tuple(carried)


def _checkpoint(turns: int, step: int, version: int) -> core.Checkpoint:
    """The run's checkpoint at `step`, as new objects (a Build reads it afresh): the user's
    message and one tool call and result per step taken."""
    seq = 4 * turns + 1
    items: list[ConversationItem] = [UserMessage(item_id="now", text="And tomorrow?", sequence=seq)]
    for s in range(step):
        items += [
            ToolCall(
                item_id=f"sc{s}",
                call_id=f"sc{s}",
                tool_name="trains",
                arguments_json='{"day": "tomorrow"}',
                sequence=seq + 1 + 2 * s,
            ),
            ToolResult(
                item_id=f"sr{s}",
                call_id=f"sc{s}",
                tool_name="trains",
                content=f"Tomorrow {s}: TGV 67{s:02d} departs 09:{s:02d}.",
                trust=TrustLevel.EXTERNAL_UNTRUSTED,
                sequence=seq + 2 + 2 * s,
            ),
        ]
    return core.Checkpoint(run_id="r", version=version, items=tuple(items))


def _inputs(
    plan: core.ContextPlan, carried: tuple[ConversationItem, ...], checkpoint: core.Checkpoint
) -> core.BuildInputs:
    return core.BuildInputs(
        tenant_id="t",
        plan=plan,
        secret=b"secret",
        checkpoint=checkpoint,
        carried=carried,
        now=datetime(2026, 11, 29, tzinfo=UTC),
        count_tokens=CATALOG.counter(MODEL),
    )


def next_steps(turns: int, budget: int) -> Iterator[core.BuildInputs]:
    """A run's successive Builds: the same plan and carried objects, a new checkpoint each."""
    plan, carried = _plan(budget), _carried(turns)
    for version in itertools.count(1):
        yield _inputs(plan, carried, _checkpoint(turns, (version - 1) % STEPS, version))


def cold(turns: int, budget: int) -> Iterator[core.BuildInputs]:
    """An equal history every time, all of it new objects (the plan is kept)."""
    plan = _plan(budget)
    while True:
        yield _inputs(plan, _carried(turns), _checkpoint(turns, 0, 1))


def first_sight(turns: int, budget: int) -> Iterator[core.BuildInputs]:
    """cold, with every memo of the process emptied before each call is timed."""
    for inputs in cold(turns, budget):
        _forget_everything()
        yield inputs


def _forget_everything() -> None:
    """Empty the memos: those the memo budget holds, and every other cache of the engine's
    modules (functools caches on counters, escaping, framing)."""
    memo_budget.clear_all()
    for name, module in list(sys.modules.items()):
        if name == "context_engine" or name.startswith("context_engine."):
            for value in list(vars(module).values()):
                clear = getattr(value, "cache_clear", None)
                if callable(clear):
                    with contextlib.suppress(TypeError):
                        clear()


def their_messages(turns: int) -> Iterator[list[Any]]:
    """The same history as LangChain messages, a new list of new messages every time."""
    from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage

    while True:
        messages: list[Any] = [SystemMessage("You plan train trips.")]
        for t, (q, result, answer) in enumerate(_history(turns)):
            messages += [
                HumanMessage(q),
                AIMessage("", tool_calls=[{"id": f"c{t}", "name": "trains", "args": {}}]),
                ToolMessage(result, tool_call_id=f"c{t}"),
                AIMessage(answer),
            ]
        messages.append(HumanMessage("And tomorrow?"))
        yield messages


def their_trim(budget: int, counter: Any = None) -> Callable[[list[Any]], list[Any]]:
    """trim_messages to `budget` with `counter` (count_tokens_approximately by default)."""
    from langchain_core.messages import trim_messages
    from langchain_core.messages.utils import count_tokens_approximately

    def trim(messages: list[Any]) -> list[Any]:
        return trim_messages(
            messages,
            max_tokens=budget,
            strategy="last",
            token_counter=counter or count_tokens_approximately,
            include_system=True,
            start_on="human",
        )

    return trim


def exact_counter() -> Any:
    """ChatOpenAI for the model, whose get_num_tokens_from_messages is the exact counter
    LangChain offers for it, or None without langchain-openai. Its tiktoken reads
    o200k_base from a cache filled from the engine's rank file: tiktoken would download it,
    and nothing here does. It counts locally; the model is never called."""
    try:
        from langchain_openai import ChatOpenAI
    except ImportError:
        return None
    from context_engine.tokenizers import default_tiktoken_dir

    ranks = default_tiktoken_dir()
    if ranks is None:
        return None
    cache = Path(tempfile.mkdtemp(prefix="tiktoken-"))
    url = "https://openaipublic.blob.core.windows.net/encodings/o200k_base.tiktoken"
    data = gzip.decompress((ranks / "o200k_base.tiktoken.gz").read_bytes())
    (cache / hashlib.sha1(url.encode()).hexdigest()).write_bytes(data)
    os.environ["TIKTOKEN_CACHE_DIR"] = str(cache)
    return ChatOpenAI(model=MODEL, api_key="unused")


def per_call_ms(inputs: Iterator[Any], call: Callable[[Any], object], seconds: float) -> float:
    """Mean time of `call(next(inputs))` over about `seconds` of timed calls; the inputs are
    made outside the timer."""
    for _ in range(5):
        call(next(inputs))
    timed, calls = 0.0, 0
    while timed < seconds:
        arg = next(inputs)
        started = time.perf_counter()
        call(arg)
        timed += time.perf_counter() - started
        calls += 1
    return timed / calls * 1000


def _what_each_keeps(turns: int, budget: int) -> bool:
    """Print what each side keeps at `budget`; False unless both trim."""
    from langchain_core.messages.utils import count_tokens_approximately

    messages = next(their_messages(turns))
    kept = their_trim(budget)(messages)
    inputs = next(cold(turns, budget))
    ours = core.assemble(inputs)
    if ours.needs_compaction or ours.pressure is None or ours.request is None:
        print(f"  context-engine: the request needs compaction at {budget} tokens; raise --budget")
        return False
    dropped = ours.pressure.history_items_dropped
    print(
        f"  LangChain keeps {len(kept)} of {len(messages)} messages,"
        f" {count_tokens_approximately(kept):,} tokens (count_tokens_approximately)"
    )
    print(
        f"  context-engine keeps {len(inputs.carried) - dropped} of {len(inputs.carried)}"
        f" carried items ({len(ours.request.messages)} request messages),"
        f" {ours.estimated_input_tokens:,} estimated input tokens"
        f" ({CATALOG.tokenizer(MODEL)}) of an input budget of {ours.input_budget_tokens:,}"
    )
    if dropped == 0 or len(kept) == len(messages):
        print("  one side keeps the whole history: nothing to compare; lower --budget")
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--turns", type=int, default=100)
    parser.add_argument("--budget", type=int, default=BUDGET_TOKENS, help="input tokens")
    parser.add_argument("--seconds", type=float, default=3.0, help="timed, per figure")
    args = parser.parse_args(argv)
    try:
        trim = their_trim(args.budget)
    except ImportError:
        print("langchain-core is not installed: run `make bench` (it uses .venv-bench)")
        return 2
    print(f"vs LangChain: {args.turns}-turn history to {args.budget:,} tokens, in-process")
    if not _what_each_keeps(args.turns, args.budget):
        return 1
    theirs_ms = per_call_ms(their_messages(args.turns), trim, args.seconds)
    step_ms = per_call_ms(next_steps(args.turns, args.budget), core.assemble, args.seconds)
    cold_ms = per_call_ms(cold(args.turns, args.budget), core.assemble, args.seconds)
    first_ms = per_call_ms(first_sight(args.turns, args.budget), core.assemble, args.seconds)
    print(f"  LangChain trim_messages + count_tokens_approximately: {theirs_ms:7.3f} ms/call")
    print(f"  context-engine, a run's next step:                   {step_ms:7.3f} ms/call")
    print(f"  context-engine, cold (a fresh equal history):        {cold_ms:7.3f} ms/call")
    print(f"  context-engine, first sight (every memo emptied):    {first_ms:7.3f} ms/call")
    failed = []
    for name, ms in (("next step", step_ms), ("cold", cold_ms), ("first sight", first_ms)):
        held = ms <= theirs_ms
        failed += [] if held else [name]
        print(
            f"  ours ({name}) / theirs = {ms / theirs_ms:.2f}"
            f"  (bar <= 1.00: {'PASS' if held else 'FAIL'})"
        )
    print(
        f"  bar evaluated on each figure: {'PASS' if not failed else 'FAIL: ' + ', '.join(failed)}"
    )
    counter = exact_counter()
    if counter is None:
        print("  (langchain-openai not installed: no exact-counter comparison)")
    else:
        exact = their_trim(args.budget, counter)
        messages = next(their_messages(args.turns))
        estimated = trim(messages)
        print(
            f"  informational: with ChatOpenAI's exact counter LangChain keeps"
            f" {len(exact(messages))} of {len(messages)} messages; the {len(estimated)} its"
            f" estimate keeps count {counter.get_num_tokens_from_messages(estimated):,} tokens"
        )
        exact_ms = per_call_ms(their_messages(args.turns), exact, args.seconds)
        print(f"  LangChain trim_messages + ChatOpenAI's exact counter: {exact_ms:.3f} ms/call")
        for name, ms in (("next step", step_ms), ("cold", cold_ms), ("first sight", first_ms)):
            print(f"  ours ({name}) / theirs, exact counter = {ms / exact_ms:.2f}")
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
