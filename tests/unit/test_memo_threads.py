"""The render memos are shared with the worker threads Plan and compaction run in
(asyncio.to_thread), and the ledger empties them from whichever thread spends it
(core/memo_budget.py, LOCK). Threads storing, evicting and emptying at once must never
make a lookup raise or answer for another key: an identity entry written in two steps,
emptied between them, once answered a new object that had its key's id with the old
key's value.

The interleavings are forced by switching threads every microsecond with a ledger so
small that nearly every store empties the memos; what is counted is rounds, not time.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator

import pytest

from context_engine.core import memo_budget
from context_engine.core.content_key import ContentMemo
from context_engine.core.identity_memo import IdentityMemo, RecentMemo
from context_engine.core.items import UserMessage
from context_engine.providers.call_ids import VariantMemo

ROUNDS = 20_000  # lookups per thread


class _Key:
    """A fresh object per lookup, dropped after it: the next one often reuses its id."""

    __slots__ = ("n",)

    def __init__(self, n: int) -> None:
        self.n = n


def _of(key: _Key) -> tuple[str, int]:
    return ("value of", key.n)


@pytest.fixture(autouse=True)
def _switching_often() -> Iterator[None]:
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    memo_budget.clear_all()
    yield
    sys.setswitchinterval(interval)
    memo_budget.set_limit(memo_budget.DEFAULT_LIMIT)
    memo_budget.clear_all()


def _in_threads(threads: int, right: Callable[[int], bool]) -> list[str]:
    """Call `right(n)` for ROUNDS values of n in each of `threads` threads: each wrong
    answer, and what a thread raised (which ends it)."""
    wrong: list[str] = []

    def work(offset: int) -> None:
        try:
            for n in range(offset, offset + ROUNDS):
                if not right(n):
                    wrong.append(f"wrong answer for {n}")
        except Exception as error:  # what a lookup raised is the finding
            wrong.append(repr(error))

    running = [threading.Thread(target=work, args=(t * 10 * ROUNDS,)) for t in range(threads)]
    for thread in running:
        thread.start()
    for thread in running:
        thread.join()
    return wrong


IDENTITY_MEMOS: dict[str, Callable[[], Callable[[_Key], tuple[str, int]]]] = {
    "identity": lambda: IdentityMemo(_of, by_value=False),
    "identity over equality": lambda: IdentityMemo(_of),
    "recent": lambda: RecentMemo(_of, maxsize=4),
}


@pytest.mark.parametrize("make", IDENTITY_MEMOS.values(), ids=IDENTITY_MEMOS.keys())
def test_an_identity_memo_in_many_threads_answers_each_key_with_its_own_value(
    make: Callable[[], Callable[[_Key], tuple[str, int]]],
) -> None:
    # A few entries' worth: nearly every store empties the memos, yet an entry lives long
    # enough for the other threads to find and evict it. Unlocked, the two-table identity
    # memos answered thousands of lookups with a dead key's value, and the recent memo
    # raised.
    memo_budget.set_limit(2_000)
    memo = make()
    assert _in_threads(3, lambda n: (lambda key: memo(key) == _of(key))(_Key(n))) == []


def test_a_variant_memo_in_many_threads_answers_each_key_and_variant() -> None:
    memo_budget.set_limit(2_000)
    memo = VariantMemo(lambda key, variant: (_of(key), variant))

    def right(n: int) -> bool:
        key = _Key(n)
        return memo(key, n % 3) == (_of(key), n % 3)

    assert _in_threads(3, right) == []


def test_a_content_memo_in_many_threads_evicts_its_oldest_entries_without_raising() -> None:
    # Room for every entry in the ledger, four in the memo: each store evicts, and six
    # threads read and drop the same oldest entry (unlocked: KeyError, or the dict
    # changing size while it was read).
    memo_budget.set_limit(100_000)
    memo = ContentMemo(lambda item: item.text.upper(), maxsize=4)
    items = [UserMessage(item_id="u", text=f"t{n}", sequence=1, run_id="r") for n in range(64)]
    assert _in_threads(6, lambda n: memo(items[n % 64]) == items[n % 64].text.upper()) == []
