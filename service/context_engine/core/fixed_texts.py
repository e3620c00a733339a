"""Fixed texts a renderer adds to a request where a provider has no field for what the
neutral request says. They live in core because the body estimate counts them
(core/body_estimate.py, Rule 6): a text the model reads is a text the budget pays for.

Changing a text here changes payload bytes and estimates: bump core/build_record.py
ASSEMBLER_VERSION (Rule 8) and keep a way to render and count the older form where
GetBuild can still serve it.
"""

from __future__ import annotations

__all__ = [
    "HISTORY_CUT_PLACEHOLDER",
    "PAIRS_AS_TEXT_PROVIDERS",
    "TOOL_CALL_AS_TEXT",
    "TOOL_ERROR_AS_TEXT",
    "TOOL_RESULT_AS_TEXT",
]

# A failed tool result's is_error, as text: the first line of what the model reads of the
# result (OpenAI's function_call_output, Anthropic's no-tools text form), then the content
# exactly as core enveloped it. It stands outside the envelope: the engine says the call
# failed, not the tool. Since context-assembler@2; @1 sent the content alone.
TOOL_ERROR_AS_TEXT = "(The tool call failed.)"

# The user turn Anthropic's renderer opens the messages with when the first kept message
# is the assistant's (a history cut that kept an assistant turn first): the API requires
# a conversation to start with the user.
HISTORY_CUT_PLACEHOLDER = "(The conversation continues from earlier turns not shown here.)"

# The providers whose API rejects tool blocks in a request that defines no tools (a rotation
# to an empty roster keeps the history's pairs), so the renderer sends the pairs as text
# (providers/anthropic.py Rule 8): a call as assistant text, a result as user text opening
# with TOOL_RESULT_AS_TEXT (then TOOL_ERROR_AS_TEXT when it failed, then the content).
# Since context-assembler@11.
PAIRS_AS_TEXT_PROVIDERS = frozenset({"anthropic"})
TOOL_CALL_AS_TEXT = "(Called tool {name} with input {arguments} as call {call_id})"
TOOL_RESULT_AS_TEXT = "(Result of call {call_id})"
