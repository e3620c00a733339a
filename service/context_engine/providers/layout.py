"""What both renderers return: the payload bytes and, for explain, the prompt units.

A prompt unit is one piece of the prompt in the order the provider caches it (Anthropic:
each tool, each system block, each message content block; OpenAI: each instructions
segment, each tool, each input item), with the row and item it was rendered from. Its
bytes exclude cache markers: a marker is not prompt text.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

from ..core.rows import ROW_TABLE, Region, Row

__all__ = ["PromptUnit", "RenderedPayload", "StablePrefix"]


@dataclass(frozen=True, slots=True)
class PromptUnit:
    path: str  # where it sits in the payload, e.g. "messages[3].content[1]"
    row: Row
    item_id: str  # "" for platform text that renders no item
    data: bytes  # canonical bytes, markers excluded

    @property
    def region(self) -> Region:
        return ROW_TABLE[self.row].region


# Hash states kept per memoized piece, for as many different heads before it.
_STATES_PER_PIECE = 4


@dataclass(frozen=True, slots=True)
class StablePrefix:
    """A body begins with `head` and then `piece`, a memoized text that repeats on every
    Build of a run (Anthropic: its repeated run's turns), both encoded as UTF-8. `states`
    lives on the memo entry that holds `piece` and goes with it: the SHA-256 of a head ->
    (the byte length of head and piece, the SHA-256 state after them). Keyed on the head's
    digest, not the head: a head can hold a compaction summary, and it is hashed anyway."""

    head: str
    piece: str
    states: dict[bytes, tuple[int, Any]]


@dataclass(frozen=True, slots=True)
class RenderedPayload:
    api: str  # "anthropic.messages" | "openai.responses"
    body: bytes  # RFC 8785 JSON, ready to POST
    # A hashing hint, never compared: where the body starts with a memoized piece.
    stable: StablePrefix | None = field(default=None, compare=False)

    def sha256(self) -> str:
        """The body's SHA-256, hex. With a stable prefix, hashing resumes from the state
        kept after it, so a run's Builds hash their head and what follows the carried
        history, not the history again (tests/unit/test_repeated_run.py checks it equals
        hashing the body whole)."""
        stable, body = self.stable, self.body
        if stable is None:
            return hashlib.sha256(body).hexdigest()
        head = stable.head.encode("utf-8")
        key = hashlib.sha256(head).digest()
        kept = stable.states.get(key)
        if kept is None:
            length = len(head) + len(stable.piece.encode("utf-8"))
            if len(stable.states) >= _STATES_PER_PIECE:
                stable.states.clear()
            kept = stable.states[key] = (length, hashlib.sha256(body[:length]))
        length, state = kept
        digest = state.copy()
        digest.update(memoryview(body)[length:])
        return digest.hexdigest()
