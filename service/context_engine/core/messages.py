"""Merging rendered blocks into messages: consecutive blocks of one role are one message.

The model's own output (assistant text, tool calls, reasoning) is the assistant's; every
other Region B item — user input, tool results, the summary, the fresh rows — is the
user's. Merging is associative, so a request's messages can be put together from parts
merged separately (core/carried.py merges a run's carried suffix once) by merging again
where two parts meet.

Messages are interned: the same role over the same block objects is the same Message
object, so the per-message memos downstream (canonical text, wire bytes, provider turns,
all keyed on identity) hit for a group that repeats — a carried turn in every later run,
a run's completed exchanges on every later step — even when it was merged anew.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import chain, compress, groupby, repeat
from operator import eq, is_, itemgetter
from typing import Literal, cast

from . import memo_budget
from .items import AssistantMessage, ContextItem, ReasoningItem, ToolCall
from .request import Block, Message

__all__ = ["Role", "grouped", "joined", "message", "role_of"]

Role = Literal["user", "assistant"]

_ASSISTANT_TYPES = (AssistantMessage, ToolCall, ReasoningItem)


def message(role: Role, blocks: tuple[Block, ...]) -> Message:
    """Message(role, blocks), interned on the blocks' identities. Each entry holds its
    message, which holds its blocks, so no id in a key is reused while the entry exists."""
    key = (role, tuple(map(id, blocks)))
    found = _INTERNED.get(key)
    if found is None:
        memo_budget.admit()
        if len(_INTERNED) >= _INTERNED_SIZE:
            _INTERNED.clear()
        found = _INTERNED[key] = Message(role, blocks)
        # Its blocks were charged where they were rendered; the message holds references.
        memo_budget.charge(memo_budget.weight(found, 0) + memo_budget.weight(blocks, 0))
    return found


class _Interned(dict[tuple[str, tuple[int, ...]], Message]):
    def cache_clear(self) -> None:
        self.clear()


_INTERNED_SIZE = 16_384
_INTERNED = _Interned()  # charged to the render memos' budget
memo_budget.register(_INTERNED)


def role_of(item: ContextItem) -> Role:
    return "assistant" if isinstance(item, _ASSISTANT_TYPES) else "user"


def grouped(items: Sequence[ContextItem], blocks: Sequence[Block]) -> tuple[Message, ...]:
    """`blocks` (one per item, in order) merged into messages by their items' roles."""
    if len(items) != len(blocks):
        raise ValueError(f"{len(items)} items but {len(blocks)} blocks")
    # Roles by type, so the pass over a long history is C-level maps, not a call per item.
    types = list(map(type, items))
    for kind in set(types) - _ROLES.keys():
        _ROLES[kind] = "assistant" if issubclass(kind, _ASSISTANT_TYPES) else "user"
    roles = list(map(_ROLES.__getitem__, types))
    if not any(map(eq, roles, roles[1:])):
        # Roles alternate, as in most histories: every message is one block, and those
        # interned before are found by one lookup each (keys as message() makes); only the
        # new ones (a run's first Build: the previous run's turns) are made one by one.
        found = list(map(_INTERNED.get, zip(roles, zip(map(id, blocks)), strict=True)))
        for n in compress(range(len(found)), map(is_, found, repeat(None))):
            found[n] = message(roles[n], (blocks[n],))
        return tuple(cast(list[Message], found))
    runs = groupby(zip(roles, blocks, strict=True), key=_FIRST)
    return tuple(message(role, tuple(map(_SECOND, run))) for role, run in runs)


_ROLES: dict[type, Role] = {}
_FIRST, _SECOND = itemgetter(0), itemgetter(1)


def joined(parts: Iterable[Sequence[Message]]) -> tuple[Message, ...]:
    """Parts merged separately, merged again where one part's last message and the next
    part's first share a role.

    The parts are chained into the tuple in one pass: a Build's parts are its head, the
    carried suffix's messages (most of the request) and its tail, and a list extended and
    then copied touched each carried message twice more."""
    pieces: list[Sequence[Message]] = []
    for messages in parts:
        if not messages:
            continue
        if pieces and pieces[-1][-1].role == messages[0].role:
            last = pieces[-1]
            pieces[-1] = last[:-1]
            pieces.append((message(last[-1].role, last[-1].blocks + messages[0].blocks),))
            messages = messages[1:]
        if messages:
            pieces.append(messages)
    return tuple(chain.from_iterable(pieces))
