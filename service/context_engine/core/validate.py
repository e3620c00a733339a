"""Validators that keep malformed conversations out: at append time and before a request
leaves the service.

Rule: a tool call and its result are one unit. A result must answer an earlier,
unanswered call, before the model's next turn (both providers take a turn's results in
the message right after it); a request must not contain a call without its result or a
result without its call. Call ids are unique within a run only, so in a request (which carries
earlier runs) a pair is keyed by (run id, call id), as core/seeding.py keys it: two runs
may each use `call_0`, and neither answers the other's.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from .errors import InvalidFieldError, PreconditionError
from .items import ConversationItem, ToolCall, ToolResult, UserMessage
from .names import CALLABLE_NAME, quoted_name
from .request import Block, Message

__all__ = [
    "ClosedRun",
    "closed_run",
    "validate_append",
    "validate_block_runs",
    "validate_tool_pairs",
]


# What the model reads rather than writes: a model turn is the items between two of these.
_INPUTS = (UserMessage, ToolResult)


def validate_append(
    existing: Sequence[ConversationItem],
    new: Sequence[ConversationItem],
    *,
    compacted_call_ids: Collection[str] = (),
) -> tuple[ConversationItem, ...]:
    """Reject items that would leave the run's conversation malformed; return `new` as it
    is logged: a tool result that names no tool takes its call's name.

    Raises:
        InvalidFieldError: a result without an unanswered call, or naming another tool
            than its call, a duplicate call id or item id, or a model turn begun while an
            earlier turn's call has no result; the field path names the item
            (``items[i]...``).
    """
    # The run's calls a compaction took out of the checkpoint are its calls still: their
    # ids are used, and they are answered.
    calls: set[str] = set(compacted_call_ids)
    pending: dict[str, str] = {}  # call id -> the tool it called
    ids = {i.item_id for i in existing}
    for item in existing:
        if isinstance(item, ToolCall):
            calls.add(item.call_id)
            pending[item.call_id] = item.tool_name
        elif isinstance(item, ToolResult):
            pending.pop(item.call_id, None)
    named: list[ConversationItem] = []
    after_input = bool(existing) and isinstance(existing[-1], _INPUTS)
    for index, item in enumerate(new):
        if after_input and pending and not isinstance(item, _INPUTS):
            # Both providers take a turn's results in the message right after it: a call
            # answered after the model's next turn is a request they refuse (a 400), and
            # compaction could not cut such a run without leaving half a pair.
            call_id = min(pending)
            raise InvalidFieldError(
                f"tool call {call_id!r} has no result: append every result of the model's"
                " turn before its next turn",
                field=f"items[{index}]",
                reason="ORPHANED_TOOL_ITEM",
                metadata={"call_id": call_id},
            )
        after_input = isinstance(item, _INPUTS)
        if item.item_id in ids:
            raise InvalidFieldError(
                f"item id {item.item_id!r} is already used in this run",
                field=f"items[{index}].item_id",
            )
        ids.add(item.item_id)
        if isinstance(item, ToolCall):
            if item.call_id in calls:
                raise InvalidFieldError(
                    f"tool call id {item.call_id!r} is already used in this run",
                    field=f"items[{index}].tool_call.call_id",
                )
            calls.add(item.call_id)
            pending[item.call_id] = item.tool_name
        elif isinstance(item, ToolResult):
            if item.call_id not in pending:
                problem = "was already answered" if item.call_id in calls else "has no call"
                raise InvalidFieldError(
                    f"tool result for call {item.call_id!r} {problem} in this run",
                    field=f"items[{index}].tool_result.call_id",
                    reason="ORPHANED_TOOL_ITEM",
                )
            called = pending.pop(item.call_id)
            # The envelope names its source by the tool (`tool:NAME`), and compaction's
            # transcript shows it: a result naming another tool than its call was labelled
            # as that tool's output (an audit).
            if item.tool_name and item.tool_name != called:
                # Names quoted only where they are names: a call's name is whatever the
                # model wrote, a page's sentence too (a review: it came back whole).
                raise InvalidFieldError(
                    f"tool result for call {item.call_id!r} names tool"
                    f" {quoted_name(item.tool_name)}; the call called {quoted_name(called)}"
                    " (leave it empty to take the call's)",
                    field=f"items[{index}].tool_result.tool_name",
                    metadata={"call_id": item.call_id}
                    | ({"tool_name": called} if CALLABLE_NAME.fullmatch(called) else {}),
                )
            if not item.tool_name:
                item = item.model_copy(update={"tool_name": called})
        named.append(item)
    return tuple(named)


def validate_tool_pairs(messages: Sequence[Message]) -> None:
    """Reject an assembled request containing an orphaned tool call or result.

    Raises:
        PreconditionError: ORPHANED_TOOL_ITEM, naming the call id.
    """
    validate_block_runs([[b for m in messages for b in m.blocks]])


@dataclass(frozen=True, slots=True)
class ClosedRun:
    """Blocks in which every tool call is answered and every result answers a call of
    their own (closed_run checked it). Walked from any pending state whose call ids are
    not among `call_ids`, they leave that state as they found it and raise nothing, so
    validate_block_runs passes over them without looking at each block."""

    blocks: tuple[Block, ...]
    call_ids: frozenset[tuple[str, str]]  # (run id, call id) of each call


def closed_run(blocks: Sequence[Block]) -> ClosedRun | None:
    """`blocks` as a ClosedRun, or None when they are not closed on their own."""
    pending: dict[tuple[str, str], str] = {}
    try:
        _walk(blocks, pending)
    except PreconditionError:
        return None
    if pending:
        return None
    calls = frozenset((b.run_id, b.call_id) for b in blocks if b.kind == "tool_call")
    return ClosedRun(tuple(blocks), calls)


def validate_block_runs(runs: Sequence[Sequence[Block] | ClosedRun]) -> None:
    """validate_tool_pairs over the concatenation of `runs`, in order.

    Raises:
        PreconditionError: ORPHANED_TOOL_ITEM, naming the call id.
    """
    pending: dict[tuple[str, str], str] = {}
    for run in runs:
        if isinstance(run, ClosedRun):
            if pending.keys().isdisjoint(run.call_ids):
                continue
            run = run.blocks
        _walk(run, pending)
    if pending:
        _, call_id = sorted(pending)[0]
        raise PreconditionError(
            f"tool call {call_id!r} has no result yet; append its result before building",
            reason="ORPHANED_TOOL_ITEM",
            metadata={"call_id": call_id},
        )


def _walk(blocks: Sequence[Block], pending: dict[tuple[str, str], str]) -> None:
    """Pair each result with the pending call it answers, by (run id, call id); `pending`
    is updated in place."""
    for block in blocks:
        if block.kind == "tool_call":
            key = (block.run_id, block.call_id)
            if key in pending:
                raise PreconditionError(
                    f"tool call id {block.call_id!r} is pending twice in one request",
                    reason="ORPHANED_TOOL_ITEM",
                    metadata={"call_id": block.call_id},
                )
            pending[key] = block.item_id
        elif (
            block.kind == "tool_result" and pending.pop((block.run_id, block.call_id), None) is None
        ):
            raise PreconditionError(
                f"tool result for call {block.call_id!r} has no preceding call",
                reason="ORPHANED_TOOL_ITEM",
                metadata={"call_id": block.call_id},
            )
