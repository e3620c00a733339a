"""ModelRequest -> protobuf, composed from memoized wire bytes.

`convert.request_to_proto` builds the message field by field; a fifty-turn request is two
hundred content blocks, and building each as a Python protobuf object on every Build costs
more than the rest of the response. A block is a frozen value that repeats on every Build
of a run (and a plan's system blocks and tools on every Build of a session), so each is
serialized once per process — and so is each message, since a run's carried messages are
the same objects on every Build (core/carried.py) — and a request's bytes are the
concatenation the protobuf encoding defines for repeated fields: a serialized message
followed by more fields of the same message merges into it, and repeated fields append.
Build sends those bytes as the BuildResponse's request field without parsing them
(EncodedBuildResponse). tests/unit/test_wire.py checks the composed request equals
`convert.request_to_proto` on generated requests, and the encoded response equals the
message built field by field.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

from .._gen.context_engine.v1 import context_engine_pb2 as pb
from ..core.identity_memo import IdentityMemo, RecentMemo
from ..core.memo_budget import bounded_cache
from ..core.plan import ClassUsage
from ..core.request import (
    Block,
    CacheBreakpoint,
    Message,
    ModelRequest,
    ToolDefinition,
    with_repeated_run,
)
from . import convert

__all__ = ["EncodedBuildResponse", "field", "request_bytes", "request_message", "request_pieces"]

# BuildResponse, ModelRequest and Message field numbers
# (proto/context_engine/v1/context_engine.proto).
_REQUEST, _BUDGET, _PROVIDER_PAYLOAD = 1, 10, 11
_ENCODED = frozenset({"request", "budget", "provider_payload"})
_SYSTEM, _TOOLS, _MESSAGES = 3, 4, 5
_ROLE, _BLOCKS = 1, 2
_LENGTH_DELIMITED = 2


class EncodedBuildResponse:
    """A BuildResponse whose large fields are already encoded: the handler returns it and
    the registered serializer (api/registration.py) sends `SerializeToString()`, the small
    head's bytes followed by the encoded fields — the budget (each class memoized), the
    provider payload and the request — so none of them is copied into protobuf objects,
    parsed or serialized again. Interceptors read it like the message: every field comes
    from the head, except the encoded ones, read from the message parsed on first access."""

    __slots__ = ("_head", "_message", "_request", "_tail")

    def __init__(
        self,
        head: pb.BuildResponse,
        request: Sequence[bytes] | None,
        *,
        budget: Sequence[ClassUsage] = (),
        payload: bytes = b"",
    ) -> None:
        """`request`: the ModelRequest's bytes, in pieces (request_pieces), or None."""
        self._head = head
        tail = _budget_field.many(budget)
        if payload:
            tail += [_field_head(_PROVIDER_PAYLOAD, len(payload)), payload]
        if request is not None:
            tail += [_field_head(_REQUEST, sum(map(len, request))), *request]
        self._request = request is not None
        self._tail = tail  # joined once, with the head, when sent
        self._message: pb.BuildResponse | None = None

    def SerializeToString(self, deterministic: bool = False) -> bytes:
        head = cast(bytes, self._head.SerializeToString(deterministic=deterministic))
        return b"".join([head, *self._tail])

    def to_message(self) -> pb.BuildResponse:
        """The equivalent protobuf message (parsed from the bytes)."""
        if self._message is None:
            self._message = pb.BuildResponse.FromString(self.SerializeToString())
        return self._message

    def HasField(self, name: str) -> bool:
        return self._request if name == "request" else self._head.HasField(name)

    def __getattr__(self, name: str) -> Any:
        if name in _ENCODED:
            return getattr(self.to_message(), name)
        return getattr(self._head, name)


def request_message(request: ModelRequest) -> pb.ModelRequest:
    """The protobuf ModelRequest of `request`, equal to convert.request_to_proto's."""
    return cast(pb.ModelRequest, pb.ModelRequest.FromString(request_bytes(request)))


def request_bytes(request: ModelRequest) -> bytes:
    """`request` serialized as a protobuf ModelRequest (request_pieces joined)."""
    return b"".join(request_pieces(request))


def request_pieces(request: ModelRequest) -> list[bytes]:
    """`request` serialized as a protobuf ModelRequest, in memoized pieces: the plan's
    system blocks and tools (the same tuples on every Build of an epoch), each message (a
    run's carried messages are the same objects on every Build) and the repeated run of
    them (ModelRequest.repeated), joined once per run."""
    head = _head(
        request.provider,
        request.model_id,
        request.cache_breakpoints,
        request.max_output_tokens,
        request.session_key,
    )
    return [
        head,
        _system_fields(request.system),
        _tool_fields(request.tools),
        *with_repeated_run(request, _message_field.many, _run_fields),
    ]


# A run's Builds repeat the request's scalar fields and cache markers (frozen values).
@bounded_cache(4096)
def _head(
    provider: str,
    model_id: str,
    breakpoints: tuple[CacheBreakpoint, ...],
    max_output_tokens: int,
    session_key: str,
) -> bytes:
    head = pb.ModelRequest(
        provider=convert.provider_to_proto(provider),
        model_id=model_id,
        cache_breakpoints=[convert.breakpoint_to_proto(b) for b in breakpoints],
        max_output_tokens=max_output_tokens,
        session_key=session_key,
    )
    return cast(bytes, head.SerializeToString())


def field(number: int, payload: bytes) -> bytes:
    """A length-delimited field: tag, length, payload. Appended to a serialized message,
    it sets (or, repeated, appends to) that field: the encoding puts no order on fields."""
    return _field_head(number, len(payload)) + payload


def _field_head(number: int, length: int) -> bytes:
    """A length-delimited field's tag and length, for a payload sent as pieces after it."""
    return _varint(number << 3 | _LENGTH_DELIMITED) + _varint(length)


def _message_field_bytes(message: Message) -> bytes:
    """ModelRequest.messages[i], tag and length included."""
    body = _ROLE_FIELD[message.role] + b"".join(_block_field.many(message.blocks))
    return field(_MESSAGES, body)


def _system_bytes(blocks: tuple[Block, ...]) -> bytes:
    return b"".join(field(_SYSTEM, _block(b)) for b in blocks)


def _tool_bytes(tools: tuple[ToolDefinition, ...]) -> bytes:
    return b"".join(field(_TOOLS, _tool(t)) for t in tools)


_ROLE_FIELD = {
    role: bytes([_ROLE << 3 | _LENGTH_DELIMITED, len(role)]) + role.encode("ascii")
    for role in ("user", "assistant")
}


def _block_bytes(block: Block) -> bytes:
    return cast(bytes, convert.block_to_proto(block).SerializeToString())


# A run's history blocks and messages are the same objects on every Build, and a plan's
# system blocks and tools the same tuples (core/identity_memo.py). A message that misses
# (one merged where the run's items meet the carried ones) is composed from block memos
# rather than hashed whole.
_block = IdentityMemo(_block_bytes)
_block_field: IdentityMemo[Block, bytes] = IdentityMemo(lambda block: field(_BLOCKS, _block(block)))
_message_field = IdentityMemo(_message_field_bytes, by_value=False)
# The interior of a run's carried suffix is one tuple on every Build (ModelRequest.repeated).
_run_fields: RecentMemo[tuple[Message, ...], bytes] = RecentMemo(
    lambda run: b"".join(_message_field.many(run))
)
_system_fields = IdentityMemo(_system_bytes, 256)
_tool_fields = IdentityMemo(_tool_bytes, 256)


# A plan's prefix classes are the same objects on every Build, and so are the body classes
# of equal figures (core/pressure.py memoizes them).
_budget_field: IdentityMemo[ClassUsage, bytes] = IdentityMemo(
    lambda usage: field(_BUDGET, convert.class_usage_to_proto(usage).SerializeToString()), 4096
)


@bounded_cache(1024)
def _tool(tool: ToolDefinition) -> bytes:
    return cast(bytes, convert.tool_to_proto(tool).SerializeToString())


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)
