"""Fixed texts the renderers send where a provider has no field for what the neutral
request says. Shared, so both providers say the same thing the same way.
"""

from __future__ import annotations

__all__ = ["TOOL_ERROR_AS_TEXT"]

# A failed tool result's is_error, as text: the first line of what the model reads of the
# result (OpenAI's function_call_output, Anthropic's no-tools text form), then the content
# exactly as core enveloped it. It stands outside the envelope: the engine says the call
# failed, not the tool.
TOOL_ERROR_AS_TEXT = "(The tool call failed.)"
