"""What both renderers return: the payload bytes and, for explain, the prompt units.

A prompt unit is one piece of the prompt in the order the provider caches it (Anthropic:
each tool, each system block, each message content block; OpenAI: each instructions
segment, each tool, each input item), with the row and item it was rendered from. Its
bytes exclude cache markers: a marker is not prompt text.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core.rows import ROW_TABLE, Region, Row

__all__ = ["PromptUnit", "RenderedPayload"]


@dataclass(frozen=True, slots=True)
class PromptUnit:
    path: str  # where it sits in the payload, e.g. "messages[3].content[1]"
    row: Row
    item_id: str  # "" for platform text that renders no item
    data: bytes  # canonical bytes, markers excluded

    @property
    def region(self) -> Region:
        return ROW_TABLE[self.row].region


@dataclass(frozen=True, slots=True)
class RenderedPayload:
    api: str  # "anthropic.messages" | "openai.responses"
    body: bytes  # RFC 8785 JSON, ready to POST
