"""core/messages.py: merging blocks into messages.

grouped() has two paths: the general grouping, and one lookup per block when roles
alternate and every one-block message was interned before. Both must give what merging
consecutive same-role blocks one by one gives, and the second call must hand back the
very objects of the first (the per-message memos downstream key on identity).
"""

from __future__ import annotations

from itertools import pairwise

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from context_engine.core import messages
from context_engine.core.items import AssistantMessage, ContextItem, ToolCall, UserMessage
from context_engine.core.messages import grouped, joined, role_of
from context_engine.core.request import Block, Message
from context_engine.core.rows import Row
from context_engine.core.trust import TrustLevel

_KINDS = st.sampled_from(["user", "assistant", "call"])


def _item(kind: str, n: int) -> ContextItem:
    if kind == "user":
        return UserMessage(text=f"u{n}", sequence=n + 1)
    if kind == "assistant":
        return AssistantMessage(text=f"a{n}", sequence=n + 1)
    return ToolCall(call_id=f"c{n}", tool_name="t", arguments_json="{}", sequence=n + 1)


def _block(n: int) -> Block:
    return Block(row=Row.CONVERSATION, trust=TrustLevel.USER, kind="text", text=str(n))


def _one_by_one(items: list[ContextItem], blocks: list[Block]) -> tuple[Message, ...]:
    out: list[Message] = []
    for item, block in zip(items, blocks, strict=True):
        role = role_of(item)
        if out and out[-1].role == role:
            out[-1] = Message(role, (*out[-1].blocks, block))
        else:
            out.append(Message(role, (block,)))
    return tuple(out)


@given(st.lists(_KINDS, max_size=40))
@example(["user", "assistant", "user", "call", "user"])  # alternating: the lookup path
@example(["assistant", "user", "call", "user", "assistant"])
def test_grouped_merges_like_one_by_one_and_repeats_as_the_same_objects(
    kinds: list[str],
) -> None:
    # The intern table is cleared whole when full; start each example with room, so a
    # clear between the two calls (which only costs memo hits) cannot break the identity.
    messages._INTERNED.clear()
    items = [_item(kind, n) for n, kind in enumerate(kinds)]
    blocks = [_block(n) for n in range(len(items))]
    first = grouped(items, blocks)
    assert first == _one_by_one(items, blocks)
    again = grouped(items, blocks)  # interned now: alternating roles take the lookup path
    assert again == first
    assert all(a is b for a, b in zip(again, first, strict=True))


# Histories whose roles alternate (the lookup path), and any other.
_ALTERNATING = st.lists(st.sampled_from(["assistant", "call"]), max_size=20).map(
    lambda answers: [kind for answer in answers for kind in ("user", answer)]
)


@given(st.one_of(_ALTERNATING, st.lists(_KINDS, max_size=40)), st.integers(0, 40))
def test_a_history_grown_by_new_turns_keeps_its_interned_messages(
    kinds: list[str], known: int
) -> None:
    """A run's first Build groups the previous history plus its new turns: the messages
    interned before are the very objects again, only the new ones are made, and the whole
    is what merging one by one gives (alternating roles take the lookup path)."""
    messages._INTERNED.clear()
    items = [_item(kind, n) for n, kind in enumerate(kinds)]
    blocks = [_block(n) for n in range(len(items))]
    known = min(known, len(items))
    before = grouped(items[:known], blocks[:known])
    made: list[tuple[str, tuple[Block, ...]]] = []
    original = messages.message

    def counted(role: messages.Role, blocks: tuple[Block, ...]) -> Message:
        made.append((role, blocks))
        return original(role, blocks)

    messages.message = counted  # type: ignore[assignment]
    try:
        grown = grouped(items, blocks)
    finally:
        messages.message = original
    assert grown == _one_by_one(items, blocks)
    alternating = all(role_of(a) != role_of(b) for a, b in pairwise(items))
    if alternating:
        assert all(a is b for a, b in zip(before, grown[: len(before)], strict=True))
        assert [b for _, (b,) in made] == blocks[known:]  # only the new ones are made


@given(st.lists(_KINDS, max_size=30), st.lists(st.integers(0, 30), max_size=4))
@example(["user", "user", "user"], [1, 2])  # a one-message part merged away whole
def test_parts_grouped_apart_and_joined_equal_the_whole(kinds: list[str], cuts: list[int]) -> None:
    """Any number of parts, empty ones and parts of one message merged whole into the one
    before them included (a Build joins three: head, carried suffix, tail)."""
    items = [_item(kind, n) for n, kind in enumerate(kinds)]
    blocks = [_block(n) for n in range(len(items))]
    bounds = [0, *sorted(min(c, len(items)) for c in cuts), len(items)]
    parts = [grouped(items[a:b], blocks[a:b]) for a, b in pairwise(bounds)]
    assert joined(parts) == grouped(items, blocks)


def test_grouped_refuses_items_and_blocks_of_different_lengths() -> None:
    with pytest.raises(ValueError, match="2 items but 1 blocks"):
        grouped([_item("user", 0), _item("assistant", 1)], [_block(0)])
