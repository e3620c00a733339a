"""What a new run carries from the session: the log cut at a pinned sequence.

Rule 1: the input is every conversation event strictly below the run's
seed_event_sequence, read from the log (never a live projection, never the previous run's
checkpoint). A child run has no seed sequence; the store reads below sequence 0 for it,
which is the empty input, so it goes through this same function.
Rule 2: provider-opaque reasoning items never cross a run boundary.
Rule 3: a tool call without its result (a run that died mid-loop), or a result without its
call, is not carried: half a pair is a malformed request, not a smaller one.
"""

from __future__ import annotations

from collections.abc import Sequence

from .items import ConversationItem, ReasoningItem, ToolCall, ToolResult

__all__ = ["carried_history", "seed_cut"]


def seed_cut(seed_event_sequence: int | None) -> int:
    """The exclusive upper bound of the log a run seeds from (0 selects nothing)."""
    return seed_event_sequence if seed_event_sequence is not None else 0


def carried_history(logged: Sequence[ConversationItem]) -> tuple[ConversationItem, ...]:
    """Project logged conversation items (oldest first) into the history a run carries.

    Calls and results pair by (run, call id) in log order: call ids are unique within a
    run only, so a dead run's unanswered call must not be "answered" by a later run that
    reuses its id.
    """
    items = [i for i in logged if not isinstance(i, ReasoningItem)]
    pending: dict[tuple[str, str], int] = {}
    keep = [True] * len(items)
    for n, item in enumerate(items):
        if isinstance(item, ToolCall):
            key = (item.run_id, item.call_id)
            if key in pending:
                keep[pending[key]] = False  # a reused id while the first is unanswered
            pending[key] = n
        elif (
            isinstance(item, ToolResult) and pending.pop((item.run_id, item.call_id), None) is None
        ):
            keep[n] = False  # a result without its call
    for index in pending.values():
        keep[index] = False  # a call without its result
    return tuple(i for i, k in zip(items, keep, strict=True) if k)
