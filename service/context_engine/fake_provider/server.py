"""The fake provider: one loopback HTTP server answering Anthropic and OpenAI shapes.

Contract:
- ``FakeProvider(clock=...)`` holds all state: both prompt caches, the reply script, the
  request log and the id counters. ``clock`` returns seconds; every TTL is judged against
  it, so tests advance a ``ManualClock`` instead of sleeping.
- ``start(host, port)`` binds a loopback address only (127.0.0.0/8 or ``localhost``) and
  returns the base URL; ``stop()`` is idempotent. ``with FakeProvider() as fake:`` starts
  and stops it.
- ``handle(method, path, headers, body)`` is the transport-free dispatcher the HTTP handler
  calls; requests are processed one at a time under a lock, so ids and cache state are
  deterministic for a deterministic client.

Routes (``ROUTES``):
  POST /v1/messages, /messages                 Anthropic Messages API
  POST /v1/messages/count_tokens               Anthropic token counting (no cache effect)
  POST /v1/responses, /responses               OpenAI Responses API
  POST /_fake/script                           queue replies (``Reply.from_json`` objects)
  GET  /_fake/stats[?include=request]          request log with per-request cache usage
  POST /_fake/reset                            clear caches, script, log and id counters
"""

from __future__ import annotations

import ipaddress
import json
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from . import anthropic_api, openai_api
from .cache import AnthropicCacheResult, AnthropicPromptCache, OpenAIPromptCache
from .errors import FakeApiError
from .ids import IdFactory
from .script import Reply, Script, ScriptError

__all__ = ["ROUTES", "FakeProvider", "RequestRecord"]

Clock = Callable[[], float]
Response = tuple[int, dict[str, str], bytes]

ROUTES: dict[tuple[str, str], str] = {
    ("POST", "/v1/messages"): "_anthropic_messages",
    ("POST", "/messages"): "_anthropic_messages",
    ("POST", "/v1/messages/count_tokens"): "_anthropic_count_tokens",
    ("POST", "/messages/count_tokens"): "_anthropic_count_tokens",
    ("POST", "/v1/responses"): "_openai_responses",
    ("POST", "/responses"): "_openai_responses",
    ("POST", "/_fake/script"): "_fake_script",
    ("GET", "/_fake/stats"): "_fake_stats",
    ("POST", "/_fake/reset"): "_fake_reset",
}


@dataclass
class RequestRecord:
    """One provider request as the fake saw it.

    ``cache`` is provider-neutral: ``total_input_tokens``, ``cache_read_tokens``,
    ``cache_write_tokens`` and ``uncached_tokens``; Anthropic adds the 5m/1h split and the
    block paths of the hit, the writes and the breakpoints ignored as too short.
    """

    seq: int
    provider: str
    endpoint: str
    status: int
    time: float
    request_id: str
    model: str | None = None
    response_id: str | None = None
    prompt_cache_key: str | None = None
    usage: dict[str, Any] | None = None
    cache: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    request: Any = field(default=None, repr=False)

    def to_json(self, *, include_request: bool = False) -> dict[str, Any]:
        out = {
            "seq": self.seq,
            "provider": self.provider,
            "endpoint": self.endpoint,
            "status": self.status,
            "time": self.time,
            "request_id": self.request_id,
            "model": self.model,
            "response_id": self.response_id,
            "prompt_cache_key": self.prompt_cache_key,
            "usage": self.usage,
            "cache": self.cache,
            "error": self.error,
        }
        if include_request:
            out["request"] = self.request
        return out


class FakeProvider:
    """In-process fake of the Anthropic Messages and OpenAI Responses APIs."""

    def __init__(self, clock: Clock = time.time) -> None:
        self.clock = clock
        self.script = Script()
        self.anthropic_cache = AnthropicPromptCache()
        self.openai_cache = OpenAIPromptCache()
        self._ids = IdFactory()
        self._records: list[RequestRecord] = []
        self._lock = threading.RLock()
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self._base_url: str | None = None

    # --- lifecycle -----------------------------------------------------------------------

    @property
    def base_url(self) -> str:
        if self._base_url is None:
            raise RuntimeError("the fake provider is not started")
        return self._base_url

    def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Serve on a loopback address in a daemon thread; return ``http://host:port``."""
        if self._server is not None:
            return self.base_url
        address = "127.0.0.1" if host == "localhost" else host
        try:
            loopback = ipaddress.ip_address(address).is_loopback
        except ValueError:
            loopback = False
        if not loopback or ":" in address:
            raise ValueError(f"the fake provider binds IPv4 loopback only, not {host!r}")
        server = _Server((address, port), _Handler)
        server.provider = self
        self._server = server
        bound_port = server.server_address[1]
        self._base_url = f"http://{address}:{bound_port}"
        self._thread = threading.Thread(
            target=server.serve_forever,
            kwargs={"poll_interval": 0.05},
            name=f"fake-provider-{bound_port}",
            daemon=True,
        )
        self._thread.start()
        return self._base_url

    def stop(self) -> None:
        server, thread = self._server, self._thread
        self._server = self._thread = self._base_url = None
        if server is not None:
            server.shutdown()
            server.server_close()
        if thread is not None:
            thread.join(timeout=5)

    def __enter__(self) -> FakeProvider:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- inspection ----------------------------------------------------------------------

    @property
    def requests(self) -> list[RequestRecord]:
        """A copy of the request log, oldest first."""
        with self._lock:
            return list(self._records)

    def stats(self, *, include_request: bool = False) -> dict[str, Any]:
        """What ``GET /_fake/stats`` returns."""
        with self._lock:
            return {
                "requests": [r.to_json(include_request=include_request) for r in self._records],
                "pending_replies": len(self.script),
                "cache_entries": {
                    "anthropic": len(self.anthropic_cache),
                    "openai": len(self.openai_cache),
                },
            }

    def reset(self) -> None:
        """Forget caches, queued replies, the request log and id counters."""
        with self._lock:
            self.anthropic_cache.clear()
            self.openai_cache.clear()
            self.script.clear()
            self._records.clear()
            self._ids.reset()

    # --- dispatch ------------------------------------------------------------------------

    def handle(self, method: str, path: str, headers: Mapping[str, str], body: bytes) -> Response:
        """Answer one HTTP request; ``headers`` keys are lower-case."""
        parts = urlsplit(path)
        handler_name = ROUTES.get((method, parts.path.rstrip("/") or "/"))
        with self._lock:
            if handler_name is None:
                return self._not_found(method, parts.path)
            handler: Callable[[Mapping[str, str], bytes, dict[str, list[str]]], Response]
            handler = getattr(self, handler_name)
            return handler(headers, body, parse_qs(parts.query))

    def _record(self, **fields: Any) -> RequestRecord:
        record = RequestRecord(seq=len(self._records) + 1, **fields)
        self._records.append(record)
        return record

    def _anthropic_messages(
        self, headers: Mapping[str, str], body: bytes, _query: dict[str, list[str]]
    ) -> Response:
        request_id = self._ids.next("req")
        now = self.clock()
        parsed = _loads(body)
        common = {"provider": "anthropic", "endpoint": "messages", "time": now}
        try:
            if isinstance(parsed, FakeApiError):
                raise parsed
            request = anthropic_api.parse_request(parsed, headers)
            reply = self.script.pop("anthropic")
            if reply.error is not None:
                raise FakeApiError(reply.error.status, reply.error.message, type=reply.error.type)
            result = self.anthropic_cache.apply(
                request.model, request.blocks, messages_salt=request.messages_salt, now=now
            )
            message = anthropic_api.render_message(request, reply, result, self._ids)
        except FakeApiError as error:
            payload = anthropic_api.error_body(error, request_id)
            self._record(
                status=error.status,
                request_id=request_id,
                model=_model_of(parsed),
                error=payload["error"],
                request=parsed if not isinstance(parsed, FakeApiError) else None,
                **common,
            )
            return _json(error.status, payload, {"request-id": request_id})
        self._record(
            status=200,
            request_id=request_id,
            model=request.model,
            response_id=message["id"],
            usage=message["usage"],
            cache=_anthropic_cache_json(request, result),
            request=parsed,
            **common,
        )
        return _json(200, message, {"request-id": request_id})

    def _anthropic_count_tokens(
        self, headers: Mapping[str, str], body: bytes, _query: dict[str, list[str]]
    ) -> Response:
        request_id = self._ids.next("req")
        parsed = _loads(body)
        try:
            if isinstance(parsed, FakeApiError):
                raise parsed
            request = anthropic_api.parse_request(parsed, headers, count_only=True)
        except FakeApiError as error:
            return _json(
                error.status,
                anthropic_api.error_body(error, request_id),
                {"request-id": request_id},
            )
        return _json(200, {"input_tokens": request.input_tokens}, {"request-id": request_id})

    def _openai_responses(
        self, headers: Mapping[str, str], body: bytes, _query: dict[str, list[str]]
    ) -> Response:
        request_id = self._ids.next("req")
        now = self.clock()
        parsed = _loads(body)
        common = {"provider": "openai", "endpoint": "responses", "time": now}
        try:
            if isinstance(parsed, FakeApiError):
                raise parsed
            request = openai_api.parse_request(parsed, headers)
            reply = self.script.pop("openai")
            if reply.error is not None:
                raise FakeApiError(reply.error.status, reply.error.message, type=reply.error.type)
            result = self.openai_cache.apply(
                request.model,
                request.prompt_cache_key,
                request.units,
                retention=request.retention,
                now=now,
            )
            response = openai_api.render_response(request, reply, result, self._ids, now)
        except FakeApiError as error:
            payload = openai_api.error_body(error)
            self._record(
                status=error.status,
                request_id=request_id,
                model=_model_of(parsed),
                error=payload["error"],
                request=parsed if not isinstance(parsed, FakeApiError) else None,
                **common,
            )
            return _json(error.status, payload, {"x-request-id": request_id})
        self._record(
            status=200,
            request_id=request_id,
            model=request.model,
            response_id=response["id"],
            prompt_cache_key=request.prompt_cache_key,
            usage=response["usage"],
            cache={
                "total_input_tokens": result.total_tokens,
                "cache_read_tokens": result.cached_tokens,
                "cache_write_tokens": 0,
                "uncached_tokens": result.total_tokens - result.cached_tokens,
            },
            request=parsed,
            **common,
        )
        return _json(200, response, {"x-request-id": request_id})

    def _fake_script(
        self, _headers: Mapping[str, str], body: bytes, _query: dict[str, list[str]]
    ) -> Response:
        parsed = _loads(body)
        if isinstance(parsed, dict) and "replies" in parsed:
            parsed = parsed["replies"]
        replies = parsed if isinstance(parsed, list) else [parsed]
        try:
            if any(not isinstance(r, dict) for r in replies):
                raise ScriptError("each scripted reply must be a JSON object")
            built = [Reply.from_json(r) for r in replies]
        except ScriptError as error:
            return _json(400, {"error": str(error)})
        self.script.push_many(built)
        return _json(200, {"queued": len(built), "pending_replies": len(self.script)})

    def _fake_stats(
        self, _headers: Mapping[str, str], _body: bytes, query: dict[str, list[str]]
    ) -> Response:
        include = "request" in query.get("include", [])
        return _json(200, self.stats(include_request=include))

    def _fake_reset(
        self, _headers: Mapping[str, str], _body: bytes, _query: dict[str, list[str]]
    ) -> Response:
        self.reset()
        return _json(200, {"reset": True})

    def _not_found(self, method: str, path: str) -> Response:
        message = f"Not found: {method} {path}"
        if "messages" in path:
            request_id = self._ids.next("req")
            error = FakeApiError(404, message, type="not_found_error")
            return _json(404, anthropic_api.error_body(error, request_id))
        return _json(404, openai_api.error_body(FakeApiError(404, message)))


def _loads(body: bytes) -> Any:
    try:
        return json.loads(body or b"null")
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        return FakeApiError(400, f"Request body is not valid JSON: {exc}")


def _model_of(parsed: Any) -> str | None:
    model = parsed.get("model") if isinstance(parsed, dict) else None
    return model if isinstance(model, str) else None


def _anthropic_cache_json(
    request: anthropic_api.MessagesRequest, result: AnthropicCacheResult
) -> dict[str, Any]:
    paths = [b.path for b in request.blocks]
    return {
        "total_input_tokens": result.total_tokens,
        "cache_read_tokens": result.cache_read_input_tokens,
        "cache_write_tokens": result.cache_creation_input_tokens,
        "cache_write_5m_tokens": result.ephemeral_5m_input_tokens,
        "cache_write_1h_tokens": result.ephemeral_1h_input_tokens,
        "uncached_tokens": result.input_tokens,
        "hit_block": paths[result.hit_block] if result.hit_block is not None else None,
        "written_blocks": [paths[i] for i in result.written_blocks],
        "breakpoints": [b.path for b in request.blocks if b.ttl is not None],
        "ignored_breakpoints": [paths[i] for i in result.ignored_breakpoints],
    }


def _json(status: int, payload: Any, headers: dict[str, str] | None = None) -> Response:
    data = json.dumps(payload, ensure_ascii=False).encode("utf-8")
    return status, dict(headers or {}), data


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False
    provider: FakeProvider


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server
    timeout = 300  # idle keep-alive connections close after this many seconds

    def do_GET(self) -> None:
        self._serve("GET")

    def do_POST(self) -> None:
        self._serve("POST")

    def _serve(self, method: str) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        headers = {k.lower(): v for k, v in self.headers.items()}
        status, extra, payload = self.server.provider.handle(method, self.path, headers, body)
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        for key, value in extra.items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, format: str, *args: Any) -> None:
        """Silence per-request logging; the request log is ``/_fake/stats``."""
