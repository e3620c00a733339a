"""Tool call ids on the wire.

A call id is unique within its run only (AppendItems checks no more), and a request carries
the session's earlier runs too, so two pairs in one request can share an id (`call_0` in
run 1 and in run 2). Both APIs pair a call with its result by id: Anthropic rejects repeated
``tool_use`` ids and any id outside ``[a-zA-Z0-9_-]``; OpenAI rejects repeated call ids.

Rule 1: a call's base id is its call id through the provider's table (``BASE_IDS``):
Anthropic replaces every character outside ``[A-Za-z0-9_-]`` with "_" ("" becomes "_");
OpenAI, which restricts no alphabet but refuses a call id over 64 characters
(``MAX_ID_CHARS``), sends one of at most 64 verbatim and a longer one as its first 43
characters, "_" and 20 hex digits of its SHA-256 (since context-assembler@21; before, it
was sent whole and the request refused, as was every later one carrying it).
Rule 2: walking the request's tool blocks in order, a call keeps its base id unless an
earlier call of the request took it; then it gets the first free ``<base>-<n>``, n = 2, 3,
…, its base cut short where the provider's limit needs it (since @21: a 64-character id
made 66). A result gets the id of the pending call it answers, keyed by (run id, call id). An id
depends only on the pairs before it, so appending history never changes the bytes of what
was sent before, and a call and its result always share an id.
Rule 3: the common case — every base id in the request distinct — is told by one C-level
pass over ids the per-message memos already hold; only a request with a repeat walks its
tool blocks (``wire_call_ids``) and re-renders the messages whose ids moved.
Rule 4: the mapping is never reversed: the model's new calls carry ids the provider made,
and results answer those verbatim.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Iterable, Sequence
from itertools import chain, count
from typing import Generic, TypeVar

from ..core import memo_budget
from ..core.request import Message

__all__ = ["BASE_IDS", "MAX_ID_CHARS", "VariantMemo", "all_distinct", "wire_call_ids"]

_NOT_ANTHROPIC = re.compile(r"[^A-Za-z0-9_-]")


def _anthropic(call_id: str) -> str:
    return _NOT_ANTHROPIC.sub("_", call_id) or "_"


# The longest call id a provider takes (Rule 1): OpenAI's `call_id` limit.
MAX_ID_CHARS: dict[str, int | None] = {"anthropic": None, "openai": 64}
_OPENAI_MAX = 64
_DIGEST_CHARS = 20


def _openai(call_id: str) -> str:
    if len(call_id) <= _OPENAI_MAX:
        return call_id
    digest = hashlib.sha256(call_id.encode("utf-8", "surrogatepass")).hexdigest()
    return f"{call_id[: _OPENAI_MAX - _DIGEST_CHARS - 1]}_{digest[:_DIGEST_CHARS]}"


# The plan's provider -> a call's base id (Rule 1).
BASE_IDS: dict[str, Callable[[str], str]] = {"anthropic": _anthropic, "openai": _openai}


def all_distinct(per_message: Iterable[tuple[str, ...]]) -> bool:
    """Whether no base id repeats across the messages' calls (Rule 3's fast test)."""
    ids = list(chain.from_iterable(per_message))
    return len(set(ids)) == len(ids)


def _numbered(own: str, n: int, limit: int | None) -> str:
    suffix = f"-{n}"
    return f"{own[: limit - len(suffix)] if limit else own}{suffix}"


def wire_call_ids(
    messages: Sequence[Message], base: Callable[[str], str], limit: int | None = None
) -> dict[int, tuple[str, ...]]:
    """Message index -> the wire id of each of its blocks, "" where it is the base id (and
    for blocks that are not tool blocks), for the messages with a tool block whose wire id
    is not its base id (Rule 2), each at most `limit` characters. By position: one block
    object may appear twice."""
    taken: set[str] = set()
    pending: dict[tuple[str, str], str] = {}
    moved: dict[int, tuple[str, ...]] = {}
    for n, message in enumerate(messages):
        here = [""] * len(message.blocks)
        for k, block in enumerate(message.blocks):
            if block.kind == "tool_call":
                own = base(block.call_id)
                wire = own
                if wire in taken:
                    wire = next(w for i in count(2) if (w := _numbered(own, i, limit)) not in taken)
                    here[k] = wire
                taken.add(wire)
                pending[(block.run_id, block.call_id)] = wire
            elif block.kind == "tool_result":
                answered = pending.pop((block.run_id, block.call_id), None)
                if answered is not None and answered != base(block.call_id):
                    here[k] = answered
        if any(here):
            moved[n] = tuple(here)
    return moved


K = TypeVar("K")
A = TypeVar("A")
V = TypeVar("V")


class VariantMemo(Generic[K, A, V]):
    """function(key, variant) remembered by the key's identity, one variant per key.

    A message's moved ids are the same on every Build that carries it (Rule 2: they depend
    only on what precedes it), so one slot per message hits from the second Build on. The
    entry holds its key, so no other object can have its id while the entry exists."""

    def __init__(self, function: Callable[[K, A], V], maxsize: int = 16_384) -> None:
        self._function = function
        self._entries: dict[int, tuple[K, A, V]] = {}
        self._maxsize = maxsize
        memo_budget.register(self)  # what it holds is charged to the memos' byte budget

    def cache_clear(self) -> None:
        self._entries.clear()

    def __call__(self, key: K, variant: A) -> V:
        hit = self._entries.get(id(key))
        if hit is not None and hit[1] == variant:
            return hit[2]
        memo_budget.admit()
        value = self._function(key, variant)
        if len(self._entries) >= self._maxsize:
            self._entries.clear()
        self._entries[id(key)] = (key, variant, value)
        memo_budget.charge(memo_budget.weight(key) + memo_budget.weight(value))
        return value
