"""The carried history of the log's newest events, and how many items the older ones carry.

A run carries the conversation events with floor < sequence < below, paired by
core/seeding.py (Rule 3), and a fitting request reaches only the newest of them
(core/carried.py: the window). So a replica reads the log newest first, a page at a time,
until the window is covered (api/log_tail.py), and never the rest. What makes that exact is
recorded with each event as it is written (migrations/0012_history_pairs.sql):

Rule 1 (answers): a result's `answers` is the sequence of the call it answers: the previous
event of its (run, call id), when that is a call. Seeding's fold pairs exactly so (a call
is answered by the next event of its key if that is a result; a reused id while the first
is unanswered drops the first; a second result answers nothing). Of the events read
(start <= sequence < below), then:
  - a message is carried;
  - a result is carried iff the call it answers lies above the floor;
  - a call is carried iff a result below `below` answers it. That result is later than the
    call, so it is among the events read: the events read decide themselves.
Rule 2 (the count before): `carried_through` is the running count, over the session's
conversation events, of 1 per message and 2 per result that answers a call (the pair, at
its result). The items the unread events, floor < sequence < start, carry are
    W(start-) - W(floor) - 2 * straddling + reaching
where W(x) is carried_through at the last event at or before x, `straddling` counts the
results among them whose call lies at or below the floor (the pair is counted in W but
neither half is carried) and `reaching` the calls among them answered by a result read
(carried, but counted in W at their result, which is read). W(start-) comes with the oldest
event read; W(floor) and `straddling` are read once (and only for a run with a summary: a
new run's floor is 0, below every event).
Rule 3 (pages): reading further back prepends the older events; the log only grows, so a
later run's tail is this one's with the events since appended. Either way no event is
read twice, and the history is the same tuple of the same item objects plus the new ones.
Reasoning items are never logged; any read is not carried (core/seeding.py, Rule 2).

Pure: no I/O. tests/unit/test_log_tail.py checks every split of generated logs against
carried_history over the whole log; tests/integration/test_log_tail.py does it through the
store's trigger and a Build.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from .items import AssistantMessage, ConversationItem, ToolCall, ToolResult, UserMessage

__all__ = ["FloorFacts", "LogTail", "Logged", "weight_of"]


@dataclass(frozen=True, slots=True)
class Logged:
    """One conversation event as read, with what the log recorded with it."""

    item: ConversationItem
    answers: int | None  # a result: the sequence of the call it answers (Rule 1)
    carried_through: int  # W at this event (Rule 2)


@dataclass(frozen=True, slots=True)
class FloorFacts:
    """What is read once about a run's carried range at its summary floor (Rule 2)."""

    weight: int  # W(floor)
    straddling: int  # results with floor < sequence < below whose call is at or below floor


# No event lies at or below sequence 0: a run without a summary needs no read (Rule 2).
_NO_FLOOR = FloorFacts(weight=0, straddling=0)


def weight_of(row: Logged) -> int:
    """What one event adds to W (Rule 2); migrations/0012_history_pairs.sql, carried_weight."""
    if isinstance(row.item, UserMessage | AssistantMessage):
        return 1
    if isinstance(row.item, ToolResult) and row.answers is not None:
        return 2
    return 0


@dataclass(frozen=True, slots=True)
class LogTail:
    """The events read of a run's carried range (floor < sequence < below), start onward,
    and what the rest carries."""

    floor: int
    below: int
    start: int  # the oldest sequence read
    history: tuple[ConversationItem, ...]  # what the events read carry, in log order
    complete: bool  # no unread event above the floor: nothing is carried before `history`
    # Rule 2's terms for the unread events (unused once complete).
    unread_weight: int  # W(start-) - W(floor)
    floor_weight: int  # W(floor)
    straddling: int  # unread results whose call lies at or below the floor
    reaching: frozenset[int]  # unread calls a result read answers
    # Calls read and not answered below `below`: a later run's events may answer them.
    pending: Mapping[int, ToolCall] = field(default_factory=dict)

    @staticmethod
    def read(
        floor: int,
        below: int,
        rows: Sequence[Logged],
        *,
        complete: bool,
        facts: FloorFacts | None = None,
    ) -> LogTail:
        """The tail from the range's newest events, `rows` (oldest first); `complete`: they
        are all of it. `facts`: the range's (needed only when incomplete above a floor)."""
        if facts is None:
            if floor > 0 and not complete:
                raise ValueError("an incomplete read above a summary floor needs its facts")
            facts = _NO_FLOOR
        unread = LogTail(
            floor=floor,
            below=below,
            start=below,
            history=(),
            complete=False,
            unread_weight=0,
            floor_weight=facts.weight,
            straddling=facts.straddling,
            reaching=frozenset(),
        )
        return unread.prepended(rows, complete=complete)

    @property
    def before(self) -> int:
        """How many carried items precede `history` (Rule 2)."""
        if self.complete:
            return 0
        return self.unread_weight - 2 * self.straddling + len(self.reaching)

    def prepended(self, older: Sequence[Logged], *, complete: bool) -> LogTail:
        """With the events just before `start` read too (oldest first); `complete`: they
        reach the floor."""
        if not older:
            if not complete:
                raise ValueError("nothing older was read, and the read is not complete")
            return replace(self, complete=True)
        answered = _answered(older, self.floor) | self.reaching
        start = older[0].item.sequence
        carried = tuple(row.item for row in older if _carried(row, self.floor, answered))
        straddlers = sum(1 for r in older if r.answers is not None and r.answers <= self.floor)
        return replace(
            self,
            start=start,
            history=carried + self.history,
            complete=complete,
            unread_weight=older[0].carried_through - weight_of(older[0]) - self.floor_weight,
            straddling=self.straddling - straddlers,
            reaching=frozenset(c for c in answered if c < start),
            pending={**_unanswered(older, answered), **self.pending},
        )

    def extended(self, newer: Sequence[Logged], below: int) -> LogTail:
        """The tail of the range up to a later `below`: `newer` (oldest first) is every
        event from this one's `below` up to that one (the log only grows)."""
        answered = _answered(newer, self.floor)
        carried = tuple(row.item for row in newer if _carried(row, self.floor, answered))
        history = self.history
        # A call read before that a new result answers is carried from now on: the history
        # changes behind its end (seldom: a call is normally answered within its run).
        moved = [self.pending[c] for c in answered if c in self.pending]
        if moved:
            history = tuple(sorted((*history, *moved), key=_sequence))
        kept = {c: call for c, call in self.pending.items() if c not in answered}
        return replace(
            self,
            below=below,
            history=history + carried,
            reaching=self.reaching | {c for c in answered if c < self.start},
            pending={**kept, **_unanswered(newer, answered)},
        )


def _sequence(item: ConversationItem) -> int:
    return item.sequence


def _answered(rows: Sequence[Logged], floor: int) -> frozenset[int]:
    """The calls above the floor that results among `rows` answer (Rule 1)."""
    return frozenset(r.answers for r in rows if r.answers is not None and r.answers > floor)


def _unanswered(rows: Sequence[Logged], answered: frozenset[int]) -> dict[int, ToolCall]:
    return {
        r.item.sequence: r.item
        for r in rows
        if isinstance(r.item, ToolCall) and r.item.sequence not in answered
    }


def _carried(row: Logged, floor: int, answered: frozenset[int]) -> bool:
    """Rule 1 for one event read; `answered`: the calls a result read answers."""
    item = row.item
    if isinstance(item, ToolCall):
        return item.sequence in answered
    if isinstance(item, ToolResult):
        return row.answers is not None and row.answers > floor
    return isinstance(item, UserMessage | AssistantMessage)
