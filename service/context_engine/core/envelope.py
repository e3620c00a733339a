"""Trust envelopes: nonced delimiters that content cannot close.

    <untrusted source="tool:web.fetch" id="8f21" nonce="7c1e…">…content…</untrusted:7c1e…>

Rule 1: the nonce is HMAC-SHA256(plan secret, item id), truncated. It is deterministic
(two builds give the same bytes) and unguessable (the secret never enters a prompt), so
content cannot predict its own closing marker.
Rule 2: any occurrence of envelope delimiter syntax inside content is escaped at render
time, including one carrying the right nonce; a closing marker inside content is content.
Rule 3: attribute values are escaped too, so a source name cannot forge attributes.
"""

from __future__ import annotations

import hashlib
import hmac
import re

from .trust import ENVELOPE_TAGS, TrustLevel, envelope_tag

__all__ = ["NONCE_HEX_CHARS", "escape_content", "item_nonce", "wrap"]

NONCE_HEX_CHARS = 16  # 64 bits: unguessable per item, short enough to cost few tokens.

# An opening or closing delimiter of any envelope tag, tolerant of whitespace and case
# because a model reads "< /UNTRUSTED" as a delimiter just as well.
_DELIMITER = re.compile(
    r"<(\s*/?\s*)(" + "|".join(sorted(set(ENVELOPE_TAGS.values()))) + r")\b",
    re.IGNORECASE,
)
_ATTR_ESCAPES = str.maketrans({"&": "&amp;", '"': "&quot;", "<": "&lt;", ">": "&gt;"})


def item_nonce(secret: bytes, item_id: str) -> str:
    """The item's envelope nonce under the plan's secret."""
    digest = hmac.new(secret, item_id.encode("utf-8"), hashlib.sha256).hexdigest()
    return digest[:NONCE_HEX_CHARS]


def escape_content(text: str) -> str:
    """Neutralize every envelope delimiter inside content; everything else is verbatim."""
    return _DELIMITER.sub(lambda m: "&lt;" + m.group(1) + m.group(2), text)


def wrap(
    text: str,
    *,
    trust: TrustLevel,
    item_id: str,
    source: str,
    secret: bytes,
    truncated: bool = False,
) -> str:
    """Render content in the envelope its trust requires (bare when none is required)."""
    tag = envelope_tag(trust)
    if tag is None:
        return text
    nonce = item_nonce(secret, item_id)
    attrs = f'source="{source.translate(_ATTR_ESCAPES)}" id="{item_id.translate(_ATTR_ESCAPES)}"'
    if truncated:
        attrs += ' truncated="true"'
    return f'<{tag} {attrs} nonce="{nonce}">\n{escape_content(text)}\n</{tag}:{nonce}>'
