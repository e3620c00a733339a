"""The provider-visible form of a tool definition, and what it costs in the prompt.

Rule 1: the model sees a tool's name, description and input schema, and nothing else of
the pinned ToolSpec. Output schema, policy, scopes, timeouts and limits are hashed into the
plan's identity but never sent, so they never count against the tool-definition class.
Rule 2: the input schema is sent without redundant generated "title" annotations and
without empty "default" annotations. Every validation keyword and every non-empty default
is kept. Only schema positions are rewritten: a property *named* "title" or "default" is
a property, and values under enum/const/examples are data, never schemas.
Rule 3: a definition costs the conservative larger form: the largest of its provider
serializations (Anthropic Messages, OpenAI Responses, the engine's own ToolDefinition)
counted with the model's tokenizer, plus a per-tool allowance for provider framing.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from .canonical import canonical_bytes
from .envelope import escape_content
from .items import ToolDefinitionItem
from .request import ToolDefinition
from .spec import ToolSpec

__all__ = [
    "PROVIDER_FRAMING_TOKENS",
    "definition_item",
    "definition_tokens",
    "input_schema_problem",
    "visible_input_schema",
]

TokenCounter = Callable[[str], int]

# Combinators Anthropic refuses at an input_schema's top level ("input_schema does not
# support oneOf, allOf, or anyOf at the top level"); OpenAI's strict function schemas
# refuse them there too. Nested under a property they are fine.
_TOP_LEVEL_COMBINATORS = ("allOf", "anyOf", "oneOf")


# Anthropic's rule for the names under an input schema's top-level "properties" ("Property
# keys should match pattern '^[a-zA-Z0-9_.-]{1,64}$'", a 400 for the whole request). MCP
# servers ship keys such as "filter[id]", "$top" and "@odata.type". OpenAI takes them.
_ANTHROPIC_PROPERTY_KEY = re.compile(r"[a-zA-Z0-9_.-]{1,64}")


def input_schema_problem(schema: Mapping[str, Any], provider: str = "") -> str | None:
    """Why a provider would refuse `schema` as a tool's input schema on every request that
    defines the tool, or None: both take a tool's input as a JSON object, and Anthropic
    refuses one without "type": "object", or with a combinator at its top level (a union
    type's generated schema, often an MCP server's); both validate the schema, so a schema
    keyword holding what is no schema (`"properties": "q"`, `"required": "q"`) is refused
    too. What is judged is the schema as sent (`visible_input_schema`: a root title, which
    is never sent, does not make it refused). With `provider` "anthropic", also a top-level
    property name outside Anthropic's pattern; with "openai", an array schema without
    `items` anywhere in it (OpenAI's "array schema missing items", strict or not: MCP
    servers ship such schemas). Plan refuses it (a tool's definition is in every request's
    prefix), and so does a rebuild of a pinned spec, whose model is known then. With
    "anthropic", also any keyword whose value JSON Schema draft 2020-12's metaschema does
    not allow (a draft-4 `"exclusiveMinimum": true`, `"type": "int"`, a negative
    `minLength`, a `required` naming a property twice): Anthropic refuses the schema as
    invalid on every request (an audit: Plan took them)."""
    schema = visible_input_schema(dict(schema))
    if schema.get("type") != "object":
        return 'must be a JSON Schema with "type": "object" (tool input is an object)'
    combined = [k for k in _TOP_LEVEL_COMBINATORS if k in schema]
    if combined:
        return (
            f"has {', '.join(combined)} at its top level, which Anthropic refuses on every"
            " request: state the alternatives inside properties, or check them in the tool"
        )
    malformed = _malformed(schema)
    if malformed is not None:
        return malformed
    if provider == "anthropic":
        properties = schema.get("properties") or {}
        bad = sorted(k for k in properties if not _ANTHROPIC_PROPERTY_KEY.fullmatch(k))
        if bad:
            shown = ", ".join(json.dumps(k, ensure_ascii=False) for k in bad[:3])
            return (
                f"has properties named {shown}{' and more' if len(bad) > 3 else ''}, which"
                " Anthropic refuses on every request (names must match"
                f" {_ANTHROPIC_PROPERTY_KEY.pattern!r}): rename them"
            )
    if provider == "anthropic":
        misvalued = _misvalued(schema)
        if misvalued is not None:
            return misvalued
    if provider == "openai":
        at = _array_without_items(schema)
        if at is not None:
            return (
                f"has an array schema without items ({at or 'its root'}), which OpenAI"
                ' refuses on every request ("array schema missing items"): give it items'
            )
    return None


def _subschemas(schema: Mapping[str, Any]) -> Iterator[tuple[dict[str, Any], str]]:
    """Every subschema of `schema` (well-formed: `_malformed` found nothing) that is an
    object, with where it is, `schema` itself first ("")."""
    pending: list[tuple[Any, str]] = [(schema, "")]
    while pending:
        node, at = pending.pop()
        if not isinstance(node, dict):
            continue
        yield node, at
        for key, value in node.items():
            where = f"{at}.{key}" if at else key
            if key in _SCHEMA_MAPS and isinstance(value, dict):
                pending += [(v, f"{where}.{k}") for k, v in value.items()]
            elif key in _SCHEMA_LISTS and isinstance(value, list):
                pending += [(v, f"{where}[{n}]") for n, v in enumerate(value)]
            elif key in _SCHEMA_ONE:
                pending.append((value, where))


def _array_without_items(schema: Mapping[str, Any]) -> str | None:
    """Where a subschema of `schema` types an array, alone or among other types, without
    `items`; None if nowhere."""
    for node, at in _subschemas(schema):
        kind = node.get("type")
        if (kind == "array" or (isinstance(kind, list) and "array" in kind)) and (
            "items" not in node
        ):
            return at
    return None


_TYPES = frozenset({"array", "boolean", "integer", "null", "number", "object", "string"})


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _count(value: Any) -> bool:
    """A non-negative integer (draft 2020-12 allows an integral number: 2.0)."""
    return _number(value) and value >= 0 and float(value).is_integer()


def _type(value: Any) -> bool:
    if isinstance(value, str):
        return value in _TYPES
    return (
        isinstance(value, list)
        and len(value) > 0
        and all(isinstance(v, str) and v in _TYPES for v in value)
        and len(set(value)) == len(value)
    )


def _names(value: Any) -> bool:
    """A list of distinct strings (`_malformed` lets a null `required` through, and one
    under `dependencies`, a draft-4 name list: a review found them raising TypeError)."""
    return (
        isinstance(value, list)
        and all(isinstance(v, str) for v in value)
        and len(set(value)) == len(value)
    )


def _text(value: Any) -> bool:
    return isinstance(value, str)


def _flag(value: Any) -> bool:
    return isinstance(value, bool)


# The metaschema's pattern for $anchor and $dynamicAnchor (a plain name, no "#").
_ANCHOR = re.compile(r"[A-Za-z_][-A-Za-z0-9._]*")


def _anchor(value: Any) -> bool:
    return isinstance(value, str) and _ANCHOR.fullmatch(value) is not None


def _schemas(value: Any) -> bool:
    """A non-empty list (of schemas: `_malformed` has looked at its members)."""
    return isinstance(value, list) and len(value) > 0


def _name_lists(value: Any) -> bool:
    return isinstance(value, dict) and all(_names(v) for v in value.values())


def _dependencies(value: Any) -> bool:
    """Draft 4's dependencies, which 2020-12's metaschema still reads: each a schema
    (`_malformed` walks those) or a property-name list."""
    return isinstance(value, dict) and all(
        isinstance(v, dict | bool) or _names(v) for v in value.values()
    )


# The metaschema's pattern for $id: a URI with no fragment but an empty one.
_ID = re.compile(r"[^#]*#?")


def _vocabulary(value: Any) -> bool:
    return isinstance(value, dict) and all(isinstance(v, bool) for v in value.values())


# Draft 2020-12's keywords -> what their value must be, and how to say it: every keyword
# of its metaschema whose value is not a schema (those are _malformed's), checked against
# that metaschema by tests/unit/test_tool_schema_metaschema.py. A value outside it fails
# the metaschema, and Anthropic refuses the whole request ("JSON schema is invalid").
_KEYWORD_VALUES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "type": (_type, f"one of {', '.join(sorted(_TYPES))}, or a list of distinct ones"),
    "multipleOf": (lambda v: _number(v) and v > 0, "a number above 0"),
    "maximum": (_number, "a number"),
    "exclusiveMaximum": (_number, "a number (draft 4's boolean form is not JSON Schema now)"),
    "minimum": (_number, "a number"),
    "exclusiveMinimum": (_number, "a number (draft 4's boolean form is not JSON Schema now)"),
    "maxLength": (_count, "a non-negative integer"),
    "minLength": (_count, "a non-negative integer"),
    "maxItems": (_count, "a non-negative integer"),
    "minItems": (_count, "a non-negative integer"),
    "maxContains": (_count, "a non-negative integer"),
    "minContains": (_count, "a non-negative integer"),
    "maxProperties": (_count, "a non-negative integer"),
    "minProperties": (_count, "a non-negative integer"),
    "uniqueItems": (lambda v: isinstance(v, bool), "true or false"),
    "pattern": (lambda v: isinstance(v, str), "a string"),
    "format": (lambda v: isinstance(v, str), "a string"),
    "enum": (lambda v: isinstance(v, list), "an array"),
    "required": (_names, "property names, each once"),
    "dependentRequired": (_name_lists, "an object of property-name lists, each name once"),
    "dependencies": (_dependencies, "an object of schemas or property-name lists"),
    # Draft 2020-12's array form is prefixItems: its items is one schema (draft 4's tuple
    # form, which _malformed walks, fails the metaschema).
    "items": (lambda v: not isinstance(v, list), "a schema (a list of them is prefixItems)"),
    "prefixItems": (_schemas, "a non-empty list of schemas"),
    "allOf": (_schemas, "a non-empty list of schemas"),
    "anyOf": (_schemas, "a non-empty list of schemas"),
    "oneOf": (_schemas, "a non-empty list of schemas"),
    # The core, meta-data and content vocabularies: annotations, but typed all the same.
    "$id": (lambda v: isinstance(v, str) and _ID.fullmatch(v) is not None, "a URI, no fragment"),
    "$schema": (_text, "a string"),
    "$ref": (_text, "a string"),
    "$dynamicRef": (_text, "a string"),
    "$comment": (_text, "a string"),
    "$anchor": (_anchor, f"a name matching {_ANCHOR.pattern!r}"),
    "$dynamicAnchor": (_anchor, f"a name matching {_ANCHOR.pattern!r}"),
    "$recursiveRef": (_text, "a string"),
    "$recursiveAnchor": (_anchor, f"a name matching {_ANCHOR.pattern!r}"),
    "$vocabulary": (_vocabulary, "an object of true or false"),
    "title": (_text, "a string"),
    "description": (_text, "a string"),
    "deprecated": (_flag, "true or false"),
    "readOnly": (_flag, "true or false"),
    "writeOnly": (_flag, "true or false"),
    "examples": (lambda v: isinstance(v, list), "an array"),
    "contentEncoding": (_text, "a string"),
    "contentMediaType": (_text, "a string"),
}


def _misvalued(schema: Mapping[str, Any]) -> str | None:
    """Where a subschema of `schema` gives a validation keyword a value draft 2020-12 does
    not allow (_KEYWORD_VALUES); None if nowhere."""
    for node, at in _subschemas(schema):
        for key, (allowed, what) in _KEYWORD_VALUES.items():
            if key in node and not allowed(node[key]):
                where = f"{at}.{key}" if at else key
                return (
                    f"has a {key} that is not {what} ({where}), which Anthropic refuses on"
                    " every request (an input schema must be valid JSON Schema draft"
                    " 2020-12)"
                )
    return None


_JSON_KINDS = {str: "a string", int: "a number", float: "a number", list: "an array"}
_JSON_KINDS[type(None)] = "null"


def _malformed(schema: Mapping[str, Any]) -> str | None:
    """Where `schema` holds a non-schema at a schema position, or a `required` that is not
    a list of names; None if nowhere. Data keywords (enum, const, default, examples) are
    not looked into, nor a `dependencies` entry that is a list (draft 4's name list)."""
    pending: list[tuple[Any, str]] = [(schema, "")]
    while pending:
        node, at = pending.pop()
        if isinstance(node, bool):
            continue
        if not isinstance(node, dict):
            kind = _JSON_KINDS.get(type(node), "value")  # the kind, not the caller's text
            return f"holds {kind} where a schema goes ({at or 'its root'})"
        required = node.get("required")
        if required is not None and not (
            isinstance(required, list) and all(isinstance(r, str) for r in required)
        ):
            return f"has a required that is not a list of property names ({at or 'its root'})"
        for key, value in node.items():
            where = f"{at}.{key}" if at else key
            if key in _SCHEMA_MAPS:
                if not isinstance(value, dict):
                    return f"has a {key} that is not an object ({where})"
                # A dependencies entry may be a name list (draft 4): only its schemas are.
                pending += [
                    (v, f"{where}.{k}")
                    for k, v in value.items()
                    if key != "dependencies" or not isinstance(v, list)
                ]
            elif (key == "items" and isinstance(value, list)) or key in _SCHEMA_LISTS - {"items"}:
                if not isinstance(value, list):
                    return f"has a {key} that is not a list of schemas ({where})"
                pending += [(v, f"{where}[{n}]") for n, v in enumerate(value)]
            elif key in _SCHEMA_ONE:
                pending.append((value, where))
    return None


# The provider wraps each definition in a few tokens of its own (role markers, separators).
# Counted once per tool so the cap holds whatever the provider adds around the JSON.
PROVIDER_FRAMING_TOKENS = 8

# JSON Schema keywords whose value is a map of name -> subschema.
_SCHEMA_MAPS = frozenset(
    {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies"}
)
# Keywords whose value is one subschema.
_SCHEMA_ONE = frozenset(
    {
        "additionalProperties",
        "additionalItems",
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
    }
)
# Keywords whose value is a list of subschemas (`items` in its draft-4 tuple form too).
_SCHEMA_LISTS = frozenset({"allOf", "anyOf", "oneOf", "prefixItems", "items"})
# The three, for a walk of a schema elsewhere (core/plan.py: the names a schema declares).
SCHEMA_MAPS, SCHEMA_ONE, SCHEMA_LISTS = _SCHEMA_MAPS, _SCHEMA_ONE, _SCHEMA_LISTS

_SEPARATORS = re.compile(r"[\s_\-.]+")


def _same_words(title: str, name: str) -> bool:
    """ "Max Results" titles "max_results": a generator derived it from the name."""
    return _SEPARATORS.sub("", title).casefold() == _SEPARATORS.sub("", name).casefold()


def _empty(value: Any) -> bool:
    # False and 0 are meaningful defaults; only absence-like values are empty.
    return value is None or (isinstance(value, str | list | dict) and len(value) == 0)


def _visible(schema: Any, name: str | None) -> Any:
    """One schema position; `name` is the property or definition name that owns it."""
    if not isinstance(schema, dict):
        return schema  # a boolean schema, or malformed input passed through verbatim
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "title" and isinstance(value, str) and name and _same_words(value, name):
            continue
        if key == "default" and _empty(value):
            continue
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {k: _visible(v, k) for k, v in value.items()}
        elif key in _SCHEMA_ONE and isinstance(value, dict):
            out[key] = _visible(value, None)
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            out[key] = [_visible(v, None) for v in value]
        else:
            out[key] = value
    return out


def visible_input_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """The input schema as the model receives it (Rule 2).

    The root's title is always generated (a model class name); the tool's own name and
    description already say what the input is.
    """
    root = {k: v for k, v in schema.items() if k != "title"}
    visible = _visible(root, None)
    assert isinstance(visible, dict)
    return visible


def definition_item(tool: ToolSpec) -> ToolDefinitionItem:
    """The model-visible definition (row 5) of a pinned tool."""
    return ToolDefinitionItem(
        item_id=f"tool:{tool.name}",
        name=tool.name,
        description=escape_content(tool.description),
        input_schema_json=canonical_bytes(visible_input_schema(tool.input_schema)).decode("utf-8"),
    )


def _forms(item: ToolDefinitionItem) -> tuple[dict[str, Any], ...]:
    schema = json.loads(item.input_schema_json)
    return (
        {"name": item.name, "description": item.description, "input_schema": schema},
        {
            "type": "function",
            "name": item.name,
            "description": item.description,
            "parameters": schema,
            "strict": False,
        },
        ToolDefinition(item.name, item.description, item.input_schema_json).canonical(),
    )


def definition_tokens(item: ToolDefinitionItem, count: TokenCounter) -> int:
    """What one definition costs against the tool-definition class (Rule 3)."""
    largest = max(count(canonical_bytes(form).decode("utf-8")) for form in _forms(item))
    return largest + PROVIDER_FRAMING_TOKENS
