"""api/kept.py: what a replica keeps across requests is bounded by weight (approximate
bytes), least recently used first, and can be forgotten by key (an erasure rewrote a
session's plans)."""

from __future__ import annotations

import gc
import sys
import types

from context_engine.api.kept import DEFAULT_CACHE_BYTES, Kept, approximate_bytes
from context_engine.core import Checkpoint
from context_engine.core.items import AssistantMessage, ToolCall, ToolResult, UserMessage
from context_engine.core.trust import TrustLevel


def test_the_least_recently_used_go_first_once_the_weight_is_over() -> None:
    kept = Kept(max_weight=3)
    for key in "abc":
        kept.put(key, key.upper(), 1)
    assert kept.get("a") == "A"  # now the most recent
    kept.put("d", "D", 1)
    assert [kept.get(k) for k in "abcd"] == ["A", None, "C", "D"]


def test_a_value_heavier_than_the_whole_budget_is_not_kept_and_evicts_nothing() -> None:
    kept = Kept(max_weight=3)
    kept.put("a", "A", 2)
    kept.put("big", "B", 4)
    assert kept.get("big") is None
    assert kept.get("a") == "A"


def test_replacing_a_key_counts_its_weight_once() -> None:
    kept = Kept(max_weight=3)
    kept.put("a", "A", 2)
    kept.put("a", "A2", 2)
    kept.put("b", "B", 1)
    assert (kept.get("a"), kept.get("b")) == ("A2", "B")


def test_forgetting_by_key_frees_its_weight() -> None:
    kept = Kept(max_weight=4)
    for epoch in (1, 2):
        kept.put(("t", "s1", epoch), epoch, 1)
        kept.put(("t", "s2", epoch), epoch, 1)
    kept.drop_where(lambda key: key[:2] == ("t", "s1"))  # type: ignore[index]
    assert kept.get(("t", "s1", 1)) is None and kept.get(("t", "s1", 2)) is None
    # The two freed units take two more entries without evicting s2's.
    kept.put(("t", "s3", 1), 1, 1)
    kept.put(("t", "s3", 2), 2, 1)
    assert [kept.get(("t", "s2", e)) for e in (1, 2)] == [1, 2]


def test_a_value_weighs_what_its_text_holds_not_how_many_items_it_has() -> None:
    """The engine weighs what it keeps in approximate bytes (api/kept.py): a checkpoint
    whose one item is a 3 MB tool result weighed 2 (items + 1), so a budget of 200,000
    could hold hundreds of GiB. Now it weighs at least its text, and a short item little."""
    big = "lorem ipsum " * 250_000
    result = ToolResult(
        item_id="r1",
        call_id="c1",
        tool_name="web.fetch",
        content=big,
        trust=TrustLevel.EXTERNAL_UNTRUSTED,
        sequence=2,
        run_id="r",
    )
    heavy = Checkpoint(run_id="r", version=2, items=(result,))
    light = Checkpoint(
        run_id="r", version=2, items=(UserMessage(item_id="u", text="hi", sequence=1),)
    )
    assert len(big) <= approximate_bytes(heavy) <= len(big) + 8_192
    assert approximate_bytes(light) < 4_096
    # Non-ASCII text is held at up to four bytes a character, and weighed so.
    wide = "\U0001f600" * 1_000
    assert approximate_bytes(wide) >= 4 * len(wide)
    # Containers, dataclasses and mappings count what they hold.
    assert approximate_bytes({"k": (big, [big])}) >= 2 * len(big)


def _held(value: object) -> int:
    """The bytes of every distinct object `value` reaches (each counted once), not
    following classes, modules and functions: what keeping it holds in memory."""
    seen: set[int] = set()
    total = 0
    pending = [value]
    while pending:
        obj = pending.pop()
        if id(obj) in seen or isinstance(obj, type | types.ModuleType | types.FunctionType):
            continue
        seen.add(id(obj))
        total += sys.getsizeof(obj)
        pending.extend(gc.get_referents(obj))
    return total


def test_a_checkpoint_of_short_items_weighs_at_least_what_it_holds() -> None:
    """A model was weighed at a flat 64 bytes beside its strings; its `__dict__` and the set
    of fields it was given cost about a kilobyte more, so a cache of short chat items held
    about twice replica_cache_bytes (an audit)."""
    items = tuple(
        item
        for n in range(200)
        for item in (
            ToolCall(
                item_id=f"c{n}",
                call_id=f"c{n}",
                tool_name="web.fetch",
                arguments_json="{}",
                sequence=3 * n + 1,
                run_id="r",
            ),
            ToolResult(
                item_id=f"r{n}",
                call_id=f"c{n}",
                tool_name="web.fetch",
                content=f"Trains leave hourly ({n}).",
                trust=TrustLevel.EXTERNAL_UNTRUSTED,
                sequence=3 * n + 2,
                run_id="r",
            ),
            AssistantMessage(item_id=f"a{n}", text=f"Every hour ({n}).", sequence=3 * n + 3),
        )
    )
    checkpoint = Checkpoint(run_id="r", version=2, items=items)
    assert _held(checkpoint) <= approximate_bytes(checkpoint) <= 2 * _held(checkpoint)


def test_a_kept_budget_in_bytes_holds_a_few_large_values_not_hundreds_of_thousands() -> None:
    kept = Kept(max_weight=10 * 2**20)
    for n in range(10):
        value = "x" * 3 * 2**20
        kept.put(n, value, approximate_bytes(value))
    assert sum(kept.get(n) is not None for n in range(10)) == 3  # the three most recent
    assert kept.get(9) is not None and kept.get(6) is None


def test_the_replica_cache_budget_is_a_setting_in_bytes() -> None:
    """replica_cache_bytes bounds what a replica keeps: three quarters for checkpoints and
    histories, a quarter for plans; the default is DEFAULT_CACHE_BYTES."""
    from context_engine.api.server import build_engine
    from context_engine.config import Settings

    assert Settings().replica_cache_bytes == DEFAULT_CACHE_BYTES
    engine = build_engine(None, settings=Settings(replica_cache_bytes=4_000_000))  # type: ignore[arg-type]
    assert (engine._kept._max, engine._plans._max) == (3_000_000, 1_000_000)
