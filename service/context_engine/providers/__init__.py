"""Provider renderers: the neutral ModelRequest as Anthropic Messages or OpenAI Responses
JSON bytes. PURE, like the core: no I/O, no clock, no randomness.

``render(request, max_breakpoints)`` picks the renderer of request.provider (``RENDERERS``)
and returns the payload bytes and the API name BuildResponse carries (``provider_payload``,
``provider_api``). ``max_breakpoints`` is the model's cache-marker budget from the model
registry (``max_cache_breakpoints``): a provider with explicit markers (Anthropic) sends at
most that many, dropping them in priority order (the run marker first); None leaves the
provider's own limit. The budget is an input like the request: the same pair renders the
same bytes, so a Build records the budget it rendered with and its replay (GetBuild)
passes the recorded one. So is ``failed_result_line``: False renders a failed tool result
as the legacy assembler sent it where the provider reads is_error as text (OpenAI always,
Anthropic without tools): its content alone, without ``TOOL_ERROR_AS_TEXT``; GetBuild
passes it for a record of context-assembler@1 (core/build_record.py, Rule 8). And
``text_call_ids``: False renders Anthropic's no-tools text form naming no call ids, as
context-assembler@10 and older sent it (providers/anthropic.py, Rule 8).
``prompt_units(request)`` is the same prompt unit by unit, in the
order the provider caches it, with the row and item of each unit (what ``explain`` diffs).
``text_paths(request, blocks)`` says where user text blocks landed in the payload (the
JSON path of the part holding each one's text), for the adapter to add a message's
attachments beside it (BuildResponse.attachment_placements).

A change here or in a renderer that changes payload bytes for the same request bumps
core/build_record.py ASSEMBLER_VERSION (Rule 8), so GetBuild can tell a record it no
longer renders the same from one it does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ..core.errors import EngineError
from ..core.request import ModelRequest
from . import anthropic, openai
from .layout import PromptUnit, RenderedPayload
from .names import check_wire_names, tool_name_from_wire, wire_tool_name
from .texts import without_error_line
from .usage import (
    PPM,
    Usage,
    cached_prefix_ppm,
    ratio_ppm,
    reuse_ppm,
    session_cached_prefix_ppm,
    usage_from_anthropic,
    usage_from_openai,
    usage_from_provider,
)

__all__ = [
    "PPM",
    "RENDERERS",
    "PromptUnit",
    "RenderedPayload",
    "Renderer",
    "Usage",
    "cached_prefix_ppm",
    "check_wire_names",
    "prompt_units",
    "ratio_ppm",
    "render",
    "reuse_ppm",
    "session_cached_prefix_ppm",
    "text_paths",
    "tool_name_from_wire",
    "usage_from_anthropic",
    "usage_from_openai",
    "usage_from_provider",
    "wire_tool_name",
]


@dataclass(frozen=True, slots=True)
class Renderer:
    api: str
    render: Callable[[ModelRequest], RenderedPayload]
    prompt_units: Callable[[ModelRequest], tuple[PromptUnit, ...]]
    # The renderer under a cache-marker budget; None: the provider places no markers.
    render_within: Callable[..., RenderedPayload] | None = None
    # Whether it says a failed result's is_error as text (TOOL_ERROR_AS_TEXT) in `request`.
    errors_as_text: Callable[[ModelRequest], bool] = lambda request: True
    # Where user text blocks landed in the body (see text_paths below).
    text_paths: Callable[..., dict[tuple[int, int], str]] = lambda request, blocks, **_: {}


# The plan's provider -> its renderer.
RENDERERS: dict[str, Renderer] = {
    "anthropic": Renderer(
        anthropic.API,
        anthropic.render,
        anthropic.prompt_units,
        anthropic.render,
        anthropic.errors_as_text,
        anthropic.text_paths,
    ),
    "openai": Renderer(
        openai.API, openai.render, openai.prompt_units, text_paths=openai.text_paths
    ),
}


def _renderer(provider: str) -> Renderer:
    renderer = RENDERERS.get(provider)
    if renderer is None:
        raise EngineError(f"no renderer for provider {provider!r}")
    return renderer


def render(
    request: ModelRequest,
    max_breakpoints: int | None = None,
    *,
    failed_result_line: bool = True,
    text_call_ids: bool = True,
) -> RenderedPayload:
    """The provider payload of `request`, for its plan's provider, with at most
    `max_breakpoints` cache markers (None: the provider's own limit); with
    `failed_result_line` False, failed results as the legacy assembler sent them; with
    `text_call_ids` False, tool pairs sent as text name no call ids (@10 and older).

    Raises:
        EngineError: an unknown provider, or a reasoning payload that is not a JSON
            object of the provider's reasoning type.
        PreconditionError: two tool names share a wire name.
    """
    renderer = _renderer(request.provider)
    if not failed_result_line and renderer.errors_as_text(request):
        request = without_error_line(request)
    if renderer.render_within is None:
        return renderer.render(request)  # the provider takes no markers and no text form
    if max_breakpoints is None:
        return renderer.render_within(request, text_call_ids=text_call_ids)
    return renderer.render_within(request, max_breakpoints, text_call_ids=text_call_ids)


def text_paths(
    request: ModelRequest,
    blocks: Iterable[tuple[int, int]],
    *,
    failed_result_line: bool = True,
    text_call_ids: bool = True,
) -> dict[tuple[int, int], str]:
    """Where each of `blocks` (message index, block index: user text blocks of `request`)
    landed in the payload `render` gives for the same arguments: the JSON path of the
    content part holding its text (Anthropic ``messages[t].content[j]``, OpenAI
    ``input[i].content[0]``). A block that sent nothing is absent."""
    renderer = _renderer(request.provider)
    if not failed_result_line and renderer.errors_as_text(request):
        request = without_error_line(request)  # as render sends it: a block may drop
    return renderer.text_paths(request, blocks, text_call_ids=text_call_ids)


def prompt_units(request: ModelRequest) -> tuple[PromptUnit, ...]:
    """The prompt of `request` unit by unit, in its provider's cache order."""
    return _renderer(request.provider).prompt_units(request)
