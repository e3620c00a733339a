"""A run's checkpoint: its working conversation and the state Build reads with it.

The session event log is the system of record; a checkpoint is the run's working copy,
versioned for optimistic concurrency. Reasoning items live only here (never logged).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from .compaction import CompactionResult
from .errors import ConflictError
from .items import ConversationItem, SummaryItem
from .working_state import WorkingState

__all__ = ["Checkpoint", "applied_factor", "require_version"]

NEUTRAL_FACTOR_PPM = 1_000_000


class Checkpoint(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    run_id: str
    version: int
    items: tuple[ConversationItem, ...] = ()
    summary: SummaryItem | None = None
    # Session sequence the summary covers: items at or below it are never admitted again.
    replaced_through_sequence: int = 0
    # The committed compaction the summary came from: provenance, elided spans, depth.
    compaction: CompactionResult | None = None
    # The run's working state (row 12); seeded from the log, changed by typed transitions.
    working_state: WorkingState = WorkingState()
    # The estimator's per-model correction, pinned when the checkpoint was written so a
    # rebuild of this checkpoint cuts history at the same place, and the model it is that
    # model's correction for ("": a checkpoint written before the model was named). The
    # model is stored beside the body, not in it (migrations/0023): a body with a field the
    # previous version does not know is one it refuses.
    estimator_factor_ppm: int = NEUTRAL_FACTOR_PPM
    estimator_model_id: str = Field(default="", exclude=True)


def applied_factor(checkpoint: Checkpoint, model_id: str) -> int:
    """The correction a Build of `checkpoint` for `model_id` applies: the pinned one, but
    neutral when it was pinned for another model. The factor resets when the model changes
    (the spec): a run continued after a MODEL_CHANGED rotation applied the old model's
    factor (4x: every Build refused BUDGET_EXCEEDED), and ReportUsage then learned the new
    model's factor against it (an audit). A checkpoint naming no model applies its factor
    as before."""
    pinned = checkpoint.estimator_factor_ppm or NEUTRAL_FACTOR_PPM
    named = checkpoint.estimator_model_id
    return pinned if not named or named == model_id else NEUTRAL_FACTOR_PPM


def require_version(checkpoint: Checkpoint, expected_version: int, hint: str = "") -> None:
    """Optimistic concurrency: the caller must have seen the latest checkpoint.

    Raises:
        ConflictError: CHECKPOINT_VERSION_CONFLICT, with the latest version in metadata.
    """
    if expected_version != checkpoint.version:
        raise ConflictError(
            f"expected_checkpoint_version {expected_version} is not the latest"
            f" ({checkpoint.version}){hint}",
            field="expected_checkpoint_version",
            reason="CHECKPOINT_VERSION_CONFLICT",
            metadata={"latest_version": str(checkpoint.version)},
        )
