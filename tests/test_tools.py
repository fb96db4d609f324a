"""MCP tool metadata (issue 13, items 1 and 4): `Registry.method(tool=..., title=..., annotations=...)`,
the JSON Schemas the worker makes of a handler's hints (broker/worker/tools.py, broker/schemas.py),
the HELLO that carries them from a real worker process, and the broker's catalogue of them
(broker/catalog.py, sans-IO). The schemas are checked as JSON Schema 2020-12 with `jsonschema`,
and against the values the handlers take and give. `rpc.discover` on a real broker:
tests/test_discover.py.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import socket
import subprocess
import sys
import types
import typing
from pathlib import Path

import jsonschema
import msgspec
import pytest
from conftest import ROOT
from test_worker_links import accept_hello

from broker import wire
from broker.catalog import DISCOVER, Catalog
from broker.schemas import INLINE_MOST, inlined
from broker.worker import Registry, ToolAnnotations, encode_result
from broker.worker.results import checked_result
from broker.worker.tools import method_info
from tests.apps import toolbox

_Validator = jsonschema.Draft202012Validator


def infos(registry: Registry) -> dict[str, wire.MethodInfo]:
    return {m.name: method_info(m) for m in registry.methods()}


def valid(schema: dict[str, object], value: object) -> bool:
    _Validator.check_schema(schema)
    return _Validator(schema).is_valid(value)


# -- registration -----------------------------------------------------------------------------


def test_the_registry_default_says_which_methods_are_tools_and_a_method_may_say_otherwise():
    plain, tools = Registry(), Registry(tools=True)
    for registry in (plain, tools):
        registry.method(lambda a: a, name="asis")
        registry.method(lambda a: a, name="yes", tool=True)
        registry.method(lambda a: a, name="no", tool=False)
    assert {m.name: m.tool for m in plain.methods()} == {"asis": False, "yes": True, "no": False}
    assert {m.name: m.tool for m in tools.methods()} == {"asis": True, "yes": True, "no": False}
    with pytest.raises(TypeError, match=r"Registry\(tools=\.\.\.\) is a str, not True or False"):
        Registry(tools="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="tool= is an int"):
        plain.method(lambda: 0, name="one", tool=1)  # type: ignore[call-overload]
    with pytest.raises(TypeError, match="title= is an int, not a str"):
        plain.method(lambda: 0, name="two", title=2)  # type: ignore[call-overload]


@pytest.mark.parametrize(("name", "suggested"), [
    ("math.add", "math_add"), ("x" * 65, "x" * 64), ("with space", "with_space"), ("caf\u00e9", "caf_"),
    ("a/b", "a_b"),
])
def test_a_tool_s_name_is_refused_unless_it_fits_what_hosts_take_saying_what_to_do(name, suggested):
    registry = Registry(tools=True)
    with pytest.raises(ValueError) as refused:
        registry.method(lambda: 0, name=name)
    said = str(refused.value)
    assert f"method {name!r} cannot be a tool" in said and f"(name={suggested!r})" in said and "tool=False" in said
    assert name not in registry
    registry.method(lambda: 0, name=name, tool=False)  # (any other method keeps today's rule)
    assert name in registry


@pytest.mark.parametrize("name", ["a", "A-b_9", "x" * 64, "get_data"])
def test_names_of_letters_digits_underscores_and_hyphens_up_to_64_are_tools(name):
    registry = Registry(tools=True)
    registry.method(lambda: 0, name=name)
    assert registry.methods()[0].tool


def test_annotations_as_a_struct_or_as_mcp_s_dict_make_the_same_json_object():
    registry = Registry(tools=True)
    registry.method(lambda: 0, name="s", annotations=ToolAnnotations(read_only_hint=True, title="T",
                                                                       open_world_hint=False))
    registry.method(lambda: 0, name="d", annotations={"readOnlyHint": True, "title": "T", "openWorldHint": False})
    registry.method(lambda: 0, name="none", annotations={})
    got = infos(registry)
    assert got["s"].annotations == got["d"].annotations == {"title": "T", "readOnlyHint": True, "openWorldHint": False}
    assert got["none"].annotations is None
    assert msgspec.json.encode(ToolAnnotations(idempotent_hint=False)) == b'{"idempotentHint":false}'


@pytest.mark.parametrize(("annotations", "error", "said"), [
    ({"read_only_hint": True}, ValueError, "unknown key 'read_only_hint' (did you mean 'readOnlyHint'?)"),
    ({"readonlyHint": True}, ValueError, "unknown key 'readonlyHint' (did you mean 'readOnlyHint'?)"),
    ({"cost": 3}, ValueError, "unknown key 'cost'; MCP's ToolAnnotations has title, readOnlyHint, destructiveHint, "
                              "idempotentHint, openWorldHint"),
    ({"readOnlyHint": "yes"}, ValueError, "Expected `bool | null`, got `str` - at `$.readOnlyHint`"),
    ({"title": 5}, ValueError, "Expected `str | null`, got `int` - at `$.title`"),
    (ToolAnnotations(destructive_hint=1), ValueError, "at `$.destructiveHint`"),  # type: ignore[arg-type]
    ([("readOnlyHint", True)], TypeError, "annotations is list, not a dict or a broker.worker.ToolAnnotations"),
])
def test_annotations_with_unknown_keys_or_wrong_types_are_refused_saying_which(annotations, error, said):
    registry = Registry(tools=True)
    with pytest.raises(error) as refused:
        registry.method(lambda: 0, name="t", annotations=annotations)
    assert said in str(refused.value) and str(refused.value).startswith("method 't': annotations")
    assert "t" not in registry


def test_annotations_on_a_method_that_is_not_a_tool_are_refused():
    with pytest.raises(ValueError, match=r"annotations describe a tool, and it is not one: register it with tool=True"):
        Registry().method(lambda: 0, name="t", annotations={"readOnlyHint": True})


def star(first: int, *rest: int) -> int:
    return first + sum(rest)


def beside(a: int, /, **more: int) -> int:
    return a


def only(a: int, /, b: int = 0) -> int:
    return a + b


def test_a_tool_s_arguments_come_by_name_so_star_args_and_unnamed_positional_only_are_refused():
    registry = Registry(tools=True)
    with pytest.raises(TypeError, match=r"method 'star': a tool's arguments come by name only \(MCP\), so \*rest could "
                                        r"never be given: take a list instead \(rest: list\[\.\.\.\]\), or register "
                                        "it with tool=False"):
        registry.method(star)
    with pytest.raises(TypeError, match="beside \\*\\*kwargs its positional-only parameter 'a' cannot be named"):
        registry.method(beside)
    registry.method(only)  # (positional-only without **kwargs: bound by name too)
    registry.method(star, tool=False)
    registry.method(beside, tool=False)
    got = infos(registry)
    assert got["only"].input_schema == {"type": "object", "properties": {"a": {"type": "integer"},
                                        "b": {"type": "integer", "default": 0}}, "required": ["a"],
                                        "additionalProperties": False}
    assert (got["only"].param_structure, got["star"].param_structure, got["beside"].param_structure) == \
        ("either", "either", "by-position")


def test_a_raw_params_tool_takes_any_arguments_object():
    registry = Registry(tools=True)
    registry.method(lambda params: params, name="raw", raw_params=True)
    info = infos(registry)["raw"]
    assert info.tool and info.input_schema == {"type": "object"} and info.output_schema is None


class Opaque:
    """No JSON form (an example in a schema must have one)."""


def test_a_tool_whose_params_or_result_have_no_json_schema_is_refused_any_other_method_served_without():
    def take(n: typing.Annotated[int, msgspec.Meta(examples=[Opaque()])] = 1) -> int:
        return n

    def give() -> typing.Annotated[int, msgspec.Meta(description="caf\udce9")]:
        return 1

    registry = Registry(tools=True)
    with pytest.raises(TypeError, match=r"method 'take': its params have no JSON Schema, which a tool's inputSchema "
                                        r"needs \(its schema has no JSON form: .*\): hint them"):
        registry.method(take)
    with pytest.raises(TypeError, match=r"method 'give': its return type has no JSON Schema, which a tool's "
                                        "outputSchema needs"):
        registry.method(give)
    registry.method(take, tool=False)
    registry.method(give, tool=False)
    got = infos(registry)
    assert got["take"].input_schema is None and got["take"].params_schema == {}
    assert got["give"].result_schema == {} and got["give"].output_schema is None
    msgspec.json.encode(wire.Hello(pid=1, slot=0, methods=list(got.values()), concurrency=1))


# -- schemas ----------------------------------------------------------------------------------


def test_input_schemas_are_objects_with_refs_inlined_and_only_the_params_the_signature_takes():
    got = infos(toolbox.registry)
    assert got["greet"].input_schema == {
        "type": "object",
        "properties": {"name": {"type": "string"}, "punctuation": {"type": "string", "default": "!"}},
        "required": ["name"], "additionalProperties": False,
    }
    point = {"title": "Point", "description": "A point in the plane.", "type": "object",
             "properties": {"x": {"type": "number"}, "y": {"type": "number"}}, "required": ["x", "y"]}
    midpoint = got["midpoint"].input_schema
    assert midpoint == {"type": "object", "properties": {"a": point, "b": point}, "required": ["a", "b"],
                        "additionalProperties": False}
    assert valid(midpoint, {"a": {"x": 1, "y": 2}, "b": {"x": 3.5, "y": -1}})
    assert not valid(midpoint, {"a": {"x": 1, "y": 2}, "b": {"x": 3.5, "y": -1}, "c": 1})
    assert not valid(midpoint, {"a": {"x": 1}, "b": {"x": 3.5, "y": -1}})
    tally = got["tally"].input_schema
    assert tally is not None and tally["additionalProperties"] == {"type": "integer"}
    assert valid(tally, {"text": "a b a", "a": 2}) and not valid(tally, {"text": "a", "a": "heavy"})


def test_a_type_that_refers_to_itself_stays_under_defs_and_the_schema_still_validates_it():
    got = infos(toolbox.registry)
    leaves = got["leaves"].input_schema
    assert leaves is not None and leaves["properties"] == {"tree": {"$ref": "#/$defs/Tree"}}
    assert list(typing.cast(dict[str, object], leaves["$defs"])) == ["Tree"]
    tree = {"label": "r", "children": [{"label": "a"}, {"label": "b", "children": [{"label": "c"}]}]}
    assert valid(leaves, {"tree": tree})
    assert not valid(leaves, {"tree": {"label": "r", "children": [{"label": 5}]}})
    grow = got["grow"]  # (as a result: its definition copied onto the root, an object there)
    assert grow.output_schema is not None and grow.output_schema["type"] == "object" and not grow.wrap_result
    assert "Tree" in typing.cast(dict[str, object], grow.output_schema["$defs"])
    assert valid(grow.output_schema, json.loads(encode_result(toolbox.grow("r", 3))))


class Shade(enum.Enum):
    DARK = "dark"


class Box(typing.TypedDict):
    shade: Shade


def anything(**extra: typing.Any) -> typing.Any:
    return extra


def nothing() -> None:
    pass


def unsaid(a):  # type: ignore[no-untyped-def]
    return a


def maybe() -> int | None:
    return None


def boxed() -> Box:
    return {"shade": Shade.DARK}


@pytest.mark.parametrize(("fn", "output", "wrap"), [
    (toolbox.midpoint, "object", False),
    (toolbox.tally, "object", False),  # (dict[str, int]: an object, as FastMCP)
    (boxed, "object", False),
    (toolbox.greet, {"type": "object", "properties": {"result": {"type": "string"}}, "required": ["result"]}, True),
    (toolbox.leaves, {"type": "object", "properties": {"result": {"type": "array", "items": {"type": "string"}}},
                      "required": ["result"]}, True),
    (maybe, {"type": "object", "properties": {"result": {"anyOf": [{"type": "integer"}, {"type": "null"}]}},
             "required": ["result"]}, True),
    (anything, None, False),
    (nothing, None, False),
    (unsaid, None, False),
    (toolbox.raw, None, False),
])
def test_output_schemas_are_the_result_s_object_or_wrap_it_as_result_and_none_when_it_says_nothing(fn, output, wrap):
    registry = Registry(tools=True)
    registry.method(fn, raw_params=fn is toolbox.raw)
    info = next(iter(infos(registry).values()))
    if output == "object":
        assert info.output_schema is not None and info.output_schema["type"] == "object"
        assert info.output_schema == info.result_schema
    else:
        assert info.output_schema == output
    assert info.wrap_result is wrap
    if info.output_schema is not None:
        _Validator.check_schema(info.output_schema)


def test_kwargs_of_any_value_leave_the_arguments_open():
    registry = Registry(tools=True)
    registry.method(anything)
    assert infos(registry)["anything"].input_schema == {"type": "object", "properties": {}}


def test_structured_content_as_the_worker_encodes_results_validates_against_the_output_schema():
    got = infos(toolbox.registry)
    cases = [("midpoint", toolbox.midpoint(toolbox.Point(0, 0), toolbox.Point(2, 4))), ("greet", toolbox.greet("x")),
             ("tally", toolbox.tally("a b a", a=3)), ("leaves", toolbox.leaves(toolbox.grow("r", 2)))]
    for name, value in cases:
        info = got[name]
        content = json.loads(encode_result(value))
        structured = {"result": content} if info.wrap_result else content
        assert info.output_schema is not None and valid(info.output_schema, structured), name
        assert valid(info.result_schema, content)
    assert got["raw"].result_schema == {"anyOf": [{}, {"type": "null"}]} and got["raw"].output_schema is None


def test_result_schemas_are_the_return_type_s_and_empty_when_unknown():
    got = infos(toolbox.registry)
    assert got["greet"].result_schema == {"type": "string"}
    assert got["ns.total"].result_schema == {"type": "integer"} and not got["ns.total"].tool
    registry = Registry()
    registry.method(unsaid)
    registry.method(nothing)
    assert infos(registry)["unsaid"].result_schema == {} and infos(registry)["nothing"].result_schema == {"type": "null"}


def test_keyword_only_parameters_make_params_by_name_only():
    got = infos(toolbox.registry)
    assert got["greet"].param_structure == "by-name" and got["midpoint"].param_structure == "either"


def test_a_type_used_twice_in_a_type_used_twice_is_not_inlined_past_a_bound():
    """Inlined, 30 levels of a Struct holding two of the one below it would be 2**30 copies:
    past INLINE_MOST nodes, the definitions used more than once stay under `$defs`."""
    kind: object = int
    for level in range(30):
        kind = msgspec.defstruct(f"Level{level}", [("left", kind), ("right", kind)])
    registry = Registry(tools=True)

    def deep(top: object) -> None:
        pass

    deep.__annotations__ = {"top": kind, "return": None}
    registry.method(deep)
    schema = infos(registry)["deep"].input_schema
    assert schema is not None and len(msgspec.json.encode(schema)) < 20_000
    assert len(typing.cast(dict[str, object], schema["$defs"])) == 29  # (Level0..28: each used twice)
    _Validator.check_schema(schema)
    assert not _Validator(schema).is_valid({"top": {"left": 1, "right": 1}})  # (a Level28 each)
    assert INLINE_MOST >= 1000


def test_inlining_walks_subschemas_only_never_data_nor_names():
    schema = {
        "$defs": {"P": {"type": "integer"}},
        "type": "object",
        "properties": {
            "$ref": {"$ref": "#/$defs/P", "default": 3},
            "$defs": {"const": {"$ref": "#/$defs/P"}},
            "c": {"enum": [{"$ref": "#/$defs/P"}], "examples": [{"$defs": {}}]},
        },
        "anyOf": [{"$ref": "#/$defs/P"}, True],
        "discriminator": {"mapping": {"p": "#/$defs/P"}},
    }
    assert inlined(schema) == {
        "type": "object",
        "properties": {
            "$ref": {"type": "integer", "default": 3},
            "$defs": {"const": {"$ref": "#/$defs/P"}},
            "c": {"enum": [{"$ref": "#/$defs/P"}], "examples": [{"$defs": {}}]},
        },
        "anyOf": [{"type": "integer"}, True],
    }


# -- check-app and the HELLO of a real worker process -----------------------------------------


def test_check_app_says_which_methods_are_tools():
    done = subprocess.run([sys.executable, "-m", "broker", "check-app", "tests.apps.toolbox:registry"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120,
                          env={k: v for k, v in os.environ.items() if not k.startswith("RPC_BROKER_")})
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[-1] == "tools: greet, grow, leaves, midpoint, raw, tally"
    rows = {line.split("(")[0].strip(): line for line in lines[1:-1]}
    assert rows["greet"].endswith("sync, tool") and rows["raw"].endswith("sync, raw params, tool")
    assert rows["ns.total"].endswith("sync")


def test_a_real_worker_process_says_hello_with_its_tools_and_the_catalogue_lists_them(tmp_path: Path):
    """A worker started as the broker starts one (`python -m broker.worker`), its HELLO read off
    a Unix socket by the wire's own decoder: what it carries makes the catalogue's MCP tools."""
    path = str(tmp_path / "w.sock")
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(path)
        server.listen(1)
        server.settimeout(60)
        proc = subprocess.Popen([sys.executable, "-m", "broker.worker", "--socket", path, "--slot", "0",
                                 "--app", "tests.apps.toolbox:registry", "--parent-pid", str(os.getpid())],
                                cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            conn, hello, _ = accept_hello(server)
            with conn:
                conn.sendall(wire.encode_frame(wire.Kind.BYE, 0))
            assert proc.wait(60) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
            assert proc.stderr is not None
            proc.stderr.close()
    assert hello.pid == proc.pid
    by_name = {m.name: m for m in hello.methods}
    assert by_name == infos(toolbox.registry)  # (the worker's own description, whole, over the wire)
    greet = by_name["greet"]
    assert (greet.tool, greet.title, greet.annotations, greet.doc) == (
        True, "Greet", {"readOnlyHint": True, "openWorldHint": False}, "Say hello to `name`.")
    catalog = Catalog(hello.methods)
    tools = catalog.tools()
    assert [t["name"] for t in tools] == ["greet", "grow", "leaves", "midpoint", "raw", "tally"]
    assert tools[0] == {"name": "greet", "title": "Greet", "description": "Say hello to `name`.",
                        "inputSchema": greet.input_schema, "outputSchema": greet.output_schema,
                        "annotations": {"readOnlyHint": True, "openWorldHint": False}}
    assert "outputSchema" not in tools[4] and "title" not in tools[4] and "annotations" not in tools[4]
    assert catalog.tool("greet") is by_name["greet"] and catalog.tool("ns.total") is None
    assert catalog.tool("nope") is None


def test_a_hello_without_the_tool_fields_still_decodes_with_their_defaults():
    old = b'{"pid": 7, "slot": 0, "methods": [{"name": "add", "params_schema": {}, "doc": "a + b"}], ' \
          b'"concurrency": 1, "wire": %d}' % wire.VERSION
    info = wire.decode_hello(old).methods[0]
    assert info == wire.MethodInfo("add", {}, "a + b")
    assert (info.tool, info.title, info.annotations, info.input_schema, info.output_schema, info.wrap_result,
            info.result_schema, info.param_structure) == (False, None, None, None, None, False, {}, "either")
    assert msgspec.json.encode(wire.MethodInfo("add")) == b'{"name":"add"}'  # (defaults left out of a HELLO)


# -- the catalogue (sans-IO) --------------------------------------------------------------------


def test_an_empty_catalogue_lists_no_tool_and_a_document_of_rpc_discover_alone():
    catalog = Catalog()
    assert catalog.tools() == [] and catalog.tool("add") is None and len(catalog) == 0
    document = json.loads(catalog.openrpc())
    assert document["openrpc"] == "1.3.2" and document["info"]["title"] == "rpc-broker"
    assert [m["name"] for m in document["methods"]] == [DISCOVER] and "components" not in document


def test_the_openrpc_document_is_encoded_once_per_set_of_hidden_methods():
    catalog = Catalog(infos(toolbox.registry).values())
    whole = catalog.openrpc()
    assert catalog.openrpc() is whole and catalog.openrpc(set()) is whole
    assert catalog.openrpc({"not-registered"}) is whole  # (only registered names change it)
    hidden = catalog.openrpc({"greet", "midpoint"})
    assert catalog.openrpc(frozenset({"midpoint", "greet"})) is hidden
    names = [m["name"] for m in json.loads(hidden)["methods"]]
    assert names == ["grow", "leaves", "ns.total", "raw", DISCOVER, "tally"]
    assert [t["name"] for t in catalog.tools({"greet", "raw"})] == ["grow", "leaves", "midpoint", "tally"]


def test_methods_are_described_by_name_with_their_params_result_and_structure():
    document = json.loads(Catalog(infos(toolbox.registry).values()).openrpc())
    methods = {m["name"]: m for m in document["methods"]}
    assert [m["name"] for m in document["methods"]] == sorted(methods)
    assert methods["greet"] == {
        "name": "greet", "summary": "Greet", "description": "Say hello to `name`.",
        "params": [{"name": "name", "schema": {"type": "string"}, "required": True},
                   {"name": "punctuation", "schema": {"type": "string", "default": "!"}, "required": False}],
        "result": {"name": "result", "schema": {"type": "string"}}, "paramStructure": "by-name",
    }
    assert methods["raw"]["params"] == [] and methods["ns.total"]["params"] == []
    assert methods[DISCOVER]["params"] == [] and methods[DISCOVER]["result"]["name"] == "OpenRPC Schema"
    # The tree's definition is a component, and every $ref to it points there
    assert list(document["components"]["schemas"]) == ["Tree"]
    assert methods["leaves"]["params"][0]["schema"] == {"$ref": "#/components/schemas/Tree"}
    tree = document["components"]["schemas"]["Tree"]
    assert tree["properties"]["children"]["items"] == {"$ref": "#/components/schemas/Tree"}


def test_two_types_of_one_name_become_two_components_and_one_type_in_two_methods_one(monkeypatch):
    def node(kind: str) -> type:  # (a class `Node` of a module of its own, referring to itself)
        module = types.ModuleType(f"node_of_{kind}")
        monkeypatch.setitem(sys.modules, module.__name__, module)
        exec(f"import msgspec\nclass Node(msgspec.Struct):\n    value: {kind}\n    next: 'Node | None' = None\n",
             module.__dict__)
        return typing.cast(type, module.Node)

    first, second = node("int"), node("str")
    registry = Registry()
    for name, kind in (("a", first), ("b", second), ("c", first)):
        def handler(n: object) -> None:
            pass

        handler.__annotations__ = {"n": kind, "return": None}
        registry.method(handler, name=name)
    document = json.loads(Catalog(infos(registry).values()).openrpc())
    schemas = document["components"]["schemas"]
    assert sorted(schemas) == ["Node", "Node_2"]
    refs = {m["name"]: m["params"][0]["schema"]["$ref"] for m in document["methods"] if m["params"]}
    assert refs == {"a": "#/components/schemas/Node", "b": "#/components/schemas/Node_2",
                    "c": "#/components/schemas/Node"}
    assert schemas["Node_2"]["properties"]["value"] == {"type": "string"}
    assert schemas["Node_2"]["properties"]["next"]["anyOf"][0] == {"$ref": "#/components/schemas/Node_2"}


class Perm(enum.IntFlag):
    R = 4
    W = 2
    X = 1


class Wide(enum.Flag):
    B0 = 1
    B1 = 2
    B2 = 4
    B3 = 8
    B4 = 16
    B5 = 32
    B6 = 64
    B7 = 128
    B8 = 256


class Node(msgspec.Struct, frozen=True):
    v: int
    kids: frozenset[Node] = frozenset()


class Zeroed(enum.Flag):
    NONE = 0
    R = 1
    W = 2
    RW = 3
    X = 4


class Boxed(msgspec.Struct, typing.Generic[typing.TypeVar("T")], tag=True):  # type: ignore[misc]
    v: typing.Any


def test_a_result_whose_sets_hold_sets_is_decoded_unchecked_as_params_could_not_be():
    """Hostile testing, round 144, F5: the hash-flooding check of results (round 142) read a tree of
    frozensets of Structs holding frozensets, which params may not have (`collisions.unsupported`:
    no linear check), converting each set's whole subtree: a 2 MB result held its worker 13 s,
    9 MB past its kill. Such a result is decoded unchecked, as before: no conversion at all."""
    registry = Registry(tools=True)

    @registry.method
    def tree() -> frozenset[Node]:
        return frozenset()

    method = registry.methods()[0]
    kids = frozenset(Node(i, frozenset(Node(j * 100 + i) for j in range(30))) for i in range(30))
    converts: list[object] = []

    def profile(frame: object, event: str, arg: object) -> None:
        if event == "c_call" and arg is msgspec.convert:
            converts.append(arg)

    sys.setprofile(profile)
    try:
        encoded = checked_result(frozenset(Node(k, kids) for k in range(20)), method.check_result, method.returns)
    finally:
        sys.setprofile(None)
    assert converts == [] and len(json.loads(encoded)) == 20


def test_a_flag_with_a_zero_member_or_an_alias_takes_its_combinations():
    """Hostile testing, round 144, F1: iterating a Flag skips a `NONE = 0` member and an alias
    (`RW = 3`), which msgspec's schema lists: the two lists never matched, and the schema kept
    the members alone ("5 is not one of [0, 1, 2, 3, 4]" for R|X)."""
    registry = Registry(tools=True)

    @registry.method
    def zeroed(v: Zeroed) -> Zeroed:
        return v

    described = typing.cast(typing.Any, registry.methods()[0].described)
    jsonschema.validate({"v": 5}, described.input_schema)
    jsonschema.validate({"result": 7}, described.output_schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"result": 8}, described.output_schema)


def test_two_flags_of_one_name_each_take_their_combinations():
    """Hostile testing, round 144, F3: the Flags' schemas were found by their name alone: of two
    classes named `Mode` in one tool, one kept its members' list."""
    first = enum.Flag("Mode", {"A": 1, "B": 2})
    second = enum.Flag("Mode", {"C": 4, "D": 8})
    registry = Registry(tools=True)

    def modes(a: first, b: second) -> int:  # type: ignore[valid-type]
        return 0

    modes.__annotations__ = {"a": first, "b": second, "return": int}
    registry.method(modes)
    schema = typing.cast(typing.Any, registry.methods()[0].described).input_schema
    jsonschema.validate({"a": 3, "b": 12}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"a": 3, "b": 3}, schema)


def test_a_generic_tagged_struct_s_tag_is_not_required_in_the_output_schema():
    """Hostile testing, round 144, F2: msgspec titles a generic Struct's schema "Boxed[int]", and the
    tag was looked up as "Boxed": still required, the SDK refused a result the check took."""
    registry = Registry(tools=True)

    @registry.method
    def box() -> Boxed[int]:
        return typing.cast(Boxed[int], {"v": 1})

    method = registry.methods()[0]
    checked_result({"v": 1}, method.check_result, method.returns)  # (the check takes it)
    jsonschema.validate({"v": 1}, typing.cast(typing.Any, method.described).output_schema)


@dataclasses.dataclass
class Hidden:
    x: int
    _secret: str


@dataclasses.dataclass
class Kept:
    x: int
    _secret: str = "s"


class Defaulted(msgspec.Struct):
    p: Perm = Perm.R


def test_a_flag_s_schema_with_a_default_or_a_description_takes_the_combinations_too():
    """New user, round 119, F4: a Flag parameter or field with a default (or an Annotated
    description) kept msgspec's members-only enum, `{"enum": [1, 2, 4], "default": 4}`: a host
    validating arguments could not send R|W, and the official SDK refused a Struct's result
    holding it ("6 is not one of [1, 2, 4]")."""
    registry = Registry(tools=True)

    @registry.method
    def grant(p: Perm = Perm.R, q: typing.Annotated[Perm, msgspec.Meta(description="d")] = Perm.W) -> Defaulted:
        return Defaulted(p | q)

    described = typing.cast(typing.Any, registry.methods()[0].described)
    assert described.input_schema["properties"]["p"] == {"title": "Perm", "default": 4, "enum": list(range(8))}
    assert described.input_schema["properties"]["q"]["enum"] == list(range(8))
    jsonschema.validate({"p": 6, "q": 3}, described.input_schema)
    jsonschema.validate({"p": 6}, described.output_schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"p": 8}, described.output_schema)


def test_a_tool_whose_result_could_never_fit_its_type_is_refused_at_registration():
    """New user, round 119, F2: a dataclass with a required field named with a leading underscore,
    which a result's JSON leaves out: every call was a tool error ("Object missing required field
    `_secret`"). Refused at registration, saying why; with a default it is served."""
    def hidden() -> Hidden:
        return Hidden(1, "s")

    def hidden_list() -> list[Hidden]:
        return []

    registry = Registry(tools=True)
    for fn in (hidden, hidden_list):
        with pytest.raises(TypeError, match="its result's Hidden has a required field '_secret', which a result's "
                                            "JSON leaves out"):
            registry.method(fn)

    def kept() -> Kept:
        return Kept(1)

    registry.method(kept)
    assert json.loads(encode_result(Kept(1))) == {"x": 1}


def test_a_flag_s_schema_takes_the_combinations_its_binding_and_results_do():
    """New user, round 118: msgspec's schema of an `enum.Flag` lists its members (`enum: [1, 2,
    4]`), while the binding takes, and a result writes, their combinations: the official SDK
    refused a tool's result `6` (R|W) as "6 is not one of [1, 2, 4]". Every combination is
    listed (0 included); a Flag of more than 8 members is an integer of 0 or more."""
    registry = Registry(tools=True)

    @registry.method
    def grant(perm: Perm, wide: Wide | None = None) -> Perm:
        return perm

    @registry.method
    def widest() -> Wide:
        return Wide.B0 | Wide.B8

    methods = {m.name: m for m in registry.methods()}
    described = typing.cast(typing.Any, methods["grant"].described)
    jsonschema.validate({"result": int(Perm.R | Perm.W)}, described.output_schema)
    jsonschema.validate({"perm": 7, "wide": 257}, described.input_schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"result": 8}, described.output_schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"perm": -1}, described.input_schema)
    with pytest.raises(jsonschema.ValidationError):  # (a Flag, STRICT: its own bits alone)
        jsonschema.validate({"result": -1}, typing.cast(typing.Any, methods["widest"].described).output_schema)
    assert methods["grant"].bind(b'{"perm": 6, "wide": 257}', 64) == ((Perm.R | Perm.W, Wide.B0 | Wide.B8), {})
    jsonschema.validate({"result": 257}, typing.cast(typing.Any, methods["widest"].described).output_schema)
