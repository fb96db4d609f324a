"""The broker's catalogue of the workers' methods (sans-IO): MCP tools and the OpenRPC document.

A `Catalog` is made from the `wire.MethodInfo` list of the HELLO that installs a method
table (`Dispatcher.set_methods`: the first worker's at the start, a reload's new workers' at
its swap, even when only their metadata changed), and replaced whole by the next one: the
dispatcher's `catalog` is always the table its calls are routed by. Before any worker said
HELLO it is empty. A worker restarted alone (a crash's restart) on code changed on disk with the
same method names joins as it does today, and its new titles or docstrings are not seen here:
a reload (SIGHUP) deploys them, to every worker and to the catalogue at once. Everything it answers is built once: `tools()` when it is made,
`openrpc()` at the first `rpc.discover` of each set of hidden methods (a caller's
`policy.Policy.denied`).

`tools()` are MCP `Tool` objects (2025-11-25 and 2026-07-28 schemas, server/tools): `name`,
`title`, `description` (the docstring), `inputSchema`, `outputSchema`, `annotations`, absent
ones left out, by name. `openrpc()` is the OpenRPC 1.3.2 document (https://spec.open-rpc.org)
that `rpc.discover` answers with (broker/replies.py, `Replies._discover`):

    openrpc   "1.3.2"
    info      {"title": "rpc-broker", "version": the package's version}
    methods   by name, `rpc.discover` among them (the specification's own method object for it,
              "Service Discovery Method"): name, summary (the title), description (the
              docstring), params (a ContentDescriptor per parameter by name: name, schema,
              required), result ({"name": "result", "schema": the return type's, {} if
              unknown}), paramStructure ("either"; "by-name" beside keyword-only parameters,
              "by-position" for positional-only ones beside **kwargs). A handler's *args and
              **kwargs have no ContentDescriptor (OpenRPC's params are named, fixed); a
              `raw_params` handler's params are not known ([]).
    components  {"schemas": ...} only for types that refer to themselves, which cannot be
              inlined: `$ref`s to "#/components/schemas/NAME".
"""

from __future__ import annotations

import functools
import re
import typing
from collections.abc import Iterable

import msgspec

from broker import version
from broker.schemas import Schema, map_refs
from broker.wire import MethodInfo

__all__ = ["DISCOVER", "OPENRPC_VERSION", "Catalog"]

DISCOVER: typing.Final = "rpc.discover"
"""OpenRPC's service discovery method (the specification's "Service Discovery Method"),
answered by the broker itself; its `method` label in the metrics."""

OPENRPC_VERSION: typing.Final = "1.3.2"

_DISCOVER_METHOD: Schema = {  # (the specification's method object for it, as it gives it)
    "name": DISCOVER,
    "description": "Returns an OpenRPC schema as a description of this service",
    "params": [],
    "result": {"name": "OpenRPC Schema",
               "schema": {"$ref": "https://raw.githubusercontent.com/open-rpc/meta-schema/master/schema.json"}},
}
DOCUMENTS_KEPT = 64
"""OpenRPC documents a catalogue keeps encoded, one per set of hidden methods (a token's
policy; callers with no token of their own share one): past it, all are dropped and made again."""
_COMPONENT = re.compile(r"[^A-Za-z0-9_.-]")  # (a component's name: characters a JSON pointer and the meta-schema take)


class Catalog:
    """The methods of one method table, as MCP tools and as an OpenRPC document.

    methods: the `wire.MethodInfo`s of a HELLO (any order; names unique, as a HELLO's are).
    """

    __slots__ = ("_documents", "_methods", "_tool_list", "_tools")

    def __init__(self, methods: Iterable[MethodInfo] = ()) -> None:
        self._methods = {m.name: m for m in methods}
        self._tools = {name: self._methods[name] for name in sorted(self._methods) if self._methods[name].tool}
        self._tool_list = [_tool(m) for m in self._tools.values()]
        self._documents: dict[frozenset[str], bytes] = {}

    def __len__(self) -> int:
        return len(self._methods)

    def names(self) -> list[str]:
        """Every method's name, in the HELLO's order."""
        return list(self._methods)

    def tools(self, hidden: typing.AbstractSet[str] = frozenset()) -> list[dict[str, object]]:
        """The MCP `Tool` objects of the tools, by name, but those named in `hidden` (a
        caller's denied methods). A new list of shared dicts: not to be changed."""
        if not hidden:
            return list(self._tool_list)
        return [tool for tool in self._tool_list if tool["name"] not in hidden]

    def tool(self, name: str) -> MethodInfo | None:
        """The `MethodInfo` of tool `name`; None for a name no worker registered and for a
        method that is not a tool."""
        return self._tools.get(name)

    def openrpc(self, hidden: typing.AbstractSet[str] = frozenset()) -> bytes:
        """The OpenRPC document (see the module docstring) as JSON, without the methods named
        in `hidden`; encoded once for each such set."""
        key = frozenset(hidden).intersection(self._methods) if hidden else frozenset()
        document = self._documents.get(key)
        if document is None:
            if len(self._documents) >= DOCUMENTS_KEPT:
                self._documents.clear()
            document = self._documents[key] = msgspec.json.encode(self._document(key))
        return document

    def _document(self, hidden: frozenset[str]) -> Schema:
        components: dict[str, Schema] = {}
        methods = [_method(self._methods[name], components) for name in sorted(self._methods) if name not in hidden]
        methods.append(_DISCOVER_METHOD)
        methods.sort(key=lambda m: typing.cast(str, m["name"]))
        document: Schema = {"openrpc": OPENRPC_VERSION, "info": {"title": "rpc-broker", "version": _version()},
                            "methods": methods}
        if components:
            document["components"] = {"schemas": components}
        return document


@functools.cache
def _version() -> str:
    return version()


def _tool(m: MethodInfo) -> dict[str, object]:
    """MCP's `Tool` object of `m`, absent fields left out."""
    tool: dict[str, object] = {"name": m.name}
    if m.title:
        tool["title"] = m.title
    if m.doc:
        tool["description"] = m.doc
    tool["inputSchema"] = m.input_schema if m.input_schema is not None else {"type": "object"}
    if m.output_schema is not None:
        tool["outputSchema"] = m.output_schema
    if m.annotations:
        tool["annotations"] = m.annotations
    return tool


def _method(m: MethodInfo, components: dict[str, Schema]) -> Schema:
    """OpenRPC's Method object of `m`; the definitions its schemas keep go into `components`."""
    out: Schema = {"name": m.name}
    if m.title:
        out["summary"] = m.title
    if m.doc:
        out["description"] = m.doc
    params: list[Schema] = []
    if m.input_schema is not None:
        inputs = _components(m.input_schema, components)
        required = inputs.get("required", [])
        for name, schema in typing.cast(dict[str, object], inputs.get("properties", {})).items():
            params.append({"name": name, "schema": schema, "required": name in typing.cast(list[str], required)})
    out["params"] = params
    out["result"] = {"name": "result", "schema": _components(m.result_schema, components)}
    out["paramStructure"] = m.param_structure
    return out


def _components(schema: Schema, components: dict[str, Schema]) -> Schema:
    """`schema` with the definitions it keeps under `$defs` (types that refer to themselves)
    moved into `components`, its `$ref`s to them made "#/components/schemas/NAME". A name
    already there for another definition takes a suffix ("Node_2"): all of this schema's
    definitions the same one, so that their `$ref`s to each other stay right."""
    defs = typing.cast(dict[str, Schema], schema.get("$defs"))
    if not defs:
        return schema
    for n in range(1, 1 + len(components) + 1):
        names = {name: _COMPONENT.sub("_", name) + ("" if n == 1 else f"_{n}") for name in defs}

        def rename(name: str, names: dict[str, str] = names) -> str:
            return f"#/components/schemas/{names.get(name, name)}"

        moved = {names[name]: typing.cast(Schema, map_refs(body, rename)) for name, body in defs.items()}
        if all(components.get(key, body) == body for key, body in moved.items()):
            components.update(moved)
            return typing.cast(Schema, map_refs({k: v for k, v in schema.items() if k != "$defs"}, rename))
    raise AssertionError("unreachable: a suffix past every component's is free")
