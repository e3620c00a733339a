"""What one Region B block costs, estimated: the body half of the estimator port.

Rule 1: a block is counted as rendered (envelope, attributes and escaping included), with
the model's counter (exact for OpenAI tokenizers, the conservative heuristic elsewhere).
Rule 2: text counts are scaled by the correction factor pinned on the checkpoint and
rounded up (estimator.apply_factor); message framing is added unscaled.
Rule 3: attachments in a user message cost what the adapter sends (ADR-0120): labels for
every reference plus a figure per image (the model's: estimator.image_tokens_for, the flat
IMAGE_TOKENS raised by the registry's image_tokens), a flat figure per PDF page and the
inlined length of a text file. block_tokens caps that content at the request-wide
attachment budget (ATTACHMENT_TOKEN_BUDGET), as if the message were the request's only one.
Rule 4: the budget is the request's, not each message's: the adapter sends markers for
content beyond it, wherever that content lies. share_attachment_budget divides it newest
first: each message's content counts up to what the newer messages of the request left,
and its cost is lowered by the rest of what block_tokens counted (`shared`). A message's
cost then depends only on what is newer than it, and over the newest items of a request
(any suffix of the history with everything after it) the content counted is
min(budget, their content): costs stay a sum over items, so the history cut is still
the largest suffix that fits, and the request's estimate is the request-wide bound.
Rule 5: pure: the same block, counter and factor give the same number.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from .estimator import (
    ATTACHMENT_TOKEN_BUDGET,
    IMAGE_TOKENS,
    MESSAGE_FRAMING_TOKENS,
    AttachmentKind,
    AttachmentRef,
    apply_factor,
    attachment_content_tokens,
    estimate_attachment_tokens,
)
from .items import Attachment, ContextItem, UserMessage
from .request import Block

__all__ = [
    "TextCounter",
    "attached_content",
    "attachment_refs",
    "block_tokens",
    "share_attachment_budget",
]

TextCounter = Callable[[str], int]


def block_tokens(
    block: Block,
    item: ContextItem,
    count: TextCounter,
    factor_ppm: int,
    image_tokens: int = IMAGE_TOKENS,
) -> int:
    """Estimated tokens of one rendered block (plus its item's attachments, each image at
    `image_tokens`)."""
    texts = (
        block.text,
        block.call_id,
        block.tool_name,
        block.arguments_json,
        block.artifact_ref,
        block.opaque,
    )
    raw = sum(count(t) for t in texts if t)
    tokens = apply_factor(raw, factor_ppm) + MESSAGE_FRAMING_TOKENS
    if isinstance(item, UserMessage) and item.attachments:
        tokens += estimate_attachment_tokens(
            attachment_refs(item.attachments), count, image_tokens=image_tokens
        )
    return tokens


def attachment_refs(attachments: tuple[Attachment, ...]) -> list[AttachmentRef]:
    """The estimator's view of a message's attachments (all within the per-item limits:
    the engine does not see the files, so it assumes the adapter sends them)."""
    refs = []
    for a in attachments:
        kind = AttachmentKind(a.kind)
        refs.append(
            AttachmentRef(
                kind=kind,
                label=a.ref,
                within_item_limits=True,
                pages=max(1, a.pages) if kind is AttachmentKind.PDF else None,
                inlined_bytes=a.text_length if kind is AttachmentKind.TEXT_FILE else None,
            )
        )
    return refs


def attached_content(item: ContextItem, image_tokens: int = IMAGE_TOKENS) -> int:
    """The attachment content `item`'s attachments send were no budget to bind (0 for any
    item without attachments): what Rule 4 shares the request's budget over."""
    if isinstance(item, UserMessage) and item.attachments:
        return attachment_content_tokens(attachment_refs(item.attachments), image_tokens)
    return 0


def share_attachment_budget(
    contents: Sequence[int], room: int = ATTACHMENT_TOKEN_BUDGET
) -> tuple[list[int], int]:
    """Rule 4 over `contents` (each message's attached_content, oldest first, newer than
    anything else that shares `room`): per message, what block_tokens counted of its
    content beyond its share (subtract it from the message's cost), and the room left for
    older messages."""
    lowered = [0] * len(contents)
    for n in range(len(contents) - 1, -1, -1):
        content = contents[n]
        share = min(content, room)
        lowered[n] = min(content, ATTACHMENT_TOKEN_BUDGET) - share
        room -= share
    return lowered, room
