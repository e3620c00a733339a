"""Cache hints: the provider cache markers of a request (CacheBreakpoint), outside the prompt.

Rule 1 (the table): every marker a request may carry is one row of BREAKPOINTS — its name,
its priority (lower sends first; a provider with fewer breakpoints drops the highest) and
whether it caches Region A or the history window. Two prefix breakpoints (after_system,
after_tools) then the history window (carried_history, run, and Rule 8's bridge): a
four-breakpoint provider sends four (after_tools giving way to a bridge) and a smaller
budget, which gets no bridge, drops the run marker first.
Rule 2 (TTL): both prefix breakpoints carry one TTL, from the plan's session kind: the
one-hour TTL for a scheduled occurrence, the default for every other session. The history
window always keeps the default: its markers move every step, so a one-hour write there
would pay the premium on every request, and a shorter entry must not precede a longer one.
The TTL is not prefix identity: nothing here enters prefix_sha256.
Rule 3 (carried-history marker): closes the compacted summary (row 9) and the retained
carried history (row 10 items of earlier runs). A run that carries nothing has none.
Rule 4 (run marker): closes the longest prefix the run's next step repeats — the completed
conversation in row 10 — stopping before the first replayed provider continuation (a
reasoning item: the next step replays only its own latest turn's, ADR-0007) and before the
fresh step context (rows 11-14) and trailing user input (row 15), which follow it and move
every step. Absent when it would close the same item as the carried-history marker.
Rule 5 (through_input_item): each history marker also names the latest user message or
tool result at or before its through_item (OpenAI's implicit lookback finds prefixes that
end at an input); empty when there is none.
Rule 6: a marker names an item by id; items without an id cannot be named, so a marker
closes the last nameable item of its prefix (earlier, never later).
Rule 7 (through_sequence): a history marker also names its item's session sequence. Item
ids are unique within a run only (a worker may number each run's items alike), and a
request carries earlier runs: the id and the sequence together name one block.
Rule 8 (bridge marker): a provider finds an earlier cache entry only within a lookback of
blocks before a marker (about twenty on Anthropic). A step that adds more than that (ten
parallel calls and their results) moves the run marker past the lookback of the previous
step's entry, so every step read only through the carried marker and wrote the run's
whole portion again, at the write premium, growing with the run. So when the run's latest
model turn (its text and calls, and the inputs after them) spans more than
LOOKBACK_ITEMS items (nine parallel calls and their results, with the turn's text), a
`bridge` marker closes the item before it: where the previous
step's run marker was (Build is a pure function of the checkpoint), which the request then
reads, writing only the new turn. It takes after_tools' place (a request carries at most
MAX_MARKERS): after_tools pays off only at a rotation that keeps the tools, while the
bridge pays off on every such step. Only where the provider reads MAX_MARKERS: with
fewer, the request keeps the markers it had before (no bridge, after_tools kept).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache

from .enums import SessionKind
from .items import ContextItem, ReasoningItem, ToolResult, UserMessage
from .memo_budget import bounded_cache
from .request import CacheBreakpoint
from .rows import Row

__all__ = [
    "BREAKPOINTS",
    "DEFAULT_TTL",
    "LOOKBACK_ITEMS",
    "MAX_MARKERS",
    "PREFIX_TTL_BY_SESSION_KIND",
    "BreakpointSpec",
    "cache_breakpoints",
    "history_window",
    "prefix_breakpoints",
]

DEFAULT_TTL = "5m"
LONG_TTL = "1h"

# ADR-0132: a scheduled occurrence's single autonomous run waits on children, slow tools
# and the async queue, so its prefix is kept an hour. Every other kind: the default.
PREFIX_TTL_BY_SESSION_KIND: dict[SessionKind, str] = {SessionKind.SCHEDULED: LONG_TTL}


@dataclass(frozen=True, slots=True)
class BreakpointSpec:
    name: str
    priority: int
    prefix: bool  # True: caches Region A (plan TTL); False: the history window (default)
    through_item: str = ""  # fixed for prefix breakpoints; history markers name an item


BREAKPOINTS: tuple[BreakpointSpec, ...] = (
    BreakpointSpec("after_system", 0, prefix=True, through_item="row:system"),
    BreakpointSpec("after_tools", 1, prefix=True, through_item="row:tools"),
    BreakpointSpec("carried_history", 2, prefix=False),
    BreakpointSpec("run", 3, prefix=False),
    BreakpointSpec("bridge", 4, prefix=False),  # Rule 8
)
# The most markers any provider reads (Anthropic's four): with a bridge, after_tools gives
# way (Rule 8).
MAX_MARKERS = 4
# Rule 8: how many blocks back from a marker the provider looks for an earlier entry
# (Anthropic's lookback is about twenty), less a margin for blocks a renderer adds.
LOOKBACK_ITEMS = 16
_SPEC = {b.name: b for b in BREAKPOINTS}

_WINDOW_ROWS = frozenset({Row.COMPACTED_SUMMARY, Row.CONVERSATION})
_INPUT_TYPES = (UserMessage, ToolResult)


@cache  # one answer per session kind
def prefix_breakpoints(session_kind: SessionKind) -> tuple[CacheBreakpoint, ...]:
    """The two Region A breakpoints, both with the plan's TTL (Rule 2)."""
    ttl = PREFIX_TTL_BY_SESSION_KIND.get(session_kind, DEFAULT_TTL)
    return tuple(
        CacheBreakpoint(b.name, through_item=b.through_item, ttl=ttl, priority=b.priority)
        for b in BREAKPOINTS
        if b.prefix
    )


def history_window(
    placed: Sequence[tuple[Row, ContextItem]], run_id: str, *, bridged: bool = True
) -> tuple[CacheBreakpoint, ...]:
    """The history window over Region B as placed by assembly: up to three markers (the
    carried, the run's and, when `bridged`, Rule 8's).

    `placed` is every Region B item in assembly order; `run_id` is the building run's id
    (row 10 items with another run id, and the summary, are carried history).
    """
    window = [item for row, item in placed if row in _WINDOW_ROWS]
    repeated: list[ContextItem] = []
    for item in window:
        if isinstance(item, ReasoningItem):
            break  # Rule 4: the next step no longer carries this continuation
        repeated.append(item)
    carried_len = 0
    while carried_len < len(repeated) and not _of_run(repeated[carried_len], run_id):
        carried_len += 1

    out: list[CacheBreakpoint] = []
    carried = _marker("carried_history", repeated[:carried_len])
    if carried is not None:
        out.append(carried)
    run = _marker("run", repeated)
    if run is not None and (carried is None or _closes(run) != _closes(carried)):
        out.append(run)
        # Rule 8: the previous step's run marker, when the new one is past its lookback.
        start = _latest_turn(repeated)
        if bridged and carried_len < start and len(repeated) - start > LOOKBACK_ITEMS:
            bridge = _marker("bridge", repeated[:start])
            if bridge is not None and _closes(bridge) not in {_closes(m) for m in out}:
                out.append(bridge)
    return tuple(out)


def _latest_turn(items: Sequence[ContextItem]) -> int:
    """Where the latest model turn of `items` begins: before its inputs (results, user
    messages) and its own items (text, calls), walking back from the end."""
    start = len(items)
    while start > 0 and isinstance(items[start - 1], _INPUT_TYPES):
        start -= 1
    while start > 0 and not isinstance(items[start - 1], _INPUT_TYPES):
        start -= 1
    return start


def cache_breakpoints(
    session_kind: SessionKind,
    placed: Sequence[tuple[Row, ContextItem]],
    run_id: str,
    budget: int | None = None,
) -> tuple[CacheBreakpoint, ...]:
    """Every marker of a request, in priority order: Region A first, then the window.
    Equal markers are one tuple object (a run's steps repeat them): what serializes them
    is then a memo hit by identity. With a bridge (Rule 8), after_tools gives way: a
    request carries at most MAX_MARKERS. `budget`: how many markers the model's provider
    reads (None: MAX_MARKERS); below MAX_MARKERS there is no bridge, so a smaller budget
    drops markers as it did before the bridge (the run marker alone, past every earlier
    entry's lookback, would be written at the premium and never read: a review)."""
    prefix = prefix_breakpoints(session_kind)
    window = history_window(placed, run_id, bridged=budget is None or budget >= MAX_MARKERS)
    if len(prefix) + len(window) > MAX_MARKERS:
        prefix = tuple(b for b in prefix if b.name != "after_tools")
    return _interned((*prefix, *window))


@bounded_cache(4096)
def _interned(breakpoints: tuple[CacheBreakpoint, ...]) -> tuple[CacheBreakpoint, ...]:
    return breakpoints


def _closes(marker: CacheBreakpoint) -> tuple[str, int]:
    """The item a history marker closes (Rule 7): an id alone can name two."""
    return marker.through_item, marker.through_sequence


def _of_run(item: ContextItem, run_id: str) -> bool:
    return bool(run_id) and getattr(item, "run_id", "") == run_id


def _marker(name: str, prefix: Sequence[ContextItem]) -> CacheBreakpoint | None:
    """A history marker closing `prefix` at its last nameable item (Rules 5, 6)."""
    closing = next((n for n in range(len(prefix) - 1, -1, -1) if prefix[n].item_id), None)
    if closing is None:
        return None
    through_input = next(
        (
            prefix[n].item_id
            for n in range(closing, -1, -1)
            if isinstance(prefix[n], _INPUT_TYPES) and prefix[n].item_id
        ),
        "",
    )
    spec = _SPEC[name]
    return CacheBreakpoint(
        name,
        through_item=prefix[closing].item_id,
        ttl=DEFAULT_TTL,
        priority=spec.priority,
        through_input_item=through_input,
        through_sequence=getattr(prefix[closing], "sequence", 0),
    )
