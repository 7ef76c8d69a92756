"""JSON-schema touches for Prefect's forms: the run form of a flow and the block editor.

Prefect renders a JSON schema as a form. Every optional pydantic field (``X | None``) becomes
``anyOf: [X, null]``, which the UI (3.9) shows as a row of type tabs with "None" selected and
the line 'Property is type "None"' under it. Dropping the ``null`` choice from the schema (never
from validation) turns it into a plain input: an empty field is left out of the values the UI
sends, and the model's default None applies. Pure: plain dicts, no Prefect import.
"""
from __future__ import annotations

from typing import Any, Callable

NULL = {"type": "null"}


def without_null(prop: dict[str, Any]) -> None:
    """Drop the ``null`` choice of an optional property in place (a lone choice left is merged
    into the property) and its ``default: null``."""
    variants = prop.get("anyOf")
    if not variants or NULL not in variants:
        return
    rest = [v for v in variants if v != NULL]
    if len(rest) == 1:
        del prop["anyOf"]
        for k, v in rest[0].items():
            prop.setdefault(k, v)
    else:
        prop["anyOf"] = rest
    if prop.get("default", 0) is None:
        del prop["default"]


def tidy_model(schema: dict[str, Any], resolve: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
    """Tidy a model's object schema and, through ``resolve`` (a ``$ref`` schema -> the referenced
    definition), every model it refers to: optional properties lose ``null``."""
    seen: set[int] = set()

    def walk(node: dict[str, Any]) -> None:
        if id(node) in seen:
            return
        seen.add(id(node))
        required = set(node.get("required", ()))
        for name, prop in (node.get("properties") or {}).items():
            if name not in required:
                without_null(prop)
            for sub in [prop, *(prop.get("anyOf") or []), prop.get("items") or {}]:
                if "$ref" in sub:
                    walk(resolve(sub))

    walk(schema)


def tidy_block_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """A block's ``model_json_schema()`` for the block editor: no ``null`` choice in the block's
    optional fields nor in the models it holds. Every definition is tidied, referenced or not:
    Prefect drops the ``additionalProperties`` reference of a ``dict[str, Model]`` field but keeps
    the model's definition, which the editor still renders for the dict's values."""
    defs = schema.get("definitions") or schema.get("$defs") or {}
    resolve = lambda ref: defs.get(ref["$ref"].rsplit("/", 1)[-1], {})   # noqa: E731
    for node in [schema, *defs.values()]:
        tidy_model(node, resolve)
    return schema
