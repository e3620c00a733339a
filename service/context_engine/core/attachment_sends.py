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
(its label) and spends nothing, as does one whose content alone is over the budget
(Build counts no content of it: core/body_estimate.py Rule 3). So the content sent never
exceeds what Build counted, and every label was counted (block_tokens counts each
reference's label whichever is sent).
Rule 4: pure, and a function of the request, its placed items and the per-image figure:
GetBuild's rebuild answers the same.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain
from operator import itemgetter

from .body_estimate import attachment_refs, share_attachment_budget
from .estimator import ATTACHMENT_TOKEN_BUDGET, attachment_content_tokens
from .identity_memo import RecentMemo
from .items import Attachment, ContextItem, UserMessage
from .request import Message, ModelRequest, repeated_run
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
    found = _located(request, attached)
    contents = [_content(item, image_tokens) for _, _, item in found]
    totals = [sum(tokens for tokens, counted in each if counted) for each in contents]
    lowered, _ = share_attachment_budget(totals)
    out = []
    for (n, k, item), each, total, less in zip(found, contents, totals, lowered, strict=True):
        share = min(total, ATTACHMENT_TOKEN_BUDGET) - less
        out.append(
            MessageAttachments(n, k, item.item_id, item.sequence, share, _sends(item, each, share))
        )
    return tuple(out)


def _located(
    request: ModelRequest, attached: Sequence[UserMessage]
) -> list[tuple[int, int, UserMessage]]:
    """(message index, block index, item) of each of `attached` in the request, in
    request order: its user text block, by item id and session sequence. The repeated
    run (core/request.py RepeatedRun: a run's carried interior, the same tuple on each of
    its Builds) is looked up in a table made once per run; the messages around it are
    walked, so a Build's cost does not grow with its carried history."""
    wanted = {(i.item_id, i.sequence): i for i in attached}
    messages, hint = request.messages, repeated_run(request)
    start, run = (hint.start, hint.run) if hint is not None else (len(messages), ())
    found = []
    for n in chain(range(start), range(start + len(run), len(messages))):
        found += [(n, k, wanted[key]) for k, key in _user_texts(messages[n]) if key in wanted]
    if run:
        table = _run_texts(run)
        found += [
            (start + table[key][0], table[key][1], i) for key, i in wanted.items() if key in table
        ]
    return sorted(found, key=_PLACE)


def _user_texts(message: Message) -> list[tuple[int, tuple[str, int]]]:
    """(block index, (item id, sequence)) of a user message's text blocks."""
    if message.role != "user":
        return []
    return [
        (k, (b.item_id, b.source_sequence))
        for k, b in enumerate(message.blocks)
        if b.kind == "text"
    ]


def _run_table(run: tuple[Message, ...]) -> dict[tuple[str, int], tuple[int, int]]:
    """(item id, sequence) -> (message offset in `run`, block index) of its user texts."""
    return {key: (n, k) for n, message in enumerate(run) for k, key in _user_texts(message)}


_run_texts: RecentMemo[tuple[Message, ...], dict[tuple[str, int], tuple[int, int]]] = RecentMemo(
    _run_table, weigh_depth=1
)
_PLACE = itemgetter(0, 1)


def with_attachments(placed: Sequence[tuple[Row, ContextItem]]) -> list[UserMessage]:
    """The user messages among `placed` that carry attachments, in order."""
    return [i for _, i in placed if isinstance(i, UserMessage) and i.attachments]


def _content(item: UserMessage, image_tokens: int) -> list[tuple[int, bool]]:
    """Each attachment's content tokens (core/body_estimate.py Rule 3), and whether Build
    counts them: not for one whose content alone is over the budget."""
    out = []
    for ref in attachment_refs(item.attachments):
        size = attachment_content_tokens([ref.model_copy(update=_WITHIN)], image_tokens)
        out.append((size, ref.within_item_limits))
    return out


_WITHIN = {"within_item_limits": True}  # its size, whether counted or not


def _sends(
    item: UserMessage, contents: list[tuple[int, bool]], share: int
) -> tuple[AttachmentSend, ...]:
    sends = []
    for attachment, (tokens, counted) in zip(item.attachments, contents, strict=True):
        fits = counted and tokens <= share
        share -= tokens if fits else 0
        sends.append(AttachmentSend(attachment, tokens, fits))
    return tuple(sends)
