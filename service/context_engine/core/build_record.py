"""The build inputs a model.request.started event records, so GetBuild can rebuild the
same bytes (Build is pure: the plan epoch, the checkpoint version, the log below the run's
seed, the clock and the step context decide it).

Rule 1: the event records the clock as the UTC instant Build read (ISO 8601, microseconds)
and the step context field by field; the epoch and checkpoint version are recorded beside
them by the engine. The zone conversion is not recorded: it follows from the plan.
Rule 2: the step context serializes generically over its dataclass fields — a tuple of
items as their JSON dumps, anything else as its JSON value — so a field added to
StepContext is recorded without touching this module, as long as it is one of those.
Rule 3: reading a record that lacks its inputs (written before this module) is an error
the caller reports; it never guesses.
Rule 4: the people the step's recall and correction lines are about are recorded beside
the inputs (PEOPLE_KEY), where an erasure finds them; redacting a person removes their
lines from the recorded inputs and marks the record redacted (REDACTED_KEY), which GetBuild
then refuses to rebuild.
Rule 5: the cache-marker budget the payload was rendered with (the model registry's
max_cache_breakpoints then) is recorded beside the inputs (BUDGET_KEY), so a rebuild sends
the same markers after an overlay changes the model's budget. A record without it was
rendered under the provider's own limit.
Rule 6: the step's lines (its tuple fields, `SHOWN_FIELDS`: knowledge passages, recall and
correction lines) read back one at a time as well (`shown_items`), so compaction can hold
the model's answers and a summary to what the recorded Builds showed the model
(core/compaction.py, Rule 3) without reading each request whole.
Rule 7: the figures Build read from outside the log are recorded the same way: the
model's per-image figure (IMAGE_KEY, the registry's then) and the server's inline excerpt
threshold (INLINE_KEY, output.inline_maximum_bytes then), so an overlay or a setting
changed since does not change what a rebuild cuts.
Rule 8: the body assembler is versioned. ASSEMBLER_VERSION names the code that turns those
inputs into a request — assembly, the estimator, the yield ladder, the provider renderers —
and every record names it (ASSEMBLER_KEY) beside the SHA-256 of the provider payload sent
(PAYLOAD_KEY). Any change to that code that can change a request's bytes, a cut or a
payload for the same inputs bumps ASSEMBLER_VERSION, and says below what the older version
did differently where a rebuild can still do it (a render-only difference). A record
without the key was written by LEGACY_ASSEMBLER_VERSION: it was rendered without the
failed-result line (`failed_result_line`) and costed images at the flat IMAGE_TOKENS. A
record of context-assembler@2 or older read a child run's user messages as the user's
(`delegated_messages`).
@21 sends an OpenAI call id over 64 characters cut and digested (providers/call_ids.py):
a record of @20 or older holding one, which the API refused, does not rebuild; and its
heuristic prices each repeat in a punctuation run of four or more at what BPE spends on it
(core/estimator.py): a record of @20 counted by the heuristic whose text held such a run
is refused on its figures (Rule 9).
GetBuild serves a rebuild only when it matches the recorded request hash and, where
recorded, the payload hash; otherwise it refuses (REQUEST_NOT_FOUND, naming both
versions), never serving bytes the provider did not receive.
Rule 9: the same bytes can come with other figures: the token counter is not an input
(a `models_file` that changes a model's tokenizer, or a replica whose tiktoken rank file
is missing and falls back to the heuristic, counts the same request otherwise). Every
record names the tokenizer that counted it (TOKENIZER_KEY) beside the figures a
BuildResponse reports (`estimate_to_record`: the estimate, the input and body budgets,
tokens per class), and GetBuild serves a rebuild only when the tokenizer, where recorded,
and every recorded figure match (`estimate_differs`); otherwise it refuses as under Rule 8.
A record without the tokenizer (written before it was recorded) is checked on its figures.
"""

from __future__ import annotations

import typing
from collections.abc import Iterable
from dataclasses import fields, replace
from datetime import UTC, datetime
from typing import Any

from pydantic import BaseModel

from .assemble import Assembled, StepContext
from .cache_hints import BREAKPOINTS
from .errors import PreconditionError
from .estimator import IMAGE_TOKENS
from .items import ContextItem, ConversationItem, ToolResult, excerpted, trust_of
from .request import CacheBreakpoint, ModelRequest
from .trust import envelope_tag

__all__ = [
    "ASSEMBLER_KEY",
    "ASSEMBLER_VERSION",
    "ATTACHMENT_TOKENS_KEY",
    "BUDGET_KEY",
    "IMAGE_KEY",
    "INLINE_KEY",
    "INPUTS_KEY",
    "LEGACY_ASSEMBLER_VERSION",
    "PAYLOAD_KEY",
    "PEOPLE_KEY",
    "REDACTED_KEY",
    "SHOWN_FIELDS",
    "TOKENIZER_KEY",
    "assembler_of",
    "attachment_tokens",
    "bridge_markers",
    "cited_passages",
    "delegated_messages",
    "entry_skill_trust",
    "estimate_differs",
    "estimate_to_record",
    "failed_result_line",
    "fixed_texts",
    "image_tokens_of",
    "inputs_from_record",
    "inputs_to_record",
    "marked_excerpts",
    "marker_sequences",
    "markers_by_id",
    "named_writers",
    "recalled_people",
    "redact_record",
    "shown_items",
    "text_call_ids",
    "unbridged",
    "uncited_passages",
    "unmarked_excerpts",
    "whole_request_hash",
]

# Rule 8: bump on any change to what Build sends for the same recorded inputs (assembly,
# the estimator, the yield ladder, the renderers), and say what the older version did.
# @2: failed tool results carry providers/texts.py TOOL_ERROR_AS_TEXT (OpenAI; Anthropic
# without tools); the estimator charges whitespace runs and control characters; images
# cost the registry's figure; the run's results are capped before a rung yields;
# recall's floor is paid with the never-yield set; a working-state task line names its
# writer first and quotes its id.
# @3: a child run's user messages (its instruction) are its parent agent's words
# (core/seeding.py, Rule 4): MODEL trust in a <delegated> envelope, where @2 rendered them
# as the user's, USER in a <user> envelope, and costed them so (a rebuild reads them as @2
# did: `delegated_messages`). "<delegated" is escaped as a delimiter in all content, which
# @2 left as it was: a record whose content held one does not rebuild (REQUEST_NOT_FOUND).
# @4: the tool-result cap pass re-reads the cut after each run result it truncates and
# takes the carried results that brings into the request first (core/yield_ladder.py
# _cap_results_in_request); @3 went over the results in the request at the pass's start
# only, so it could stop over the cap with such a result whole. Only those cuts differ:
# such a record does not rebuild (REQUEST_NOT_FOUND); every other @3 record rebuilds.
# @5: recall over its cap is trimmed to it before knowledge yields (core/yield_ladder.py
# _cap_recall), where @4 measured recall whole when knowledge dropped, so a passage could
# drop for tokens the recall cap freed anyway; and the pointer of a carried result that was
# excerpted (over the inline limit) names the result's own byte count, where @4 named the
# excerpt's (core/carried.py). Such records do not rebuild (REQUEST_NOT_FOUND); every other
# @4 record does.
# @6: what the earlier rungs gave up comes back where the unit that made the body fit, or
# a run result the cap pass truncated, freed room for it (core/yield_ladder.py _take_back):
# @5 kept a passage dropped (or a recall line trimmed) even when a recall line or a result
# truncated after it freed more than was still over. Such records do not rebuild
# (REQUEST_NOT_FOUND); every other @5 record does.
# @7: a request's attachment content counts up to ATTACHMENT_TOKEN_BUDGET in all, shared
# among its messages newest first (core/body_estimate.py Rule 4), as the adapter sends
# it; @6 capped each message's content at the budget on its own, so a request with
# several messages carrying attachments was estimated above what is sent, and history
# that fitted was cut. A record whose request, or the carried history within its window,
# held messages whose attachment contents, each capped at the budget, add up to more than
# the budget can rebuild with another estimate or another cut: it then does not rebuild
# (REQUEST_NOT_FOUND); every other @6 record does. One that rebuilds after its ladder
# yielded may report another pressure.body_tokens_before (the history past the cut is
# costed with the budget shared). And request_sha256 hashes the request with its
# messages, system blocks and tools given by their own SHA-256 (core/request.py Rule 1),
# where @6 and older hashed the canonical request whole: GetBuild checks an older record
# by the hash it recorded (`whole_request_hash`) and answers with that hash.
# @8: a history cache marker names its item's session sequence too
# (CacheBreakpoint.through_sequence, core/cache_hints.py Rule 7), the Anthropic renderer
# closes the block of that id and sequence, and the run marker is sent whenever it closes
# another item than the carried marker; @7 and older named the id alone (a render closed
# the first block of the id: where earlier runs reused it, an earlier run's item) and
# left the run marker out when it named the carried marker's id. A rebuild of an older
# record makes its markers so (`marker_sequences`, `markers_by_id`) and renders as it did.
# And the cap pass pins the history cut it read (core/yield_ladder.py Body.pinned_cut):
# what the earlier rungs gave up comes back into the room of the request that cut makes,
# where a carried result the pass truncated freed tokens too, recall lines first; @7 let
# it back only where the cut did not move with the carried results counted whole, so a
# passage dropped for tokens the pass freed anyway, and a passage could come back where a
# recall line before it could not. Such records (the cap pass ran and something given up
# comes back otherwise) do not rebuild (REQUEST_NOT_FOUND); every other @7 record does.
# @9: a tool result sent as the tool pipeline's excerpt (ToolResult.context_content, not
# its content) renders in an envelope marked truncated, as the engine's own excerpts and
# pointers are (the spec: truncation keeps the envelope and marks it truncated); @8 and
# older sent the excerpt unmarked. A rebuild of an older record reads each such result as
# its excerpt alone (`unmarked_excerpts`), which renders as it did; where its full size
# bore on the request (capped to a pointer, which names the content's byte count, or the
# ladder's savings, which count it), the rebuild differs and the record does not rebuild
# (REQUEST_NOT_FOUND).
# @10: the estimator's heuristic (models without an exact tokenizer: Anthropic's) prices a
# junk word -- an id, base64, hex -- by its letters, digits and changes of letter case or
# class (core/estimator.py _add_junk_word); @9 priced one per character and per
# lower-to-upper or digit change, which put random base64 up to six tokens a word under
# cl100k_base before the text's edge constant (two ids on two lines: a token under in
# all): the estimate, meant as an upper bound, was not one. Only the heuristic's figures
# move: a record it counted whose text held such words is refused on its figures (Rule 9,
# REQUEST_NOT_FOUND naming both versions); records counted exactly (OpenAI models) and
# every other @9 record rebuild.
# @11: Anthropic's no-tools text form (providers/anthropic.py, Rule 8) names each pair's
# wire call id: a call as TOOL_CALL_AS_TEXT, a result after a TOOL_RESULT_AS_TEXT line (so
# a result with no content sends that line where @10 sent nothing), so parallel calls of
# one tool pair with their results; @10 and older named none. A render-only difference: a
# rebuild of an older record renders the text form as it did (`text_call_ids`). Only
# requests without tools differ. The estimate is unchanged: it counts a pair's call id and
# tool name as it does for blocks, not the lines' fixed words (about 6 heuristic tokens a
# call, 8 a result), as it does not count a block's JSON keys.
# @12: the working-state block (core/working_state.py, Rule 5) names each fact's writer
# ("- [model #9] Established (events #3): ...") and says a question the runtime added is
# the model's ("- [runtime #6] the model asked: ..."); @11 and
# older named neither, so a fact the model concluded read as the platform's assertion. A
# render-only difference: a rebuild of an older record renders the block as it did
# (`named_writers`). And escaping (core/envelope.py, Rule 2) reads more delimiters as a
# model does: spelled with the tags' letters of other scripts or small capitals, accents
# or overlays, a braille blank, or slashes and backslashes before the tag; @11 sent those
# as they were, so a record whose body held one does not rebuild (REQUEST_NOT_FOUND), as
# @3's did for "<delegated". Plans keep the bytes they were made with (the builder version
# is unchanged: rotating every session's plan to re-escape content that holds none of these
# would cost every session its cache), so one made before escapes as it did until it
# rotates. And a carried result the ladder truncated before the cut settled past it (an
# orphan a summary floor split from its call) is left out of the request; @11 wrote its
# pointer over the newest kept item, or refused the Build (core/pressure.py), so such a
# record does not rebuild.
# @13: the estimate counts the texts a renderer adds of its own (core/body_estimate.py
# Rule 6): a failed tool result's TOOL_ERROR_AS_TEXT line, which OpenAI's output and
# Anthropic's no-tools text form send (about 6 tokens a failed result: a history of many
# short failures came out over its window, 6% above its estimate); in Anthropic's text
# form, the words around each call and result; a tool block's wire name rather than the
# tool's own; and once per request the reply priming and the placeholder turn, which come
# off the body (core/budget.py Rule 7). An estimate-only difference: the bytes are @12's.
# A rebuild of an older record counts as it was counted (`fixed_texts`), so its figures
# match and it rebuilds (tests/unit/test_fixed_texts.py pins @12's own figures). And the
# pressure report no longer lists the truncation of a carried result the request left out
# (@12's orphan fix, core/yield_ladder.py `_Yielded.before_cut`); the report is not among
# a record's figures, so a rebuild of such a record reports it the new way.
# @14: the working-state block hides the model's and the runtime's open questions before
# the user's (core/working_state.py Rule 3; before, the stalest whoever wrote it), and
# finds how many entries to hide by bisection rather than one at a time (render_block),
# which can hide otherwise where hiding a one-character entry lengthens the note. A block
# that hides some of a mixed list renders other bytes, and GetBuild refuses such a @13
# record as not rebuilt (the older order is not kept: a block hides entries only over its
# 1,000 tokens). The estimate is @13's.
# @15: a request whose latest model turn spans more than core/cache_hints.py's
# LOOKBACK_ITEMS items carries a `bridge` history marker where the previous step's run
# marker was, in after_tools' place (Rule 8 there): such a step past the provider's
# lookback read nothing of the run and wrote it all again. A marker-only difference: a
# rebuild of an older record drops the bridge and restores after_tools (`unbridged`).
# @16: a bare knowledge passage (TRUSTED_CONFIGURATION) leads with its citation,
# `[citation] text`; it was sent as its text alone, which the model could not cite. A
# rebuild of an older record leaves bare passages' citations out (`uncited_passages`).
# @17: escaping reads more as a delimiter (core/envelope.py): a tag followed by a letter-like
# character of another script (a look-alike colon), the Hangul fillers as spaces, more
# look-alike angle brackets, slashes and backslashes; attribute values escape line breaks;
# and content rendered bare at TRUSTED_CONFIGURATION (a tool result, a skill body, a
# passage) is escaped as an envelope's content is: content holding none of these renders
# as before, and GetBuild refuses an older record whose content held one (it is not
# rebuilt). And a loaded skill's body renders at its pinned entry's trust in the plan
# built on where a Rotate lowered it or took it out (core/skills.py, Rule 6): an older
# record is rebuilt at each body's load trust (`entry_skill_trust`).
# @18: Anthropic gets a displaced tool pair (its result landed after another run's turn:
# two overlapping runs) in the no-tools text form where it lies (providers/anthropic.py,
# Rule 9); as blocks the API refused every such request. A request without one renders as
# before; GetBuild refuses an older record that carried one (it is not rebuilt: the
# provider refused what was sent). And an Anthropic tool result whose content is whitespace
# alone (a bare TRUSTED_CONFIGURATION result) omits `content`, as an empty one did: the
# API refuses whitespace-only text; GetBuild refuses an older record that sent one.
# @19: OpenAI gets no reasoning item that the output it was produced with does not follow
# at once (providers/openai.py, Rule 4): a turn whose only output was reasoning failed every
# later request of its run. And escaping reads a delimiter through control characters (C0
# but tab and line breaks, DEL, C1: core/envelope.py), as through invisible ones. A request
# with neither renders as before; GetBuild refuses an older record that held one (it is not
# rebuilt: the provider refused the first, and the second was sent unescaped).
# @20: the tool-result class's cap counts the active turn's results, which never yield,
# so older results yield to pointers to hold the class within it (the others alone were
# measured: a request carried 12,070 tokens of results against a 9,883-token cap); and
# history's floor counts the history already paid, the summary and the run's own
# exchanges, so carried history is protected only for the rest of the 8,000 tokens (a run
# with 10,000 tokens of its own dropped every knowledge passage, or asked for compaction,
# to keep 8,000 more of carried history). core/yield_ladder.py Rule 5. A request under no
# such pressure is cut as before; GetBuild refuses an older record that was cut otherwise
# (it is not rebuilt: the older rules are not kept).
# @22: an envelope's attribute escapes the quotation marks that read as '"' (curly, low,
# double primes, gershayim, the ditto mark: core/envelope.py Rule 3), which a source or
# citation could use to show a forged nonce in the header. A request with none renders as
# before; GetBuild refuses an older record that held one (it is not rebuilt).
# @23: Anthropic gets no thinking block that ends its assistant message (providers/
# anthropic.py, Rule 5): the API refuses such a turn, so a model turn whose only output was
# thinking (or thinking and blank text) failed every later request of its run. A request
# without one renders as before; GetBuild refuses an older record that held one (it is not
# rebuilt: the provider refused what was sent).
# @24: OpenAI pairs a replayed reasoning item with the item after it by that item's id:
# items carry their provider item ids (AssistantMessage and ToolCall provider_item_id),
# the function calls and assistant text after a reasoning item sent carry them (the text
# in the API's output form), and a reasoning item whose following item was logged without
# one is not sent (providers/openai.py, Rule 4): public reports show the API refusing it,
# so every later request of an OpenAI reasoning model's tool loop failed. Ids are counted
# in the estimate. A request without OpenAI reasoning renders as before; GetBuild refuses
# an older record that sent reasoning (it is not rebuilt: its items held no ids).
# @25: the tool-result cap truncates in quanta (core/yield_ladder.py, Rule 6): the run's
# results four at a time, earlier runs' up to a multiple of eight session sequences, and
# every earlier run's result in the request once the run's cap took one of its own; one
# more at every step of a tool loop changed the history under the previous request's
# cache markers at every step once the run was over its cap. What the quanta free past the
# cap's need is paid as if those results were whole (Body.held_back), so the history cut
# and the fit decide as minimal truncation would. A request under no cap is
# cut as before; GetBuild refuses an older record that was cut otherwise (it is not
# rebuilt: the older rule is not kept).
# @26: a model turn that sent reasoning alone (thinking cut off at max_tokens, an empty
# end_turn) is not the latest turn whose reasoning is replayed: the turn before it that sent
# output keeps its reasoning (core/assemble.py _latest_turn_reasoning_only). Taken as the
# latest, it dropped the tool loop's thinking, and Anthropic with thinking on refused every
# later request of the run (a call must follow its thinking). The latest turn keeps its own
# reasoning as before, the turns between keep none, and the tool loop's turn stays the
# active one (never yielding, never compacted). A request without such a turn renders as
# before; GetBuild refuses an older record that held one (it is not rebuilt).
# @27: under a plan secret made by context-builder@5 and later, a nonce is 20 decimal
# digits (core/envelope.py, Rule 1), whose token count is the same under every secret, so a
# history cut or a fit no longer moves with the secret. A Build on an older plan, and every
# older record, renders its hex nonces as before (its secret carries no tag). And an
# attachment's label is scaled by the pinned factor as other text is (core/body_estimate.py
# Rule 3): GetBuild refuses an older record whose labels were counted at a factor above 1
# (its figures differ). And what the tool-result cap's quanta hold back is spent before
# anything yields for the fit (core/yield_ladder.py _release_holds): a body that fitted as
# sent dropped a passage, truncated a newer result or asked for a compaction. GetBuild
# refuses an older record cut otherwise (it is not rebuilt).
# @28: a PDF or text file whose content alone is over the request's attachment budget
# (core/body_estimate.py Rule 3), always sent as its marker, costs its label alone: it was
# charged the whole budget, which older messages' attachments then had none of, and a
# 21-page PDF failed every Build of a window under about 80,000 tokens (an audit). GetBuild
# refuses an older record that held one (its figures differ; it is not rebuilt).
# @29: correction lines share in-turn recall's 2,000-token cap (core/pressure.py Rule 6):
# recall holds what they leave, and lines over it are INVALID_FIELD; they were uncapped (an
# audit: 100 lines of 285 tokens were sent, recall trimmed beside them to its own cap), and
# their class reports that cap. GetBuild refuses an older record whose recall they now
# trim (it is not rebuilt).
ASSEMBLER_VERSION = "context-assembler@29"
LEGACY_ASSEMBLER_VERSION = "context-assembler@1"  # a record without ASSEMBLER_KEY
# The versions that read a child run's user messages as the user's.
_UNDELEGATED = frozenset({LEGACY_ASSEMBLER_VERSION, "context-assembler@2"})
# The versions whose request_sha256 is the canonical request hashed whole.
_WHOLE_HASH = frozenset(
    {LEGACY_ASSEMBLER_VERSION, *(f"context-assembler@{n}" for n in range(2, 7))}
)
# The versions that sent a tool-pipeline excerpt unmarked.
_UNMARKED = frozenset({LEGACY_ASSEMBLER_VERSION, *(f"context-assembler@{n}" for n in range(2, 9))})
# The versions whose no-tools text form names no call ids.
_UNNAMED_CALLS = frozenset(
    {LEGACY_ASSEMBLER_VERSION, *(f"context-assembler@{n}" for n in range(2, 11))}
)
# The versions whose working-state block names no fact's writer.
_UNNAMED_WRITERS = _UNNAMED_CALLS | {"context-assembler@11"}
# The versions whose estimate counted no renderer's fixed text.
_UNCOUNTED_TEXTS = _UNNAMED_WRITERS | {"context-assembler@12"}
_SPEC_OF = {b.name: b for b in BREAKPOINTS}
# The versions that sent no bridge marker (every one before @15).
_UNBRIDGED = _UNCOUNTED_TEXTS | {"context-assembler@13", "context-assembler@14"}
# The versions that sent a bare (TRUSTED_CONFIGURATION) knowledge passage without its
# citation (every one before @16).
_UNCITED = _UNBRIDGED | {"context-assembler@15"}  # @16 cited, as @17 does
# The versions that rendered a loaded skill's body at its load's trust alone.
_LOAD_TRUST = _UNCITED | {"context-assembler@16"}
# The versions whose cache markers name an item by its id alone.
_BY_ID = _WHOLE_HASH | {"context-assembler@7"}
ASSEMBLER_KEY = "assembler_version"
PAYLOAD_KEY = "payload_sha256"
IMAGE_KEY = "image_tokens"
INLINE_KEY = "inline_maximum_bytes"
BUDGET_KEY = "max_cache_breakpoints"
INPUTS_KEY = "build_inputs"
PEOPLE_KEY = "people"
REDACTED_KEY = "redacted"
TOKENIZER_KEY = "tokenizer"
ATTACHMENT_TOKENS_KEY = "attachment_tokens"
_LINES = ("recall", "corrections")  # the step fields whose lines name people


def _line_fields() -> dict[str, type[ContextItem]]:
    """Rule 6: the step fields that are tuples of items, with their item type."""
    hints = typing.get_type_hints(StepContext)
    found: dict[str, type[ContextItem]] = {}
    for f in fields(StepContext):
        item_type = (typing.get_args(hints[f.name]) or (None,))[0]
        if isinstance(item_type, type) and issubclass(item_type, ContextItem):
            found[f.name] = item_type
    return found


_SHOWN = _line_fields()
SHOWN_FIELDS = tuple(_SHOWN)


def inputs_to_record(now: datetime, step: StepContext) -> dict[str, Any]:
    """The `build_inputs` entry of a model.request.started payload (Rules 1, 2)."""
    step_json: dict[str, Any] = {}
    for name in _STEP_FIELDS:
        value = getattr(step, name)
        if isinstance(value, tuple):
            step_json[name] = [v.model_dump(mode="json") for v in value]
        else:
            step_json[name] = value
    return {"now": now.astimezone(UTC).isoformat(), "step": step_json}


_STEP_FIELDS = tuple(f.name for f in fields(StepContext))  # in declaration order, as recorded


def inputs_from_record(payload: dict[str, Any]) -> tuple[datetime, StepContext]:
    """(now, step) from a model.request.started payload.

    Raises:
        PreconditionError: REQUEST_NOT_FOUND when the event recorded no build inputs.
    """
    record = payload.get(INPUTS_KEY)
    if not isinstance(record, dict):
        raise PreconditionError(
            "this request was recorded without its build inputs and cannot be rebuilt",
            field="request_sequence",
            reason="REQUEST_NOT_FOUND",
        )
    hints = typing.get_type_hints(StepContext)
    values: dict[str, Any] = {}
    where = "now"
    try:
        now = datetime.fromisoformat(record["now"])
        if now.tzinfo is None:
            raise ValueError("a naive time")
        for name, value in record.get("step", {}).items():
            where = f"step.{name}"
            hint = hints.get(name)
            if hint is None:
                continue  # a field this build no longer has
            if isinstance(value, list):
                item_type = typing.get_args(hint)[0]
                if not (isinstance(item_type, type) and issubclass(item_type, BaseModel)):
                    raise ValueError("not a list of items")
                values[name] = tuple(item_type.model_validate(v) for v in value)
            else:
                values[name] = value
        where = "step"
        step = StepContext(**values)
    except (KeyError, TypeError, ValueError) as exc:  # pydantic's ValidationError included
        # A record this build cannot read (a field a rolled-back model forbids, say) was
        # INTERNAL (an audit); it is a record GetBuild cannot rebuild, named by where.
        raise PreconditionError(
            f"{where} of its recorded build inputs cannot be read back by this build"
            f" ({type(exc).__name__})",
            field="request_sequence",
            reason="REQUEST_NOT_FOUND",
        ) from None
    return now, step


def shown_items(lines: Iterable[tuple[str, dict[str, Any]]]) -> tuple[ContextItem, ...]:
    """Rule 6: the items of recorded step lines, each given as (step field, its JSON) as
    `inputs_to_record` wrote it; a field this build no longer has is skipped."""
    return tuple(_SHOWN[name].model_validate(line) for name, line in lines if name in _SHOWN)


def assembler_of(payload: dict[str, Any]) -> str:
    """Rule 8: the assembler version that built a recorded request."""
    version = payload.get(ASSEMBLER_KEY)
    return version if isinstance(version, str) else LEGACY_ASSEMBLER_VERSION


def failed_result_line(payload: dict[str, Any]) -> bool:
    """Rule 8: whether the request's failed tool results were sent after the
    TOOL_ERROR_AS_TEXT line. @1 sent them without it (a render-only difference)."""
    return assembler_of(payload) != LEGACY_ASSEMBLER_VERSION


def delegated_messages(payload: dict[str, Any]) -> bool:
    """Rule 8: whether the request read a child run's user messages as its parent's
    (DelegatedMessage). @2 and @1 read them as the user's; a rebuild reads them so."""
    return assembler_of(payload) not in _UNDELEGATED


def whole_request_hash(payload: dict[str, Any]) -> bool:
    """Rule 8: whether the record's request_sha256 is the canonical request hashed whole
    (ModelRequest.canonical_sha256, @6 and older) rather than in parts
    (ModelRequest.request_sha256)."""
    return assembler_of(payload) in _WHOLE_HASH


def marker_sequences(payload: dict[str, Any]) -> bool:
    """Rule 8: whether the request's history cache markers named their items' sequences
    (@8 on); an older record is rebuilt with its markers made by `markers_by_id`."""
    return assembler_of(payload) not in _BY_ID


def bridge_markers(payload: dict[str, Any]) -> bool:
    """Rule 8: whether the request could carry a bridge marker (@15 on); an older record
    is rebuilt with its markers made by `unbridged`."""
    return assembler_of(payload) not in _UNBRIDGED


def cited_passages(payload: dict[str, Any]) -> bool:
    """Rule 8: whether a bare knowledge passage led with its citation (@16 on); an older
    record is rebuilt from `uncited_passages` of its step."""
    return assembler_of(payload) not in _UNCITED


def uncited_passages(step: StepContext) -> StepContext:
    """`step` with each bare knowledge passage's citation left out, so it renders as its
    text alone, as context-assembler@15 and older sent it (an enveloped passage's citation
    is its envelope's source, unchanged)."""
    if not any(envelope_tag(trust_of(k)) is None and k.citation for k in step.knowledge):
        return step
    return replace(
        step,
        knowledge=tuple(
            k.model_copy(update={"citation": ""}) if envelope_tag(trust_of(k)) is None else k
            for k in step.knowledge
        ),
    )


def entry_skill_trust(payload: dict[str, Any]) -> bool:
    """Rule 8: whether a loaded skill's body took its pinned entry's trust where a Rotate
    lowered it (@17 on); an older record is rebuilt at each body's load trust."""
    return assembler_of(payload) not in _LOAD_TRUST


def unbridged(request: ModelRequest) -> ModelRequest:
    """`request` with its cache markers as context-assembler@14 and older made them: no
    bridge marker, and after_tools (which the bridge took the place of) with
    after_system's TTL."""
    markers = request.cache_breakpoints
    if not any(bp.name == "bridge" for bp in markers):
        return request
    kept = [bp for bp in markers if bp.name != "bridge"]
    system = next((bp for bp in kept if bp.name == "after_system"), None)
    if system is not None and not any(bp.name == "after_tools" for bp in kept):
        tools = _SPEC_OF["after_tools"]
        kept.append(
            CacheBreakpoint(
                "after_tools",
                through_item=tools.through_item,
                ttl=system.ttl,
                priority=tools.priority,
            )
        )
    kept.sort(key=lambda bp: bp.priority)
    return replace(request, cache_breakpoints=tuple(kept))


def marked_excerpts(payload: dict[str, Any]) -> bool:
    """Rule 8: whether the request marked tool-pipeline excerpts truncated (@9 on); an
    older record is rebuilt from `unmarked_excerpts` of its items."""
    return assembler_of(payload) not in _UNMARKED


def text_call_ids(payload: dict[str, Any]) -> bool:
    """Rule 8: whether the request's tool pairs sent as text (Anthropic without tools)
    named their call ids (@11 on); an older record renders them as it did."""
    return assembler_of(payload) not in _UNNAMED_CALLS


def named_writers(payload: dict[str, Any]) -> bool:
    """Rule 8: whether the request's working-state block named each fact's writer and a
    runtime question's asker (@12 on); an older record renders it as it did."""
    return assembler_of(payload) not in _UNNAMED_WRITERS


def fixed_texts(payload: dict[str, Any]) -> bool:
    """Rule 9: whether the request's estimate counted the renderers' fixed texts (@13 on:
    core/body_estimate.py Rule 6); an older record is rebuilt counting as it did, so its
    figures match."""
    return assembler_of(payload) not in _UNCOUNTED_TEXTS


def unmarked_excerpts(items: tuple[ConversationItem, ...]) -> tuple[ConversationItem, ...]:
    """`items` with each tool result sent as its excerpt read as that excerpt alone (no
    context_content), so it renders unmarked, as context-assembler@8 and older sent it."""
    if not any(isinstance(i, ToolResult) and excerpted(i) for i in items):
        return items
    return tuple(
        i.model_copy(update={"content": i.context_content, "context_content": ""})
        if isinstance(i, ToolResult) and excerpted(i)
        else i
        for i in items
    )


def markers_by_id(request: ModelRequest) -> ModelRequest:
    """`request` with its cache markers as context-assembler@7 and older made them: each
    naming its item by id alone (a render then closes the first block of the id), and no
    run marker naming the carried marker's id (core/cache_hints.py kept one marker then)."""
    markers: list[CacheBreakpoint] = []
    carried = ""
    for bp in request.cache_breakpoints:
        if bp.name == "carried_history":
            carried = bp.through_item
        elif bp.name == "run" and bp.through_item == carried:
            continue
        markers.append(replace(bp, through_sequence=0))
    return replace(request, cache_breakpoints=tuple(markers))


def image_tokens_of(payload: dict[str, Any]) -> int:
    """Rule 7: the per-image figure the request was costed with; @1 used the flat one."""
    figure = payload.get(IMAGE_KEY)
    return figure if isinstance(figure, int) else IMAGE_TOKENS


def estimate_to_record(assembled: Assembled) -> dict[str, Any]:
    """Rule 9: the figures a BuildResponse reports beside the bytes, as the record holds
    them (the tokens per class feed inspect's budget bars too)."""
    return {
        "estimated_input_tokens": assembled.estimated_input_tokens,
        "body_estimated_tokens": assembled.body_estimated_tokens,
        "input_budget_tokens": assembled.input_budget_tokens,
        "class_tokens": [
            {"class_name": c.class_name, "tokens": c.tokens} for c in assembled.budget
        ],
    }


def attachment_tokens(assembled: Assembled) -> int:
    """The attachment content the estimate counted at fixed figures (each message's share
    of the request's attachment budget), which no correction factor scales: recorded as
    ATTACHMENT_TOKENS_KEY, and ReportUsage learns nothing from a request that sent any
    (api/usage.py). Derived from the bytes, like the placements: not a Rule 9 figure."""
    return sum(m.share_tokens for m in assembled.attachments)


def estimate_differs(payload: dict[str, Any], rebuilt: Assembled, tokenizer: str) -> str | None:
    """Rule 9: why a rebuild with the recorded bytes is still not the request recorded
    (None when it is): counted by another tokenizer than the one `payload` names (where it
    names one), or a recorded figure that `rebuilt` does not reproduce."""
    counted = payload.get(TOKENIZER_KEY)
    if isinstance(counted, str) and counted != tokenizer:
        return (
            f"it was counted with tokenizer {counted} and this server counts the model with"
            f" {tokenizer} (a models_file change, or a tiktoken rank file missing here)"
        )
    for key, value in estimate_to_record(rebuilt).items():
        if key in payload and payload[key] != value:
            return f"its recorded {key} differs from the rebuild's (another token counter)"
    return None


def recalled_people(step: StepContext) -> list[str]:
    """Rule 4: everyone the step's recall and correction lines name, sorted, once each."""
    recalled = {p for line in step.recall for p in line.person_ids}
    return sorted(recalled.union(*(line.person_ids for line in step.corrections)))


def redact_record(payload: dict[str, Any], person_id: str) -> tuple[dict[str, Any], int]:
    """Rule 4: (the payload without the person's lines and out of its people index, how
    many lines were removed). A record that lost a line is marked redacted.

    A line naming two people is removed by the first one's erasure, and the record stays
    indexed under the other, who was sent in it too: their erasure finds it, reports it
    and takes them out of the index, with no line left to remove. Kept in the index for
    good, they were found, rewritten and counted at every erasure of theirs (an audit);
    taken out with the line, their erasure never learned the run that sent their memory (a
    review)."""
    people = [p for p in payload.get(PEOPLE_KEY, []) if p != person_id]
    step = dict(payload.get(INPUTS_KEY, {}).get("step", {}))
    removed = 0
    for name in _LINES:
        lines = step.get(name, [])
        kept = [line for line in lines if person_id not in line.get("person_ids", [])]
        removed += len(lines) - len(kept)
        step[name] = kept
    if not removed:
        return {**payload, PEOPLE_KEY: people}, 0
    inputs = {**payload[INPUTS_KEY], "step": step}
    return {**payload, INPUTS_KEY: inputs, PEOPLE_KEY: people, REDACTED_KEY: True}, removed
