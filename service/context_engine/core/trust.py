"""Trust levels and the envelope each one renders in.

Rule: content below TRUSTED_CONFIGURATION renders inside a nonced envelope, except the
model's own output (MODEL), which renders in the assistant role where no envelope can go.
The numbering matches the proto's TrustLevel so conversion is a cast, not a table.
"""

from __future__ import annotations

from enum import IntEnum

__all__ = ["ENVELOPE_TAGS", "TrustLevel", "envelope_tag"]


class TrustLevel(IntEnum):
    PLATFORM = 1
    TRUSTED_CONFIGURATION = 2
    USER = 3
    MODEL = 4
    MEMORY = 5
    EXTERNAL_UNTRUSTED = 6


# The envelope tag per trust level; a level absent here renders bare.
ENVELOPE_TAGS: dict[TrustLevel, str] = {
    TrustLevel.USER: "user",
    TrustLevel.MEMORY: "memory",
    TrustLevel.EXTERNAL_UNTRUSTED: "untrusted",
}


def envelope_tag(trust: TrustLevel) -> str | None:
    """The envelope tag content of this trust renders in, or None for bare content."""
    return ENVELOPE_TAGS.get(trust)
