"""Trust envelopes: nonced delimiters that content cannot close.

    <untrusted source="tool:web.fetch" id="8f21" nonce="7c1e…">…content…</untrusted:7c1e…>

Rule 1: the nonce is HMAC-SHA256(plan secret, item id), truncated. It is deterministic
(two builds give the same bytes) and unguessable (the secret never enters a prompt), so
content cannot predict its own closing marker. Under a secret `new_plan_secret` made
(context-builder@5 and later) it is 64 bits written as 20 decimal digits: every such
nonce counts the same tokens under every counter the engine ships (a digit run splits
into groups of three), so what fits a cap or a budget never depends on the secret. As 16
hex characters it did: one short memory's envelope counted 33 to 52 tokens under o200k
(36 in decimal), so which memories a snapshot pinned changed with the secret of a
rebuilding rotation (an audit of Plan's caps), and it cost 4.5 tokens more on average.
A secret without the tag (every plan made before) keeps the hex form, so a stored plan,
its Builds and their records render as they did.
Rule 2: any occurrence of envelope delimiter syntax inside content is escaped at render
time, including one carrying the right nonce; a closing marker inside content is content.
Delimiters are matched as a model reads them: in any case, with whitespace, slashes and
backslashes before the tag ("</ untrusted", "<//untrusted", "<\\/untrusted"), and with
each character folded as a reader folds it: compatibility forms to ASCII (NFKC: fullwidth
"＜" and "／", fullwidth or mathematical letters, ligatures), invisible characters dropped
(category Cf, such as U+200B and U+FEFF, and Unicode's other default-ignorable code
points: core/invisible.py, the set compaction's laundering check drops too), combining
marks dropped ("ü" reads as "u", and an overlay such as U+0336 as nothing), look-alike
angle brackets, slashes and backslashes, letters of other scripts that look like the tags'
(Cyrillic "е", Greek "ο", small capitals such as "ᴜ") and blank-looking characters (U+2800
and the Hangul fillers: core/invisible.py BLANKS) read as "<", "/", "\\", the letter and a
space (``_LOOKALIKES``). A tag is a delimiter unless an ASCII letter, digit or "_"
follows. Escaping replaces the one character that opens a delimiter with ``&lt;``; nothing
else changes and nothing is normalized.
Plain ASCII content can hold no look-alike and takes the plain match alone.
Rule 3: attribute values are escaped too, so a source name cannot forge attributes: & " < >
and every character that reads as one of them (fullwidth forms, Rule 2's openers, the
quotation marks that read as " such as “ ” „ ″), and
line breaks and tabs (as character references), so no attribute starts a line of its own.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import unicodedata
from functools import lru_cache

from .invisible import BLANKS, CONTROLS, is_invisible
from .trust import DELIMITER_TAGS, TrustLevel, envelope_tag

__all__ = [
    "DECIMAL_NONCE_TAG",
    "NONCE_DECIMAL_DIGITS",
    "NONCE_HEX_CHARS",
    "attribute_reading_count",
    "attribute_readings",
    "escape_content",
    "item_nonce",
    "new_plan_secret",
    "shown_attribute",
    "wrap",
]

NONCE_HEX_CHARS = 16  # 64 bits: unguessable per item, short enough to cost few tokens.
NONCE_DECIMAL_DIGITS = 20  # the same 64 bits in decimal (2**64 has 20 digits)
# What starts a plan secret whose nonces are decimal (Rule 1). Part of the HMAC key, as the
# rest of the secret is; it makes nothing guessable, the random bytes after it are secret.
DECIMAL_NONCE_TAG = b"context-engine nonce: decimal\n"

_TAGS = DELIMITER_TAGS  # the delegated tag too (core/trust.py, Rule 2)

# An opening or closing delimiter of any envelope tag, tolerant of whitespace and case
# because a model reads "< /UNTRUSTED" as a delimiter just as well. Possessive (*+): giving
# whitespace back can never let "/" or a tag match, and backtracking made "<" followed by
# n spaces cost n² steps.
# The tag ends where no ASCII letter, digit or "_" follows: not at a word boundary, which a
# letter-like character of another script (a modifier letter colon U+02D0, Lisu's U+A4FD)
# would deny, leaving "</untrusted\u02d0" unescaped though it reads as "</untrusted:" (an
# audit).
_DELIMITER = re.compile(r"<[\s/\\]*+(?:" + "|".join(_TAGS) + r")(?![A-Za-z0-9_])", re.IGNORECASE)

# Rule 2, look-alikes. Characters that read as "<" or "/" to a model but that NFKC leaves
# alone (it already folds fullwidth and small forms: U+FF1C, U+FE64, U+FF0F).
_LOOKALIKES = {
    **dict.fromkeys("\u2039\u2329\u3008\u27e8\u276c\u276e\u2770\u02c2\u1438", "<"),
    # More of them (an audit): a modifier letter, Canadian syllabics, mathematical angle
    # brackets. Not the double ones (guillemets, CJK title marks, U+27EA), which read as
    # "<<" and open French and Chinese quotations: escaping « user » and 《Memory》 in a
    # user's words, and folding every one (a review: 40 times the cost), bought nothing
    # the nonce does not.
    **dict.fromkeys("\u02f1\u140a\u22d6\u2991\u29fc", "<"),
    **dict.fromkeys("\u2044\u2215\u2571\u27cb\u29f8\u141f\u1735", "/"),
    **dict.fromkeys("\u29f5\u2216\u29f9", "\\"),
    # Blank-looking characters (core/invisible.py BLANKS) read as a space, not dropped.
    **dict.fromkeys(BLANKS, " "),
    # Letters that look like the tags' (untrusted, memory, user, delegated) in other
    # scripts (Cyrillic, Greek, Armenian, Cherokee, Lisu), as small capitals or with a
    # built-in stroke, which NFKC leaves alone, either case. A list, not every look-alike
    # a model could read: the nonce is what keeps a forged closing marker from closing.
    **dict.fromkeys("\u0430\u0410\u03b1\u0391\u0251\u1d00\u13aa\ua4ee", "a"),
    **dict.fromkeys("\u0501\u1d05\u0111\u0110\u13a0\ua4d3", "d"),
    **dict.fromkeys("\u0435\u0415\u0395\u04bd\u1d07\u13ac\ua4f0", "e"),
    **dict.fromkeys("\u0261\u050d\u0262\u13c0\ua4d6", "g"),
    **dict.fromkeys("\u04cf\u04c0\u01c0\u0406\u0456\u029f\u0142\u0141\u0399\u13de\ua4e1", "l"),
    **dict.fromkeys("\u043c\u041c\u039c\u1d0d\u13b7\ua4df", "m"),
    **dict.fromkeys("\u0578\u0274\u039d\ua4e0", "n"),
    **dict.fromkeys("\u043e\u041e\u03bf\u039f\u0585\u1d0f\u00f8\u00d8\ua4f3", "o"),
    **dict.fromkeys("\u0433\u0280\u13a1\ua4e3", "r"),
    **dict.fromkeys("\u0455\u0405\ua731\u13da\ua4e2", "s"),
    **dict.fromkeys("\u0442\u0422\u03c4\u03a4\u1d1b\u0167\u0166\u13a2\ua4d4", "t"),
    **dict.fromkeys("\u057d\u1d1c\u03c5\u0289\ua4f4", "u"),
    **dict.fromkeys("\u0443\u0423\u04af\u03a5\u028f\u13a9\ua4ec", "y"),
}
# Every character that can open a delimiter once folded: "<", what NFKC folds to it (small
# and fullwidth forms, and U+FE3F, a vertical-form angle bracket, through U+3008), "≮"
# (which decomposes to "<" and a mark _fold drops) and the look-alikes above
# (tests/unit/test_envelope.py scans every code point for one _fold reads as "<"). Plain
# ASCII content has none but "<".
_OPENERS = "<\ufe64\uff1c\ufe3f\u226e" + "".join(k for k, v in _LOOKALIKES.items() if v == "<")
# An opener worth a closer look: past whitespace and slashes, a tag's first letter or any
# non-ASCII character (which may fold to one). Rejects "</div", "<b>", "a < 2" in C.
_INITIALS = "".join(sorted({t[0] for t in _TAGS}))
# Control characters that are not whitespace (core/invisible.py CONTROLS): a reader sees
# nothing of them, so "<\x7f/untrusted:" reads as a closing marker (an audit; U+0000 never
# reaches here: requests refuse it). Read past like whitespace here, and dropped by _fold
# as the invisible characters they are.
_HAS_CONTROL = re.compile(f"[{CONTROLS}]")
_CANDIDATE = re.compile(
    f"[{_OPENERS}](?=[\\s/\\\\{CONTROLS}]*+[{_INITIALS}\\x80-\\U0010ffff])", re.IGNORECASE
)
_SPACE = re.compile(r"\s")
# What follows an opener in a delimiter, on the visible characters only (whitespace,
# slashes and backslashes dropped, lowercased), and each start of one: a cheap necessary
# condition that ends the look at "<di" or "</x".
_VISIBLE_TAGS = tuple(_TAGS)
_VISIBLE_STARTS = frozenset(t[:n] for t in _VISIBLE_TAGS for n in range(len(t)))
_QUOTE_LOOKALIKES = "\u201c\u201d\u201e\u201f\u2033\u2036\u02ba\u02dd\u05f4\u3003"
# Rule 3: & " < > and the characters that read as them (their compatibility forms, and
# every opener of Rule 2), so an attribute can neither end early nor hold a delimiter.
_ATTR_ESCAPES = str.maketrans(
    {
        **dict.fromkeys("&\ufe60\uff06", "&amp;"),
        # And the quotation marks that read as one (an audit: a source holding
        # `” nonce=“0000` showed a second nonce in the header): curly and low double quotes,
        # double primes, the modifier and Hebrew gershayim, the ditto mark.
        **dict.fromkeys('"\uff02' + _QUOTE_LOOKALIKES, "&quot;"),
        **dict.fromkeys(_OPENERS, "&lt;"),
        **dict.fromkeys(">\ufe65\uff1e", "&gt;"),
        # Line breaks and tabs as character references: a source with a line of its own
        # read as the engine's words inside the opening tag (an audit).
        **{c: f"&#{ord(c)};" for c in "\t\n\x0b\x0c\r\x85\u2028\u2029"},
    }
)


# Each reference an attribute shows, with every character it stands for (several read alike).
_ATTR_READINGS: dict[str, tuple[str, ...]] = {
    shown: tuple(chr(c) for c, s in sorted(_ATTR_ESCAPES.items()) if s == shown)
    for shown in sorted({str(s) for s in _ATTR_ESCAPES.values()})
}
_ATTR_REFERENCE = re.compile(
    "|".join(map(re.escape, sorted(_ATTR_READINGS, key=len, reverse=True)))
)


def shown_attribute(value: str) -> str:
    """`value` as an envelope's attribute shows it (Rule 3)."""
    return value.translate(_ATTR_ESCAPES)


def attribute_reading_count(shown: str, limit: int) -> int:
    """How many texts attribute_readings(shown) gives (`shown` itself among them), counted
    without making them; `limit` + 1 once past `limit`."""
    references = _ATTR_REFERENCE.findall(shown)
    count = 1
    for reference in references:
        count *= len(_ATTR_READINGS[reference])
        if count > limit:
            return limit + 1
    return min(count + 1, limit + 1) if references else 1


def attribute_readings(shown: str, limit: int) -> list[str] | None:
    """Every text that an envelope's attribute shows as `shown` (Rule 3 writes several
    characters alike: `&amp;` is `&`, U+FE60 or U+FF06), `shown` itself first; None when
    there are more than `limit`."""
    parts = _ATTR_REFERENCE.split(shown)
    choices = [_ATTR_READINGS[m] for m in _ATTR_REFERENCE.findall(shown)]
    count = 1
    for options in choices:
        count *= len(options)
        if count > limit:
            return None
    readings = [parts[0]]
    for options, after in zip(choices, parts[1:], strict=True):
        readings = [text + option + after for text in readings for option in options]
    return [shown, *(r for r in readings if r != shown)]


def new_plan_secret(key: bytes) -> bytes:
    """A new plan's secret from `key`, the shell's unguessable bytes: decimal nonces
    (Rule 1)."""
    return DECIMAL_NONCE_TAG + key


def item_nonce(secret: bytes, item_id: str) -> str:
    """The item's envelope nonce under the plan's secret (Rule 1: decimal under a secret
    new_plan_secret made, hex under an older one)."""
    digest = hmac.new(secret, item_id.encode("utf-8"), hashlib.sha256).digest()
    if secret.startswith(DECIMAL_NONCE_TAG):
        return f"{int.from_bytes(digest[:8], 'big'):0{NONCE_DECIMAL_DIGITS}d}"
    return digest.hex()[:NONCE_HEX_CHARS]


def escape_content(text: str) -> str:
    """Neutralize every envelope delimiter inside content, look-alikes included (Rule 2):
    its opening character becomes ``&lt;``; everything else is verbatim."""
    if text.isascii():  # O(1) in CPython: no look-alike and nothing invisible can occur
        if "<" not in text:
            return text  # no opener: most content, found by one memchr
        if not _HAS_CONTROL.search(text):  # the plain match decides
            return _DELIMITER.sub(_escaped, text)
    pieces: list[str] = []
    done = 0
    for candidate in _CANDIDATE.finditer(text):
        at = candidate.start()
        if _DELIMITER.match(text, at) or _reads_as_delimiter(text, at):
            pieces += (text[done:at], "&lt;")
            done = at + 1
    return "".join(pieces) + text[done:] if pieces else text


def _escaped(match: re.Match[str]) -> str:
    return "&lt;" + match.group()[1:]


def _reads_as_delimiter(text: str, at: int) -> bool:
    """Whether the text from the opener at `at` reads as a delimiter once each character
    after it is folded (Rule 2). Looks only as far as it takes to decide: to the first
    character no delimiter continues with, or to the one after the tag (the word boundary).
    """
    folded = ["<"]
    visible = ""
    for n in range(at + 1, len(text)):
        piece, shown = _fold(text[n])
        folded.append(piece)
        if piece and visible.startswith(_VISIBLE_TAGS):
            break
        if not visible:  # before the tag: slashes and backslashes, as the regex allows
            shown = shown.lstrip("/\\")
        visible += shown
        if visible not in _VISIBLE_STARTS and not visible.startswith(_VISIBLE_TAGS):
            return False
    return _DELIMITER.match("".join(folded)) is not None


# Combining marks, which a reader sees on the letter before (or as nothing of their own).
_MARKS = frozenset({"Mn", "Me"})


@lru_cache(maxsize=4096)
def _fold(ch: str) -> tuple[str, str]:
    """(`ch` as read: look-alike replaced, NFKC, invisible characters, control characters
    and combining marks dropped; the same lowercased without whitespace)."""
    read = unicodedata.normalize("NFKD", unicodedata.normalize("NFKC", _LOOKALIKES.get(ch, ch)))
    read = "".join(
        _LOOKALIKES.get(c, c)
        for c in read
        if not is_invisible(c) and unicodedata.category(c) not in _MARKS
    )
    read = unicodedata.normalize("NFC", read)
    return read, "".join(c for c in read.lower() if not _SPACE.match(c))


def wrap(
    text: str,
    *,
    trust: TrustLevel,
    item_id: str,
    source: str,
    secret: bytes,
    truncated: bool = False,
    tag: str | None = None,
) -> str:
    """Render content in the envelope its trust requires (bare when none is required), or
    in `tag`'s when given (a child run's delegated message: core/trust.py, Rule 2)."""
    tag = tag or envelope_tag(trust)
    if tag is None:
        return text
    nonce = item_nonce(secret, item_id)
    attrs = f'source="{shown_attribute(source)}" id="{shown_attribute(item_id)}"'
    if truncated:
        attrs += ' truncated="true"'
    return f'<{tag} {attrs} nonce="{nonce}">\n{escape_content(text)}\n</{tag}:{nonce}>'
