"""Names the model writes, and how an error message may quote them.

A tool's name, a parameter's: what the providers accept as a tool name is also what an
error message may repeat to its caller. Anything else a model wrote in a name's place (a
sentence, an instruction it read on a page) is content, which no message, log line or
metadata value carries (docs/security.md): it is described, not quoted.
"""

from __future__ import annotations

import re

__all__ = ["CALLABLE_NAME", "quoted_name"]

# A name the model repeats to call a tool: what the providers accept as a tool name (and
# what a parameter name sensibly is).
CALLABLE_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def quoted_name(name: str) -> str:
    """`name` quoted (repr) when it has a name's shape (CALLABLE_NAME), else a description
    of it that holds none of its text (a review: a model's key written as a sentence came
    back whole in the refusal)."""
    if CALLABLE_NAME.fullmatch(name):
        return repr(name)
    return f"a name of {len(name)} characters that is not one (at most 64 letters, digits, _ . -)"
