"""What a new run carries from the session: the log cut at a pinned sequence.

Rule 1: the input is every conversation event strictly below the run's
seed_event_sequence, read from the log (never a live projection, never the previous run's
checkpoint). A child run has no seed sequence; the store reads below sequence 0 for it,
which is the empty input, so it goes through this same function. Build reads that input
newest first, only as far back as a fitting request can reach (core/log_tail.py), and
carries exactly what this function makes of all of it.
Rule 2: provider-opaque reasoning items never cross a run boundary.
Rule 3: a tool call without its result (a run that died mid-loop), or a result without its
call, is not carried: half a pair is a malformed request, not a smaller one.
Rule 4: a child run seeds from its parent's instruction instead: its first user message,
item id `instruction_item_id(run)`, never logged. That and every user message added to the
child later are its parent agent's words, not the user's (a child's "user" is its parent),
so Build reads them as DelegatedMessage (`delegated`): MODEL trust in a <delegated>
envelope. The checkpoint keeps them as written; only the reading differs, so a child
started before context-assembler@3 is read so too, and GetBuild of an older record reads
them as that assembler did (core/build_record.py, Rule 8).
"""

from __future__ import annotations

from collections.abc import Sequence

from .items import (
    ConversationItem,
    DelegatedMessage,
    ReasoningItem,
    ToolCall,
    ToolResult,
    UserMessage,
)

__all__ = ["carried_history", "delegated", "instruction_item_id", "seed_cut"]


def seed_cut(seed_event_sequence: int | None) -> int:
    """The exclusive upper bound of the log a run seeds from (0 selects nothing)."""
    return seed_event_sequence if seed_event_sequence is not None else 0


def carried_history(logged: Sequence[ConversationItem]) -> tuple[ConversationItem, ...]:
    """Project logged conversation items (oldest first) into the history a run carries.

    Calls and results pair by (run, call id) in log order: call ids are unique within a
    run only, so a dead run's unanswered call must not be "answered" by a later run that
    reuses its id. A call is answered by the next item of its key if that is a result; a
    second call of the key while the first is unanswered drops the first. Build reads the
    same pairing from what the log records with each result (core/log_tail.py, Rule 1), so
    it need not fold the whole log.
    """
    items = [i for i in logged if not isinstance(i, ReasoningItem)]  # Rule 2
    pending: dict[tuple[str, str], int] = {}  # (run, call id) -> index of an unanswered call
    dropped: set[int] = set()  # indices never carried: half pairs (Rule 3)
    for n, item in enumerate(items):
        if isinstance(item, ToolCall):
            key = (item.run_id, item.call_id)
            if key in pending:
                dropped.add(pending[key])  # a reused id while the first is unanswered
            pending[key] = n
        elif isinstance(item, ToolResult):
            answered = pending.pop((item.run_id, item.call_id), None)
            if answered is None:
                dropped.add(n)  # a result without its call
    unseen = dropped.union(pending.values())  # pending: never answered below the cut
    return tuple(i for n, i in enumerate(items) if n not in unseen)


def instruction_item_id(run_id: str) -> str:
    """The item id of a child run's instruction, its first user message (Rule 4)."""
    return f"instruction:{run_id}"


def delegated(items: tuple[ConversationItem, ...]) -> tuple[ConversationItem, ...]:
    """A child run's items as Build reads them: each user message its parent's (Rule 4)."""
    if not any(type(i) is UserMessage for i in items):
        return items
    return tuple(DelegatedMessage(**dict(i)) if type(i) is UserMessage else i for i in items)
