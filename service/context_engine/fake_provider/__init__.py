"""A fake LLM provider for tests: Anthropic Messages + OpenAI Responses on loopback HTTP,
with a prompt-cache simulator modelled on each provider's documented caching rules.

Typical use::

    clock = ManualClock()
    with FakeProvider(clock=clock) as fake:
        client = anthropic.Anthropic(base_url=fake.base_url, api_key="test", max_retries=0)
        fake.script.push_tool_call("search", {"q": "x"})
        ...
        clock.advance(301)               # past the 5-minute TTL
        fake.requests[-1].usage          # what the API returned
        fake.stats()                     # what GET /_fake/stats returns

Run one by hand with ``python -m context_engine.fake_provider --listen 127.0.0.1:8089``.
"""

from .cache import (
    ANTHROPIC_LOOKBACK_BLOCKS,
    ANTHROPIC_MIN_CACHEABLE_TOKENS,
    ANTHROPIC_TTL_SECONDS,
    OPENAI_CACHE_INCREMENT,
    OPENAI_MIN_CACHEABLE_TOKENS,
    OPENAI_RETENTION_SECONDS,
    anthropic_min_cacheable_tokens,
)
from .ids import ManualClock
from .script import DEFAULT_REPLY, ErrorReply, Reply, Script, ScriptError, ToolCall
from .server import FakeProvider, RequestRecord
from .tokens import canonical_bytes, count_tokens

__all__ = [
    "ANTHROPIC_LOOKBACK_BLOCKS",
    "ANTHROPIC_MIN_CACHEABLE_TOKENS",
    "ANTHROPIC_TTL_SECONDS",
    "DEFAULT_REPLY",
    "OPENAI_CACHE_INCREMENT",
    "OPENAI_MIN_CACHEABLE_TOKENS",
    "OPENAI_RETENTION_SECONDS",
    "ErrorReply",
    "FakeProvider",
    "ManualClock",
    "Reply",
    "RequestRecord",
    "Script",
    "ScriptError",
    "ToolCall",
    "anthropic_min_cacheable_tokens",
    "canonical_bytes",
    "count_tokens",
]
