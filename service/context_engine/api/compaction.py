"""Compaction orchestration: prepare the worker's summarizer input, commit its result.

Prepare reads the checkpoint, its carried history, the text of earlier elided spans, the
step lines recorded Builds showed the model and the enveloped prefix entries of the plans
they (and the run) were made on; commit is one transaction under the session row lock
that re-prepares from the same checkpoint, validates the worker's result against it, and
writes the run's next checkpoint and the context.compacted event together. The log below
the seed is immutable, so the re-prepare computes what prepare did, unless what the model
was shown changed in between: a Build recorded since (new step lines, a new plan's
prefix) can elide an item prepare kept, and an erasure that redacted a plan or a record
can keep an item prepare elided (its source is gone); the commit then answers
COMPACTION_MISMATCH (prepare again). Neither writes the plan: the prefix cannot
move. A retry with the same idempotency key and request returns the first response and
writes nothing (Committed.replayed: telemetry counts the compaction once).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any
from uuid import UUID

from ..core.budget import allocate
from ..core.build_record import INPUTS_KEY, SHOWN_FIELDS, shown_items
from ..core.checkpoint import Checkpoint, applied_factor, require_version
from ..core.compaction import (
    CompactionResult,
    Prepared,
    check_result,
    compacted_checkpoint,
    elided_content,
    prepare,
    require_room,
    require_shrink,
)
from ..core.errors import InvalidFieldError, NotFoundError
from ..core.items import ContextItem, ConversationItem
from ..core.plan import ContextPlan, PrefixData, prefix_data
from ..core.seeding import carried_history, seed_cut
from ..core.skills import LoadedSkill, body_trust, pinned_entry
from ..core.spec import SkillSpec
from ..core.trust import TrustLevel
from ..store import events, idempotency, plans, runs, sessions
from ..store import skills as skill_store
from ..store import working_state as ws_store
from ..store.db import snapshot, transaction
from ..store.events import NewEvent

if TYPE_CHECKING:
    from .engine import Engine, TokenCounter

__all__ = ["COMPACTED", "Committed", "commit_compaction", "prepare_compaction"]

COMPACTED = "context.compacted"


@dataclass(frozen=True, slots=True)
class _Inputs:
    checkpoint: Checkpoint
    carried: tuple[ConversationItem, ...]  # as Build reads it
    earlier: dict[int, str]  # by event id, the logged text of each span an earlier compaction
    # elided
    shown: tuple[ContextItem, ...]  # the step lines recorded Builds showed the model
    skills: tuple[LoadedSkill, ...]  # the session's loaded skill bodies, shown every step
    prefix: tuple[PrefixData, ...]  # the enveloped prefix entries of the plans shown
    tool_names: frozenset[str]  # the tools those plans offer, defined and deferred
    child: bool  # a child run: its user messages are its parent's words
    # The plan the run builds on (its lineage's latest, store/runs.py RunHead): its body
    # bounds what the engine's cut keeps and what a summary may take.
    plan: ContextPlan


@dataclass(frozen=True, slots=True)
class Committed:
    """CommitCompaction's answer, and what telemetry records of it."""

    response: dict[str, Any]  # {checkpoint_version, event_sequence}, as stored for a retry
    depth: int  # the committed summary's depth (0 for a replay)
    # A retry answered with the first response: it committed nothing, so counts nothing.
    replayed: bool = False


async def _inputs(
    conn: Any, tenant_id: str, session_id: UUID, run_id: UUID, version: int
) -> _Inputs:
    """What prepare reads. The step lines are those of every request recorded from the
    earliest that produced, for a run whose items are in view, its first item above the
    floor on (store/events.py _REQUESTS_FROM): the model may have quoted any of them in an
    item still in view (core/compaction.py, Rule 3). So are the prefix entries of the
    plans those requests were made on, and of the run's own."""
    try:
        head = await runs.read_run_head(conn, tenant_id, session_id, run_id)
    except NotFoundError:
        await plans.read_plan(conn, tenant_id, session_id)  # an unknown session is named first
        raise
    run = head.run
    own = await plans.read_plan(conn, tenant_id, session_id, head.effective_epoch)
    checkpoint = await runs.read_checkpoint(conn, tenant_id, run_id, version)
    logged = await events.read_carried_items(
        conn,
        tenant_id,
        session_id,
        below_sequence=seed_cut(run.seed_event_sequence),
        above_sequence=checkpoint.replaced_through_sequence,
    )
    earlier = checkpoint.compaction.elided if checkpoint.compaction else ()
    found = await ws_store.read_events_at(
        conn, tenant_id, session_id, [s.event_id for s in earlier]
    )
    contents = {
        s.event_id: elided_content(*found[s.event_id]) for s in earlier if s.event_id in found
    }
    # The runs whose items are in view: each one's requests showed its model what they
    # may quote.
    in_view = sorted({i.run_id for i in (*logged, *checkpoint.items)})
    shown = await events.read_shown(
        conn,
        tenant_id,
        session_id,
        inputs_key=INPUTS_KEY,
        fields=SHOWN_FIELDS,
        from_sequence=checkpoint.replaced_through_sequence,
        in_view=in_view,
    )
    skills = await skill_store.read_loaded(conn, tenant_id, session_id)
    epochs = sorted({*shown.epochs, *head.plan_epochs})
    shown_plans = await plans.read_distinct_prefixes(conn, tenant_id, session_id, epochs)
    prefix = [entry for p in shown_plans for entry in prefix_data(p.plan, p.spec)]
    # Each body as the least trusted Build showed it: a plan whose pinned entry a Rotate
    # lowered (or took out) showed it lower than it was loaded (core/skills.py, Rule 6; a
    # review: a summary could restate a body Build had enveloped as untrusted).
    skills = [
        replace(
            s,
            trust=max(
                (_shown_trust(s, p.spec.skills, p.plan.skill_pins) for p in shown_plans),
                default=s.trust,
            ),
        )
        for s in skills
    ]
    # The tools the run is or will be given, not the sweep's: another lineage's (a grant's
    # fork) would license a tool's name this run never had (a review).
    given = sorted({*shown.epochs, run.epoch, head.effective_epoch})
    tool_names = await plans.read_tool_names(conn, tenant_id, session_id, given)
    return _Inputs(
        checkpoint,
        carried_history(logged),
        contents,
        shown_items(shown.lines),
        tuple(skills),
        tuple(prefix),
        tool_names,
        child=run.parent_run_id is not None,
        plan=own.plan,
    )


def _shown_trust(
    skill: LoadedSkill, catalog: Sequence[SkillSpec], pins: Sequence[tuple[str, str]]
) -> TrustLevel:
    """The trust a plan of `catalog` and `pins` showed the loaded body at (Build's rule)."""
    return body_trust(pinned_entry(catalog, pins, skill.name)[1], skill.trust)


def _plan_facts(engine: Engine, plan: ContextPlan) -> tuple[TokenCounter, int]:
    """The token counter of the run's plan, and the plan's body (what Build may put in a
    request after the prefix, before the renderers' framing): what the engine's own cut
    keeps and what a summary may take are held to it (core/compaction.py, KEEP_BODY_PPM).
    The run's plan, not the session's current one: an admission fork's (another run's
    grant) can carry a larger prefix, so a smaller body, than the plan the run builds on."""
    budget = allocate(
        context_window=plan.context_window,
        policy_cap_tokens=plan.policy_cap_tokens,
        reserve_output_tokens=plan.max_output_tokens,
        prefix_tokens=plan.prefix_tokens,
    )
    return engine.count_tokens_for(plan.model_id), max(budget.body_tokens, 1)


async def prepare_compaction(
    engine: Engine,
    tenant_id: str,
    session_id: UUID,
    run_id: UUID,
    checkpoint_version: int,
    through_sequence: int,
) -> Prepared:
    """PrepareCompaction: the summarizer input for the given (or latest) checkpoint."""
    async with snapshot(engine.pool) as conn:  # its reads agree with each other
        inputs = await _inputs(conn, tenant_id, session_id, run_id, checkpoint_version)
    count_tokens, body_tokens = _plan_facts(engine, inputs.plan)
    # Elision and the quoting check scan every untrusted text in view: CPU work, off the
    # event loop.
    return await asyncio.to_thread(
        prepare,
        inputs.checkpoint,
        inputs.carried,
        through_sequence=through_sequence,
        count_tokens=count_tokens,
        earlier_contents=inputs.earlier,
        shown=inputs.shown,
        skills=inputs.skills,
        prefix=inputs.prefix,
        tool_names=inputs.tool_names,
        child=inputs.child,
        body_tokens=body_tokens,
        factor_ppm=applied_factor(inputs.checkpoint, inputs.plan.model_id),
    )


def _reprepare(inputs: _Inputs, through: int, count_tokens: TokenCounter) -> Prepared:
    field = "result.replaced_through_sequence"
    if through < 1:
        raise InvalidFieldError(
            f"{field} is required: commit the value PrepareCompaction returned",
            field=field,
            reason="COMPACTION_MISMATCH",
        )
    try:
        return prepare(
            inputs.checkpoint,
            inputs.carried,
            through_sequence=through,
            count_tokens=count_tokens,
            earlier_contents=inputs.earlier,
            shown=inputs.shown,
            skills=inputs.skills,
            prefix=inputs.prefix,
            tool_names=inputs.tool_names,
            child=inputs.child,
        )
    except InvalidFieldError as exc:
        if exc.field != "through_sequence":
            raise
        raise InvalidFieldError(
            f"{field} {through} is not what PrepareCompaction prepared: {exc.message}",
            field=field,
            reason="COMPACTION_MISMATCH",
        ) from None


# Unlocked passes a commit makes before it checks under the session's lock.
_UNLOCKED_PASSES = 3


async def commit_compaction(
    engine: Engine,
    tenant_id: str,
    session_id: UUID,
    run_id: UUID,
    expected_version: int,
    result: CompactionResult,
    idempotency_key: str,
    request_sha256: str,
) -> Committed:
    """CommitCompaction: validate and store the result.

    Checking the result prepares again over what compaction reads (the log above the floor,
    the lines recorded Builds showed, the plans in view): seconds of CPU for a long log. It
    is done on one snapshot, without the session's lock, which every other write to the
    session (and an erasure naming a person of it) would wait on meanwhile (an audit: 20 s
    under the lock at 40,000 events, every such write SESSION_BUSY). Under the lock the
    check stands if the session has not moved since (sessions.session_mark); if it has,
    the lock is let go and the check made again on a new snapshot, up to
    _UNLOCKED_PASSES times (a review: checking again under the lock held it as long as
    before on a busy session), and then under the lock."""
    for unlocked_pass in range(_UNLOCKED_PASSES + 1):
        under_lock = unlocked_pass == _UNLOCKED_PASSES
        if not under_lock:
            async with snapshot(engine.pool) as conn:
                stored = await _stored(conn, tenant_id, session_id, idempotency_key, request_sha256)
                if stored is not None:
                    return Committed(stored, 0, replayed=True)
                mark = await sessions.session_mark(conn, tenant_id, session_id, run_id)
                inputs = await _inputs(conn, tenant_id, session_id, run_id, 0)
            record, retained = await _checked(engine, inputs, expected_version, result)
        async with engine.gates.held(tenant_id, session_id), transaction(engine.pool) as conn:
            epoch = await sessions.lock_session(conn, tenant_id, session_id)
            stored = await _stored(conn, tenant_id, session_id, idempotency_key, request_sha256)
            if stored is not None:
                return Committed(stored, 0, replayed=True)
            if under_lock:
                inputs = await _inputs(conn, tenant_id, session_id, run_id, 0)
                record, retained = await _checked(engine, inputs, expected_version, result)
            elif await sessions.session_mark(conn, tenant_id, session_id, run_id) != mark:
                continue  # the session moved: let it go, and check again
            pinned = await engine.pinned_factor(conn, tenant_id, session_id, epoch)
            # The checkpoint written pins the factor current now, which a usage report
            # since the run's last write may have raised: the summary must fit under it.
            factor = applied_factor(
                inputs.checkpoint.model_copy(update=pinned), inputs.plan.model_id
            )
            if factor > applied_factor(inputs.checkpoint, inputs.plan.model_id):
                count_tokens, body_tokens = _plan_facts(engine, inputs.plan)
                require_room(record, count_tokens, body_tokens, retained, factor)
            response, written = await _write(
                conn,
                tenant_id,
                session_id,
                run_id,
                inputs.checkpoint,
                record,
                idempotency_key,
                request_sha256,
                pinned,
            )
        # Kept once the transaction has committed.
        engine.checkpoint_written(tenant_id, session_id, written, expected_version)
        return Committed(response, record.depth)
    raise AssertionError("unreachable: the last pass checks under the lock")


async def _stored(
    conn: Any, tenant_id: str, session_id: UUID, idempotency_key: str, request_sha256: str
) -> dict[str, Any] | None:
    return await idempotency.recall_response(
        conn, tenant_id, session_id, idempotency_key, "CommitCompaction", request_sha256
    )


async def _write(
    conn: Any,
    tenant_id: str,
    session_id: UUID,
    run_id: UUID,
    checkpoint: Checkpoint,
    record: CompactionResult,
    idempotency_key: str,
    request_sha256: str,
    pinned: dict[str, Any],
) -> tuple[dict[str, Any], Checkpoint]:
    """Store the checked record over `checkpoint`, with the session locked: the new
    checkpoint (pinning the estimator factor current now, `pinned`: Engine.pinned_factor),
    the event and the key's response. -> (the response, the new checkpoint)."""
    new_checkpoint = compacted_checkpoint(checkpoint, record).model_copy(update=pinned)
    await runs.insert_checkpoint(conn, tenant_id, new_checkpoint)
    payload = {
        **record.model_dump(mode="json"),
        "checkpoint_version": new_checkpoint.version,
        "from_checkpoint_version": checkpoint.version,
    }
    (sequence,) = await events.append_events(
        conn, tenant_id, session_id, [NewEvent(COMPACTED, payload, run_id=run_id)]
    )
    response = {"checkpoint_version": new_checkpoint.version, "event_sequence": sequence}
    await idempotency.remember_response(
        conn, tenant_id, session_id, idempotency_key, "CommitCompaction", request_sha256, response
    )
    return response, new_checkpoint


async def _checked(
    engine: Engine, inputs: _Inputs, expected_version: int, result: CompactionResult
) -> tuple[CompactionResult, tuple[str, ...]]:
    """The record `result` commits over `inputs`, or the refusal (a version conflict, a
    mismatch with what prepare gives now, a summary that launders, does not shrink, or
    takes more than half the run's plan's body as Build costs it under the checkpoint's
    estimator correction), with the texts it retains verbatim (require_room's `retained`)."""
    count_tokens, body_tokens = _plan_facts(engine, inputs.plan)
    require_version(inputs.checkpoint, expected_version, "; prepare again")
    prepared = await asyncio.to_thread(
        _reprepare, inputs, result.replaced_through_sequence, count_tokens
    )
    record = await asyncio.to_thread(check_result, prepared, result, count_tokens)
    retained = (*prepared.retained_constraints, *prepared.open_questions)
    require_shrink(record, count_tokens, retained)
    factor = applied_factor(inputs.checkpoint, inputs.plan.model_id)
    require_room(record, count_tokens, body_tokens, retained, factor)
    return record, retained
