"""Plan's input-schema check against JSON Schema draft 2020-12's own metaschema.

Anthropic validates every tool's input schema against draft 2020-12 and refuses the whole
request when it fails ("tools.N.custom.input_schema: JSON schema is invalid. It must match
JSON Schema draft 2020-12"). Plan refuses such a schema for an Anthropic model with a
hand-written table (core/tool_schema.py, `_KEYWORD_VALUES` and `_malformed`): fast enough
for Plan's every tool, and naming the keyword and where. The reference here is the
`jsonschema` package's draft 2020-12 validator (a test dependency), applied to generated
schemas whose keywords hold values of every JSON kind, in both directions:

- whatever the metaschema refuses, Plan refuses (no schema Anthropic refuses is planned);
- whatever Plan's schema-keyword rules refuse, the metaschema refuses (no false refusal),
  outside the rules that are not the metaschema's: the top level's own (an object, no
  combinator, Anthropic's property-name pattern), draft 2019's `additionalItems`, which
  Plan still reads as a schema position, and the regex format of `pattern`, which the
  reference is not asked to check (format is an annotation unless a checker is given).
"""

from __future__ import annotations

import re
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from jsonschema import Draft202012Validator

from context_engine.core.tool_schema import input_schema_problem, visible_input_schema

# The metaschema itself, no format checker: the vocabulary Anthropic names.
METASCHEMA = Draft202012Validator(Draft202012Validator.META_SCHEMA)

# Keywords whose value is a schema, a map of them or a list of them (draft 2020-12).
SCHEMA_ONE = (
    "additionalProperties",
    "items",
    "contains",
    "not",
    "if",
    "then",
    "else",
    "propertyNames",
    "unevaluatedItems",
    "unevaluatedProperties",
    "contentSchema",
)
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
# Every other keyword of the metaschema, with a value of the kind it allows.
VALUES: dict[str, st.SearchStrategy[Any]] = {
    "type": st.sampled_from(["string", "object", ["string", "null"], "integer"]),
    "multipleOf": st.sampled_from([1, 0.5, 3]),
    "maximum": st.integers(-5, 5),
    "exclusiveMaximum": st.integers(-5, 5),
    "minimum": st.integers(-5, 5),
    "exclusiveMinimum": st.floats(-5, 5, allow_nan=False),
    "maxLength": st.integers(0, 9),
    "minLength": st.integers(0, 9),
    "maxItems": st.integers(0, 9),
    "minItems": st.integers(0, 9),
    "maxContains": st.integers(0, 9),
    "minContains": st.integers(0, 9),
    "maxProperties": st.integers(0, 9),
    "minProperties": st.integers(0, 9),
    "uniqueItems": st.booleans(),
    "pattern": st.sampled_from(["^a", "[0-9]+"]),
    "format": st.sampled_from(["date", "uri"]),
    "enum": st.lists(st.integers(0, 3), max_size=3),
    "const": st.integers(0, 3),
    "required": st.lists(st.sampled_from("abc"), unique=True, max_size=3),
    "dependentRequired": st.dictionaries(
        st.sampled_from("ab"), st.lists(st.sampled_from("xy"), unique=True), max_size=2
    ),
    "$id": st.just("https://example.com/s"),
    "$schema": st.just("https://json-schema.org/draft/2020-12/schema"),
    "$ref": st.just("#/$defs/a"),
    "$dynamicRef": st.just("#meta"),
    "$comment": st.just("why"),
    "$anchor": st.sampled_from(["a", "_b.c-1"]),
    "$dynamicAnchor": st.just("meta"),
    "$vocabulary": st.just({"https://json-schema.org/draft/2020-12/vocab/core": True}),
    "title": st.just("A title"),
    "description": st.just("What it is."),
    "deprecated": st.booleans(),
    "readOnly": st.booleans(),
    "writeOnly": st.booleans(),
    "examples": st.lists(st.integers(0, 3), max_size=2),
    "default": st.integers(0, 3),
    "contentEncoding": st.just("base64"),
    "contentMediaType": st.just("application/json"),
    "$recursiveRef": st.just("#"),
    "$recursiveAnchor": st.just("meta"),
}
# Any JSON value: what a keyword holds when its value is drawn wrong.
ANY_JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-3, 3)
    | st.floats(-3, 3, allow_nan=False)
    | st.sampled_from(["", "x", "1bad", "#a", "string"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from("ab"), inner),
    max_leaves=6,
)


def _schemas(depth: int) -> st.SearchStrategy[Any]:
    return st.booleans() | _schema(depth) if depth > 0 else st.booleans() | st.just({})


def _value(key: str, depth: int) -> st.SearchStrategy[Any]:
    """`key`'s value: mostly of the kind it allows, sometimes any JSON value."""
    if key in SCHEMA_ONE:
        right = _schemas(depth - 1)
    elif key in SCHEMA_MAPS:
        right = st.dictionaries(st.sampled_from(["a", "b", "c_1"]), _schemas(depth - 1))
    elif key in SCHEMA_LISTS:
        right = st.lists(_schemas(depth - 1), max_size=2)
    elif key == "dependencies":  # draft 4's, still in the metaschema: schemas or names
        names = st.lists(st.sampled_from("xy"), unique=True)
        right = st.dictionaries(st.sampled_from("ab"), _schemas(depth - 1) | names)
    else:
        right = VALUES[key]
    return st.one_of(right, right, right, ANY_JSON)


KEYS = (*SCHEMA_ONE, *SCHEMA_MAPS, *SCHEMA_LISTS, "dependencies", *VALUES)


def _schema(depth: int) -> st.SearchStrategy[dict[str, Any]]:
    return st.lists(st.sampled_from(KEYS), unique=True, max_size=4).flatmap(
        lambda keys: st.fixed_dictionaries({k: _value(k, depth) for k in keys})
    )


# A tool's input schema: an object at its top level, with no combinator there and property
# names Anthropic takes (those rules are the top level's, tested in test_roster.py).
TOP_KEYS = tuple(k for k in KEYS if k not in ("type", "allOf", "anyOf", "oneOf", "properties"))


@st.composite
def input_schemas(draw: st.DrawFn) -> dict[str, Any]:
    keys = draw(st.lists(st.sampled_from(TOP_KEYS), unique=True, max_size=3))
    properties = draw(st.dictionaries(st.sampled_from(["q", "n", "tags"]), _schemas(3), max_size=3))
    schema: dict[str, Any] = {"type": "object", "properties": properties}
    for key in keys:
        schema[key] = draw(_value(key, 3))
    return schema


def _refused_by_metaschema(schema: dict[str, Any]) -> str | None:
    """Why the metaschema refuses `schema` as it is sent (a root title is not sent)."""
    error = next(iter(METASCHEMA.iter_errors(visible_input_schema(schema))), None)
    return None if error is None else f"{list(error.absolute_path)}: {error.message}"


@settings(max_examples=1500)
@given(input_schemas())
def test_plan_refuses_what_the_metaschema_refuses_and_nothing_else(schema: dict[str, Any]) -> None:
    reference = _refused_by_metaschema(schema)
    ours = input_schema_problem(schema, "anthropic")
    if reference is not None:
        assert ours is not None, f"the metaschema refuses ({reference}); Plan took {schema}"
    else:
        assert ours is None, f"Plan refused ({ours}); the metaschema takes {schema}"


def test_what_plan_refuses_beyond_the_metaschema() -> None:
    """The rules the generated schemas leave out, each refused though the metaschema takes
    it: they are Anthropic's own (the top level) or Plan's reading of a draft-2019
    keyword as a schema position (for OpenAI as for Anthropic)."""
    beyond = [
        {"type": "object", "anyOf": [{"required": ["q"]}]},
        {"type": "object", "properties": {"filter[id]": {"type": "string"}}},
        {"type": "object", "properties": {"t": {"type": "array", "additionalItems": 3}}},
    ]
    for schema in beyond:
        assert _refused_by_metaschema(schema) is None
        assert input_schema_problem(schema, "anthropic") is not None


def test_the_reference_refuses_what_anthropic_names() -> None:
    """The reference is the metaschema Anthropic names: a few refusals the audits met, and
    the schemas the generator draws right, taken (a reference that took nothing or
    refused everything would make the property above vacuous)."""
    for bad in (
        {"type": "object", "properties": {"n": {"type": "integer", "exclusiveMinimum": True}}},
        {"type": "object", "properties": {"t": {"type": "array", "items": [{}]}}},
        {"type": "object", "properties": {"n": {"description": 3}}},
        {"type": "object", "properties": {"n": {"anyOf": []}}},
        {"type": "object", "$anchor": "#a"},
        # A review's: what the generator had not drawn.
        {"type": "object", "properties": {"n": {"$id": "#a"}}},
        {"type": "object", "properties": {"n": {"dependencies": {"a": ["b", "b"]}}}},
        {"type": "object", "properties": {"n": {"dependencies": {"a": {"properties": 3}}}}},
        {"type": "object", "properties": {"n": {"$recursiveRef": 3}}},
    ):
        assert _refused_by_metaschema(bad) is not None, bad
        problem = input_schema_problem(bad, "anthropic")
        assert problem is not None and re.search(
            r"\(properties\.n\.|\(\$anchor|\(properties\.t", problem
        )
    good = {
        "type": "object",
        "$defs": {"a": {"type": "string", "minLength": 1}},
        "properties": {"q": {"$ref": "#/$defs/a"}, "tags": {"prefixItems": [{}], "items": False}},
        "dependentRequired": {"q": ["tags"]},
        "dependencies": {"q": ["tags"], "tags": {"required": ["q"]}},
        "required": ["q"],
        "title": 7,  # the root's title is never sent
    }
    assert _refused_by_metaschema(good) is None
    assert input_schema_problem(good, "anthropic") is None
