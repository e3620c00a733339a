"""The provider-neutral ModelRequest that Build returns.

Plain frozen dataclasses (not pydantic): they are built on every request and validated by
construction in assemble.py.

Rule 1 (the request's hash): `request_sha256()` is the SHA-256 of the RFC 8785 bytes of
`hashed()`: the request's canonical form with its messages, its system blocks and its
tools each replaced by the SHA-256 of their canonical bytes (`messages_sha256`: the
messages array's). Hashed whole (`canonical_sha256`, what context-assembler@6 and older
recorded), the canonical request put every byte of every Build through SHA-256 (about
45 us per 80 kB here), growing with the window; in parts, the messages' hashing resumes
after a run's carried interior (ModelRequest.repeated) from the state kept for it, and a
plan's system blocks and tools are hashed once per object, so a Build hashes the head and
tail of its messages and a few hundred bytes more.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from operator import is_
from typing import Any, Literal, TypeVar

from .canonical import canonical_bytes, comma_separated
from .identity_memo import IdentityMemo, RecentMemo
from .memo_budget import bounded_cache
from .rows import Row
from .trust import TrustLevel

__all__ = [
    "Block",
    "CacheBreakpoint",
    "Message",
    "ModelRequest",
    "RepeatedRun",
    "ToolDefinition",
    "repeated_run",
    "with_repeated_run",
]

BlockKind = Literal["text", "tool_call", "tool_result", "reasoning"]


@dataclass(frozen=True, slots=True)
class Block:
    row: Row
    trust: TrustLevel
    kind: BlockKind
    item_id: str = ""
    source_sequence: int = 0
    text: str = ""  # text; for a tool result, its enveloped content
    call_id: str = ""
    tool_name: str = ""
    arguments_json: str = ""
    is_error: bool = False
    artifact_ref: str = ""
    provider: str = ""  # reasoning only
    opaque: str = ""  # reasoning only
    # Tool calls and results only: the run that logged the item. Call ids are unique within
    # a run, so a pair is keyed by (run_id, call_id) (core/validate.py, providers/call_ids.py).
    run_id: str = ""
    # Assistant text and tool calls: the provider's id of the output item, as logged
    # (OpenAI sends it only beside its reasoning: providers/openai.py, Rule 4).
    provider_item_id: str = ""

    def canonical(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "row": int(self.row),
            "trust": self.trust.name,
            "kind": self.kind,
            "item_id": self.item_id,
            "source_sequence": self.source_sequence,
        }
        extra = {
            "text": self.text,
            "call_id": self.call_id,
            "tool_name": self.tool_name,
            "arguments_json": self.arguments_json,
            "artifact_ref": self.artifact_ref,
            "provider": self.provider,
            "opaque": self.opaque,
            "provider_item_id": self.provider_item_id,
        }
        # run_id is not hashed. It decides a pair's wire id only when two runs reuse a call
        # id, and then the blocks' order fixes which keeps it (providers/call_ids.py), so
        # the bytes sent are a function of what is hashed; leaving it out keeps the
        # request_sha256 of every request recorded before blocks carried it, which GetBuild
        # checks its rebuild against.
        out.update({k: v for k, v in extra.items() if v})
        if self.is_error:
            out["is_error"] = True
        return out


@dataclass(frozen=True, slots=True)
class Message:
    role: Literal["user", "assistant"]
    blocks: tuple[Block, ...]

    def canonical(self) -> dict[str, Any]:
        return {"role": self.role, "blocks": [b.canonical() for b in self.blocks]}


@dataclass(frozen=True, slots=True)
class ToolDefinition:
    name: str
    description: str
    input_schema_json: str

    def canonical(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "description": self.description,
            "input_schema_json": self.input_schema_json,
        }


@dataclass(frozen=True, slots=True)
class CacheBreakpoint:
    name: str
    through_item: str
    ttl: str = "5m"
    priority: int = 0
    through_input_item: str = ""
    # The session sequence of the item through_item names (its blocks' source_sequence);
    # 0 where there is none (Region A, an item not in the log). Item ids are unique within
    # a run only and a request carries earlier runs, so the id alone can name two items.
    through_sequence: int = 0

    def canonical(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.name,
            "through_item": self.through_item,
            "through_input_item": self.through_input_item,
            "ttl": self.ttl,
            "priority": self.priority,
        }
        # Only where there is one: a marker without it is the one context-assembler@7 and
        # older sent, byte for byte (their records are checked by its hash).
        if self.through_sequence:
            out["through_sequence"] = self.through_sequence
        return out


@dataclass(frozen=True, slots=True)
class RepeatedRun:
    """`run` is `messages[start:start + len(run)]`, message for message the same objects
    (checked when it is made), and one tuple on every Build that carries it: the interior
    of a run's carried suffix (core/carried.py Retained.interior). It holds for a request
    whose messages are `messages` itself (repeated_run): a request rebuilt with other
    messages (dataclasses.replace) keeps the hint, and the hint then holds for nothing."""

    messages: tuple[Message, ...]
    start: int
    run: tuple[Message, ...]

    def __post_init__(self) -> None:
        carried = self.messages[self.start : self.start + len(self.run)] if self.start >= 0 else ()
        if len(carried) != len(self.run) or not all(map(is_, carried, self.run)):
            raise ValueError("a repeated run must be the very messages at its place")


@dataclass(frozen=True, slots=True)
class ModelRequest:
    provider: str
    model_id: str
    system: tuple[Block, ...]
    tools: tuple[ToolDefinition, ...]
    messages: tuple[Message, ...]
    max_output_tokens: int
    session_key: str
    cache_breakpoints: tuple[CacheBreakpoint, ...] = field(default=())
    # A rendering hint, never hashed nor compared: a run of this request's messages that
    # repeats, as one tuple object, on every Build of a run (RepeatedRun). Serializers
    # render it as one fragment memoized on the tuple (with_repeated_run), so a Build's
    # serializing does not grow with the history; without it they render message by
    # message, to the same bytes.
    repeated: RepeatedRun | None = field(default=None, compare=False)

    def canonical_bytes(self) -> bytes:
        """RFC 8785 bytes of `canonical()`, composed from memoized per-block fragments.

        Equal to `canonical_bytes(self.canonical())` (tests/unit/test_canonical.py checks
        it): keys in sorted order, each block serialized canonically once per process.
        """
        return b"".join(self._canonical_chunks())

    def request_sha256(self) -> str:
        """Rule 1: sha256_hex(canonical_bytes(self.hashed())), from memoized parts."""
        return hashlib.sha256(
            b"".join(
                (
                    b'{"cache_breakpoints":',
                    _json(self.cache_breakpoints),
                    b',"max_output_tokens":',
                    str(self.max_output_tokens).encode("ascii"),
                    b',"messages_sha256":"',
                    _messages_digest(self),
                    b'","model_id":',
                    _string(self.model_id),
                    b',"provider":',
                    _string(self.provider),
                    b',"session_key":',
                    _string(self.session_key),
                    b',"system_sha256":"',
                    _values_digest(self.system),
                    b'","tools_sha256":"',
                    _values_digest(self.tools),
                    b'"}',
                )
            )
        ).hexdigest()

    def hashed(self) -> dict[str, Any]:
        """What request_sha256 hashes (Rule 1), as a JSON value."""
        canonical = self.canonical()

        def digest(value: Any) -> str:
            return hashlib.sha256(canonical_bytes(value)).hexdigest()

        return {
            "cache_breakpoints": canonical["cache_breakpoints"],
            "max_output_tokens": self.max_output_tokens,
            "messages_sha256": digest(canonical["messages"]),
            "model_id": self.model_id,
            "provider": self.provider,
            "session_key": self.session_key,
            "system_sha256": digest(canonical["system"]),
            "tools_sha256": digest(canonical["tools"]),
        }

    def canonical_sha256(self) -> str:
        """sha256_hex(self.canonical_bytes()), hashed chunk by chunk: the request's bytes,
        tens of kilobytes, are never joined just to be hashed. What context-assembler@6 and
        older recorded as request_sha256 (GetBuild checks their records by it)."""
        digest = hashlib.sha256()
        for chunk in self._canonical_chunks():
            digest.update(chunk)
        return digest.hexdigest()

    def _canonical_chunks(self) -> list[bytes]:
        """canonical_bytes() in order, in pieces: keys sorted, messages comma-separated."""
        messages = with_repeated_run(self, _message_json.many, _run_json)
        return [
            b'{"cache_breakpoints":',
            _json(self.cache_breakpoints),
            b',"max_output_tokens":',
            str(self.max_output_tokens).encode("ascii"),
            b',"messages":[',
            *comma_separated(messages, b","),
            b'],"model_id":',
            _string(self.model_id),
            b',"provider":',
            _string(self.provider),
            b',"session_key":',
            _string(self.session_key),
            b',"system":',
            _json(self.system),
            b',"tools":',
            _json(self.tools),
            b"}",
        ]

    def canonical(self) -> dict[str, Any]:
        return {
            "provider": self.provider,
            "model_id": self.model_id,
            "system": [b.canonical() for b in self.system],
            "tools": [t.canonical() for t in self.tools],
            "messages": [m.canonical() for m in self.messages],
            "cache_breakpoints": [c.canonical() for c in self.cache_breakpoints],
            "max_output_tokens": self.max_output_tokens,
            "session_key": self.session_key,
        }


# Memoized fragments of canonical_bytes: blocks, breakpoints and tools are frozen values,
# so their canonical text never changes; a plan's system blocks and tools repeat on every
# request of the session, and a run's history blocks on every step.
_FRAGMENTS = 16_384


def _block_text(block: Block) -> bytes:
    return canonical_bytes(block.canonical())


_block_json = IdentityMemo(_block_text, _FRAGMENTS)


def _message_text(message: Message) -> bytes:
    blocks = b",".join(_block_json.many(message.blocks))
    return b'{"blocks":[' + blocks + b'],"role":' + _string(message.role) + b"}"


# A run's carried messages are the same objects on every Build (core/carried.py).
_message_json = IdentityMemo(_message_text, _FRAGMENTS)
# ...and the interior of its carried suffix the same tuple (ModelRequest.repeated).
_run_json: RecentMemo[tuple[Message, ...], bytes] = RecentMemo(
    lambda run: b",".join(_message_json.many(run))
)


def _values_text(values: tuple[Block | ToolDefinition | CacheBreakpoint, ...]) -> bytes:
    return canonical_bytes([v.canonical() for v in values])


# A plan's system blocks and tools are the same tuples on every Build (core/assemble.py);
# hashing a tuple rehashes every member, so identity answers first.
_json = IdentityMemo(_values_text, 256)


def _hex_sha256(text: bytes) -> bytes:
    return hashlib.sha256(text).hexdigest().encode("ascii")


# Rule 1: a plan's system blocks' and tools' digests, once per tuple.
_values_digest: IdentityMemo[tuple[Block | ToolDefinition, ...], bytes] = IdentityMemo(
    lambda values: _hex_sha256(_json(values)), 256
)

# Per carried interior (ModelRequest.repeated), the SHA-256 of the messages array's
# bytes up to the interior's end, for as many different heads before it (by the head's
# digest). The interior is tens of kilobytes and the same tuple on every Build of a run;
# what comes before it is a message or two.
_STATES_PER_RUN = 4
_run_states: RecentMemo[tuple[Message, ...], dict[bytes, Any]] = RecentMemo(lambda run: {})


def _messages_digest(request: ModelRequest) -> bytes:
    """The hex SHA-256 of the canonical messages array (Rule 1), resuming after the
    request's repeated run where it has one."""
    hint = repeated_run(request)
    if hint is None:
        digest = hashlib.sha256(b"[")
        for piece in comma_separated(_message_json.many(request.messages), b","):
            digest.update(piece)
        digest.update(b"]")
        return digest.hexdigest().encode("ascii")
    head = _message_json.many(request.messages[: hint.start])
    opening = b"[" + b"".join(piece + b"," for piece in head)
    states = _run_states(hint.run)
    key = hashlib.sha256(opening).digest()
    state = states.get(key)
    if state is None:
        state = hashlib.sha256(opening)
        state.update(_run_json(hint.run))
        if len(states) >= _STATES_PER_RUN:
            states.clear()
        states[key] = state  # never updated once kept: each Build copies it
    digest = state.copy()
    for piece in _message_json.many(request.messages[hint.start + len(hint.run) :]):
        digest.update(b"," + piece)
    digest.update(b"]")
    return digest.hexdigest().encode("ascii")


@bounded_cache(1024)
def _string(value: str) -> bytes:
    return canonical_bytes(value)


F = TypeVar("F")


def repeated_run(request: ModelRequest) -> RepeatedRun | None:
    """The request's repeated run where it holds: not empty, and made for these very
    messages (RepeatedRun); None otherwise."""
    hint = request.repeated
    if hint is None or not hint.run or hint.messages is not request.messages:
        return None
    return hint


def with_repeated_run(
    request: ModelRequest,
    each: Callable[[Sequence[Message]], list[F]],
    run: Callable[[tuple[Message, ...]], F],
) -> list[F]:
    """`each(request.messages)`, a fragment per message, except that the repeated run
    (repeated_run) is one fragment, `run(the run)`: the fragments joined give the same
    bytes when `run(r)` is the join of `each(r)`."""
    messages, hint = request.messages, repeated_run(request)
    if hint is None:
        return each(messages)
    end = hint.start + len(hint.run)
    return [*each(messages[: hint.start]), run(hint.run), *each(messages[end:])]
