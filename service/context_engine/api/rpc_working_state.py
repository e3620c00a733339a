"""gRPC methods for working state; composed into ContextEngineServicer.

UpdateWorkingState (the context.update_working_state control tool), ListControlTools and
OfferFactCandidates, with the proto <-> core conversion for their messages, validating
first: a malformed request names its field and writes nothing.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

import grpc
from google.protobuf import json_format

from .._gen.context_engine.v1 import context_engine_pb2 as pb
from ..core.canonical import canonical_json_text, parse_json_object
from ..core.errors import InvalidFieldError
from ..core.names import CALLABLE_NAME, quoted_name
from ..core.spec import ToolSpec
from ..core.trust import TrustLevel
from ..core.working_state import (
    MAX_FACT_SOURCES,
    MAX_UPDATE_ENTRIES,
    UPDATE_TOOL,
    Entry,
    Fact,
    NewFact,
    TaskStatus,
    TaskUpsert,
    WorkingState,
    WorkingStateUpdate,
    Writer,
    check_fact_sources,
    check_update_sizes,
)
from . import convert
from . import working_state as ws_api
from .errors import grpc_errors
from .request_hash import request_sha256

if TYPE_CHECKING:
    from .engine import Engine

__all__ = [
    "CONTROL_TOOLS",
    "WorkingStateRpcs",
    "state_to_proto",
    "tool_spec_to_proto",
    "update_from_proto",
]

# The engine's control tools, advertised through ListControlTools.
CONTROL_TOOLS: tuple[ToolSpec, ...] = (UPDATE_TOOL,)


# Per fact of an update, in order, the item ids it cites (`Fact.source_item_ids`): the
# model's way to name evidence, resolved to sequences under the session lock (ws_api).
CitedItems = tuple[tuple[str, ...], ...]


def update_from_proto(
    update: pb.WorkingStateUpdate, field: str = "update"
) -> tuple[WorkingStateUpdate, CitedItems]:
    """-> (the update, the item ids each of its facts cites besides its source_event_ids).

    Raises InvalidFieldError naming the field (`update.upsert_tasks[1].status`, ...).

    A list field longer than MAX_UPDATE_ENTRIES is refused before anything is converted.
    """
    check_update_sizes({name: len(getattr(update, name)) for name in MAX_UPDATE_ENTRIES}, field)
    for n, t in enumerate(update.upsert_tasks):
        if t.task_id and not t.task_id.strip():
            # Checked here, not in the transition: the log fold replays what was accepted.
            raise InvalidFieldError(
                "task_id must not be blank", field=f"{field}.upsert_tasks[{n}].task_id"
            )
    tasks = [
        TaskUpsert(
            task_id=t.task_id,
            title=t.title,
            status=convert.known_enum(TaskStatus, t.status, f"{field}.upsert_tasks[{n}].status")
            if t.status
            else None,
        )
        for n, t in enumerate(update.upsert_tasks)
    ]
    facts = []
    cited: list[tuple[str, ...]] = []
    for n, f in enumerate(update.add_facts):
        path = f"{field}.add_facts[{n}]"
        for output in ("writer", "source_sequence"):
            if getattr(f, output):
                raise InvalidFieldError(
                    f"{output} is the engine's (the update's writer is the request's)",
                    field=f"{path}.{output}",
                )
        check_fact_sources(f.source_event_ids, f"{path}.source_event_ids")
        if len(f.source_item_ids) + len(f.source_event_ids) > MAX_FACT_SOURCES:
            # By its length before each id is checked (a review: 2.5 million ids took 0.7 s
            # of the event loop to be refused).
            _refuse_sources(f.source_item_ids, f.source_event_ids, f"{path}.source_item_ids")
        items = tuple(
            convert.require_id(item_id, f"{path}.source_item_ids[{k}]")
            for k, item_id in enumerate(f.source_item_ids)
        )
        check_fact_sources(items, f"{path}.source_item_ids", also=len(f.source_event_ids))
        cited.append(items)
        facts.append(
            NewFact(
                statement=f.statement,
                source_event_ids=tuple(f.source_event_ids),
                # An unspecified claim claims nothing: the evidence alone decides.
                trust=convert.known_enum(TrustLevel, f.trust, f"{path}.trust")
                if f.trust
                else TrustLevel.PLATFORM,
            )
        )
    readings = ws_api.cited_readings([i for items in cited for i in items])
    if readings > ws_api.UPDATE_READINGS:
        raise InvalidFieldError(
            f"the item ids {field}.add_facts cites stand for more than"
            f" {ws_api.UPDATE_READINGS} ids together (an envelope shows several characters"
            " alike)",
            field=f"{field}.add_facts",
            metadata={"limit": str(ws_api.UPDATE_READINGS)},
        )
    typed = WorkingStateUpdate(
        objective=update.objective if update.HasField("objective") else None,
        remove_constraints=tuple(update.remove_constraints),
        add_constraints=tuple(update.add_constraints),
        upsert_tasks=tuple(tasks),
        add_facts=tuple(facts),
        add_questions=tuple(update.add_questions),
        resolve_questions=tuple(update.resolve_questions),
        next_action=update.next_action if update.HasField("next_action") else None,
    )
    return typed, tuple(cited)


TOOL_ARGUMENTS = "tool_arguments_json"


def update_from_tool_arguments(text: str) -> pb.WorkingStateUpdate:
    """The update a context.update_working_state call's arguments (as the model sent them)
    ask for, read by the tool's input schema: its keys only, task statuses by their
    lowercase names. The proto's JSON form otherwise, which the schema's keys are.

    Raises:
        InvalidFieldError: naming tool_arguments_json, the message saying where.
    """
    _check_list_sizes(text)
    try:
        arguments = parse_json_object(text)
    except (ValueError, RecursionError) as exc:  # the parser's words, never content
        raise InvalidFieldError(
            f"{TOOL_ARGUMENTS} must be a JSON object: {exc}", field=TOOL_ARGUMENTS
        ) from None
    _check_arguments(arguments, UPDATE_TOOL.input_schema, "")
    for task in arguments.get("upsert_tasks") or ():
        if isinstance(task, dict) and isinstance(task.get("status"), str):
            task["status"] = f"TASK_STATUS_{task['status'].upper()}"
    update = pb.WorkingStateUpdate()
    try:
        json_format.ParseDict(arguments, update)
    except json_format.ParseError as exc:
        raise InvalidFieldError(f"{TOOL_ARGUMENTS}: {exc}", field=TOOL_ARGUMENTS) from None
    return update


def _check_list_sizes(text: str) -> None:
    """check_update_sizes on the arguments' top-level lists, before any entry is read: the
    canonical walk, the schema check and the protobuf of 3.9 million entries took 11 s,
    to refuse a list by its length (an audit). A text json.loads cannot read is left to
    parse_json_object, which says why."""
    try:
        quick = json.loads(text)
    except (ValueError, RecursionError):
        return
    if not isinstance(quick, dict):
        return
    # The schema's lists only: a key it does not define is refused as no argument, whatever
    # its length (a review: a long `add_questions` was told its count).
    arguments = UPDATE_TOOL.input_schema["properties"]
    check_update_sizes(
        {k: len(v) for k, v in quick.items() if k in arguments and isinstance(v, list)}
    )
    # And each fact's cited ids, a list inside a list (another review: 2.5 million of them
    # were walked before their count was read).
    facts = quick.get("add_facts")
    for n, fact in enumerate(facts if isinstance(facts, list) else ()):
        cited = fact.get("source_item_ids") if isinstance(fact, dict) else None
        if isinstance(cited, list) and len(cited) > MAX_FACT_SOURCES:
            _refuse_sources(cited, (), f"update.add_facts[{n}].source_item_ids")


def _refuse_sources(items: Sequence[Any], events: Sequence[Any], field: str) -> NoReturn:
    """check_fact_sources' refusal of a fact citing more than MAX_FACT_SOURCES in all,
    counted before any id is read."""
    check_fact_sources(range(len(items)), field, also=len(events))
    raise AssertionError("over MAX_FACT_SOURCES, so refused above")


# JSON Schema's types as Python's (json.loads): a bool is no integer, though Python's is.
_JSON_TYPES: dict[str, Callable[[Any], bool]] = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
}


def _check_arguments(value: Any, schema: Mapping[str, Any], path: str) -> None:
    """Refuse what the tool's schema does not admit: a key it does not define (which the
    proto would take: a fact's trust, add_questions, which the tool does not offer the
    model), a value of another type (a status given as a number, a string as null), one
    outside an enum, a required key missing, a list shorter than its minimum. The subset
    of JSON Schema the control tool's own schema uses."""
    where = path or "the arguments"
    kinds = schema.get("type")
    if kinds is not None:
        allowed = [kinds] if isinstance(kinds, str) else list(kinds)
        if not any(_JSON_TYPES[kind](value) for kind in allowed):
            _refuse(f"{where} must be {' or '.join(allowed)}")
    if "enum" in schema and value not in schema["enum"]:
        _refuse(f"{where} is not one of {', '.join(map(str, schema['enum']))}")
    if isinstance(value, dict):
        properties = schema.get("properties", {})
        for key, item in value.items():
            inner = f"{path}.{key}" if path else key
            if key not in properties:
                # The key quoted only where it is a name: the model may write anything
                # there, a page's sentence too (a review: it came back whole).
                hint = _INSTEAD.get(key, "")
                named = inner if CALLABLE_NAME.fullmatch(key) else f"{quoted_name(key)} in {where}"
                _refuse(f"{named} is not an argument of {UPDATE_TOOL.name}{hint}")
            _check_arguments(item, properties[key], inner)
        for key in schema.get("required", ()):
            if key not in value:
                _refuse(f"{where} lacks {key}")
    elif isinstance(value, list):
        if len(value) < schema.get("minItems", 0):
            _refuse(f"{where} needs at least {schema['minItems']} entries")
        if isinstance(schema.get("items"), Mapping):
            for n, item in enumerate(value):
                _check_arguments(item, schema["items"], f"{path}[{n}]")


# What a model reading an earlier definition of the tool (a plan pins the one it was made
# with) sends, and what the message tells it to send instead.
_INSTEAD = {"source_event_ids": ": cite source_item_ids, the ids the envelopes show"}


def _refuse(message: str) -> NoReturn:
    raise InvalidFieldError(f"{TOOL_ARGUMENTS}: {message}", field=TOOL_ARGUMENTS)


def _entry(entry: Entry) -> pb.WorkingStateEntry:
    return pb.WorkingStateEntry(
        text=entry.text,
        writer=pb.Writer.ValueType(entry.writer),
        source_sequence=entry.source_sequence,
        trust=pb.TrustLevel.ValueType(entry.trust),
    )


def _fact(fact: Fact) -> pb.Fact:
    return pb.Fact(
        statement=fact.statement,
        source_event_ids=list(fact.source_event_ids),
        trust=pb.TrustLevel.ValueType(fact.trust),
        writer=pb.Writer.ValueType(fact.writer),
        source_sequence=fact.source_sequence,
    )


def state_to_proto(state: WorkingState) -> pb.WorkingState:
    out = pb.WorkingState(
        constraints=[_entry(c) for c in state.constraints],
        tasks=[
            pb.TaskState(task_id=t.task_id, title=t.title, status=pb.TaskStatus.ValueType(t.status))
            for t in state.tasks
        ],
        facts=[_fact(f) for f in state.facts],
        open_questions=[_entry(q) for q in state.open_questions],
        next_action=state.next_action.text if state.next_action else "",
    )
    if state.objective is not None:
        out.objective.CopyFrom(_entry(state.objective))
    return out


def tool_spec_to_proto(tool: ToolSpec) -> pb.ToolSpec:
    return pb.ToolSpec(
        name=tool.name,
        description=tool.description,
        input_schema_json=canonical_json_text(json.dumps(tool.input_schema)),
        output_schema_json=canonical_json_text(json.dumps(tool.output_schema))
        if tool.output_schema is not None
        else "",
        side_effect=pb.SideEffect.ValueType(tool.side_effect),
        required_scopes=list(tool.required_scopes),
        server=tool.server,
        model_visible=tool.model_visible,
        builtin=tool.builtin,
        session_binding=tool.session_binding,
        policy_json=canonical_json_text(json.dumps(tool.policy)),
    )


def _candidate(candidate: Mapping[str, Any]) -> pb.FactCandidate:
    fact = Fact.model_validate(candidate["fact"])
    return pb.FactCandidate(
        fact=_fact(fact), authority=candidate["authority"], run_id=candidate["run_id"]
    )


class WorkingStateRpcs:
    """Expects `engine` from ContextEngineServicer."""

    engine: Engine

    @grpc_errors
    async def UpdateWorkingState(
        self, request: pb.UpdateWorkingStateRequest, context: grpc.aio.ServicerContext
    ) -> pb.UpdateWorkingStateResponse:
        tenant = convert.require_tenant(request)
        session_id = convert.require_uuid(request.session_id, "session_id")
        run_id = convert.require_uuid(request.run_id, "run_id")
        convert.require_expected_version(request.expected_checkpoint_version)
        if request.tool_arguments_json:
            if request.HasField("update"):
                raise InvalidFieldError(
                    f"send update or {TOOL_ARGUMENTS}, not both", field=TOOL_ARGUMENTS
                )
            # A tool call's arguments are the model's words, whoever relays them.
            if request.writer not in (pb.WRITER_UNSPECIFIED, pb.WRITER_MODEL):
                raise InvalidFieldError(
                    f"{TOOL_ARGUMENTS} are the model's: writer must be WRITER_MODEL",
                    field="writer",
                )
            writer = Writer.MODEL
            # Off the event loop: arguments of a few megabytes are parsed and walked.
            sent = await asyncio.to_thread(update_from_tool_arguments, request.tool_arguments_json)
        elif request.HasField("update"):
            writer = convert.known_enum(Writer, request.writer, "writer")
            sent = request.update
        else:
            raise InvalidFieldError(f"update (or {TOOL_ARGUMENTS}) is required", field="update")
        update, cited = update_from_proto(sent)
        if not update.touched():
            raise InvalidFieldError("update changes nothing", field="update")
        result = await ws_api.update_working_state(
            self.engine,
            tenant,
            session_id,
            run_id,
            request.expected_checkpoint_version,
            writer,
            update,
            convert.require_id(request.idempotency_key, "idempotency_key", required=False),
            request_sha256(request, {"session_id": session_id, "run_id": run_id}),
            cited,
            relayed=bool(request.tool_arguments_json),
        )
        return pb.UpdateWorkingStateResponse(
            checkpoint_version=result["checkpoint_version"],
            event_sequence=result["event_sequence"],
            state=state_to_proto(WorkingState.model_validate(result["state"])),
        )

    @grpc_errors
    async def ListControlTools(
        self, request: pb.ListControlToolsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListControlToolsResponse:
        return pb.ListControlToolsResponse(tools=[tool_spec_to_proto(t) for t in CONTROL_TOOLS])

    @grpc_errors
    async def OfferFactCandidates(
        self, request: pb.OfferFactCandidatesRequest, context: grpc.aio.ServicerContext
    ) -> pb.OfferFactCandidatesResponse:
        tenant = convert.require_tenant(request)
        session_id = convert.require_uuid(request.session_id, "session_id")
        result = await ws_api.offer_fact_candidates(
            self.engine,
            tenant,
            session_id,
            convert.require_id(request.idempotency_key, "idempotency_key", required=False),
            request_sha256(request, {"session_id": session_id}),
        )
        return pb.OfferFactCandidatesResponse(
            candidates=[_candidate(c) for c in result["candidates"]],
            event_sequence=result["event_sequence"],
        )
