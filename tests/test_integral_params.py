"""An integral number written as a float (5.0, 1e2) binds to an `int` parameter (broker/worker/integral.py).

JSON Schema counts it an integer (draft 2020-12, Validation 6.1.1), a tool's inputSchema says
`"type": "integer"` for an `int`, and MCP clients send it so; msgspec's strict mode had refused
it (-32602 "Expected `int`, got `float`"). One with a fractional part is still refused, saying
so; a bool is no integer; "5" is a string. First `Method.bind` itself, on each shape a type
may hold an int in, then over JSON-RPC and through the official `mcp` SDK's client, against a
real broker and its workers."""

from __future__ import annotations

import decimal
import enum
import json
import typing

import anyio
import msgspec
import pytest
from mcp.client.client import Client

from broker.worker.params import InvalidParams, Method
from tests.conftest import Broker, start_broker

FRACTIONAL = "Expected `int`, got a number with a fractional part"


class Item(msgspec.Struct):
    sku: str
    qty: int
    price: float = 0.0


class Circle(msgspec.Struct, tag="circle"):
    r: int


class Square(msgspec.Struct, tag="square"):
    side: int


class Level(enum.IntEnum):
    LOW = 1
    HIGH = 2


def shapes(n: int, ns: list[int] | None = None, counts: dict[str, int] | None = None,
           item: Item | None = None, either: int | str = 0, shape: Circle | Square | None = None,
           pair: tuple[int, float] = (0, 0.0), level: Level = Level.LOW, one: typing.Literal[1, 2] = 1,
           ratio: float = 0.0, loose: typing.Any = None, num: int | float = 0,
           small: typing.Annotated[int, msgspec.Meta(le=10)] = 0) -> None:
    return None


def spread(first: int, *rest: int, **named: int) -> None:
    return None


def bound(params: bytes, fn: typing.Callable[..., object] = shapes) -> dict[str, object]:
    args, kwargs = Method(fn.__name__, fn).bind(params, 64)
    names = list(typing.get_type_hints(fn))
    return {**dict(zip(names, args)), **kwargs}


def refused(params: bytes, fn: typing.Callable[..., object] = shapes) -> tuple[str | None, str]:
    with pytest.raises(InvalidParams) as info:
        Method(fn.__name__, fn).bind(params, 64)
    return info.value.param, info.value.reason


def test_an_integral_float_binds_to_an_int_where_the_types_want_one() -> None:
    assert bound(b'{"n": 5.0}')["n"] == 5 and type(bound(b'{"n": 5.0}')["n"]) is int
    assert bound(b"[5.0]")["n"] == 5
    for text, value in ((b"1e2", 100), (b"-0.0", 0), (b"5.000", 5), (b"0.5e1", 5), (b"50E-1", 5),
                        (b"9007199254740993.0", 9007199254740993)):  # (read from the text: no float holds it)
        assert bound(b'{"n": ' + text + b"}")["n"] == value, text
    got = bound(b'{"n": 1, "ns": [1.0, 2e0, 3], "counts": {"a": 4.0}, "item": {"sku": "x", "qty": 3.0, "price": 2.0},'
                b' "either": 7.0, "shape": {"type": "square", "side": 2.0}, "pair": [1.0, 2.0], "level": 2.0,'
                b' "one": 2.0, "small": 10.0}')
    assert got["ns"] == [1, 2, 3] and got["counts"] == {"a": 4}
    assert got["item"] == Item("x", 3, 2.0) and got["either"] == 7 and got["shape"] == Square(2)
    assert got["pair"] == (1, 2.0) and got["level"] is Level.HIGH and got["one"] == 2 and got["small"] == 10
    assert [type(v) for v in typing.cast(list[object], got["ns"])] == [int, int, int]
    assert Method("spread", spread).bind(b"[1.0, 2.0, 3]", 64) == ((1, 2, 3), {})
    assert Method("spread", spread).bind(b'{"first": 1.0, "q": 4.0}', 64) == ((1,), {"q": 4})


def test_a_list_of_unions_is_walked_in_order_its_numbers_by_the_member_an_int_is() -> None:
    """A list of Optional[int] (or of int | list[int]) has its union chosen once for its numbers
    (round 139, F5: a number at a time, 1 MiB took 1.5 s); a list in it is walked in its place,
    and the same exponent's text read once is read right each time."""
    def mixed(xs: list[int | None], ys: list[int | list[int]], zs: list[float | None] = []) -> None:  # noqa: B006
        return None

    got = bound(b'{"xs": [1e1, null, 2.0, 1e1, 3], "ys": [1e1, [2e0, 1e1], 4.0], "zs": [1e1, null]}', mixed)
    assert got == {"xs": [10, None, 2, 10, 3], "ys": [10, [2, 10], 4], "zs": [10.0, None]}
    assert [type(x) for x in typing.cast(list[object], got["zs"])] == [float, type(None)]
    assert refused(b'{"xs": [1e1, null, 2.5], "ys": []}', mixed) == ("xs", "Expected `int | null`, got a number with a fractional part - at `xs[2]`")
    assert refused(b'{"xs": [], "ys": [1e1, [2e0, 2.5], 0.5]}', mixed) == ("ys", FRACTIONAL + " - at `ys[1][1]`")
    assert refused(b'{"xs": [], "ys": [1e1, [2e0], 0.5, [2.5]]}', mixed) == ("ys", "Expected `int | array`, got a number with a fractional part - at `ys[2]`")


def test_a_float_stays_a_float_where_the_types_take_one() -> None:
    got = bound(b'{"n": 1, "ratio": 2.0, "loose": 3.0, "num": 4.0, "item": {"sku": "x", "qty": 1, "price": 5.0}}')
    assert (got["ratio"], got["loose"], got["num"]) == (2.0, 3.0, 4.0)
    assert [type(got[k]) for k in ("ratio", "loose", "num")] == [float, float, float]
    assert typing.cast(Item, got["item"]).price == 5.0


def test_a_number_with_a_fraction_a_bool_or_a_string_is_still_refused() -> None:
    assert refused(b'{"n": 5.5}') == ("n", FRACTIONAL)
    assert refused(b"[5.5]") == ("n", FRACTIONAL)
    assert refused(b'{"n": 1, "ns": [1.0, 2.5]}') == ("ns", FRACTIONAL + " - at `ns[1]`")
    assert refused(b'{"n": 1, "item": {"sku": "x", "qty": 0.25}}') == ("item", FRACTIONAL + " - at `item.qty`")
    assert refused(b'{"n": 4503599627370496.5}') == ("n", FRACTIONAL)  # (a float would round it to 2**52)
    assert refused(b'{"n": 1.00000000000000000001}') == ("n", FRACTIONAL)  # (and this to 1.0)
    assert refused(b"[1, 2.5]", spread) == ("rest", FRACTIONAL + " (params[1])")
    assert refused(b'{"first": 1, "q": 4.5}', spread) == ("q", FRACTIONAL)
    assert refused(b'{"n": true}') == ("n", "Expected `int`, got `bool`")  # (JSON Schema: a boolean is no integer)
    assert refused(b'{"n": "5"}') == ("n", "Expected `int`, got `str`")  # (strict still: no lax mode)
    assert refused(b'{"n": 1, "small": 11.0}') == ("small", "Expected `int` <= 10")  # (its constraint checked)
    assert refused(b'{"n": 1, "level": 3.0}') == ("level", "Invalid enum value 3")
    assert refused(b'{"n": 5.0, "nope": 1}') == ("nope", "unexpected parameter")


def test_an_integral_number_binds_up_to_a_doubles_range_and_past_it_is_refused_as_msgspec_does() -> None:
    """1e308 is an integer (JSON Schema) of 309 digits, a double's most; one past a double's range
    (1e309, 1e4299: sent by no client's doubles) is not written out (round 139, F1: 1000 calls of
    `1e4299` in a batch, each written out as 4300 digits, held a worker 0.86 s), but refused as
    msgspec refuses it, exponent or not. What the integers add to the text is bounded by its own
    length (and 309)."""
    assert bound(b'{"n": 1e308}')["n"] == 10**308
    assert bound(b'{"n": -17976931348623157e292}')["n"] == -17976931348623157 * 10**292  # (read from its text: no double holds it)
    assert bound(b'{"n": 9' + b"0" * 308 + b'.0}')["n"] == 9 * 10**308
    for beyond in (b"1e309", b"1e400", b"1e4299", b"1e5000", b"1" + b"0" * 309 + b".0"):
        plain = _msgspec_refusal(b'{"n": %s}' % beyond)
        assert refused(b'{"n": %s}' % beyond) == ("n", plain) == ("n", "Number out of range")
    assert refused(b'{"n": 1, "ratio": 1e400}') == ("ratio", "Number out of range")  # (a float's is as before)
    many = b'{"n": 1, "ns": [' + b",".join([b"1e308"] * 300) + b"]}"
    param, reason = refused(many)
    assert param == "ns" and reason.startswith("Expected `int`, got `float` - at `ns[")  # (past the room)


def _msgspec_refusal(params: bytes) -> str:
    """What msgspec itself says of params decoded into `shapes`' `n` (without the retry)."""
    try:
        msgspec.json.decode(params, type=dict[str, int])
    except msgspec.ValidationError as exc:
        return str(exc).split(" - at ")[0]
    raise AssertionError("taken")


def test_params_that_fit_are_bound_by_the_path_they_were_and_decimals_keep_their_digits() -> None:
    def priced(count: int, price: decimal.Decimal) -> None:
        return None

    assert Method("priced", priced).bind(b'{"count": 2.0, "price": 1.10}', 64) == ((2, decimal.Decimal("1.10")), {})
    assert Method("priced", priced).bind(b"[3e0, 2.50]", 64) == ((3, decimal.Decimal("2.50")), {})


@pytest.fixture(scope="module")
def broker() -> typing.Iterator[Broker]:
    b = start_broker("--workers", "1", "--app", "tests.apps.mcp_tools:registry")
    yield b
    assert b.stop() == 0, b.read_log()


def test_over_json_rpc_an_integral_float_is_an_int_and_a_fraction_is_minus_32602(broker: Broker) -> None:
    assert broker.call("add", {"a": 5.0, "b": 2})["result"] == 7
    assert broker.call("add", [1e2, 2.0])["result"] == 102
    error = typing.cast(dict[str, typing.Any], broker.call("add", {"a": 5.5, "b": 2})["error"])
    assert (error["code"], error["data"]) == (-32602, {"param": "a", "reason": FRACTIONAL})
    error = typing.cast(dict[str, typing.Any], broker.call("add", {"a": True, "b": 2})["error"])
    assert (error["code"], error["data"]) == (-32602, {"param": "a", "reason": "Expected `int`, got `bool`"})


def test_over_http_a_batch_of_numbers_past_a_doubles_range_is_refused_call_by_call(broker: Broker) -> None:
    """Round 139, F1: a batch of 1000 calls given `1e4299` for an int (each written out as 4300
    digits, then bound) held a worker 0.86 s; each is refused now as msgspec refuses it, beside
    calls given an integral float within a double's range, which still bind."""
    beyond = b'{"jsonrpc": "2.0", "method": "add", "params": [1e4299, %d], "id": %d}'
    within = b'{"jsonrpc": "2.0", "method": "add", "params": [1e308, %d], "id": %d}'
    body = b"[" + b",".join((within if i % 100 == 0 else beyond) % (i, i) for i in range(1000)) + b"]"
    status, _, answer = broker.post(body, timeout=60)
    answers = {a["id"]: a for a in json.loads(answer)}
    assert status == 200 and sorted(answers) == list(range(1000))
    for i, a in answers.items():
        if i % 100 == 0:
            assert a["result"] == 10**308 + i
        else:
            assert (a["error"]["code"], a["error"]["data"]) == (-32602, {"param": "a", "reason": "Number out of range"})


def test_through_the_mcp_sdk_a_tool_takes_an_integral_float_for_its_integer(broker: Broker) -> None:
    async def main() -> tuple[typing.Any, typing.Any]:
        async with Client(f"http://127.0.0.1:{broker.port}/mcp") as client:
            return (await client.call_tool("add", {"a": 5.0, "b": 2.0}),
                    await client.call_tool("add", {"a": 5.5, "b": 2}))

    good, bad = anyio.run(main)
    assert (good.is_error, good.structured_content) == (False, {"result": 7})
    assert bad.is_error is True
    assert bad.content[0].text == f"Invalid arguments: argument 'a': {FRACTIONAL}"


class Pair(msgspec.Struct):
    a: int
    b: int


def pair(a: int, b: int, p: Pair | None = None) -> None: ...


def test_an_objects_values_are_rewritten_in_the_texts_order() -> None:
    """Hostile testing, round 141, F10: an object's values were walked last key first, so the
    rewrite met `b`'s 1.5 before `a`'s 1.0 and stopped there, and `a` (an integral 1.0) was
    named "a number with a fractional part"; `b` is."""
    assert refused(b'{"a": 1.0, "b": 1.5}', pair) == ("b", "Expected `int`, got a number with a fractional part")
    assert refused(b'{"a": 1, "b": 2, "p": {"a": 1e0, "b": 1.5}}', pair) == (
        "p", "Expected `int`, got a number with a fractional part - at `p.b`")
    assert bound(b'{"a": 1.0, "b": 2e0, "p": {"a": 3.0, "b": 4}}', pair) == {"a": 1, "b": 2, "p": Pair(3, 4)}
