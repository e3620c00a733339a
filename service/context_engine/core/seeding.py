"""What a new run carries from the session: the log cut at a pinned sequence.

Rule 1: the input is every conversation event strictly below the run's
seed_event_sequence, read from the log (never a live projection, never the previous run's
checkpoint). A child run has no seed sequence; the store reads below sequence 0 for it,
which is the empty input, so it goes through this same function.
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

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from .items import (
    ConversationItem,
    DelegatedMessage,
    ReasoningItem,
    ToolCall,
    ToolResult,
    UserMessage,
)

__all__ = ["Projection", "carried_history", "delegated", "instruction_item_id", "seed_cut"]


def seed_cut(seed_event_sequence: int | None) -> int:
    """The exclusive upper bound of the log a run seeds from (0 selects nothing)."""
    return seed_event_sequence if seed_event_sequence is not None else 0


def carried_history(logged: Sequence[ConversationItem]) -> tuple[ConversationItem, ...]:
    """Project logged conversation items (oldest first) into the history a run carries.

    Calls and results pair by (run, call id) in log order: call ids are unique within a
    run only, so a dead run's unanswered call must not be "answered" by a later run that
    reuses its id.
    """
    return Projection().extended(logged).history


@dataclass(frozen=True, slots=True)
class Projection:
    """carried_history as a left fold over the log, kept so a longer log extends it.

    The log only grows (a later run's input is an earlier run's plus what was logged since,
    as the same item objects), so a new run's projection is the previous run's extended by
    the new items: the Python step runs once per new item, and the carried history grows
    by the new items it carries (one C-level copy). Only when the new items answer a call
    the shorter log left pending (a call carried only once answered, Rule 3) does the
    history change behind its end; it is then selected again from the whole log, which a
    run's turns seldom need (a call is normally answered within its run, before the next
    run starts).
    """

    consumed: tuple[ConversationItem, ...] = ()  # the log folded so far (its objects)
    history: tuple[ConversationItem, ...] = ()  # what a run seeded below it carries
    count: int = 0  # the items of `consumed` that are not reasoning items
    # (run, call id) -> index among those items of a call with no result yet
    pending: Mapping[tuple[str, str], int] = field(default_factory=dict)
    dropped: frozenset[int] = frozenset()  # indices never carried: half pairs (Rule 3)
    folded: int = 0  # items the Python step has processed (all extensions included)

    def extends_to(self, logged: Sequence[ConversationItem]) -> bool:
        """Whether `logged` begins with the log folded here (the same objects)."""
        n = len(self.consumed)
        return n <= len(logged) and (n == 0 or logged[n - 1] is self.consumed[-1])

    def extended(self, logged: Sequence[ConversationItem]) -> Projection:
        """The projection of `logged`, whose first items are the log folded here."""
        if not self.extends_to(logged):
            raise ValueError("the log does not extend the one projected")
        more = [i for i in logged[len(self.consumed) :] if not isinstance(i, ReasoningItem)]
        pending = dict(self.pending)
        dropped = set(self.dropped)
        base = self.count
        answered_earlier = False  # a call pending before `more` answered in it
        for n, item in enumerate(more, base):
            if isinstance(item, ToolCall):
                key = (item.run_id, item.call_id)
                if key in pending:
                    dropped.add(pending[key])  # a reused id while the first is unanswered
                pending[key] = n
            elif isinstance(item, ToolResult):
                call = pending.pop((item.run_id, item.call_id), None)
                if call is None:
                    dropped.add(n)  # a result without its call
                elif call < base:
                    answered_earlier = True
        unseen = dropped.union(pending.values())  # not carried (pending: not yet)
        consumed = tuple(logged)
        history: tuple[ConversationItem, ...]
        if answered_earlier:
            items = [i for i in consumed if not isinstance(i, ReasoningItem)]
            history = tuple(i for n, i in enumerate(items) if n not in unseen)
        else:
            new = (i for n, i in enumerate(more, base) if n not in unseen)
            history = self.history + tuple(new)
        return Projection(
            consumed=consumed,
            history=history,
            count=base + len(more),
            pending=pending,
            dropped=frozenset(dropped),
            folded=self.folded + len(consumed) - len(self.consumed),
        )


def instruction_item_id(run_id: str) -> str:
    """The item id of a child run's instruction, its first user message (Rule 4)."""
    return f"instruction:{run_id}"


def delegated(items: tuple[ConversationItem, ...]) -> tuple[ConversationItem, ...]:
    """A child run's items as Build reads them: each user message its parent's (Rule 4)."""
    if not any(type(i) is UserMessage for i in items):
        return items
    return tuple(DelegatedMessage(**dict(i)) if type(i) is UserMessage else i for i in items)
