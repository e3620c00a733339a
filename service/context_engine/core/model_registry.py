"""The model registry: what the engine knows about each model, built from already-parsed data.

Rule 1. The registry is data, not code. The shipped table is ``context_engine/data/models.json``;
        operators add or override models with overlay documents of the same shape. Reading
        those files is the shell's job (``context_engine.model_registry_loader``); this module
        only turns parsed mappings into validated, frozen values.
Rule 2. A document has the shape ``{"defaults": {...}, "models": {"<model id>": {...}}}``, plus
        an optional ``"$comment"`` string that is ignored. Any other top-level key is an error,
        so a misspelt section fails loudly instead of being skipped.
Rule 3. Merging is field by field, in document order (base first, then each overlay):
        - a document's ``defaults`` fill the fields its *own new* model entries omit;
        - an overlay entry for a model that already exists replaces only the fields it names;
        - an overlay entry for a new model id must be complete once its defaults are applied.
Rule 4. Every validation error names the document, the model id and the field.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

__all__ = [
    "ModelInfo",
    "ModelRegistry",
    "ModelRegistryError",
    "Provider",
    "TokenizerName",
    "UnknownModelError",
]

Provider = Literal["anthropic", "openai"]
TokenizerName = Literal["o200k_base", "cl100k_base", "heuristic"]

_TOP_LEVEL_KEYS: Final = frozenset({"$comment", "defaults", "models"})


class UnknownModelError(LookupError):
    """The model id is not in the registry (neither shipped nor added by an operator overlay)."""

    def __init__(self, model_id: str) -> None:
        super().__init__(f"unknown model id: {model_id!r}")
        self.model_id = model_id


class ModelRegistryError(ValueError):
    """A registry document is malformed; the message names the document, model and field."""


class ModelInfo(BaseModel):
    """What the engine needs to know about one model. Immutable.

    ``default_output_reserve`` must leave room for input: it is strictly below
    ``context_window``. ``max_cache_breakpoints == 0`` means the provider caches automatically
    (OpenAI). ``image_tokens`` raises the estimator's flat per-image figure for models whose
    image accounting exceeds it (the estimate uses the larger of the two:
    ``estimator.image_tokens_for``); ``None`` means "use the estimator's default".
    ``max_output_tokens`` bounds the output reserve a plan may send (Plan refuses a reserve
    above it: the provider would refuse every request).
    """

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    model_id: str = Field(min_length=1)
    provider: Provider
    family: str = Field(min_length=1)
    context_window: int = Field(gt=0)
    default_output_reserve: int = Field(gt=0)
    max_cache_breakpoints: int = Field(ge=0)
    min_cacheable_tokens: int = Field(ge=0)
    tokenizer: TokenizerName
    image_tokens: int | None = Field(default=None, gt=0)
    # The most a request may ask the model to write; None: not known (an overlay's model
    # without it), and the reserve is not checked against it.
    max_output_tokens: int | None = Field(default=None, gt=0)

    @model_validator(mode="after")
    def _reserve_leaves_room_for_input(self) -> ModelInfo:
        if self.default_output_reserve >= self.context_window:
            raise ValueError(
                f"default_output_reserve ({self.default_output_reserve}) must be below "
                f"context_window ({self.context_window})"
            )
        if self.max_output_tokens is not None and (
            self.default_output_reserve > self.max_output_tokens
        ):
            raise ValueError(
                f"default_output_reserve ({self.default_output_reserve}) must not exceed "
                f"max_output_tokens ({self.max_output_tokens})"
            )
        return self


class ModelRegistry:
    """An immutable mapping of model id to :class:`ModelInfo`."""

    __slots__ = ("_models",)

    def __init__(self, models: Mapping[str, ModelInfo]) -> None:
        for model_id, info in models.items():
            if info.model_id != model_id:
                raise ModelRegistryError(
                    f"model {model_id!r}: entry carries model_id {info.model_id!r}"
                )
        self._models: Mapping[str, ModelInfo] = MappingProxyType(dict(sorted(models.items())))

    @classmethod
    def from_mappings(cls, base: Mapping[str, Any], *overlays: Mapping[str, Any]) -> ModelRegistry:
        """Build a registry from the shipped document and zero or more operator overlays.

        Raises:
            ModelRegistryError: a document is malformed, or a merged entry fails validation.
                The message names the document ("base" or "overlay N"), the model and the field.
        """
        merged: dict[str, dict[str, Any]] = {}
        sources: dict[str, list[str]] = {}
        for index, document in enumerate((base, *overlays)):
            source = "base" if index == 0 else f"overlay {index}"
            defaults, entries = _split_document(document, source)
            for model_id, entry in entries.items():
                if model_id in merged:
                    merged[model_id] = {**merged[model_id], **entry}
                else:
                    merged[model_id] = {**defaults, **entry}
                sources.setdefault(model_id, []).append(source)
        return cls(
            {
                model_id: _validate(model_id, raw, " + ".join(sources[model_id]))
                for model_id, raw in merged.items()
            }
        )

    def get(self, model_id: str) -> ModelInfo:
        """Return the model's info.

        Raises:
            UnknownModelError: the id is not registered.
        """
        try:
            return self._models[model_id]
        except KeyError:
            raise UnknownModelError(model_id) from None

    @property
    def model_ids(self) -> tuple[str, ...]:
        """Registered ids, sorted."""
        return tuple(self._models)

    def __contains__(self, model_id: object) -> bool:
        return model_id in self._models

    def __iter__(self) -> Iterator[ModelInfo]:
        return iter(self._models.values())

    def __len__(self) -> int:
        return len(self._models)

    def __repr__(self) -> str:
        return f"ModelRegistry({len(self._models)} models)"


def _split_document(
    document: Mapping[str, Any], source: str
) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    if not isinstance(document, Mapping):
        raise ModelRegistryError(f"{source}: document must be a JSON object")
    unknown = sorted(set(document) - _TOP_LEVEL_KEYS)
    if unknown:
        raise ModelRegistryError(f"{source}: unknown top-level key(s) {unknown}")
    defaults = document.get("defaults", {})
    if not isinstance(defaults, Mapping):
        raise ModelRegistryError(f"{source}: 'defaults' must be an object")
    if "model_id" in defaults:
        raise ModelRegistryError(f"{source}: 'defaults' must not set model_id")
    models = document.get("models")
    if not isinstance(models, Mapping):
        raise ModelRegistryError(f"{source}: 'models' must be an object of model id -> entry")
    entries: dict[str, dict[str, Any]] = {}
    for model_id, entry in models.items():
        if not isinstance(model_id, str) or not model_id:
            raise ModelRegistryError(f"{source}: model ids must be non-empty strings")
        if not isinstance(entry, Mapping):
            raise ModelRegistryError(f"{source}: model {model_id!r}: entry must be an object")
        if "model_id" in entry and entry["model_id"] != model_id:
            raise ModelRegistryError(
                f"{source}: model {model_id!r}: field 'model_id' disagrees with its key"
            )
        entries[model_id] = {**entry, "model_id": model_id}
    return dict(defaults), entries


def _validate(model_id: str, raw: Mapping[str, Any], source: str) -> ModelInfo:
    try:
        return ModelInfo.model_validate(raw)
    except ValidationError as exc:
        problems = "; ".join(
            f"field {'.'.join(str(part) for part in error['loc']) or '<entry>'!r}: {error['msg']}"
            for error in exc.errors()
        )
        raise ModelRegistryError(f"{source}: model {model_id!r}: {problems}") from None
