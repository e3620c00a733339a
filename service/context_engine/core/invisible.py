"""Characters a reader never sees, shared by every check that compares text as a model
reads it.

Rule 1 (the set): a character is invisible when its general category is Cf (format: the
zero-width space U+200B, soft hyphen U+00AD, word joiner U+2060, BOM U+FEFF, bidi
controls, tag characters, ...) or it is one of Unicode's other Default_Ignorable_Code_Point
characters (combining grapheme joiner, Hangul fillers, variation selectors). A model reads
"C\\u200bA\\u200bN" as "CAN", so core/envelope.py drops these when it matches a delimiter
and core/compaction.py when it compares a summary with untrusted text, but for the blanks
(BLANKS: the Hangul fillers, drawn as a space, and the braille blank), which both read as
a space first. And the control characters that are not whitespace (CONTROLS: C0 but tab and
line breaks, DEL, C1 but NEL), which render as nothing either (an audit: "<\x7f/untrusted"
hid a delimiter, and a summary spelled with them passed the laundering check).
Rule 2 (linear): dropping them from a text is one regular-expression pass. ASCII holds no
invisible character, so ASCII text is returned as it is without a look.
"""

from __future__ import annotations

import re
import sys
import unicodedata
from functools import cache

__all__ = ["BLANKS", "CONTROLS", "blanks_as_spaces", "drop_invisible", "is_invisible"]

# Characters that render as a blank space though they are neither whitespace nor, to a
# reader, nothing: the braille blank (U+2800) and the Hangul fillers, which are
# default-ignorable (Rule 1) yet drawn as a space by common fonts. A reader takes
# "Platform\u3164notice" for two words, so the checks read them as a space, before
# dropping what is invisible (an audit: dropped, they joined words into one, and both an
# envelope's tag and a quoted sentence went unseen).
BLANKS = "\u2800\u3164\u115f\u1160\uffa0"
_BLANKS = str.maketrans(dict.fromkeys(BLANKS, " "))


def blanks_as_spaces(text: str) -> str:
    """`text` with every blank-looking character (BLANKS) a space."""
    return text if text.isascii() else text.translate(_BLANKS)


# Default_Ignorable_Code_Point besides category Cf.
_IGNORABLE = (
    "\u034f\u115f\u1160\u17b4\u17b5\u180b-\u180f\u3164\ufe00-\ufe0f\uffa0\U000e0100-\U000e01ef"
)
_IGNORABLE_RE = re.compile(f"[{_IGNORABLE}]")


# Control characters that are not whitespace, as a character class (\x1c-\x1f and NEL are
# line breaks to Python's str.splitlines and \s).
CONTROLS = "\x01-\x08\x0e-\x1b\x7f-\x84\x86-\x9f"
_CONTROL_RE = re.compile(f"[{CONTROLS}]+")


def is_invisible(ch: str) -> bool:
    """Whether the character `ch` is skipped by a reader (Rule 1)."""
    return (
        unicodedata.category(ch) == "Cf"
        or _IGNORABLE_RE.match(ch) is not None
        or _CONTROL_RE.match(ch) is not None
    )


@cache
def _invisible_re() -> re.Pattern[str]:
    """Every invisible character as one class. Cf is read from the interpreter's Unicode
    tables, so the set cannot fall behind them; built once, on first use (a scan of the
    code space, about a fifth of a second)."""
    formats = "".join(
        chr(c) for c in range(sys.maxunicode + 1) if unicodedata.category(chr(c)) == "Cf"
    )
    return re.compile(f"[{re.escape(formats)}{_IGNORABLE}{CONTROLS}]+")


def drop_invisible(text: str) -> str:
    """`text` without its invisible characters (Rules 1, 2); everything else verbatim."""
    if text.isascii():  # O(1) in CPython: of ASCII, only the controls are invisible
        return _CONTROL_RE.sub("", text) if _CONTROL_RE.search(text) else text
    return _invisible_re().sub("", text)
