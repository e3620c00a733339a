"""Load the model registry from the packaged table plus an optional operator file (shell).

The packaged ``context_engine/data/models.json`` is read with ``importlib.resources``; an
operator overlay (same shape, see ``core.model_registry``) is read from a path the caller
chooses -- typically the value of ``CONTEXT_ENGINE_MODELS_FILE``. This module reads files and
parses JSON; all merging and validation happen in the pure core.
"""

from __future__ import annotations

import json
import os
from importlib import resources
from pathlib import Path
from typing import Any, Final

from .core.model_registry import ModelRegistry, ModelRegistryError

__all__ = [
    "MODELS_FILE_ENV",
    "load_model_registry",
    "read_packaged_models",
]

# The caller may read the operator file path from this variable; this module never reads it.
MODELS_FILE_ENV: Final = "CONTEXT_ENGINE_MODELS_FILE"

_PACKAGE: Final = "context_engine"
_RESOURCE: Final = ("data", "models.json")


def read_packaged_models() -> dict[str, Any]:
    """The parsed packaged model table."""
    resource = resources.files(_PACKAGE).joinpath(*_RESOURCE)
    return _parse(resource.read_text(encoding="utf-8"), "packaged models.json")


def load_model_registry(operator_file: str | os.PathLike[str] | None = None) -> ModelRegistry:
    """Build the registry from the packaged table, overlaid by ``operator_file`` if given.

    An operator file that is named but missing or unreadable is an error, not a silent skip:
    the operator asked for models that would otherwise be unknown.

    Raises:
        ModelRegistryError: a file cannot be read or parsed, or an entry is invalid.
    """
    base = read_packaged_models()
    if operator_file is None:
        return ModelRegistry.from_mappings(base)
    path = Path(operator_file)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ModelRegistryError(f"cannot read operator models file {path}: {exc}") from exc
    except UnicodeDecodeError as exc:  # named like any other bad file, not a bare codec error
        raise ModelRegistryError(
            f"operator models file {path} is not UTF-8 JSON (byte {exc.start})"
        ) from None
    return ModelRegistry.from_mappings(base, _parse(text, str(path)))


def _parse(text: str, source: str) -> dict[str, Any]:
    try:
        document = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ModelRegistryError(f"{source}: invalid JSON: {exc}") from exc
    if not isinstance(document, dict):
        raise ModelRegistryError(f"{source}: document must be a JSON object")
    return document
