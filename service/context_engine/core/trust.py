"""Trust levels and the envelope each one renders in.

Rule 1: content below TRUSTED_CONFIGURATION renders inside a nonced envelope, except the
model's own output (MODEL), which renders in the assistant role where no envelope can go.
Rule 2: a child run's messages from its parent agent (its instruction) are MODEL content
that stands in the user role as the run's request. They render in an envelope of their
own, DELEGATED_TAG: bare, they would read as the platform's text; as <user>, as the user's
words. That tag is no trust level's, so every tag a delimiter can name is listed in
DELIMITER_TAGS, which escaping reads (core/envelope.py, Rule 2).
The numbering matches the proto's TrustLevel so conversion is a cast, not a table.
"""

from __future__ import annotations

from enum import IntEnum

__all__ = ["DELEGATED_TAG", "DELIMITER_TAGS", "ENVELOPE_TAGS", "TrustLevel", "envelope_tag"]


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

# Rule 2: a child run's messages from its parent agent (MODEL trust, in the user role).
DELEGATED_TAG = "delegated"

# Every envelope tag, each escaped as a delimiter inside every envelope's content.
DELIMITER_TAGS: tuple[str, ...] = tuple(sorted({*ENVELOPE_TAGS.values(), DELEGATED_TAG}))


def envelope_tag(trust: TrustLevel) -> str | None:
    """The envelope tag content of this trust renders in, or None for bare content."""
    return ENVELOPE_TAGS.get(trust)
