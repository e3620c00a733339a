"""Prompt-cache simulators for the fake provider, one per provider family.

Both are pure state machines over ``now`` (seconds, from the injected clock): no I/O, no
sleeping, no randomness. Each models the provider's *documented* rules, cited by doc name.

Anthropic (docs: "Prompt caching", Claude platform docs)
---------------------------------------------------------
Rule A1. The prompt is the sequence of blocks ``tools -> system -> messages``. Each block
         boundary has a prefix identity: a hash chain over the model id and the canonical
         bytes of every block up to and including it. ``cache_control`` is not part of it.
Rule A2. Message-level settings (``tool_choice``, ``thinking``) are mixed into the chain where
         the messages begin: changing them misses message entries but keeps tools/system
         entries ("What invalidates the cache").
Rule A3. A cache entry is written only at a breakpoint (a block carrying ``cache_control``),
         and only if the prefix up to it reaches the model's minimum cacheable length
         (``ANTHROPIC_MIN_CACHEABLE_TOKENS``); shorter breakpoints are silently ignored.
Rule A4. A read checks each breakpoint's boundary and, walking backwards, up to
         ``ANTHROPIC_LOOKBACK_BLOCKS`` earlier block boundaries ("automatic prefix
         checking", about 20 blocks). The longest live entry found is the hit.
Rule A5. Entries live 5 minutes (``ttl`` absent or ``"5m"``) or 1 hour (``"1h"``) and are
         refreshed, at no cost, whenever they are read.
Rule A6. Billing follows "Mixing different TTLs": A = tokens at the hit (0 if none); B = tokens
         at the last 1h breakpoint after A (else A); C = tokens at the last breakpoint after A
         (else A). ``cache_read_input_tokens`` = A, 1h writes = B - A, 5m writes = C - B,
         ``cache_creation_input_tokens`` = C - A, ``input_tokens`` = total - C.
Rule A7. Entries are per model (and, on the real API, per organization: one fake is one org).

OpenAI (docs: "Prompt caching", OpenAI API guides)
---------------------------------------------------
Rule O1. Caching is automatic for prompts of at least ``OPENAI_MIN_CACHEABLE_TOKENS`` tokens.
Rule O2. Hits are reported in ``OPENAI_CACHE_INCREMENT``-token steps: ``cached_tokens`` is the
         longest live previously seen prefix whose length is 1024 + k*128.
Rule O3. Requests are routed by ``prompt_cache_key``; entries are kept per (model, key), so a
         different key (or none) does not see another key's entries.
Rule O4. Entries live ``OPENAI_RETENTION_SECONDS[retention]`` after their last use. The docs
         say 5-10 minutes of inactivity for in-memory retention; the fake picks the lower
         bound (300 s) so a test never passes on a hit the real API may not give.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from .tokens import token_chunks

__all__ = [
    "ANTHROPIC_DEFAULT_MIN_CACHEABLE_TOKENS",
    "ANTHROPIC_LOOKBACK_BLOCKS",
    "ANTHROPIC_MIN_CACHEABLE_TOKENS",
    "ANTHROPIC_TTL_SECONDS",
    "OPENAI_CACHE_INCREMENT",
    "OPENAI_MIN_CACHEABLE_TOKENS",
    "OPENAI_RETENTION_SECONDS",
    "AnthropicBlock",
    "AnthropicCacheResult",
    "AnthropicPromptCache",
    "OpenAICacheResult",
    "OpenAIPromptCache",
    "anthropic_min_cacheable_tokens",
]

# --- Anthropic tables -------------------------------------------------------------------

ANTHROPIC_TTL_SECONDS: dict[str, int] = {"5m": 5 * 60, "1h": 60 * 60}

ANTHROPIC_LOOKBACK_BLOCKS = 20
"""A breakpoint at block ``b`` checks boundaries ``b, b-1, ..., b-20`` (Rule A4)."""

# Minimum cacheable prompt length, "Cache limitations" in the prompt-caching docs. First
# matching model-id prefix wins, so longer ids come first. The rows marked "reported" were
# taken from secondary write-ups of the docs, not from the docs page itself.
ANTHROPIC_MIN_CACHEABLE_TOKENS: tuple[tuple[str, int], ...] = (
    ("claude-opus-5", 512),  # reported
    ("claude-fable-5", 512),  # reported
    ("claude-mythos-5", 512),  # reported
    ("claude-sonnet-5", 1024),  # reported
    ("claude-opus-4-8", 1024),  # reported
    ("claude-opus-4-7", 2048),  # reported
    ("claude-opus-4-6", 4096),
    ("claude-opus-4-5", 4096),
    ("claude-haiku-4-5", 4096),
    ("claude-opus-4-1", 1024),
    ("claude-opus-4", 1024),
    ("claude-sonnet-4", 1024),  # Sonnet 4, 4.5, 4.6
    ("claude-3-7-sonnet", 1024),
    ("claude-3-5-sonnet", 1024),
    ("claude-3-opus", 1024),
    ("claude-3-5-haiku", 2048),
    ("claude-3-haiku", 2048),
)
ANTHROPIC_DEFAULT_MIN_CACHEABLE_TOKENS = 1024


def anthropic_min_cacheable_tokens(model: str) -> int:
    """Minimum cacheable prefix length for ``model`` (Rule A3)."""
    for prefix, minimum in ANTHROPIC_MIN_CACHEABLE_TOKENS:
        if model.startswith(prefix):
            return minimum
    if "haiku" in model:
        return 2048
    return ANTHROPIC_DEFAULT_MIN_CACHEABLE_TOKENS


# --- OpenAI tables ----------------------------------------------------------------------

OPENAI_MIN_CACHEABLE_TOKENS = 1024
OPENAI_CACHE_INCREMENT = 128
OPENAI_RETENTION_SECONDS: dict[str, int] = {"in_memory": 5 * 60, "24h": 24 * 60 * 60}


# --- Anthropic --------------------------------------------------------------------------


@dataclass(frozen=True)
class AnthropicBlock:
    """One prompt block: its path in the request, canonical bytes, token cost and, when it
    is a breakpoint, the breakpoint's TTL (``"5m"`` or ``"1h"``)."""

    path: str
    region: str  # "tools" | "system" | "messages"
    data: bytes
    tokens: int
    ttl: str | None = None
    cacheable: bool = True  # thinking blocks cannot carry a marker


@dataclass(frozen=True)
class AnthropicCacheResult:
    """The usage numbers of one request (Rule A6) plus where the hit and writes were."""

    total_tokens: int
    input_tokens: int
    cache_read_input_tokens: int
    ephemeral_5m_input_tokens: int
    ephemeral_1h_input_tokens: int
    hit_block: int | None
    written_blocks: tuple[int, ...]
    ignored_breakpoints: tuple[int, ...]  # below the minimum cacheable length

    @property
    def cache_creation_input_tokens(self) -> int:
        return self.ephemeral_5m_input_tokens + self.ephemeral_1h_input_tokens


@dataclass
class _Entry:
    expires_at: float
    ttl_seconds: int


class AnthropicPromptCache:
    """Explicit-breakpoint prefix cache (Rules A1-A7). Not thread-safe; the server locks."""

    def __init__(self) -> None:
        self._entries: dict[bytes, _Entry] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()

    def apply(
        self,
        model: str,
        blocks: Sequence[AnthropicBlock],
        *,
        messages_salt: bytes,
        now: float,
    ) -> AnthropicCacheResult:
        """Look up, bill, write and refresh entries for one request at time ``now``."""
        self._expire(now)
        hashes, cumulative = _prefix_chain(model, blocks, messages_salt)
        minimum = anthropic_min_cacheable_tokens(model)
        breakpoints = [i for i, b in enumerate(blocks) if b.ttl is not None]
        effective = [i for i in breakpoints if cumulative[i] >= minimum]
        ignored = tuple(i for i in breakpoints if cumulative[i] < minimum)

        hit: int | None = None
        for bp in effective:
            for i in range(bp, max(-1, bp - ANTHROPIC_LOOKBACK_BLOCKS - 1), -1):
                if hashes[i] in self._entries:
                    if hit is None or i > hit:
                        hit = i
                    break
        a = cumulative[hit] if hit is not None else 0
        after = [i for i in effective if hit is None or i > hit]
        one_hour = [i for i in after if blocks[i].ttl == "1h"]
        b = cumulative[one_hour[-1]] if one_hour else a
        c = cumulative[after[-1]] if after else a

        if hit is not None:
            self._refresh(hashes[hit], now, ttl=blocks[hit].ttl)
            for i in effective:
                if i < hit:
                    self._refresh(hashes[i], now, ttl=blocks[i].ttl)
        for i in after:
            ttl = ANTHROPIC_TTL_SECONDS[blocks[i].ttl or "5m"]
            self._entries[hashes[i]] = _Entry(expires_at=now + ttl, ttl_seconds=ttl)

        total = cumulative[-1] if cumulative else 0
        return AnthropicCacheResult(
            total_tokens=total,
            input_tokens=total - max(a, c),
            cache_read_input_tokens=a,
            ephemeral_5m_input_tokens=c - b,
            ephemeral_1h_input_tokens=b - a,
            hit_block=hit,
            written_blocks=tuple(after),
            ignored_breakpoints=ignored,
        )

    def _refresh(self, key: bytes, now: float, ttl: str | None = None) -> None:
        # Rule A5: a read refreshes the entry; a longer TTL requested on it is kept.
        entry = self._entries.get(key)
        if entry is None:
            return
        if ttl is not None:
            entry.ttl_seconds = max(entry.ttl_seconds, ANTHROPIC_TTL_SECONDS[ttl])
        entry.expires_at = now + entry.ttl_seconds

    def _expire(self, now: float) -> None:
        dead = [k for k, e in self._entries.items() if e.expires_at <= now]
        for k in dead:
            del self._entries[k]


def _prefix_chain(
    model: str, blocks: Sequence[AnthropicBlock], messages_salt: bytes
) -> tuple[list[bytes], list[int]]:
    """Prefix identity and cumulative token count at every block boundary (Rules A1, A2)."""
    state = hashlib.sha256(b"anthropic\x00" + model.encode("utf-8")).digest()
    salted = False
    hashes: list[bytes] = []
    cumulative: list[int] = []
    running = 0
    for block in blocks:
        h = hashlib.sha256(state)
        if block.region == "messages" and not salted:
            h.update(b"\x01" + messages_salt)
            salted = True
        h.update(b"\x00" + len(block.data).to_bytes(8, "big") + block.data)
        state = h.digest()
        running += block.tokens
        hashes.append(state)
        cumulative.append(running)
    return hashes, cumulative


# --- OpenAI -----------------------------------------------------------------------------


@dataclass(frozen=True)
class OpenAICacheResult:
    total_tokens: int
    cached_tokens: int


class OpenAIPromptCache:
    """Automatic prefix cache keyed by (model, prompt_cache_key) (Rules O1-O4).

    Not thread-safe; the server locks.
    """

    def __init__(self) -> None:
        # (model, key) -> {prefix hash at a 128-token boundary -> expiry}
        self._entries: dict[tuple[str, str | None], dict[bytes, float]] = {}

    def __len__(self) -> int:
        return sum(len(v) for v in self._entries.values())

    def clear(self) -> None:
        self._entries.clear()

    def apply(
        self,
        model: str,
        prompt_cache_key: str | None,
        units: Sequence[bytes],
        *,
        retention: str,
        now: float,
    ) -> OpenAICacheResult:
        """Look up and store the prompt made of ``units`` (canonical bytes) at ``now``."""
        tokens = [chunk for unit in units for chunk in token_chunks(unit)]
        total = len(tokens)
        if total < OPENAI_MIN_CACHEABLE_TOKENS:
            return OpenAICacheResult(total_tokens=total, cached_tokens=0)
        boundaries = _openai_boundaries(tokens)
        table = self._entries.setdefault((model, prompt_cache_key), {})
        for k in [k for k, exp in table.items() if exp <= now]:
            del table[k]
        cached = 0
        for length, digest in reversed(boundaries):
            if digest in table:
                cached = length
                break
        expires = now + OPENAI_RETENTION_SECONDS[retention]
        for _, digest in boundaries:
            table[digest] = expires
        return OpenAICacheResult(total_tokens=total, cached_tokens=cached)


def _openai_boundaries(tokens: Sequence[bytes]) -> list[tuple[int, bytes]]:
    """(length, prefix hash) at every cacheable 1024 + k*128 boundary (Rules O1, O2)."""
    h = hashlib.sha256(b"openai\x00")
    out: list[tuple[int, bytes]] = []
    for n, token in enumerate(tokens, start=1):
        h.update(len(token).to_bytes(1, "big") + token)
        if n >= OPENAI_MIN_CACHEABLE_TOKENS and n % OPENAI_CACHE_INCREMENT == 0:
            out.append((n, h.copy().digest()))
    return out
