"""The orchestrator: load (store) -> assemble (core) -> record (store), per RPC.

Takes and returns core values; the servicer does the proto conversion around it. The
clock, ids and secrets are injected so tests can pin them; in production they are the
process clock, uuid4 and os.urandom, and this module is the only place that calls them.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator, Callable, Collection, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from datetime import datetime
from functools import partial
from typing import Any, Literal, TypeVar
from uuid import UUID
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import asyncpg

from .. import telemetry
from ..core import epochs as epoch_rules
from ..core.assemble import Assembled, BuildInputs, StepContext, assemble, carried_reaches
from ..core.build_record import (
    ASSEMBLER_KEY,
    ASSEMBLER_VERSION,
    ATTACHMENT_TOKENS_KEY,
    BUDGET_KEY,
    IMAGE_KEY,
    INLINE_KEY,
    INPUTS_KEY,
    PAYLOAD_KEY,
    PEOPLE_KEY,
    TOKENIZER_KEY,
    attachment_tokens,
    estimate_to_record,
    inputs_to_record,
    markers_by_id,
    recalled_people,
    unbridged,
    uncited_passages,
    unmarked_excerpts,
)
from ..core.checkpoint import NEUTRAL_FACTOR_PPM, Checkpoint, applied_factor, require_version
from ..core.enums import PlanReason
from ..core.errors import (
    BudgetExceededError,
    ConflictError,
    EngineError,
    InvalidFieldError,
    NotFoundError,
    PreconditionError,
    RequestError,
)
from ..core.estimator import IMAGE_TOKENS
from ..core.excerpts import DEFAULT_INLINE_MAXIMUM_BYTES
from ..core.items import ConversationItem, ToolCall, ToolResult, UserMessage
from ..core.log_tail import LogTail
from ..core.plan import CapacityError, ContextPlan, ModelFacts, make_plan, require_capacity
from ..core.roster import advertisable
from ..core.seeding import delegated, instruction_item_id, seed_cut
from ..core.skills import body_items
from ..core.snapshot import first_naming, named_people
from ..core.snapshot import nonempty as snapshot_nonempty
from ..core.spec import PlanSpec
from ..core.validate import validate_append
from ..core.working_state import Writer, render_block
from ..providers import RenderedPayload, check_wire_names, render, text_paths
from ..store import events, idempotency, plans, records, runs, sessions, snapshots
from ..store import skills as skill_store
from ..store.batches import Batcher
from ..store.db import HeldConnection, SessionBusyError, acquire, transaction
from ..store.events import EVENT_TYPE_OF_ITEM, NewEvent, item_payload
from ..store.records import (
    BUSY,
    NO_SESSION,
    PERSON_ERASED,
    PLAN_INVALIDATED,
    STALE_HEAD,
    RequestRecord,
)
from . import log_tail
from . import skills as skills_api
from . import usage as usage_api
from . import working_state as ws_api
from .convert import MAX_PEOPLE_NAMED
from .kept import DEFAULT_CACHE_BYTES, Kept, approximate_bytes
from .session_gate import SessionGates

__all__ = ["OFF_LOOP_BYTES", "BuildResult", "ChildSeed", "Engine", "RunStarted", "off_loop"]

R = TypeVar("R")

TokenCounter = Callable[[str], int]


@dataclass(frozen=True, slots=True)
class ChildSeed:
    parent_run_id: UUID
    instruction: str


@dataclass(frozen=True, slots=True)
class RunStarted:
    run_id: UUID
    session_id: UUID
    parent_run_id: UUID | None
    seed_event_sequence: int | None
    epoch: int
    checkpoint_version: int
    rotated_epoch: int | None = None  # set when admission rotated the plan for this run
    # Not stored with the answer (to_json): what this call did, for telemetry. A replayed
    # answer (a retried StartRun) started nothing and rotated nothing.
    rotations: tuple[PlanReason, ...] = ()  # every rotation admission made, in order
    replayed: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "run_id": str(self.run_id),
            "session_id": str(self.session_id),
            "parent_run_id": str(self.parent_run_id) if self.parent_run_id else None,
            "seed_event_sequence": self.seed_event_sequence,
            "epoch": self.epoch,
            "checkpoint_version": self.checkpoint_version,
            "rotated_epoch": self.rotated_epoch,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> RunStarted:
        return cls(
            run_id=UUID(d["run_id"]),
            session_id=UUID(d["session_id"]),
            parent_run_id=UUID(d["parent_run_id"]) if d["parent_run_id"] else None,
            seed_event_sequence=d["seed_event_sequence"],
            epoch=d["epoch"],
            checkpoint_version=d["checkpoint_version"],
            rotated_epoch=d.get("rotated_epoch"),
        )


@dataclass(frozen=True, slots=True)
class BuildResult:
    assembled: Assembled
    plan: ContextPlan
    checkpoint_version: int
    request_sequence: int
    rendered: RenderedPayload | None = None  # provider payload; None without a request
    # Per assembled.attachments entry, the path in the payload of its message's text.
    attachment_paths: tuple[str, ...] = ()


class Engine:
    def __init__(
        self,
        pool: asyncpg.Pool,
        *,
        model_facts: Callable[[str], ModelFacts],
        token_counter: Callable[[str], TokenCounter],
        default_policy: Any,
        clock: Callable[[], datetime],
        new_id: Callable[[], str],
        new_secret: Callable[[], bytes],
        tokenizer_of: Callable[[str], str] | None = None,
        image_tokens_of: Callable[[str], int] | None = None,
        inline_maximum_bytes: int = DEFAULT_INLINE_MAXIMUM_BYTES,
        cache_breakpoints_of: Callable[[str], int | None] | None = None,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
    ) -> None:
        self.pool = pool
        # Writes to one session queue here, not on pooled connections (api/session_gate.py).
        self.gates = SessionGates()
        # A model's cache-marker budget (the registry's max_cache_breakpoints; None: the
        # provider's own limit). Read at every render, Build and GetBuild alike.
        self._cache_breakpoints_of = cache_breakpoints_of or (lambda model_id: None)
        # Which tokenizer counts for a model: a correction learned for another resets.
        self._tokenizer_of = tokenizer_of or (lambda model_id: "heuristic")
        # What Build costs one image at for a model (the registry's figure where it is larger).
        self._image_tokens_of = image_tokens_of or (lambda model_id: IMAGE_TOKENS)
        self._inline_maximum_bytes = inline_maximum_bytes
        self._model_facts = model_facts
        self._token_counter = token_counter
        self.default_policy = default_policy
        self._clock = clock
        self._new_id = new_id
        self._new_secret = new_secret
        # Plans are immutable per (tenant, session, epoch), so a replica may keep them, and
        # checkpoint versions and the log below a pinned seed never change (api/kept.py):
        # the most recently used, within `cache_bytes` (replica_cache_bytes) in all, plans
        # taking a quarter of it. A replica serves any number of sessions.
        self._plans = Kept(max_weight=cache_bytes // 4)
        self._kept = Kept(max_weight=cache_bytes - cache_bytes // 4)
        # Build's round trips (its head read, skipped for a kept head, and its record),
        # shared by the Builds that arrive while one is in flight (store/batches.py): under
        # load one statement and one commit serve many Builds.
        self._read_heads: Batcher[tuple[str, UUID], Any] = Batcher(self._head_rows)
        # The record's round trips, back to back under load, share one held connection
        # while they follow one another (store/db.py HeldConnection, batches.py Rule 4).
        held = HeldConnection(pool)
        # Records answered BUSY waiting for their locks at once, each on a connection of
        # its own: at most half the pool (the rest serves everyone else).
        most = pool.get_max_size() if hasattr(pool, "get_max_size") else 2
        self._busy_records = asyncio.Semaphore(max(1, most // 2))
        self._record_requests: Batcher[RequestRecord, int] = Batcher(
            partial(records.record_requests, pool, connection=held.use),
            idle=held.release,
            weigh=records.people_named,
            max_weight=MAX_PEOPLE_NAMED,
        )

    def new_id(self) -> str:
        return self._new_id()

    @asynccontextmanager
    async def _busy_slot(self, session_id: UUID) -> AsyncIterator[None]:
        """One of the pool's connections a busy record may wait on, waited for as long as
        a session's gate is (store/db.py LOCK_WAIT_SECONDS).

        Raises:
            SessionBusyError: no slot came free within the wait.
        """
        wait = self.gates.wait_seconds
        try:
            async with asyncio.timeout(wait):
                await self._busy_records.acquire()
        except TimeoutError:
            raise SessionBusyError(session_id, wait) from None
        try:
            yield
        finally:
            self._busy_records.release()

    @property
    def kept(self) -> Kept:
        """What this replica keeps of values that never change once written (api/kept.py):
        for the shell's other modules (api/working_state.py keeps its log folds here)."""
        return self._kept

    def serves(self, model_id: str) -> bool:
        """Whether the model registry holds `model_id`."""
        try:
            self._model_facts(model_id)
        except InvalidFieldError:
            return False
        return True

    async def _head_rows(self, keys: Sequence[tuple[str, UUID]]) -> list[Any]:
        async with acquire(self.pool) as conn:
            return await runs.read_run_heads(conn, keys)

    def now(self) -> datetime:
        return self._clock()

    def count_tokens_for(self, model_id: str) -> TokenCounter:
        """The model's token counter (working-state and compaction measurements)."""
        return self._token_counter(model_id)

    def tokenizer_of(self, model_id: str) -> str:
        """The tokenizer counting for the model (estimator corrections are per tokenizer)."""
        return self._tokenizer_of(model_id)

    # --- plans ------------------------------------------------------------------------

    def _make_plan(
        self,
        spec: PlanSpec,
        session_id: UUID,
        epoch: int,
        reason: PlanReason,
        secret: bytes,
        factor_ppm: int | None = NEUTRAL_FACTOR_PPM,
    ) -> ContextPlan:
        """`factor_ppm`: the tenant's estimator factor for the model, for a caller's spec
        (Rotate with a spec; None: Plan, which checks a new session's under its lock); a
        rebuild of a pinned spec checks its capacity at the neutral factor, as it was
        planned, so a factor learned since fails no session's rotations (its Builds say
        BUDGET_EXCEEDED where they no longer fit)."""
        _zone(spec.environment.time_zone)
        facts = self._model_facts(spec.model_id)
        plan = make_plan(
            spec,
            session_id=str(session_id),
            epoch=epoch,
            reason=reason,
            secret=secret,
            model=facts,
            count_tokens=self._token_counter(spec.model_id),
            factor_ppm=factor_ppm,
        )
        _check_roster_wire_names(plan)
        return plan

    async def plan(
        self, tenant: str, session_id: UUID, spec: PlanSpec
    ) -> tuple[plans.StoredPlan, bool, bool]:
        """Open the session's plan, or return the current one. -> (plan, created, matches)."""
        secret = self._new_secret()
        # Rendering and counting a large spec is CPU work: off the event loop, so other
        # sessions' RPCs keep flowing while it runs.
        candidate = await asyncio.to_thread(
            self._make_plan, spec, session_id, 1, PlanReason.SESSION_OPENED, secret, None
        )
        _check_grantable_wire_names(spec)
        async with self.gates.held(tenant, session_id), transaction(self.pool) as conn:
            await _fence_snapshot(conn, tenant, spec)
            await sessions.ensure_session(conn, tenant, session_id)
            epoch = await sessions.lock_session(conn, tenant, session_id)
            counter = self._token_counter(spec.model_id)
            if epoch == 0:
                # Its capacity at the factor its runs will pin.
                factor = await usage_api.pinned_factor(
                    conn, tenant, spec.model_id, self.tokenizer_of
                )
                require_capacity(candidate, counter, factor)
                created_at = await plans.insert_plan(
                    conn, tenant, session_id, candidate, spec, secret, lineage=1
                )
                await plans.set_current_epoch(conn, tenant, session_id, 1)
                await events.append_events(
                    conn,
                    tenant,
                    session_id,
                    [_plan_event("context.plan.created", candidate, {"lineage": 1})],
                )
                stored = plans.StoredPlan(candidate, spec, secret, created_at=created_at)
                return stored, True, True
            # The spec is validated either way (docs/api.md), an existing session's at the
            # neutral factor: a worker reopening it is not refused its own plan because the
            # factor rose since (a review: it was not checked at all).
            require_capacity(candidate, counter, NEUTRAL_FACTOR_PPM)
            current = await plans.read_plan(conn, tenant, session_id)
            if not current.plan.invalidated:
                return current, False, _same_meaning(current.spec, spec)
            # An erasure redacted this snapshot: the next plan recalls again, from the
            # snapshot the worker sends now. Only the snapshot: the rest of its spec (its
            # principal's scopes above all) takes effect through a Rotate with spec, as for
            # any Plan on an open session. A sweep (store/plans.py): the current lineage
            # now, every other from its own spec, with this snapshot, when next used; so
            # which of Plan and Build comes first after an erasure hands no run another's
            # authority.
            # The snapshot of the session's own principal only: another's memories were
            # pinned in this session's prefix, which a Rotate refuses (a review). Refused
            # here, in the transaction, nothing is written.
            _require_same_principal(current.spec, spec)
            fresh = current.spec.model_copy(update={"snapshot": spec.snapshot})
            try:
                rotated = await self._rotate_locked(
                    conn,
                    tenant,
                    session_id,
                    current,
                    PlanReason.SNAPSHOT_INVALIDATED,
                    fresh,
                    "plan after erasure",
                    sweep=True,
                )
            except RequestError as exc:
                # The caller's spec made a plan (candidate): the pinned rest is at fault.
                raise _as_state(exc, "with the snapshot sent after an erasure") from None
            try:
                # A larger snapshot takes room the loaded bodies hold (they never yield).
                await skills_api.check_loaded_fit(self, conn, tenant, session_id, rotated)
            except RequestError as exc:
                raise PreconditionError(
                    exc.message, field="spec.snapshot", reason=exc.reason, metadata=exc.metadata
                ) from None
        # Its response says created=false, so only this call knows it started an epoch.
        _count_rotation(rotated)
        return rotated, False, _same_meaning(rotated.spec, spec)

    # --- the run heads a replica keeps for Build (docs/architecture.md, A Build) ---------

    def _heads(self, tenant: str, session_id: UUID) -> _Heads | None:
        heads: _Heads | None = self._kept.get(("heads", tenant, session_id))
        return heads

    def _put_heads(self, tenant: str, session_id: UUID, heads: _Heads) -> None:
        self._kept.put(("heads", tenant, session_id), heads, approximate_bytes(heads))

    def _writes(self, tenant: str, session_id: UUID) -> tuple[_Heads, int]:
        """The session's kept heads (an empty entry kept now if there is none) and how many
        of its writes through this replica moved or dropped them so far."""
        heads = self._heads(tenant, session_id)
        if heads is None:
            heads = _Heads()
            self._put_heads(tenant, session_id, heads)
        return heads, heads.writes

    def _keep_head(
        self, tenant: str, session_id: UUID, head: runs.RunHead, seen: tuple[_Heads, int]
    ) -> None:
        """Keep `head`, read when the session's heads and writes here were `seen`. A head
        read before a write through this replica (an append, a rotation) is older than
        what the replica knows: kept, the next Build found it moved, with no write since
        to explain it, and took the session for one another replica serves (an audit).
        The entry itself is compared too: one evicted and made again counts from 0."""
        heads = self._heads(tenant, session_id)
        if heads is None or heads is not seen[0] or heads.spread or heads.writes != seen[1]:
            return
        kept = heads.by_run.get(head.run.run_id)
        if kept is None or kept.latest_version <= head.latest_version:
            heads.by_run[head.run.run_id] = head
            self._put_heads(tenant, session_id, heads)

    def checkpoint_written(
        self, tenant: str, session_id: UUID, checkpoint: Checkpoint, expected: int
    ) -> None:
        """A write through this replica made `checkpoint` of its run from version
        `expected`: it is kept, as read back (so the run's next Build reads no checkpoint),
        and a head kept at `expected` moves with it (so that Build confirms its head rather
        than finding it stale and building twice: Engine.build)."""
        run_id = UUID(checkpoint.run_id)
        stored = Checkpoint.model_validate(checkpoint.model_dump(mode="json")).model_copy(
            update={"estimator_model_id": checkpoint.estimator_model_id}  # stored beside it
        )
        self._kept.put(
            ("checkpoint", tenant, run_id, stored.version), stored, approximate_bytes(stored)
        )
        # Counted with no heads kept too: a Build reading one meanwhile must not keep it.
        heads = self._heads(tenant, session_id) or _Heads()
        if heads.spread:
            return
        heads.writes += 1
        head = heads.by_run.get(run_id)
        if head is not None and head.latest_version == expected < stored.version:
            heads.by_run[run_id] = replace(head, latest_version=stored.version)
        self._put_heads(tenant, session_id, heads)

    def forget_heads(self, tenant: str, session_id: UUID) -> None:
        """A write through this replica that may move the heads of a session's runs (a
        plan, a rotation, a run's start, a skill loaded, an erasure's redaction): their next
        Builds here read them afresh rather than find them stale. A session whose calls
        were seen spread over replicas stays so."""
        heads = self._heads(tenant, session_id) or _Heads()
        if not heads.spread:
            heads.by_run.clear()
            heads.writes += 1
            self._put_heads(tenant, session_id, heads)

    def _head_moved(self, tenant: str, session_id: UUID, heads: _Heads, writes: int) -> None:
        """A Build's kept head had moved. Unless a write through this replica since the
        Build began explains it, another replica serves the session too: its Builds here
        then read their heads, as a kept head would mostly be stale (each stale one is a
        Build assembled twice). A write still holding the session's gate here may be the
        one: it counts itself (forget_heads, checkpoint_written) only once it leaves the
        gate, after its commit, and a Build recorded in between took this replica's own
        write for another's, for good (an audit)."""
        if (
            self._heads(tenant, session_id) is heads
            and heads.writes == writes
            and not self.gates.busy(tenant, session_id)
        ):
            self._kept.put(("heads", tenant, session_id), _Heads(spread=True), _HEADS_WEIGHT)
        else:
            self.forget_heads(tenant, session_id)

    def forget_cached_plans(self, tenant: str, session_id: UUID) -> None:
        """Drop this replica's cached plans of a session (an erasure rewrote them), and the
        run heads it kept (the rewrite bumped the session's plans_revision)."""
        self._plans.drop_where(lambda key: key[:2] == (tenant, session_id))  # type: ignore[index]
        self.forget_heads(tenant, session_id)

    async def get_plan(
        self, tenant: str, session_id: UUID, epoch: int = 0, revision: int | None = None
    ) -> plans.StoredPlan:
        """The plan of `epoch` (the current one when 0). A kept copy answers only for an
        epoch named with the session's plans_revision the caller just read: an erasure on
        any replica rewrites plans in place and bumps it, so an older copy is read again."""
        if epoch and revision is not None:
            cached: plans.StoredPlan | None = self._plans.get((tenant, session_id, epoch))
            if cached is not None and cached.revision >= revision:
                return cached
            if cached is not None:
                # The revision is the session's: every plan of it kept here is as old, and
                # may hold what an erasure on another replica redacted (an audit: kept
                # until evicted). Dropped now, not one epoch at a time as each is asked.
                self._plans.drop_where(lambda key: key[:2] == (tenant, session_id))  # type: ignore[index]
        async with telemetry.span("store.read_plan"), acquire(self.pool) as conn:
            stored = await plans.read_plan(conn, tenant, session_id, epoch)
        self._plans.put((tenant, session_id, stored.plan.epoch), stored, approximate_bytes(stored))
        return stored

    async def rotate(
        self,
        tenant: str,
        session_id: UUID,
        from_epoch: int,
        reason: PlanReason,
        spec: PlanSpec | None,
        detail: str,
        idempotency_key: str = "",
        request_sha256: str = "",
    ) -> tuple[plans.StoredPlan, bool]:
        """Rotate explicitly. -> (the plan started, the session's current plan; replayed).
        With `spec`, a plan every run follows (a merge, store/plans.py): the caller's spec
        states the session's configuration and authority. Without, a sweep: the current
        lineage's plan rebuilt from (or, canonicalized, a copy of) its own spec now, every
        other lineage's from its own when next used, so no run is handed another run's
        admitted authority, and one epoch is started however many lineages there are. A
        retry under the first call's idempotency key answers with the plan that call made
        (read as it is now) and rotates nothing: its from_epoch is no longer current, so
        without the key the retry of a rotation whose answer was lost would fail
        EPOCH_CONFLICT."""
        async with self.gates.held(tenant, session_id), transaction(self.pool) as conn:
            stored, fenced = None, None
            if spec is not None:  # the pinned spec was fenced when it was first persisted
                # A rotation that landed answers its retry even after an erasure of a
                # person its snapshot names: the key is looked up before the fence (a
                # committed key is final). A first call looks again under the lock.
                stored = await idempotency.recall_response(
                    conn, tenant, session_id, idempotency_key, "Rotate", request_sha256
                )
                if stored is None:
                    try:
                        await _fence_snapshot(conn, tenant, spec)
                    except PreconditionError as erased:
                        # Held until the key is looked up under the lock: a resend sent
                        # while its first call was in flight, on another replica, waited
                        # for the fence behind an erasure that came after that call, which
                        # landed meanwhile; refused, it looked lost (an audit).
                        fenced = erased
            epoch = await sessions.lock_session(conn, tenant, session_id)
            stored = stored or await idempotency.recall_response(
                conn, tenant, session_id, idempotency_key, "Rotate", request_sha256
            )
            if stored is not None:
                return await plans.read_plan(conn, tenant, session_id, stored["epoch"]), True
            if fenced is not None:
                raise fenced
            if epoch == 0:
                raise PreconditionError(
                    f"session {session_id} has no plan to rotate; call Plan first",
                    field="session_id",
                    reason="PLAN_NOT_FOUND",
                )
            if from_epoch != epoch:
                raise ConflictError(
                    f"from_epoch {from_epoch} is not the current epoch {epoch}",
                    field="from_epoch",
                    reason="EPOCH_CONFLICT",
                    metadata={"current_epoch": str(epoch)},
                )
            current = await plans.read_plan(conn, tenant, session_id)
            factor = NEUTRAL_FACTOR_PPM
            if spec is not None:
                _require_same_principal(current.spec, spec)
                _check_grantable_wire_names(spec)
                # The caller's capacity is checked as Plan checks it: at the factor the
                # session's next run will pin.
                factor = await usage_api.pinned_factor(
                    conn, tenant, spec.model_id, self.tokenizer_of
                )
            elif reason is PlanReason.PREFIX_HASH_CANONICALIZED:
                _require_to_canonicalize(current.plan)
            try:
                # A spec is refused for a canonicalizing rotation (_rotate_locked).
                rotated = await self._rotate_locked(
                    conn,
                    tenant,
                    session_id,
                    current,
                    reason,
                    spec,
                    detail,
                    begins_lineage=spec is not None,
                    sweep=spec is None,
                    factor_ppm=factor,
                )
                # Another model or capacity, or a registry overlay changed since the pinned
                # spec was planned: the loaded bodies never yield, so a plan that cannot
                # carry them would fail every later Build of the session.
                await skills_api.check_loaded_fit(self, conn, tenant, session_id, rotated)
            except RequestError as exc:
                if spec is not None:
                    raise  # the caller's spec: the error names its field
                # Rebuilt from the session's pinned spec: no field of this request is at fault.
                raise _as_state(exc, f"for a {reason.name.lower()} rotation") from None
            await idempotency.remember_response(
                conn,
                tenant,
                session_id,
                idempotency_key,
                "Rotate",
                request_sha256,
                {"epoch": rotated.plan.epoch},
            )
        return rotated, False

    async def _rotate_locked(
        self,
        conn: Any,
        tenant: str,
        session_id: UUID,
        current: plans.StoredPlan,
        reason: PlanReason,
        spec: PlanSpec | None,
        detail: str,
        *,
        begins_lineage: bool = False,
        sweep: bool = False,
        makes_current: bool = True,
        factor_ppm: int = NEUTRAL_FACTOR_PPM,
    ) -> plans.StoredPlan:
        """Start a plan after `current` inside the caller's transaction (session locked), as
        the session's next epoch, and (`makes_current`) make it the session's current plan.
        It continues `current`'s lineage, or `begins_lineage` (store/plans.py): a fork for
        an admission reason, a merge otherwise; a `sweep` is one every lineage follows.
        `factor_ppm`: the estimator factor its capacity is checked at (_make_plan).

        Rebuilds from `spec` (or the pinned spec), except prefix_hash_canonicalized, which
        copies the plan with canonical hashes under the same secret (core/epochs.py).
        The caller counts the rotation once its transaction commits (_count_rotation).
        """
        epoch = await plans.next_epoch(conn, tenant, session_id)
        lineage = epoch if begins_lineage else current.lineage
        if reason is PlanReason.PREFIX_HASH_CANONICALIZED:
            if spec is not None:
                raise InvalidFieldError(
                    "prefix_hash_canonicalized copies the pinned plan; it takes no spec",
                    field="spec",
                )
            plan = epoch_rules.canonicalized_copy(current.plan, epoch=epoch)
            new_spec, secret = current.spec, current.secret
        else:
            new_spec, secret = spec or current.spec, self._new_secret()
            plan = await asyncio.to_thread(
                self._make_plan, new_spec, session_id, epoch, reason, secret, factor_ppm
            )
        created_at = await plans.insert_plan(
            conn, tenant, session_id, plan, new_spec, secret, lineage, sweep=sweep
        )
        if makes_current:
            await plans.set_current_epoch(conn, tenant, session_id, plan.epoch)
        extra = {
            "from_epoch": current.plan.epoch,
            "from_prefix_sha256": current.plan.prefix_sha256,
            "lineage": lineage,
            "sweep": sweep,
            "detail": detail,
        }
        await events.append_events(
            conn, tenant, session_id, [_plan_event("context.epoch.rotated", plan, extra)]
        )
        return plans.StoredPlan(plan, new_spec, secret, current.revision, created_at, lineage)

    def _builder_reproduces(self, session_id: UUID, stored: plans.StoredPlan) -> bool:
        """Whether the current builder renders the stored plan's bytes from its spec and
        secret (a plan it reproduces stays current across a builder upgrade). Kept per
        plan: such a plan is never rotated, so every top-level StartRun of the session
        asked again, rebuilding the plan on the event loop under the session's lock (a
        store audit)."""
        plan = stored.plan
        rendered = epoch_rules.rendered_identity(plan)
        digest = hashlib.sha256(rendered).digest()
        key = ("builder reproduces", session_id, plan.epoch, plan.spec_sha256, digest)
        known: bool | None = self._kept.get(key)
        if known is not None:
            return known
        try:
            # Bytes only: its capacity is not in question here (a newer builder that counts
            # a plan's prefix larger, context-builder@6's separators, kept a plan at its
            # least capacity current rather than rotating it into a refusal: a review).
            again = self._make_plan(
                stored.spec, session_id, plan.epoch, plan.reason, stored.secret, None
            )
            reproduces = epoch_rules.rendered_identity(again) == rendered
        except (InvalidFieldError, PreconditionError):
            reproduces = False
        self._kept.put(key, reproduces, _HEADS_WEIGHT)
        return reproduces

    async def _advertised(
        self, session_id: UUID, stored: plans.StoredPlan, scopes: tuple[str, ...]
    ) -> epoch_rules.Advertised:
        """The (defined, deferred) tool names a plan of the stored plan's spec under
        `scopes` advertises, or None when none can be made (core/epochs.py Rule 3: whether
        a grant changes them). Kept per pinned spec and scopes: a run admitted with a grant
        that changes nothing finds it new again at every admission, since the plan keeps
        its pinned scopes."""
        plan = stored.plan
        key = ("advertised", session_id, plan.epoch, plan.spec_sha256, scopes)
        known: tuple[epoch_rules.Advertised] | None = self._kept.get(key)  # None: not kept
        if known is not None:
            return known[0]
        spec = epoch_rules.with_scopes(stored.spec, scopes)
        try:
            made = await asyncio.to_thread(
                self._make_plan, spec, session_id, plan.epoch, plan.reason, stored.secret
            )
            found: epoch_rules.Advertised = (made.tool_names, made.deferred_tool_names)
        except (InvalidFieldError, PreconditionError):
            found = None
        self._kept.put(key, (found,), _HEADS_WEIGHT)
        return found

    async def _plan_locked(
        self, conn: Any, tenant: str, session_id: UUID, epoch: int, revision: int
    ) -> plans.StoredPlan:
        """The plan of `epoch` inside the caller's transaction (session locked; `revision`
        its plans_revision, read under the lock): a kept copy of that revision answers."""
        kept: plans.StoredPlan | None = self._plans.get((tenant, session_id, epoch))
        if kept is not None and kept.revision == revision:
            return kept
        stored = await plans.read_plan(conn, tenant, session_id, epoch)
        self._plans.put((tenant, session_id, epoch), stored, approximate_bytes(stored))
        return stored

    async def _admit(
        self,
        conn: Any,
        tenant: str,
        session_id: UUID,
        admission: epoch_rules.Admission | None,
        epoch: int,
        revision: int,
    ) -> tuple[plans.StoredPlan, list[plans.StoredPlan]]:
        """A new run's admission, before it pins its tools: rotate when the rules of
        core/epochs.py say so. -> (the plan the run pins, the rotated plans in order, the
        last being the one the run pins; none when the plan stays). The run's own change
        (an admission reason) begins a lineage only it follows. Any other reason reaches
        every run, rebuilt from the pinned spec: an erasure's continues the current lineage
        (every other invalidated one continues when next used), any other is a sweep
        (store/plans.py). After an erasure the run's own change follows as a second
        decision (core/epochs.py, Rule 2).

        `epoch` and `revision` are the session's, read under its lock: a kept plan of that
        epoch and revision is the current one, and is not read again."""
        current = await self._plan_locked(conn, tenant, session_id, epoch, revision)
        rotated: list[plans.StoredPlan] = []
        # Each rotation clears its own reasons, so a second decision finds at most the
        # run's own change; the bound makes that certain.
        for _ in range(2):
            # What plans under a grant's scopes advertise, made off the event loop (an
            # audit: two plan builds under the session lock stalled every other call).
            weighed = epoch_rules.weighed_scopes(current.plan, current.spec, admission)
            advertised = {
                scopes: await self._advertised(session_id, current, scopes)
                for scopes in weighed or ()
            }
            decision = epoch_rules.admit_run(
                current.plan,
                current.spec,
                admission,
                builder_reproduces=partial(self._builder_reproduces, session_id, current),
                advertises=advertised.__getitem__,
            )
            if decision.reason is None:
                break
            try:
                current = await self._rotate_locked(
                    conn,
                    tenant,
                    session_id,
                    current,
                    decision.reason,
                    decision.spec,
                    f"run admission: {decision.detail}",
                    begins_lineage=decision.reason in epoch_rules.ADMISSION_REASONS,
                    sweep=decision.reason not in _NOT_SWEPT,
                )
                # A grant's tools take room from the body the loaded skill bodies hold
                # their place in (they never yield): a run on a plan that cannot carry them
                # would fail every Build (an audit).
                await skills_api.check_loaded_fit(self, conn, tenant, session_id, current)
                rotated.append(current)
            except RequestError as exc:
                if exc.reason == "SKILL_LIMIT" and decision.reason in epoch_rules.ADMISSION_REASONS:
                    raise _bodies_not_carried(exc, decision.detail) from None
                # The session's spec, not the request's: the state forbids the run. Raised
                # inside StartRun's transaction, so nothing of the run is written.
                rebuilt = f"for this run's admission ({decision.detail})"
                dropped = _scopes_drop_browser(exc, admission, current.spec)
                if dropped is not None:
                    raise dropped from None
                if (
                    admission is not None
                    and admission.browser_profile_id
                    and exc.metadata.get("missing")
                    # The profile's: where the rebuild is the grant's, the run's scopes took
                    # the browser tools away (an audit: named the profile the session has).
                    and PlanReason.BROWSER_PROFILE_CHANGED in decision.reasons
                ):
                    raise _profile_not_served(exc, admission.browser_profile_id) from None
                raise _as_state(exc, rebuilt) from None
        return current, rotated

    async def _catch_up(
        self,
        conn: Any,
        tenant: str,
        session_id: UUID,
        head: plans.StoredPlan,
        epoch: int,
        revision: int,
    ) -> plans.StoredPlan | None:
        """Continue the lineage `head` heads, inside the caller's transaction (session
        locked; `epoch` and `revision` the session's, read under the lock), when it is
        behind the session's latest sweep or an erasure invalidated it (store/plans.py).
        -> the plan started, or None when the lineage is up to date (another call may have
        continued it first). The caller counts it once its transaction commits.

        Behind: rebuilt from the head's own spec with the sweep's reason and snapshot (a
        canonicalization copies the head, unless a rebuilding sweep since the head is
        newer: then that sweep's reason and snapshot, store/plans.py). Invalidated only:
        rebuilt from the head's redacted spec, snapshot_invalidated. What it starts depends
        only on the head and the sweeps, not on which call gets the lock first; the lock
        makes one call start it.
        """
        sweep = await plans.latest_sweep(conn, tenant, session_id, revision)
        behind = sweep is not None and sweep.plan.epoch > head.plan.epoch
        if not behind and not head.plan.invalidated:
            return None
        reason, spec, detail = PlanReason.SNAPSHOT_INVALIDATED, None, "after erasure"
        if sweep is not None and behind:
            if sweep.plan.reason is PlanReason.PREFIX_HASH_CANONICALIZED:
                # A copy only when every sweep since the head was one: an earlier rebuild
                # (a builder upgrade, a Plan's fresh snapshot) must reach the lineage too.
                rebuild = await plans.latest_sweep(
                    conn, tenant, session_id, revision, rebuilding=True
                )
                if rebuild is not None and rebuild.plan.epoch > head.plan.epoch:
                    sweep = rebuild
            reason, detail = sweep.plan.reason, f"continues epoch {sweep.plan.epoch}'s rotation"
            if reason is not PlanReason.PREFIX_HASH_CANONICALIZED:
                spec = head.spec.model_copy(update={"snapshot": sweep.spec.snapshot})
            elif head.plan.invalidated:  # a copy would keep the erased memory's flag
                reason = PlanReason.SNAPSHOT_INVALIDATED
            elif not epoch_rules.copyable(head.plan):
                # A head whose hash matches no document cannot be copied: rebuilt instead.
                # The copy's refusal (INVALID_FIELD naming `reason`, a field Build does not
                # have) failed every Build of the lineage, which stayed behind (an audit).
                reason = PlanReason.BUILDER_UPGRADED
        current = await plans.lineage_of(conn, tenant, session_id, epoch)
        continued = await self._rotate_locked(
            conn,
            tenant,
            session_id,
            head,
            reason,
            spec,
            f"lineage {head.lineage} {detail}",
            makes_current=head.lineage == current,
        )
        # A sweep measured only the lineage current then (Engine.rotate): this one's plan,
        # rebuilt now (a grant's tools, this replica's registry), must carry the loaded
        # bodies too, or its Builds would fail after the rotation was written (a review).
        await skills_api.check_loaded_fit(self, conn, tenant, session_id, continued)
        return continued

    async def continue_behind(
        self,
        conn: Any,
        tenant: str,
        session_id: UUID,
        head: runs.RunHead,
        epoch: int,
        revision: int,
    ) -> tuple[plans.StoredPlan, plans.StoredPlan | None]:
        """The plan the run of `head` builds on next, inside the caller's transaction
        (session locked; `epoch` and `revision` the session's, read under the lock): its
        lineage's own, or, when it is behind a sweep, its continuation, started here as its
        next Build would start it (_catch_up). -> (that plan, the plan started or None).
        The caller counts a rotation once its transaction commits (_count_rotation).

        Raises:
            RequestError: the continuation's refusal, as the session's state (_as_state).
        """
        own = await plans.read_plan(conn, tenant, session_id, head.effective_epoch)
        if not head.behind:
            return own, None
        try:
            continued = await self._catch_up(conn, tenant, session_id, own, epoch, revision)
        except RequestError as exc:
            raise _as_state(exc, "to continue this run's plan lineage") from None
        return continued or own, continued

    async def _bring_up_to_date(
        self, tenant: str, session_id: UUID, run_id: UUID
    ) -> plans.StoredPlan:
        """Build found its lineage behind a sweep, or its plan invalidated by an erasure:
        continue the run's lineage (_catch_up, once, whoever gets the lock first) and build
        on its new plan. Only this lineage: every other continues when next used."""
        async with self.gates.held(tenant, session_id), transaction(self.pool) as conn:
            epoch, revision = await sessions.lock_session_plans(conn, tenant, session_id)
            head = await runs.read_run_head(conn, tenant, session_id, run_id)
            own = await plans.read_plan(conn, tenant, session_id, head.effective_epoch)
            try:
                continued = await self._catch_up(conn, tenant, session_id, own, epoch, revision)
            except RequestError as exc:
                # The pinned spec no longer fits (a registry overlay shrank the window or
                # dropped the model, say): the session's state, not Build's request, is at
                # fault.
                raise _as_state(exc, "to continue this run's plan lineage") from None
        if continued is None:
            return own  # another call continued it first, and counted it
        # Counted here, once committed, not by the Build handler: the Build may still fail
        # (PERSON_ERASED, BUDGET_EXCEEDED, ...) while its rotation stands.
        _count_rotation(continued)
        return continued

    # --- runs -------------------------------------------------------------------------

    async def start_run(
        self,
        tenant: str,
        session_id: UUID,
        run_id: UUID,
        seed: UserMessage | ChildSeed,
        idempotency_key: str,
        request_sha256: str,
        admission: epoch_rules.Admission | None = None,
    ) -> RunStarted:
        """Start a run. A top-level run is admitted first (`admission`, core/epochs.py) and
        pins the epoch current after it. A child is not admitted: it works for its parent,
        so it pins the epoch its parent builds on (store/runs.py read_run_head), never one
        another run's admission made."""
        async with self.gates.held(tenant, session_id), transaction(self.pool) as conn:
            epoch, revision = await sessions.lock_session_plans(conn, tenant, session_id)
            stored = await idempotency.recall_response(
                conn, tenant, session_id, idempotency_key, "StartRun", request_sha256
            )
            if stored is not None:
                return replace(RunStarted.from_json(stored), replayed=True)
            if epoch == 0:
                raise PreconditionError(
                    f"session {session_id} has no plan; call Plan first",
                    field="session_id",
                    reason="PLAN_NOT_FOUND",
                )
            rotated: list[plans.StoredPlan] = []
            if isinstance(seed, ChildSeed):
                # The parent's lineage, continued first if it is behind or invalidated
                # (store/plans.py): the child pins a plan it can build on.
                try:
                    parent = await runs.read_run_head(conn, tenant, session_id, seed.parent_run_id)
                except NotFoundError as exc:  # the parent named, not the new run's id
                    raise NotFoundError(
                        exc.message, field="child.parent_run_id", reason="RUN_NOT_FOUND"
                    ) from None
                own = await self._plan_locked(
                    conn, tenant, session_id, parent.effective_epoch, revision
                )
                try:
                    continued = await self._catch_up(conn, tenant, session_id, own, epoch, revision)
                except RequestError as exc:
                    raise _as_state(exc, "to continue the parent's plan lineage") from None
                rotated += [continued] if continued else []
                epoch = (continued or own).plan.epoch
            else:
                # Admission precedes the seed: the run pins the epoch it starts on.
                pinned, rotated = await self._admit(
                    conn, tenant, session_id, admission, epoch, revision
                )
                epoch = pinned.plan.epoch
            if isinstance(seed, UserMessage):
                # The seeding event and the run row share this transaction, so the run's
                # seed_event_sequence can never point at an event that did not land.
                (seq,) = await events.append_events(
                    conn,
                    tenant,
                    session_id,
                    [_item_event(seed, run_id, in_history=True)],
                )
                first = replace_item(seed, sequence=seq, run_id=str(run_id))
                run = runs.RunRow(run_id, session_id, None, seq, epoch)
            else:
                # Kept as written; Build reads it as the parent's (core/seeding.py, Rule 4).
                first = UserMessage(
                    item_id=instruction_item_id(str(run_id)),
                    text=seed.instruction,
                    run_id=str(run_id),
                )
                run = runs.RunRow(run_id, session_id, seed.parent_run_id, None, epoch)
                await events.append_events(
                    conn,
                    tenant,
                    session_id,
                    [
                        NewEvent(
                            "run.child.started",
                            {"parent_run_id": str(seed.parent_run_id)},
                            run_id=run_id,
                        )
                    ],
                )
            await runs.insert_run(conn, tenant, run)
            # Working state is folded from the log below the seed (a child's starts empty).
            state = await ws_api.seed_state(
                conn, tenant, session_id, run.seed_event_sequence, self.kept
            )
            # The first checkpoint pins the model's current estimator correction.
            estimator = await self.pinned_factor(conn, tenant, session_id, epoch)
            await runs.insert_checkpoint(
                conn,
                tenant,
                Checkpoint(
                    run_id=str(run_id),
                    version=1,
                    items=(first,),
                    working_state=state,
                    **estimator,
                ),
            )
            result = RunStarted(
                run_id,
                session_id,
                run.parent_run_id,
                run.seed_event_sequence,
                epoch,
                1,
                rotated[-1].plan.epoch if rotated else None,
                tuple(r.plan.reason for r in rotated),
            )
            await idempotency.remember_response(
                conn,
                tenant,
                session_id,
                idempotency_key,
                "StartRun",
                request_sha256,
                result.to_json(),
            )
        return result

    async def append_items(
        self,
        tenant: str,
        session_id: UUID,
        run_id: UUID,
        expected_version: int,
        new_items: list[ConversationItem],
        idempotency_key: str,
        request_sha256: str,
    ) -> dict[str, Any]:
        async with self.gates.held(tenant, session_id), transaction(self.pool) as conn:
            epoch = await sessions.lock_session(conn, tenant, session_id)
            stored = await idempotency.recall_response(
                conn, tenant, session_id, idempotency_key, "AppendItems", request_sha256
            )
            if stored is not None:
                return stored
            # The version it continues, if this replica wrote or built it, need not be read.
            kept = self._kept.get(("checkpoint", tenant, run_id, expected_version))
            run, checkpoint = await runs.read_run_checkpoint(conn, tenant, session_id, run_id, kept)
            require_version(checkpoint, expected_version)
            in_history = run.parent_run_id is None
            # A compaction took calls out of the checkpoint; their ids stay the run's (an
            # audit: a reused id was accepted, two calls of one id in one run's log), and
            # a result naming one is its second (said so, not "has no call": another). The
            # log is asked only of ids the checkpoint and the append do not call.
            new_calls = [i.call_id for i in new_items if isinstance(i, ToolCall)]
            called = {i.call_id for i in checkpoint.items if isinstance(i, ToolCall)}
            called.update(new_calls)
            new_calls += [
                i.call_id
                for i in new_items
                if isinstance(i, ToolResult) and i.call_id not in called
            ]
            compacted = (
                await events.read_logged_call_ids(
                    conn, tenant, session_id, run_id, new_calls, in_history=in_history
                )
                if new_calls and checkpoint.replaced_through_sequence
                else set()
            )
            # As logged: a result that names no tool takes its call's name.
            new_items = list(
                validate_append(checkpoint.items, new_items, compacted_call_ids=compacted)
            )
            runtime = ws_api.runtime_transition(checkpoint, new_items)
            loggable = [i for i in new_items if i.kind in EVENT_TYPE_OF_ITEM]
            sequences = await events.append_events(
                conn,
                tenant,
                session_id,
                [_item_event(i, run_id, in_history=in_history) for i in loggable],
            )
            by_id = dict(zip((i.item_id for i in loggable), sequences, strict=True))
            placed = tuple(
                replace_item(i, sequence=by_id.get(i.item_id, 0), run_id=str(run_id))
                for i in new_items
            )
            # A new checkpoint pins the model's current correction: rebuilding it later cuts
            # the same, whatever usage is reported meanwhile.
            pinned = await self.pinned_factor(conn, tenant, session_id, epoch)
            new_checkpoint = checkpoint.model_copy(
                update={
                    "version": checkpoint.version + 1,
                    "items": checkpoint.items + placed,
                    **pinned,
                }
            )
            if runtime is not None:  # task states on tool outcomes; ask_user questions
                transition, _ = await ws_api.record_transition(
                    conn,
                    tenant,
                    session_id,
                    run_id,
                    checkpoint.working_state,
                    runtime,
                    writer=Writer.RUNTIME,
                    checkpoint_version=new_checkpoint.version,
                )
                new_checkpoint = new_checkpoint.model_copy(
                    update={"working_state": transition.state}
                )
            await runs.insert_checkpoint(conn, tenant, new_checkpoint)
            result = {
                "checkpoint_version": new_checkpoint.version,
                "sequences": [i.sequence for i in placed],
                "item_ids": [i.item_id for i in placed],
            }
            await idempotency.remember_response(
                conn, tenant, session_id, idempotency_key, "AppendItems", request_sha256, result
            )
        self.checkpoint_written(tenant, session_id, new_checkpoint, expected_version)
        return result

    async def pinned_factor(
        self, conn: Any, tenant: str, session_id: UUID, epoch: int
    ) -> dict[str, Any]:
        """What a checkpoint written now pins of the estimator: the correction for the model
        of the session's current plan, `epoch` as read under the session lock, and that
        model (a Build on another model's plan applies none of it: core/checkpoint.py). A
        plan never changes its model, so a kept plan of that epoch names it without a
        query."""
        kept: plans.StoredPlan | None = self._plans.get((tenant, session_id, epoch))
        if kept is None:
            model_id, factor = await usage_api.session_factor(
                conn, tenant, session_id, self.tokenizer_of
            )
        else:
            model_id = kept.plan.model_id
            factor = await usage_api.pinned_factor(conn, tenant, model_id, self.tokenizer_of)
        return {"estimator_factor_ppm": factor, "estimator_model_id": model_id}

    async def _carried(
        self, conn: Any, tenant: str, session_id: UUID, below: int, floor: int
    ) -> tuple[LogTail, int]:
        """The newest part of the history a run seeded below `below` carries, over the
        session's logged items with floor < sequence < below (core/log_tail.py), and the
        approximate bytes of what was read for it.

        The log is append-only and a sequence is committed before any later one is handed
        out (the session row lock), so the items below one run's seed are a prefix of those
        below a later run's. A replica keeps, per (session, floor), the tail it has read
        for the latest run, and a new run's first Build reads only the events since
        (api/log_tail.py): neither reads the whole log. Build reads further back only as
        far as the plan's window needs (`_carried_reaching`)."""
        prefix_key = ("logged", tenant, session_id, floor)
        # (tail, approximate bytes): an extension weighs only what it read.
        known: tuple[LogTail, int] | None = self._kept.get(prefix_key)
        usable = known if known is not None and known[0].below <= below else None
        read = await log_tail.read_newest(
            conn,
            tenant,
            session_id,
            floor,
            below,
            usable[0] if usable else None,
            log_tail.FIRST_PAGE,
        )
        tail, weight = read.tail, approximate_bytes(read.rows)
        if read.extended and usable is not None:
            weight += usable[1]
        if known is None or usable is not None:
            self._kept.put(prefix_key, (tail, weight), weight)
        return tail, weight

    async def _carried_reaching(
        self,
        tenant: str,
        session_id: UUID,
        inputs: BuildInputs,
        kept: tuple[LogTail, int],
        as_sent: Callable[[tuple[ConversationItem, ...]], tuple[ConversationItem, ...]],
    ) -> BuildInputs:
        """`inputs` with the carried history read back as far as a fitting request can
        reach (core/assemble.py, carried_reaches): a page at a time, each larger, and kept,
        so the run's later Builds read nothing. `as_sent`: the history as the request
        sends it (its excerpts marked or not), which is what the reach is measured on."""
        tail, weight = kept
        page = log_tail.FIRST_PAGE
        while not carried_reaches(inputs):
            page *= log_tail.GROWTH
            async with telemetry.span("store.read"), acquire(self.pool) as conn:
                older, rows, _ = await log_tail.read_older(conn, tenant, session_id, tail, page)
            weight += approximate_bytes(rows)
            carried_key = ("carried", tenant, session_id, tail.below, tail.floor)
            prefix_key = ("logged", tenant, session_id, tail.floor)
            latest: tuple[LogTail, int] | None = self._kept.get(prefix_key)
            if latest is not None and latest[0] is tail:
                self._kept.put(prefix_key, (older, weight), weight)
            self._kept.put(carried_key, (older, weight), weight)
            tail = older
            inputs = replace(inputs, carried=as_sent(tail.history), carried_before=tail.before)
        return inputs

    # --- build ------------------------------------------------------------------------

    async def build(
        self,
        tenant: str,
        session_id: UUID,
        run_id: UUID,
        checkpoint_version: int,
        now: datetime | None,
        step: StepContext,
        *,
        epoch: int = 0,
        record: bool = True,
        skills_loaded: int | None = None,
        breakpoint_budget: int | Literal["registry"] | None = "registry",
        image_tokens: int | None = None,
        inline_maximum_bytes: int | None = None,
        failed_result_line: bool = True,
        delegated_messages: bool = True,
        marker_sequences: bool = True,
        marked_excerpts: bool = True,
        text_call_ids: bool = True,
        named_writers: bool = True,
        fixed_texts: bool = True,
        bridge_markers: bool = True,
        cited_passages: bool = True,
        entry_skill_trust: bool = True,
    ) -> BuildResult:
        """Assemble, render and record the run's next request.

        `epoch` 0 builds against the current plan; GetBuild passes the recorded epoch and
        `record=False` to rebuild a recorded request without recording it again,
        `skills_loaded` (recorded) so skills loaded later do not enter the rebuild, and
        `breakpoint_budget` (recorded) so the payload keeps the cache markers it was sent
        with after an overlay changes the model's max_cache_breakpoints. "registry": the
        model's budget now; None: the provider's own limit. Likewise `image_tokens` and
        `inline_maximum_bytes` (None: the registry's figure and the server's setting now)
        and `failed_result_line` (False: a request the legacy assembler sent;
        core/build_record.py, Rules 7 and 8). `delegated_messages` reads a child run's user
        messages as its parent's (core/seeding.py, Rule 4); False: as the user's, as
        context-assembler@2 and older did. `marker_sequences` False: cache markers name
        their items by id alone, as context-assembler@7 and older did (`markers_by_id`).
        `marked_excerpts` False: a tool result sent as its pipeline excerpt renders
        unmarked, as context-assembler@8 and older sent it (`unmarked_excerpts`).
        `text_call_ids` False: tool pairs sent as text (Anthropic without tools) name no
        call ids, as context-assembler@10 and older sent them. `named_writers` False: the
        working-state block names no fact's writer, as context-assembler@11 and older
        rendered it. `fixed_texts` False: the estimate counts no renderer's fixed text (a
        failed result's line, the request's framing), as context-assembler@12 and older
        counted (core/body_estimate.py, Rule 6). `bridge_markers` False: the request
        carries no bridge marker, as context-assembler@14 and older made it (`unbridged`).
        `cited_passages` False: a bare knowledge passage is sent without its citation, as
        context-assembler@15 and older sent it (`uncited_passages`). `entry_skill_trust`
        False: each loaded skill's body at its load trust, as @16 and older rendered it.

        A recording Build of a run this replica has built before is made from the run head
        it kept, which the record confirms in the same round trip (store/records.py): if
        the head has moved, nothing was written and the Build is made again from a head
        read afresh, as is one whose kept head led to a refusal.
        """
        attempt = partial(
            self._build,
            tenant,
            session_id,
            run_id,
            checkpoint_version,
            now,
            step,
            epoch=epoch,
            record=record,
            skills_loaded=skills_loaded,
            breakpoint_budget=breakpoint_budget,
            image_tokens=image_tokens,
            inline_maximum_bytes=inline_maximum_bytes,
            failed_result_line=failed_result_line,
            delegated_messages=delegated_messages,
            marker_sequences=marker_sequences,
            marked_excerpts=marked_excerpts,
            text_call_ids=text_call_ids,
            named_writers=named_writers,
            fixed_texts=fixed_texts,
            bridge_markers=bridge_markers,
            cited_passages=cited_passages,
            entry_skill_trust=entry_skill_trust,
        )
        heads = self._heads(tenant, session_id) if record else None
        kept = heads.by_run.get(run_id) if heads is not None else None
        # A lineage behind is continued from a head read afresh.
        if heads is not None and kept is not None and not kept.behind:
            writes = heads.writes
            try:
                return await attempt(kept)
            except _StaleHead:
                telemetry.record_kept_head_retry("moved")
                self._head_moved(tenant, session_id, heads, writes)
            except SessionBusyError:
                # The session stayed busy: a Build from a head read afresh would wait as
                # long again (a review: twice the lock wait, holding a busy slot).
                raise
            except RequestError:
                telemetry.record_kept_head_retry("refused")
                heads.by_run.pop(run_id, None)
        return await attempt(None)

    async def _build(
        self,
        tenant: str,
        session_id: UUID,
        run_id: UUID,
        checkpoint_version: int,
        now: datetime | None,
        step: StepContext,
        kept: runs.RunHead | None,
        *,
        epoch: int,
        record: bool,
        skills_loaded: int | None,
        breakpoint_budget: int | Literal["registry"] | None,
        image_tokens: int | None,
        inline_maximum_bytes: int | None,
        failed_result_line: bool,
        delegated_messages: bool,
        marker_sequences: bool,
        marked_excerpts: bool,
        text_call_ids: bool,
        named_writers: bool,
        fixed_texts: bool,
        bridge_markers: bool,
        cited_passages: bool,
        entry_skill_trust: bool,
    ) -> BuildResult:
        """build() from the `kept` head, which the record must confirm (_StaleHead if it
        does not; nothing is written before then), or from a head read now (None)."""
        seen: tuple[_Heads, int] | None = None  # the session's heads when a fresh head is read
        async with telemetry.span("store.read"):
            if kept is not None:
                head = kept
            else:
                # Builds made while another's head read is in flight share the next one.
                seen = self._writes(tenant, session_id)
                row = await self._read_heads((tenant, run_id))
                try:
                    head = runs.run_head_of(row, session_id, run_id)
                except NotFoundError:
                    await self.get_plan(tenant, session_id)  # an unknown session is named first
                    raise
            run, skills = head.run, head.skills_loaded
            version = checkpoint_version or head.latest_version
            below = seed_cut(run.seed_event_sequence)
            checkpoint_key = ("checkpoint", tenant, run_id, version)
            found = self._kept.get_weighed(checkpoint_key)
            checkpoint, checkpoint_bytes = found if found is not None else (None, 0)
            # Loaded skills are append-only and never unloaded: the first N are the same on
            # every read, so a count names them (and none costs no round trip).
            loaded = self._kept.get(("skills", tenant, session_id, skills)) if skills else []
            carried: tuple[LogTail, int] | None = None
            if checkpoint is not None:
                floor = checkpoint.replaced_through_sequence
                carried = self._kept.get(("carried", tenant, session_id, below, floor))
            if checkpoint is None or carried is None or loaded is None:
                async with acquire(self.pool) as conn:
                    if checkpoint is None:
                        checkpoint = await runs.read_checkpoint(conn, tenant, run_id, version)
                        checkpoint_bytes = approximate_bytes(checkpoint)
                        self._kept.put(checkpoint_key, checkpoint, checkpoint_bytes)
                    floor = checkpoint.replaced_through_sequence
                    carried_key = ("carried", tenant, session_id, below, floor)
                    carried = self._kept.get(carried_key)
                    if carried is None:
                        carried = await self._carried(conn, tenant, session_id, below, floor)
                        self._kept.put(carried_key, carried, carried[1])
                    if loaded is None:
                        loaded = await skill_store.read_loaded(conn, tenant, session_id)
                        self._kept.put(
                            ("skills", tenant, session_id, len(loaded)),
                            loaded,
                            approximate_bytes(loaded),
                        )
                        # What the head read counted: a skill loaded since (after a Rotate
                        # another replica made) belongs with a later plan than the head's,
                        # and a fresh head's record confirms nothing (an audit).
                        loaded = loaded[:skills]
        if skills_loaded is not None:
            loaded = loaded[:skills_loaded]  # sticky and append-only: a prefix is the past
        if delegated_messages and run.parent_run_id is not None:
            # A child's "user" is its parent agent (core/seeding.py, Rule 4).
            checkpoint = checkpoint.model_copy(update={"items": delegated(checkpoint.items)})
        # An active run builds on the latest plan of its own lineage: another run's
        # admission rotation, and a rotation rebuilt from another run's lineage, never
        # reach it; any other rotation does, at its next Build, which continues its
        # lineage first when a sweep has not reached it yet (store/plans.py).
        stored = await self.get_plan(
            tenant, session_id, epoch or head.effective_epoch, head.plans_revision
        )
        moved = record and (head.behind or stored.plan.invalidated)
        if moved:
            if kept is not None:
                raise _StaleHead  # a write: made only from a head read afresh
            stored = await self._bring_up_to_date(tenant, session_id, run_id)
        telemetry.annotate(epoch=stored.plan.epoch, prefix_sha256=stored.plan.prefix_sha256)
        plan = stored.plan
        budget = (
            self._cache_breakpoints_of(plan.model_id)
            if breakpoint_budget == "registry"
            else breakpoint_budget
        )
        instant = now or self._clock()
        try:
            zone = _zone(plan.time_zone)
        except InvalidFieldError as exc:
            # The plan's pinned zone, which this replica's tz database lacks: the session's
            # state, not a field of this request (an audit: it named spec.environment.*).
            raise _as_state(exc, "for this build's clock") from None
        clock = instant.astimezone(zone)
        count_tokens = self.count_tokens_for(plan.model_id)
        if image_tokens is None:
            image_tokens = self._image_tokens_of(plan.model_id)
        if inline_maximum_bytes is None:
            inline_maximum_bytes = self._inline_maximum_bytes
        # The working-state block refuses never-yield fields over its cap (only a changed
        # token counter gets there) with the same BUDGET_EXCEEDED as assemble, so it is
        # rendered inside the try: either refusal is recorded as context.budget.exceeded.
        # Excerpts as the record's assembler sent them: marked, or unmarked as
        # context-assembler@8 and older sent them. Before the window is read back, which
        # measures the items as sent (a review: measured marked and then unmarked, a rebuild
        # reached past what a replica paging the log had read, and was refused there only).
        as_sent = _same if marked_excerpts else unmarked_excerpts
        sent_checkpoint = (
            checkpoint
            if marked_excerpts
            else checkpoint.model_copy(update={"items": as_sent(checkpoint.items)})
        )
        try:
            inputs = BuildInputs(
                tenant_id=tenant,
                plan=plan,
                secret=stored.secret,
                checkpoint=sent_checkpoint,
                carried=as_sent(carried[0].history),
                carried_before=carried[0].before,
                now=clock,
                # Bare passages as @15 and older sent them: without their citations.
                step=step if cited_passages else uncited_passages(step),
                skill_bodies=body_items(
                    loaded, (stored.spec.skills, plan.skill_pins) if entry_skill_trust else None
                ),
                working_state=render_block(
                    checkpoint.working_state,
                    secret=stored.secret,
                    count_tokens=count_tokens,
                    named_writers=named_writers,
                ),
                count_tokens=count_tokens,
                image_tokens=image_tokens,
                inline_maximum_bytes=inline_maximum_bytes,
                fixed_texts=fixed_texts,
                cache_marker_budget=budget,
                # A rebuild serves what was sent, made before Build refused such a floor.
                refuse_floor_over_cap=record,
            )
            if inputs.carried_before:  # with nothing before it, what was read reaches
                inputs = await self._carried_reaching(tenant, session_id, inputs, carried, as_sent)
            # Past OFF_LOOP_BYTES of the run's own items and step lines, which assembly
            # renders whole, the CPU work is a worker thread's (off_loop).
            heavy = checkpoint_bytes + _step_bytes(step) > OFF_LOOP_BYTES
            assembled = await off_loop(heavy, telemetry.traced("assemble", assemble), inputs)
        except BudgetExceededError as exc:
            if record and kept is None:  # from a kept head, build() decides it afresh
                await self._record_budget_exceeded(
                    tenant, session_id, run_id, plan, exc, checkpoint, step
                )
            raise
        if not bridge_markers and assembled.request is not None:
            older = unbridged(assembled.request)
            assembled = replace(assembled, request=older, request_sha256=older.request_sha256())
        if not marker_sequences and assembled.request is not None:
            older = markers_by_id(assembled.request)
            assembled = replace(assembled, request=older, request_sha256=older.request_sha256())
        payload = {
            "run_id": str(run_id),
            "epoch": plan.epoch,
            "prefix_sha256": plan.prefix_sha256,
            "prefix_tokens": plan.prefix_tokens,
            "request_sha256": assembled.request_sha256,
            "checkpoint_version": checkpoint.version,
            # The estimate ReportUsage reconciles against, and what it was made with; with
            # the tokens per class (prefix exact, body estimated) for inspect's budget bars.
            # GetBuild serves a rebuild only with these figures (core/build_record.py, Rule 9).
            "model_id": plan.model_id,
            **estimate_to_record(assembled),
            ATTACHMENT_TOKENS_KEY: attachment_tokens(assembled),
            TOKENIZER_KEY: self.tokenizer_of(plan.model_id),
            "estimator_factor_ppm": assembled.estimator_factor_ppm,
            INPUTS_KEY: inputs_to_record(instant, step),
            # Whom its recall lines are about, where an erasure finds them (Rule 4).
            PEOPLE_KEY: recalled_people(step),
            "skills_loaded": len(loaded),
            # The cache-marker budget the payload was rendered with (GetBuild renders again).
            BUDGET_KEY: budget,
            # What else it was built with, and by which assembler (core/build_record.py,
            # Rules 7 and 8): GetBuild rebuilds with these, or refuses.
            IMAGE_KEY: image_tokens,
            INLINE_KEY: inline_maximum_bytes,
            ASSEMBLER_KEY: ASSEMBLER_VERSION,
        }
        # Rendered before anything is recorded: a request no provider can take writes nothing.
        rendered = (
            await off_loop(
                heavy,
                partial(
                    telemetry.traced("render", render),
                    failed_result_line=failed_result_line,
                    text_call_ids=text_call_ids,
                ),
                assembled.request,
                budget,
            )
            if assembled.request is not None
            else None
        )
        paths = _attachment_paths(assembled, failed_result_line, text_call_ids)
        if not record:
            return BuildResult(assembled, plan, checkpoint.version, 0, rendered, paths)
        if rendered is not None:
            payload[PAYLOAD_KEY] = rendered.sha256()  # of the bytes the provider gets
        pressure = assembled.pressure
        noted = (
            _pressure_event(run_id, plan, checkpoint.version, assembled).payload
            if pressure is not None and pressure.yielded
            else None
        )
        if assembled.request is None and (people := recalled_people(step)):
            # No request, so no fence in the record's round trip (it is the request's): a
            # recall naming an erased person is refused here, as a sending Build's is,
            # before its pressure event names the line (an audit). Checked, then recorded:
            # an erasure between the two can leave that event naming the line's id.
            async with transaction(self.pool) as conn:
                if erased := await snapshots.fence_people(conn, tenant, people):
                    raise _person_erased(step, erased)
        # context.budget.pressure precedes the request it shaped; with no request (the body
        # needs compaction) it is the only record of this Build. One round trip: see
        # migrations/0005_record_request.sql for the lock, the erasure fence and the binding;
        # Builds made while another's record is in flight share the next round trip (0011).
        async with telemetry.span("store.write"):
            request_record = RequestRecord(
                tenant_id=tenant,
                session_id=session_id,
                epoch=plan.epoch,
                run_id=run_id,
                pressure=noted,
                used=_snapshot_used(run_id, plan) if snapshot_nonempty(plan) else None,
                snapshot_id=plan.snapshot_id,
                recall_trace_id=plan.recall_trace_id,
                request=payload if assembled.request is not None else None,
                head_state=head.state if kept is not None else None,
                # What the kept head says only matters when it chose the checkpoint.
                latest_version=(
                    head.latest_version if kept is not None and not checkpoint_version else None
                ),
            )
            seq = await self._record_requests(request_record)
            if seq == BUSY:
                # Its session (or a person it names) is locked by another write: waited
                # for on a connection of its own, never in the replica's shared round
                # trip, where it would hold up every other session's Build. At most half
                # the pool waits so at once: an erasure locking many sessions' people made
                # every Build of them take a connection to wait on, and the pool ran dry
                # for everyone else (a review). Then on the session's gate, as its writes
                # do: one connection per busy session waits (another review). A slot first:
                # holding the gate while waiting for one kept the session's writes out
                # though its row was free (a third).
                async with self._busy_slot(session_id), self.gates.held(tenant, session_id):
                    seq = await records.record(self.pool, request_record)
        if seq == STALE_HEAD:
            raise _StaleHead
        if seq == PLAN_INVALIDATED:
            # The erasure may have run on another replica: re-read plans on the retry.
            self.forget_cached_plans(tenant, session_id)
            raise ConflictError(
                "an erasure invalidated this plan's snapshot while the request was built;"
                " build again",
                field="session_id",
                reason="EPOCH_CONFLICT",
            )
        if seq == PERSON_ERASED:
            # The record's fence says only that someone is erased; which line, read apart.
            async with acquire(self.pool) as conn:
                erased = await snapshots.erased_among(conn, tenant, recalled_people(step))
            raise _person_erased(step, erased)
        if seq == NO_SESSION:
            raise NotFoundError(
                f"session {session_id} not found", field="session_id", reason="SESSION_NOT_FOUND"
            )
        if seen is not None and not moved:
            # The head this Build read, for the run's next Build to confirm; not one this
            # Build has just moved on (a lineage continued, a plan replaced).
            self._keep_head(tenant, session_id, head, seen)
        return BuildResult(assembled, plan, checkpoint.version, seq, rendered, paths)

    async def _record_budget_exceeded(
        self,
        tenant: str,
        session_id: UUID,
        run_id: UUID,
        plan: ContextPlan,
        exc: BudgetExceededError,
        checkpoint: Checkpoint,
        step: StepContext,
    ) -> None:
        """context.budget.exceeded: the never-yield set alone did not fit the body, the body
        did not fit after every yield with nothing left to compact, or the working state's
        never-yield fields did not fit its block. A recall naming a person
        erased from the tenant (`step`'s, under the erasure fence) is PERSON_ERASED instead,
        recording nothing, as a Build that sends a request (an audit).

        Raises:
            PreconditionError: PERSON_ERASED.
        """
        payload = {
            "run_id": str(run_id),
            "epoch": plan.epoch,
            "checkpoint_version": checkpoint.version,
            "estimator_factor_ppm": applied_factor(checkpoint, plan.model_id),
            **exc.metadata,
        }
        async with self.gates.held(tenant, session_id), transaction(self.pool) as conn:
            if erased := await snapshots.fence_people(conn, tenant, recalled_people(step)):
                raise _person_erased(step, erased)
            await sessions.lock_session(conn, tenant, session_id)
            await events.append_events(
                conn,
                tenant,
                session_id,
                [NewEvent("context.budget.exceeded", payload, run_id=run_id)],
            )


def _attachment_paths(
    assembled: Assembled, failed_result_line: bool, text_call_ids: bool
) -> tuple[str, ...]:
    """Where in the payload each message of assembled.attachments sent its text: what
    the adapter adds its attachments beside. Every user message renders a text block (its
    envelope), so each has one; a renderer that lost one is the engine's bug."""
    request, sends = assembled.request, assembled.attachments
    if request is None or not sends:
        return ()
    keys = [(s.message_index, s.block_index) for s in sends]
    found = text_paths(
        request, keys, failed_result_line=failed_result_line, text_call_ids=text_call_ids
    )
    missing = [s.item_id for s in sends if (s.message_index, s.block_index) not in found]
    if missing:
        raise EngineError(f"user messages with attachments sent no text block: {missing}")
    return tuple(found[key] for key in keys)


def _require_same_principal(pinned: PlanSpec, sent: PlanSpec) -> None:
    """A session belongs to one principal: its log, its working state's facts (offered to
    that principal's memory formation, their evidence the principal's own words) and its
    snapshot are theirs. A Rotate naming another principal_id handed them to another
    (OfferFactCandidates would offer one user's stated facts as the next one's: a review).
    Scopes and label may change; the identity may not.

    Raises:
        InvalidFieldError: naming spec.principal.principal_id.
    """
    was, now = pinned.principal.principal_id, sent.principal.principal_id
    if now != was:
        raise InvalidFieldError(
            f"spec.principal.principal_id {now!r} is not the session's principal {was!r}:"
            " a session belongs to one principal; open a new session for another",
            field="spec.principal.principal_id",
        )


def _same(items: tuple[ConversationItem, ...]) -> tuple[ConversationItem, ...]:
    """The items as they are (excerpts marked: the current assembler's form)."""
    return items


def _count_rotation(stored: plans.StoredPlan) -> None:
    """Count a rotation this call made (context_engine.epochs.rotated), after its
    transaction committed: a rolled-back one started no epoch. Rotate's response and
    StartRun's handler count theirs; Plan and Build count here, as their responses cannot
    say whether the call rotated."""
    telemetry.record_rotation(stored.plan.reason.name.lower())


# Rotations every run follows that are not sweeps (store/plans.py): an erasure invalidates
# exactly the plans holding the person, and each such lineage continues when next used.
_NOT_SWEPT = epoch_rules.ADMISSION_REASONS | {PlanReason.SNAPSHOT_INVALIDATED}


async def _fence_snapshot(conn: Any, tenant: str, spec: PlanSpec) -> None:
    """The people fence for a snapshot a caller sent, taken before the session lock
    (store/snapshots.py): refuse one naming an erased person (core/snapshot.py, Rule 4).

    Raises:
        PreconditionError: PERSON_ERASED, naming the first such item.
    """
    erased = await snapshots.fence_people(conn, tenant, named_people(spec))
    index = first_naming(spec, erased)
    if index is not None:
        raise PreconditionError(
            f"snapshot item {index} names a person erased from this tenant: the recall"
            " predates the erasure; recall again",
            field=f"spec.snapshot.items[{index}].person_ids",
            reason="PERSON_ERASED",
        )


@dataclass
class _Heads:
    """The run heads a replica keeps for a session's Builds, by run; none once another
    replica was seen moving one (`spread`: Engine._heads_spread). `writes` counts the
    session's writes through this replica that moved or dropped them, so a Build whose
    kept head moved can tell this replica's own write from another's."""

    by_run: dict[UUID, runs.RunHead] = field(default_factory=dict)
    spread: bool = False
    writes: int = 0


_HEADS_WEIGHT = 64  # a spread session's entry: a marker, no heads


class _StaleHead(Exception):
    """A Build made from a kept run head that the record found moved: nothing was written."""


def _person_erased(step: StepContext, erased: Collection[str]) -> PreconditionError:
    """PERSON_ERASED naming the first recall or correction line (recall's first) that
    names one of `erased`, as the request listed them: `step.recall[2].person_ids`."""
    named: list[tuple[str, int, tuple[str, ...]]] = [
        *(("recall", n, line.person_ids) for n, line in enumerate(step.recall)),
        *(("corrections", n, line.person_ids) for n, line in enumerate(step.corrections)),
    ]
    found = next(((name, n) for name, n, people in named if any(p in erased for p in people)), None)
    where = f"step.{found[0]}[{found[1]}]" if found else "step"
    return PreconditionError(
        f"{where} names a person erased from this tenant: the recall predates the erasure;"
        " recall again",
        field=f"{where}.person_ids" if found else "step",
        reason="PERSON_ERASED",
    )


# Past this many approximate bytes of the run's own items (its checkpoint, as kept.py weighs
# it) and the step's lines, a Build assembles and renders in a worker thread, not on the
# event loop. Assembly renders those whole (a carried result is excerpted first), and
# escaping content dense with look-alike delimiters is Python work per delimiter: a 2 MB
# tool result of "‹ｕser" held the loop 0.4 s on its first Build, and every other call of
# the replica with it (an audit; bench/loop_stall.py). The memos are shared with worker
# threads (core/memo_budget.py); a thread's hop costs about 0.1 ms, paid only by the runs
# holding this much. The weight is memory's: a character of Latin-1 text weighs a byte, and
# one such as "ü" still takes the slow path, so below the bar such content (128 K
# characters) holds the loop some 45 ms at most (a review: at 256 KiB, 86 ms). The carried
# history is not weighed: a carried result is excerpted to inline_maximum_bytes, and what
# a run's first Build derives of it is memoized for the session's later Builds.
OFF_LOOP_BYTES = 128 * 1024


def _step_bytes(step: StepContext) -> int:
    """About what the step's lines hold, their texts at a byte a character (the least a
    character weighs in memory, as the checkpoint is weighed)."""
    recall, corrections, knowledge = step.recall, step.corrections, step.knowledge
    if not (recall or corrections or knowledge):
        return 0  # most steps: no line
    return sum(len(line.text) for lines in (recall, corrections, knowledge) for line in lines)


async def off_loop(heavy: bool, fn: Callable[..., R], *args: Any) -> R:
    """`fn(*args)`, in a worker thread when `heavy`, else here on the event loop."""
    if heavy:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)


def _same_meaning(pinned: PlanSpec, sent: PlanSpec) -> bool:
    """Plan's spec_matches: `sent` means what the session's pinned spec means (PlanSpec.
    meaning_sha256), whatever order it lists its tools in."""
    return pinned.meaning_sha256() == sent.meaning_sha256()


def _require_to_canonicalize(plan: ContextPlan) -> None:
    """A canonicalizing Rotate copies the current plan (core/epochs.py Rule 7), which its
    hash must match the recorded document of. Of one whose hash matches none (an erasure
    redacted it) the copy's refusal was INVALID_ARGUMENT, as if the request were at fault
    (an audit): it is the plan's state, FAILED_PRECONDITION naming `reason`, and nothing
    is written. (A canonical current plan is copied: the sweep's purpose may be the other
    lineages' heads, which are canonicalized when next used.)

    Raises:
        PreconditionError: INVALID_FIELD naming `reason`.
    """
    if epoch_rules.copyable(plan):
        return
    raise PreconditionError(
        f"epoch {plan.epoch} cannot be copied with canonical hashes: its prefix_sha256"
        " matches no recorded document (an erasure redacted it, or it was written before"
        " the document was recorded); rotate with a rebuilding reason (builder_upgraded)",
        field="reason",
        reason="INVALID_FIELD",
    )


def _as_state(exc: RequestError, rebuilt: str) -> RequestError:
    """A refusal of the plan rebuilt `rebuilt` from the session's pinned spec (a Rotate
    without spec, a run's admission, a lineage's continuation, a Plan after an erasure),
    as the session's state: the request sent no such spec, so no `spec.*` field of it is at
    fault.

    A capacity that no longer fits is PREFIX_OVER_CAPACITY (CapacityError.as_state). A
    pinned model this server's registry lacks (another replica's overlay added it, or a
    restart dropped it) is UNKNOWN_MODEL with metadata model_id. Any other refusal naming a
    `spec*` field keeps its reason, with that field in metadata spec_field: a prefix class
    over its cap (a grant bringing an enabled tool in, a counter that now counts more), a
    roster colliding on the wire (a grant bringing in a tool that renders as a listed
    one's name: TOOL_NAME_COLLISION, metadata wire_name), INVALID_FIELD for the rest. All
    are FAILED_PRECONDITION naming `session_id`: a Rotate with a spec is the way out.
    Anything else is returned unchanged.
    """
    if isinstance(exc, CapacityError):
        return exc.as_state(rebuilt)
    if exc.reason == "UNKNOWN_MODEL":
        model_id = exc.metadata.get("model_id", "")
        return PreconditionError(
            f"the session's pinned model {model_id!r} is no longer in this server's model"
            f" registry, so its plan cannot be rebuilt {rebuilt}. Nothing was written;"
            " Rotate with a spec naming a model this server serves",
            field="session_id",
            reason="UNKNOWN_MODEL",
            metadata={"model_id": model_id},
        )
    if (exc.field or "").startswith("spec"):
        return PreconditionError(
            f"the session's pinned spec, rebuilt {rebuilt}, no longer fits: {exc.message}."
            " Nothing was written; Rotate with a spec that fits",
            field="session_id",
            reason="TOOL_NAME_COLLISION" if isinstance(exc, _WireNameCollision) else exc.reason,
            metadata={**exc.metadata, "spec_field": exc.field or ""},
        )
    return exc


def _bodies_not_carried(exc: RequestError, detail: str) -> PreconditionError:
    """A run's admission asks for authority (`detail`: a grant's tools, a browser profile)
    whose plan leaves too little room for the session's loaded skill bodies
    (core/skills.py still_fit): the admission is what to change, in the session's state."""
    return PreconditionError(
        f"this run's admission ({detail}) makes a plan that cannot carry the session's loaded"
        f" skill bodies: {exc.message}. Nothing was written; start the run with less"
        " authority, or Rotate with a spec that leaves the body more room",
        field="admission",
        reason="SKILL_LIMIT",
        metadata=dict(exc.metadata),
    )


def _scopes_drop_browser(
    exc: RequestError, admission: epoch_rules.Admission | None, pinned: PlanSpec
) -> PreconditionError | None:
    """The refusal when a run's admission scopes (which replace the principal's for the
    run) leave out the scopes the browser tools its website profile needs, where the
    pinned spec defines those tools: the request's scopes are at fault, not the session's
    spec. Named as the spec's (`session_id`, "Rotate with a spec that fits"), the advice
    could not help (an audit); nor could the profile's where the principal lacks the scope
    too (a review: the pinned plan then lists no browser tool). None where the refusal is
    another's: a tool the spec does not define, or one the run's scopes do admit."""
    missing = exc.metadata.get("missing", "")
    if admission is None or not admission.scopes or not missing:
        return None
    names = missing.split(",")
    by_name = {t.name: t for t in advertisable(pinned)}
    granted = set(admission.scopes)
    if not all(n in by_name and not granted >= set(by_name[n].required_scopes) for n in names):
        return None  # the spec's refusal, not the scopes'
    return PreconditionError(
        f"this run's admission scopes leave out what the session's website profile needs:"
        f" {', '.join(names)} require scopes the run does not hold. Nothing was written;"
        " add their scopes to admission.scopes, or start the run without a browser profile",
        field="admission.scopes",
        reason=exc.reason,
        metadata={**exc.metadata, "spec_field": exc.field or ""},
    )


def _profile_not_served(exc: RequestError, profile: str) -> PreconditionError:
    """A run's admission asks for browser profile `profile`, and the session's pinned spec
    does not give it the browser tools a profile needs (core/roster.py): the admission's
    field is what to change (or Rotate with a spec defining them), in the session's state
    (FAILED_PRECONDITION: the same request would start on a session that has them)."""
    return PreconditionError(
        f"this run's admission selects browser profile {profile!r}, but the session's pinned"
        f" spec cannot serve it: {exc.message}. Nothing was written; start the run without a"
        " browser profile, or Rotate with a spec that defines the browser tools",
        field="admission.browser_profile_id",
        reason=exc.reason,
        metadata={**exc.metadata, "spec_field": exc.field or ""},
    )


class _WireNameCollision(InvalidFieldError):
    """A roster whose tools collide on the wire: INVALID_FIELD naming `spec.tools` for a
    spec the caller sent; rebuilt from the pinned spec, the session's state
    TOOL_NAME_COLLISION (_as_state)."""


def _check_roster_wire_names(plan: ContextPlan) -> None:
    """Refuse a roster whose tools (defined or deferred) collide on the wire: every Build
    of the plan would fail rendering, so the spec is wrong, not the session's state."""
    try:
        check_wire_names([*plan.tool_names, *plan.deferred_tool_names])
    except PreconditionError as exc:
        raise _WireNameCollision(exc.message, field="spec.tools", metadata=exc.metadata) from None


def _check_grantable_wire_names(spec: PlanSpec) -> None:
    """Refuse a caller's spec whose tools would collide on the wire once a run's grant
    brings one in (core/roster.py advertisable), as Plan checks their schemas (core/plan.py
    _definable): an ungranted tool named onto a listed one's wire name passed Plan and
    failed the admission that granted it (an audit). Not on a rebuild of a pinned spec,
    which a grant has not reached: a session an older version planned so keeps working
    until such a grant."""
    try:
        check_wire_names([t.name for t in advertisable(spec)])
    except PreconditionError as exc:
        raise _WireNameCollision(exc.message, field="spec.tools", metadata=exc.metadata) from None


def _snapshot_used(run_id: UUID, plan: ContextPlan) -> dict[str, Any]:
    """context.snapshot.used: binds a run to its plan's nonempty snapshot before its first
    request on the epoch leaves (recorded once per run and epoch)."""
    return {
        "run_id": str(run_id),
        "epoch": plan.epoch,
        "snapshot_id": plan.snapshot_id,
        "recall_trace_id": plan.recall_trace_id,
        "snapshot_watermark": plan.snapshot_watermark,
    }


def _pressure_event(
    run_id: UUID, plan: ContextPlan, checkpoint_version: int, assembled: Assembled
) -> NewEvent:
    assert assembled.pressure is not None
    payload = {
        "run_id": str(run_id),
        "epoch": plan.epoch,
        "checkpoint_version": checkpoint_version,
        "needs_compaction": assembled.needs_compaction,
        "estimator_factor_ppm": assembled.estimator_factor_ppm,
        **assembled.pressure.to_json(),
    }
    return NewEvent("context.budget.pressure", payload, run_id=run_id)


def replace_item(item: ConversationItem, **changes: Any) -> Any:
    return item.model_copy(update=changes)


def _item_event(item: ConversationItem, run_id: UUID, *, in_history: bool) -> NewEvent:
    return NewEvent(
        type=EVENT_TYPE_OF_ITEM[item.kind],
        payload=item_payload(item),
        run_id=run_id,
        item_id=item.item_id,
        in_history=in_history,
    )


def _plan_event(kind: str, plan: ContextPlan, extra: dict[str, Any]) -> NewEvent:
    return NewEvent(
        kind,
        {
            "epoch": plan.epoch,
            "reason": plan.reason.name.lower(),
            "prefix_sha256": plan.prefix_sha256,
            "prefix_tokens": plan.prefix_tokens,
            "model_id": plan.model_id,
            "builder_version": plan.builder_version,
            "tool_names": list(plan.tool_names),
            "deferred_tool_names": list(plan.deferred_tool_names),
            "skipped_tool_names": list(plan.skipped_tool_names),
            "skipped_skill_names": list(plan.skipped_skill_names),
            "skipped_memory_ids": list(plan.skipped_memory_ids),
            "authority_scope_hashes": list(plan.authority_scope_hashes or ()),
            "snapshot_id": plan.snapshot_id,
            "recall_trace_id": plan.recall_trace_id,
            **extra,
        },
    )


# The longest IANA name has four parts ("right/America/Argentina/Buenos_Aires"). A name of
# hundreds made ZoneInfo's fallback import of the tzdata package recurse past Python's
# limit (RecursionError: INTERNAL, not the caller's error), so longer ones are refused first.
_ZONE_PARTS = 8


def _zone(name: str) -> ZoneInfo:
    try:
        if name.count("/") >= _ZONE_PARTS:
            raise ValueError(name)
        return ZoneInfo(name or "UTC")
    except (ZoneInfoNotFoundError, ValueError, RecursionError):
        raise InvalidFieldError(
            f"unknown time zone {name!r}", field="spec.environment.time_zone"
        ) from None
