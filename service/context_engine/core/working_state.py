"""Working state: the run's structured record, changed by typed transitions only.

Rule 1 (writers): three writers, each allowed a fixed set of fields (WRITER_FIELDS). The
model writes through the context.update_working_state control tool, the user directly, the
runtime only what it observes: task states on tool outcomes, and the questions
conversation.ask_user asks and their answers (`runtime_update`). Nobody's prose is parsed.
Rule 2 (protection): only the user may remove a constraint the user set, or supersede an
objective the user set (CONSTRAINT_PROTECTED). The model may remove its own constraints.
Nor may the model resolve a question the user asked, or one whose ask_user call in the run
awaits its answer (`pending_questions`): questions carry until an answer resolves them,
never the model deciding to forget.
A writer that states an existing constraint or the current objective again takes it over
when it ranks above the entry's writer (WRITER_RANK: the user above the model), so a
constraint the user also stated is the user's; restating never lowers an entry's writer.
Rule 3 (bounds): LIST_CAPS. Constraints never evict: at the cap add_constraints fails
(WORKING_STATE_CAP) and nothing changes. Tasks, facts and open questions evict at their
caps: completed entries first, then the stalest (oldest last-written sequence) first, a
task in progress after every other task (the block hides over its token cap by age alone); open
questions the model's and the runtime's before the user's, so the model cannot push out a
question of the user's it may not resolve by asking questions of its own.
The caps apply after a whole update is merged, so UpdateWorkingState refuses at input an
update carrying more than MAX_UPDATE_ENTRIES entries in a list field (twice its cap), and
a transition finds each entry's match by its key (text, task id, statement), never by a
scan: its cost is linear in what it carries.
Rule 4 (block): the rendered block is capped at BLOCK_TOKENS. Evictable entries are hidden
at render in the same order (the state and the log keep them); objective, constraints and
next_action never hide, so a transition that would put them alone, with the longest note
of what is hidden, over the cap fails: every evictable entry stays hideable.
Rule 5 (trust): every entry records its writer, trust and source sequence. A fact's trust
is the lowest of its claim and its sources' (`lowest_trust`); below USER it renders only as
an attributed claim with its source event ids, and where its trust has an envelope, inside
that nonced envelope. Every entry's text is delimiter-escaped, and continuation lines are
indented, so no entry can close an envelope or start a line that forges an attribution.
The writer's label comes before any written text on every entry's line ("Objective: [user
#4] ...", "- [model #7] Task "t1" (open): ...", "- [model #9] Established (events #3):
..."), and a task id is quoted as a JSON string, so no written text can pass for a label.
A fact resting on the user's events is established whoever wrote it (the spec: what the
session concluded, a formation candidate; one resting on TRUSTED_CONFIGURATION events
renders established too, but is no candidate: a tool's output is no user source), so its
line names the writer too: the model
reading "[model #9] Established" knows the conclusion was its own. A question the runtime
added carries the model's trust (_WRITER_TRUST: its conversation.ask_user text) and says
so ("- [runtime #6] the model asked: ..."), so the model's words never read as the
runtime's.
Rule 6 (carry): a new run's state is a fold over the log's working-state events (`carry`),
never a copy of a checkpoint; each run boundary applies CARRY_RULES. The fold refuses no
constraint again, neither at Rule 3's cap nor at Rule 4's ceiling: what overlapping runs
wrote together, or what a new model's counter makes longer, carries whole. A state whose
never-hiding fields do not fit the block then fails every Build with BUDGET_EXCEEDED
(class working_state) until the user removes constraints: constraints never evict, and a
loss the user would notice is never silent (the spec).
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum, IntEnum
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict

from .enums import SideEffect
from .envelope import escape_content, wrap
from .errors import BudgetExceededError, InvalidFieldError, PreconditionError, RequestError
from .items import ConversationItem, ToolCall, ToolResult, WorkingStateItem
from .spec import ToolSpec
from .trust import TrustLevel, envelope_tag

__all__ = [
    "ASK_USER_TOOL",
    "BLOCK_TOKENS",
    "CARRY_RULES",
    "COMPLETED",
    "LIST_CAPS",
    "MAX_ENTRY_CHARS",
    "MAX_FACT_SOURCES",
    "MAX_UPDATE_ENTRIES",
    "SOURCE_TRUST_OF_EVENT",
    "UPDATE_TOOL",
    "UPDATE_TOOL_NAME",
    "WRITER_FIELDS",
    "WRITER_RANK",
    "Carry",
    "Entry",
    "Fact",
    "Folded",
    "LoggedUpdate",
    "NewFact",
    "Task",
    "TaskStatus",
    "TaskUpsert",
    "Transition",
    "WorkingState",
    "WorkingStateUpdate",
    "Writer",
    "apply_update",
    "at_run_boundary",
    "carry",
    "check_fact_sources",
    "check_update_sizes",
    "evidence_trust",
    "fold",
    "lowest_trust",
    "pending_questions",
    "render_block",
    "require_writer_fields",
    "runtime_update",
    "source_trust",
]

TokenCounter = Callable[[str], int]
T = TypeVar("T")


class Writer(IntEnum):
    """Numbering matches the proto's Writer."""

    MODEL = 1
    USER = 2
    RUNTIME = 3


class TaskStatus(IntEnum):
    """Numbering matches the proto's TaskStatus."""

    OPEN = 1
    IN_PROGRESS = 2
    BLOCKED = 3
    DONE = 4
    CANCELLED = 5


COMPLETED = frozenset({TaskStatus.DONE, TaskStatus.CANCELLED})

LIST_CAPS: dict[str, int] = {"constraints": 20, "tasks": 30, "facts": 40, "open_questions": 20}
BLOCK_TOKENS = 1_000
# An entry longer than this could never render inside the block; refuse it up front.
MAX_ENTRY_CHARS = 2_000
MAX_TASK_ID_CHARS = 200
# The most entries one UpdateWorkingState may carry in each list field: twice the list's
# cap, room to touch every entry the list can hold and add as many new ones (a whole new
# task list beside the old one marked done). More could never be kept: the caps apply
# after the update is merged, so the excess would only cost work under the session lock
# and a log entry every later run replays. Checked at input (`check_update_sizes`), not by
# `apply_update`: the log fold replays what was accepted before, and the runtime's own
# writes follow the items of one append, one entry per item at most.
MAX_UPDATE_ENTRIES: dict[str, int] = {
    "remove_constraints": 2 * LIST_CAPS["constraints"],
    "add_constraints": 2 * LIST_CAPS["constraints"],
    "upsert_tasks": 2 * LIST_CAPS["tasks"],
    "add_facts": 2 * LIST_CAPS["facts"],
    "add_questions": 2 * LIST_CAPS["open_questions"],
    "resolve_questions": 2 * LIST_CAPS["open_questions"],
}

# The most evidence one fact of an update may cite, and each once: a fact rests on a few
# events. Without a bound one update could cite millions (every StartRun folds it again,
# and every later Build renders it), so it is refused at input like a long list. A
# statement restated merges its evidence (_add_facts), which the session's own events
# bound: each cited event must exist.
MAX_FACT_SOURCES = 32

# The trust an entry of each writer carries. A runtime entry is an open question copied
# from the model's conversation.ask_user call, so it is the model's text.
_WRITER_TRUST: dict[Writer, TrustLevel] = {
    Writer.MODEL: TrustLevel.MODEL,
    Writer.USER: TrustLevel.USER,
    Writer.RUNTIME: TrustLevel.MODEL,
}

_ALL_FIELDS = frozenset(
    {
        "objective",
        "add_constraints",
        "remove_constraints",
        "upsert_tasks",
        "add_facts",
        "add_questions",
        "resolve_questions",
        "next_action",
    }
)
# Which fields each writer may touch (Rule 1). Questions are added by the runtime when
# conversation.ask_user fires; the runtime touches nothing it does not observe.
WRITER_FIELDS: dict[Writer, frozenset[str]] = {
    Writer.MODEL: _ALL_FIELDS - {"add_questions"},
    Writer.USER: _ALL_FIELDS,
    Writer.RUNTIME: frozenset({"upsert_tasks", "add_questions", "resolve_questions"}),
}

# Who may undo whose objective and constraints (Rule 2): a writer may remove or supersede
# an entry of equal or lower rank, and takes over an entry it restates of lower rank. The
# runtime ranks with the model: its entries are the model's text (_WRITER_TRUST), and it
# may not write the objective or constraints anyway.
WRITER_RANK: dict[Writer, int] = {Writer.MODEL: 0, Writer.RUNTIME: 0, Writer.USER: 1}


def _outranks(writer: Writer, owner: Writer) -> bool:
    return WRITER_RANK[writer] > WRITER_RANK[owner]


# The proto numbers trust levels from most to least trusted, so "lowest" is the largest.
_ASSERTED = frozenset({TrustLevel.PLATFORM, TrustLevel.TRUSTED_CONFIGURATION, TrustLevel.USER})

# The trust of a fact source, by the event type it is logged as. Events of any other type
# are not evidence a fact can rest on.
SOURCE_TRUST_OF_EVENT: dict[str, TrustLevel | None] = {
    "user.message.created": TrustLevel.USER,
    "assistant.message.created": TrustLevel.MODEL,
    "tool.call.created": TrustLevel.MODEL,
    "tool.result.created": None,  # the result's own trust, from its payload
}

ASK_USER_TOOL = "conversation.ask_user"
UPDATE_TOOL_NAME = "context.update_working_state"


# --- the model -----------------------------------------------------------------------------


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Entry(_Frozen):
    text: str
    writer: Writer
    source_sequence: int  # the context.working_state.updated event that wrote it
    trust: TrustLevel


class Task(_Frozen):
    task_id: str
    title: str
    status: TaskStatus
    writer: Writer
    source_sequence: int  # last written; the age eviction reads


class Fact(_Frozen):
    statement: str
    source_event_ids: tuple[int, ...]
    trust: TrustLevel
    writer: Writer
    source_sequence: int


class WorkingState(_Frozen):
    objective: Entry | None = None
    constraints: tuple[Entry, ...] = ()
    tasks: tuple[Task, ...] = ()  # first-seen order; completed ones until the run ends
    facts: tuple[Fact, ...] = ()
    open_questions: tuple[Entry, ...] = ()
    next_action: Entry | None = None

    def is_empty(self) -> bool:
        # Against one empty state made once: a model made per call was a Build's cost.
        return self == _EMPTY_STATE


_EMPTY_STATE = WorkingState()


class TaskUpsert(_Frozen):
    task_id: str
    title: str = ""  # empty: keep the title (required for a new task)
    status: TaskStatus | None = None  # None: keep (OPEN for a new task)


class NewFact(_Frozen):
    statement: str
    source_event_ids: tuple[int, ...]
    trust: TrustLevel  # already lowered to its sources' (`lowest_trust`)


class WorkingStateUpdate(_Frozen):
    """One typed transition. Fields apply in declaration order (removals before additions,
    so a constraint can be replaced at the cap)."""

    objective: str | None = None
    remove_constraints: tuple[str, ...] = ()
    add_constraints: tuple[str, ...] = ()
    upsert_tasks: tuple[TaskUpsert, ...] = ()
    add_facts: tuple[NewFact, ...] = ()
    add_questions: tuple[str, ...] = ()
    resolve_questions: tuple[str, ...] = ()
    next_action: str | None = None

    def touched(self) -> frozenset[str]:
        return frozenset(
            name
            for name in _ALL_FIELDS
            if getattr(self, name) is not None and getattr(self, name) != ()
        )


@dataclass(frozen=True, slots=True)
class Transition:
    state: WorkingState
    evicted: dict[str, list[str]]  # list name -> what its cap pushed out, oldest first
    superseded_objective: str | None  # recorded, never silently replaced


def lowest_trust(levels: Iterable[TrustLevel]) -> TrustLevel:
    """The least trusted of `levels` (PLATFORM when there are none)."""
    return max(levels, default=TrustLevel.PLATFORM)


def evidence_trust(
    event_type: str, payload: dict[str, Any], conversation: bool
) -> TrustLevel | None:
    """source_trust of an event, no higher than MODEL when it is not the session's
    conversation: a child run's "user" is its parent agent, so its messages are the model's
    words, not the user's (and never a trusted user source for formation)."""
    level = source_trust(event_type, payload)
    if level is None or conversation:
        return level
    return lowest_trust([level, TrustLevel.MODEL])


def source_trust(event_type: str, payload: dict[str, Any]) -> TrustLevel | None:
    """The trust of a logged event as fact evidence, or None when it cannot be evidence."""
    if event_type not in SOURCE_TRUST_OF_EVENT:
        return None
    fixed = SOURCE_TRUST_OF_EVENT[event_type]
    if fixed is not None:
        return fixed
    try:
        return TrustLevel(int(payload.get("trust", TrustLevel.EXTERNAL_UNTRUSTED)))
    except (TypeError, ValueError):
        return TrustLevel.EXTERNAL_UNTRUSTED


# --- transitions -------------------------------------------------------------------------


def check_update_sizes(sizes: Mapping[str, int], field: str = "update") -> None:
    """Refuse an update carrying more entries in a list field than MAX_UPDATE_ENTRIES
    allows, given each list field's length (before any of it is read).

    Raises:
        InvalidFieldError: naming the first list field over its limit (`update.add_facts`).
    """
    for name, limit in MAX_UPDATE_ENTRIES.items():
        size = sizes.get(name, 0)
        if size > limit:
            raise InvalidFieldError(
                f"{field}.{name} carries {size} entries; an update carries at most {limit}"
                " (twice the list's cap)",
                field=f"{field}.{name}",
                metadata={"limit": str(limit), "entries": str(size)},
            )


def check_fact_sources(ids: Sequence[Hashable], field: str, *, also: int = 0) -> None:
    """Refuse a fact citing more than MAX_FACT_SOURCES events in all (`also`: how many it
    cites in its other list), or one twice (`field`: the fact's source_event_ids or
    source_item_ids). At input only, as check_update_sizes: the log fold replays what was
    accepted before.

    Raises:
        InvalidFieldError: naming `field`.
    """
    if len(ids) + also > MAX_FACT_SOURCES:
        raise InvalidFieldError(
            f"{field} cites {len(ids) + also} events in all; a fact cites at most"
            f" {MAX_FACT_SOURCES}",
            field=field,
            metadata={"limit": str(MAX_FACT_SOURCES), "entries": str(len(ids) + also)},
        )
    if len(set(ids)) != len(ids):
        raise InvalidFieldError(f"{field} cites an event twice", field=field)


@dataclass(frozen=True, slots=True)
class _Ctx:
    writer: Writer
    sequence: int
    folding: bool = False  # replaying the log (`carry`): constraints are never refused
    # Questions whose conversation.ask_user call in the run has no result yet.
    pending: frozenset[str] = frozenset()

    def entry(self, text: str) -> Entry:
        return Entry(
            text=text,
            writer=self.writer,
            source_sequence=self.sequence,
            trust=_WRITER_TRUST[self.writer],
        )


def _text(value: str, field: str) -> str:
    if not value.strip():
        raise InvalidFieldError(f"{field} must not be empty", field=field)
    if len(value) > MAX_ENTRY_CHARS:
        raise InvalidFieldError(f"{field} is longer than {MAX_ENTRY_CHARS} characters", field=field)
    return value


def _set_objective(state: WorkingState, value: str, ctx: _Ctx) -> WorkingState:
    _text(value, "update.objective")
    current = state.objective
    if current is not None and current.text == value:
        # Restated: the stronger writer owns it from now on (Rule 2), so a model cannot
        # supersede an objective the user has also stated.
        if _outranks(ctx.writer, current.writer):
            return state.model_copy(update={"objective": ctx.entry(value)})
        return state
    if current is not None and _outranks(current.writer, ctx.writer):
        raise PreconditionError(
            "the objective was set by the user; only the user can supersede it",
            field="update.objective",
            reason="CONSTRAINT_PROTECTED",
            metadata={"writer": current.writer.name},
        )
    return state.model_copy(update={"objective": ctx.entry(value)})


def _remove_constraints(state: WorkingState, values: tuple[str, ...], ctx: _Ctx) -> WorkingState:
    kept = list(state.constraints)
    for n, text in enumerate(values):
        field = f"update.remove_constraints[{n}]"
        found = next((c for c in kept if c.text == text), None) or next(
            (c for c in kept if _one(c.text) == text), None
        )
        if found is None:
            raise InvalidFieldError("no such constraint (exact text required)", field=field)
        if _outranks(found.writer, ctx.writer):
            raise PreconditionError(
                "the user set this constraint; only the user can remove it",
                field=field,
                reason="CONSTRAINT_PROTECTED",
            )
        kept.remove(found)
    return state.model_copy(update={"constraints": tuple(kept)})


def _add_constraints(state: WorkingState, values: tuple[str, ...], ctx: _Ctx) -> WorkingState:
    constraints = list(state.constraints)
    # Each text's first position, for a lookup per entry instead of a scan (Rule 3's cap
    # is checked only after the whole list, so the list may be long).
    where: dict[str, int] = {}
    for i, c in enumerate(constraints):
        where.setdefault(c.text, i)
    for n, text in enumerate(values):
        _text(text, f"update.add_constraints[{n}]")
        at = where.get(text)
        if at is None:
            where[text] = len(constraints)
            constraints.append(ctx.entry(text))
        elif _outranks(ctx.writer, constraints[at].writer):
            # The user stating the model's constraint makes it the user's (Rule 2), in place.
            constraints[at] = ctx.entry(text)
    cap = LIST_CAPS["constraints"]
    # Only an update that adds one: a state carried over the cap (two overlapping runs'
    # constraints together) refused a restatement, the user's taking the model's over, even
    # beside a removal (an audit), where docs/api.md says it can still shrink or restate.
    grows = len(constraints) > len(state.constraints)
    if len(constraints) > cap and grows and not ctx.folding:
        raise PreconditionError(
            f"working state holds at most {cap} constraints and they never evict; remove one"
            " (the user, or the model for its own) before adding another",
            field="update.add_constraints",
            reason="WORKING_STATE_CAP",
            # `current` counts what this update's removals left; `would_hold` what its
            # additions would make of it (`current` alone read as room where there was
            # none: 19 of 20 left, two to add).
            metadata={
                "list": "constraints",
                "cap": str(cap),
                "current": str(len(state.constraints)),
                "would_hold": str(len(constraints)),
            },
        )
    return state.model_copy(update={"constraints": tuple(constraints)})


def _upsert_tasks(state: WorkingState, values: tuple[TaskUpsert, ...], ctx: _Ctx) -> WorkingState:
    tasks = list(state.tasks)
    where: dict[str, int] = {}  # each task id's first position: a lookup, not a scan
    for i, t in enumerate(tasks):
        where.setdefault(t.task_id, i)
    for n, upsert in enumerate(values):
        field = f"update.upsert_tasks[{n}]"
        if not upsert.task_id or len(upsert.task_id) > MAX_TASK_ID_CHARS:
            raise InvalidFieldError(
                f"task_id is required (at most {MAX_TASK_ID_CHARS} characters)",
                field=f"{field}.task_id",
            )
        if upsert.title:
            _text(upsert.title, f"{field}.title")
        at = where.get(upsert.task_id)
        if at is None:
            if ctx.writer is Writer.RUNTIME:
                raise InvalidFieldError(
                    f"no task {upsert.task_id!r} in the working state",
                    field=f"{field}.task_id",
                )
            if not upsert.title:
                raise InvalidFieldError("a new task needs a title", field=f"{field}.title")
            where[upsert.task_id] = len(tasks)
            tasks.append(
                Task(
                    task_id=upsert.task_id,
                    title=upsert.title,
                    status=upsert.status or TaskStatus.OPEN,
                    writer=ctx.writer,
                    source_sequence=ctx.sequence,
                )
            )
            continue
        old = tasks[at]
        # A new title is its writer's; the user restating the model's is the user's (the
        # stronger writer wins, Rule 2, as for a constraint).
        retitled = bool(upsert.title) and (
            upsert.title != old.title or _outranks(ctx.writer, old.writer)
        )
        tasks[at] = old.model_copy(
            update={
                "title": upsert.title or old.title,
                "status": upsert.status or old.status,
                # The label says who wrote the title, and when: a new one is its writer's
                # (an audit: the model's title showed as the user's). A status alone keeps
                # both, so no label pairs one writer with another's event (a review).
                "source_sequence": ctx.sequence if retitled else old.source_sequence,
                "writer": ctx.writer if retitled else old.writer,
            }
        )
    return state.model_copy(update={"tasks": tuple(tasks)})


@dataclass(slots=True)
class _Written:
    """A fact this transition writes, its evidence merged in place as it is restated."""

    statement: str
    ids: set[int]
    trust: TrustLevel
    # The writer of the fact it restates where that writer ranks above this transition's:
    # restating never lowers a fact's writer, as for the other entries (an audit: the
    # model restating the user's fact made it the model's, offered as its conclusion).
    owner: Writer | None = None
    owner_sequence: int = 0  # the event that wrote it as the owner's: its label's number


def _take(slots: deque[int] | None, gone: set[int]) -> int | None:
    """The first of `slots` not taken yet (`gone`), taken; None when there is none."""
    while slots:
        at = slots.popleft()
        if at not in gone:
            return at
    return None


def _positions(keys: Iterable[str]) -> dict[str, deque[int]]:
    """Each key's positions in `keys`, first first: the entry a text names without a scan."""
    where: dict[str, deque[int]] = {}
    for i, key in enumerate(keys):
        where.setdefault(key, deque()).append(i)
    return where


def _add_facts(state: WorkingState, values: tuple[NewFact, ...], ctx: _Ctx) -> WorkingState:
    # The facts by slot, in list order: a restated fact leaves its slot for a new one at
    # the end (a dict deletion and insertion, not a list pop and append), and `where` finds
    # the first fact of a statement, so each entry costs the same however many came before.
    live: dict[int, Fact | _Written] = dict(enumerate(state.facts))
    where = _positions(f.statement for f in state.facts)
    for n, new in enumerate(values):
        field = f"update.add_facts[{n}]"
        _text(new.statement, f"{field}.statement")
        if not new.source_event_ids or any(i < 1 for i in new.source_event_ids):
            raise InvalidFieldError(
                "a fact needs the events it rests on: source_item_ids (the ids its items'"
                " envelopes show) or source_event_ids (their session sequences)",
                field=f"{field}.source_event_ids",
            )
        written = _Written(new.statement, set(new.source_event_ids), new.trust)
        slots = where.setdefault(new.statement, deque())
        if slots:
            # The same statement again: one entry resting on the union of its evidence, as
            # trusted as the least trusted evidence.
            old = live.pop(slots.popleft())
            if isinstance(old, Fact):
                written.ids.update(old.source_event_ids)
                if _outranks(old.writer, ctx.writer):
                    written.owner, written.owner_sequence = old.writer, old.source_sequence
            else:  # written earlier in this transition: merge into it, not a copy of it
                old.ids.update(written.ids)
                written.ids = old.ids
                written.owner, written.owner_sequence = old.owner, old.owner_sequence
            written.trust = lowest_trust((old.trust, new.trust))
        slot = len(state.facts) + n
        live[slot] = written
        slots.append(slot)
    facts = tuple(
        fact
        if isinstance(fact, Fact)
        else Fact(
            statement=fact.statement,
            source_event_ids=tuple(sorted(fact.ids)),
            trust=fact.trust,
            writer=fact.owner or ctx.writer,
            source_sequence=fact.owner_sequence if fact.owner else ctx.sequence,
        )
        for fact in live.values()
    )
    return state.model_copy(update={"facts": facts})


def _add_questions(state: WorkingState, values: tuple[str, ...], ctx: _Ctx) -> WorkingState:
    questions = list(state.open_questions)
    where: dict[str, int] = {}  # each text's first position: a lookup, not a scan
    for i, q in enumerate(questions):
        where.setdefault(q.text, i)
    for n, text in enumerate(values):
        _text(text, f"update.add_questions[{n}]")
        at = where.get(text)
        if at is None:
            where[text] = len(questions)
            questions.append(ctx.entry(text))
        elif _outranks(ctx.writer, questions[at].writer):
            # The user asking the model's question makes it the user's (Rule 2), in place,
            # as a constraint: the model may then not resolve it (an audit: it could).
            questions[at] = ctx.entry(text)
    return state.model_copy(update={"open_questions": tuple(questions)})


def _resolve_questions(state: WorkingState, values: tuple[str, ...], ctx: _Ctx) -> WorkingState:
    questions = state.open_questions
    # The runtime adds and resolves in one transition (asked and answered in one append),
    # so the list may be long: find each question by its text, not by a scan.
    where = _positions(q.text for q in questions)
    shown: dict[str, deque[int]] | None = None  # by the text as the block shows it
    gone: set[int] = set()
    for n, text in enumerate(values):
        at = _take(where.get(text), gone)
        if at is None:
            shown = shown if shown is not None else _positions(_one(q.text) for q in questions)
            at = _take(shown.get(text), gone)
        if at is None:
            raise InvalidFieldError(
                "no such open question (exact text required)",
                field=f"update.resolve_questions[{n}]",
            )
        if not ctx.folding:
            _may_resolve(questions[at], ctx, n)
        gone.add(at)
    kept = tuple(q for i, q in enumerate(questions) if i not in gone)
    return state.model_copy(update={"open_questions": kept})


def _may_resolve(question: Entry, ctx: _Ctx, n: int) -> None:
    """Open questions carry until an answer resolves them, never the model deciding to
    forget (the spec): the model may not resolve one the user asked, nor one whose ask_user
    call in this run awaits its answer (the answer, through the runtime, resolves it)."""
    if ctx.writer is not Writer.MODEL:
        return
    if question.writer is Writer.USER:
        why = "the user asked it"
    elif question.text in ctx.pending:
        why = "its conversation.ask_user call awaits the answer, which resolves it"
    else:
        return
    raise PreconditionError(
        f"the model may not resolve this question: {why}",
        field=f"update.resolve_questions[{n}]",
        reason="CONSTRAINT_PROTECTED",
    )


def pending_questions(items: Sequence[ConversationItem]) -> frozenset[str]:
    """The questions of the conversation.ask_user calls in `items` that no result answers."""
    answered = {i.call_id for i in items if isinstance(i, ToolResult)}
    return frozenset(
        question
        for item in items
        if isinstance(item, ToolCall)
        and item.tool_name == ASK_USER_TOOL
        and item.call_id not in answered
        and (question := _ask_user_question(item)) is not None
    )


def _set_next_action(state: WorkingState, value: str, ctx: _Ctx) -> WorkingState:
    if value and len(value) > MAX_ENTRY_CHARS:
        raise InvalidFieldError(
            f"update.next_action is longer than {MAX_ENTRY_CHARS} characters",
            field="update.next_action",
        )
    # An empty next_action clears it: the turn's scratchpad is done.
    return state.model_copy(update={"next_action": ctx.entry(value) if value.strip() else None})


# The transition, one step per field, in the order they apply.
_STEPS: tuple[tuple[str, Callable[[WorkingState, Any, _Ctx], WorkingState]], ...] = (
    ("objective", _set_objective),
    ("remove_constraints", _remove_constraints),
    ("add_constraints", _add_constraints),
    ("upsert_tasks", _upsert_tasks),
    ("add_facts", _add_facts),
    ("add_questions", _add_questions),
    ("resolve_questions", _resolve_questions),
    ("next_action", _set_next_action),
)


def _evict(
    entries: tuple[T, ...], cap: int, key: Callable[[T], tuple[int, int]]
) -> tuple[tuple[T, ...], list[T]]:
    """Keep at most `cap` entries, dropping the smallest `key` first (ties: oldest index)."""
    if len(entries) <= cap:
        return entries, []
    order = sorted(range(len(entries)), key=lambda i: (*key(entries[i]), i))
    dropped = order[: len(entries) - cap]  # in eviction order
    drop = set(dropped)
    return tuple(e for i, e in enumerate(entries) if i not in drop), [entries[i] for i in dropped]


def _task_age(t: Task) -> tuple[int, int]:
    return (0 if t.status in COMPLETED else 1, t.source_sequence)


def _task_eviction_age(t: Task, written: frozenset[str]) -> tuple[int, int]:
    """_task_age, with a task in progress, or one the update being applied upserts (its id
    in `written`), after every other open task: a status change keeps a task's sequence
    (its label's), so by age alone the task the run works on was evicted before open tasks
    added after it, and the run's next call naming it was refused (an audit); and an update
    must not evict a task it writes (reviews: a new one with 30 in progress, a status
    changed among 30 open). Eviction only: the block hides tasks over its token cap by
    _task_age still, as the requests recorded since context-assembler@14 were rendered."""
    if t.status in COMPLETED:
        return (0, t.source_sequence)
    working = t.status is TaskStatus.IN_PROGRESS or t.task_id in written
    return (2 if working else 1, t.source_sequence)


def _fact_age(f: Fact, stated: frozenset[str] = frozenset()) -> tuple[int, int]:
    """A fact the update being applied states (its statement in `stated`) after every
    other: one restated keeps its owner's sequence (_Written.owner), so by age alone the
    update that restated it evicted it (a review)."""
    return (2 if f.statement in stated else 1, f.source_sequence)


def _question_age(e: Entry) -> tuple[int, int]:
    return (WRITER_RANK[e.writer], e.source_sequence)


def _bound_lists(
    state: WorkingState, written: frozenset[str], stated: frozenset[str] = frozenset()
) -> tuple[WorkingState, dict[str, list[str]]]:
    """Rule 3 for the evicting lists, after an update upserting the tasks `written` and
    stating the facts `stated`."""
    tasks, gone_tasks = _evict(
        state.tasks, LIST_CAPS["tasks"], lambda t: _task_eviction_age(t, written)
    )
    facts, gone_facts = _evict(state.facts, LIST_CAPS["facts"], lambda f: _fact_age(f, stated))
    questions, gone_q = _evict(state.open_questions, LIST_CAPS["open_questions"], _question_age)
    evicted = {
        name: values
        for name, values in (
            ("tasks", [t.task_id for t in gone_tasks]),
            ("facts", [f.statement for f in gone_facts]),
            ("open_questions", [q.text for q in gone_q]),
        )
        if values
    }
    bounded = state.model_copy(update={"tasks": tasks, "facts": facts, "open_questions": questions})
    return bounded, evicted


# Fields whose entries never hide, and so may not grow the block past its cap.
_FIXED_FIELDS = ("add_constraints", "objective", "next_action")


def _merged(state: WorkingState, update: WorkingStateUpdate, ctx: _Ctx) -> WorkingState:
    """The update's fields applied in the order a transition applies them (_STEPS), before
    Rule 3's caps, which apply once to the whole update (apply_update, _replay).

    Raises:
        InvalidFieldError, PreconditionError: as apply_update.
    """
    require_writer_fields(update, ctx.writer)
    for name, step in _STEPS:
        value = getattr(update, name)
        if value is None or value == ():
            continue
        state = step(state, value, ctx)
    return state


def _largest(
    before: WorkingState,
    update: WorkingStateUpdate,
    grown: list[str],
    count_tokens: Callable[[str], int],
) -> str:
    """Of the fixed fields `update` touches, the one that grows the block most over
    `before`: what the cap's refusal names (an audit: it named a one-character constraint
    beside a long next action, the first of a fixed order; a review: a restated
    objective, which grew nothing, beside a new constraint)."""
    held = {c.text for c in before.constraints}
    was = {
        "objective": before.objective.text if before.objective is not None else "",
        "next_action": before.next_action.text if before.next_action is not None else "",
    }

    def growth(name: str) -> int:
        if name == "add_constraints":  # net of the held ones the update removes
            added = sum(count_tokens(c) for c in update.add_constraints if c not in held)
            gone = {c for c in update.remove_constraints if c in held}
            return added - sum(count_tokens(c) for c in gone - set(update.add_constraints))
        return count_tokens(getattr(update, name) or "") - count_tokens(was[name])

    return max(grown, key=growth)


def require_writer_fields(update: WorkingStateUpdate, writer: Writer) -> None:
    """Rule 1: `writer` may set every field `update` touches.

    Raises:
        InvalidFieldError: naming the first field it may not set.
    """
    forbidden = sorted(update.touched() - WRITER_FIELDS[writer])
    if forbidden:
        raise InvalidFieldError(
            f"the {writer.name.lower()} writer may not set {forbidden[0]}",
            field=f"update.{forbidden[0]}",
        )


def _stated(update: WorkingStateUpdate) -> frozenset[str]:
    """The fact statements an update writes, which its own caps do not evict (_fact_age)."""
    return frozenset(f.statement for f in update.add_facts)


def _upserted(update: WorkingStateUpdate) -> frozenset[str]:
    """The task ids an update writes, which its own caps do not evict (_task_eviction_age)."""
    return frozenset(u.task_id for u in update.upsert_tasks)


def apply_update(
    state: WorkingState,
    update: WorkingStateUpdate,
    *,
    writer: Writer,
    sequence: int,
    count_tokens: TokenCounter | None = None,
    folding: bool = False,
    pending: frozenset[str] = frozenset(),
) -> Transition:
    """Apply one typed transition. All or nothing: on any error the state is unchanged.

    With `count_tokens`, a transition that grows the never-hiding part of the block
    (objective, constraints, next_action) past BLOCK_TOKENS fails; one that leaves it over
    the cap but no larger passes (a state two overlapping runs carried over it: clearing
    the next action or restating the objective was refused, a review). `folding` (the log fold,
    `carry`) replays a write that was admitted: no cap or ceiling refuses its constraints
    again (Rule 6). `pending`: the questions whose ask_user call in the run awaits its
    answer, which the model may not resolve (`pending_questions`).

    Raises:
        InvalidFieldError: a field the writer may not touch, or a malformed value.
        PreconditionError: WORKING_STATE_CAP or CONSTRAINT_PROTECTED.
    """
    original, before = state, state.objective
    state = _merged(state, update, _Ctx(writer, sequence, folding, pending))
    state, evicted = _bound_lists(state, _upserted(update), _stated(update))
    grown = [f for f in _FIXED_FIELDS if f in update.touched()]
    if count_tokens is not None and grown and not folding:
        tokens = _fixed_tokens(state, count_tokens)
        if tokens > BLOCK_TOKENS and tokens > _fixed_tokens(original, count_tokens):
            raise PreconditionError(
                f"objective, constraints and next action alone would take {tokens} tokens;"
                f" the working-state block holds {BLOCK_TOKENS} and they never evict",
                field=f"update.{_largest(original, update, grown, count_tokens)}",
                reason="WORKING_STATE_CAP",
                metadata={"class": "working_state", "cap_tokens": str(BLOCK_TOKENS)},
            )
    # A restated objective taken over by a stronger writer is the same objective.
    superseded = (
        before.text
        if before is not None
        and state.objective is not None
        and state.objective.text != before.text
        else None
    )
    return Transition(state, evicted, superseded)


def _fixed_tokens(state: WorkingState, count_tokens: TokenCounter) -> int:
    """What the never-hiding part of the block costs, with room for the longest note of
    what is hidden: the evictable entries must always be hideable, or one added task could
    make every Build of the run fail."""
    return count_tokens(_render_text(_fixed_part(state), b"\0" * 32, _ALL_HIDDEN))


# --- carry ---------------------------------------------------------------------------------


class Carry(Enum):
    KEEP = "carries"
    OPEN_ONLY = "open entries carry; completed ones drop from context and stay in the log"
    RESET = "resets at every new run"


# What crosses a run boundary, per field (the spec's carry table). The objective carries
# until the user states a new one: transitions already refuse anyone else superseding a
# user's objective. Open questions carry until an answer resolves them.
CARRY_RULES: dict[str, Carry] = {
    "objective": Carry.KEEP,
    "constraints": Carry.KEEP,
    "tasks": Carry.OPEN_ONLY,
    "facts": Carry.KEEP,
    "open_questions": Carry.KEEP,
    "next_action": Carry.RESET,
}

_CARRY_APPLY: dict[Carry, Callable[[Any], Any]] = {
    Carry.KEEP: lambda value: value,
    Carry.OPEN_ONLY: lambda tasks: tuple(t for t in tasks if t.status not in COMPLETED),
    Carry.RESET: lambda value: None,
}


def at_run_boundary(state: WorkingState) -> WorkingState:
    """The state a new run starts from, given the state the log ended in."""
    return state.model_copy(
        update={
            name: _CARRY_APPLY[rule](getattr(state, name)) for name, rule in CARRY_RULES.items()
        }
    )


@dataclass(frozen=True, slots=True)
class LoggedUpdate:
    """A context.working_state.updated event as the fold reads it."""

    sequence: int
    run_id: str
    writer: Writer
    update: WorkingStateUpdate


def carry(updates: Sequence[LoggedUpdate]) -> WorkingState:
    """Fold the log's working-state events (oldest first) into the state a new run carries.

    The fold replays every transition, applying CARRY_RULES wherever the run changes, and
    once more at the end. A transition that no longer applies whole (two runs that
    overlapped in time wrote to states the other did not see: one resolved a question the
    other resolves again) is replayed field by field, in the order a transition applies
    them, and a list field that fails whole entry by entry: only what no longer applies is
    skipped. A constraint the user added beside a stale resolution is still the session's,
    and a question resolved beside a stale one is still resolved. Rule 3's caps apply once,
    after all of the transition, as they did live. The fold never fails.

    No constraint is dropped to fit (Rule 6): not past the list cap (two overlapping runs
    each checked only their own state) nor past the block's ceiling (their union, or a
    model whose counter makes the same text longer). Such a state fails every Build of the
    run with BUDGET_EXCEEDED, class working_state, until the user removes constraints: a
    failure the agent can surface, where the fold dropped the last ones without a word.
    """
    return at_run_boundary(fold(updates).state)


_NOTHING_YET = WorkingState()  # frozen: one instance serves every empty fold


@dataclass(frozen=True, slots=True)
class Folded:
    """The log's working-state events folded through sequence `through`: the state after
    the last of them (no final run boundary yet) and the run that wrote it. The log is
    append-only, so a fold through N continues with the events after N alone (fold's
    `start`): carry of the whole log is at_run_boundary of that continuation's state."""

    through: int = 0
    run: str | None = None
    state: WorkingState = _NOTHING_YET


def fold(updates: Sequence[LoggedUpdate], start: Folded | None = None) -> Folded:
    """carry's fold, continued from `start` with `updates`, all after `start.through`.

    Raises:
        ValueError: an update at or below `start.through` (already folded).
    """
    start = start or Folded()
    state, run, through = start.state, start.run, start.through
    for logged in sorted(updates, key=lambda u: u.sequence):
        if logged.sequence <= through:
            raise ValueError(f"event {logged.sequence} is at or below {through}, folded")
        if run is not None and logged.run_id != run:
            state = at_run_boundary(state)
        run, through = logged.run_id, logged.sequence
        state = _replay(state, logged)
    return Folded(through, run, state)


def _replay(state: WorkingState, logged: LoggedUpdate) -> WorkingState:
    """One logged transition: whole, or else each field, and each entry of a list field,
    that still applies (carry): a stale resolution skips only that question. Either way
    the caps apply once, after all of it, as in the live transition: capped field by
    field, a split update evicted an open question before its own resolutions made room
    (one asked and answered in one append, beside a stale answer), which the run kept."""
    ctx = _Ctx(logged.writer, logged.sequence, folding=True)

    def merged(state: WorkingState, update: WorkingStateUpdate) -> WorkingState | None:
        try:
            return _merged(state, update, ctx)
        except RequestError:
            return None

    whole = merged(state, logged.update)
    if whole is not None:
        state = whole
    else:
        for name, _ in _STEPS:
            value = getattr(logged.update, name)
            if value is None or value == ():
                continue
            field = merged(state, WorkingStateUpdate(**{name: value}))
            if field is not None:
                state = field
            elif isinstance(value, tuple):  # a list field: entry by entry
                for entry in value:
                    state = merged(state, WorkingStateUpdate(**{name: (entry,)})) or state
    return _bound_lists(state, _upserted(logged.update), _stated(logged.update))[0]


# --- runtime writes ----------------------------------------------------------------------


def _ask_user_question(call: ToolCall) -> str | None:
    """The call's question as open_questions holds it: cut to MAX_ENTRY_CHARS, so the ask
    and its answer compare the same text (None when there is no usable question)."""
    try:
        arguments = json.loads(call.arguments_json)
    except ValueError:
        return None
    question = arguments.get("question") if isinstance(arguments, dict) else None
    if not isinstance(question, str):
        return None
    stored = question[:MAX_ENTRY_CHARS]
    return stored if stored.strip() else None


def runtime_update(
    state: WorkingState,
    existing: Sequence[ConversationItem],
    new: Sequence[ConversationItem],
) -> WorkingStateUpdate | None:
    """The runtime's own transition for items being appended, or None when there is none.

    A conversation.ask_user call adds its "question" argument to open_questions (cut to
    MAX_ENTRY_CHARS) and its result resolves it, unless the result is an error (no answer
    came); a call with a task_id moves that task to in_progress and its result to done
    (blocked when the result is an error). Nothing else
    is observed; no text is parsed except the ask_user call's typed arguments. Questions
    follow the items' order: answered then asked again in one append, a question stays
    open (its entry unchanged); asked then answered, it is resolved.

    Raises:
        InvalidFieldError: a tool call names a task_id the working state does not hold.
    """
    calls = {i.call_id: i for i in (*existing, *new) if isinstance(i, ToolCall)}
    known = {t.task_id for t in state.tasks}
    was_open = {q.text for q in state.open_questions}
    is_open = set(was_open)
    asked: dict[str, None] = {}  # questions asked here, first ask first (an ordered set)
    answered: dict[str, None] = {}
    tasks: list[TaskUpsert] = []
    for index, item in enumerate(new):
        if isinstance(item, ToolCall):
            question = _ask_user_question(item) if item.tool_name == ASK_USER_TOOL else None
            if question is not None and question not in is_open:
                asked[question] = None
                is_open.add(question)
            if item.task_id:
                if item.task_id not in known:
                    raise InvalidFieldError(
                        f"no task {item.task_id!r} in the run's working state",
                        field=f"items[{index}].tool_call.task_id",
                    )
                tasks.append(TaskUpsert(task_id=item.task_id, status=TaskStatus.IN_PROGRESS))
        elif isinstance(item, ToolResult) and item.call_id in calls:
            call = calls[item.call_id]
            question = _ask_user_question(call) if call.tool_name == ASK_USER_TOOL else None
            # An error (no answer came) is not an answer: the question stays open.
            if question is not None and question in is_open and not item.is_error:
                answered[question] = None
                is_open.discard(question)
            if call.task_id in known:
                status = TaskStatus.BLOCKED if item.is_error else TaskStatus.DONE
                tasks.append(TaskUpsert(task_id=call.task_id, status=status))
    # A transition adds before it resolves, so the update states the net effect of the
    # items in their order: a question open at the end is added if it was not open
    # before (asked, answered and asked again), never resolved (answered, then asked
    # again: it stays open as it was); one closed at the end is resolved (asked then
    # answered here: added and resolved, so the log shows both).
    added = [q for q in asked if q not in was_open]
    resolved = [q for q in answered if q not in is_open]
    if not (added or resolved or tasks):
        return None
    return WorkingStateUpdate(
        upsert_tasks=tuple(tasks), add_questions=tuple(added), resolve_questions=tuple(resolved)
    )


# --- rendering -----------------------------------------------------------------------------

_HEADER = (
    "Working state (the platform's record, kept through context.update_working_state; each"
    " entry names its writer and the event that wrote it):"
)


def _one(text: str) -> str:
    """An entry's text, escaped, with continuation lines indented so it cannot start a new
    entry line of its own."""
    lines = escape_content(text).splitlines() or [""]
    return "\n    ".join(lines)


def _label(entry: Entry | Task | Fact) -> str:
    return f"[{entry.writer.name.lower()} #{entry.source_sequence}]"


def _task_id(task_id: str) -> str:
    """A task id as one JSON string: its quotes, and the label before it, bound where the
    model's text starts and ends, so an id cannot pass for a status or a writer."""
    return _one(json.dumps(task_id, ensure_ascii=False))


def _events(ids: Sequence[int]) -> str:
    return ", ".join(f"#{i}" for i in ids)


def _fact_line(fact: Fact, index: int, secret: bytes, named: bool) -> str:
    events = _events(fact.source_event_ids)
    head = f"- {_label(fact)} " if named else "- "
    if fact.trust in _ASSERTED:
        return f"{head}Established (events {events}): {_one(fact.statement)}"
    attribution = (
        f"{head}Claim, not established (events {events}; {fact.trust.name.lower()}) states"
    )
    if envelope_tag(fact.trust) is None:
        return f"{attribution}: {_one(fact.statement)}"
    item_id = f"working-state:fact:{fact.source_sequence}:{index}"
    source = "events:" + ",".join(str(i) for i in fact.source_event_ids)
    quoted = wrap(fact.statement, trust=fact.trust, item_id=item_id, source=source, secret=secret)
    return f"{attribution}:\n{quoted}"


# A question the runtime added carries the model's words (its trust is MODEL: _WRITER_TRUST).
_ASKED = "the model asked:"


def _question_line(question: Entry, named: bool) -> str:
    asked = f" {_ASKED}" if named and question.writer is Writer.RUNTIME else ""
    return f"- {_label(question)}{asked} {_one(question.text)}"


def _render_text(
    state: WorkingState, secret: bytes, hidden: Iterable[tuple[str, int]], named: bool = True
) -> str:
    """The block's text (Rule 5). `named` False: fact lines name no writer and a runtime
    question does not say it is the model's, as context-assembler@11 and older sent them."""
    gone = frozenset(hidden)
    lines = [_HEADER]
    if state.objective is not None:
        lines.append(f"Objective: {_label(state.objective)} {_one(state.objective.text)}")
    if state.constraints:
        lines.append("Constraints (in force; never dropped):")
        lines += [f"- {_label(c)} {_one(c.text)}" for c in state.constraints]
    tasks = [t for n, t in enumerate(state.tasks) if ("tasks", n) not in gone]
    if tasks:
        lines.append("Tasks:")
        lines += [
            f"- {_label(t)} Task {_task_id(t.task_id)} ({t.status.name.lower()}): {_one(t.title)}"
            for t in tasks
        ]
    facts = [(n, f) for n, f in enumerate(state.facts) if ("facts", n) not in gone]
    if facts:
        lines.append("Established facts:")
        lines += [_fact_line(f, n, secret, named) for n, f in facts]
    questions = [q for n, q in enumerate(state.open_questions) if ("open_questions", n) not in gone]
    if questions:
        lines.append("Open questions (unanswered):")
        lines += [_question_line(q, named) for q in questions]
    if state.next_action is not None:
        lines.append(f"Next action: {_label(state.next_action)} {_one(state.next_action.text)}")
    if gone:
        counts = {name: sum(1 for g, _ in gone if g == name) for name, _ in sorted(gone)}
        shown = ", ".join(f"{n} {name.replace('_', ' ')}" for name, n in counts.items())
        lines.append(f"(Not shown for space, oldest first: {shown}. The log keeps them.)")
    return "\n".join(lines)


# Every evictable entry the caps allow, hidden: _render_text's longest "not shown" note.
_ALL_HIDDEN = tuple(
    (name, n) for name in ("tasks", "facts", "open_questions") for n in range(LIST_CAPS[name])
)


def _fixed_part(state: WorkingState) -> WorkingState:
    return state.model_copy(update={"tasks": (), "facts": (), "open_questions": ()})


def _hide_order(state: WorkingState) -> list[tuple[str, int]]:
    """Completed tasks first, then every evictable entry, stalest first (Rule 4). A user's
    open question counts as no staler than the newest of the model's and the runtime's,
    and after it on a tie: no question hides sooner than its own age would hide it, and a
    user's question never before the model's (_question_age's order among questions)."""
    newest_other = max(
        (q.source_sequence for q in state.open_questions if q.writer is not Writer.USER),
        default=0,
    )

    def question_age(q: Entry) -> tuple[int, ...]:
        if q.writer is not Writer.USER:
            return (1, q.source_sequence, WRITER_RANK[q.writer])
        return (1, max(q.source_sequence, newest_other), WRITER_RANK[q.writer])

    keyed: list[tuple[tuple[int, ...], int, tuple[str, int]]] = []
    keyed += [(_task_age(t), 0, ("tasks", n)) for n, t in enumerate(state.tasks)]
    keyed += [(_fact_age(f), 1, ("facts", n)) for n, f in enumerate(state.facts)]
    keyed += [
        (question_age(q), 2, ("open_questions", n)) for n, q in enumerate(state.open_questions)
    ]
    return [key for _, _, key in sorted(keyed)]


def render_block(
    state: WorkingState,
    *,
    secret: bytes,
    count_tokens: TokenCounter,
    cap_tokens: int = BLOCK_TOKENS,
    named_writers: bool = True,
) -> WorkingStateItem | None:
    """Row 12: the working-state block, within its token cap; None for an empty state.
    `named_writers` False: as context-assembler@11 and older rendered it (`_render_text`).

    Raises:
        BudgetExceededError: objective, constraints and next action alone exceed the cap
            (transitions refuse that, so only a changed token counter can get here).
    """
    if state.is_empty():
        return None
    order = _hide_order(state)

    def shown(k: int) -> str | None:
        """The block with the first `k` entries of `order` hidden, if it fits the cap."""
        text = _render_text(state, secret, order[:k], named_writers)
        return text if count_tokens(text) <= cap_tokens else None

    # The fewest entries hidden that fit, by bisection: about log2(90) renders, where hiding
    # one at a time (until context-assembler@14) rendered and counted the whole block once
    # per entry hidden (90 over the cap: 1.4 s under an exact counter, on the event loop).
    # Hiding one more shortens the block but where it adds a list to the note for a line
    # shorter than the note's words (a one-character entry): there the two can differ.
    # Either way the block fits and hiding one fewer would not.
    text = shown(0)
    if text is None:
        text = shown(len(order))
        if text is None:
            raise BudgetExceededError(
                f"the working-state block needs more than {cap_tokens} tokens for entries that"
                " never evict",
                metadata={"class": "working_state", "cap_tokens": str(cap_tokens)},
            )
        unfit, fit = 0, len(order)  # shown(unfit) is over the cap, shown(fit) is `text`
        while fit - unfit > 1:
            middle = (unfit + fit) // 2
            found = shown(middle)
            if found is None:
                unfit = middle
            else:
                fit, text = middle, found
    return WorkingStateItem(item_id="working-state", text=text, trust=TrustLevel.PLATFORM)


# --- the control tool ----------------------------------------------------------------------

_STATUS_NAMES = [s.name.lower() for s in TaskStatus]

UPDATE_TOOL = ToolSpec(
    name=UPDATE_TOOL_NAME,
    description=(
        "Update the run's working state: the objective, constraints, tasks, established"
        " facts, resolved questions and your next action. Use it instead of restating state"
        " in prose; the platform shows the result in every later request. Constraints are"
        " append-only: you may remove only constraints you added, never the user's. A fact"
        ' must name the items it rests on by the id their envelopes show (id="..."); a'
        " fact resting on external content is shown as an attributed claim, never as"
        " established. No approval is needed."
    ),
    input_schema={
        "type": "object",
        "additionalProperties": False,
        "properties": {
            "objective": {
                "type": ["string", "null"],
                "description": "The new objective; null leaves it. A user's objective stays.",
            },
            "add_constraints": {
                "type": "array",
                "items": {"type": "string"},
                "description": f"Constraints to add (at most {LIST_CAPS['constraints']} in all).",
            },
            "remove_constraints": {
                "type": "array",
                "items": {"type": "string"},
                "description": "Constraints you added that no longer apply (exact text).",
            },
            "upsert_tasks": {
                "type": "array",
                "items": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "task_id": {"type": "string"},
                        "title": {"type": "string"},
                        "status": {"type": "string", "enum": _STATUS_NAMES},
                    },
                    "required": ["task_id"],
                },
                "description": "Tasks to add or change, by task_id.",
            },
            "add_facts": {
                "type": "array",
                "items": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "statement": {"type": "string"},
                        "source_item_ids": {
                            "type": "array",
                            "items": {"type": "string", "minLength": 1},
                            "minItems": 1,
                            "maxItems": MAX_FACT_SOURCES,
                            "uniqueItems": True,
                        },
                    },
                    "required": ["statement", "source_item_ids"],
                },
                "description": (
                    "Facts the session established, each with the ids of the items it rests"
                    ' on, as their envelopes show them (id="...").'
                ),
            },
            "resolve_questions": {
                "type": "array",
                "items": {"type": "string"},
                "description": "Open questions an answer has resolved (exact text).",
            },
            "next_action": {
                "type": ["string", "null"],
                "description": "Your next step within this turn; null leaves it.",
            },
        },
    },
    side_effect=SideEffect.NONE,
    builtin=True,
    policy={"control_tool": True, "requires_approval": False, "read_only_outside_run": True},
)
