"""Skill loads and subject erasure: load (store) -> decide (core) -> record (store).

Both are writes under session row locks. A load is one transaction: one that fails writes
nothing. An erasure is one transaction for the person's record and one per session it
redacts: one that fails part way has recorded the person and redacted the sessions before
the one it stopped at, and a resend finishes it.

LoadSkill (core/skills.py): the body must be in the plan's pinned catalog, at most two load
per session within 6,000 tokens, a third fails rather than evicting; loads are sticky and
Build renders them in load order (row 11). Records skill.loaded.

EraseSubject (core/snapshot.py): every persisted snapshot holding the person's memories is
redacted and its plan invalidated (the next Plan, run admission or Build rotates with
snapshot_invalidated); the runs already bound to those snapshots (context.snapshot.used)
are reported. Records context.snapshot.invalidated per affected session. Every recorded
request whose recall or correction lines name the person loses those lines from its record
and is marked redacted (core/build_record.py, Rule 4), which GetBuild refuses; records
context.requests.redacted per affected session.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any
from uuid import UUID

from .. import telemetry
from ..core.assemble import skill_body_texts
from ..core.build_record import redact_record
from ..core.errors import PreconditionError
from ..core.plan import skill_room
from ..core.skills import (
    LoadedSkill,
    admit_load,
    admit_tokens,
    body_trust,
    pinned_entry,
    still_fit,
)
from ..core.snapshot import redact_person
from ..core.trust import TrustLevel
from ..store import events, plans, runs, sessions, snapshots
from ..store import skills as skill_store
from ..store.db import SessionBusyError, transaction
from ..store.events import NewEvent
from . import usage as usage_api

if TYPE_CHECKING:
    from .engine import Engine

__all__ = ["Erasure", "check_loaded_fit", "erase_subject", "load_skill"]

SKILL_LOADED = "skill.loaded"
SNAPSHOT_INVALIDATED = "context.snapshot.invalidated"
REQUESTS_REDACTED = "context.requests.redacted"


@dataclass(frozen=True, slots=True)
class Erasure:
    invalidated_session_ids: tuple[UUID, ...]
    bound_run_ids: tuple[UUID, ...]
    redacted_items: int
    redacted_requests: int
    # The runs whose recorded requests lost a line: those requests were already sent.
    redacted_request_run_ids: tuple[UUID, ...]


async def load_skill(
    engine: Engine,
    tenant: str,
    session_id: UUID,
    name: str,
    body: str,
    trust: TrustLevel | None,
    run_id: UUID | None,
) -> tuple[list[str], bool]:
    """Load a skill body for the session. -> (loaded names in load order, newly loaded).

    Raises:
        PreconditionError: PLAN_NOT_FOUND, SKILL_NOT_IN_CATALOG, SKILL_LIMIT or
            SKILL_ALREADY_LOADED.
        InvalidFieldError: a trust no body may carry.
        NotFoundError: an unknown session or run.
    """
    continued: plans.StoredPlan | None = None
    async with engine.gates.held(tenant, session_id), transaction(engine.pool) as conn:
        epoch, revision = await sessions.lock_session_plans(conn, tenant, session_id)
        if epoch == 0:
            raise PreconditionError(
                f"session {session_id} has no plan; call Plan first",
                field="session_id",
                reason="PLAN_NOT_FOUND",
            )
        head = (
            await runs.read_run_head(conn, tenant, session_id, run_id)
            if run_id is not None
            else None
        )
        current = await plans.read_plan(conn, tenant, session_id)
        loaded = await skill_store.read_loaded(conn, tenant, session_id)
        names = [s.name for s in loaded]
        version, catalog_trust = pinned_entry(current.spec.skills, current.plan.skill_pins, name)
        effective = body_trust(catalog_trust, trust)
        skill = LoadedSkill(name=name, version=version, body=body, trust=effective, tokens=0)
        if not admit_load(loaded, current.plan.skill_pins, skill, claimed=trust):
            return names, False
        # Measured once nothing cheaper refuses it (core/skills.py Rule 4).
        count = engine.count_tokens_for(current.plan.model_id)
        tokens = await asyncio.to_thread(
            _body_tokens, name, version, body, effective, current.secret, count
        )
        skill = replace(skill, tokens=tokens)
        # The bodies held, measured again as this plan's Builds pay them: a stored count is
        # its load's, with the plan of then (a review: after a Rotate to a model whose
        # tokenizer counts more, a second body was admitted past the class cap, and every
        # later Rotate keeping the model was refused SKILL_LIMIT).
        held = [await _measured(s, current.secret, count) for s in loaded]
        # The room as the session's Builds pay it: at the correction they pin now.
        factor = await usage_api.pinned_factor(
            conn, tenant, current.plan.model_id, engine.tokenizer_of
        )
        room = skill_room(current.plan, current.spec, count, factor)
        admit_tokens(held, skill, room, factor)
        # And beside the plan the loading run builds on: a run admitted with a grant is on a
        # lineage of its own, whose tools take room the current plan leaves (a review: the
        # load was admitted and that run's Builds all failed). Only that run's: measuring
        # every lineage a session ever forked cost a load seconds under the session lock
        # after a few hundred forks, and refused loads for lineages no run builds on again
        # or that the next Build rebuilds (another review). Another run whose lineage
        # cannot carry the bodies fails its own Builds BUDGET_EXCEEDED, as a stale lineage
        # does (docs/architecture.md, Epochs). A lineage behind a sweep is continued here,
        # as the run's next Build would continue it, and that plan measured (a review: the
        # plan went unmeasured, and the run's Builds all failed SKILL_LIMIT); a refused
        # load writes neither.
        if head is not None:
            own, continued = await engine.continue_behind(
                conn, tenant, session_id, head, epoch, revision
            )
            if own.plan.epoch != current.plan.epoch:
                await _admit_beside(engine, conn, tenant, own, loaded, skill)
        payload = {
            "name": name,
            "version": version,
            "trust": effective.name,
            "tokens": tokens,
            "position": len(loaded),
            "epoch": current.plan.epoch,
        }
        (sequence,) = await events.append_events(
            conn, tenant, session_id, [NewEvent(SKILL_LOADED, payload, run_id=run_id)]
        )
        await skill_store.insert_loaded(
            conn, tenant, session_id, len(loaded), skill, run_id, sequence
        )
    if continued is not None:  # counted once committed, as Build counts its own
        telemetry.record_rotation(continued.plan.reason.name.lower())
    return [*names, name], True


async def _admit_beside(
    engine: Engine,
    conn: Any,
    tenant: str,
    stored: plans.StoredPlan,
    loaded: Sequence[LoadedSkill],
    skill: LoadedSkill,
) -> None:
    """admit_tokens for `skill` beside `loaded`, all measured with `stored`'s counter and
    costed in its room, as that plan's Builds would pay them.

    Raises:
        PreconditionError: SKILL_LIMIT naming `body`.
    """
    plan = stored.plan
    count = engine.count_tokens_for(plan.model_id)
    held = [await _measured(s, stored.secret, count) for s in loaded]
    new = await _measured(skill, stored.secret, count)
    factor = await usage_api.pinned_factor(conn, tenant, plan.model_id, engine.tokenizer_of)
    admit_tokens(held, new, skill_room(plan, stored.spec, count, factor), factor)


async def _measured(skill: LoadedSkill, secret: bytes, count: Callable[[str], int]) -> LoadedSkill:
    """`skill` with its tokens measured again under a plan's secret and counter."""
    tokens = await asyncio.to_thread(
        _body_tokens, skill.name, skill.version, skill.body, skill.trust, secret, count
    )
    return replace(skill, tokens=tokens)


async def check_loaded_fit(
    engine: Engine, conn: Any, tenant: str, session_id: UUID, stored: plans.StoredPlan
) -> None:
    """Whether the session's loaded skill bodies fit `stored`, a plan a rotation is about to
    start (a Rotate with a spec or without, a run's admission, a lineage's continuation, a
    Plan after an erasure): each measured again with its counter (in every form Build can
    send it in, as LoadSkill measured it) and costed at the factor its Builds pin
    (core/skills.py still_fit). In the rotation's transaction: a refusal writes nothing.

    Raises:
        PreconditionError: SKILL_LIMIT naming `spec` (the engine names the session's state
            or the admission when the request sent no spec).
    """
    loaded = await skill_store.read_loaded(conn, tenant, session_id)
    if not loaded:
        return
    plan = stored.plan
    count = engine.count_tokens_for(plan.model_id)
    measured = [await _measured(s, stored.secret, count) for s in loaded]
    factor = await usage_api.pinned_factor(conn, tenant, plan.model_id, engine.tokenizer_of)
    still_fit(measured, skill_room(plan, stored.spec, count, factor), factor)


def _body_tokens(
    name: str,
    version: str,
    body: str,
    trust: TrustLevel,
    secret: bytes,
    count: Callable[[str], int],
) -> int:
    """The most the body's rendered forms cost (core/assemble.py skill_body_texts).
    Rendered and counted off the event loop, as Plan's renderings are: a body of megabytes
    takes seconds to escape and count before the cap refuses it (an audit: one load held
    a replica's loop for 5 s)."""
    return max(count(text) for text in skill_body_texts(name, version, body, trust, secret))


async def erase_subject(engine: Engine, tenant: str, person_id: str) -> Erasure:
    """Redact a person's memories from every persisted snapshot of the tenant, and their
    recall and correction lines from every recorded request.

    First the person's fence, in a transaction of its own: the person is recorded as
    erased, so a later Plan or Rotate whose snapshot, or Build whose recall, still names
    them is refused (PERSON_ERASED), and the sessions holding or naming them are read (one
    persisted before is committed, and found). Then each of those sessions is redacted in a
    transaction of its own, its holdings re-read under its lock (a rotation that copied the
    snapshot meanwhile is redacted too), sessions in one order (sorted ids). One session at
    a time: holding every session's lock to the end kept each of their writers waiting, a
    pooled connection each, until a replica's pool ran dry for every tenant (an audit).
    An erasure interrupted (SESSION_BUSY, UNAVAILABLE) has recorded the person and redacted
    the sessions before; a resend finishes it.

    The answer is everything erasing this person has done, this call and the earlier ones
    together (kept with the record of the erasure, updated with each session): a resend
    whose first answer was lost answers as the first did, where it answered empty and the
    bound runs were lost with the dropped response.
    """
    async with transaction(engine.pool) as conn:
        earlier = await snapshots.fence_erasure(conn, tenant, person_id)
        holding = await snapshots.plans_holding(conn, tenant, person_id)
        naming = await snapshots.sessions_naming(conn, tenant, person_id)
        erasure = _with_earlier(_NOTHING_FOUND, earlier)
        await snapshots.record_erasure_outcome(conn, tenant, person_id, _outcome_json(erasure))
    for session_id in sorted({*holding, *naming}):
        try:
            async with engine.gates.held(tenant, session_id), transaction(engine.pool) as conn:
                # The fence before the session lock, as every writer naming the person takes
                # it: another erasure of the person waits here, so the outcome adds up.
                earlier = await snapshots.fence_erasure(conn, tenant, person_id)
                found = await _erase_in_session(conn, tenant, person_id, session_id)
                erasure = _with_earlier(found, earlier)
                await snapshots.record_erasure_outcome(
                    conn, tenant, person_id, _outcome_json(erasure)
                )
        except SessionBusyError as busy:
            # Its own words: the busy error's "nothing was written, retry under the key"
            # is not so here (an audit): the person is recorded as erased and the sessions
            # before this one are redacted, and EraseSubject takes no key.
            busy.message = (
                f"session {session_id} stayed busy with another write; the person is"
                " recorded as erased and the sessions before it are redacted: resend"
                " EraseSubject to finish"
            )
            busy.args = (busy.message,)
            raise
        if session_id in holding:
            engine.forget_cached_plans(tenant, session_id)
    return erasure


_NOTHING_FOUND = Erasure((), (), 0, 0, ())


async def _erase_in_session(conn: Any, tenant: str, person_id: str, session_id: UUID) -> Erasure:
    """Redact the person from one session, locked here: its plans' snapshots (invalidating
    the current one) and its recorded requests, with an event for each."""
    current_epoch = await sessions.lock_session(conn, tenant, session_id)
    epochs = (await snapshots.plans_holding(conn, tenant, person_id, session_id)).get(
        session_id, []
    )
    recorded = (await snapshots.requests_naming(conn, tenant, person_id, session_id)).get(
        session_id, []
    )
    news: list[NewEvent] = []
    invalidated = False
    bound: list[UUID] = []
    redacted = 0
    if epochs:
        for epoch in epochs:
            plan, spec = await snapshots.read_plan_row(conn, tenant, session_id, epoch)
            plan, spec, removed = redact_person(plan, spec, person_id)
            if removed:
                await snapshots.write_redacted_plan(conn, tenant, session_id, plan, spec)
                redacted += removed
                invalidated = invalidated or epoch == current_epoch
        await snapshots.forget_person(conn, tenant, person_id, session_id, epochs)
        bound = await snapshots.bound_runs(conn, tenant, session_id, epochs)
        payload = {
            "epochs": epochs,
            "current_epoch_invalidated": invalidated,
            "redacted_items": redacted,
            "bound_run_ids": [str(r) for r in bound],
        }
        news.append(NewEvent(SNAPSHOT_INVALIDATED, payload))
    lines = 0
    for sequence, _, recorded_payload in recorded:
        # Out of the people index too: a resend finds nothing (redact_record).
        rewritten, removed = redact_record(recorded_payload, person_id)
        await snapshots.rewrite_request(conn, tenant, session_id, sequence, rewritten)
        lines += removed
    if recorded:
        sequences = [sequence for sequence, _, _ in recorded]
        news.append(NewEvent(REQUESTS_REDACTED, {"sequences": sequences, "lines": lines}))
    await events.append_events(conn, tenant, session_id, news)
    # Every Build's record names its run.
    sent_by = dict.fromkeys(run_id for _, run_id, _ in recorded if run_id is not None)
    return Erasure(
        (session_id,) if invalidated else (), tuple(bound), redacted, len(recorded), tuple(sent_by)
    )


def _outcome_json(erasure: Erasure) -> dict[str, Any]:
    return {
        "invalidated_session_ids": [str(s) for s in erasure.invalidated_session_ids],
        "bound_run_ids": [str(r) for r in erasure.bound_run_ids],
        "redacted_items": erasure.redacted_items,
        "redacted_requests": erasure.redacted_requests,
        "redacted_request_run_ids": [str(r) for r in erasure.redacted_request_run_ids],
    }


def _with_earlier(now: Erasure, earlier: dict[str, Any] | None) -> Erasure:
    """This erasure's findings after the earlier ones': ids once each, first seen first."""
    if not earlier:
        return now

    def merged(before: list[str], found: tuple[UUID, ...]) -> tuple[UUID, ...]:
        return tuple(dict.fromkeys([*map(UUID, before), *found]))

    return Erasure(
        merged(earlier["invalidated_session_ids"], now.invalidated_session_ids),
        merged(earlier["bound_run_ids"], now.bound_run_ids),
        int(earlier["redacted_items"]) + now.redacted_items,
        int(earlier["redacted_requests"]) + now.redacted_requests,
        # Not in an outcome recorded before the field was (a resend then lists only what
        # it finds itself).
        merged(earlier.get("redacted_request_run_ids", []), now.redacted_request_run_ids),
    )
