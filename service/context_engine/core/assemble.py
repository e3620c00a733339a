"""Build: a pure function from (plan, checkpoint, carried history, step context, clock) to a
provider-neutral ModelRequest. Called twice on the same inputs it returns the same bytes.

Rule 1 (order): rows 9 and 10 come first — the summary, then retained carried history and
the run's completed exchanges (its original user message once the run has tool calls and
results). Fresh rows 11-14 follow those exchanges; they are never inserted back before the
run's original user message. An unanswered trailing user message stays last (row 15).
Rule 2 (regions): every placed item's declared region, rows and trust are asserted against
the row table before anything renders.
Rule 3 (clock): the date in row 14 comes from the `now` argument, already in the session's
time zone (the shell resolves the zone; reading tz data is I/O).
Rule 4 (pairs): the assembled request is validated for orphaned tool items before it leaves.
Rule 5 (budget): the prefix is the plan's exact count; only the body is estimated, with
the correction factor pinned on the checkpoint. Carried results over the inline limit get
legacy excerpts first; then pressure.fit_body pays the never-yield set, runs the yield
ladder and cuts history. A body that does not fit after every cheaper yield is reported as
needs_compaction with no request: Build never compacts inline. Only while something is left
to compact (core/compaction.py compactable): with nothing, it is BUDGET_EXCEEDED, as a
never-yield set over the body is, since no compaction could answer it.
Rule 6 (versioned): this module and what it calls (the estimator, pressure, the yield
ladder, the renderers after it) are the body assembler, named by core/build_record.py
ASSEMBLER_VERSION in every request's record. A change that gives other bytes or cuts for
the same inputs bumps it (Rule 8 there); GetBuild refuses a record it no longer rebuilds.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime

from .attachment_sends import MessageAttachments, attachment_sends, with_attachments
from .body_estimate import (
    FixedTexts,
    attached_content,
    block_tokens,
    fixed_texts_of,
    request_framing,
    share_attachment_budget,
)
from .budget import ContextBudget, allocate
from .cache_hints import cache_breakpoints
from .carried import CarriedView, carried_view
from .checkpoint import NEUTRAL_FACTOR_PPM, Checkpoint, applied_factor
from .compaction import compactable
from .content_key import ContentMemo
from .envelope import escape_content, new_plan_secret, wrap
from .errors import BudgetExceededError, EngineError
from .estimator import ATTACHMENT_TOKEN_BUDGET, IMAGE_TOKENS, apply_factor, heuristic_count
from .excerpts import DEFAULT_INLINE_MAXIMUM_BYTES
from .identity_memo import IdentityMemo
from .items import (
    AssistantMessage,
    ContextItem,
    ConversationItem,
    CorrectionLineItem,
    DelegatedMessage,
    KnowledgePassageItem,
    ReasoningItem,
    RecallLineItem,
    RuntimeMetadataItem,
    SkillBodyItem,
    SummaryItem,
    ToolCall,
    ToolResult,
    UserMessage,
    WorkingStateItem,
    check_placement,
    excerpted,
    trust_of,
)
from .memo_budget import bounded_cache
from .messages import grouped, joined
from .plan import ClassUsage, ContextPlan, session_key
from .pressure import Fitted, PressureReport, fit_body, window_reach
from .request import Block, Message, ModelRequest, RepeatedRun, ToolDefinition
from .rows import Row
from .skills import body_text
from .trust import DELEGATED_TAG, TrustLevel, envelope_tag
from .validate import ClosedRun, validate_block_runs

__all__ = [
    "Assembled",
    "BuildInputs",
    "StepContext",
    "active_turn",
    "assemble",
    "carried_reaches",
    "skill_body_texts",
    "split_run_items",
]

_INPUT_TYPES = (UserMessage, ToolResult)


@dataclass(frozen=True, slots=True)
class StepContext:
    recall: tuple[RecallLineItem, ...] = ()
    corrections: tuple[CorrectionLineItem, ...] = ()
    knowledge: tuple[KnowledgePassageItem, ...] = ()
    # Recall lines never trimmed under pressure, counted from the best-ranked.
    recall_floor_lines: int = 0


@dataclass(frozen=True, slots=True)
class BuildInputs:
    tenant_id: str
    plan: ContextPlan
    secret: bytes  # the plan's nonce secret; never rendered
    checkpoint: Checkpoint
    carried: tuple[ConversationItem, ...]  # the run's carried history, oldest first
    now: datetime  # aware, in the session's time zone
    step: StepContext = StepContext()
    skill_bodies: tuple[SkillBodyItem, ...] = ()
    working_state: WorkingStateItem | None = None
    # The model's raw token counter (exact tokenizer or the conservative heuristic).
    count_tokens: Callable[[str], int] = heuristic_count
    # The model's per-image figure (estimator.image_tokens_for its registry entry), which
    # the shell resolves with the counter.
    image_tokens: int = IMAGE_TOKENS
    # Legacy tool results over this many bytes get head/tail excerpts (output setting).
    inline_maximum_bytes: int = DEFAULT_INLINE_MAXIMUM_BYTES
    # When `carried` is only the newest part of the run's carried history (the shell read
    # the log newest first: core/log_tail.py), how many carried items above the summary
    # floor precede it. It must reach as far back as any fitting request (carried_reaches).
    carried_before: int = 0
    # Whether the estimate counts the renderers' fixed texts (core/body_estimate.py Rule
    # 6); False only to rebuild a context-assembler@12 or older record as it was counted.
    fixed_texts: bool = True
    # How many cache markers the model's provider reads (the registry's
    # max_cache_breakpoints; None: the provider's own limit). A bridge marker only where
    # there is room for it beside the run marker (core/cache_hints.py Rule 8).
    cache_marker_budget: int | None = None
    # Whether row 13 over recall's cap where nothing of it yields (the correction lines,
    # they and recall's floor) is refused (pressure.fit_body Rule 6); False only to rebuild
    # a recorded request, which may predate the refusal.
    refuse_floor_over_cap: bool = True

    @property
    def estimator_factor_ppm(self) -> int:
        """The correction factor pinned on the checkpoint this build reads, for the plan's
        model (core/checkpoint.py applied_factor)."""
        return applied_factor(self.checkpoint, self.plan.model_id)


@dataclass(frozen=True, slots=True)
class Assembled:
    """Build's result. When the body does not fit even after every cheaper yield, and
    something is left to compact, `needs_compaction` is true and there is no request
    (`request` None, hash empty)."""

    request: ModelRequest | None
    request_sha256: str
    placed: tuple[tuple[Row, ContextItem], ...]  # every Region B item, in order
    needs_compaction: bool = False
    pressure: PressureReport | None = None  # always set by assemble(); .yielded says if
    budget: tuple[ClassUsage, ...] = ()  # prefix classes (exact) + body classes (estimated)
    # prefix exact + the request's framing + body estimated (the classes in `budget` sum to
    # it less the framing, which belongs to no class: core/budget.py Rule 7)
    estimated_input_tokens: int = 0
    input_budget_tokens: int = 0  # min(window, policy cap) - output reserve
    body_estimated_tokens: int = 0
    estimator_factor_ppm: int = NEUTRAL_FACTOR_PPM
    # Per user message of the request with attachments: where the adapter adds them and
    # what it sends of each (core/attachment_sends.py). Derived, never hashed or recorded.
    attachments: tuple[MessageAttachments, ...] = ()


def split_run_items(
    items: Sequence[ConversationItem],
) -> tuple[tuple[ConversationItem, ...], tuple[UserMessage, ...]]:
    """Split a run's items into completed exchanges and the unanswered trailing user input.

    The trailing input is the maximal suffix of user messages: before the model has
    answered anything they are the request's last word; once it has, they still are.
    """
    cut = len(items)
    while cut > 0 and isinstance(items[cut - 1], UserMessage):
        cut -= 1
    trailing = tuple(i for i in items[cut:] if isinstance(i, UserMessage))
    return tuple(items[:cut]), trailing


def assemble(inputs: BuildInputs) -> Assembled:
    """Assemble the run's next request.

    Raises:
        EngineError: an item type without a declared region, or in the wrong row; or
            `carried` stops short of what a fitting request can reach (carried_reaches).
        PreconditionError: the request would carry an orphaned tool call or result.
        BudgetExceededError: the never-yield set alone exceeds the body, or the body does
            not fit after every yield and nothing is left to compact.
    """
    plan = inputs.plan
    budget = _budget(inputs)
    view = _view(inputs, budget)
    if not view.covered(inputs.carried_before):
        raise EngineError(
            f"the carried history handed to assembly stops short of the window:"
            f" {inputs.carried_before} carried items before it were not read"
        )
    head, tail = _place(inputs)
    for row, item in (*head, *tail):
        check_placement(item, row)
    lowered, room = _attachment_shares(tail, inputs.image_tokens)
    # Items the summary covers are represented by it; admitting them again would state the
    # same turns twice in two voices. The carried history is older than everything in
    # `tail`: its messages share what attachment budget those left.
    floor = inputs.checkpoint.replaced_through_sequence
    segment = view.segment(floor).sharing(room)
    fitted = fit_body(
        head,
        segment,
        tail,
        pending=active_turn(inputs.checkpoint.items),
        budget=budget,
        cost=_cost(inputs, lowered),
        recall_floor_lines=inputs.step.recall_floor_lines,
        refuse_floor_over_cap=inputs.refuse_floor_over_cap,
        # Those the shell did not read (core/log_tail.py) lie above the floor and before the
        # window too.
        skipped=view.skipped(inputs.carried, floor) + inputs.carried_before,
    )
    if not fitted.fits:
        if not inputs.carried_before and not compactable(inputs.checkpoint, inputs.carried):
            raise _nothing_to_compact(fitted, budget)
        return _outcome(inputs, budget, fitted, None, "")
    messages, runs, repeated = _messages(fitted, inputs.secret)
    validate_block_runs(runs)
    request = ModelRequest(
        provider=plan.provider,
        model_id=plan.model_id,
        system=_system_blocks(plan),
        tools=_tool_definitions(plan),
        messages=messages,
        max_output_tokens=plan.max_output_tokens,
        session_key=session_key(inputs.tenant_id, plan.session_id),
        cache_breakpoints=cache_breakpoints(
            plan.session_kind,
            _window_items(fitted, inputs.checkpoint.run_id),
            inputs.checkpoint.run_id,
            inputs.cache_marker_budget,
        ),
        repeated=repeated,
    )
    digest = request.request_sha256()
    sends = attachment_sends(request, _attached(fitted), inputs.image_tokens)
    return _outcome(inputs, budget, fitted, request, digest, sends)


def _nothing_to_compact(fitted: Fitted, budget: ContextBudget) -> BudgetExceededError:
    """BUDGET_EXCEEDED for a body that does not fit after every yield when nothing is left
    to compact (every request that fits is as before, so the assembler version stands):
    what stays is the never-yield set with the summary (and the run's own user messages,
    which compaction keeps verbatim). Asked for a compaction, a worker was told by
    PrepareCompaction that nothing is compactable, an answer no protocol step follows (an
    audit: a large active turn beside a summary of half the body). Names the largest class
    of the request's need (`history` holds the summary)."""
    largest = max(fitted.usage, key=lambda u: (u.tokens, u.class_name))
    return BudgetExceededError(
        f"the body needs {fitted.body_tokens} tokens but has {budget.body_tokens}, and"
        " nothing is left to compact (everything before the active turn is summarized);"
        f" {largest.class_name} takes {largest.tokens}",
        metadata={
            "class": largest.class_name,
            "class_tokens": str(largest.tokens),
            "body_tokens": str(fitted.body_tokens),
            "body_budget_tokens": str(budget.body_tokens),
        },
    )


def carried_reaches(inputs: BuildInputs) -> bool:
    """Whether `inputs.carried` reaches as far back as any fitting request can: assemble
    decides the same with or without the `carried_before` items before it (their number
    is all it reports of them). The shell reads the log further back until it does."""
    return _view(inputs, _budget(inputs)).covered(inputs.carried_before)


def _budget(inputs: BuildInputs) -> ContextBudget:
    plan = inputs.plan
    return allocate(
        context_window=plan.context_window,
        policy_cap_tokens=plan.policy_cap_tokens,
        reserve_output_tokens=plan.max_output_tokens,
        prefix_tokens=plan.prefix_tokens,
        framing_tokens=_framing(
            inputs.count_tokens, inputs.estimator_factor_ppm, inputs.fixed_texts
        ),
    )


def _fixed(inputs: BuildInputs) -> FixedTexts:
    """The renderers' fixed texts the items' estimates count (core/body_estimate.py Rule 6):
    a plan's roster, and so the form its pairs take, is fixed for its epoch."""
    plan = inputs.plan
    return fixed_texts_of(plan.provider, bool(plan.tools), inputs.fixed_texts)


# Counted once per counter and factor, not on every Build (a counter is one function per
# model and tokenizer in the shell).
_framing = bounded_cache(64)(request_framing)


def _view(inputs: BuildInputs, budget: ContextBudget) -> CarriedView:
    # Only history a fitting request can reach is excerpted, placed and costed, and that
    # once per run's history and once per item content (core/carried.py, which keeps what
    # it derives: it is handed the unmemoized counter, and a renderer that stores nothing
    # but finds the block a run's own item was placed as).
    secret, count, factor = inputs.secret, inputs.count_tokens, inputs.estimator_factor_ppm
    images, fixed = inputs.image_tokens, _fixed(inputs)
    return carried_view(
        inputs.carried,
        (secret, count, factor, images, fixed),
        lambda block, item: block_tokens(block, item, count, factor, images, fixed),
        lambda item: attached_content(item, images),
        lambda row, item, truncated: _rendered_before(row, item, secret, truncated),
        inputs.inline_maximum_bytes,
        window_reach(budget),
    )


def _rendered_before(row: Row, item: ContextItem, secret: bytes, truncated: bool) -> Block:
    """`_render(row, item, secret, truncated)`, as the block a run's own item was rendered
    to when it was placed (the previous run's turns, now carried, were its own items): the
    same object, so every memo keyed on blocks and messages by identity finds it. Looked
    up, not stored: a history read cold fills only the walk's own table."""
    found = _render_memo.peek(item, row, secret, truncated)
    return found if found is not None else _render(row, item, secret, truncated)


def _system(plan: ContextPlan) -> tuple[Block, ...]:
    return tuple(b.to_block() for b in plan.system)


def _tools(plan: ContextPlan) -> tuple[ToolDefinition, ...]:
    return tuple(ToolDefinition(t.name, t.description, t.input_schema_json) for t in plan.tools)


# A session's plan is the same object on every Build of its epoch (the shell caches it), so
# its Region A blocks are made once and, being the same tuple, serialize from a memo too.
_system_blocks = IdentityMemo(_system, 256, by_value=False)
_tool_definitions = IdentityMemo(_tools, 256, by_value=False)


def _window_items(fitted: Fitted, run_id: str) -> Sequence[tuple[Row, ContextItem]]:
    """What cache_hints.history_window reads of the placed items. An untouched carried
    suffix with no reasoning item and nothing of the building run is represented by the at
    most two items a marker can name in it (core/carried.py, Retained.markable): the window
    closes each marker at the last nameable item and names the last input at or before it,
    and within such a suffix both are among those two."""
    retained = fitted.retained
    if retained is None or retained.has_reasoning or (run_id and run_id in retained.run_ids):
        return fitted.placed
    at, end = fitted.retained_at, fitted.retained_at + len(retained.pairs)
    return (*fitted.placed[:at], *retained.markable, *fitted.placed[end:])


def _attached(fitted: Fitted) -> list[UserMessage]:
    """The placed user messages with attachments, in order: those of a retained carried
    suffix found once per suffix (Retained.attached), the few placed around it walked."""
    retained = fitted.retained
    if retained is None:
        return with_attachments(fitted.placed)
    at, end = fitted.retained_at, fitted.retained_at + len(retained.pairs)
    placed = fitted.placed
    return [
        *with_attachments(placed[:at]),
        *retained.attached,
        *with_attachments(placed[end:]),
    ]


def _outcome(
    inputs: BuildInputs,
    budget: ContextBudget,
    fitted: Fitted,
    request: ModelRequest | None,
    digest: str,
    attachments: tuple[MessageAttachments, ...] = (),
) -> Assembled:
    plan = inputs.plan
    return Assembled(
        request=request,
        request_sha256=digest,
        placed=fitted.placed,
        needs_compaction=not fitted.fits,
        pressure=fitted.report,
        budget=(*plan.prefix_classes, *fitted.usage),
        estimated_input_tokens=plan.prefix_tokens + budget.framing_tokens + fitted.body_tokens,
        input_budget_tokens=budget.input_tokens,
        body_estimated_tokens=fitted.body_tokens,
        estimator_factor_ppm=inputs.estimator_factor_ppm,
        attachments=attachments,
    )


def active_turn(items: Sequence[ConversationItem]) -> tuple[ConversationItem, ...]:
    """The latest model turn that sent output (its text, reasoning and tool calls) and
    everything after it (inputs, and turns of reasoning alone), when that turn called
    tools; () otherwise. It never yields: Build pays it first (its pending pairs are the
    results the model is about to read) and compaction stops before it (its reasoning
    must stay with its calls: a provider replays the turn whole)."""
    completed, _ = split_run_items(items)
    # The latest turn that sent output (_output_turn): a turn of reasoning alone after a
    # tool loop's left that turn unprotected, and a compaction through it dropped the
    # thinking its call must follow (a review).
    start, end, _ = _output_turn(completed)
    if not any(isinstance(i, ToolCall) for i in completed[start:end]):
        return ()
    return tuple(completed[start:])


def _cost(
    inputs: BuildInputs, lowered: Mapping[int, int]
) -> Callable[[Row, ContextItem, bool], int]:
    """A placed item's estimated tokens as rendered, under the checkpoint's pinned factor
    (carried items are costed once per run: core/carried.py), less what `lowered` says of
    it (by id(): its attachment content beyond its share of the request's budget)."""
    count, factor, secret = inputs.count_tokens, inputs.estimator_factor_ppm, inputs.secret
    images, fixed = inputs.image_tokens, _fixed(inputs)

    def cost(row: Row, item: ContextItem, truncated: bool) -> int:
        return _cost_memo(item, row, secret, truncated, count, factor, images, fixed)

    if not lowered:
        return cost  # most requests: no message of the run carries attachments

    def shared(row: Row, item: ContextItem, truncated: bool) -> int:
        return cost(row, item, truncated) - lowered.get(id(item), 0)

    return shared


def _attachment_shares(
    placed: Sequence[tuple[Row, ContextItem]], image_tokens: int
) -> tuple[dict[int, int], int]:
    """core/body_estimate.py Rule 4 over the items placed after the carried history (the
    newest of the request, and never yielded: user messages): by id(), what each one's
    cost is lowered by, and the attachment budget they leave the carried history."""
    attached = [(i, c) for _, i in placed if (c := attached_content(i, image_tokens))]
    if not attached:
        return {}, ATTACHMENT_TOKEN_BUDGET
    lowered, room = share_attachment_budget([c for _, c in attached])
    return {id(i): n for (i, _), n in zip(attached, lowered, strict=True) if n}, room


# Rendering and estimating a block are pure functions of immutable arguments (frozen items,
# the plan secret, the counter, the pinned factor), so bounded memos change no result, only
# how often the work is done. They are keyed on the item's content (core/content_key.py):
# a run's items arrive as new objects on each step (its checkpoint is read afresh) and
# find their block and cost with a C-level hash and compare, not pydantic's. The bound
# covers the longest run a request can hold (a window of a million tokens at the dozen or
# so an item costs at least): the memos drop their oldest entries first, so a run of more
# items than the bound missed every entry at every Build (8,192 made 16,000 items cost
# 0.9-1.3 s a Build instead of 0.1 s). What they hold is bounded by bytes anyway
# (core/memo_budget.py).
_MEMO_SIZE = 65_536


def _render_item(item: ContextItem, row: Row, secret: bytes, truncated: bool) -> Block:
    return _render(row, item, secret, truncated)


_render_memo = ContentMemo(_render_item, _MEMO_SIZE)


def _item_cost(
    item: ContextItem,
    row: Row,
    secret: bytes,
    truncated: bool,
    count: Callable[[str], int],
    factor: int,
    image_tokens: int,
    fixed_texts: FixedTexts,
) -> int:
    block = _render_memo(item, row, secret, truncated)
    return block_tokens(block, item, count, factor, image_tokens, fixed_texts)


_cost_memo = ContentMemo(_item_cost, _MEMO_SIZE)


def _rendered(row: Row, item: ContextItem, secret: bytes, truncated: bool) -> Block:
    return _render_memo(item, row, secret, truncated)


def _place(
    inputs: BuildInputs,
) -> tuple[list[tuple[Row, ContextItem]], list[tuple[Row, ContextItem]]]:
    """Region B items in the fixed order of the row table: those before the carried
    history (the summary) and those after it."""
    checkpoint = inputs.checkpoint
    completed, trailing = split_run_items(checkpoint.items)
    head: list[tuple[Row, ContextItem]] = []
    if checkpoint.summary is not None:
        head.append((Row.COMPACTED_SUMMARY, checkpoint.summary))
    placed: list[tuple[Row, ContextItem]] = []
    placed += [(Row.CONVERSATION, i) for i in _latest_turn_reasoning_only(completed)]
    placed += [(Row.SKILL_BODIES, s) for s in inputs.skill_bodies]
    if inputs.working_state is not None:
        placed.append((Row.WORKING_STATE, inputs.working_state))
    step = inputs.step
    placed += [(Row.RECALL, c) for c in step.corrections]
    placed += [(Row.RECALL, r) for r in step.recall]
    placed += [(Row.RECALL, k) for k in sorted(step.knowledge, key=lambda k: k.rank)]
    placed.append((Row.RUNTIME_METADATA, _runtime(inputs)))
    placed += [(Row.USER_INPUT, u) for u in trailing]
    return head, placed


def _latest_turn_reasoning_only(items: tuple[ConversationItem, ...]) -> list[ConversationItem]:
    """Drop reasoning items except those of the latest model turn (ADR-0007).

    A model turn is a run of model output (assistant text, tool calls, reasoning) between
    inputs (user messages, tool results). The latest turn keeps its reasoning; where it
    sent reasoning alone (thinking cut off at max_tokens, an empty end_turn), so does the
    latest turn that sent output (_output_turn). Taken as the only one, a turn of reasoning
    alone dropped the tool loop's reasoning, and its call went to Anthropic without the
    thinking that must lead it: every later request of the run was refused (a review;
    context-assembler@26).
    """
    start, end, latest = _output_turn(items)
    # Not the reasoning of the turns between the two, which no provider replays (each ends
    # its message) and which, kept, were counted against the body (a review).
    return [
        i
        for n, i in enumerate(items)
        if not isinstance(i, ReasoningItem) or start <= n < end or n >= latest
    ]


def _output_turn(items: Sequence[ConversationItem]) -> tuple[int, int, int]:
    """(start, end) of the latest model turn that sent output (_sends_output), skipping
    back over turns of reasoning alone, and the start of the latest model turn."""
    start, end = _turn_before(items, len(items))
    latest = start
    while start > 0 and not any(_sends_output(i) for i in items[start:end]):
        start, end = _turn_before(items, start)
    return start, end, latest


def _turn_before(items: Sequence[ConversationItem], end: int) -> tuple[int, int]:
    """(start, end) of the last model turn of items[:end]: a run of model output, the
    inputs after it left out."""
    while end > 0 and isinstance(items[end - 1], _INPUT_TYPES):
        end -= 1
    start = end
    while start > 0 and not isinstance(items[start - 1], _INPUT_TYPES):
        start -= 1
    return start, end


def _sends_output(item: ConversationItem) -> bool:
    """A model item a provider replays as output: a tool call, or text that is not blank."""
    return isinstance(item, ToolCall) or (
        isinstance(item, AssistantMessage) and bool(item.text.strip())
    )


# English names by ISO weekday index: strftime("%A") would follow the process locale.
_WEEKDAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")


def _runtime(inputs: BuildInputs) -> RuntimeMetadataItem:
    plan = inputs.plan
    return _runtime_item(
        inputs.now.date().isoformat(),
        _WEEKDAYS[inputs.now.weekday()],
        plan.time_zone,
        plan.principal_scope,
        plan.surface,
        tuple(plan.allowed_origins),
    )


# The same item for the same day and plan: its block and cost are then memo hits by
# identity, as a run's carried items are.
@bounded_cache(1024)
def _runtime_item(
    date: str,
    weekday: str,
    time_zone: str,
    principal_scope: str,
    surface: str,
    allowed_origins: tuple[str, ...],
) -> RuntimeMetadataItem:
    return RuntimeMetadataItem(
        item_id="runtime",
        date=date,
        weekday=weekday,
        time_zone=time_zone,
        principal_scope=principal_scope,
        surface=surface,
        allowed_origins=allowed_origins,
    )


def skill_body_texts(
    name: str, version: str, body: str, trust: TrustLevel, secret: bytes
) -> tuple[str, ...]:
    """Every text row 11 can send for this loaded body: rendered at `trust`, and at each
    less trusted level a Rotate may yet give its catalog entry (core/skills.py, Rule 6),
    one per form (bare, or each envelope's). LoadSkill holds the largest to the class's
    cap (an audit: it measured the body unescaped, and a body of tag-like text loaded at
    5,989 tokens was sent at 9,078 escaped; one lowered into an envelope grew too)."""
    forms: dict[str | None, str] = {}
    for level in TrustLevel:
        if level >= trust and level not in (TrustLevel.PLATFORM, TrustLevel.MODEL):
            form = envelope_tag(level)
            if form not in forms:
                item = SkillBodyItem(
                    item_id=f"skill-body:{name}", name=name, version=version, body=body, trust=level
                )
                forms[form] = _render(Row.SKILL_BODIES, item, secret).text or ""
    return tuple(forms.values())


def runtime_row_tokens(
    time_zone: str,
    principal_scope: str,
    surface: str,
    allowed_origins: Sequence[str],
    count_tokens: Callable[[str], int],
) -> int:
    """Row 14's cost for a plan of these values on any day, at the neutral factor: dated
    with the widest date and weekday, as runtime_row_cost. Every request carries the row
    and it never yields, so a body smaller than this fails its Builds on some day (Plan
    refuses such a capacity: core/plan.py require_capacity). Counted undated, it passed a
    body no day's row fitted (an audit)."""
    return runtime_row_cost(
        time_zone, principal_scope, surface, allowed_origins, count_tokens, NEUTRAL_FACTOR_PPM
    )


def runtime_row_cost(
    time_zone: str,
    principal_scope: str,
    surface: str,
    allowed_origins: Sequence[str],
    count_tokens: Callable[[str], int],
    factor_ppm: int,
) -> int:
    """Row 14's most cost for a plan of these values at `factor_ppm`, as Build pays it:
    dated with the widest date and weekday ("Wednesday"), so no day's row costs more. What
    LoadSkill leaves beside the loaded bodies (core/plan.py skill_room)."""
    return _runtime_row_cost(
        ("2026-09-30", "Wednesday"),
        time_zone,
        principal_scope,
        surface,
        allowed_origins,
        count_tokens,
        factor_ppm,
    )


# A costly id the server can give a seed message sent without one: a UUID whose letters
# and digits alternate counts 35 tokens under o200k and cl100k and 36 heuristic ones, where
# 20,000 random ones counted 15 to 31 and 19 to 36. Not the costliest: a review's search
# found one a token dearer, and a one-character message other than "." costs up to 5 more
# (an emoji), so the seed is charged _SEED_MARGIN_TOKENS beyond it.
_SERVER_SEED_ID = "a0b1c2d3-e4f5-4a6b-8c7d-9e0f1a2b3c4d"
_SEED_MARGIN_TOKENS = 8


def least_seed_cost(count_tokens: Callable[[str], int], factor_ppm: int) -> int:
    """What a top-level run's seed can cost at least, as Build pays it at `factor_ppm`: a
    one-character message under any id the server assigns (the usual case; a shorter id
    of the worker's costs up to 20 tokens less), in a new plan's envelope, whose decimal
    nonce counts the same under every secret (an older plan's hex one can cost a few tokens
    more). Every request of the run carries it and it never yields (an audit: Plan took a
    body that held the runtime row alone, and the shortest run then failed every Build; a
    child's seed, in its delegated envelope and under its run-derived id, costs more)."""
    item = UserMessage(item_id=_SERVER_SEED_ID, text=".")
    block = _render(Row.CONVERSATION, item, new_plan_secret(b""))
    return block_tokens(block, item, count_tokens, factor_ppm) + apply_factor(
        _SEED_MARGIN_TOKENS, factor_ppm
    )


def _runtime_row_cost(
    dated: tuple[str, str],
    time_zone: str,
    principal_scope: str,
    surface: str,
    allowed_origins: Sequence[str],
    count_tokens: Callable[[str], int],
    factor_ppm: int = NEUTRAL_FACTOR_PPM,
) -> int:
    """Row 14 rendered with `dated` (date, weekday) and costed as a block at `factor_ppm`."""
    item = _runtime_item(*dated, time_zone, principal_scope, surface, tuple(allowed_origins))
    block = _render(Row.RUNTIME_METADATA, item, b"")
    return block_tokens(block, item, count_tokens, factor_ppm)


# --- rendering -------------------------------------------------------------------------


def _messages(
    fitted: Fitted, secret: bytes
) -> tuple[tuple[Message, ...], list[Sequence[Block] | ClosedRun], RepeatedRun]:
    """Render the placed items to blocks and merge consecutive same-role blocks into
    messages; also the blocks as runs, for validate_block_runs, and where the carried
    suffix's interior lies among the messages (ModelRequest.repeated).

    The carried suffix comes rendered and merged (core/carried.py, Retained); the items
    before it (the summary) and after it (the run's items, the fresh rows) are rendered
    here, `fitted.truncated` naming those whose envelope is marked truncated. Merging is
    the same wherever the groups come from: only the suffix's first and last message can
    merge with a neighbour, so its interior is carried as it is."""
    retained = fitted.retained
    assert retained is not None  # every fitting body has one
    at, end = fitted.retained_at, fitted.retained_at + len(retained.pairs)
    before, after = fitted.placed[:at], fitted.placed[end:]
    head = [_rendered(row, item, secret, id(item) in fitted.truncated) for row, item in before]
    tail = [_rendered(row, item, secret, id(item) in fitted.truncated) for row, item in after]
    leading = grouped([item for _, item in before], head)
    messages = joined((leading, retained.messages, grouped([item for _, item in after], tail)))
    # The suffix's first message is the one after `leading`, or merged into its last.
    first = len(leading) - (
        1 if leading and retained.messages and leading[-1].role == retained.messages[0].role else 0
    )
    repeated = RepeatedRun(messages, first + 1, retained.interior)
    return messages, [head, retained.closed or retained.blocks, tail], repeated


def _render(row: Row, item: ContextItem, secret: bytes, truncated: bool = False) -> Block:
    """One Region B item's block. Exhaustive; an unknown item type raises."""
    trust = trust_of(item)
    seq = getattr(item, "sequence", 0)

    def configured(body: str) -> str:
        # Rendered bare in the user role but not the platform's: delimiter syntax in it is
        # escaped as an envelope's content is, so a skill body, a passage or a tool result
        # at TRUSTED_CONFIGURATION forges no <user> envelope (an audit; @16 and older sent
        # it verbatim).
        return escape_content(body) if trust is TrustLevel.TRUSTED_CONFIGURATION else body

    def text(body: str, source: str, tag: str | None = None) -> Block:
        rendered = wrap(
            configured(body),
            trust=trust,
            item_id=item.item_id,
            source=source,
            secret=secret,
            tag=tag,
        )
        return Block(row, trust, "text", item.item_id, seq, text=rendered)

    match item:
        case DelegatedMessage():  # before UserMessage, which it is too
            return text(item.text, "parent agent", DELEGATED_TAG)
        case UserMessage():
            return text(item.text, "user")
        case AssistantMessage():
            return Block(
                row,
                trust,
                "text",
                item.item_id,
                seq,
                text=item.text,
                provider_item_id=item.provider_item_id,
            )
        case ToolCall():
            return Block(
                row,
                trust,
                "tool_call",
                item.item_id,
                seq,
                call_id=item.call_id,
                tool_name=item.tool_name,
                arguments_json=item.arguments_json,
                run_id=item.run_id,
                provider_item_id=item.provider_item_id,
            )
        case ToolResult():
            # The tool pipeline's excerpt stands in for the content: marked truncated, as
            # the engine's own excerpts and pointers are (build_record.py, @9).
            content = item.context_content or item.content
            truncated = truncated or excerpted(item)
            source = item.source or f"tool:{item.tool_name}"
            return Block(
                row,
                trust,
                "tool_result",
                item.item_id,
                seq,
                text=wrap(
                    configured(content),
                    trust=trust,
                    item_id=item.item_id,
                    source=source,
                    secret=secret,
                    truncated=truncated,
                ),
                call_id=item.call_id,
                tool_name=item.tool_name,
                is_error=item.is_error,
                artifact_ref=item.artifact_ref,
                run_id=item.run_id,
            )
        case ReasoningItem():
            return Block(
                row,
                trust,
                "reasoning",
                item.item_id,
                seq,
                provider=item.provider,
                opaque=item.opaque,
            )
        case SummaryItem():
            return text(
                "Summary of earlier conversation (platform record):\n" + item.text, "summary"
            )
        case SkillBodyItem():
            return text(body_text(item.name, item.version, item.body), f"skill:{item.name}")
        case WorkingStateItem():
            return text(item.text, "working-state")
        case CorrectionLineItem():
            return text(
                f"Correction (overrides the snapshot): {item.text}", item.source or "memory"
            )
        case RecallLineItem():
            return text(item.text, item.source or "memory")
        case KnowledgePassageItem():
            # A passage is a quotation the model may cite. Enveloped, its citation is the
            # envelope's source; bare (TRUSTED_CONFIGURATION), it leads the text, as a
            # snapshot memory's source does (an audit: it was dropped, @15 and older).
            if envelope_tag(trust) is None and item.citation:
                return text(f"[{item.citation}] {item.text}", item.citation)
            return text(item.text, item.citation or "knowledge")
        case RuntimeMetadataItem():
            return text(_runtime_text(item), "runtime")
    raise TypeError(f"no Region B renderer for {type(item).__name__}")


def _runtime_text(item: RuntimeMetadataItem) -> str:
    lines = [
        "Runtime context:",
        f"- today: {item.date} ({item.weekday}), time zone {item.time_zone}",
    ]
    if item.principal_scope:
        lines.append(f"- acting for: {item.principal_scope}")
    if item.surface:
        lines.append(f"- surface: {item.surface}")
    if item.allowed_origins:
        lines.append("- browser.navigate accepts: " + ", ".join(item.allowed_origins))
    return "\n".join(lines)
