"""ModelRequest -> protobuf, composed from memoized wire bytes.

`convert.request_to_proto` builds the message field by field; a fifty-turn request is two
hundred content blocks, and building each as a Python protobuf object on every Build costs
more than the rest of the response. A block is a frozen value that repeats on every Build
of a run (and a plan's system blocks and tools on every Build of a session), so each is
serialized once per process and a request's bytes are the concatenation the protobuf
encoding defines for repeated fields: a serialized message followed by more fields of the
same message merges into it, and repeated fields append. The result is parsed once (in C)
into the message the response carries. tests/unit/test_wire.py checks it equals
`convert.request_to_proto` on generated requests.
"""

from __future__ import annotations

from functools import lru_cache

from .._gen.context_engine.v1 import context_engine_pb2 as pb
from ..core.identity_memo import IdentityMemo
from ..core.request import Block, Message, ModelRequest, ToolDefinition
from . import convert

__all__ = ["request_message"]

# ModelRequest and Message field numbers (proto/context_engine/v1/context_engine.proto).
_SYSTEM, _TOOLS, _MESSAGES = 3, 4, 5
_ROLE, _BLOCKS = 1, 2
_LENGTH_DELIMITED = 2


def request_message(request: ModelRequest) -> pb.ModelRequest:
    """The protobuf ModelRequest of `request`, equal to convert.request_to_proto's."""
    head = pb.ModelRequest(
        provider=convert.provider_to_proto(request.provider),
        model_id=request.model_id,
        cache_breakpoints=[convert.breakpoint_to_proto(b) for b in request.cache_breakpoints],
        max_output_tokens=request.max_output_tokens,
        session_key=request.session_key,
    )
    data = b"".join(
        (
            head.SerializeToString(),
            *(_field(_SYSTEM, _block(b)) for b in request.system),
            *(_field(_TOOLS, _tool(t)) for t in request.tools),
            *(_message_field(m) for m in request.messages),
        )
    )
    return pb.ModelRequest.FromString(data)


def _message_field(message: Message) -> bytes:
    """ModelRequest.messages[i], tag and length included."""
    body = _ROLE_FIELD[message.role] + b"".join(_block_field(b) for b in message.blocks)
    return _field(_MESSAGES, body)


_ROLE_FIELD = {
    role: bytes([_ROLE << 3 | _LENGTH_DELIMITED, len(role)]) + role.encode("ascii")
    for role in ("user", "assistant")
}


def _block_bytes(block: Block) -> bytes:
    return convert.block_to_proto(block).SerializeToString()


# A run's history blocks are the same objects on every Build (core/identity_memo.py).
_block = IdentityMemo(_block_bytes)
_block_field = IdentityMemo(lambda block: _field(_BLOCKS, _block(block)))


@lru_cache(maxsize=1024)
def _tool(tool: ToolDefinition) -> bytes:
    return convert.tool_to_proto(tool).SerializeToString()


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited field: tag, length, payload."""
    return _varint(number << 3 | _LENGTH_DELIMITED) + _varint(len(payload)) + payload


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)
