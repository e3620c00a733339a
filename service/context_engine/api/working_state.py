"""Working-state orchestration: load (store) -> transition (core) -> record (store).

Every transition is one transaction under the session row lock: the
context.working_state.updated event and the run's next checkpoint land together, and a
transition that fails writes neither. The event records the typed update itself, so a new
run's state is a fold over the log (core.working_state.carry), never a checkpoint copy.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any
from uuid import UUID

from ..core.build_record import INPUTS_KEY, SHOWN_FIELDS, shown_items
from ..core.checkpoint import Checkpoint, require_version
from ..core.compaction import (
    SUMMARIZABLE,
    elided_content,
    held_texts,
    quoted_sources,
    quoted_whole,
    shown_texts,
)
from ..core.envelope import attribute_reading_count, attribute_readings, shown_attribute
from ..core.errors import EngineError, InvalidFieldError
from ..core.items import (
    ContextItem,
    ConversationItem,
    CorrectionLineItem,
    KnowledgePassageItem,
    RecallLineItem,
    ToolResult,
    UserMessage,
    trust_of,
)
from ..core.plan import prefix_data
from ..core.seeding import seed_cut
from ..core.skills import body_trust, pinned_entry
from ..core.trust import TrustLevel
from ..core.working_state import (
    ASK_USER_TOOL,
    UPDATE_TOOL_NAME,
    Fact,
    Folded,
    NewFact,
    Transition,
    WorkingState,
    WorkingStateUpdate,
    Writer,
    apply_update,
    at_run_boundary,
    evidence_trust,
    fold,
    lowest_trust,
    pending_questions,
    require_writer_fields,
    runtime_update,
)
from ..store import events, idempotency, plans, runs, sessions
from ..store import skills as skill_store
from ..store import working_state as ws_store
from ..store.db import transaction
from ..store.events import NewEvent
from .kept import Kept, approximate_bytes

if TYPE_CHECKING:
    from .engine import Engine

__all__ = [
    "FACT_CANDIDATES_OFFERED",
    "FACT_CANDIDATE_AUTHORITY",
    "UPDATE_READINGS",
    "carried_state",
    "cited_readings",
    "offer_fact_candidates",
    "record_transition",
    "runtime_transition",
    "seed_state",
    "update_working_state",
]

TokenCounter = Callable[[str], int]

FACT_CANDIDATES_OFFERED = "memory.fact_candidates.offered"
# Formation enters an offered fact above an extractor inference, below a user statement.
FACT_CANDIDATE_AUTHORITY = "AFFIRMED"
# A candidate's evidence must be a trusted user source (the spec): the user's own words
# (or the platform's). Not TRUSTED_CONFIGURATION: that is a tool's output the worker
# trusts to render bare, not something the user said, and a calendar entry's text was
# offered to formation as the user's (an audit).
_TRUSTED_EVIDENCE = frozenset({TrustLevel.PLATFORM, TrustLevel.USER})


async def carried_state(
    conn: Any, tenant_id: str, session_id: UUID, below_sequence: int, kept: Kept | None = None
) -> WorkingState:
    """The working state the log strictly below `below_sequence` carries into a new run
    (core.working_state.carry: no constraint dropped to fit). Call with the session locked.

    With `kept`, the replica's fold of the session's log so far is continued with the
    events since, rather than every event folded again (about 150 us an event: a session
    of 2,000 updates took 0.3 s a StartRun). The log's working-state events are never
    rewritten (an erasure rewrites recorded requests only) and, under the session lock,
    every one below the read's bound is committed, so a fold of them stays true.
    """
    key = ("working-state fold", tenant_id, session_id)
    known: Folded | None = kept.get(key) if kept is not None else None
    # A fold past the bound asked (a run seeded earlier than the latest) is of no use.
    start = known if known is not None and known.through < below_sequence else Folded()
    updates = await ws_store.read_working_state_updates(
        conn, tenant_id, session_id, below_sequence, start.through
    )
    folded = fold(updates, start)
    if kept is not None and folded.through > (known.through if known is not None else 0):
        kept.put(key, folded, approximate_bytes(folded))
    return at_run_boundary(folded.state)


async def seed_state(
    conn: Any,
    tenant_id: str,
    session_id: UUID,
    seed_event_sequence: int | None,
    kept: Kept | None = None,
) -> WorkingState:
    """A new run's first working state: carried from the log below its seed for a
    top-level run; empty for a child run, whose working state is its own. A carried state
    over the block's ceiling is carried whole; the run's Builds refuse it (BUDGET_EXCEEDED,
    class working_state) until the user removes constraints."""
    if seed_event_sequence is None:
        return WorkingState()
    return await carried_state(conn, tenant_id, session_id, seed_event_sequence, kept)


async def record_transition(
    conn: Any,
    tenant_id: str,
    session_id: UUID,
    run_id: UUID,
    state: WorkingState,
    update: WorkingStateUpdate,
    *,
    writer: Writer,
    checkpoint_version: int,
    count_tokens: TokenCounter | None = None,
    pending: frozenset[str] = frozenset(),
) -> tuple[Transition, int]:
    """Apply a transition and append its event. Call with the session locked, inside the
    transaction that writes the checkpoint. -> (transition, event sequence)

    Raises:
        RequestError: the transition is refused (nothing is appended).
    """
    sequence = await ws_store.next_sequence(conn, tenant_id, session_id)
    transition = apply_update(
        state, update, writer=writer, sequence=sequence, count_tokens=count_tokens, pending=pending
    )
    payload = {
        "writer": writer.name.lower(),
        "update": update.model_dump(mode="json"),
        "evicted": transition.evicted,
        "superseded_objective": transition.superseded_objective,
        "checkpoint_version": checkpoint_version,
    }
    (appended,) = await events.append_events(
        conn,
        tenant_id,
        session_id,
        [NewEvent(ws_store.WORKING_STATE_UPDATED, payload, run_id=run_id)],
    )
    if appended != sequence:
        raise EngineError(f"working-state event landed at {appended}, expected {sequence}")
    return transition, sequence


def runtime_transition(
    checkpoint: Checkpoint, new_items: Sequence[ConversationItem]
) -> WorkingStateUpdate | None:
    """The runtime's own writes for items about to be appended, validated before any write.

    Raises:
        InvalidFieldError: a tool call names a task the working state does not hold.
    """
    update = runtime_update(checkpoint.working_state, checkpoint.items, new_items)
    if update is not None:
        apply_update(checkpoint.working_state, update, writer=Writer.RUNTIME, sequence=0)
    return update


async def _lowered_facts(
    conn: Any,
    tenant_id: str,
    session_id: UUID,
    run_id: UUID,
    run: runs.RunRow,
    checkpoint: Checkpoint,
    update: WorkingStateUpdate,
    cited: Sequence[Sequence[str]] = (),
) -> WorkingStateUpdate:
    """Each new fact's evidence, the events of the item ids it cites (`cited`, one list per
    fact) added to its source_event_ids, and its trust, lowered to the least trusted of its
    claim, its evidence and what it quotes of the memory lines and untrusted content the
    run was shown that its evidence does not say (`_quoted_trust`): its requests' step
    lines and plans' entries, its own untrusted items (a fetched page, an email) and the
    state's claims below USER.

    Raises:
        InvalidFieldError: evidence that is not a conversation event of this session, or
            an item id naming no conversation item the run was shown.
    """
    if not update.add_facts:
        return update
    named = await _named_evidence(conn, tenant_id, session_id, run_id, run, update, cited)
    wanted = [sequence for pairs in named for sequence, _ in pairs]
    found = await ws_store.read_evidence_at(conn, tenant_id, session_id, wanted)
    facts = []
    # A child run's model saw none of the session's conversation, only its parent's words
    # (its "user"): whatever it cites, its fact is at most the model's (a review: a child
    # citing the parent's user message wrote a relayed page as the user's, Established).
    ceiling = [TrustLevel.MODEL] if run.parent_run_id is not None else []
    for fact, pairs in zip(update.add_facts, named, strict=True):
        levels = [fact.trust, *ceiling]
        for sequence, field in pairs:
            event = found.get(sequence)
            level = evidence_trust(*event) if event is not None else None
            if level is None:
                raise InvalidFieldError(
                    f"event {sequence} is not a conversation event of this session",
                    field=field,
                )
            levels.append(level)
        evidence = tuple(dict.fromkeys(sequence for sequence, _ in pairs))
        facts.append(
            fact.model_copy(update={"source_event_ids": evidence, "trust": lowest_trust(levels)})
        )
    if any(f.trust in SUMMARIZABLE for f in facts):
        shown, erased = await _everything_shown(conn, tenant_id, session_id, run, checkpoint)
        # Matching scans every source for each fact: CPU work, off the event loop (a
        # review: seconds of it held every tenant's calls on the replica).
        facts = await asyncio.to_thread(lambda: [_quoted_trust(f, shown, found) for f in facts])
        if erased:
            # What an erasure took out of the run's view is gone, so a fact cannot be
            # compared with it: one the run writes afterwards is held at MEMORY (an audit:
            # a fact restating an erased recall line, written after the erasure, was USER
            # and offered to memory formation).
            facts = [
                f.model_copy(update={"trust": lowest_trust([f.trust, TrustLevel.MEMORY])})
                for f in facts
            ]
    return update.model_copy(update={"add_facts": tuple(facts)})


# A source the run was shown: (its text, its trust), below what a fact may restate freely.
Source = tuple[str, TrustLevel]

# Trusted labels that say nothing of who wrote the text: a tool's result or a knowledge
# passage at TRUSTED_CONFIGURATION or USER is the worker's to render bare, not the user's
# words. Restated in a fact citing the user's message, it was USER and offered to memory
# formation as the user's statement (an audit: a calendar entry, a page labelled USER, a
# passage), though a fact citing it is not offered. Held as the model's: such a fact is the
# model's restatement, no user source (_trusted_candidate).
_VOUCHED = frozenset({TrustLevel.TRUSTED_CONFIGURATION, TrustLevel.USER})


def _quoting_trust(item: ContextItem) -> TrustLevel | None:
    """The trust a fact quoting `item` is held at, or None where quoting it is free (a
    trust core/compaction.py SUMMARIZABLE holds): MODEL for a vouched-for tool result or
    passage (_VOUCHED), which is no user source (conversation.ask_user's answer is the
    user's)."""
    trust = trust_of(item)
    vouched = isinstance(item, KnowledgePassageItem) or (
        isinstance(item, ToolResult) and item.tool_name != ASK_USER_TOOL
    )
    if trust in _VOUCHED and vouched:
        return TrustLevel.MODEL
    return None if trust in SUMMARIZABLE else trust


async def _everything_shown(
    conn: Any, tenant_id: str, session_id: UUID, run: runs.RunRow, checkpoint: Checkpoint
) -> tuple[list[Source], bool]:
    """What the run's model was shown below what it may restate freely, and whether an
    erasure has since taken some of it out (_shown_sources)."""
    shown, erased = await _shown_sources(conn, tenant_id, session_id, run)
    # The run's own items and the state's claims: a fact restating the page the run
    # fetched, citing the user's message, was USER, shown bare and offered (an audit).
    shown += _run_sources(checkpoint)
    # Those a compaction took out of the checkpoint: the model saw them before the summary
    # replaced them (an audit: a page the run fetched, compacted away, was restated as the
    # user's).
    shown += await _elided_sources(conn, tenant_id, session_id, checkpoint)
    # And the earlier runs' results it carried: a page fetched a turn before was restated
    # the same way (an audit).
    shown += await _carried_sources(conn, tenant_id, session_id, run, checkpoint)
    return shown, erased


def _standing_entries(state: WorkingState, update: WorkingStateUpdate) -> list[tuple[str, str]]:
    """(field, text) of the objective and constraints the update states that the state
    does not hold yet: shown bare, at their writer's trust, in force in every later run.
    What it holds already was checked when written (a review: a task's title restated
    with its new status was refused once a search page echoed it)."""
    held = {c.text for c in state.constraints}
    current = state.objective.text if state.objective is not None else None
    entries = [("update.objective", update.objective or "")]
    if update.objective == current:
        entries = []
    entries += [
        (f"update.add_constraints[{k}]", c)
        for k, c in enumerate(update.add_constraints)
        if c not in held
    ]
    return [(field, text) for field, text in entries if text]


async def _refuse_quoted_entries(
    conn: Any,
    tenant_id: str,
    session_id: UUID,
    run: runs.RunRow,
    checkpoint: Checkpoint,
    update: WorkingStateUpdate,
) -> None:
    """The model's objective and constraints restate nothing less trusted than the model
    that the run was shown. A fact restating a page is held at the page's trust; these
    take their writer's alone, so a page's instruction copied into a constraint was shown
    bare, in force, in every later run (an audit). Matched as a fact's quote is
    (_quoted_trust: fragments, and a memory line copied whole), what the user wrote
    licensing what it holds: the run's messages and those it carries, and the state's
    entries of the user's. Not a child run's messages, its parent's words. Task titles and
    next actions are not checked (a review: the model's own search terms, echoed by the
    page they found, were refused at every step).

    Raises:
        InvalidFieldError: naming the entry that restates such a source.
    """
    entries = _standing_entries(checkpoint.working_state, update)
    if not entries:
        return
    shown, _ = await _everything_shown(conn, tenant_id, session_id, run, checkpoint)
    sources = [(text, trust) for text, trust in shown if trust > TrustLevel.MODEL]
    if not sources:
        return
    allowed = "\n".join(await _users_words(conn, tenant_id, session_id, run, checkpoint))
    texts = [text for _, text in entries]
    quoted = await asyncio.to_thread(quoted_sources, texts, [text for text, _ in sources], allowed)
    memories = [j for j, (_, trust) in enumerate(sources) if trust is TrustLevel.MEMORY]
    for n, (field, text) in enumerate(entries):
        whole = quoted_whole(text, [sources[j][0] for j in memories], allowed)
        found = {*quoted.get(n, ()), *(memories[k] for k in whole)}
        if found:
            level = lowest_trust([sources[j][1] for j in found])
            raise InvalidFieldError(
                f"{field} restates {level.name} content the run was shown; it would be"
                " shown bare, at the writer's trust: state it as a fact citing its source,"
                " which keeps that content's trust",
                field=field,
            )


# How many of the user's earlier messages license the model's objective and constraints.
CARRIED_USER_MESSAGES = 64


async def _users_words(
    conn: Any, tenant_id: str, session_id: UUID, run: runs.RunRow, checkpoint: Checkpoint
) -> list[str]:
    """What the user wrote that the run was shown: its messages, the newest
    CARRIED_USER_MESSAGES of the conversation it carries, the state's entries of the
    user's. None for a child run, whose messages are its parent's words (core/seeding.py,
    Rule 4)."""
    if run.parent_run_id is not None:
        return []
    state = checkpoint.working_state
    own = [
        i.text
        for i in checkpoint.items
        if isinstance(i, UserMessage) and trust_of(i) <= TrustLevel.USER
    ]
    entries = [
        e.text
        for e in (state.objective, *state.constraints, *state.open_questions)
        if e is not None and e.writer is Writer.USER
    ]
    carried = await ws_store.read_carried_user_texts(
        conn, tenant_id, session_id, seed_cut(run.seed_event_sequence), CARRIED_USER_MESSAGES
    )
    return [*own, *entries, *carried]


# How many earlier runs' requests a new fact's check reads the step lines of, newest first:
# a bound like CARRIED_SOURCES' on what an update adding a fact reads under the lock.
SHOWN_RUNS = 16


async def _named_evidence(
    conn: Any,
    tenant_id: str,
    session_id: UUID,
    run_id: UUID,
    run: runs.RunRow,
    update: WorkingStateUpdate,
    cited: Sequence[Sequence[str]],
) -> list[list[tuple[int, str]]]:
    """Per fact, each event it cites with the field that names it: its source_event_ids,
    then the events its source_item_ids name for this run (store `resolve_item_ids`: every
    item of the id the run may have been shown, so the least trusted decides). The model
    reads item ids in its envelopes (sequences only in the working-state block's labels),
    so item ids are how the control tool cites (an audit: it was asked for sequences of
    events it could only guess, and a guessed user message made its conclusion USER
    trust). An id is taken as written and as every id its envelope would show alike.

    Raises:
        InvalidFieldError: an item id naming no conversation item the run was shown.
    """
    forms = {
        (n, k): _id_forms(item_id)
        for n, items in enumerate(cited)
        for k, item_id in enumerate(items)
    }
    ids = [form for readings in forms.values() for form in readings]
    resolved = await ws_store.resolve_item_ids(
        conn, tenant_id, session_id, run_id, run.seed_event_sequence, ids
    )
    # By sequence, the same view as by item id: a later run's message, or another run's
    # turn, named by its sequence was taken as evidence the run never saw (an audit: a fact
    # resting on another run's user message was Established and offered).
    unseen = await ws_store.unseen_by_run(
        conn,
        tenant_id,
        session_id,
        run_id,
        run.seed_event_sequence,
        [s for fact in update.add_facts for s in fact.source_event_ids],
    )
    named = []
    for n, fact in enumerate(update.add_facts):
        path = f"update.add_facts[{n}]"
        pairs = [(s, f"{path}.source_event_ids[{k}]") for k, s in enumerate(fact.source_event_ids)]
        for sequence, field in pairs:
            if sequence in unseen:
                raise InvalidFieldError(
                    f"event {sequence} is not one this run was shown (its own, or the earlier"
                    " conversation it carries): cite the events the fact rests on",
                    field=field,
                )
        for k, item_id in enumerate(cited[n] if n < len(cited) else ()):
            field = f"{path}.source_item_ids[{k}]"
            found = sorted({s for form in forms[n, k] for s in resolved.get(form, ())})
            if not found:
                raise InvalidFieldError(
                    f"item {item_id!r} is not a conversation item this run was shown (its"
                    " own, or one of the earlier conversation it carries): cite the ids of"
                    " the user messages and tool results the fact rests on",
                    field=field,
                )
            pairs += [(sequence, field) for sequence in found]
        named.append(pairs)
    return named


# How many ids the item ids an update cites may stand for together: an envelope shows
# several characters alike (`&lt;` is any of 19), so an id holding two of them reads as
# 362, three as 6,860. Counted before the request takes the session's lock, and before any
# reading is made (cited_readings; a review: 3.7 million made, then refused, held the
# replica's event loop 5.6 s and 1.6 GB).
UPDATE_READINGS = 4096


def cited_readings(item_ids: Sequence[str]) -> int:
    """How many ids `item_ids` stand for together at most (_id_forms), counted: a plain id
    (its envelope shows it as it is) stands for itself alone; UPDATE_READINGS + 1 once past
    the bound."""
    total = 0
    for item_id in item_ids:
        shown = shown_attribute(item_id)
        total += attribute_reading_count(item_id, UPDATE_READINGS)
        total += attribute_reading_count(shown, UPDATE_READINGS) if shown != item_id else 0
        if total > UPDATE_READINGS:
            return UPDATE_READINGS + 1  # past the bound: how far past is not counted
    return total


def _id_forms(item_id: str) -> list[str]:
    """Every id the cited one may be: the id as written, and every id whose envelope shows
    what the cited one's shows, or what the cited one is if it was copied as shown
    (core/envelope.py attribute_readings: `&amp;` is `&`, U+FE60 or U+FF06). All of them
    are candidates, so the least trusted decides (a review: a page's `q＆a` and a user
    message's `q&a` both show as `q&amp;a`, and only the message was found, cited as shown
    or as decoded). Bounded by the update's count (UPDATE_READINGS), checked first."""
    forms: dict[str, None] = {}
    for text in dict.fromkeys((item_id, shown_attribute(item_id))):
        forms.update(dict.fromkeys(attribute_readings(text, UPDATE_READINGS) or ()))
    return list(forms)


async def _shown_sources(
    conn: Any, tenant_id: str, session_id: UUID, run: runs.RunRow
) -> tuple[list[Source], bool]:
    """The step lines (recall, corrections, knowledge) the run's requests showed its model,
    with their prose attributions (a passage's citation, a line's source); the enveloped
    prefix entries of their plans (the snapshot's memories, say); and the loaded skill
    bodies, each at the least trust a plan shown showed it at (core/skills.py, Rule 6):
    where their trust is one a fact may not launder (core/compaction.py SUMMARIZABLE), as
    compaction holds them (an audit: a fact restating an untrusted skill body or a
    passage's citation, citing the user's message, was USER and offered), and the
    passages vouched for, held as the model's (_quoting_trust). And whether an
    erasure has since taken some of what it was shown out (events.run_saw_erased). Read
    from the requests of the run and of the SHOWN_RUNS newest earlier runs whose requests
    its carried history follows (their items may quote what those showed: an audit found
    a passage shown a run before restated as the user's), whether or not a compaction has
    summarized those items since (the model read them before it did: another audit),
    each decompressed once: a cost
    that grows with those runs' steps, paid only by an update adding a fact above
    MEMORY. A child run carries no history: its own requests alone."""
    earlier = (
        await events.recent_requesting_runs(
            conn,
            tenant_id,
            session_id,
            below=seed_cut(run.seed_event_sequence),
            limit=SHOWN_RUNS,
        )
        if run.parent_run_id is None
        else []
    )
    head = await runs.read_run_head(conn, tenant_id, session_id, run.run_id)
    in_view = [run.run_id, *earlier]
    shown = await events.read_runs_shown(
        conn,
        tenant_id,
        session_id,
        in_view,
        inputs_key=INPUTS_KEY,
        fields=SHOWN_FIELDS,
    )
    lines = [
        (text, trust)
        for item in shown_items(shown.lines)
        if isinstance(item, KnowledgePassageItem | RecallLineItem | CorrectionLineItem)
        and (trust := _quoting_trust(item)) is not None
        # A vouched-for passage's text (shown_texts holds none at a trust a summary may
        # repeat: it is the worker's, not the user's, that a fact may not claim).
        for text in (shown_texts(item) or [item.text])
    ]
    sources: list[Source] = []
    epochs = sorted({*shown.epochs, *head.plan_epochs})
    prefixes = await plans.read_distinct_prefixes(conn, tenant_id, session_id, epochs)
    for stored in prefixes:
        sources += [(e.text, e.trust) for e in prefix_data(stored.plan, stored.spec)]
    for skill in await skill_store.read_loaded(conn, tenant_id, session_id):
        shown_at = [
            body_trust(pinned_entry(p.spec.skills, p.plan.skill_pins, skill.name)[1], skill.trust)
            for p in prefixes
        ]
        level = max(shown_at, default=skill.trust)
        # A vouched-for body is the skill author's, as a vouched-for passage is its
        # source's: restated, citing the user's message, it was USER and offered to memory
        # formation as the user's statement (an audit). Held as the model's, as those are.
        sources.append((skill.body, TrustLevel.MODEL if level in _VOUCHED else level))
    # What an erasure took out of a plan counts only where the model was shown it: the
    # plans of its requests (and its own, as before), not one it has yet to build on.
    seen = sorted({*shown.epochs, run.epoch})
    erased = await events.run_saw_erased(conn, tenant_id, session_id, in_view, seen)
    held = [
        (text, trust)
        for text, trust in sources
        if trust not in SUMMARIZABLE or trust is TrustLevel.MODEL
    ]
    return lines + held, erased


def _run_sources(checkpoint: Checkpoint) -> list[Source]:
    """The run's items below what a fact may restate freely (their texts, as compaction
    holds them: content, excerpt, prose attribution), its vouched-for tool results held as
    the model's (_quoting_trust), and the state's facts below USER, each at its trust."""
    items = [
        (text, trust)
        for i in checkpoint.items
        if (trust := _quoting_trust(i)) is not None
        for text in held_texts(i)
    ]
    claims = [
        (f.statement, f.trust)
        for f in checkpoint.working_state.facts
        if f.trust not in SUMMARIZABLE
    ]
    return items + claims


async def _elided_sources(
    conn: Any, tenant_id: str, session_id: UUID, checkpoint: Checkpoint
) -> list[Source]:
    """The logged items the checkpoint's compactions elided (below what a summary may
    restate: an untrusted result, or an item of the model's quoting one), read from the log
    and held as _run_sources holds the run's items, each at the lower of its own trust and
    the trust its span records (what the item quoted). Bounded as _carried_sources is: the
    newest CARRIED_SOURCES of them, and no more once CARRIED_SOURCE_CHARS characters are
    held, the one crossing it included."""
    spans = checkpoint.compaction.elided if checkpoint.compaction else ()
    trust = {s.event_id: s.trust for s in spans if s.event_id and s.trust not in SUMMARIZABLE}
    newest = sorted(trust, reverse=True)[:CARRIED_SOURCES]
    items = await events.read_items_at(conn, tenant_id, session_id, newest)
    sources: list[Source] = []
    held = 0
    for item in reversed(items):  # newest first
        if held >= CARRIED_SOURCE_CHARS:
            break
        texts = held_texts(item)
        held += sum(map(len, texts))
        level = lowest_trust([trust[item.sequence], trust_of(item)])
        sources += [(text, level) for text in texts]
    return sources


# How much of the earlier runs' untrusted results a new fact is compared with, newest first:
# a bound on what an update adding a fact reads under the session's lock and matches,
# however long the session (about 0.7 us a character a fact). A request carries far less of
# them on any window but the largest, so older ones were cut from the run's view.
CARRIED_SOURCES = 500
CARRIED_SOURCE_CHARS = 1_000_000
_UNTRUSTED = [int(level) for level in TrustLevel if level not in SUMMARIZABLE]
_VOUCHED_LEVELS = sorted(int(level) for level in _VOUCHED)


async def _carried_sources(
    conn: Any, tenant_id: str, session_id: UUID, run: runs.RunRow, checkpoint: Checkpoint
) -> list[Source]:
    """The tool results of earlier runs that the run carries below what a fact may restate
    freely, as _run_sources holds the run's own: the newest CARRIED_SOURCES of them, and
    no more once CARRIED_SOURCE_CHARS characters are read. And, bounded alike, those
    vouched for (held as the model's: _quoting_trust), its own a compaction summarized
    too: a summary restates them, so they leave the checkpoint unelided (a review found a
    fact restating one the user's again). A child run carries none."""
    if run.parent_run_id is not None:
        return []
    below = seed_cut(run.seed_event_sequence)
    reads = (
        (_UNTRUSTED, below, None),
        # Apart, so neither crowds the other out; without conversation.ask_user's answers,
        # the user's words, which crowded the vouched ones out (a review). Past the seed
        # cut, the run's own only: another run's it was never shown (another review).
        (_VOUCHED_LEVELS, max(below, checkpoint.replaced_through_sequence + 1), ASK_USER_TOOL),
    )
    carried = []
    for levels, under, unless in reads:
        carried += await events.read_carried_results(
            conn,
            tenant_id,
            session_id,
            under,
            levels,
            CARRIED_SOURCES,
            CARRIED_SOURCE_CHARS,
            except_tool=unless,
            own_run=run.run_id,
            others_below=below,
        )
    return [
        (text, trust)
        for i in carried
        if (trust := _quoting_trust(i)) is not None
        for text in held_texts(i)
    ]


def _quoted_trust(
    fact: NewFact, shown: Sequence[Source], evidence: dict[int, tuple[str, dict[str, Any], bool]]
) -> NewFact:
    """`fact` at no more than the trust of any shown source it quotes that its evidence
    does not say itself. Its trust was its evidence's alone: a fact the model wrote
    restating a recall line, citing the user's message, was USER, offered to memory
    formation, after an erasure of the line's person too (an audit). Matched as compaction
    matches a summary (core/compaction.py quoted_sources: 40-character substrings, 8-word
    windows, identifier runs; a memory too short for those, of three words or more, held
    whole: quoted_whole), the evidence's text licensing what it holds, so a fact the user
    stated in their own words keeps their trust."""
    sources = [(text, trust) for text, trust in shown if trust > fact.trust]
    if not sources:
        return fact
    # Only evidence the user (or the platform) wrote licenses the words it holds, as in
    # compaction: the model's own message quoting a fetched page, cited, licensed the page,
    # and the fact was MODEL, rendered bare in the block (an audit).
    allowed = "\n".join(
        elided_content(kind, payload)
        for kind, payload, flag in (evidence[i] for i in fact.source_event_ids if i in evidence)
        if (level := evidence_trust(kind, payload, flag)) is not None and level <= TrustLevel.USER
    )
    texts = [text for text, _ in sources]
    quoted = quoted_sources([fact.statement], texts, allowed).get(0, frozenset())
    # And a memory too short for any of those, copied whole (a short recall line: an
    # audit). Memories only: a tool's or a skill's short description ("Create a calendar
    # event") is in too many of the user's own requests (a review).
    memories = [j for j, (_, trust) in enumerate(sources) if trust is TrustLevel.MEMORY]
    whole = quoted_whole(fact.statement, [texts[j] for j in memories], allowed)
    quoted |= {memories[k] for k in whole}
    if not quoted:
        return fact
    trust = lowest_trust([fact.trust, *(sources[j][1] for j in quoted)])
    return fact.model_copy(update={"trust": trust})


async def update_working_state(
    engine: Engine,
    tenant_id: str,
    session_id: UUID,
    run_id: UUID,
    expected_version: int,
    writer: Writer,
    update: WorkingStateUpdate,
    idempotency_key: str,
    request_sha256: str,
    cited: Sequence[Sequence[str]] = (),
    *,
    relayed: bool = False,
) -> dict[str, Any]:
    """UpdateWorkingState: one typed transition -> checkpoint + event. `cited`: per fact of
    the update, the item ids it cites (resolved here, under the session lock). `relayed`:
    the update is a model's control call, which only a plan offering the tool admits.

    -> {"checkpoint_version", "event_sequence", "state"} (state as JSON).
    """
    stored_plan = await engine.get_plan(tenant_id, session_id)
    count_tokens = engine.count_tokens_for(stored_plan.plan.model_id)
    async with engine.gates.held(tenant_id, session_id), transaction(engine.pool) as conn:
        epoch = await sessions.lock_session(conn, tenant_id, session_id)
        stored = await idempotency.recall_response(
            conn, tenant_id, session_id, idempotency_key, "UpdateWorkingState", request_sha256
        )
        if stored is not None:
            return stored
        run = await runs.read_run(conn, tenant_id, session_id, run_id)
        if run.parent_run_id is not None and writer is Writer.USER:
            # A child run's "user" is its parent agent, whose words are the model's
            # (core/seeding.py, Rule 4): written as the user's, they were labelled the
            # user's in the child's block and outranked its model (a trust audit).
            raise InvalidFieldError(
                "a child run's user is its parent agent: write its state as WRITER_MODEL",
                field="writer",
            )
        if relayed:
            await _require_offered(conn, tenant_id, session_id, run_id)
        checkpoint = await runs.read_checkpoint(conn, tenant_id, run_id)
        require_version(checkpoint, expected_version)
        # Before the facts' evidence is read and compared: a writer that may not set a
        # field was told about a fact's evidence instead (an audit), after that work.
        require_writer_fields(update, writer)
        if writer is not Writer.USER:
            await _refuse_quoted_entries(conn, tenant_id, session_id, run, checkpoint, update)
        update = await _lowered_facts(
            conn, tenant_id, session_id, run_id, run, checkpoint, update, cited
        )
        version = checkpoint.version + 1
        transition, sequence = await record_transition(
            conn,
            tenant_id,
            session_id,
            run_id,
            checkpoint.working_state,
            update,
            writer=writer,
            checkpoint_version=version,
            count_tokens=count_tokens,
            pending=pending_questions(checkpoint.items),
        )
        # Pinned anew, as every checkpoint written pins the factor current then (api/usage.py
        # Rule 4): a copy kept the one before, so a factor learned since, or a new model's
        # after a rotation, reached the run's Builds only at its next append (an audit).
        pinned = await engine.pinned_factor(conn, tenant_id, session_id, epoch)
        written = checkpoint.model_copy(
            update={"version": version, "working_state": transition.state, **pinned}
        )
        await runs.insert_checkpoint(conn, tenant_id, written)
        result = {
            "checkpoint_version": version,
            "event_sequence": sequence,
            "state": transition.state.model_dump(mode="json"),
        }
        await idempotency.remember_response(
            conn,
            tenant_id,
            session_id,
            idempotency_key,
            "UpdateWorkingState",
            request_sha256,
            result,
        )
    engine.checkpoint_written(tenant_id, session_id, written, expected_version)
    return result


async def _require_offered(conn: Any, tenant_id: str, session_id: UUID, run_id: UUID) -> None:
    """A relayed control call needs the plan the run builds on to offer the tool: the model
    was not given it otherwise, and a call of it is text it wrote, not the engine's to apply
    (a review: a tool loop applied an injected objective and constraint). The run's plan,
    not the session's current one: a run keeps its epoch across another run's admission.

    Raises:
        InvalidFieldError: naming tool_arguments_json.
    """
    head = await runs.read_run_head(conn, tenant_id, session_id, run_id)
    stored = await plans.read_plan(conn, tenant_id, session_id, head.effective_epoch)
    plan = stored.plan
    # The engine's own definition (builtin): a tool of that name a server lists is its own
    # (a review), whose calls are not the engine's to apply.
    builtin = any(t.name == UPDATE_TOOL_NAME and t.builtin for t in stored.spec.tools)
    if not builtin or UPDATE_TOOL_NAME not in (*plan.tool_names, *plan.deferred_tool_names):
        raise InvalidFieldError(
            f"the plan this run builds on does not offer the engine's {UPDATE_TOOL_NAME}: a"
            " call the model was not given the tool for is not applied",
            field="tool_arguments_json",
        )


def _trusted_candidate(fact: Fact, evidence: dict[int, tuple[str, dict[str, Any], bool]]) -> bool:
    if fact.trust not in _TRUSTED_EVIDENCE or not fact.source_event_ids:
        return False
    return all(i in evidence and _user_source(*evidence[i]) for i in fact.source_event_ids)


def _user_source(event_type: str, payload: dict[str, Any], conversation: bool) -> bool:
    """Whether an event is the user's (or the platform's) words: a tool's result is not,
    whatever trust its writer gave it, but for conversation.ask_user's answers (an audit:
    an email tool's result labelled USER was offered as the user's)."""
    if evidence_trust(event_type, payload, conversation) not in _TRUSTED_EVIDENCE:
        return False
    is_result = event_type == "tool.result.created"
    return not is_result or payload.get("tool_name") == ASK_USER_TOOL


async def offer_fact_candidates(
    engine: Engine,
    tenant_id: str,
    session_id: UUID,
    idempotency_key: str = "",
    request_sha256: str = "",
) -> dict[str, Any]:
    """The facts the session's log ends with whose every source is trusted, as candidates.

    Recomputed from the log (the fold every new run uses), re-checked against the evidence
    events themselves, and recorded as memory.fact_candidates.offered. Candidates, never
    beliefs: formation applies its own gates. A retry under the first call's idempotency
    key answers with that call's offer and records no second event.
    -> {"candidates": [{"fact", "authority", "run_id"}], "event_sequence"}
    """
    async with engine.gates.held(tenant_id, session_id), transaction(engine.pool) as conn:
        await sessions.lock_session(conn, tenant_id, session_id)
        stored = await idempotency.recall_response(
            conn, tenant_id, session_id, idempotency_key, "OfferFactCandidates", request_sha256
        )
        if stored is not None:
            return stored
        # Facts only: the block's ceiling decides only the never-hiding fields, so the
        # fold needs no model's counter (and a session without a plan can still answer).
        state = await carried_state(conn, tenant_id, session_id, 2**62, engine.kept)
        evidence = await ws_store.read_evidence_at(
            conn, tenant_id, session_id, [i for f in state.facts for i in f.source_event_ids]
        )
        run_id = await ws_store.latest_top_level_run(conn, tenant_id, session_id)
        candidates = [
            {
                "fact": fact.model_dump(mode="json"),
                "authority": FACT_CANDIDATE_AUTHORITY,
                "run_id": str(run_id or ""),
            }
            for fact in state.facts
            if _trusted_candidate(fact, evidence)
        ]
        (sequence,) = await events.append_events(
            conn,
            tenant_id,
            session_id,
            [
                NewEvent(
                    FACT_CANDIDATES_OFFERED,
                    {"candidates": candidates, "offered": len(candidates)},
                    run_id=run_id,
                )
            ],
        )
        result = {"candidates": candidates, "event_sequence": sequence}
        await idempotency.remember_response(
            conn,
            tenant_id,
            session_id,
            idempotency_key,
            "OfferFactCandidates",
            request_sha256,
            result,
        )
    return result
