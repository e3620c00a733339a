"""Legacy tool results get deterministic excerpts before selection (ADR-0137).

Rule 1: a result's context content is its persisted `context_content` excerpt when the tool
pipeline wrote one, else its canonical `content`.
Rule 2: a carried result whose context content still exceeds `inline_maximum_bytes` is
replaced in the request by a head/tail excerpt of it: the same bytes for the same input,
cut on UTF-8 character boundaries, with a marker that names the omitted byte count, the
original event (by session sequence) and the result's first artifact reference.
Rule 3: the replacement is a copy; the checkpoint and the source event keep canonical
content. Trust, call id, tool name, error flag and artifact reference are kept.
Rule 4: selection is independent of later tool results; only the limit moves these bytes.
"""

from __future__ import annotations

from .items import ToolResult

__all__ = ["DEFAULT_INLINE_MAXIMUM_BYTES", "excerpt_of", "excerpt_text"]

DEFAULT_INLINE_MAXIMUM_BYTES = 16_384
_HEAD_SHARE = 2  # the head gets 2/3 of the kept bytes: a result's opening usually says most
_SHARES = 3


def excerpt_text(text: str, limit: int, marker: str) -> str:
    """Head and tail of `text` around `marker`, at most `limit` UTF-8 bytes in all when the
    limit leaves room for the marker (the marker is never cut)."""
    data = text.encode("utf-8")
    keep = max(0, limit - len(marker.encode("utf-8")) - 2)
    head_bytes = keep * _HEAD_SHARE // _SHARES
    tail_bytes = keep - head_bytes
    head = data[:head_bytes].decode("utf-8", errors="ignore")
    tail = data[len(data) - tail_bytes :].decode("utf-8", errors="ignore") if tail_bytes else ""
    return f"{head}\n{marker}\n{tail}"


def excerpt_of(result: ToolResult, inline_maximum_bytes: int) -> ToolResult | None:
    """The request's copy of a carried result over the inline limit, or None when the
    result's context content is within it (it is then rendered as is). Not memoized:
    core/carried.py keeps what it derives per carried item, this excerpt included."""
    text = result.context_content or result.content
    size = len(text.encode("utf-8"))
    if size <= inline_maximum_bytes:
        return None
    reference = f"event {result.sequence}" if result.sequence else f"item {result.item_id}"
    if result.artifact_ref:
        reference += f", artifact:{result.artifact_ref}"
    kept = max(0, inline_maximum_bytes)
    marker = f"[excerpt: {size:,} bytes in all, middle omitted; full result: {reference}]"
    excerpt = excerpt_text(text, kept, marker)
    return result.model_copy(update={"content": excerpt, "context_content": ""})
