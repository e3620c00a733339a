"""What one Region B block costs, estimated: the body half of the estimator port.

Rule 1: a block is counted as rendered (envelope, attributes and escaping included), with
the model's counter (exact for OpenAI tokenizers, the conservative heuristic elsewhere).
Rule 2: text counts are scaled by the correction factor pinned on the checkpoint and
rounded up (estimator.apply_factor); message framing is added unscaled.
Rule 3: attachments in a user message cost what the adapter sends (ADR-0120): labels for
every reference (text, scaled as Rule 2 says) plus a figure per image (the model's:
estimator.image_tokens_for, the flat IMAGE_TOKENS raised by the registry's image_tokens),
a flat figure per PDF page and the inlined length of a text file; no content for a PDF or
text file whose content alone is over the request-wide attachment budget
(ATTACHMENT_TOKEN_BUDGET), which never fits a share and is always sent as its marker
(core/attachment_sends.py Rule 3: an audit found a 21-page PDF charged 64,000 tokens it
never sent, and a small window's every Build refused). block_tokens caps that content at
the budget, as if the message were the request's only one.
Rule 4: the budget is the request's, not each message's: the adapter sends markers for
content beyond it, wherever that content lies. share_attachment_budget divides it newest
first: each message's content counts up to what the newer messages of the request left,
and its cost is lowered by the rest of what block_tokens counted (`shared`). A message's
cost then depends only on what is newer than it, and over the newest items of a request
(any suffix of the history with everything after it) the content counted is
min(budget, their content): costs stay a sum over items, so the history cut is still
the largest suffix that fits, and the request's estimate is the request-wide bound.
Rule 5: pure: the same block, counter, factor, image figure and fixed texts (Rule 6) give
the same number.
Rule 6 (fixed texts): what a renderer adds of its own (core/fixed_texts.py) is counted
as text, in the form the request takes (`FixedTexts`): where tool pairs go as blocks, a
failed result's TOOL_ERROR_AS_TEXT line (OpenAI sends it before the content; Anthropic
says it in a field, and the line is counted anyway, a few tokens a failed call); where
they go as text (Anthropic without tools), that line and the words of TOOL_CALL_AS_TEXT
and TOOL_RESULT_AS_TEXT, counted in pieces (the words, then each field): that bounds the
heuristic's count of the joined text, which is what Anthropic models count with (an exact
BPE tokenizer can count the joined text a token or two above its pieces). A displaced
pair (providers/anthropic.py Rule 9), sent in the text form though the request defines
tools, is counted as blocks: its words, about 15 tokens a pair, are left to the body's 5%
margin. A tool block's name is counted as it is sent: its wire name
(core/wire_names.py) in blocks, the tool's own name in the text form; and its call id
with the suffix it is sent with when an earlier pair of the request took the id. And
once per request, `request_framing`: the reply priming (REQUEST_FRAMING_TOKENS) and the
HISTORY_CUT_PLACEHOLDER turn, counted on every request though Anthropic sends it only
when the first kept message is the assistant's (so the cut does not depend on what it
keeps). Since context-assembler@13; @12 and older counted none of these, and the
neutral name (FixedTexts.NONE), and a rebuild of their records counts as they did.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from enum import StrEnum

from .estimator import (
    ATTACHMENT_TOKEN_BUDGET,
    IMAGE_TOKENS,
    MESSAGE_FRAMING_TOKENS,
    PDF_PAGE_TOKENS,
    REQUEST_FRAMING_TOKENS,
    TEXT_FILE_TOKENS_PER_BYTE,
    AttachmentKind,
    AttachmentRef,
    apply_factor,
    attachment_content_tokens,
    estimate_attachment_tokens,
)
from .fixed_texts import (
    HISTORY_CUT_PLACEHOLDER,
    PAIRS_AS_TEXT_PROVIDERS,
    TOOL_CALL_AS_TEXT,
    TOOL_ERROR_AS_TEXT,
    TOOL_RESULT_AS_TEXT,
)
from .items import Attachment, ContextItem, UserMessage
from .memo_budget import ITEM, bounded_cache
from .request import Block
from .wire_names import wire_tool_name

__all__ = [
    "FixedTexts",
    "TextCounter",
    "attached_content",
    "attachment_refs",
    "block_tokens",
    "fixed_texts_of",
    "request_framing",
    "share_attachment_budget",
]

TextCounter = Callable[[str], int]


class FixedTexts(StrEnum):
    """Rule 6: which of the renderers' fixed texts a block's estimate counts."""

    NONE = "none"  # context-assembler@12 and older counted none
    BLOCKS = "blocks"  # tool pairs sent as blocks
    TEXT = "text"  # tool pairs sent as text (core/fixed_texts.py PAIRS_AS_TEXT_PROVIDERS)


# The words a renderer adds around a block's own texts (which are counted on their own),
# each with the line break that follows it, by (block kind, is_error).
_CALL_WORDS = TOOL_CALL_AS_TEXT.format(name="", arguments="", call_id="")
_RESULT_LINE = TOOL_RESULT_AS_TEXT.format(call_id="") + "\n"
_FAILED_LINE = TOOL_ERROR_AS_TEXT + "\n"
# A call id is unique within its run only, so a pair whose id an earlier pair of the
# request took is sent as "<id>-<n>" (providers/call_ids.py Rule 2). Whether an id moves
# depends on what else the request carries, so every tool block is charged the suffix of
# up to 99 repeats of one id: two tokens under the exact tokenizers, three heuristic ones.
_MOVED_SUFFIX = "-99"
_ADDED: Mapping[FixedTexts, Mapping[tuple[str, bool], tuple[str, ...]]] = {
    FixedTexts.NONE: {},
    FixedTexts.BLOCKS: {
        ("tool_call", False): (_MOVED_SUFFIX,),
        ("tool_result", False): (_MOVED_SUFFIX,),
        ("tool_result", True): (_MOVED_SUFFIX, _FAILED_LINE),
    },
    FixedTexts.TEXT: {
        ("tool_call", False): (_CALL_WORDS, _MOVED_SUFFIX),
        ("tool_result", False): (_RESULT_LINE, _MOVED_SUFFIX),
        ("tool_result", True): (_RESULT_LINE, _MOVED_SUFFIX, _FAILED_LINE),
    },
}


_BLOCKS = FixedTexts.BLOCKS


def _name_sent(name: str, fixed_texts: FixedTexts) -> str:
    """The tool name a block sends (Rule 6): its wire name in blocks, which is not always
    as many tokens ("web.fetch" is sent as "web-fetch"); "" for a block naming no tool."""
    return wire_tool_name(name) if name and fixed_texts is _BLOCKS else name


def fixed_texts_of(provider: str, defines_tools: bool, counted: bool = True) -> FixedTexts:
    """Rule 6: the fixed texts a request of `provider` counts (`counted` False: none, as
    context-assembler@12 and older)."""
    if not counted:
        return FixedTexts.NONE
    as_text = provider in PAIRS_AS_TEXT_PROVIDERS and not defines_tools
    return FixedTexts.TEXT if as_text else FixedTexts.BLOCKS


def block_tokens(
    block: Block,
    item: ContextItem,
    count: TextCounter,
    factor_ppm: int,
    image_tokens: int = IMAGE_TOKENS,
    fixed_texts: FixedTexts = FixedTexts.BLOCKS,
) -> int:
    """Estimated tokens of one rendered block (plus its item's attachments, each image at
    `image_tokens`, and the renderer's `fixed_texts` around it: Rule 6)."""
    # A provider item id (OpenAI's msg_/fc_) is counted wherever it is logged, though the
    # renderer sends it only beside its reasoning: a few tokens a turn, and the cost of an
    # item stays a function of the item alone (the history cut's sum).
    texts = (block.text, block.call_id, block.artifact_ref, block.opaque, block.provider_item_id)
    raw = sum(count(t) for t in texts if t)
    # The texts many blocks share (a tool's name, the renderer's fixed words, short
    # arguments such as "{}") are counted once per counter: a first Build counted "-99"
    # and the tool's name on every pair it derived (half of its tokenizer calls).
    if block.tool_name:
        raw += _shared_count(count, _name_sent(block.tool_name, fixed_texts))
    if block.arguments_json:
        raw += (
            _shared_count(count, block.arguments_json)
            if len(block.arguments_json) <= _SHARED_LENGTH
            else count(block.arguments_json)
        )
    raw += sum(
        _shared_count(count, t) for t in _ADDED[fixed_texts].get((block.kind, block.is_error), ())
    )
    tokens = apply_factor(raw, factor_ppm) + MESSAGE_FRAMING_TOKENS
    if isinstance(item, UserMessage) and item.attachments:
        # A label is text: scaled as the block's is (Rule 2; an audit: counted raw, every
        # label was under its scaled figure at a factor above 1, since context-assembler@27).
        tokens += estimate_attachment_tokens(
            attachment_refs(item.attachments),
            lambda label: apply_factor(count(label), factor_ppm),
            image_tokens=image_tokens,
        )
    return tokens


# Arguments this short are mostly shared ("{}", "{\"day\": \"today\"}"); longer ones are
# mostly one call's own, not worth a memo entry.
_SHARED_LENGTH = 32


@bounded_cache(4096, ITEM)
def _shared_count(count: TextCounter, text: str) -> int:
    return count(text)


def request_framing(count: TextCounter, factor_ppm: int, counted: bool = True) -> int:
    """Rule 6: what a request costs beyond its blocks (0 when not `counted`, as @12 and
    older): the reply priming and the placeholder turn, its text scaled by the factor as a
    block's is."""
    if not counted:
        return 0
    placeholder = apply_factor(count(HISTORY_CUT_PLACEHOLDER), factor_ppm) + MESSAGE_FRAMING_TOKENS
    return REQUEST_FRAMING_TOKENS + placeholder


def attachment_refs(attachments: tuple[Attachment, ...]) -> list[AttachmentRef]:
    """The estimator's view of a message's attachments: within the per-item limits where
    their content fits the request's attachment budget (Rule 3; the engine does not see
    the files, so it assumes the adapter sends any other)."""
    refs = []
    for a in attachments:
        kind = AttachmentKind(a.kind)
        pages = max(1, a.pages) if kind is AttachmentKind.PDF else None
        inlined = a.text_length if kind is AttachmentKind.TEXT_FILE else None
        content = (pages or 0) * PDF_PAGE_TOKENS + (inlined or 0) * TEXT_FILE_TOKENS_PER_BYTE
        refs.append(
            AttachmentRef(
                kind=kind,
                label=a.ref,
                within_item_limits=content <= ATTACHMENT_TOKEN_BUDGET,
                pages=pages,
                inlined_bytes=inlined,
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
