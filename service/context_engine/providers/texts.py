"""Fixed texts the renderers send where a provider has no field for what the neutral
request says. Shared, so both providers say the same thing the same way.

Changing a text here (or in core/fixed_texts.py) changes payload bytes: bump
core/build_record.py ASSEMBLER_VERSION (Rule 8) and keep a way to render the older form
where GetBuild can still serve it.
"""

from __future__ import annotations

from dataclasses import replace

from ..core.fixed_texts import TOOL_ERROR_AS_TEXT
from ..core.request import Block, Message, ModelRequest

__all__ = ["TOOL_ERROR_AS_TEXT", "without_error_line"]

# TOOL_ERROR_AS_TEXT (a failed result's is_error, as text) is defined in core/fixed_texts.py:
# the body estimate counts it.


def without_error_line(request: ModelRequest) -> ModelRequest:
    """`request` as a context-assembler@1 renderer read it where is_error is said as text:
    every failed tool result's is_error cleared, so it renders as its content alone, the
    way @1 sent it. Rendered only to rebuild a legacy record (GetBuild); the neutral
    request, and its hash, keep is_error."""
    if not any(b.is_error for m in request.messages for b in m.blocks):
        return request
    return replace(request, messages=tuple(map(_message_without, request.messages)))


def _message_without(message: Message) -> Message:
    if not any(b.is_error for b in message.blocks):
        return message
    return replace(message, blocks=tuple(map(_block_without, message.blocks)))


def _block_without(block: Block) -> Block:
    return replace(block, is_error=False) if block.is_error else block
