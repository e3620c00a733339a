"""Scripted replies: what the fake "model" answers next.

Contract:
- Replies are provider-neutral (``Reply``); each API module renders them in its own shape
  (Anthropic ``text``/``tool_use``/``thinking`` blocks, OpenAI ``message``/``function_call``/
  ``reasoning`` items).
- The queue is FIFO. A reply may be pinned to one provider (``"anthropic"`` or ``"openai"``);
  a request takes the first queued reply that is unpinned or pinned to its provider.
- An empty queue answers ``DEFAULT_REPLY`` (the text ``"ok"``).
- Only requests that pass validation consume a reply; an ``error`` reply is returned as that
  provider's error JSON and touches no cache.
- Over HTTP, ``POST /_fake/script`` takes one reply object or a list of them, in the JSON
  shape of ``Reply.from_json``.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["DEFAULT_REPLY", "PROVIDERS", "ErrorReply", "Reply", "Script", "ScriptError", "ToolCall"]

PROVIDERS = ("anthropic", "openai")


class ScriptError(ValueError):
    """A scripted reply is malformed."""


@dataclass(frozen=True)
class ToolCall:
    """A tool call the model makes. ``id`` becomes the Anthropic ``tool_use.id`` or the
    OpenAI ``call_id``; when omitted a deterministic one is generated."""

    name: str
    arguments: Mapping[str, Any] = field(default_factory=dict)
    id: str | None = None


@dataclass(frozen=True)
class ErrorReply:
    """An API error instead of a reply; ``type`` defaults from the provider's status table."""

    status: int
    message: str
    type: str | None = None


@dataclass(frozen=True)
class Reply:
    """One model turn: optional thinking/reasoning text, optional text, tool calls, or an
    error. ``provider`` pins the reply to one provider's endpoint."""

    text: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    thinking: str | None = None
    error: ErrorReply | None = None
    provider: str | None = None

    def __post_init__(self) -> None:
        if self.provider is not None and self.provider not in PROVIDERS:
            raise ScriptError(f"provider must be one of {PROVIDERS}, got {self.provider!r}")
        if self.error is None and self.text is None and not self.tool_calls:
            raise ScriptError("a reply needs text, tool_calls or error")

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> Reply:
        """Build from ``{"text"?, "thinking"?, "tool_calls"?: [{"name", "arguments"?,
        "id"?}], "error"?: {"status", "message", "type"?}, "provider"?}``."""
        if not isinstance(obj, Mapping):
            raise ScriptError("a scripted reply must be a JSON object")
        unknown = set(obj) - {"text", "thinking", "tool_calls", "error", "provider"}
        if unknown:
            raise ScriptError(f"unknown reply fields: {sorted(unknown)}")
        calls = []
        for raw in obj.get("tool_calls") or ():
            if not isinstance(raw, Mapping) or not isinstance(raw.get("name"), str):
                raise ScriptError("each tool call needs a string 'name'")
            arguments = raw.get("arguments", {})
            if not isinstance(arguments, Mapping):
                raise ScriptError("tool call 'arguments' must be an object")
            calls.append(ToolCall(name=raw["name"], arguments=dict(arguments), id=raw.get("id")))
        error = None
        if obj.get("error") is not None:
            raw_error = obj["error"]
            if not isinstance(raw_error, Mapping) or not isinstance(raw_error.get("status"), int):
                raise ScriptError("'error' needs an integer 'status'")
            error = ErrorReply(
                status=raw_error["status"],
                message=str(raw_error.get("message", "scripted error")),
                type=raw_error.get("type"),
            )
        return cls(
            text=obj.get("text"),
            tool_calls=tuple(calls),
            thinking=obj.get("thinking"),
            error=error,
            provider=obj.get("provider"),
        )


DEFAULT_REPLY = Reply(text="ok")


class Script:
    """Thread-safe FIFO of scripted replies (see module docstring)."""

    def __init__(self) -> None:
        self._queue: deque[Reply] = deque()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._queue)

    def push(self, reply: Reply | str | Mapping[str, Any], *, provider: str | None = None) -> Reply:
        """Queue a ``Reply``, a plain text, or a ``Reply.from_json`` object."""
        if isinstance(reply, str):
            reply = Reply(text=reply, provider=provider)
        elif not isinstance(reply, Reply):
            reply = Reply.from_json({**reply, **({"provider": provider} if provider else {})})
        elif provider is not None:
            reply = Reply(reply.text, reply.tool_calls, reply.thinking, reply.error, provider)
        with self._lock:
            self._queue.append(reply)
        return reply

    def push_many(self, replies: Iterable[Reply | str | Mapping[str, Any]]) -> int:
        count = 0
        for reply in replies:
            self.push(reply)
            count += 1
        return count

    def push_text(self, text: str, *, provider: str | None = None) -> Reply:
        return self.push(Reply(text=text, provider=provider))

    def push_tool_call(
        self,
        name: str,
        arguments: Mapping[str, Any] | None = None,
        *,
        id: str | None = None,
        text: str | None = None,
        thinking: str | None = None,
        provider: str | None = None,
    ) -> Reply:
        """Queue one tool call (optionally preceded by text and thinking)."""
        call = ToolCall(name=name, arguments=dict(arguments or {}), id=id)
        return self.push(Reply(text=text, tool_calls=(call,), thinking=thinking, provider=provider))

    def push_error(
        self, status: int, message: str, *, type: str | None = None, provider: str | None = None
    ) -> Reply:
        return self.push(Reply(error=ErrorReply(status, message, type), provider=provider))

    def pop(self, provider: str) -> Reply:
        """Take the next reply for ``provider``, or ``DEFAULT_REPLY``."""
        with self._lock:
            for i, reply in enumerate(self._queue):
                if reply.provider in (None, provider):
                    del self._queue[i]
                    return reply
        return DEFAULT_REPLY

    def clear(self) -> None:
        with self._lock:
            self._queue.clear()
