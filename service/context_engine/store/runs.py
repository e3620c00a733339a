"""Runs and their versioned checkpoints."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from uuid import UUID

from ..core.checkpoint import Checkpoint
from ..core.errors import ConflictError, NotFoundError, PreconditionError
from .plans import RUN_LINEAGE

__all__ = [
    "RUN_HEAD",
    "RUN_HEADS",
    "RunHead",
    "RunRow",
    "insert_checkpoint",
    "insert_run",
    "read_checkpoint",
    "read_run",
    "read_run_head",
    "read_run_heads",
    "run_head_of",
]


@dataclass(frozen=True, slots=True)
class RunRow:
    run_id: UUID
    session_id: UUID
    parent_run_id: UUID | None
    seed_event_sequence: int | None
    epoch: int


async def insert_run(conn: Any, tenant_id: str, run: RunRow) -> None:
    """Insert a run.

    Raises:
        PreconditionError: RUN_STATE when the run id is taken (not a lost race: retrying
            the same StartRun with a new idempotency key fails again).
    """
    status = await conn.execute(
        "INSERT INTO runs (tenant_id, session_id, run_id, parent_run_id, seed_event_sequence,"
        " epoch) VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT DO NOTHING",
        tenant_id,
        run.session_id,
        run.run_id,
        run.parent_run_id,
        run.seed_event_sequence,
        run.epoch,
    )
    if status.endswith(" 0"):
        raise PreconditionError(
            f"run {run.run_id} already exists", field="run_id", reason="RUN_STATE"
        )


async def read_run(conn: Any, tenant_id: str, session_id: UUID, run_id: UUID) -> RunRow:
    """Raises NotFoundError for a run that is not in this tenant's session.

    The run is found by its primary key and its session compared here: with the session in
    the WHERE clause too, PostgreSQL may pick the (tenant, session, created_at) index and
    filter every run of the session (measured: 0.75 ms at 5,000 runs, 0.2 ms at 50)."""
    row = await conn.fetchrow(
        "SELECT session_id, parent_run_id, seed_event_sequence, epoch FROM runs"
        " WHERE tenant_id = $1 AND run_id = $2",
        tenant_id,
        run_id,
    )
    if row is None or row["session_id"] != session_id:
        raise NotFoundError(f"run {run_id} not found", field="run_id", reason="RUN_NOT_FOUND")
    return RunRow(
        run_id=run_id,
        session_id=row["session_id"],
        parent_run_id=row["parent_run_id"],
        seed_event_sequence=row["seed_event_sequence"],
        epoch=row["epoch"],
    )


async def read_run_checkpoint(
    conn: Any, tenant_id: str, session_id: UUID, run_id: UUID, kept: Checkpoint | None = None
) -> tuple[RunRow, Checkpoint]:
    """read_run and read_checkpoint (the latest version) in one round trip, for a write
    that continues the run (AppendItems). `kept` is a checkpoint of this run the caller
    holds: when it is the latest, its body is not sent or parsed again (versions are
    immutable: nothing rewrites a stored one), and it is returned as read.

    Raises NotFoundError as read_run does, then as read_checkpoint does."""
    row = await conn.fetchrow(
        "SELECT r.session_id, r.parent_run_id, r.seed_event_sequence, r.epoch, c.version,"
        " CASE WHEN c.version = $3 THEN NULL ELSE c.body END AS body, c.estimator_model_id"
        " FROM runs r LEFT JOIN LATERAL"
        " (SELECT version, body, estimator_model_id FROM run_checkpoints c"
        "  WHERE c.tenant_id = r.tenant_id AND c.run_id = r.run_id"
        "  ORDER BY version DESC LIMIT 1) c ON true"
        " WHERE r.tenant_id = $1 AND r.run_id = $2",
        tenant_id,
        run_id,
        kept.version if kept is not None else None,  # NULL: never equal
    )
    if row is None or row["session_id"] != session_id:
        raise NotFoundError(f"run {run_id} not found", field="run_id", reason="RUN_NOT_FOUND")
    if row["version"] is None:
        raise NotFoundError(
            f"run {run_id} has no checkpoint version 0",
            field="checkpoint_version",
            reason="RUN_NOT_FOUND",
        )
    run = RunRow(
        run_id=run_id,
        session_id=row["session_id"],
        parent_run_id=row["parent_run_id"],
        seed_event_sequence=row["seed_event_sequence"],
        epoch=row["epoch"],
    )
    if row["body"] is None:
        assert kept is not None and kept.version == row["version"]
        return run, kept
    return run, _checkpoint(row)


async def insert_checkpoint(conn: Any, tenant_id: str, checkpoint: Checkpoint) -> None:
    """Write a checkpoint version. Raises ConflictError when that version exists."""
    status = await conn.execute(
        "INSERT INTO run_checkpoints"
        " (tenant_id, run_id, version, body, estimator_factor_ppm, estimator_model_id)"
        " VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT DO NOTHING",
        tenant_id,
        UUID(checkpoint.run_id),
        checkpoint.version,
        checkpoint.model_dump(mode="json"),
        checkpoint.estimator_factor_ppm,
        checkpoint.estimator_model_id or None,
    )
    if status.endswith(" 0"):
        raise ConflictError(
            f"checkpoint version {checkpoint.version} was written concurrently",
            field="expected_checkpoint_version",
            reason="CHECKPOINT_VERSION_CONFLICT",
        )


async def read_checkpoint(conn: Any, tenant_id: str, run_id: UUID, version: int = 0) -> Checkpoint:
    """The given version, or the latest when version is 0."""
    row = await conn.fetchrow(
        "SELECT body, estimator_model_id FROM run_checkpoints WHERE tenant_id = $1"
        " AND run_id = $2"
        " AND ($3::bigint = 0 OR version = $3::bigint) ORDER BY version DESC LIMIT 1",
        tenant_id,
        run_id,
        version,
    )
    if row is None:
        raise NotFoundError(
            f"run {run_id} has no checkpoint version {version}",
            field="checkpoint_version",
            reason="RUN_NOT_FOUND",
        )
    return _checkpoint(row)


def _checkpoint(row: Any) -> Checkpoint:
    """A checkpoint as stored: its body, and the model its pinned factor is for, beside it
    (migrations/0023; NULL for one the previous version wrote)."""
    checkpoint = Checkpoint.model_validate(row["body"])
    model = row["estimator_model_id"]
    return checkpoint.model_copy(update={"estimator_model_id": model}) if model else checkpoint


# What a Build reads first of a run `r` (read_run_head, read_run_heads); every subquery an
# index probe (migrations/0010), which tests/integration/test_plan_service.py checks with
# EXPLAIN. migrations/0013's run_head_state (its run read by key since 0014) and
# run_latest_version read the same (a change here is a change there:
# tests/integration/test_kept_heads.py compares them).
_HEAD_COLUMNS = (
    "r.session_id, r.parent_run_id, r.seed_event_sequence, r.epoch,"
    " (SELECT max(c.version) FROM run_checkpoints c"
    "  WHERE c.tenant_id = r.tenant_id AND c.run_id = r.run_id) AS latest,"
    " (SELECT max(p.epoch) FROM context_plans p"
    "  WHERE p.tenant_id = r.tenant_id AND p.session_id = r.session_id"
    "  AND coalesce(p.lineage, p.epoch) = " + RUN_LINEAGE + ") AS effective,"
    " (SELECT count(*) FROM loaded_skills s"
    "  WHERE s.tenant_id = r.tenant_id AND s.session_id = r.session_id) AS skills,"
    " (SELECT s.plans_revision FROM sessions s"
    "  WHERE s.tenant_id = r.tenant_id AND s.session_id = r.session_id) AS revision,"
    " (SELECT max(w.epoch) FROM context_plans w"
    "  WHERE w.tenant_id = r.tenant_id AND w.session_id = r.session_id AND w.sweep) AS sweep"
)
# One run's head ($1 tenant, $2 run id).
RUN_HEAD = "SELECT " + _HEAD_COLUMNS + " FROM runs r WHERE r.tenant_id = $1 AND r.run_id = $2"
# Many runs' heads ($1 tenants, $2 run ids, pairwise), each row with `n`, the 1-based
# position of its key; a key with no run has no row.
RUN_HEADS = (
    "SELECT k.n, " + _HEAD_COLUMNS + " FROM unnest($1::text[], $2::uuid[])"
    " WITH ORDINALITY AS k(tenant_id, run_id, n)"
    " JOIN runs r ON r.tenant_id = k.tenant_id AND r.run_id = k.run_id"
)


@dataclass(frozen=True, slots=True)
class RunHead:
    """What a Build reads first, in one round trip (read_run_head)."""

    run: RunRow
    latest_version: int  # the run's latest checkpoint version
    effective_epoch: int  # the plan epoch it builds on
    skills_loaded: int  # how many skills the session has loaded
    plans_revision: int  # the session's plans_revision (bumped when an erasure rewrites)
    # The session's latest sweep (store/plans.py), 0 for none: the run's lineage is behind
    # while its head, effective_epoch, is older.
    sweep_epoch: int = 0

    @property
    def state(self) -> str:
        """What a Build made from this head depends on besides the checkpoint version, as
        migrations/0013's run_head_state reads it: a record confirms a kept head with it
        (store/records.py)."""
        parts = (self.effective_epoch, self.skills_loaded, self.plans_revision, self.sweep_epoch)
        return "/".join(map(str, parts))

    @property
    def behind(self) -> bool:
        """Whether a sweep has not reached the run's lineage yet (store/plans.py)."""
        return self.sweep_epoch > self.effective_epoch

    @property
    def plan_epochs(self) -> tuple[int, ...]:
        """The plans the run's model is shown from now on, besides those its recorded
        requests were built on: its own, the one it builds on, and when behind the sweep
        its lineage continues with (the continuation shows that sweep's snapshot). What
        the run may restate is held at the least trust any of them shows it (a review: a
        Rotate that lowered a loaded skill reached summaries and facts only once the run
        had built on the new plan). The sweep's plan is another lineage's, so its catalog
        may hold a text lower than the run will see it, never higher; its tools are not
        the run's (compaction reads the tools a run was given without it)."""
        behind = (self.sweep_epoch,) if self.behind else ()
        return tuple(dict.fromkeys((self.run.epoch, self.effective_epoch, *behind)))


async def read_run_head(conn: Any, tenant_id: str, session_id: UUID, run_id: UUID) -> RunHead:
    """The run, its latest checkpoint version, the plan epoch it builds on, how many skills
    the session has loaded, the session's plans revision and its latest sweep, in one round
    trip. The epoch is the latest plan of the run's lineage (store/plans.py): the run's own
    epoch, or a later one that continues its lineage or merged every lineage, never another
    run's admission nor a plan rebuilt from another run's lineage. Each subquery reads an
    index (migrations/0010), so it costs the same however many plans the session has.

    Raises NotFoundError for a run that is not in this tenant's session. Found by primary
    key, the session compared after (see read_run).
    """
    return run_head_of(await conn.fetchrow(RUN_HEAD, tenant_id, run_id), session_id, run_id)


async def read_run_heads(conn: Any, keys: Sequence[tuple[str, UUID]]) -> list[Any]:
    """Many runs' head rows in one round trip, by (tenant, run id): each key's row, or
    None when no such run exists. run_head_of makes each a RunHead for its session
    (store/batches.py sends Builds' reads this way)."""
    rows = await conn.fetch(RUN_HEADS, [t for t, _ in keys], [r for _, r in keys])
    found: list[Any] = [None] * len(keys)
    for row in rows:
        found[row["n"] - 1] = row
    return found


def run_head_of(row: Any, session_id: UUID, run_id: UUID) -> RunHead:
    """RunHead of a head row read for `run_id`.

    Raises NotFoundError for a run that is not in this tenant's session (no row, or a row
    of another session)."""
    if row is None or row["session_id"] != session_id:
        raise NotFoundError(f"run {run_id} not found", field="run_id", reason="RUN_NOT_FOUND")
    run = RunRow(
        run_id=run_id,
        session_id=session_id,
        parent_run_id=row["parent_run_id"],
        seed_event_sequence=row["seed_event_sequence"],
        epoch=row["epoch"],
    )
    return RunHead(
        run=run,
        latest_version=int(row["latest"] or 0),
        effective_epoch=int(row["effective"] or row["epoch"]),
        skills_loaded=int(row["skills"]),
        plans_revision=int(row["revision"] or 0),
        sweep_epoch=int(row["sweep"] or 0),
    )
