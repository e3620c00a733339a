"""History selection: the retained set is a contiguous suffix, chosen by one cut index.

The four rules, each total:
Rule 1: scan backward from the newest item, accumulating estimated tokens, and stop at the
first item whose inclusion would exceed `history_tokens` (the floor is already applied by
the allocator; the predicate reads one number and never re-derives it).
Rule 2: the cut never falls earlier than the summary floor: an item whose event sequence is
at or below `summary_floor` is represented by the summary and is not a candidate.
Rule 3: if the cut splits a tool pair, it moves later, past the orphaned result, so the
pair is excluded as a unit; never earlier (that would add tokens to a full set).
Rule 4: the never-yield items are not in `items` at all: the caller pays for them first.

`summary_floor` is an event sequence and the return value an item index; the two are
never compared with each other. The estimator must be pure, so two calls on the same
input return the same index.
"""

from __future__ import annotations

import operator
from bisect import bisect_left
from collections.abc import Sequence
from itertools import accumulate
from typing import Protocol

from .items import ContextItem, ToolCall, ToolResult

__all__ = [
    "TokenEstimator",
    "negated_suffix_sums",
    "past_split_pairs",
    "select_history",
    "suffix_cut",
]


class TokenEstimator(Protocol):
    """The estimator port as select_history uses it: a pure, conservative count."""

    def estimate(self, items: Sequence[ContextItem], model_id: str) -> int: ...


def select_history(
    items: Sequence[ContextItem],
    summary_floor: int,
    history_tokens: int,
    estimator: TokenEstimator,
    model_id: str,
) -> int:
    """The cut index: items[cut:] are retained. Items are ordered oldest first.

    Never raises; an empty suffix (cut == len(items)) is a valid answer.
    """
    cut = _floor_index(items, summary_floor)  # rule 2
    used = 0
    for index in range(len(items) - 1, cut - 1, -1):  # rule 1
        cost = estimator.estimate([items[index]], model_id)
        if used + cost > history_tokens:
            cut = index + 1
            break
        used += cost
    return past_split_pairs(items, cut)  # rule 3


def negated_suffix_sums(costs: Sequence[int]) -> tuple[int, ...]:
    """-(sum of costs[i:]) for i in 0..len(costs): ascending when no cost is negative."""
    return (*accumulate(reversed(costs), operator.sub, initial=0),)[::-1]


def suffix_cut(negated_suffix: Sequence[int], history_tokens: int) -> int:
    """Rule 1 by bisection, for items above the floor whose costs are never negative.

    Scanning backward, the accumulated cost after including item i is the suffix sum from
    i; those sums only grow as i falls, so the scan stops at the last index whose sum
    exceeds `history_tokens`, and the cut is the first index whose sum does not.
    `negated_suffix` is negated_suffix_sums(costs), derived once per history.
    (tests/unit/test_history_cut.py checks the two agree.)"""
    # A negative allowance admits nothing: the cut is the end (len = len(negated) - 1).
    return min(bisect_left(negated_suffix, -history_tokens), len(negated_suffix) - 1)


def _floor_index(items: Sequence[ContextItem], summary_floor: int) -> int:
    """The first index after the last logged item the summary covers (0 < sequence <=
    floor). An item of sequence 0 was never logged (a reasoning item: checkpoint only) and
    no summary covers it: it must not pull the floor past logged items above it."""
    start = 0
    for index, item in enumerate(items):
        if 0 < getattr(item, "sequence", 0) <= summary_floor:
            start = index + 1
    return start


def past_split_pairs(items: Sequence[ContextItem], cut: int) -> int:
    """Move the cut later until no retained result answers a call before the cut.

    Each move only drops items, so the retained set still fits; with a suffix there is one
    boundary that can split a pair, so a single forward pass settles it.
    """
    retained_calls: set[tuple[str, str]] = set()
    index = cut
    while index < len(items):
        item = items[index]
        if isinstance(item, ToolCall):
            retained_calls.add(_pair_key(item))
        elif isinstance(item, ToolResult) and _pair_key(item) not in retained_calls:
            # Its call is before the cut (or covered by the summary): exclude the pair.
            cut = index + 1
            retained_calls.clear()
        index += 1
    return cut


def _pair_key(item: ToolCall | ToolResult) -> tuple[str, str]:
    # Call ids are unique within a run, not across runs: a provider may reuse one.
    return (item.run_id, item.call_id)
