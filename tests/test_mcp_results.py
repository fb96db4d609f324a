"""A tool's result checked against its return type, the source of its outputSchema, all the
way down (MCP server/tools, "Output Schema": "Servers MUST provide structured results that
conform to this schema"). Hostile testing, round 131: a Struct missing a field, a field of
another type, a NaN written null, a TypedDict's or a Literal's other value went out as
structuredContent with isError false, and the official SDK's client raised RuntimeError
("Invalid structured content returned by tool"): the host got no result and the model no
readable error. Now a tool error saying where; the JSON-RPC face answers -32603 with the
same reason. A real broker, its workers, and the official `mcp` client."""

from __future__ import annotations

import json
import typing

import anyio
import pytest
from mcp.client.client import Client

from tests.conftest import Broker, start_broker

MODES = ("auto", "legacy")


@pytest.fixture(scope="module")
def broker() -> typing.Iterator[Broker]:
    b = start_broker("--workers", "1", "--app", "tests.apps.shaped:registry")
    yield b
    assert b.stop() == 0, b.read_log()


def call(b: Broker, mode: str, tool: str, arguments: dict[str, object]) -> typing.Any:
    async def main() -> typing.Any:
        async with Client(f"http://127.0.0.1:{b.port}/mcp", mode=mode) as client:  # type: ignore[arg-type]
            return await client.call_tool(tool, arguments)

    return anyio.run(main)


BROKEN = [
    ("point", {"kind": "missing"}, "Object missing required field `y`"),
    ("point", {"kind": "typed"}, "Expected `int`, got `str` - at `$.x`"),
    ("point", {"kind": "nan"}, "Expected `int`, got `null` - at `$.y`"),
    ("named", {"a": "x"}, "Expected `int`, got `str` - at `$.a`"),
    ("letter", {"value": "zzz"}, "Invalid enum value 'zzz' - at `$.result`"),
    ("numbers", {"values": [1, "x"]}, "Expected `int`, got `str` - at `$.result[1]`"),  # (its structuredContent's)
    # (a result with a number written with an exponent: read by float(), then converted; round 140, F5)
    ("numbers", {"values": [1e-300, 2]}, "Expected `int`, got `float` - at `$.result[0]`"),
    # (an integral float where an int is declared too: the result goes out as the tool returned it)
    ("whole", {"value": 3.0}, "Expected `int`, got `float` - at `$.result`"),
    ("numbers", {"values": [3, 2.0]}, "Expected `int`, got `float` - at `$.result[1]`"),
    # (hostile testing, round 142, F8: "at `key` in `$[0]` - at `$.result`")
    ("keyed", {"key": "x"}, "Expected `int`, got `str` - at `key` in `$.result[0]`"),
    # (an IntFlag's bits of no member: refused, as in params; hostile testing, round 142, F3)
    ("kept", {"value": 7}, "7 is not made of the bits of Kept's members - at `$.result[0]`"),
    ("scaled", {"values": [1e300, 2.5e-300, "x"]}, "Expected `float`, got `str` - at `$.result[2]`"),
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("tool", "arguments", "why"), BROKEN)
def test_a_result_that_breaks_its_schema_below_its_top_is_a_tool_error_saying_where(
        broker: Broker, mode: str, tool: str, arguments: dict[str, object], why: str) -> None:
    result = call(broker, mode, tool, arguments)
    assert result.is_error is True and result.structured_content is None, result
    assert result.content[0].text == f"Internal error: TypeError: the result does not fit the tool's outputSchema: {why}"


@pytest.mark.parametrize("mode", MODES)
def test_results_that_fit_go_out_as_structured_content(broker: Broker, mode: str) -> None:
    assert call(broker, mode, "point", {"kind": "ok"}).structured_content == {"x": 1, "y": 2}
    assert call(broker, mode, "point", {"kind": "struct"}).structured_content == {"x": 3, "y": 4}
    assert call(broker, mode, "named", {"a": 7}).structured_content == {"a": 7}
    assert call(broker, mode, "letter", {"value": "b"}).structured_content == {"result": "b"}
    assert call(broker, mode, "numbers", {"values": [1, 2]}).structured_content == {"result": [1, 2]}
    values = [1e308, 1.2345000000000000576e249, 2.5e-300, 7, 0.5]
    assert call(broker, mode, "scaled", {"values": values}).structured_content == {"result": values}


# What msgspec's decoding takes but the schema it writes does not say (new user, round 118, F9:
# the official SDK's client raised "3.3 is not of type 'string'", "'type' is a required
# property", "[1, 1, 2] has non-unique elements"): the outputSchema says it, and the result goes
# out as the tool returned it.
# (Written again from the decoded value, round 142 found a Struct's defaults written out, 45
# times the params, and its `__post_init__` run twice: "Hello, Hello, Ann".)
AS_RETURNED = [
    ("price", {}, {"amount": 3.3}),
    ("prices", {}, {"result": ["1.5", 2.5]}),
    ("tagged", {}, {"result": {"v": 1}}),
    ("tagged", {"many": True}, {"result": [{"v": 1}, {"type": "Tagged", "v": 2}]}),
    ("unique", {}, {"result": [1, 1, 2]}),
    ("kept", {"value": 3}, {"result": [3]}),
    ("keyed", {"key": "12"}, {"result": [{"12": "a"}]}),
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("tool", "arguments", "structured"), AS_RETURNED)
def test_a_result_the_check_takes_fits_the_output_schema_the_host_checks(
        broker: Broker, mode: str, tool: str, arguments: dict[str, object], structured: object) -> None:
    result = call(broker, mode, tool, arguments)  # (the SDK's client checks it against the outputSchema)
    assert result.is_error is False and result.structured_content == structured, result
    value = structured if tool == "price" else structured["result"]  # type: ignore[index]
    assert json.loads(result.content[0].text) == value  # (the text block says the same)
    assert broker.call(tool, arguments)["result"] == value  # (and so does the JSON-RPC face)


def test_the_json_rpc_face_answers_the_same_reason(broker: Broker) -> None:
    answer = broker.call("point", {"kind": "missing"})
    assert answer["error"] == {"code": -32603, "message": "Internal error", "data": {
        "type": "TypeError", "reason": "the result does not fit the tool's outputSchema: Object missing required field `y`"}}
    assert broker.call("point", {"kind": "ok"})["result"] == {"x": 1, "y": 2}
    assert "tool point returned a result that breaks its outputSchema" in broker.read_log(0.5)


def test_a_result_s_set_of_one_hash_is_refused_before_it_is_built(broker: Broker) -> None:
    """Hostile testing, round 142, F9: a `-> set[int]` tool's result of integers that share a hash
    (`5 + k * (2**61 - 1)`), 0.68 MiB, held its worker 15 s as the check built the set, and
    another client's call waited as long. The result is checked for hash flooding first, as
    params are."""
    flood = [5 + k * (2**61 - 1) for k in range(40)]
    answer = broker.call("as_set", {"values": flood})
    assert answer["error"]["data"]["reason"] == (
        "the result does not fit the tool's outputSchema: more than 8 distinct values of one hash in one set or in "
        "one object's keys - at `$.result`: refused (hash flooding)"), answer
    assert broker.call("as_set", {"values": [1, 2, 2]})["result"] == [1, 2, 2]


def test_the_flag_members_a_result_s_check_makes_are_dropped(broker: Broker) -> None:
    """Hostile testing, round 142, F4: each distinct value of an IntFlag a result held made a
    member as the check decoded it, kept for good (a worker grew 49 to 300 MiB over 6 calls).
    They are dropped as those params make are, past FLAG_PSEUDO_MEMBERS_MAX."""
    from broker.worker.params import FLAG_PSEUDO_MEMBERS_MAX

    before = broker.call("wide_made")["result"]
    for round_ in range(3):
        values = [(round_ * 4000 + i) * 7 % (1 << 24) for i in range(1, 4001)]
        assert len(broker.call("wide_values", {"values": values})["result"]) == 4000
    assert broker.call("wide_made")["result"] <= before + FLAG_PSEUDO_MEMBERS_MAX
