"""Facts found by an item's content are the facts of that item (core/content_key.py, and
core/carried.py's table keyed on it).

The table answers for an item with what it derived for an equal one, so the gates are:
content keys are equal exactly when the items are (same class, pydantic-equal), whatever
object or field order they arrive as; what the table answers is what deriving the item
afresh gives, for items that differ from ones it already holds by one adversarial
character, one flag or their class; and a whole Build from equal but distinct objects,
with the table warm, is the Build of a process that never saw them.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from context_engine.core import assemble, memo_budget
from context_engine.core import carried as carried_module
from context_engine.core.body_estimate import FixedTexts, attached_content, block_tokens
from context_engine.core.content_key import ContentMemo, content_key
from context_engine.core.errors import EngineError
from context_engine.core.estimator import IMAGE_TOKENS
from context_engine.core.items import (
    ConversationItem,
    DelegatedMessage,
    ToolResult,
    TrustLevel,
    UserMessage,
)
from context_engine.core.rows import Row

from .strategies import SETTINGS, carried_histories, count_tokens, scenarios, secrets

GATE = settings(SETTINGS, max_examples=150)

# One character away from a text, in the ways that matter to a reader or to escaping: a
# look-alike bracket, an invisible character, a lone surrogate, a long whitespace run, a
# fullwidth letter, an envelope delimiter.
_NUDGES = st.sampled_from(
    [
        *("\uff1c", "<", "\u2039", "\u3008user", "\u200b", "\ufeff", "\ud800", "\udfff"),
        *(" " * 4096, "\uff41", "</untrusted>", "< / UNTRUSTED"),
    ]
)


def _copy(item: ConversationItem) -> ConversationItem:
    """An equal item, as a new object with new strings (as a fresh read makes it)."""
    fresh = type(item).model_validate_json(item.model_dump_json())
    assert fresh is not item and fresh == item
    return fresh


def _reordered(item: ConversationItem) -> ConversationItem:
    """The same item with its instance dict in reverse field order (pydantic equality
    compares dicts, so this is still equal; a key built from dict order would not be)."""
    copy = item.model_copy()
    object.__setattr__(copy, "__dict__", dict(reversed(list(item.__dict__.items()))))
    assert copy == item
    return copy


@st.composite
def _variants(draw: st.DrawFn, item: ConversationItem) -> ConversationItem:
    """`item` again, equal or one small change away from it."""
    how = draw(st.sampled_from(["copy", "reordered", "text", "flag", "class", "sequence"]))
    if how == "copy":
        return _copy(item)
    if how == "reordered":
        return _reordered(item)
    if how == "sequence":
        return item.model_copy(update={"sequence": item.sequence + draw(st.sampled_from([1, -1]))})
    if how == "class" and isinstance(item, UserMessage):
        return DelegatedMessage(**item.model_dump(exclude={"kind"}))
    if how == "flag" and isinstance(item, ToolResult):
        update: dict[str, Any] = draw(
            st.sampled_from(
                [
                    {"is_error": not item.is_error},
                    {
                        "trust": TrustLevel.USER
                        if item.trust != TrustLevel.USER
                        else TrustLevel.MEMORY
                    },
                    {"source": item.source + "\u200b"},
                ]
            )
        )
        return item.model_copy(update=update)
    field = next(f for f in ("text", "content", "arguments_json", "opaque") if hasattr(item, f))
    value: str = getattr(item, field)
    at = draw(st.integers(0, len(value)))
    return item.model_copy(update={field: value[:at] + draw(_NUDGES) + value[at:]})


@GATE
@given(st.data(), carried_histories(b"k" * 32))
def test_content_keys_are_equal_exactly_when_the_items_are(
    data: st.DataObject, history: list[ConversationItem]
) -> None:
    for item in history:
        other = data.draw(_variants(item))
        same = type(other) is type(item) and other == item
        assert (content_key(other) == content_key(item)) is same
        if same:
            assert hash(content_key(other)) == hash(content_key(item))


def _fresh_facts(item: ConversationItem, view_args: tuple[Any, ...]) -> object:
    """The item's facts derived in a process that holds nothing: every memo emptied."""
    memo_budget.clear_all()
    return carried_module._facts(item, *view_args)


def _context(secret: bytes) -> tuple[Any, ...]:
    """(count, attached, render, inline limit) as assemble() hands them to
    core/carried.py."""
    import importlib

    assembly = importlib.import_module("context_engine.core.assemble")

    def count(block: Any, item: Any) -> int:
        return int(block_tokens(block, item, count_tokens, 1_250_000, IMAGE_TOKENS))

    def render(row: Row, item: Any, truncated: bool) -> Any:
        return assembly._render(row, item, secret, truncated)

    def attached(item: Any) -> int:
        return attached_content(item, IMAGE_TOKENS)

    return (count, attached, render, 64)  # a low limit: long results get excerpts


@GATE
@given(st.data(), secrets, carried_histories(b"k" * 32))
def test_facts_found_by_content_are_the_facts_derived_afresh(
    data: st.DataObject, secret: bytes, history: list[ConversationItem]
) -> None:
    """The table, filled from one history, answers for equal items and near misses (one
    look-alike, invisible or surrogate character, one flag, the class, the sequence) exactly
    what deriving each of them with nothing remembered gives."""
    count, attached, render, limit = _context(secret)
    context = ("test", secret)

    def walk(items: list[ConversationItem]) -> tuple[object, ...]:
        view = carried_module._derive(tuple(items), context, count, attached, render, limit, 2**62)
        return view.facts

    carried_module._KNOWN.pop(context, None)
    walk(history)
    variants = []
    for item in history:
        other = data.draw(_variants(item))
        try:
            _fresh_facts(other, (count, attached, render, limit))
        except (EngineError, UnicodeEncodeError):
            other = item  # not an item assembly can carry (a surrogate cannot be sent)
        variants.append(other)
    found = walk(variants)
    assert found == tuple(_fresh_facts(item, (count, attached, render, limit)) for item in variants)


@settings(SETTINGS, max_examples=60)
@given(scenarios())
def test_a_build_from_equal_new_objects_is_the_build_of_a_process_that_never_saw_them(
    scenario: Any,
) -> None:
    """The cold case: a fresh, equal history (new objects, new strings) while the table and
    memos are warm from the first. Its request bytes, hash, figures and pressure are those
    of a Build after every memo and table is emptied."""
    inputs = scenario.inputs()
    try:
        assemble(inputs)
    except EngineError:
        return
    fresh = replace(
        inputs,
        carried=tuple(map(_copy, inputs.carried)),
        checkpoint=inputs.checkpoint.model_copy(
            update={"items": tuple(map(_copy, inputs.checkpoint.items))}
        ),
    )
    warm = assemble(fresh)
    memo_budget.clear_all()
    carried_module._TABLE.clear()
    carried_module._KNOWN.clear()
    cold = assemble(fresh)
    assert warm == cold
    assert warm.request_sha256 == cold.request_sha256
    if warm.request is not None and cold.request is not None:
        assert warm.request.canonical_bytes() == cold.request.canonical_bytes()


@GATE
@given(st.data(), secrets, carried_histories(b"k" * 32))
def test_the_render_and_cost_memos_answer_by_content_what_rendering_afresh_gives(
    data: st.DataObject, secret: bytes, history: list[ConversationItem]
) -> None:
    """assemble's block and cost memos (ContentMemo), warm from one history, answer for
    equal items as new objects and for near misses what rendering and counting each
    afresh gives."""
    import importlib

    assembly = importlib.import_module("context_engine.core.assemble")
    count, _, _, _ = _context(secret)
    args = (count_tokens, 1_250_000, IMAGE_TOKENS, FixedTexts.BLOCKS)
    for item in history:
        for truncated in (False, True):
            assembly._render_memo(item, Row.CONVERSATION, secret, truncated)
            assembly._cost_memo(item, Row.CONVERSATION, secret, truncated, *args)
    for item in history:
        other = data.draw(_variants(item))
        truncated = data.draw(st.booleans())
        try:
            block = assembly._render(Row.CONVERSATION, other, secret, truncated)
            tokens = count(block, other)
        except UnicodeEncodeError:
            continue  # a surrogate: not an item assembly can carry
        assert assembly._render_memo(other, Row.CONVERSATION, secret, truncated) == block
        assert assembly._cost_memo(other, Row.CONVERSATION, secret, truncated, *args) == tokens


def test_an_item_whose_key_cannot_be_hashed_is_computed_without_the_memo() -> None:
    calls: list[object] = []

    def length(item: UserMessage) -> int:
        calls.append(item)
        return len(item.text)

    memo = ContentMemo(length, 8)
    unhashable = UserMessage.model_construct(item_id="u", text="abc", attachments=[])
    assert memo(unhashable) == 3
    assert memo(unhashable) == 3
    assert len(calls) == 2  # not remembered
    hashable = UserMessage(item_id="u", text="abc")
    assert memo(hashable) == memo(hashable.model_copy()) == 3
    assert len(calls) == 3  # remembered by content
