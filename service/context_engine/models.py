"""The shell's view of models: facts from the model registry and a token counter each.

Loading tokenizer rank files and the registry file is I/O, so it happens here, once at
start; the core receives the resulting values and functions.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from .core.errors import InvalidFieldError
from .core.plan import ModelFacts

__all__ = ["ModelCatalog"]

TokenCounter = Callable[[str], int]


def heuristic_counter(text: str) -> int:
    """Conservative fallback: three UTF-8 bytes per token, rounded up."""
    return math.ceil(len(text.encode("utf-8")) / 3)


class ModelCatalog:
    """Resolves a model id to its facts and its token counter."""

    def __init__(
        self,
        facts: dict[str, ModelFacts],
        counters: dict[str, TokenCounter] | None = None,
    ) -> None:
        self._facts = facts
        self._counters = counters or {}

    def facts(self, model_id: str) -> ModelFacts:
        """Raises InvalidFieldError (UNKNOWN_MODEL) for a model the registry lacks."""
        found = self._facts.get(model_id)
        if found is None:
            raise InvalidFieldError(
                f"model {model_id!r} is not in the model registry",
                field="spec.model_id",
                reason="UNKNOWN_MODEL",
                metadata={"model_id": model_id},
            )
        return found

    def counter(self, model_id: str) -> TokenCounter:
        return self._counters.get(model_id, heuristic_counter)

    @classmethod
    def builtin(cls) -> ModelCatalog:
        table = {
            "claude-sonnet-4-5": ("anthropic", 200_000),
            "claude-haiku-4-5": ("anthropic", 200_000),
            "claude-opus-4-1": ("anthropic", 200_000),
            "gpt-4o": ("openai", 128_000),
            "gpt-4.1": ("openai", 1_047_576),
            "gpt-5": ("openai", 400_000),
        }
        return cls({m: ModelFacts(m, p, w, 8192) for m, (p, w) in table.items()})
