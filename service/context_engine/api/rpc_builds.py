"""gRPC methods for recorded builds (GetBuild); composed into ContextEngineServicer.

GetBuild rebuilds the request a model.request.started event recorded, from the inputs the
event holds (epoch, run, checkpoint version, clock, step context, cache-marker budget,
image figure, inline threshold) and the log, without recording it again. Build is pure,
so the rebuild by the same assembler is the recorded request; one by a later assembler
(core/build_record.py, Rule 8) is too unless that version changed what it sends. A record
of the legacy assembler renders its failed results as they were sent (without the
failed-result line); one of context-assembler@2 or older, a child run's user messages as
they were sent (the user's: `<user>`, USER, not the parent's `<delegated>`, MODEL). The
rebuild is checked against the recorded request_sha256 (for a record of
context-assembler@6 or older, the canonical request hashed whole, which the response then
carries too) and, where recorded, the payload's SHA-256, and the figures beside the bytes
against the record's (Rule 9: the tokenizer that counted it, the estimate, the budgets
and the tokens per class): a request that does not rebuild to them, or that the current
assembler refuses to build, is refused with FAILED_PRECONDITION REQUEST_NOT_FOUND naming
the recorded and the current assembler version (and both tokenizers where they differ),
never answered with bytes the provider never saw or figures it was not counted at. A
request built on a plan an erasure has since redacted no longer rebuilds, nor does one
whose recall lines an erasure removed from its record: both are refused with
REQUEST_REDACTED, never answered from a kept copy.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any
from uuid import UUID

import grpc

from .._gen.context_engine.v1 import context_engine_pb2 as pb
from ..core.build_record import (
    ASSEMBLER_VERSION,
    BUDGET_KEY,
    INLINE_KEY,
    PAYLOAD_KEY,
    REDACTED_KEY,
    TOKENIZER_KEY,
    assembler_of,
    bridge_markers,
    cited_passages,
    delegated_messages,
    entry_skill_trust,
    estimate_differs,
    failed_result_line,
    fixed_texts,
    image_tokens_of,
    inputs_from_record,
    marked_excerpts,
    marker_sequences,
    named_writers,
    text_call_ids,
    whole_request_hash,
)
from ..core.errors import EngineError, InvalidFieldError, NotFoundError, PreconditionError
from ..core.snapshot import erased_from_prefix
from ..store import events, sessions
from ..store.db import acquire
from . import convert
from .errors import grpc_errors
from .wire import EncodedBuildResponse

if TYPE_CHECKING:
    from .engine import BuildResult, Engine

__all__ = ["REQUEST_EVENT", "BuildsRpcs", "rebuild"]

REQUEST_EVENT = "model.request.started"


class BuildsRpcs:
    """Expects `engine` and `build_response` from ContextEngineServicer."""

    engine: Engine

    def build_response(self, result: BuildResult) -> EncodedBuildResponse:
        raise NotImplementedError  # ContextEngineServicer defines it

    def _counted_otherwise(self, payload: dict[str, Any]) -> tuple[str, str] | None:
        """(the record's tokenizer, this server's for its model) where both are known and
        differ; None otherwise (Rule 9)."""
        counted, model_id = payload.get(TOKENIZER_KEY), payload.get("model_id")
        if not isinstance(counted, str) or not isinstance(model_id, str):
            return None
        now = self.engine.tokenizer_of(model_id)
        return (counted, now) if now != counted else None

    @grpc_errors
    async def GetBuild(
        self, request: pb.GetBuildRequest, context: grpc.aio.ServicerContext
    ) -> EncodedBuildResponse:
        tenant = convert.require_tenant(request)
        session_id = convert.require_uuid(request.session_id, "session_id")
        if request.request_sequence < 1:
            raise InvalidFieldError(
                "request_sequence must be a BuildResponse.request_sequence (>= 1)",
                field="request_sequence",
            )
        sequence = request.request_sequence
        payload, before = await _recorded_request(self.engine, tenant, session_id, sequence)
        if payload.get(REDACTED_KEY):
            raise _redacted(sequence, "its recall lines")
        recorded = assembler_of(payload)
        # Another tokenizer cuts and refuses otherwise: said first, as the cause, where the
        # rebuild differs or is refused (an audit: it read "the rebuild differs", naming two
        # equal assembler versions and no tokenizer).
        counted = self._counted_otherwise(payload)
        try:
            result = await rebuild(self.engine, tenant, session_id, payload)
        except (InvalidFieldError, PreconditionError) as exc:
            # A refusal now (BUDGET_EXCEEDED under a later estimator, say) of what was built
            # and sent then: the record cannot be rebuilt, and the caller asked nothing wrong.
            # A record this build cannot read back says where (core/build_record.py).
            why = (
                exc.message
                if exc.reason == "REQUEST_NOT_FOUND"
                else f"this build refuses it ({exc.reason})"
            )
            if counted is not None:
                why = f"{_counted_by(counted)}, and {why}"
            raise _not_rebuilt(sequence, recorded, why, counted) from exc
        except EngineError as exc:
            if recorded == ASSEMBLER_VERSION:
                raise  # the same assembler built it: ours to fix, not the record's
            # An older assembler let through what this one cannot render (a reasoning
            # payload of another type, say).
            raise _not_rebuilt(sequence, recorded, "this build cannot render it") from exc
        if whole_request_hash(payload):
            result = _hashed_whole(result)  # the hash an older assembler recorded
        if not _same_bytes(result, payload):
            if erased_from_prefix(result.plan):
                # An erasure took blocks out of the plan's snapshot since: the recorded bytes
                # held the erased memories, and they are not served again (core/snapshot.py).
                # Not one whose memories the cap had skipped (an audit: a record another
                # assembler built was answered REQUEST_REDACTED, "ask again", and lost the
                # versions REQUEST_NOT_FOUND names).
                raise _redacted(sequence, f"epoch {result.plan.epoch}'s snapshot")
            why = "the rebuild differs from the recorded bytes"
            if counted is not None:
                why = f"{_counted_by(counted)}, and {why}"
            raise _not_rebuilt(sequence, recorded, why, counted)
        async with acquire(self.engine.pool) as conn:
            # Asked again after the rebuild, which may have read the record's lines or the
            # plan before an erasure committed (an audit: served an erased person's line).
            now = await events.redaction_of(conn, tenant, session_id, sequence, result.plan.epoch)
        if now.record:
            raise _redacted(sequence, "its recall lines")
        # A rebuild from the redacted plan that gives the recorded bytes shows the request
        # never held what was erased (the snapshot's cap left it out, say): served, as
        # docs/security.md says (an audit: every request of the epoch was refused). One
        # from a plan an erasure rewrote while it rebuilt (the revision moved) is not.
        if now.plan and (not result.plan.invalidated or now.revision != before.revision):
            raise _redacted(sequence, f"epoch {result.plan.epoch}'s snapshot")
        tokenizer = self.engine.tokenizer_of(result.plan.model_id)
        differs = estimate_differs(payload, result.assembled, tokenizer)
        if differs is not None:
            counted = payload.get(TOKENIZER_KEY)
            raise _not_rebuilt(
                sequence,
                recorded,
                f"{differs}, so its estimate and budget figures would not be the ones sent",
                tokenizers=(counted, tokenizer) if isinstance(counted, str) else None,
            )
        return self.build_response(replace(result, request_sequence=sequence))


def _counted_by(tokenizers: tuple[str, str]) -> str:
    return f"it was counted with {tokenizers[0]} and this server counts with {tokenizers[1]}"


async def rebuild(
    engine: Engine,
    tenant: str,
    session_id: UUID,
    payload: dict[str, Any],
    *,
    counted: bool | None = None,
) -> BuildResult:
    """The request a model.request.started `payload` records, built again as the assembler
    that recorded it built it (core/build_record.py, Rules 7 to 9), without recording it.
    GetBuild then checks the bytes and figures against the record. `counted`: whether its
    estimate counted the renderers' fixed texts (None: as its assembler version says; the
    tests name it, to check that reading).

    Raises:
        what Engine.build raises.
    """
    now, step = inputs_from_record(payload)
    run_id, version, epoch = _recorded_position(payload)
    return await engine.build(
        tenant,
        session_id,
        run_id,
        version,
        now,
        step,
        epoch=epoch,
        record=False,
        # Skills are sticky and append-only: the first N loaded are the ones it saw.
        skills_loaded=payload.get("skills_loaded"),
        # The markers it was sent with, whatever the registry says now.
        breakpoint_budget=payload.get(BUDGET_KEY),
        # The figures it was cut with, and its failed results as they were sent.
        image_tokens=image_tokens_of(payload),
        inline_maximum_bytes=payload.get(INLINE_KEY),
        failed_result_line=failed_result_line(payload),
        # A child run's user messages as it read them: the parent's from @3 on.
        delegated_messages=delegated_messages(payload),
        # Its cache markers as it named them: by id alone before @8.
        marker_sequences=marker_sequences(payload),
        # Its tool-pipeline excerpts as it sent them: unmarked before @9.
        marked_excerpts=marked_excerpts(payload),
        # Its tool pairs as text as it sent them: naming no call ids before @11.
        text_call_ids=text_call_ids(payload),
        # Its working-state block as it sent it: naming no fact's writer before @12.
        named_writers=named_writers(payload),
        # Its estimate as it counted it: no renderer's fixed text before @13.
        fixed_texts=fixed_texts(payload) if counted is None else counted,
        # Its cache markers as it placed them: no bridge before @15.
        bridge_markers=bridge_markers(payload),
        # Its bare knowledge passages as it sent them: without their citations before @16.
        cited_passages=cited_passages(payload),
        # Its loaded skills' bodies at their load trust before @17.
        entry_skill_trust=entry_skill_trust(payload),
    )


def _recorded_position(payload: dict[str, Any]) -> tuple[UUID, int, int]:
    """(run id, checkpoint version, plan epoch) a model.request.started payload was built at.

    Raises:
        PreconditionError: REQUEST_NOT_FOUND when the payload does not hold them.
    """
    try:
        return (
            UUID(payload["run_id"]),
            int(payload["checkpoint_version"]),
            int(payload["epoch"]),
        )
    except (KeyError, TypeError, ValueError):
        raise PreconditionError(
            "this request was recorded without the run, version or epoch it was built at",
            field="request_sequence",
            reason="REQUEST_NOT_FOUND",
        ) from None


def _hashed_whole(result: BuildResult) -> BuildResult:
    """`result` with request_sha256 the canonical request hashed whole, as context-assembler@6
    and older recorded it (core/build_record.py, whole_request_hash)."""
    request = result.assembled.request
    if request is None:
        return result
    assembled = replace(result.assembled, request_sha256=request.canonical_sha256())
    return replace(result, assembled=assembled)


def _same_bytes(result: BuildResult, payload: dict[str, Any]) -> bool:
    """Whether the rebuild is the request recorded: its neutral hash and, where the record
    holds one (context-assembler@2 on), the provider payload's."""
    if result.assembled.request_sha256 != payload.get("request_sha256"):
        return False
    sent = payload.get(PAYLOAD_KEY)
    if sent is None:
        return True
    return result.rendered is not None and result.rendered.sha256() == sent


def _not_rebuilt(
    sequence: int, recorded: str, why: str, tokenizers: tuple[str, str] | None = None
) -> PreconditionError:
    """FAILED_PRECONDITION REQUEST_NOT_FOUND: the record exists, but this build cannot
    reproduce what was sent (core/build_record.py, Rules 8 and 9). `tokenizers`: (the
    record's, this server's) for the metadata, where the record names one."""
    metadata = {"recorded_assembler_version": recorded, "assembler_version": ASSEMBLER_VERSION}
    if tokenizers is not None:
        metadata |= {"recorded_tokenizer": tokenizers[0], "tokenizer": tokenizers[1]}
    return PreconditionError(
        f"request {sequence} was built by {recorded} and this server runs"
        f" {'it too' if recorded == ASSEMBLER_VERSION else ASSEMBLER_VERSION}: {why}. It"
        " cannot be rebuilt here; its recorded hashes stand, and bytes the provider was not"
        " sent are never served",
        field="request_sequence",
        reason="REQUEST_NOT_FOUND",
        metadata=metadata,
    )


def _redacted(sequence: int, what: str) -> PreconditionError:
    return PreconditionError(
        f"an erasure has since redacted memories from {what} of request {sequence}, which"
        " its recorded bytes held (or may have: an erasure committed while it was rebuilt;"
        " ask again); they are not served",
        field="request_sequence",
        reason="REQUEST_REDACTED",
    )


async def _recorded_request(
    engine: Engine, tenant: str, session_id: UUID, sequence: int
) -> tuple[dict[str, Any], events.Redaction]:
    """The payload of the model.request.started event at `sequence`, and what an erasure
    had redacted of it before the rebuild (its plan's revision, GetBuild's to compare).

    Raises:
        NotFoundError: SESSION_NOT_FOUND — no such session for this tenant (as every session
            RPC answers); REQUEST_NOT_FOUND — no such event in the session.
    """
    async with acquire(engine.pool) as conn:
        rows = await events.read_events(
            conn, tenant, session_id, types=[REQUEST_EVENT], after_sequence=sequence - 1, limit=1
        )
        # Asked only when nothing was found, so a request that is found costs no more.
        missing = not rows and not await sessions.session_exists(conn, tenant, session_id)
        recorded_epoch = rows[0]["payload"].get("epoch") if rows else 0
        # An unreadable epoch is the rebuild's to refuse (REQUEST_NOT_FOUND), not INTERNAL.
        epoch = recorded_epoch if isinstance(recorded_epoch, int) else 0
        before = await events.redaction_of(conn, tenant, session_id, sequence, epoch)
    if missing:
        raise NotFoundError(
            f"session {session_id} not found", field="session_id", reason="SESSION_NOT_FOUND"
        )
    if not rows or rows[0]["sequence"] != sequence:
        raise NotFoundError(
            f"no {REQUEST_EVENT} event at sequence {sequence} in this session",
            field="request_sequence",
            reason="REQUEST_NOT_FOUND",
        )
    payload: dict[str, Any] = rows[0]["payload"]
    return payload, before
