"""JSON Schema documents as msgspec writes them, reshaped (sans-IO): `$ref`s inlined where a
definition can be, and renamed where it cannot.

msgspec's `msgspec.json.schema` puts every Struct, dataclass, TypedDict and Enum under `$defs`
at the root and refers to it as `#/$defs/NAME`. MCP hosts (and the model APIs behind them)
take schemas without `$ref` best, so the worker inlines them (`inlined`, `rooted`:
broker/worker/tools.py); the broker moves the definitions that stay (a type that refers to
itself) into an OpenRPC document's `components` (`map_refs`: broker/catalog.py).

Walks follow the keywords that hold subschemas (JSON Schema 2020-12's core and applicator
vocabularies, msgspec's dialect); the values of every other keyword (`default`, `const`,
`enum`, `examples`...) are data, never walked: a default that looks like a `$ref` stays as it is.
"""

from __future__ import annotations

import typing
from collections.abc import Callable

__all__ = ["DEFS", "INLINE_MOST", "Schema", "inlined", "map_refs", "rooted", "unconstrained"]

Schema = dict[str, object]

_ANNOTATING = frozenset({"title", "description", "default", "examples", "$comment", "deprecated"})


def unconstrained(schema: Schema) -> bool:
    """Whether any JSON value is valid against `schema`: it has annotating keywords only, or
    an `anyOf` with an arm that has (`msgspec.Raw | None`)."""
    arms = schema.get("anyOf")
    if isinstance(arms, list) and any(isinstance(arm, dict) and unconstrained(arm) for arm in arms):
        return set(schema) - {"anyOf"} <= _ANNOTATING
    return set(schema) <= _ANNOTATING


# Where JSON Schema keywords hold subschemas: one, a map of them by name, a list of them.
_ONE = ("items", "additionalProperties", "not", "contains", "propertyNames", "if", "then", "else",
        "unevaluatedItems", "unevaluatedProperties", "contentSchema")
_BY_NAME = ("properties", "patternProperties", "dependentSchemas")
_LISTED = ("anyOf", "oneOf", "allOf", "prefixItems")
DEFS = "#/$defs/"  # the `$ref` prefix of a definition msgspec writes


INLINE_MOST = 20_000
"""Schema nodes (objects and arrays) an inlined schema may hold: past it, the definitions
used more than once stay under `$defs` (a type used twice in a type used twice... inlined
doubles at each level)."""


class _Sprawling(Exception):
    """Inlining went past `INLINE_MOST` nodes."""


def inlined(schema: Schema) -> Schema:
    """`schema` (msgspec's: definitions under `$defs` at the root, `$ref`s as `#/$defs/NAME`)
    with each `$ref` replaced by its definition, merged with the keywords beside it (a
    field's `default`, `description`). A definition that refers to itself, directly or not,
    cannot be inlined: it stays under `$defs`, with the `$ref`s to it; so do those used more
    than once when inlining them all would make more than `INLINE_MOST` nodes. msgspec's
    `discriminator` (OpenAPI's, not JSON Schema's, and made of `$ref`s) is dropped: the tag
    is in each variant's properties."""
    defs = typing.cast(dict[str, Schema], schema.get("$defs", {}))
    cyclic = _cyclic(defs)
    try:
        return _inline(schema, defs, cyclic)
    except _Sprawling:
        uses: dict[str, int] = {}
        for node in (schema, *defs.values()):
            _refs(node, uses)
        return _inline(schema, defs, cyclic | {name for name, n in uses.items() if n > 1})


def _inline(schema: Schema, defs: dict[str, Schema], kept_names: set[str]) -> Schema:
    """`inlined`'s walk: every `$ref` inlined but those to `kept_names`, kept under `$defs`."""
    kept: dict[str, Schema] = {}
    done: dict[str, tuple[Schema, int]] = {}  # an inlined definition: (its walk, the nodes it made)
    made = 0

    def walk(node: object) -> object:
        nonlocal made
        if isinstance(node, list):
            made += 1
            return [walk(item) for item in node]
        if not isinstance(node, dict):
            return node  # (true, false: schemas too)
        made += 1
        if made > INLINE_MOST:
            raise _Sprawling
        ref = node.get("$ref")
        target = ref[len(DEFS):] if isinstance(ref, str) and ref.startswith(DEFS) else None
        out: Schema = {}
        if target is not None and target in defs:
            if target in kept_names:
                if target not in kept:
                    kept[target] = {}  # (placed first: a cycle comes back here)
                    kept[target] = typing.cast(Schema, walk(defs[target]))
                out["$ref"] = ref
            else:
                if target not in done:
                    before = made
                    body = typing.cast(Schema, walk(defs[target]))
                    done[target] = body, made - before
                else:  # (its walk shared, as the nodes an encoding writes again)
                    body, size = done[target]
                    made += size
                    if made > INLINE_MOST:
                        raise _Sprawling
                out.update(body)
        for key, value in node.items():
            if key in ("$defs", "discriminator") or (key == "$ref" and target is not None and target in defs):
                continue
            if key in _ONE:
                out[key] = walk(value)
            elif key in _BY_NAME and isinstance(value, dict):
                out[key] = {k: walk(v) for k, v in value.items()}
            elif key in _LISTED and isinstance(value, list):
                out[key] = [walk(v) for v in value]
            else:
                out[key] = value
        return out

    body = typing.cast(Schema, walk(schema))
    if kept:
        body["$defs"] = kept
    return body


def rooted(schema: Schema) -> Schema:
    """`inlined(schema)` with a root that is its own schema, not a `$ref`: a self-referring
    root definition is copied onto the root (its `$defs` entry kept for the inner `$ref`s),
    as FastMCP's `_inline_root_ref` does."""
    out = inlined(schema)
    ref = out.get("$ref")
    defs = typing.cast(dict[str, Schema], out.get("$defs", {}))
    if isinstance(ref, str) and ref.startswith(DEFS) and ref[len(DEFS):] in defs:
        siblings = {k: v for k, v in out.items() if k not in ("$ref", "$defs")}
        out = {**defs[ref[len(DEFS):]], **siblings, "$defs": defs}
    return out


def _cyclic(defs: dict[str, Schema]) -> set[str]:
    """The definitions of `defs` that reach themselves through `$ref`s."""
    edges = {name: _refs(body) for name, body in defs.items()}
    out = set()
    for start in defs:
        seen: set[str] = set()
        todo = list(edges[start])
        while todo:
            name = todo.pop()
            if name == start:
                out.add(start)
                break
            if name in seen or name not in edges:
                continue
            seen.add(name)
            todo.extend(edges[name])
    return out


def _refs(node: object, uses: dict[str, int] | None = None) -> set[str]:
    """The definition names `node`'s subschemas `$ref` (walked as `inlined` walks); each
    `$ref` counted in `uses` if given."""
    found: set[str] = set()
    todo = [node]
    while todo:
        item = todo.pop()
        if isinstance(item, list):
            todo.extend(item)
            continue
        if not isinstance(item, dict):
            continue
        ref = item.get("$ref")
        if isinstance(ref, str) and ref.startswith(DEFS):
            found.add(ref[len(DEFS):])
            if uses is not None:
                uses[ref[len(DEFS):]] = uses.get(ref[len(DEFS):], 0) + 1
        for key, value in item.items():
            if key in _ONE or key in _LISTED:
                todo.append(value)
            elif key in _BY_NAME and isinstance(value, dict):
                todo.extend(value.values())
    return found


def map_refs(schema: object, rename: Callable[[str], str]) -> object:
    """A copy of `schema` with each subschema's `$ref` that names a definition
    (`#/$defs/NAME`) made `rename(NAME)`; other `$ref`s and all data as they are."""
    if isinstance(schema, list):
        return [map_refs(item, rename) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out: Schema = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and value.startswith(DEFS):
            out[key] = rename(value[len(DEFS):])
        elif key in _ONE:
            out[key] = map_refs(value, rename)
        elif key in _BY_NAME and isinstance(value, dict):
            out[key] = {k: map_refs(v, rename) for k, v in value.items()}
        elif key in _LISTED and isinstance(value, list):
            out[key] = [map_refs(v, rename) for v in value]
        else:
            out[key] = value
    return out
