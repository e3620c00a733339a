"""Token estimation for the elastic request body: exact where we hold the tokenizer, a
conservative byte-class heuristic where we do not, corrected against observed usage.

Contract
--------
Rule 1. Pure. Every function here is a function of its arguments: no clock, no randomness, no
        I/O. The tokenizer is handed in by the shell, already constructed (a counting function
        or a ``tiktoken.Encoding``-like object); this module never reads rank files.
Rule 2. Conservative. Every figure rounds up: ``estimate = ceil(raw * factor_ppm / 1_000_000)``
        per text, plus ``MESSAGE_FRAMING_TOKENS`` per message. The allocator's 5% safety
        margin sits on top of this, not inside it.
Rule 3. Per model. The model's registry entry names its tokenizer (``o200k_base``,
        ``cl100k_base`` or ``heuristic``). A model whose exact tokenizer was not supplied falls
        back to the heuristic; the shell logs that when it fails to load the encoding.
Rule 4. No floats. Correction factors are integer parts-per-million (``1_000_000 == 1.0``) and
        the heuristic adds integer milli-tokens, so every number that can move a cut is exact
        and identical across machines.
Rule 5. Memoization may only save time. The heuristic keeps an LRU keyed by the exact text;
        it cannot change a returned number.
Rule 6. Versioned with the assembler. A change that moves any estimate moves cuts, and so the
        bytes a recorded request rebuilds to: bump core/build_record.py ASSEMBLER_VERSION
        (Rule 8 there), so GetBuild refuses an older record instead of failing on it.

The heuristic (models without an exact tokenizer, i.e. Anthropic)
-----------------------------------------------------------------
Anthropic does not publish its tokenizer, so the heuristic is calibrated against the two exact
tokenizers we do hold: for every text it aims at ``max(o200k_base, cl100k_base)``, never below.
Byte-level BPE tokenizers first split text into pre-tokens (a word with its leading space, a
run of 1-3 digits, a punctuation run, a whitespace run) and then merge bytes within each
pre-token, so the estimate mirrors that structure instead of using a flat chars/4 ratio, which
is close on English prose but ~30% under on JSON tool output and 3-5x under on base64 and CJK:

* ASCII words are split into case pieces (``getHTTPResponse`` -> ``get``, ``HTTP``,
  ``Response``). A lower/title-case piece costs one token up to nine letters and more beyond;
  each letter pair outside the 250 commonest English/code bigrams adds most of a token (that is
  how BPE splits a rare word), and a piece of four or more letters ending in a/i/o/u adds more
  (Romance-language words, which both tokenizers split into stem and ending). All-caps pieces
  cost more (``ENDMARKER`` is 3 tokens).
* A word that does not look like language -- one class change (lower/upper/digit) per three
  characters, 40% rare letter pairs, or from 12 characters on a few of each -- is *junk*
  (base64, hex, UUIDs, hashes, random ids) and is charged per word, per letter, per digit
  and per change of case or class, because BPE spends one token per 1.2-1.8 such
  characters. The weights were fitted to cover both tokenizers on 12,000 generated ids
  (random and mostly-zero bytes as base64, URL-safe base64 and hex; UUIDs; prefixed keys)
  with the text's edge constant left out, so a text of many ids, which pays that constant
  once, stays covered. On other ids of those kinds about
  one in 500 falls short before the edge constant, by at most about two tokens, and none
  after it (``test_ids_are_covered_almost_without_the_texts_edge_constant``).
* Digits cost per group of three (both tokenizers split numbers that way).
* Punctuation runs cost one token plus a fraction per character change; in a run of four
  or more, each repeat of a character costs what BPE spends on it at most (half a token
  for "}", ":" or '"', merged only in pairs; a sixteenth for "-" or "="). A lone punctuation
  character glued to the next word (``.append``, ``_name``) mostly merges into it.
* Whitespace: a single space before a word is free (it merges), a newline or an indentation run
  costs about one token each, a newline right after punctuation (``):\\n``) merges. A longer or
  mixed run (blank lines carrying indentation, tab runs, scraped pages, CRLF) pays at least a
  bound: one token per homogeneous segment of the run plus a share per character
  (``_whitespace_bound_mt``), since BPE merges a repeated character well and a change of
  character poorly.
* ASCII control characters (NUL..BS, SO..US, DEL) are charged one token each: both tokenizers
  spend about that on them.
* Non-ASCII characters are weighted per script (CJK, Hangul, Cyrillic, Greek, Arabic, Indic,
  accented Latin, general punctuation), calibrated so that real prose and random strings of
  the script's common characters stay covered. Non-ASCII capitals and every other code point
  are charged one token per UTF-8 byte -- a hard upper bound for a byte-level BPE, and what
  cl100k actually spends on them.
* Each text pays a small edge constant (pre-token boundaries at its ends), and no estimate ever
  exceeds the text's UTF-8 length -- again a hard bound, since every token holds >= 1 byte.

Weights were fitted by linear programming (minimise the mean over-estimate on English prose,
code and JSON subject to ``estimate >= max(o200k, cl100k)`` on every calibration sample) over
the CPython 3.11 standard library (source, docstrings, documentation topics), generated JSON
tool output, base64/hex/UUID blobs, random alphanumeric and punctuation strings, and a
hand-written corpus in sixteen languages (``bench/corpus/non_latin.txt``), then rounded up.
``python -m bench.estimator`` reports the signed error against both tokenizers: about +10% on
prose and +13-15% on code and JSON, never under by more than 1% on any sample. On held-out text
(the 3.12 and 3.13 standard libraries) the mean is the same and the worst sample is 4% under.

Known limits, stated rather than hidden. The proxies are not Claude's tokenizer, which can
count more than either; the per-model correction factor learned from real usage
(``reconcile``) closes that gap and can only raise estimates. Word costs are averages, so one
rare multi-token word repeated many times ("Anthropic. Anthropic. ...") or a run of rare
letters ("ζζζ", rare Hangul syllables, uniformly random CJK) can undercount; such drift shows
up in the correction factor on the first usage report. Ids of other alphabets than the fit's
(all-caps ULIDs and access keys, short lower-case alphanumerics) fall short before the edge
constant more often, by up to about two tokens each, so a short text of several can be a
token or two under (two ULIDs twice in a JSON list: 99 for cl100k's 100); so can short
base64 that reads as words (``["AgKsAAI=", "AgKsAgc="]``: "Ag", "Ks" and "Agc" are priced as
word pieces, which BPE splits further). Covering those alphabets too was measured to put
the mean over-estimate on JSON tool output past its 15% bar (16-17%). In texts of 32
tokens or more the edge constant and the other words cover them: ``bench.estimator``'s ids
family (292 generated texts of ULIDs, all-caps and access keys, short base64, nano ids,
prefixed keys, upper-case hex and UUIDs, by line, in JSON and among words) has none under
either tokenizer, the closest 3.4% over cl100k_base.
"""

from __future__ import annotations

import bisect
import re
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from enum import StrEnum
from functools import lru_cache
from types import MappingProxyType
from typing import Any, Final, Protocol

from pydantic import BaseModel, ConfigDict, Field, model_validator

from . import memo_budget
from .memo_budget import ITEM, bounded_cache
from .model_registry import ModelRegistry

__all__ = [
    "ATTACHMENT_BLOCK_TOKENS",
    "ATTACHMENT_TOKEN_BUDGET",
    "CORRECTION_WINDOW",
    "HEURISTIC_TOKENIZER",
    "IMAGE_TOKENS",
    "MAX_BODY_MAGNIFICATION",
    "MAX_FACTOR_PPM",
    "MESSAGE_FRAMING_TOKENS",
    "MIN_FACTOR_PPM",
    "PDF_PAGE_TOKENS",
    "PPM",
    "REQUEST_FRAMING_TOKENS",
    "TEXT_FILE_TOKENS_PER_BYTE",
    "AttachmentKind",
    "AttachmentRef",
    "Correction",
    "Encoder",
    "ExactCounter",
    "HeuristicCounter",
    "ModelTokenEstimator",
    "TokenCounter",
    "TokenEstimator",
    "apply_factor",
    "attachment_content_tokens",
    "estimate_attachment_tokens",
    "heuristic_count",
    "image_tokens_for",
    "learned_sample",
    "plausible_sample",
    "reconcile",
    "signed_error_ppm",
]

PPM: Final = 1_000_000
# The tokenizer name of a model counted by the heuristic (core/model_registry.py).
HEURISTIC_TOKENIZER: Final = "heuristic"

# Provider message framing. OpenAI chat formats spend 3 tokens per message
# (<|start|>{role}<|message|> ... <|end|>) plus 1 when a name is set; Anthropic's turn markers
# are of the same size. 4 covers both; it is added unscaled because it does not depend on text.
MESSAGE_FRAMING_TOKENS: Final = 4
# Once per request: the assistant reply priming (<|start|>assistant<|message|>).
REQUEST_FRAMING_TOKENS: Final = 3

# --- Attachments (ADR-0120) -----------------------------------------------------------------
# Anthropic downsizes any image above ~1.15 megapixels (1568 px long edge), which caps an image
# at ~1,600 tokens; gpt-4o high detail tops out at 85 + 8 * 170 = 1,445 and gpt-4.1 at 1,536
# patches. Models that count more (gpt-4o-mini, the patch-multiplier minis) say so with
# ``image_tokens`` in the registry (``image_tokens_for``).
IMAGE_TOKENS: Final = 1_600
# A PDF page is sent as a rendered page image plus its extracted text: Anthropic documents
# 1,500-3,000 tokens per page and dense pages measure ~3,150 on Opus.
PDF_PAGE_TOKENS: Final = 3_200
# Only the inlined length is known, not the text; one token per UTF-8 byte is the hard bound.
TEXT_FILE_TOKENS_PER_BYTE: Final = 1
# The content block wrapping each reference (type, media type, source framing).
ATTACHMENT_BLOCK_TOKENS: Final = 8
# Request-wide ceiling on attachment *content*: the adapter sends markers instead of content
# beyond it, so it bounds what is sent. Keep equal to agent_core.model.attachments' budget.
ATTACHMENT_TOKEN_BUDGET: Final = 64_000

# --- Correction factor ----------------------------------------------------------------------
# The applied factor never goes below 1.0: the base estimate is already an upper bound, and a
# factor learned on one content mix (non-Latin chat, which it over-counts by 30-100%) and then
# applied to another (plain code, over-counted by a few percent) would under-count by far more
# than the 5% margin. Over-estimation stays visible in ``Correction.observed_ppm``.
MIN_FACTOR_PPM: Final = PPM
# A ratio beyond 4x means a mis-registered tokenizer or a bogus usage report, not drift.
MAX_FACTOR_PPM: Final = 4 * PPM
_MIN_SAMPLE_PPM: Final = PPM // 10
# Running mean over the first samples, then an exponentially weighted mean with weight 1/8:
# the first report sets the factor outright (fast convergence), one outlier moves it by 1/8.
CORRECTION_WINDOW: Final = 8
# learned_sample: how many times a body's ratio may magnify the whole request's error. The
# tokens a provider counts beyond our exact prefix count (its framing of tools, say) are
# charged to the body, so a small body's ratio is mostly that margin: one report 7% high
# over a 119-token body behind a 3,858-token prefix set a tenant's factor to 3.3x (an
# audit). Where the body is a small share, its absolute error is small too, so capping
# what it learns costs few tokens; a body of a quarter of the request or more is learned
# from in full.
MAX_BODY_MAGNIFICATION: Final = 4


# =============================================================================================
# Heuristic tables
# =============================================================================================

# Weight of each feature, in milli-tokens. Feature counts come from ``_heuristic_features``.
_WEIGHTS_MT: Final[Mapping[str, int]] = MappingProxyType(
    {
        # Lower/title-case ASCII word pieces, by length (1..12), and per letter beyond 12.
        "word_1": 1000,
        "word_2": 1000,
        "word_3": 1000,
        "word_4": 1000,
        "word_5": 1000,
        "word_6": 1000,
        "word_7": 1000,
        "word_8": 1000,
        "word_9": 1000,
        "word_10": 1380,
        "word_11": 1380,
        "word_12": 1380,
        "word_long_char": 660,
        "caps_word": 1310,
        "caps_char": 250,
        "rare_bigram": 790,
        "vowel_end": 1790,
        # Junk words (see _add_junk_word), refitted for context-assembler@10.
        "junk_word": 1300,
        "junk_letter": 560,
        "junk_digit": 320,
        "junk_case_change": 530,
        "digit_group": 1010,
        "newline": 1380,
        "newline_after_punct": 0,
        "indent": 1490,
        "lone_space": 1000,
        # Already in milli-tokens: what the whitespace bound (``_whitespace_bound_mt``) adds
        # over the fitted whitespace features above when a run is longer or more mixed than
        # those features describe.
        "whitespace_excess": 1,
        "punct_run": 920,
        "punct_change": 130,
        "punct_change_long": 720,
        "punct_repeat": 20,
        # Already in milli-tokens: what a long punctuation run's repeats add over the flat
        # repeat above (``_repeats_excess_mt``).
        "punct_excess": 1,
        "prefix_underscore": 20,
        "prefix_dot": 160,
        "prefix_quote": 1000,
        "prefix_open": 1000,
        "prefix_other": 60,
        "space_before_non_ascii": 640,
        "script_latin": 1240,
        "script_greek": 1000,
        "script_cyrillic": 900,
        "script_arabic": 970,
        "script_indic": 1260,
        "script_cjk": 1490,
        "script_hangul": 1440,
        "script_general_punct": 1800,
        "other_byte": 1000,
        "text_edge": 2850,
    }
)
_FEATURES: Final = tuple(_WEIGHTS_MT)
_INDEX: Final = MappingProxyType({name: i for i, name in enumerate(_FEATURES)})
_WEIGHT_VECTOR: Final = tuple(_WEIGHTS_MT[name] for name in _FEATURES)

# Non-ASCII code point ranges with a calibrated per-character weight; anything else is charged
# per UTF-8 byte ("other_byte"). Sorted by start, non-overlapping.
_SCRIPT_RANGES: Final = (
    (0x00A0, 0x024F, "script_latin"),  # Latin-1 Supplement, Latin Extended-A/B
    (0x0370, 0x03FF, "script_greek"),
    (0x0400, 0x052F, "script_cyrillic"),
    (0x0600, 0x06FF, "script_arabic"),
    (0x0900, 0x0DFF, "script_indic"),  # Devanagari .. Sinhala
    (0x1E00, 0x1EFF, "script_latin"),  # Latin Extended Additional (Vietnamese)
    (0x2000, 0x206F, "script_general_punct"),  # dashes, curly quotes, ellipsis
    (0x3000, 0x30FF, "script_cjk"),  # CJK punctuation, Hiragana, Katakana
    (0x3400, 0x4DBF, "script_cjk"),  # CJK Extension A
    (0x4E00, 0x9FFF, "script_cjk"),  # CJK Unified Ideographs
    (0xAC00, 0xD7AF, "script_hangul"),
    (0xFF00, 0xFFEF, "script_cjk"),  # full-width forms
)
_SCRIPT_STARTS: Final = tuple(start for start, _, _ in _SCRIPT_RANGES)

_PREFIX_FEATURE: Final[Mapping[str, str]] = MappingProxyType(
    {
        "_": "prefix_underscore",
        ".": "prefix_dot",
        '"': "prefix_quote",
        "'": "prefix_quote",
        "`": "prefix_quote",
        "(": "prefix_open",
        "[": "prefix_open",
        "{": "prefix_open",
        "<": "prefix_open",
    }
)

# The 250 commonest letter pairs in English prose and code (lower-cased).
_COMMON_BIGRAM_TEXT: Final = (
    "ab ac ad ag ai ak al am an ap ar as at au av ax ay ba be bi bj bl bo br bs bu by ca cc "
    "ce ch ci ck cl co cr ct cu da dd de di dl do dr ds du ea ec ed ee ef eg ei el em en eo "
    "ep eq er es et ev ew ex ey fa fe ff fi fl fo fr ft fu ge gh gi gl gn gr gs gu ha he hi "
    "ho hr ht ia ib ic id ie if ig il im in io ip ir is it iv ix iz je ke ks la ld le lf li "
    "ll lo ls lt lu ly ma mb me mi mm mo mp ms mu na nc nd ne nf ng ni nk nl nn no ns nt nu "
    "nv ny ob oc od of og oi ok ol om on oo op or os ot ou ov ow pa pe pi pl po pp pr pt pu "
    "py qu ra rc rd re rg ri rk rm rn ro rr rs rt ru ry sa sc se sh si sl so sp ss st su sy "
    "ta tc td te th ti tl to tp tr ts tt tu tw ty ua ub uc ue uf ui ul um un up ur us ut va "
    "ve vi wa we wh wi wo wr xc xe xi xp xt yo yp ys yt ze"
)
_COMMON_BIGRAMS: Final = frozenset(_COMMON_BIGRAM_TEXT.split())

# A word is junk when it changes character class at least once per this many milli-chars...
_JUNK_TRANSITIONS_PER_1000_CHARS: Final = 300
_JUNK_MIN_CHARS: Final = 4
# ...or when this share (per mille) of its letter pairs is rare.
_JUNK_RARE_PAIRS_PER_1000: Final = 400
_JUNK_RARE_MIN_CHARS: Final = 5
# ...or, from this length on, when both together (per mille of pairs plus per mille of
# chars) reach this: ids encoded from low-entropy bytes ("req_AnYBaiEAAQABABF0") have a
# few of each, camelCase identifiers (getElementById: 367) fewer.
_JUNK_MIXED_PER_1000: Final = 380
_JUNK_MIXED_MIN_CHARS: Final = 12
_MAX_WORD_TABLE: Final = 12

# ASCII control characters (everything below 0x20 but the whitespace, and DEL). Both
# tokenizers spend a token on almost every one of them, so they are charged at the byte bound.
_CONTROL_CHARS: Final = "\x00-\x08\x0e-\x1f\x7f"
_RUN_RE: Final = re.compile(
    rf"[A-Za-z0-9]+|[ \t\n\r\f\v]+|[^\x00-\x7f]+|[{_CONTROL_CHARS}]+|[\x00-\x7f]"
)
_CONTROL_RE: Final = re.compile(rf"[{_CONTROL_CHARS}]")
_PIECE_RE: Final = re.compile(r"[A-Z]?[a-z]+|[A-Z]+(?![a-z])|[0-9]+")
_ALNUM, _SPACE, _NON_ASCII, _PUNCT, _CONTROL = range(5)

# --- The whitespace bound -------------------------------------------------------------------
# The fitted whitespace features price what prose and code contain (a newline, an indentation
# run, a space). A longer or mixed run -- blank lines carrying indentation, tab and newline
# runs, scraped pages -- is priced by a bound instead, and the run pays whichever is larger.
# Both tokenizers cut a run into pre-tokens: everything up to its last line break ("head"),
# then the rest but its last character, which joins the next word. Within a pre-token a run
# of one repeated character compresses well, a change of character mostly does not, so every
# homogeneous segment costs one token plus a share per character; the shares are the
# worst observed rates of the two tokenizers (a token per 80 spaces, 16 tabs, 11 newlines,
# 4 CRLF pairs, with headroom for the worse splits inside mixed runs). The one change both
# vocabularies learned is a short indentation closed by a line break ("   \n"), which
# counts as one segment. \r alone, \v and \f get a token each, which is what cl100k spends.
# Checked against both tokenizers on 55,000 random runs (every mix of these characters up to
# 400 long, and indented blank-line sequences, after and before words, punctuation, digits
# and the text end) without an under-count.
_WS_SEGMENT_MT: Final = 1000
_WS_CHAR_MT: Final[Mapping[str, int]] = MappingProxyType({" ": 20, "\t": 63, "\n": 100})
_WS_CRLF_MT: Final = 400
_WS_SEGMENT_RE: Final = re.compile(
    r"(?P<line>(?: {1,8}|\t{1,3})\n{1,2}(?!\n))|(?P<same> +|\t+|\n+)|(?P<crlf>(?:\r\n)+)|[\r\f\v]"
)
_LEADING_NEWLINES_RE: Final = re.compile(r"[\r\n]+")
_PLAIN_RUN_RE: Final = re.compile(r"\n{0,2} {0,25}")

# Only texts up to this length are memoized (at most 1024 of them), so the cache pins at most
# ~16M characters however large the conversation; longer texts are simply recounted.
_MEMO_MAX_CHARS: Final = 16 * 1024


# =============================================================================================
# Heuristic
# =============================================================================================


# Beyond this many characters the heuristic is not run: one token per UTF-8 byte is a hard
# upper bound for any byte-level BPE tokenizer and costs nothing to compute, while the
# feature scan runs at about a megabyte a second and would hold the event loop. Texts this
# long are over every class cap except history's and yield (to pointers) first anyway.
_HEURISTIC_MAX_CHARS: Final = 64 * 1024


def heuristic_count(text: str) -> int:
    """Conservative token count for ``text`` without a tokenizer (see the module docstring).

    Deterministic, pure and never above the text's UTF-8 length (which is what a text longer
    than 64 KiB characters counts). Empty text counts 0.
    """
    if len(text) <= _MEMO_MAX_CHARS:
        return _heuristic_count_memo(text)
    if len(text) > _HEURISTIC_MAX_CHARS:
        return len(text.encode("utf-8", "surrogatepass"))
    return _heuristic_count(text)


@bounded_cache(1024, ITEM)
def _heuristic_count_memo(text: str) -> int:
    return _heuristic_count(text)


def _heuristic_count(text: str) -> int:
    if not text:
        return 0
    features = _heuristic_features(text)
    milli = sum(count * weight for count, weight in zip(features, _WEIGHT_VECTOR, strict=True))
    tokens = -(-milli // 1000)
    # Every BPE token covers at least one byte.
    return min(tokens, len(text.encode("utf-8", "surrogatepass")))


def _run_kind(run: str) -> int:
    first = run[0]
    if first.isascii():
        if first.isalnum():
            return _ALNUM
        if first in " \t\n\r\f\v":
            return _SPACE
        if _CONTROL_RE.match(first):
            return _CONTROL
        return _PUNCT
    return _NON_ASCII


def _heuristic_features(text: str) -> list[int]:
    """Feature counts for ``text``, aligned with ``_FEATURES`` (empty text: all zero)."""
    counts = [0] * len(_FEATURES)
    if not text:
        return counts
    counts[_INDEX["text_edge"]] = 1
    runs = _RUN_RE.findall(text)
    kinds = [_run_kind(run) for run in runs]
    total = len(runs)
    i = 0
    while i < total:
        run = runs[i]
        kind = kinds[i]
        after = i + 1
        if kind == _ALNUM:
            _add_known(run, counts, _add_word, run)
        elif kind == _NON_ASCII:
            for char in run:
                feature, weight_units = _non_ascii_feature(char)
                counts[_INDEX[feature]] += weight_units
        elif kind == _SPACE:
            # Of the next run only its first character decides anything (_add_whitespace).
            following = runs[after][0] if after < total else None
            after_punctuation = i > 0 and kinds[i - 1] == _PUNCT
            key = (run, after_punctuation, following)
            _add_known(key, counts, _add_whitespace, run, after_punctuation, following)
        elif kind == _CONTROL:
            counts[_INDEX["other_byte"]] += len(run)
        else:
            while after < total and kinds[after] == _PUNCT:
                after += 1
            joined = "".join(runs[i:after])
            spaced = i > 0 and kinds[i - 1] == _SPACE
            # Likewise for punctuation (_add_punctuation); its runs are never whitespace's.
            following = runs[after][0] if after < total else None
            key = (joined, spaced, following)
            _add_known(key, counts, _add_punctuation, joined, spaced, following)
        i = after
    return counts


# What each run of a text adds to the features, by the run and what of its neighbours the
# function reads (_add_word: the word alone; whitespace and punctuation: the first
# character after them and a flag). Each function only adds, and text repeats its runs (a
# language's common words, a tool result's field names, ", " and ": "), so most runs are
# looked up rather than split, classed and paired again character by character: a
# 230-370-character text counted in 37-88 us rather than 150-230 us. Runs over
# _RUN_MEMO_MAX_CHARS are computed, not kept. Bounded by entries; emptied with the item
# memos (core/memo_budget.py) and charged to them at each key's text plus its deltas.
_RUN_MEMO_SIZE: Final = 65_536
_RUN_MEMO_MAX_CHARS: Final = 48

_Deltas = tuple[tuple[int, int], ...]  # (feature index, count) for each feature it adds to


class _RunDeltas(dict[object, _Deltas]):
    def cache_clear(self) -> None:
        self.clear()


_RUN_DELTAS: Final = _RunDeltas()
memo_budget.register(_RUN_DELTAS, ITEM)


def _add_known(
    key: str | tuple[str, bool, str | None],
    counts: list[int],
    add: Callable[..., None],
    *args: object,
) -> None:
    """add(*args, counts), its deltas remembered under `key`: a word, or (run, flag, the
    next run's first character), what `args` decide."""
    deltas = _RUN_DELTAS.get(key)
    if deltas is None:
        scratch = [0] * len(_FEATURES)
        add(*args, scratch)
        deltas = tuple((n, v) for n, v in enumerate(scratch) if v)
        text = key if isinstance(key, str) else key[0]
        if len(text) <= _RUN_MEMO_MAX_CHARS:
            memo_budget.admit()
            if len(_RUN_DELTAS) >= _RUN_MEMO_SIZE:
                _RUN_DELTAS.clear()
            _RUN_DELTAS[key] = deltas
            size = sys.getsizeof(text) + memo_budget.ENTRY * (1 + len(deltas))
            memo_budget.charge(size, ITEM)
    for n, v in deltas:
        counts[n] += v


def _add_word(word: str, counts: list[int]) -> None:
    length = len(word)
    if length >= _JUNK_MIN_CHARS:
        transitions, capitals = _class_changes(word)
        changes = transitions * 1000 // length
        rare = _rare_pairs_per_1000(word) if length >= _JUNK_RARE_MIN_CHARS else 0
        if (
            changes >= _JUNK_TRANSITIONS_PER_1000_CHARS
            or rare >= _JUNK_RARE_PAIRS_PER_1000
            or (length >= _JUNK_MIXED_MIN_CHARS and changes + rare >= _JUNK_MIXED_PER_1000)
        ):
            _add_junk_word(word, transitions + capitals, counts)
            return
    for piece in _PIECE_RE.findall(word):
        size = len(piece)
        if piece[0].isdigit():
            counts[_INDEX["digit_group"]] += -(-size // 3)
        elif size >= 2 and piece.isupper():
            counts[_INDEX["caps_word"]] += 1
            counts[_INDEX["caps_char"]] += size
        else:
            counts[_INDEX[f"word_{min(size, _MAX_WORD_TABLE)}"]] += 1
            counts[_INDEX["word_long_char"]] += max(0, size - _MAX_WORD_TABLE)
            lower = piece.lower()
            counts[_INDEX["vowel_end"]] += size >= 4 and lower[-1] in "aiou"
            counts[_INDEX["rare_bigram"]] += sum(
                lower[j : j + 2] not in _COMMON_BIGRAMS for j in range(size - 1)
            )


def _add_junk_word(word: str, case_changes: int, counts: list[int]) -> None:
    # Priced by what the tokenizers split it into: a pre-token per letter run and per digit
    # group, and within letters one token per one or two characters, more where the case
    # changes (the weights' fit: the module docstring). context-assembler@9's price, per
    # character and per lower-to-upper or digit change, missed random base64 by up to six
    # tokens a word before the text's edge constant, and two ids on two lines by a token.
    letters = sum(char.isalpha() for char in word)
    counts[_INDEX["junk_word"]] += 1
    counts[_INDEX["junk_letter"]] += letters
    counts[_INDEX["junk_digit"]] += len(word) - letters
    counts[_INDEX["junk_case_change"]] += case_changes


def _class_changes(word: str) -> tuple[int, int]:
    """(transitions, capitals): changes of class (lower, upper, digit) but upper -> lower,
    which is how every capitalised word starts and so tells junk from words; and those
    upper -> lower changes, which BPE pays for in junk all the same."""
    transitions = capitals = 0
    previous = -1
    for char in word:
        current = 2 if char.isdigit() else (1 if char.isupper() else 0)
        if previous >= 0 and current != previous:
            if previous == 1 and current == 0:
                capitals += 1
            else:
                transitions += 1
        previous = current
    return transitions, capitals


def _rare_pairs_per_1000(word: str) -> int:
    lower = word.lower()
    pairs = 0
    rare = 0
    for j in range(len(lower) - 1):
        pair = lower[j : j + 2]
        if pair.isalpha():
            pairs += 1
            rare += pair not in _COMMON_BIGRAMS
    return rare * 1000 // pairs if pairs else 0


def _add_whitespace(
    run: str, after_punctuation: bool, next_run: str | None, counts: list[int]
) -> None:
    fitted_mt = 0
    last_newline = max(run.rfind("\n"), run.rfind("\r"))
    if last_newline >= 0:
        # Both tokenizers glue newlines directly after punctuation into its pre-token.
        merged = after_punctuation and run[0] in "\r\n"
        feature = "newline_after_punct" if merged else "newline"
        counts[_INDEX[feature]] += 1
        fitted_mt += _WEIGHTS_MT[feature]
    trailing = len(run) - last_newline - 1
    if trailing == 1:
        # A lone space merges into a following word or punctuation run, not into digits.
        if next_run is None or (next_run[0].isascii() and next_run[0].isdigit()):
            counts[_INDEX["lone_space"]] += 1
            fitted_mt += _WEIGHTS_MT["lone_space"]
        elif not next_run[0].isascii():
            counts[_INDEX["space_before_non_ascii"]] += 1
            fitted_mt += _WEIGHTS_MT["space_before_non_ascii"]
    elif trailing >= 2:
        counts[_INDEX["indent"]] += 1
        fitted_mt += _WEIGHTS_MT["indent"]
    # Skip the bound where it cannot exceed the fitted features: a lone space, one or two
    # newlines, and those plus up to 25 spaces before a word or punctuation (the bound is at
    # most 1.2 + 1.0 + 0.02 per space there, the features 1.38 + 1.49) -- the commonest runs.
    plain = run in (" ", "\n", "\n\n") or (
        next_run is not None and not next_run[0].isdigit() and _PLAIN_RUN_RE.fullmatch(run)
    )
    if not plain:
        excess = _whitespace_bound_mt(run, after_punctuation, next_run) - fitted_mt
        if excess > 0:
            counts[_INDEX["whitespace_excess"]] += excess


def _whitespace_bound_mt(run: str, after_punctuation: bool, next_run: str | None) -> int:
    """Upper bound, in milli-tokens, on what both tokenizers spend on a whitespace run."""
    last_newline = max(run.rfind("\n"), run.rfind("\r"))
    head, tail = run[: last_newline + 1], run[last_newline + 1 :]
    bound = 0
    if after_punctuation and head:
        leading = _LEADING_NEWLINES_RE.match(head)
        if leading is not None:
            head = head[leading.end() :]
            bound += _merged_newlines_mt(leading.group())
    bound += _segments_mt(head)
    if tail:
        if next_run is None:
            return bound + _segments_mt(tail)
        bound += _segments_mt(tail[:-1])
        # The last character joins the next pre-token: a space before a word or punctuation,
        # a tab before an ASCII word. Anything else stands alone.
        last, following = tail[-1], next_run[0]
        joins = (last == " " and not following.isdigit()) or (
            last == "\t" and following.isascii() and following.isalpha()
        )
        if not joins:
            bound += _WS_SEGMENT_MT
    return bound


def _merged_newlines_mt(newlines: str) -> int:
    # The newlines right after punctuation join its pre-token (":\n", ".\n\n" and ")\r\n" are
    # one token); beyond one or two of them BPE splits them off again. A mix of \n and \r\n
    # is charged in full.
    if newlines in ("\n", "\n\n", "\r\n"):
        return 0
    if newlines.count("\n") == len(newlines):
        return _segments_mt(newlines[1:])
    if newlines == "\r\n" * (len(newlines) // 2):
        return _segments_mt(newlines[2:])
    return _segments_mt(newlines)


def _segments_mt(text: str) -> int:
    total = 0
    for match in _WS_SEGMENT_RE.finditer(text):
        kind = match.lastgroup
        segment = match.group()
        if kind == "crlf":
            total += _WS_SEGMENT_MT + len(segment) // 2 * _WS_CRLF_MT
        elif kind == "same":
            total += _WS_SEGMENT_MT + len(segment) * _WS_CHAR_MT[segment[0]]
        elif kind == "line":
            # A short indentation closed by a line break ("   \n", "\t\n\n") is one token.
            total += _WS_SEGMENT_MT + sum(_WS_CHAR_MT[char] for char in segment)
        else:  # \r alone, \v, \f
            total += _WS_SEGMENT_MT
    return total


def _add_punctuation(
    run: str, preceded_by_space: bool, next_run: str | None, counts: list[int]
) -> None:
    length = len(run)
    # A single punctuation character not preceded by a space joins the following word's
    # pre-token (".append", "_name", "(self"); a longer run or a spaced one stands alone.
    if (
        length == 1
        and not preceded_by_space
        and next_run is not None
        and next_run[0].isascii()
        and next_run[0].isalpha()
    ):
        counts[_INDEX[_PREFIX_FEATURE.get(run, "prefix_other")]] += 1
        return
    changes = sum(run[j] != run[j - 1] for j in range(1, length))
    counts[_INDEX["punct_run"]] += 1
    counts[_INDEX["punct_change_long" if length >= 4 else "punct_change"]] += changes
    counts[_INDEX["punct_repeat"]] += length - 1 - changes
    if length >= _PUNCT_BOUND_FROM:
        counts[_INDEX["punct_excess"]] += _repeats_excess_mt(run)


# In a punctuation run of four characters or more (the fit's short runs, a docstring's
# quotes or "))", stay as fitted), each repeat of a character costs r, the most either
# tokenizer spends on a repeat of it (tokens past a run's first over its characters past
# the first, lengths 2-400): BPE merges "}", ":" or '"' only in pairs, "(" or "," in fours.
# The flat repeat priced a run of 299 "}" at 10 tokens for 150 (an audit). Checked against
# both tokenizers on every such run of 1-400 and 60,000 random mixed runs: none under.
_PUNCT_BOUND_FROM: Final = 4
_REPEAT_MT: Final = {
    **dict.fromkeys("~}|{^]\\[@:&$`'\"", 500),
    **dict.fromkeys("?><;,+)(%/", 250),
    **dict.fromkeys("!_", 200),
    "#": 170,
    "*": 130,
    ".": 120,
    **dict.fromkeys("-=", 70),
}


def _repeats_excess_mt(run: str) -> int:
    """What the run's repeats cost beyond the flat repeat, each at its character's rate
    (_REPEAT_MT)."""
    flat = _WEIGHTS_MT["punct_repeat"]
    return sum(
        _REPEAT_MT.get(run[j], 500) - flat for j in range(1, len(run)) if run[j] == run[j - 1]
    )


@lru_cache(maxsize=4096)
def _non_ascii_feature(char: str) -> tuple[str, int]:
    # Both tokenizers learned few merges for non-ASCII capitals ("ΑΑΑ" is six cl100k tokens):
    # charge them at the byte bound whatever their script.
    if char.isupper():
        return "other_byte", len(char.encode("utf-8", "surrogatepass"))
    code = ord(char)
    index = bisect.bisect_right(_SCRIPT_STARTS, code) - 1
    if index >= 0:
        _, end, feature = _SCRIPT_RANGES[index]
        if code <= end:
            return feature, 1
    return "other_byte", len(char.encode("utf-8", "surrogatepass"))


# =============================================================================================
# Counters: one per tokenizer
# =============================================================================================


class TokenCounter(Protocol):
    """Counts the tokens of one text under one tokenizer, without framing or correction."""

    @property
    def tokenizer(self) -> str:
        """The registry tokenizer name this counter implements."""
        ...

    @property
    def exact(self) -> bool:
        """True when counts are the tokenizer's own, False for an estimate."""
        ...

    def count_text(self, text: str) -> int:
        """Token count of ``text``; must be a pure function of ``text``."""
        ...


class Encoder(Protocol):
    """The part of ``tiktoken.Encoding`` the core uses (structural; no tiktoken import here)."""

    @property
    def name(self) -> str: ...

    def encode_ordinary(self, text: str) -> list[int]: ...


class ExactCounter:
    """Exact counts from a tokenizer the shell constructed (a counting function or encoding)."""

    __slots__ = ("_count", "_tokenizer")

    def __init__(self, tokenizer: str, count: Callable[[str], int]) -> None:
        self._tokenizer = tokenizer
        self._count = count

    @classmethod
    def from_encoding(cls, encoding: Encoder) -> ExactCounter:
        """Count with ``encoding.encode_ordinary``: special-token text in user content is
        counted as the ordinary text it is, never rejected or interpreted."""

        def count(text: str) -> int:
            return len(encoding.encode_ordinary(text))

        return cls(encoding.name, count)

    @property
    def tokenizer(self) -> str:
        return self._tokenizer

    @property
    def exact(self) -> bool:
        return True

    def count_text(self, text: str) -> int:
        return self._count(text)

    def __repr__(self) -> str:
        return f"ExactCounter({self._tokenizer!r})"


class HeuristicCounter:
    """The conservative byte-class heuristic as a :class:`TokenCounter`."""

    __slots__ = ()

    @property
    def tokenizer(self) -> str:
        return HEURISTIC_TOKENIZER

    @property
    def exact(self) -> bool:
        return False

    def count_text(self, text: str) -> int:
        return heuristic_count(text)

    def __repr__(self) -> str:
        return "HeuristicCounter()"


_HEURISTIC: Final = HeuristicCounter()


# =============================================================================================
# Attachments (ADR-0120)
# =============================================================================================


class AttachmentKind(StrEnum):
    IMAGE = "image"
    PDF = "pdf"
    TEXT_FILE = "text_file"


class AttachmentRef(BaseModel):
    """A file or image reference in an owner-written user message.

    ``label`` is the reference text the message carries (file name or marker); it is counted
    for every reference. Content is counted only when ``within_item_limits`` is true, because
    the adapter sends a marker instead of a file that fails the per-item limits. ``pages`` is
    required for (and only for) a PDF; ``inlined_bytes`` for (and only for) a text file.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: AttachmentKind
    label: str
    within_item_limits: bool
    pages: int | None = Field(default=None, ge=1)
    inlined_bytes: int | None = Field(default=None, ge=0)

    @model_validator(mode="after")
    def _fields_match_kind(self) -> AttachmentRef:
        if (self.pages is not None) != (self.kind is AttachmentKind.PDF):
            raise ValueError("pages is required for a pdf and not allowed otherwise")
        if (self.inlined_bytes is not None) != (self.kind is AttachmentKind.TEXT_FILE):
            raise ValueError("inlined_bytes is required for a text_file and not allowed otherwise")
        return self


def _attachment_content_tokens(ref: AttachmentRef, image_tokens: int) -> int:
    if not ref.within_item_limits:
        return 0
    if ref.kind is AttachmentKind.IMAGE:
        return image_tokens
    if ref.kind is AttachmentKind.PDF:
        assert ref.pages is not None  # guaranteed by the model validator
        return ref.pages * PDF_PAGE_TOKENS
    assert ref.inlined_bytes is not None
    return ref.inlined_bytes * TEXT_FILE_TOKENS_PER_BYTE


def image_tokens_for(registry_image_tokens: int | None) -> int:
    """Per-image figure for a model whose registry entry says ``registry_image_tokens``.

    The registry figure raises the flat ``IMAGE_TOKENS`` where a model counts more; it never
    lowers it (the flat figure is the upper bound the estimate promises for any provider)."""
    return max(IMAGE_TOKENS, registry_image_tokens or 0)


def estimate_attachment_tokens(
    refs: Iterable[AttachmentRef],
    count_label: Callable[[str], int],
    *,
    image_tokens: int = IMAGE_TOKENS,
) -> int:
    """Upper bound on what the adapter sends for ``refs`` when they are a request's only
    references.

    Every reference pays its label (``count_label``) plus ``ATTACHMENT_BLOCK_TOKENS``; the
    content of references within the per-item limits is summed and capped at
    ``ATTACHMENT_TOKEN_BUDGET``, the request-wide budget beyond which the adapter sends markers.
    A request with several messages shares that budget among them
    (``body_estimate.share_attachment_budget``).
    """
    refs = tuple(refs)  # read twice: labels, then content
    labels = sum(count_label(ref.label) + ATTACHMENT_BLOCK_TOKENS for ref in refs)
    return labels + min(attachment_content_tokens(refs, image_tokens), ATTACHMENT_TOKEN_BUDGET)


def attachment_content_tokens(refs: Iterable[AttachmentRef], image_tokens: int) -> int:
    """The content ``refs`` would send were no budget to bind: what those within the
    per-item limits cost (``image_tokens`` per image), labels not included."""
    return sum(_attachment_content_tokens(ref, image_tokens) for ref in refs)


# =============================================================================================
# Correction factor
# =============================================================================================


class Correction(BaseModel):
    """Per-model correction learned from actual usage.

    ``observed_ppm`` is the smoothed ratio actual / uncorrected estimate -- the drift, visible
    in both directions. ``factor_ppm`` is what estimates are multiplied by: ``observed_ppm``
    clamped to ``[MIN_FACTOR_PPM, MAX_FACTOR_PPM]``, so it can raise estimates but never lower
    them. ``observed_ppm`` defaults to ``factor_ppm`` when omitted.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    model_id: str = Field(min_length=1)
    factor_ppm: int = Field(ge=MIN_FACTOR_PPM, le=MAX_FACTOR_PPM)
    samples: int = Field(ge=0)
    observed_ppm: int = Field(ge=_MIN_SAMPLE_PPM, le=MAX_FACTOR_PPM)

    @model_validator(mode="before")
    @classmethod
    def _observed_defaults_to_factor(cls, data: Any) -> Any:
        if isinstance(data, Mapping) and "observed_ppm" not in data and "factor_ppm" in data:
            return {**data, "observed_ppm": data["factor_ppm"]}
        return data

    @classmethod
    def initial(cls, model_id: str) -> Correction:
        """The neutral correction: factor 1.0, no samples."""
        return cls(model_id=model_id, factor_ppm=PPM, samples=0, observed_ppm=PPM)


def apply_factor(raw: int, factor_ppm: int) -> int:
    """``ceil(raw * factor_ppm / 1_000_000)`` in integers."""
    return -(-raw * factor_ppm // PPM)


def _clamp(value: int, low: int, high: int) -> int:
    return max(low, min(high, value))


def reconcile(
    previous: Correction | None, model_id: str, estimated: int, actual: int
) -> Correction:
    """Fold one observed request into the model's correction and return the new correction.

    ``estimated`` is the estimate the request was built with -- under ``previous``'s factor when
    ``previous`` is for ``model_id``, under factor 1.0 otherwise -- and ``actual`` the input
    tokens the provider reported for the same span. The sample is the implied ratio
    actual / uncorrected estimate; the first sample is taken outright, later ones are averaged
    (running mean up to ``CORRECTION_WINDOW`` samples, then weight 1/``CORRECTION_WINDOW``),
    with every rounding going upward. A ``previous`` for another model is discarded: the
    factor resets when the model changes. A zero ``estimated`` or ``actual`` carries no ratio
    and returns the (possibly reset) correction unchanged.

    Raises:
        ValueError: ``estimated`` or ``actual`` is negative.
    """
    if estimated < 0 or actual < 0:
        raise ValueError(f"token counts must be >= 0 (estimated={estimated}, actual={actual})")
    base = (
        previous
        if previous is not None and previous.model_id == model_id
        else Correction.initial(model_id)
    )
    if estimated == 0 or actual == 0:
        return base
    implied = _clamp(-(-actual * base.factor_ppm // estimated), _MIN_SAMPLE_PPM, MAX_FACTOR_PPM)
    window = min(base.samples + 1, CORRECTION_WINDOW)
    observed = base.observed_ppm + -(-(implied - base.observed_ppm) // window)
    return Correction(
        model_id=model_id,
        factor_ppm=_clamp(observed, MIN_FACTOR_PPM, MAX_FACTOR_PPM),
        samples=base.samples + 1,
        observed_ppm=observed,
    )


def learned_sample(
    estimated: int, actual: int, prefix_tokens: int, exact_prefix: bool, factor_ppm: int = PPM
) -> tuple[int, int]:
    """The (estimated, actual) pair a report teaches reconcile, of a request whose estimate
    is its prefix's count and its estimated body.

    The factor scales the body alone, yet the ratio of the whole request, prefix and all,
    closes only a body's share of the body's error: at a true body ratio r, a 20,000-token
    prefix and 2,000-token bodies, it settled at 1 + (r - 1) / 11, and a larger body later
    was estimated short (an audit). With a prefix counted exactly, the pair is the body's
    alone where that implies the larger ratio, else the whole request's: a prefix the
    provider counts as fewer tokens than we do (a tool schema it reformats) would shrink
    the body's ratio, and the whole request's is then the conservative one. A prefix the
    heuristic counted keeps the whole request's: its error is the body's factor to absorb
    (docs/architecture.md), and taken from the body alone it inflated the small bodies'
    ratio further. A small body's is not learned in full: its ratio magnifies the whole
    request's excess by the request's size over the body's, and at most
    MAX_BODY_MAGNIFICATION times is learned (the pair then says so), as the provider's own
    margin over our prefix count reads as the body's. A ratio so capped that no drift
    explains (plausible_sample, under `factor_ppm`, the factor the request was estimated
    with) is not learned either, and the whole request's is instead (one report 11% over
    a request behind a 40x prefix set the factor to 4x outright: a review)."""
    if not exact_prefix or not 0 < prefix_tokens < min(estimated, actual):
        return estimated, actual
    body_estimated, body_actual = estimated - prefix_tokens, actual - prefix_tokens
    if body_actual * estimated <= actual * body_estimated:
        return estimated, actual
    # Capped first, then judged: judged first, a report 7% high taught 1.28 and one 9% high
    # 1.09, its raw body ratio past the bound (a review).
    if body_estimated * MAX_BODY_MAGNIFICATION < estimated:
        body_estimated, body_actual = (
            estimated,
            estimated + MAX_BODY_MAGNIFICATION * (actual - estimated),
        )
    if not plausible_sample(body_estimated, body_actual, factor_ppm):
        return estimated, actual
    return body_estimated, body_actual


def plausible_sample(estimated: int, actual: int, factor_ppm: int) -> bool:
    """Whether `actual` input tokens are a ratio a correction can learn from, for a request
    estimated at `estimated` under `factor_ppm`: its uncorrected estimate times a ratio
    within [0.1, 4]. Past either bound it is a bogus report or a mis-registered tokenizer,
    not drift (MAX_FACTOR_PPM): taken, one such report set a tenant's factor to 4x at once,
    its first sample outright, and every later session of the model was refused
    BUDGET_EXCEEDED; or to the floor, and real underestimates went unlearned (an audit)."""
    if estimated <= 0 or actual <= 0:
        return False
    ratio = actual * max(factor_ppm, 1) // estimated
    return _MIN_SAMPLE_PPM <= ratio <= MAX_FACTOR_PPM


def signed_error_ppm(estimated: int, actual: int) -> int:
    """Signed estimator error ``(estimated - actual) / actual`` in ppm; negative means an
    under-estimate. Rounds toward negative infinity, so an under-estimate never reads smaller.

    Raises:
        ValueError: ``actual`` is not positive or ``estimated`` is negative.
    """
    if actual <= 0 or estimated < 0:
        raise ValueError(f"need actual > 0 and estimated >= 0 (got {estimated}, {actual})")
    return (estimated - actual) * PPM // actual


# =============================================================================================
# The estimator port and its implementation
# =============================================================================================


class TokenEstimator(Protocol):
    """Per-model token estimates for the elastic body. Implementations must be pure."""

    def count_text(self, text: str, model_id: str) -> int:
        """Raw count under the model's tokenizer (or the heuristic), no correction."""
        ...

    def estimate_text(self, text: str, model_id: str) -> int:
        """``ceil(count_text * factor_ppm / 1e6)``."""
        ...

    def estimate_message(self, text: str, model_id: str) -> int:
        """``estimate_text`` plus ``MESSAGE_FRAMING_TOKENS``."""
        ...

    def estimate_attachments(self, refs: Sequence[AttachmentRef], model_id: str) -> int:
        """Labels for every reference plus capped content (ADR-0120)."""
        ...


class ModelTokenEstimator:
    """:class:`TokenEstimator` over a model registry, exact counters and corrections.

    ``counters`` maps tokenizer name to a counter built by the shell from a loaded encoding; a
    model whose tokenizer is absent from it uses the heuristic. ``corrections`` holds at most
    one correction per model id. Instances are immutable; ``with_correction`` returns a new one.
    """

    __slots__ = ("_corrections", "_counters", "_registry")

    def __init__(
        self,
        registry: ModelRegistry,
        counters: Mapping[str, TokenCounter] | None = None,
        corrections: Iterable[Correction] = (),
    ) -> None:
        self._registry = registry
        resolved = dict(counters or {})
        for name, counter in resolved.items():
            if counter.tokenizer != name:
                raise ValueError(f"counter for {name!r} implements {counter.tokenizer!r}")
        self._counters: Mapping[str, TokenCounter] = MappingProxyType(resolved)
        by_model: dict[str, Correction] = {}
        for correction in corrections:
            if correction.model_id in by_model:
                raise ValueError(f"two corrections for model {correction.model_id!r}")
            by_model[correction.model_id] = correction
        self._corrections: Mapping[str, Correction] = MappingProxyType(by_model)

    @property
    def registry(self) -> ModelRegistry:
        return self._registry

    def counter_for(self, model_id: str) -> TokenCounter:
        """The counter used for ``model_id``.

        Raises:
            UnknownModelError: the model is not registered.
        """
        tokenizer = self._registry.get(model_id).tokenizer
        return self._counters.get(tokenizer, _HEURISTIC)

    def is_exact(self, model_id: str) -> bool:
        return self.counter_for(model_id).exact

    def correction_for(self, model_id: str) -> Correction | None:
        return self._corrections.get(model_id)

    def factor_ppm(self, model_id: str) -> int:
        correction = self._corrections.get(model_id)
        return PPM if correction is None else correction.factor_ppm

    def with_correction(self, correction: Correction) -> ModelTokenEstimator:
        """A copy with ``correction`` replacing any correction for the same model."""
        others = [c for c in self._corrections.values() if c.model_id != correction.model_id]
        return ModelTokenEstimator(self._registry, self._counters, [*others, correction])

    def count_text(self, text: str, model_id: str) -> int:
        return self.counter_for(model_id).count_text(text)

    def estimate_text(self, text: str, model_id: str) -> int:
        return apply_factor(self.count_text(text, model_id), self.factor_ppm(model_id))

    def estimate_message(self, text: str, model_id: str) -> int:
        return self.estimate_text(text, model_id) + MESSAGE_FRAMING_TOKENS

    def estimate_messages(self, texts: Iterable[str], model_id: str) -> int:
        """Sum of ``estimate_message`` over ``texts`` (each rounded up on its own)."""
        return sum(self.estimate_message(text, model_id) for text in texts)

    def estimate_attachments(self, refs: Sequence[AttachmentRef], model_id: str) -> int:
        image_tokens = image_tokens_for(self._registry.get(model_id).image_tokens)
        return estimate_attachment_tokens(
            refs,
            lambda label: self.estimate_text(label, model_id),
            image_tokens=image_tokens,
        )

    def __repr__(self) -> str:
        return (
            f"ModelTokenEstimator({self._registry!r}, counters={sorted(self._counters)}, "
            f"corrections={sorted(self._corrections)})"
        )
