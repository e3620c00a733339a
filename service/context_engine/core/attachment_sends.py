"""What the adapter sends of each user message's attachments in one request (ADR-0120).

The engine never resolves an attachment: the payload holds the message's text, and the
adapter adds each attachment beside it. What it may send is what Build counted, so the
response says it, message by message, and the adapter has nothing to work out again.

Rule 1 (which messages): every user message of the request that carries attachments, in
request order, found by its block (item id and session sequence). A message cut from the
window or compacted away is not in the request and has no entry: nothing of it is sent.
Rule 2 (shares): the request's attachment content budget (ATTACHMENT_TOKEN_BUDGET) is
divided newest first, exactly as Build costed it (core/body_estimate.py Rule 4): a
message's share is its content up to what the newer messages left.
Rule 3 (content or marker): within a message, in order, an attachment whose content fits
in what is left of the share sends its content and spends it; any other sends its marker
(its label) and spends nothing. So the content sent never exceeds what Build counted, and
every label was counted (block_tokens counts each reference's label whichever is sent).
Rule 4: pure, and a function of the request, its placed items and the per-image figure:
GetBuild's rebuild answers the same.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .body_estimate import attachment_refs, share_attachment_budget
from .estimator import ATTACHMENT_TOKEN_BUDGET, attachment_content_tokens
from .items import Attachment, ContextItem, UserMessage
from .request import ModelRequest
from .rows import Row

__all__ = ["AttachmentSend", "MessageAttachments", "attachment_sends", "with_attachments"]


@dataclass(frozen=True, slots=True)
class AttachmentSend:
    attachment: Attachment
    content_tokens: int  # what Build counts its content at (the per-image figure, ...)
    content: bool  # True: send its content; False: its marker (Rule 3)


@dataclass(frozen=True, slots=True)
class MessageAttachments:
    """One message's attachments as the adapter sends them (Rules 2 and 3)."""

    message_index: int  # in request.messages
    block_index: int  # in that message's blocks: the message's text block
    item_id: str
    source_sequence: int
    share_tokens: int  # its share of the request's attachment content budget
    sends: tuple[AttachmentSend, ...]


def attachment_sends(
    request: ModelRequest, attached: Sequence[UserMessage], image_tokens: int
) -> tuple[MessageAttachments, ...]:
    """Rules 1-3 over the request's messages; `attached`: the request's placed user
    messages that carry attachments, in request order (with_attachments). () when none."""
    if not attached:
        return ()
    by_block: dict[tuple[str, int], list[UserMessage]] = {}
    for item in attached:
        by_block.setdefault((item.item_id, item.sequence), []).append(item)
    found: list[tuple[int, int, UserMessage]] = []
    for n, message in enumerate(request.messages):
        if message.role != "user":
            continue
        for k, block in enumerate(message.blocks):
            waiting = by_block.get((block.item_id, block.source_sequence))
            if block.kind == "text" and waiting:
                found.append((n, k, waiting.pop(0)))
    contents = [_content(item, image_tokens) for _, _, item in found]
    lowered, _ = share_attachment_budget([sum(c) for c in contents])
    out = []
    for (n, k, item), each, less in zip(found, contents, lowered, strict=True):
        share = min(sum(each), ATTACHMENT_TOKEN_BUDGET) - less
        out.append(
            MessageAttachments(n, k, item.item_id, item.sequence, share, _sends(item, each, share))
        )
    return tuple(out)


def with_attachments(placed: Sequence[tuple[Row, ContextItem]]) -> list[UserMessage]:
    """The user messages among `placed` that carry attachments, in order."""
    return [i for _, i in placed if isinstance(i, UserMessage) and i.attachments]


def _content(item: UserMessage, image_tokens: int) -> list[int]:
    """Each attachment's content as Build counts it (core/body_estimate.py Rule 3)."""
    return [
        attachment_content_tokens([ref], image_tokens) for ref in attachment_refs(item.attachments)
    ]


def _sends(item: UserMessage, contents: list[int], share: int) -> tuple[AttachmentSend, ...]:
    sends = []
    for attachment, tokens in zip(item.attachments, contents, strict=True):
        fits = tokens <= share
        share -= tokens if fits else 0
        sends.append(AttachmentSend(attachment, tokens, fits))
    return tuple(sends)
