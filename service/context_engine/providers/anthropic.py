"""Neutral ModelRequest -> Anthropic Messages API request body (``POST /v1/messages``).

Rule 1 (order): the body holds ``tools``, ``system`` and ``messages``; Anthropic processes
and caches them in that order, so prompt units (for explain) follow it too.
Rule 2 (bytes): the body is RFC 8785 JSON (sorted keys, no whitespace, UTF-8): the same
request renders the same bytes in every process. Tool schemas and call arguments are
re-parsed from their canonical JSON; reasoning blocks from their opaque JSON.
Rule 3 (text): text is copied verbatim, envelopes included. A whitespace-only text block is
not sent (the API rejects it); a tool result with empty or whitespace-only content (a bare
result at TRUSTED_CONFIGURATION: a command's blank output) omits ``content`` (since
context-assembler@18; before, only an empty one did).
Rule 4 (turns): consecutive same-role messages merge into one turn; in a user turn the
``tool_result`` blocks lead (the API requires results first); a conversation that starts
with the assistant (a history cut that kept an assistant turn first) is preceded by the
fixed user turn ``HISTORY_CUT_PLACEHOLDER``, the same on every request.
Rule 5 (reasoning): a reasoning block from Anthropic (``thinking``/``redacted_thinking``)
is replayed verbatim from its opaque JSON, never rendered into text; one from another
provider cannot be replayed here and is not sent. A payload of any other type is refused
(EngineError): it would replay as content the hashed request does not show. Nor is one
that would end its assistant message (nothing it produced follows it there: the API
refuses a turn whose final block is thinking; context-assembler@23).
Rule 6 (markers): request.cache_breakpoints become ``cache_control`` on the block each
closes — after_tools on the last tool, after_system on the last system block, a history
marker on its through_item's block (or the nearest sendable block before it; the first
block of that id and, where the marker names one, of its through_sequence: an id alone can
name an item of each run, core/cache_hints.py Rule 7). At most
the model's budget (the registry's ``max_cache_breakpoints``, never above the API's
``MAX_BREAKPOINTS``), taken in priority order, so the run marker drops first; two markers on
one block are one. In processing order no one-hour marker follows a shorter one: a later
marker's TTL is lowered to the shortest before it. ``"5m"`` is sent as the API default
(no ``ttl`` key).
Rule 7 (call ids): ``tool_use.id`` and ``tool_result.tool_use_id`` are the pair's wire call
id (providers/call_ids.py): the call id mapped into ``[A-Za-z0-9_-]``, unique in the
request, the earliest pair keeping its id.
Rule 8 (no tools): the API rejects tool_use and tool_result blocks in a request that
defines no tools (a rotation to an empty roster keeps the history's pairs), so then a call
is sent as assistant text (``TOOL_CALL_AS_TEXT``: its tool name, canonical arguments and
wire call id) and a result as user text: ``TOOL_RESULT_AS_TEXT`` naming the call's wire id
on the first line (so parallel calls of one tool pair with their results as they do in
blocks), then ``TOOL_ERROR_AS_TEXT`` (core/fixed_texts.py) on its own line when the call
failed (``is_error`` has no other place to go; OpenAI's output says it the same way), then
its content exactly as core enveloped it (Rule 3). The wire ids are Rule 7's. A request
renders all its pairs one way, so every request of an epoch does too. Until
context-assembler@11 the text named no call id (``UNNAMED_CALL_AS_TEXT``, no result line):
``render(..., text_call_ids=False)`` renders a record of @10 or older so.

Rule 9 (displaced pairs): the API takes a tool_use's tool_result in the very next user
turn. A carried pair whose result landed after another run's turn (two overlapping runs:
run 1 calls a tool and waits, run 2 answers the user, then run 1's result arrives) is
logged, and carried, with that turn between its halves; as blocks, every later request of
the session was a 400. Such a pair is sent in Rule 8's text form where it lies (the call as
assistant text naming its wire call id, the result as user text after its line), so the
history keeps its order and the rest of the request its blocks. Since
context-assembler@18; the estimate does not count the text form's fixed words (about 15
tokens a displaced pair; the body's 5% margin holds them).

Speed: each tool, system block and message block renders once per process to its
canonical JSON text (memoized on the frozen neutral value; a session's tools and a run's
history repeat on every Build), and the body is composed from those texts in RFC 8785 key
order — the bytes ``canonical_bytes`` of the whole body would give, which
tests/unit/test_providers.py checks on generated requests.

A change to the bytes rendered for a request bumps core/build_record.py ASSEMBLER_VERSION
(Rule 8 there). The failed-result line of Rule 8 came with context-assembler@2; a record of
@1 is rebuilt without it (``render(..., failed_result_line=False)``, providers/__init__.py).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from itertools import chain, compress, count, repeat
from operator import attrgetter, eq, is_not, methodcaller
from typing import Any, TypeVar

from ..core.canonical import canonical_bytes, comma_separated
from ..core.errors import EngineError

# Rules 4 and 8; defined in core, whose estimate counts their fixed words.
from ..core.fixed_texts import HISTORY_CUT_PLACEHOLDER, TOOL_CALL_AS_TEXT, TOOL_RESULT_AS_TEXT
from ..core.identity_memo import IdentityMemo, RecentMemo
from ..core.items import REASONING_TYPES
from ..core.memo_budget import bounded_cache
from ..core.request import (
    Block,
    CacheBreakpoint,
    Message,
    ModelRequest,
    ToolDefinition,
    repeated_run,
    with_repeated_run,
)
from ..core.rows import Row
from .call_ids import BASE_IDS, VariantMemo, all_distinct, wire_call_ids
from .layout import PromptUnit, RenderedPayload, StablePrefix
from .names import check_wire_names, wire_tool_name
from .texts import TOOL_ERROR_AS_TEXT  # Rule 8: a result's is_error, as text

__all__ = [
    "API",
    "HISTORY_CUT_PLACEHOLDER",
    "MAX_BREAKPOINTS",
    "TOOL_CALL_AS_TEXT",
    "TOOL_ERROR_AS_TEXT",
    "TOOL_RESULT_AS_TEXT",
    "UNNAMED_CALL_AS_TEXT",
    "errors_as_text",
    "prompt_units",
    "render",
    "text_paths",
]

API = "anthropic.messages"
MAX_BREAKPOINTS = 4
UNNAMED_CALL_AS_TEXT = "(Called tool {name} with input {arguments})"  # @10 and older
_TTL_RANK = {"5m": 0, "1h": 1}
_PROVIDER = "anthropic"


@dataclass(frozen=True, slots=True)
class _Rendered:
    """One content block as rendered, shared by every request that carries it."""

    obj: Mapping[str, Any]  # never mutated: markers live on the request's _Unit
    text: str  # canonical JSON of obj
    row: Row
    item_id: str
    kind: str  # "tool" | "system" | "text" | "tool_use" | "tool_result" | "reasoning"


@dataclass(slots=True)
class _Unit:
    """A rendered block's place in one request, with the cache marker it closes, if any."""

    rendered: _Rendered
    control: dict[str, str] | None = None

    @property
    def cacheable(self) -> bool:
        return self.rendered.kind != "reasoning"  # thinking blocks cannot carry cache_control

    @property
    def kind(self) -> str:
        return self.rendered.kind

    def json(self) -> str:
        if self.control is None:
            return self.rendered.text
        return _marked(self.rendered, self.control.get("ttl", ""))


# What a history marker's block is found by (Rule 6): its item id, with the item's session
# sequence where the marker names one (an id alone can name an item of each run). A
# marker without it (context-assembler@7's and older) finds the first block of the id.
_Anchor = str | tuple[str, int]


@dataclass(slots=True)
class _Layout:
    tools: list[_Unit]
    system: list[_Unit]
    turns: list[tuple[str, list[_Unit]]]
    # For each neutral message block, in order: the unit it rendered to, or the last unit
    # rendered before it when it rendered none (Rule 6: a marker never moves later); by
    # item id, then by (item id, source sequence) where the block has one.
    anchors: list[tuple[_Anchor, _Unit | None]]

    def ordered(self) -> list[tuple[str, str, _Unit]]:
        """(path, role, unit) in processing order; role is "" outside messages."""
        out = [(f"tools[{n}]", "", u) for n, u in enumerate(self.tools)]
        out += [(f"system[{n}]", "", u) for n, u in enumerate(self.system)]
        for t, (role, units) in enumerate(self.turns):
            out += [(f"messages[{t}].content[{n}]", role, u) for n, u in enumerate(units)]
        return out


def render(
    request: ModelRequest, max_breakpoints: int = MAX_BREAKPOINTS, *, text_call_ids: bool = True
) -> RenderedPayload:
    """The Messages API body for `request`, with at most `max_breakpoints` markers (the
    model's budget; above the API's MAX_BREAKPOINTS counts as MAX_BREAKPOINTS). With
    `text_call_ids` False, a request without tools says no call ids (Rule 8, @10).

    Raises:
        PreconditionError: two tool names share a wire name.
        EngineError: a reasoning item's opaque payload is not a JSON object of the
            provider's reasoning type (core/items.py REASONING_TYPES).
    """
    max_breakpoints = min(max_breakpoints, MAX_BREAKPOINTS)  # the API refuses a fifth
    tools = [_Unit(_tool(t)) for t in request.tools]
    system = [_Unit(r) for b in request.system if (r := _system(b)) is not None]
    form = _form(request, text_call_ids)
    messages, moved, run_at = _message_layouts(request, form=form)
    displaced = _displaced(request, form)
    turns = (
        None  # Rule 9: rare, and laid out block by block
        if displaced
        else _turns_by_message(
            messages, tools, system, request.cache_breakpoints, max_breakpoints, run_at
        )
    )
    if turns is _EXPAND:  # a marker lands in the repeated run: lay it out message by message
        messages, moved, run_at = _message_layouts(request, collapse=False, form=form)
        turns = _turns_by_message(
            messages, tools, system, request.cache_breakpoints, max_breakpoints, run_at
        )
    if turns is None:  # a message that sends nothing, or two of one role in a row
        layout = _layout(request, tools, system, moved, form, displaced=displaced)
        _place_markers(layout, request.cache_breakpoints, max_breakpoints)
        turns = [_turn_text(role, units) for role, units in layout.turns]
        run_at = -1
    assert isinstance(turns, list)
    # Keys in RFC 8785 order; the pieces joined once (the turns are tens of kB).
    pieces = [
        '{"max_tokens":',
        str(request.max_output_tokens),
        ',"messages":[',
        *comma_separated(turns, ","),
        '],"model":',
        _string(request.model_id),
    ]
    if system:
        pieces += [',"system":[', ",".join(u.json() for u in system), "]"]
    if tools:
        pieces += [',"tools":[', ",".join(u.json() for u in tools), "]"]
    pieces.append("}")
    body = "".join(pieces).encode("utf-8")
    return RenderedPayload(API, body, _stable_prefix(pieces, turns, messages, run_at))


def _stable_prefix(
    pieces: list[str], turns: list[str], messages: list[_MessageLayout], run_at: int
) -> StablePrefix | None:
    """The body's pieces up to its repeated run's turns, which _turns_by_message left as
    the run's memoized text (no marker lands in it): the head before them, and where the
    hash states after them are kept. None without a run laid out as one."""
    if run_at < 0:
        return None
    run = messages[run_at]
    # A placeholder turn opens the messages when the first is the assistant's.
    at = run_at + (len(turns) - len(messages))
    if turns[at] is not run.text:
        return None
    end = 3 + 2 * at  # three pieces open the body; a comma follows each turn
    return StablePrefix("".join(pieces[:end]), run.text, run.states)


def errors_as_text(request: ModelRequest) -> bool:
    """Whether `request` says a failed result's is_error as text (Rule 8: no tools);
    otherwise the tool_result block carries ``is_error``."""
    return not request.tools


def _turn_text(role: str, units: Sequence[_Unit]) -> str:
    # Keys in RFC 8785 order: a turn's content before its role.
    return '{"content":[' + ",".join(u.json() for u in units) + '],"role":' + _string(role) + "}"


def prompt_units(request: ModelRequest) -> tuple[PromptUnit, ...]:
    """The prompt as Anthropic caches it, unit by unit, markers excluded."""
    layout = _prompt_layout(request)
    return tuple(
        PromptUnit(
            path,
            unit.rendered.row,
            unit.rendered.item_id,
            canonical_bytes({"role": role, "block": dict(unit.rendered.obj)})
            if role
            else unit.rendered.text.encode("utf-8"),
        )
        for path, role, unit in layout.ordered()
    )


def text_paths(
    request: ModelRequest, blocks: Iterable[tuple[int, int]], *, text_call_ids: bool = True
) -> dict[tuple[int, int], str]:
    """Where each of `blocks` (message index, block index in request.messages) landed in
    the body: the path of its content block, ``messages[t].content[j]`` (Rules 4 and 8:
    turns merged, results first, the placeholder turn counted). A block that sent nothing
    is absent. What the adapter finds a message's attachments' place by.

    Where every message is a turn of its own (the common case, as _turns_by_message
    finds it from the memos: the repeated run is one layout), message n is turn n after
    the placeholder, and a block's place in it is its anchor in the message's memoized
    layout, so a Build's cost does not grow with its history. Otherwise the general
    layout is walked."""
    blocks, form = list(blocks), _form(request, text_call_ids)
    messages, moved, _ = _message_layouts(request, form=form)
    displaced = _displaced(request, form)
    if displaced or not _one_turn_each(messages):
        return _walked_paths(request, blocks, moved, form, displaced)
    first = 1 if messages and messages[0].first_role == "assistant" else 0
    layout_of = _FORMS[form].layout
    found: dict[tuple[int, int], str] = {}
    for n, k in blocks:
        block = request.messages[n].blocks[k]
        layout = layout_of(request.messages[n])
        j = layout.anchors.get(_block_anchor(block), -1)
        # The anchor is the block's own unit when it sends something; else an earlier one.
        own = j >= 0 and layout.units[j].item_id == block.item_id
        if own and layout.units[j].obj.get("text") == block.text:
            found[n, k] = f"messages[{n + first}].content[{j}]"
    return found


def _walked_paths(
    request: ModelRequest,
    blocks: list[tuple[int, int]],
    moved: _Moved,
    form: str,
    displaced: frozenset[tuple[int, int]],
) -> dict[tuple[int, int], str]:
    """text_paths over the general layout (Rule 4), every block laid out."""
    units: dict[tuple[int, int], _Unit] = {}
    layout = _layout(request, [], [], moved, form, units, displaced=displaced)
    where = {
        id(unit): f"messages[{t}].content[{j}]"
        for t, (_, turn) in enumerate(layout.turns)
        for j, unit in enumerate(turn)
    }
    return {key: where[id(units[key])] for key in blocks if key in units}


def _block_anchor(block: Block) -> _Anchor:
    return (block.item_id, block.source_sequence) if block.source_sequence else block.item_id


# --- layout ----------------------------------------------------------------------------

# Message index -> its blocks' wire call ids, "" where unmoved (call_ids.wire_call_ids).
_Moved = dict[int, tuple[str, ...]]


def _message_layouts(
    request: ModelRequest, *, collapse: bool = True, form: str = "blocks"
) -> tuple[list[_MessageLayout], _Moved, int]:
    """Each message's layout, from the memos, the blocks whose call id moved (Rule 7):
    none in the common case, told by one pass over the memos' ids, and where the repeated
    run lies (-1: nowhere). Checks wire names.

    With `collapse`, the request's repeated run (core/request.py ModelRequest.repeated) is
    one layout of several turns (`_run_layout`), memoized on the run, where it can be one:
    its messages each send something and alternate roles. Not when call ids move: those are
    re-laid by message index. `form` is how tool pairs render (_form)."""
    memos = _FORMS[form]
    each, run_of = memos.layout, memos.run
    messages, run_at = _collapsed(request, each, run_of) if collapse else (None, -1)
    if messages is None:
        messages = each.many(request.messages)
    if memos.relaid is None:  # no call id reaches the wire
        return messages, {}, run_at
    if form == "blocks":  # Rule 8: as text, no tool name is a wire name
        check_wire_names(t.name for t in request.tools)  # names.py Rule 2: the tools alone
    if all_distinct(map(_CALL_IDS, messages)):
        return messages, {}, run_at
    messages = each.many(request.messages)
    moved = wire_call_ids(request.messages, _BASE_ID)
    for n, wire in moved.items():
        messages[n] = memos.relaid(request.messages[n], wire)
    return messages, moved, -1


def _collapsed(
    request: ModelRequest,
    each: IdentityMemo[Message, _MessageLayout],
    run_of: RecentMemo[tuple[Message, ...], _MessageLayout | _NoRun],
) -> tuple[list[_MessageLayout] | None, int]:
    """The layouts with the repeated run as one, and its index; (None, -1) where there is
    no run or it cannot be one layout."""
    hint = repeated_run(request)
    if hint is None:
        return None, -1
    combined = run_of(hint.run)
    if isinstance(combined, _NoRun):
        return None, -1
    messages, start = request.messages, hint.start
    after = messages[start + len(hint.run) :]
    return [*each.many(messages[:start]), combined, *each.many(after)], start


def _unit_of(block: Block, wire: str, form: str) -> _Rendered | None:
    """`block`'s unit in `form`; `wire` is its moved call id, or ""."""
    memos = _FORMS[form]
    return memos.moved(block, wire) if wire else memos.block(block)


def _layout(
    request: ModelRequest,
    tools: list[_Unit],
    system: list[_Unit],
    moved: _Moved,
    form: str,
    units_of: dict[tuple[int, int], _Unit] | None = None,
    *,
    displaced: frozenset[tuple[int, int]] = frozenset(),
) -> _Layout:
    """Every block's unit, message by message (Rule 4): the general case. `units_of`,
    when given, is filled with each block's unit by (message index, block index); the
    blocks at `displaced` (message index, block index) render as text (Rule 9)."""
    turns: list[tuple[str, list[_Unit]]] = []
    anchors: list[tuple[_Anchor, _Unit | None]] = []
    last: _Unit | None = None
    for n, message in enumerate(request.messages):
        units: list[_Unit] = []
        wire = moved.get(n, ())
        for k, block in enumerate(message.blocks):
            if (n, k) in displaced:
                rendered = _render_block_as_text(block, wire[k] if wire else "")
            else:
                rendered = _unit_of(block, wire[k] if wire else "", form)
            unit = _Unit(rendered) if rendered is not None else None
            if unit is not None:
                units.append(unit)
                if units_of is not None:
                    units_of[n, k] = unit
                if unit.cacheable:
                    last = unit
            closing = unit if unit is not None and unit.cacheable else last
            anchors.append((block.item_id, closing))
            if block.source_sequence:
                anchors.append(((block.item_id, block.source_sequence), closing))
        if message.role == "assistant" and units and units[-1].rendered.kind == "reasoning":
            kept = _without_final_reasoning([u.rendered for u in units])
            if units_of is not None:  # the blocks whose unit is not sent have no place
                dropped = {id(u) for u in units[len(kept) :]}
                for key in [k for k, u in units_of.items() if id(u) in dropped]:
                    del units_of[key]
            units = units[: len(kept)]
        if not units:
            continue
        if turns and turns[-1][0] == message.role:
            turns[-1][1].extend(units)
        else:
            turns.append((message.role, units))
    if turns and turns[0][0] == "assistant":
        turns.insert(0, ("user", [_Unit(_PLACEHOLDER)]))
    turns = [(role, _results_first(units) if role == "user" else units) for role, units in turns]
    return _Layout(tools, system, turns, anchors)


def _prompt_layout(request: ModelRequest) -> _Layout:
    form = _form(request, True)
    _, moved, _ = _message_layouts(request, collapse=False, form=form)
    tools = [_Unit(_tool(t)) for t in request.tools]
    system = [_Unit(r) for b in request.system if (r := _system(b)) is not None]
    return _layout(request, tools, system, moved, form, displaced=_displaced(request, form))


# --- Rule 9: pairs whose result is not in the turn after their call ---------------------


@dataclass(frozen=True, slots=True)
class _PairKeys:
    """The (run id, call id) keys a message's calls and results name; for a repeated run
    (several messages), its last message's calls, its first message's results, and whether
    every pair within it lies in adjacent messages."""

    calls: frozenset[tuple[str, str]]
    results: frozenset[tuple[str, str]]
    adjacent: bool = True


def _keys_of(message: Message) -> _PairKeys:
    kinds = ("tool_call", "tool_result")
    calls, results = (
        frozenset((b.run_id, b.call_id) for b in message.blocks if b.kind == kind) for kind in kinds
    )
    return _PairKeys(calls, results)


def _adjacent(keys: Sequence[_PairKeys]) -> bool:
    """Whether each of `keys`' results answer calls of the one before (and all within)."""
    return all(map(_ADJACENT, keys)) and all(
        map(frozenset.issubset, map(_RESULTS, keys[1:]), map(_CALLS, keys))
    )


def _run_keys(run: tuple[Message, ...]) -> _PairKeys:
    keys = _pair_keys.many(run)
    return _PairKeys(keys[-1].calls, keys[0].results, _adjacent(keys))


# A run's messages are the same objects on every Build (core/messages.py interns them), and
# its carried interior one tuple (ModelRequest.repeated), whose keys are made once: the
# check then walks only the messages around it.
_pair_keys = IdentityMemo(_keys_of, 16_384, by_value=False)
_run_pair_keys: RecentMemo[tuple[Message, ...], _PairKeys] = RecentMemo(_run_keys, weigh_depth=1)
_CALLS = attrgetter("calls")
_RESULTS = attrgetter("results")
_ADJACENT = attrgetter("adjacent")
_NOT_DISPLACED: frozenset[tuple[int, int]] = frozenset()


def _displaced(request: ModelRequest, form: str) -> frozenset[tuple[int, int]]:
    """The (message index, block index) of both halves of every pair whose result is not
    in the message right after its call's (Rule 9); none in the common case, told by one
    pass over memoized keys: each message's results answer calls of the message before.
    Messages alternate roles (core/messages.py), so that message is the next turn."""
    if form != "blocks":
        return _NOT_DISPLACED  # Rule 8 sends every pair as text already
    if _adjacent(with_repeated_run(request, _pair_keys.many, _run_pair_keys)):
        return _NOT_DISPLACED
    called: dict[tuple[str, str], tuple[int, int]] = {}
    found: set[tuple[int, int]] = set()
    for n, message in enumerate(request.messages):
        for k, block in enumerate(message.blocks):
            key = (block.run_id, block.call_id)
            if block.kind == "tool_call":
                called[key] = (n, k)
            elif block.kind == "tool_result" and (at := called.get(key)) and at[0] != n - 1:
                found.update((at, (n, k)))
    return frozenset(found)


# --- one turn per message: the common case, composed from per-message memos -----------


@dataclass(frozen=True, slots=True)
class _MessageLayout:
    """One neutral message rendered as a turn of its own (Rules 3-5), shared by every
    request that carries the message."""

    role: str
    units: tuple[_Rendered, ...]  # in turn order (a user turn's results first)
    text: str  # the turn's canonical JSON, no markers
    # item id, and (item id, source sequence) where the block has one (_anchor) -> index in
    # `units` of the unit a marker through that item closes (Rule 6): the block's own, or
    # the last cacheable one before it; -1 when that lies in an earlier message. First
    # occurrence wins, as in _target.
    anchors: dict[_Anchor, int]
    last_cacheable: int  # index in `units` of the last cacheable unit in block order; -1
    call_ids: tuple[str, ...]  # its calls' base ids (Rule 7)
    # The roles its turns begin and end with: its role, for one message; a repeated run's
    # first and last message's (_run_layout), whose `text` is then several turns.
    first_role: str = ""
    last_role: str = ""
    # A repeated run's: the hash states after bodies that begin with it (StablePrefix).
    states: dict[bytes, tuple[int, Any]] = field(default_factory=dict, compare=False, repr=False)


class _NoRun:
    """A repeated run that cannot be one layout (a message sends nothing, or two of one
    role meet inside it)."""


_NO_RUN = _NoRun()


def _lay_out_run(layouts: Sequence[_MessageLayout]) -> _MessageLayout | _NoRun:
    """The layouts of a run of messages as one of several turns, when each message is a
    turn of its own: its text the turns' texts joined, its calls and names theirs. Its
    anchors name every item its messages' anchors do (value 0) and it has a cacheable unit
    if any of them has: a marker that lands in it sends _turns_by_message back to the
    messages one by one, so where in the run is never needed."""
    # A run's first Build makes this over every carried message: whole-list passes in C.
    roles = list(map(_ROLE, layouts))
    if not layouts or "" in map(_TEXT, layouts) or True in map(eq, roles, roles[1:]):
        return _NO_RUN
    return _MessageLayout(
        role="",
        units=(),
        text=",".join(map(_TEXT, layouts)),
        anchors=dict.fromkeys(chain.from_iterable(map(_ANCHORS, layouts)), 0),
        last_cacheable=0 if max(map(_LAST_CACHEABLE, layouts)) >= 0 else -1,
        call_ids=tuple(chain.from_iterable(map(_CALL_IDS, layouts))),
        first_role=roles[0],
        last_role=roles[-1],
    )


def _lay_out_message(
    message: Message, moved: tuple[str, ...] = (), form: str = "blocks"
) -> _MessageLayout:
    rendered: list[_Rendered] = []
    anchors: dict[_Anchor, int] = {}
    last = -1  # index into `rendered` (block order)
    for k, block in enumerate(message.blocks):
        unit = _unit_of(block, moved[k] if moved else "", form)
        if unit is not None:
            rendered.append(unit)
            if unit.kind != "reasoning":
                last = len(rendered) - 1
        own = unit is not None and unit.kind != "reasoning"
        closing = len(rendered) - 1 if own else last
        anchors.setdefault(block.item_id, closing)
        if block.source_sequence:
            anchors.setdefault((block.item_id, block.source_sequence), closing)
    if message.role == "assistant":
        rendered = _without_final_reasoning(rendered)
    units = [_Unit(r) for r in rendered]
    ordered = _results_first(units) if message.role == "user" else units
    turn = [u.rendered for u in ordered]
    # Indexes above are in block order; the turn's order may differ (results first).
    where = {id(u): n for n, u in enumerate(ordered)}
    to_turn = [where[id(u)] for u in units]
    return _MessageLayout(
        role=message.role,
        units=tuple(turn),
        text=_turn_text(message.role, ordered) if ordered else "",
        anchors={k: (to_turn[v] if v >= 0 else -1) for k, v in anchors.items()},
        last_cacheable=to_turn[last] if last >= 0 else -1,
        call_ids=tuple(_BASE_ID(b.call_id) for b in message.blocks if b.kind == "tool_call"),
        first_role=message.role,
        last_role=message.role,
    )


def _without_final_reasoning(rendered: list[_Rendered]) -> list[_Rendered]:
    """Rule 5: an assistant message's units without the reasoning blocks that end it. The
    API refuses a turn whose final block is thinking ("The final block in an assistant
    message cannot be 'thinking'"): a turn whose only output was reasoning, or reasoning
    and blank text, failed every later request of its run (an audit)."""
    end = len(rendered)
    while end and rendered[end - 1].kind == "reasoning":
        end -= 1
    return rendered[:end]


# A run's carried messages are the same objects on every Build (core/identity_memo.py),
# and so are the ids that moved in them (providers/call_ids.py, Rule 2).
_message_layout = IdentityMemo(_lay_out_message, 16_384, by_value=False)
_text_layout = IdentityMemo(partial(_lay_out_message, form="text"), 16_384, by_value=False)
_unnamed_layout = IdentityMemo(partial(_lay_out_message, form="unnamed"), 16_384, by_value=False)
_relaid = VariantMemo(_lay_out_message)
_relaid_text = VariantMemo(partial(_lay_out_message, form="text"))
# A run's carried suffix keeps its interior as one tuple on every Build (Rule 9 there).
# Weighed one level down: its text, and its anchors counted, not visited (their keys are
# the items' ids, held by the items, and (id, sequence) pairs: these the count leaves out).
_run_layout: RecentMemo[tuple[Message, ...], _MessageLayout | _NoRun] = RecentMemo(
    lambda run: _lay_out_run(_message_layout.many(run)), weigh_depth=1
)
_run_text_layout: RecentMemo[tuple[Message, ...], _MessageLayout | _NoRun] = RecentMemo(
    lambda run: _lay_out_run(_text_layout.many(run)), weigh_depth=1
)
_run_unnamed_layout: RecentMemo[tuple[Message, ...], _MessageLayout | _NoRun] = RecentMemo(
    lambda run: _lay_out_run(_unnamed_layout.many(run)), weigh_depth=1
)
_BASE_ID = BASE_IDS[_PROVIDER]
_CALL_IDS = attrgetter("call_ids")
_FIRST_ROLE = attrgetter("first_role")
_LAST_ROLE = attrgetter("last_role")
_TEXT = attrgetter("text")
_ANCHORS = attrgetter("anchors")
_ROLE = attrgetter("role")
_LAST_CACHEABLE = attrgetter("last_cacheable")

# Processing-order position of a unit: (section, message, unit); tools, system, messages.
_Position = tuple[int, int, int]


class _Expand:
    """_turns_by_message's answer when a marker lands in the repeated run."""


_EXPAND = _Expand()


def _turns_by_message(
    messages: list[_MessageLayout],
    tools: list[_Unit],
    system: list[_Unit],
    breakpoints: Sequence[CacheBreakpoint],
    budget: int,
    run_at: int = -1,
) -> list[str] | _Expand | None:
    """The turns' JSON texts when every message sends something and no two neighbours share
    a role, so each message is one turn: its memoized text, recomposed only where a marker
    lands. None otherwise (the general _layout handles it); _EXPAND, changing nothing, when
    a marker lands in the repeated run at `run_at` (the caller lays it out message by
    message). Markers follow _place_markers exactly; tests/unit/test_providers.py checks
    the two paths give the same bytes."""
    if not _one_turn_each(messages):
        return None
    texts: list[str] = list(map(_TEXT, messages))
    firsts: list[str] = list(map(_FIRST_ROLE, messages))
    located = partial(_position_of, messages=messages, tools=tools, system=system)
    controls = _controls(breakpoints, budget, located)
    if run_at >= 0 and any(section == 2 and at == run_at for (section, at, _), _ in controls):
        return _EXPAND
    marked: dict[int, dict[int, dict[str, str]]] = {}
    for (section, message, unit), control in controls:
        if section == 0:
            tools[unit].control = control
        elif section == 1:
            system[unit].control = control
        else:
            marked.setdefault(message, {})[unit] = control
    for n, marks in marked.items():
        units = [_Unit(r, marks.get(k)) for k, r in enumerate(messages[n].units)]
        texts[n] = _turn_text(messages[n].role, units)
    if firsts and firsts[0] == "assistant":
        texts.insert(0, _PLACEHOLDER_TURN)
    return texts


def _one_turn_each(messages: list[_MessageLayout]) -> bool:
    """Whether each message is one turn: every one sends something and no two neighbours
    share a role (a repeated run's layout counts as its turns, which alternate)."""
    firsts = list(map(_FIRST_ROLE, messages))
    return "" not in map(_TEXT, messages) and True not in map(
        eq, map(_LAST_ROLE, messages), firsts[1:]
    )


def _position_of(
    bp: CacheBreakpoint,
    messages: list[_MessageLayout],
    tools: list[_Unit],
    system: list[_Unit],
) -> _Position | None:
    """Where the unit _target would pick for `bp` sits, in processing order."""
    if bp.name == "after_tools" or (bp.name == "after_system" and not system):
        return (0, 0, len(tools) - 1) if tools else None
    if bp.name == "after_system":
        return (1, 0, len(system) - 1)
    if not bp.through_item:
        return None
    # The first message naming the item, found without a Python step per message.
    hits = list(map(methodcaller("get", _anchor(bp)), map(_ANCHORS, messages)))
    n = next(compress(count(), map(is_not, hits, repeat(None))), None)
    if n is None:
        return None
    index: int = hits[n]
    while index < 0:  # the last cacheable unit of an earlier message
        n -= 1
        if n < 0:
            return None
        index = messages[n].last_cacheable
    return (2, n, index)


# Rendering is a pure function of frozen neutral values; the memos change only how often it
# runs. Bounded like core/request.py's fragments.
_MEMO = 16_384


def _marked_text(rendered: _Rendered, ttl: str) -> str:
    control = {"type": "ephemeral", **({"ttl": ttl} if ttl else {})}
    return _canonical_text({**rendered.obj, "cache_control": control})


# The blocks markers close repeat on every Build of a run (the last tool, the last system
# block, the carried suffix's last block), each with the same TTL (_controls makes only
# these two cache_control shapes).
_marked = VariantMemo(_marked_text, 1024)


@bounded_cache(256)
def _string(value: str) -> str:
    return _canonical_text(value)


def _canonical_text(value: Any) -> str:
    return canonical_bytes(value).decode("utf-8")


def _rendered(obj: dict[str, Any], row: Row, item_id: str, kind: str) -> _Rendered:
    return _Rendered(obj, _canonical_text(obj), row, item_id, kind)


@bounded_cache(1024)
def _tool(tool: ToolDefinition) -> _Rendered:
    obj: dict[str, Any] = {
        "name": wire_tool_name(tool.name),
        "input_schema": json.loads(tool.input_schema_json),
    }
    if tool.description:
        obj["description"] = tool.description
    return _rendered(obj, Row.TOOL_DEFINITIONS, f"tool:{tool.name}", "tool")


@bounded_cache(1024)
def _system(block: Block) -> _Rendered | None:
    if not block.text.strip():
        return None
    return _rendered({"type": "text", "text": block.text}, block.row, block.item_id, "system")


def _render_block(block: Block, call_id: str = "") -> _Rendered | None:
    """One neutral block's content block (Rules 3, 5, 7); None when it sends nothing.
    `call_id` is the pair's wire id when it moved; "" sends the call's base id."""
    match block.kind:
        case "text":
            if not block.text.strip():
                return None
            obj: dict[str, Any] = {"type": "text", "text": block.text}
        case "tool_call":
            obj = {
                "type": "tool_use",
                "id": call_id or _BASE_ID(block.call_id),
                "name": wire_tool_name(block.tool_name),
                "input": json.loads(block.arguments_json or "{}"),
            }
        case "tool_result":
            obj = {"type": "tool_result", "tool_use_id": call_id or _BASE_ID(block.call_id)}
            if block.text.strip():  # whitespace alone is refused as text is (Rule 3)
                obj["content"] = block.text
            if block.is_error:
                obj["is_error"] = True
        case "reasoning":
            if block.provider != _PROVIDER:
                return None
            obj = _opaque(block)
        case _:
            raise EngineError(f"no Anthropic rendering for block kind {block.kind!r}")
    kind = {"tool_call": "tool_use"}.get(block.kind, block.kind)
    return _rendered(obj, block.row, block.item_id, kind)


def _render_block_as_text(block: Block, call_id: str = "", named: bool = True) -> _Rendered | None:
    """A block of a request that defines no tools (Rule 8): tool blocks as text blocks,
    naming the pair's wire call id (`call_id` where it moved, else the base id); with
    `named` False, as context-assembler@10 and older sent them, naming none."""
    match block.kind:
        case "tool_call":
            arguments = block.arguments_json or "{}"
            said = TOOL_CALL_AS_TEXT if named else UNNAMED_CALL_AS_TEXT
            wire = call_id or _BASE_ID(block.call_id)
            text = said.format(name=block.tool_name, arguments=arguments, call_id=wire)
        case "tool_result":
            # The lines stand outside the envelope: the engine says which call this
            # answers and that it failed; the tool's own text stays as core enveloped it.
            wire = call_id or _BASE_ID(block.call_id)
            lines = [TOOL_RESULT_AS_TEXT.format(call_id=wire)] if named else []
            lines += [TOOL_ERROR_AS_TEXT] if block.is_error else []
            lines += [block.text] if block.text.strip() else []
            if not lines:
                return None
            text = "\n".join(lines)
        case _:
            return _block(block)
    return _rendered({"type": "text", "text": text}, block.row, block.item_id, "text")


# A run's history blocks are the same objects on every Build (core/identity_memo.py).
_block = IdentityMemo(_render_block, _MEMO)
_text_block = IdentityMemo(_render_block_as_text, _MEMO)
_unnamed_block = IdentityMemo(partial(_render_block_as_text, named=False), _MEMO)


@dataclass(frozen=True, slots=True)
class _FormMemos:
    """How one form renders: a block (`block`, memoized; `moved`, one whose wire id moved),
    a message and a repeated run (`layout`, `run`), a message whose ids moved (`relaid`;
    None: no call id reaches the wire, so none is re-laid)."""

    block: Callable[[Block], _Rendered | None]
    moved: Callable[[Block, str], _Rendered | None]
    layout: IdentityMemo[Message, _MessageLayout]
    run: RecentMemo[tuple[Message, ...], _MessageLayout | _NoRun]
    relaid: VariantMemo[Message, tuple[str, ...], _MessageLayout] | None


# How a request's tool pairs render: as tool blocks, or as text (Rule 8) naming their wire
# call ids, or naming none (context-assembler@10 and older).
_FORMS: dict[str, _FormMemos] = {
    "blocks": _FormMemos(_block, _render_block, _message_layout, _run_layout, _relaid),
    "text": _FormMemos(
        _text_block, _render_block_as_text, _text_layout, _run_text_layout, _relaid_text
    ),
    "unnamed": _FormMemos(
        _unnamed_block,
        lambda block, wire: _unnamed_block(block),
        _unnamed_layout,
        _run_unnamed_layout,
        None,
    ),
}


def _form(request: ModelRequest, text_call_ids: bool) -> str:
    if request.tools:
        return "blocks"
    return "text" if text_call_ids else "unnamed"


_PLACEHOLDER = _rendered(
    {"type": "text", "text": HISTORY_CUT_PLACEHOLDER}, Row.CONVERSATION, "", "text"
)
_PLACEHOLDER_TURN = _turn_text("user", [_Unit(_PLACEHOLDER)])


def _opaque(block: Block) -> dict[str, Any]:
    """The reasoning payload to replay. AppendItems checked its type; checked again here,
    since a payload of another type would replay as a message or call the hashed request
    does not show."""
    try:
        value = json.loads(block.opaque)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise EngineError(f"reasoning item {block.item_id!r} is not a JSON object")
    kind = value.get("type")
    if not isinstance(kind, str) or kind not in REASONING_TYPES[_PROVIDER]:
        raise EngineError(f"reasoning item {block.item_id!r} is not a {_PROVIDER} reasoning item")
    return value


def _results_first(units: list[_Unit]) -> list[_Unit]:
    if len(units) < 2:
        return units
    results = [u for u in units if u.kind == "tool_result"]
    return results + [u for u in units if u.kind != "tool_result"]


# --- markers ---------------------------------------------------------------------------


def _place_markers(layout: _Layout, breakpoints: Sequence[CacheBreakpoint], budget: int) -> None:
    """Attach cache_control to the blocks the markers close (Rule 6)."""
    ordered = [u for _, _, u in layout.ordered()]
    position = {id(u): n for n, u in enumerate(ordered)}

    def located(bp: CacheBreakpoint) -> int | None:
        unit = _target(layout, bp)
        return position.get(id(unit)) if unit is not None else None

    for index, control in _controls(breakpoints, budget, located):
        ordered[index].control = control


P = TypeVar("P", int, _Position)


def _controls(
    breakpoints: Sequence[CacheBreakpoint],
    budget: int,
    locate: Callable[[CacheBreakpoint], P | None],
) -> list[tuple[P, dict[str, str]]]:
    """(position, cache_control) of each marker sent, in processing order (Rule 6): at most
    `budget` distinct positions, taken in priority order; a later marker's TTL lowered to
    the shortest before it."""
    chosen: dict[P, str] = {}
    for bp in sorted(breakpoints, key=lambda b: (b.priority, b.name)):
        if len(chosen) >= budget:
            break
        position = locate(bp)
        if position is not None:
            chosen.setdefault(position, bp.ttl if bp.ttl in _TTL_RANK else "5m")
    out: list[tuple[P, dict[str, str]]] = []
    shortest = max(_TTL_RANK.values())
    for position in sorted(chosen):
        shortest = min(shortest, _TTL_RANK[chosen[position]])
        control: dict[str, str] = {"type": "ephemeral"}
        if shortest == _TTL_RANK["1h"]:
            control["ttl"] = "1h"
        out.append((position, control))
    return out


def _target(layout: _Layout, bp: CacheBreakpoint) -> _Unit | None:
    if bp.name == "after_tools":
        return layout.tools[-1] if layout.tools else None
    if bp.name == "after_system":
        if layout.system:
            return layout.system[-1]
        return layout.tools[-1] if layout.tools else None
    key = _anchor(bp)
    for anchor, unit in layout.anchors:
        if anchor and anchor == key:
            return unit  # the first block of that id: a duplicate id never moves it later
    return None


def _anchor(bp: CacheBreakpoint) -> _Anchor:
    return (bp.through_item, bp.through_sequence) if bp.through_sequence else bp.through_item
