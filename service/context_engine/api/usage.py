"""ReportUsage: reconcile the estimator against what the provider actually read.

Rule 1: the estimate is the one recorded on the request's model.request.started event
(prefix exact + body and the request's framing estimated); the actual is input + cache
read + cache creation tokens. What a report teaches is core/estimator.py learned_sample:
the body's own ratio behind an exact prefix (or the whole request's, when larger or when
the body's is outside plausible_sample's bound), the whole request's behind a heuristic
one; a request that sent attachment content teaches nothing (their figures are fixed,
never scaled).
Rule 2: the per-model correction factor (core.estimator.reconcile) is per tenant, persisted
in estimator_corrections, and resets when the model changes: a report answered by another
model than the request was built for, or whose estimate another tokenizer counted than this
replica counts the model with, is recorded but moves no factor, and a factor learned for
another tokenizer (a registry change) starts over.
Rule 3: a request's usage is counted once per idempotency key; a retry returns the first
response and writes nothing (UsageOutcome.replayed: telemetry records nothing either).
Every write is one transaction under the session lock, and the correction's
read-modify-write also under the (tenant, model) correction lock, so reports racing from
different sessions or replicas each count once.
Rule 4: checkpoints pin the factor current when they are written (pinned_factor), so a
rebuild of the same checkpoint cuts history at the same place whatever was reported since.
The signed error of each report is returned (UsageOutcome) for the telemetry shell.
Rule 5: a request is the first of its epoch when no earlier model.request.started of the
session was built on the same epoch; it writes the provider's prefix cache, so its cached
share says nothing about cache reuse (UsageOutcome.first_of_epoch; telemetry leaves it out
of context_engine.prefix.cached_ratio).
Rule 6: a report also measures history reuse, the spec's second cache measure: the input
it read from cache against the full input the preceding request read (`reuse_ppm`,
providers/usage.py; capped at 1). Region A's ratio cannot see history being sent again
uncached; this can. The preceding request is the run's request before this one or, for a
run's first, the session's, as first reported; unmeasured (None) when there is none or
it is not reported yet (a report is not measured again when its predecessor's arrives).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields, replace
from typing import Any
from uuid import UUID

import asyncpg

from ..core.build_record import ATTACHMENT_TOKENS_KEY, TOKENIZER_KEY
from ..core.checkpoint import NEUTRAL_FACTOR_PPM
from ..core.errors import NotFoundError
from ..core.estimator import (
    HEURISTIC_TOKENIZER,
    PPM,
    Correction,
    learned_sample,
    plausible_sample,
    reconcile,
    signed_error_ppm,
)
from ..providers.usage import reuse_ppm as history_reuse_ppm
from ..store import events, sessions
from ..store import usage as store
from ..store.db import transaction
from ..store.events import NewEvent

__all__ = ["REQUEST_EVENT", "USAGE_EVENT", "UsageOutcome", "UsageReport", "pinned_factor"]

REQUEST_EVENT = "model.request.started"
USAGE_EVENT = "model.usage.reported"


@dataclass(frozen=True, slots=True)
class UsageReport:
    """A validated ReportUsage request."""

    request_sequence: int
    model_id: str
    input_tokens: int
    cache_read_input_tokens: int
    cache_creation_input_tokens: int
    output_tokens: int
    idempotency_key: str
    request_sha256: str

    @property
    def actual_input_tokens(self) -> int:
        return self.input_tokens + self.cache_read_input_tokens + self.cache_creation_input_tokens


@dataclass(frozen=True, slots=True)
class UsageOutcome:
    """What ReportUsage answers, and what telemetry records (signed error per model)."""

    model_id: str
    factor_ppm: int
    samples: int
    signed_error_ppm: int
    cached_prefix_ppm: int
    estimated_input_tokens: int
    actual_input_tokens: int
    absorbed: bool
    # Rule 5. Responses stored before this field existed read as False.
    first_of_epoch: bool = False
    # Rule 6. None when unmeasured. Stored in a column of its own, not with the answer
    # (to_json): a replica of the version before it reads the stored answer into its
    # fields and would fail on one it does not know (migrations/0024).
    reuse_ppm: int | None = None
    # Not stored with the answer (to_json): whether this call only replayed an earlier
    # report's answer (Rule 3). It recorded nothing, so telemetry records nothing.
    replayed: bool = False
    # Not stored either: whether the report measures the request's estimate, so the
    # estimator's metrics take it: the request's first report (any earlier one, absorbed
    # or not), by the model it was estimated for (an audit: another model's answer was
    # recorded under that model's label against this estimate, and a second report under
    # another key counted twice).
    measures_estimate: bool = True

    def to_json(self) -> dict[str, Any]:
        stored = asdict(self)
        del stored["replayed"], stored["reuse_ppm"], stored["measures_estimate"]
        return stored

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> UsageOutcome:
        # Keys a later version stored are left out rather than refused (a mixed fleet).
        return cls(**{k: v for k, v in data.items() if k in _OUTCOME_FIELDS})


_OUTCOME_FIELDS = frozenset(f.name for f in fields(UsageOutcome))


async def pinned_factor(
    conn: Any, tenant_id: str, model_id: str, tokenizer_of: Callable[[str], str]
) -> int:
    """The factor a checkpoint written now pins for `model_id` (neutral when none was
    learned, or when it was learned for another tokenizer)."""
    stored = await store.read_correction(conn, tenant_id, model_id)
    if stored is None or stored.tokenizer != tokenizer_of(model_id):
        return NEUTRAL_FACTOR_PPM
    return stored.correction.factor_ppm


async def session_factor(
    conn: Any, tenant_id: str, session_id: UUID, tokenizer_of: Callable[[str], str]
) -> tuple[str, int]:
    """(the model of the session's current plan, its pinned_factor); ("", neutral) for a
    session without a plan."""
    model_id = await store.session_model(conn, tenant_id, session_id)
    if model_id is None:
        return "", NEUTRAL_FACTOR_PPM
    return model_id, await pinned_factor(conn, tenant_id, model_id, tokenizer_of)


async def report_usage(
    pool: asyncpg.Pool,
    tenant_id: str,
    session_id: UUID,
    report: UsageReport,
    tokenizer_of: Callable[[str], str],
) -> UsageOutcome:
    """Record one request's usage and fold it into the model's correction factor.

    Raises:
        NotFoundError: SESSION_NOT_FOUND, or REQUEST_NOT_FOUND when request_sequence is not
            a model.request.started event of this session.
        InvalidFieldError: IDEMPOTENCY_KEY_REUSED for a key reused with other figures.
    """
    async with transaction(pool) as conn:
        await sessions.lock_session(conn, tenant_id, session_id)
        # Read, whether it was warm too, before _reconcile takes the tenant's correction
        # lock, which every report of the tenant's sessions waits on until this transaction
        # ends.
        read = await store.read_report_context(
            conn,
            tenant_id,
            session_id,
            report.request_sequence,
            report.idempotency_key,
            report.request_sha256,
        )
        if read.earlier is not None:
            return replace(UsageOutcome.from_json(read.earlier), replayed=True)
        if read.recorded is None:
            raise NotFoundError(
                f"no model request was recorded at sequence {report.request_sequence} in"
                " this session",
                field="request_sequence",
                reason="REQUEST_NOT_FOUND",
            )
        recorded, warm = read.recorded, read.warm
        outcome, correction = await _reconcile(
            conn, tenant_id, report, recorded, tokenizer_of, learned=read.learned
        )
        outcome = replace(
            outcome,
            # A request's first report only, absorbed or not (a review: a refused first
            # report and a second under another key counted twice).
            measures_estimate=outcome.measures_estimate and not read.reported,
            first_of_epoch=not warm,
            reuse_ppm=None
            if read.preceding_input is None
            else history_reuse_ppm(report.cache_read_input_tokens, read.preceding_input),
        )
        if correction is not None:
            await store.write_correction(
                conn, tenant_id, correction, tokenizer_of(correction.model_id)
            )
        await store.insert_report(conn, tenant_id, session_id, _report_row(report, outcome))
        run_id = recorded.get("run_id")
        await events.append_events(
            conn,
            tenant_id,
            session_id,
            [
                NewEvent(
                    USAGE_EVENT,
                    {
                        "request_sequence": report.request_sequence,
                        "input_tokens": report.input_tokens,
                        "cache_read_input_tokens": report.cache_read_input_tokens,
                        "cache_creation_input_tokens": report.cache_creation_input_tokens,
                        "output_tokens": report.output_tokens,
                        **outcome.to_json(),
                        "reuse_ppm": outcome.reuse_ppm,
                    },
                    run_id=UUID(run_id) if run_id else None,
                )
            ],
        )
    return outcome


async def _reconcile(
    conn: Any,
    tenant_id: str,
    report: UsageReport,
    recorded: dict[str, Any],
    tokenizer_of: Callable[[str], str],
    *,
    learned: bool = False,
) -> tuple[UsageOutcome, Correction | None]:
    estimated = int(recorded.get("estimated_input_tokens", 0))
    prefix = int(recorded.get("prefix_tokens", 0))
    planned_model = str(recorded.get("model_id", report.model_id))
    actual = report.actual_input_tokens
    # Reports of other sessions of this tenant race for the same correction (Rule 3).
    await store.lock_correction(conn, tenant_id, planned_model)
    stored = await store.read_correction(conn, tenant_id, planned_model)
    previous = (
        stored.correction
        if stored is not None and stored.tokenizer == tokenizer_of(planned_model)
        else None
    )
    # Another model answered than the request was estimated for: its tokens say nothing
    # about this estimate's tokenizer, so nothing is learned (the factor resets on a change).
    # Nor when another tokenizer counted the estimate than this replica counts the model
    # with (a registry change, replicas configured apart): the factor is this tokenizer's,
    # and a foreign sample would be learned for it. A record older than the tokenizer's
    # name is taken as counted here.
    counted = recorded.get(TOKENIZER_KEY)
    same_counter = not isinstance(counted, str) or counted == tokenizer_of(planned_model)
    used = int(recorded.get("estimator_factor_ppm", NEUTRAL_FACTOR_PPM)) or PPM
    # Nor from a report no tokenizer drift explains (core/estimator.py plausible_sample),
    # nor from a second report of a request one was learned from (`learned`: under another
    # key; each counted, contradictory figures too: an audit). One response, one sample.
    exact = (counted if isinstance(counted, str) else tokenizer_of(planned_model)) != (
        HEURISTIC_TOKENIZER
    )
    sample, seen = learned_sample(estimated, actual, prefix, exact, used)
    # Nor from a request that sent attachment content, counted at fixed figures no factor
    # scales (an image at 1,600 tokens that a provider reads as 765 pulled a learned 1.5
    # down to 1.01 over a dozen reports: an audit).
    absorbed = (
        not learned
        and same_model(report.model_id, planned_model)
        and same_counter
        and plausible_sample(estimated, actual, used)
        and not recorded.get(ATTACHMENT_TOKENS_KEY, 0)
    )
    correction: Correction | None = None
    if absorbed:
        current = previous.factor_ppm if previous is not None else PPM
        # reconcile() reads the estimate as made under the current factor; this request was
        # built under the factor its checkpoint pinned, so restate it under the current one.
        restated = -(-sample * current // used)
        correction = reconcile(previous, planned_model, restated, seen)
    shown = correction or previous or Correction.initial(planned_model)
    outcome = UsageOutcome(
        # The planned model's name for a dated snapshot of it: one series per model.
        model_id=planned_model if same_model(report.model_id, planned_model) else report.model_id,
        factor_ppm=shown.factor_ppm,
        samples=shown.samples,
        signed_error_ppm=signed_error_ppm(estimated, actual) if estimated > 0 else 0,
        cached_prefix_ppm=min(PPM, report.cache_read_input_tokens * PPM // prefix)
        if prefix > 0
        else 0,
        estimated_input_tokens=estimated,
        actual_input_tokens=actual,
        absorbed=absorbed,
        measures_estimate=same_model(report.model_id, planned_model),
    )
    return outcome, correction


# A provider's dated snapshot of a model: Anthropic's "-20250929", OpenAI's "-2024-08-06"
# and its older month-and-day form, "gpt-4-0613" and "gpt-3.5-turbo-0125" (an audit: those
# two models never learned a factor from the response.model the docs say will do).
_SNAPSHOT = re.compile(r"-(?:\d{8}|\d{4}-\d{2}-\d{2}|(?:0[1-9]|1[0-2])(?:0[1-9]|[12]\d|3[01]))")


def same_model(reported: str, planned: str) -> bool:
    """Whether the model a provider reports is the one the request was planned for: the
    same id, or a dated snapshot of it (what a provider's response.model says when the
    request named the alias)."""
    if reported == planned:
        return True
    return (
        reported.startswith(planned) and _SNAPSHOT.fullmatch(reported[len(planned) :]) is not None
    )


def _report_row(report: UsageReport, outcome: UsageOutcome) -> dict[str, Any]:
    return {
        "request_sequence": report.request_sequence,
        "idempotency_key": report.idempotency_key,
        "request_sha256": report.request_sha256,
        "model_id": report.model_id,
        "estimated_input_tokens": outcome.estimated_input_tokens,
        "actual_input_tokens": outcome.actual_input_tokens,
        "input_tokens": report.input_tokens,
        "cache_read_input_tokens": report.cache_read_input_tokens,
        "cache_creation_input_tokens": report.cache_creation_input_tokens,
        "output_tokens": report.output_tokens,
        "signed_error_ppm": outcome.signed_error_ppm,
        "cached_prefix_ppm": outcome.cached_prefix_ppm,
        "absorbed": outcome.absorbed,
        "reuse_ppm": outcome.reuse_ppm,
        "response": outcome.to_json(),
    }
