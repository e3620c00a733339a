"""What one Region B block costs, estimated: the body half of the estimator port.

Rule 1: a block is counted as rendered (envelope, attributes and escaping included), with
the model's counter (exact for OpenAI tokenizers, the conservative heuristic elsewhere).
Rule 2: text counts are scaled by the correction factor pinned on the checkpoint and
rounded up (estimator.apply_factor); message framing is added unscaled.
Rule 3: attachments in a user message cost what the adapter sends (ADR-0120): labels for
every reference plus a figure per image (the model's: estimator.image_tokens_for, the flat
IMAGE_TOKENS raised by the registry's image_tokens), a flat figure per PDF page and the
inlined length of a text file, capped at the request-wide attachment budget.
Rule 4: pure: the same block, counter and factor give the same number.
"""

from __future__ import annotations

from collections.abc import Callable

from .estimator import (
    IMAGE_TOKENS,
    MESSAGE_FRAMING_TOKENS,
    AttachmentKind,
    AttachmentRef,
    apply_factor,
    estimate_attachment_tokens,
)
from .items import Attachment, ContextItem, UserMessage
from .request import Block

__all__ = ["TextCounter", "attachment_refs", "block_tokens"]

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
