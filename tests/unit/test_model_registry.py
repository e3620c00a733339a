"""The model registry: the shipped table, operator overlays, and errors that name the culprit."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from context_engine.core.model_registry import (
    ModelInfo,
    ModelRegistry,
    ModelRegistryError,
    UnknownModelError,
)
from context_engine.model_registry_loader import (
    MODELS_FILE_ENV,
    load_model_registry,
    read_packaged_models,
)

SHIPPED = {
    "claude-opus-4-1",
    "claude-sonnet-4-5",
    "claude-haiku-4-5",
    "claude-3-5-haiku",
    "gpt-4o",
    "gpt-4o-mini",
    "gpt-4.1",
    "gpt-4.1-mini",
    "o3",
    "o4-mini",
    "gpt-5",
    "gpt-4",
    "gpt-3.5-turbo",
}


def _entry(**fields: Any) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "provider": "openai",
        "family": "test",
        "context_window": 100_000,
        "default_output_reserve": 4096,
        "max_cache_breakpoints": 0,
        "min_cacheable_tokens": 1024,
        "tokenizer": "o200k_base",
    }
    entry.update(fields)
    return entry


def _doc(models: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"models": models, **extra}


# --- the shipped table ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def shipped() -> ModelRegistry:
    return load_model_registry()


def test_the_shipped_table_has_the_expected_models(shipped: ModelRegistry) -> None:
    assert set(shipped.model_ids) == SHIPPED
    assert list(shipped.model_ids) == sorted(SHIPPED)
    assert len(shipped) == len(SHIPPED)


def test_shipped_entries_follow_their_provider(shipped: ModelRegistry) -> None:
    for info in shipped:
        assert info.default_output_reserve < info.context_window
        if info.provider == "anthropic":
            assert info.tokenizer == "heuristic"
            assert info.max_cache_breakpoints == 4
            assert info.min_cacheable_tokens in (1024, 2048, 4096)
        else:
            assert info.tokenizer in ("o200k_base", "cl100k_base")
            assert info.max_cache_breakpoints == 0
            assert info.min_cacheable_tokens == 1024


@pytest.mark.parametrize(
    ("model_id", "window", "tokenizer", "minimum"),
    [
        ("claude-sonnet-4-5", 200_000, "heuristic", 1024),
        ("claude-opus-4-1", 200_000, "heuristic", 1024),
        ("claude-haiku-4-5", 200_000, "heuristic", 4096),
        ("claude-3-5-haiku", 200_000, "heuristic", 2048),
        ("gpt-4o", 128_000, "o200k_base", 1024),
        ("gpt-4.1", 1_047_576, "o200k_base", 1024),
        ("o3", 200_000, "o200k_base", 1024),
        ("gpt-5", 400_000, "o200k_base", 1024),
        ("gpt-4", 8192, "cl100k_base", 1024),
        ("gpt-3.5-turbo", 16_385, "cl100k_base", 1024),
    ],
)
def test_shipped_figures(
    shipped: ModelRegistry, model_id: str, window: int, tokenizer: str, minimum: int
) -> None:
    info = shipped.get(model_id)
    assert (info.context_window, info.tokenizer, info.min_cacheable_tokens) == (
        window,
        tokenizer,
        minimum,
    )


def test_defaults_fill_omitted_fields_and_explicit_values_win(shipped: ModelRegistry) -> None:
    assert shipped.get("gpt-4o").default_output_reserve == 8192
    assert shipped.get("o3").default_output_reserve == 25_000
    # gpt-5 reserves its whole output so input stays within its 272k input limit.
    gpt5 = shipped.get("gpt-5")
    assert gpt5.context_window - gpt5.default_output_reserve == 272_000


def test_unknown_models_raise_a_lookup_error_naming_the_model(shipped: ModelRegistry) -> None:
    with pytest.raises(UnknownModelError) as info:
        shipped.get("gpt-9000")
    assert isinstance(info.value, LookupError)
    assert info.value.model_id == "gpt-9000"
    assert "gpt-9000" in str(info.value)
    assert "gpt-9000" not in shipped


def test_model_info_is_immutable(shipped: ModelRegistry) -> None:
    info = shipped.get("gpt-4o")
    with pytest.raises(ValidationError):
        info.context_window = 1  # type: ignore[misc]


# --- overlays ---------------------------------------------------------------------------------


def test_an_overlay_adds_a_model_without_code() -> None:
    base = read_packaged_models()
    overlay = _doc({"acme-llm": _entry(family="acme", tokenizer="heuristic")})
    registry = ModelRegistry.from_mappings(base, overlay)
    assert registry.get("acme-llm").family == "acme"
    assert set(registry.model_ids) == SHIPPED | {"acme-llm"}


def test_an_overlay_overrides_only_the_fields_it_names() -> None:
    base = read_packaged_models()
    overlay = _doc({"claude-sonnet-4-5": {"context_window": 1_000_000}})
    registry = ModelRegistry.from_mappings(base, overlay)
    before = ModelRegistry.from_mappings(base).get("claude-sonnet-4-5")
    after = registry.get("claude-sonnet-4-5")
    assert after.context_window == 1_000_000
    assert after.model_copy(update={"context_window": before.context_window}) == before


def test_overlay_defaults_apply_to_the_overlays_new_models_only() -> None:
    base = _doc({"a": _entry()}, defaults={"default_output_reserve": 1000})
    without_reserve = {k: v for k, v in _entry().items() if k != "default_output_reserve"}
    overlay = _doc(
        {"a": {"family": "renamed"}, "b": without_reserve},
        defaults={"default_output_reserve": 2000},
    )
    registry = ModelRegistry.from_mappings(base, overlay)
    assert registry.get("a").default_output_reserve == 4096  # its own value, untouched
    assert registry.get("a").family == "renamed"
    assert registry.get("b").default_output_reserve == 2000


@given(st.lists(st.integers(10_000, 2_000_000), min_size=1, max_size=5))
def test_later_overlays_win(windows: list[int]) -> None:
    base = _doc({"m": _entry()})
    overlays = [_doc({"m": {"context_window": w}}) for w in windows]
    assert ModelRegistry.from_mappings(base, *overlays).get("m").context_window == windows[-1]


def test_loader_reads_the_operator_file(tmp_path: Path) -> None:
    path = tmp_path / "models.json"
    path.write_text(json.dumps(_doc({"local-llama": _entry(tokenizer="heuristic")})))
    registry = load_model_registry(path)
    assert "local-llama" in registry
    assert "gpt-4o" in registry
    assert MODELS_FILE_ENV == "CONTEXT_ENGINE_MODELS_FILE"


def test_a_named_operator_file_that_is_missing_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ModelRegistryError, match="cannot read"):
        load_model_registry(tmp_path / "absent.json")


def test_an_operator_file_that_is_not_json_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "models.json"
    path.write_text("{ not json")
    with pytest.raises(ModelRegistryError, match="invalid JSON"):
        load_model_registry(path)


# --- validation errors name the document, the model and the field -----------------------------


@pytest.mark.parametrize(
    ("entry", "field"),
    [
        (_entry(context_window=-5), "context_window"),
        (_entry(context_window="200000"), "context_window"),
        (_entry(context_window=True), "context_window"),
        (_entry(provider="mistral"), "provider"),
        (_entry(tokenizer="p50k_base"), "tokenizer"),
        (_entry(max_cache_breakpoints=-1), "max_cache_breakpoints"),
        (_entry(image_tokens=0), "image_tokens"),
        (_entry(temperature=0.2), "temperature"),
        ({k: v for k, v in _entry().items() if k != "family"}, "family"),
    ],
)
def test_invalid_fields_are_reported_with_model_and_field(
    entry: dict[str, Any], field: str
) -> None:
    with pytest.raises(ModelRegistryError) as info:
        ModelRegistry.from_mappings(_doc({"ok": _entry()}), _doc({"broken-model": entry}))
    message = str(info.value)
    assert "overlay 1" in message
    assert "'broken-model'" in message
    assert field in message


def test_a_reserve_that_leaves_no_room_for_input_is_rejected() -> None:
    with pytest.raises(ModelRegistryError, match="default_output_reserve"):
        ModelRegistry.from_mappings(
            _doc({"m": _entry(context_window=8192, default_output_reserve=8192)})
        )


def test_a_default_reserve_above_the_models_maximum_output_is_rejected() -> None:
    with pytest.raises(ModelRegistryError, match="max_output_tokens"):
        ModelRegistry.from_mappings(
            _doc({"m": _entry(default_output_reserve=8192, max_output_tokens=4096)})
        )
    # Not known (an overlay's model without it): nothing to check against.
    assert ModelRegistry.from_mappings(_doc({"m": _entry()})).get("m").max_output_tokens is None


def test_every_shipped_model_states_its_maximum_output(shipped: ModelRegistry) -> None:
    """Plan checks a reserve against it (core/plan.py _check_reserve)."""
    for model_id in shipped.model_ids:
        info = shipped.get(model_id)
        assert info.max_output_tokens is not None, model_id
        assert info.default_output_reserve <= info.max_output_tokens
    assert shipped.get("claude-3-5-haiku").max_output_tokens == 8192
    assert shipped.get("gpt-5").max_output_tokens == 128_000


def test_an_override_that_breaks_a_shipped_model_names_both_documents() -> None:
    with pytest.raises(ModelRegistryError) as info:
        ModelRegistry.from_mappings(read_packaged_models(), _doc({"gpt-4": {"context_window": 0}}))
    assert "base + overlay 1" in str(info.value)
    assert "'gpt-4'" in str(info.value)


@pytest.mark.parametrize(
    ("document", "needle"),
    [
        ([], "must be a JSON object"),
        ({"modles": {}}, "unknown top-level key"),
        ({"defaults": []}, "'defaults' must be an object"),
        ({"defaults": {"model_id": "x"}, "models": {}}, "must not set model_id"),
        ({}, "'models' must be an object"),
        ({"models": {"m": 3}}, "entry must be an object"),
        ({"models": {"": _entry()}}, "non-empty strings"),
        ({"models": {"m": _entry(model_id="n")}}, "disagrees with its key"),
    ],
)
def test_malformed_documents_are_rejected(document: Any, needle: str) -> None:
    with pytest.raises(ModelRegistryError, match=needle):
        ModelRegistry.from_mappings(document)


def test_comments_are_allowed_and_ignored() -> None:
    registry = ModelRegistry.from_mappings(_doc({"m": _entry()}, **{"$comment": ["why"]}))
    assert registry.model_ids == ("m",)


def test_a_registry_built_directly_checks_its_keys() -> None:
    info = ModelInfo.model_validate({"model_id": "a", **_entry()})
    with pytest.raises(ModelRegistryError, match="carries model_id"):
        ModelRegistry({"b": info})
