"""Provider usage, normalized, and the cache ratios the spec tracks (pure arithmetic).

Telemetry (issue 7) and ReportUsage record these; they live here so a worker, a bench and
the server compute them the same way.

Rule 1: ``Usage`` splits input the Anthropic way — uncached ``input_tokens``,
``cache_read_input_tokens``, ``cache_creation_input_tokens`` — whatever the provider.
OpenAI reports ``input_tokens`` including the cached part, so its uncached share is
``input_tokens - cached_tokens``; it reports no writes (``cache_write_tokens`` when given).
Rule 2: ratios are integer parts per million (no floats in anything recorded), floored,
and 0 when the denominator is 0.
Rule 3 (cached-prefix ratio): prefix tokens served from cache over prefix tokens, per
request, capped at 1,000,000 (a read that also covers history still counts the prefix
once). A session's ratio counts the requests after its first.
Rule 4 (reuse ratio): cached input against the preceding call's full input: a stable
Region A hash alone does not prove history reuse. Capped at 1,000,000: a read longer than
the preceding call's input (a longer prefix an older call cached) reused all of it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "PPM",
    "Usage",
    "cached_prefix_ppm",
    "ratio_ppm",
    "reuse_ppm",
    "session_cached_prefix_ppm",
    "usage_from_anthropic",
    "usage_from_openai",
    "usage_from_provider",
]

PPM = 1_000_000


@dataclass(frozen=True, slots=True)
class Usage:
    input_tokens: int  # uncached input
    cache_read_input_tokens: int
    cache_creation_input_tokens: int
    output_tokens: int

    @property
    def total_input_tokens(self) -> int:
        return self.input_tokens + self.cache_read_input_tokens + self.cache_creation_input_tokens


def _int(usage: Mapping[str, Any], key: str) -> int:
    value = usage.get(key)
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else 0


def usage_from_anthropic(usage: Mapping[str, Any]) -> Usage:
    """From a Messages API ``usage`` object."""
    return Usage(
        input_tokens=_int(usage, "input_tokens"),
        cache_read_input_tokens=_int(usage, "cache_read_input_tokens"),
        cache_creation_input_tokens=_int(usage, "cache_creation_input_tokens"),
        output_tokens=_int(usage, "output_tokens"),
    )


def usage_from_openai(usage: Mapping[str, Any]) -> Usage:
    """From a Responses API ``usage`` object (Rule 1)."""
    details = usage.get("input_tokens_details") or {}
    cached = _int(details, "cached_tokens")
    written = _int(details, "cache_write_tokens")
    total = _int(usage, "input_tokens")
    return Usage(
        input_tokens=max(0, total - cached - written),
        cache_read_input_tokens=cached,
        cache_creation_input_tokens=written,
        output_tokens=_int(usage, "output_tokens"),
    )


_BY_API = {"anthropic.messages": usage_from_anthropic, "openai.responses": usage_from_openai}


def usage_from_provider(api: str, usage: Mapping[str, Any]) -> Usage:
    """Dispatch on BuildResponse.provider_api. Raises KeyError for an unknown API."""
    return _BY_API[api](usage)


def ratio_ppm(numerator: int, denominator: int) -> int:
    """numerator / denominator in parts per million, floored; 0 when nothing to divide."""
    if denominator <= 0:
        return 0
    return max(0, numerator) * PPM // denominator


def cached_prefix_ppm(prefix_tokens: int, cache_read_input_tokens: int) -> int:
    """Prefix tokens served from cache / prefix tokens, for one request (Rule 3)."""
    return ratio_ppm(min(cache_read_input_tokens, prefix_tokens), prefix_tokens)


def session_cached_prefix_ppm(requests: Sequence[tuple[int, int]]) -> int:
    """The session's ratio over (prefix_tokens, cache_read_input_tokens) per request,
    oldest first; the first request, which writes the cache, is not counted (Rule 3)."""
    later = requests[1:]
    served = sum(min(read, prefix) for prefix, read in later)
    return ratio_ppm(served, sum(prefix for prefix, _ in later))


def reuse_ppm(cache_read_input_tokens: int, preceding_total_input_tokens: int) -> int:
    """Cached input of this call against the preceding call's full input (Rule 4)."""
    return min(PPM, ratio_ppm(cache_read_input_tokens, preceding_total_input_tokens))
