"""Numbers msgspec's JSON parser reads slowly (`1e308`, `1.2345000000000000576e249`: 2-20 µs each
where `1.5` takes 0.03: broker/floats.py), read by float() instead: bound as the same
doubles, refused with the same messages, never refused for how many there are (hostile testing,
rounds 136 and 137). First the reading itself and `Method.bind`, then a real broker and its one
worker over HTTP. (How long each takes: benchmarks/slow_numbers.py, not a test.)"""

from __future__ import annotations

import json
import random
import struct
import sys
import typing
from decimal import Decimal

import msgspec
import pytest

from broker import floats
from broker.floats import beyond_read, plain_numbers, read_json
from broker.worker.params import InvalidParams, Method
from tests.apps import bignums
from tests.conftest import Broker, start_broker

MIB = (1 << 20) - 100  # (a MiB with the envelope: max_body_bytes, 1 MiB by default)
HALFWAY = b"1.2345000000000000576e249"


def array_of(token: bytes, size: int = MIB) -> bytes:
    """A JSON array of `token` repeated, as many as `size` bytes hold."""
    return b"[" + b",".join([token] * ((size - 1) // (len(token) + 1))) + b"]"


# msgspec's slow path (round 136 F2, round 137 F1, F3, F9), and Python's float() of each
SLOW = [b"1e308", b"1E+308", b"-1e290", b"1.7976931348623157e308", b"0.0001e293", HALFWAY,
        b"1.2345000000000000451e-300", b"3.7054923438093490813e-323", b"1e23", b"1" * 59 + b"e249",
        b"0." + b"0" * 200 + b"1e500"]


def bits(value: float) -> bytes:
    return struct.pack("<d", value)


@pytest.mark.parametrize("token", SLOW, ids=lambda t: t[-12:].decode())
def test_slow_forms_are_not_plain_and_read_as_msgspec_reads_them(token: bytes) -> None:
    params = array_of(token, 4096)
    assert not plain_numbers(params)
    assert [bits(v) for v in read_json(params)] == [bits(v) for v in msgspec.json.decode(params)]
    assert bits(read_json(token)) == bits(float(token))


def test_plain_numbers_are_those_written_without_an_exponent() -> None:
    """Those msgspec reads fast, or past 19 digits at a cost bound by their length (`111...1.0`)."""
    for params in (b"[1, 2]", b"[1.5, -2.25]", array_of(b"123456789.12345"), array_of(b"-0.000000000001"),
                   b"[0.30000000000000004, 1234567890123456789012]", b"[" + b"1" * 308 + b".0]",
                   b'{"text": "the seventeen elephants", "n": 7}', b"[]", b""):
        assert plain_numbers(params), params[:40]
    for params in (b"[1e5]", b"[1.0E-2]", b"[-0e0]", b'["550e8400"]'):
        assert not plain_numbers(params), params  # (the last a string's: read by float() too, the same)


def test_random_doubles_and_hard_decimals_read_bit_for_bit() -> None:
    rng = random.Random(137)
    texts = []
    for _ in range(20000):
        value = struct.unpack("<d", rng.getrandbits(64).to_bytes(8, "little"))[0]
        if value - value == 0.0:
            texts.append(repr(value))
        texts.append(f"{rng.randint(1, 9)}.{rng.getrandbits(70)}e{rng.randint(-330, 300)}")  # (past 19 digits)
    params = ("[" + ",".join(texts) + "]").encode()
    assert [bits(v) for v in read_json(params)] == [bits(v) for v in msgspec.json.decode(params)]


@pytest.mark.parametrize("params", [b"[1, 1e400]", b'{"a": [1.5, {"b": -1e400}]}', b"[1e400", b"[1e400, x]",
                                    b"[" + b"9" * 5000 + b"]", b'["\xff"]', b"[01]"])
def test_read_json_refuses_as_msgspec_does(params: bytes) -> None:
    with pytest.raises(msgspec.MsgspecError) as theirs:
        msgspec.json.decode(params)
    with pytest.raises(msgspec.MsgspecError) as ours:
        read_json(params)
    assert (type(ours.value), str(ours.value)) == (type(theirs.value), str(theirs.value))


def bind(name: str, params: bytes) -> tuple[tuple[object, ...], dict[str, object]]:
    return Method(name, getattr(bignums, name)).bind(params, 64)


def refusal(name: str, params: bytes) -> tuple[str | None, str]:
    with pytest.raises(InvalidParams) as refused:
        bind(name, params)
    return refused.value.param, refused.value.reason


@pytest.mark.parametrize("token", [b"1e308", HALFWAY, b"1.7976931348623157e308", b"1e23"], ids=bytes.decode)
def test_a_mib_of_slow_floats_binds_to_each_shape_of_parameter(token: bytes) -> None:
    """Round 136 refused a MiB of `1e308` for their count; round 137's halfway floats bound,
    0.25 s: each is the double float() reads, however the parameter is typed."""
    one = float(token)
    values = array_of(token, MIB - 20)
    n = values.count(b",") + 1
    assert bind("total", b"[" + values + b"]") == (([one] * n,), {})
    assert bind("untyped", b"[" + values + b"]") == (([one] * n,), {})
    assert bind("anything", b'{"v": ' + values + b"}") == (([one] * n,), {})
    assert bind("star", values) == (tuple([one] * n), {})
    points = bind("points", b"[" + array_of(b'{"x": ' + token + b"}", MIB - 20) + b"]")[0][0]
    assert typing.cast(list[bignums.Point], points)[-1] == bignums.Point(one)
    assert bind("fdict", b'{"m": {"a": ' + token + b', "b": 1.5}}') == (({"a": one, "b": 1.5},), {})
    # refused as ordinary floats are, for the parameter's type
    assert refusal("mark", values) == ("tag", "Expected `str`, got `float`")
    assert refusal("points", b'[[{"x": 1.5}, {"x": ' + token + b', "n": 0.5}]]') == (
        "ps", "Expected `int`, got a number with a fractional part - at `ps[1].n`")


def test_an_honest_payload_of_float64_max_sentinels_binds() -> None:
    """Round 137, F9: 600 of numpy's finfo(float).max among 2,000 floats (42 KB) was refused for
    holding more than 512 numbers of 3-digit exponents."""
    rng = random.Random(9)
    values = [rng.uniform(-50, 50) for _ in range(1400)] + [sys.float_info.max] * 600
    rng.shuffle(values)
    assert bind("star", json.dumps(values).encode()) == (tuple(values), {})


def test_a_refusal_of_a_number_past_range_reads_the_params_once() -> None:
    """Round 137, F5: a MiB of halfway floats and one `1e1000` was decoded ~6 times to be
    refused (1.6 s); the number past a double's range is read once per binding (twice where
    the integral floats are made integers first), and placed as before."""
    values = array_of(HALFWAY, MIB - 40)[:-1] + b",1e1000]"
    at = values.count(b",")
    for name, bindings in (("untyped", 1), ("total", 1), ("ints", 2)):
        before = beyond_read()
        assert refusal(name, b'{"values": ' + values + b"}") == ("values", f"Number out of range - at `values[{at}]`")
        assert beyond_read() - before == bindings, name
    before = beyond_read()
    assert refusal("points", b'[[{"x": 1.5}, {"x": 1e400, "n": 1}]]') == ("ps", "Number out of range - at `ps[1].x`")
    assert refusal("anything", b'{"v": {"a": [1, 1e400]}}') == ("v", "Number out of range - at `v[...][1]`")
    assert refusal("star", b"[1.5, 1e400]") == ("values", "Number out of range (params[1])")
    assert beyond_read() - before == 3
    assert floats.first_beyond([1.5, {"a": [2.5, floats.BEYOND]}]) == [1, "...", 1]
    assert floats.first_beyond({"k": 1, "b": [{"a": floats.BEYOND, "c": 9e999}], "z": floats.BEYOND}) == ["b", 0, "..."]
    assert floats.first_beyond({"a": [1, {"b": "9e999"}, floats.BEYOND]}) == ["a", 2]  # (text that looks so: a string's)
    assert floats.first_beyond(floats.BEYOND) == [] and floats.first_beyond([1e308, "x", {}]) is None


def test_a_later_duplicate_key_replaces_a_number_past_range() -> None:
    """The last of duplicate keys is kept (as for any value), inside params too: round 36 bound
    the params' own keys so, and now `{"a": 1e400, "a": 2.5}` inside a value binds as well."""
    assert bind("total", b'{"values": [1e400], "values": [2.5]}') == (([2.5],), {})
    assert bind("fdict", b'{"m": {"a": 1e400, "b": 1.5, "a": 2.5}}') == (({"a": 2.5, "b": 1.5},), {})


def test_a_refusal_of_a_parameter_that_takes_no_int_is_not_bound_again() -> None:
    """The integral-float retry rewrote `n`'s 2.0 and bound all again, building `first` twice
    more (its `__post_init__` ran 4 times), to refuse `tag` the same; it still runs for `n`."""
    method = Method("counted", bignums.counted)
    for params in (b'[{"x": 1}, 1.5, 2.0]', b'{"first": {"x": 1}, "tag": 1.5, "n": 2.0}'):
        before = len(bignums.MADE)
        with pytest.raises(InvalidParams) as refused:
            method.bind(params, 64)
        assert (refused.value.param, refused.value.reason) == ("tag", "Expected `str`, got `float`")
        assert len(bignums.MADE) - before == 2  # (the fast path's, the slow path's)
    assert method.bind(b'[{"x": 1}, "a", 2.0]', 64) == ((bignums.Counted(1), "a", 2), {})
    with pytest.raises(InvalidParams) as refused:
        method.bind(b'[{"x": 1}, "a", 2.5]', 64)
    assert (refused.value.param, refused.value.reason) == ("n", "Expected `int`, got a number with a fractional part")


@pytest.mark.parametrize("token", [b"1e308", HALFWAY], ids=bytes.decode)
def test_floats_beside_a_decimal_or_a_raw_are_read_by_float(token: bytes) -> None:
    """Round 139, F4: a method with a Decimal or a msgspec.Raw among its hints decoded each
    value with its own type by msgspec, floats included (1 MiB of `1e308` 1.6 s). A value
    whose type holds neither is read as other params are: the same doubles, the same
    refusals, and a float past a double's range is read by the float reader (counted), not
    by msgspec's decoder."""
    one = float(token)
    values = array_of(token, MIB - 40)
    n = values.count(b",") + 1
    assert bind("priced", b'{"price": 1.5, "values": ' + values + b"}") == ((Decimal("1.5"), [one] * n, None), {})
    assert bind("priced", b"[1e400, " + values + b", " + token + b"]") == ((Decimal("1e400"), [one] * n, one), {})
    body, floats_ = bind("wrapped", b'[{"a": ' + token + b"}, " + values + b"]")[0]
    assert (bytes(typing.cast(msgspec.Raw, body)), floats_) == (b'{"a": ' + token + b"}", [one] * n)
    past = values[:-1] + b", 1e400]"
    before = beyond_read()
    assert refusal("priced", b"[1.5, " + past + b"]") == ("values", f"Number out of range - at `values[{n}]`")
    assert refusal("wrapped", b"[[], " + past + b"]") == ("values", f"Number out of range - at `values[{n}]`")
    assert refusal("priced", b'[1.5, [1], {"a": [' + token + b", 1e400]}]") == (
        "extra", "Number out of range - at `extra[...][1]`")
    assert refusal("priced", b"[1.5, 1e400]") == ("values", "Number out of range")
    assert beyond_read() - before == 4
    # refused as before for what comes first
    assert refusal("priced", b'[1.5, ["x", 1e400]]') == ("values", "Expected `float`, got `str` - at `values[0]`")
    assert refusal("priced", b'[1.5, {"a": ' + token + b"}]") == ("values", "Expected `array`, got `object`")


def test_kwargs_and_fields_beside_a_decimal_bind_as_the_typed_decoder_binds_them() -> None:
    """Round 140, F1: **kwargs' values beside a Decimal were still read by msgspec's decoder
    (1 MiB of `1e308` 1.6 s); now as the other parameters' (a number past range read by the
    float reader, counted), the refused key named. F3: a `1e400` in a field the Struct
    ignores was refused once read by float(); dropped, as the decoder skips it."""
    values = array_of(b"1e308", MIB - 60)
    n = values.count(b",") + 1
    assert bind("kwpriced", b'{"price": 1.5, "a": ' + values + b', "b": [1e1]}') == (
        (Decimal("1.5"), None), {"a": [1e308] * n, "b": [10.0]})
    before = beyond_read()
    assert refusal("kwpriced", b'{"price": 1.5, "a": ' + values + b', "b": [2.5, 1e400]}') == (
        "b", "Number out of range - at `b[1]`")
    assert refusal("kwpriced", b'{"price": 1.5, "a": [1e1], "b": ["x", 1e400]}') == (
        "b", "Expected `float`, got `str` - at `b[0]`")
    assert beyond_read() - before >= 2
    point = b'{"x": 1e2, "extra": 1e400}'
    assert bind("kwpriced", b'{"price": 1.5, "point": ' + point + b"}") == ((Decimal("1.5"), bignums.Point(100.0)), {})
    assert refusal("kwpriced", b'{"price": 1.5, "point": {"x": 1e400, "extra": 1e0}}') == (
        "point", "Number out of range - at `point.x`")


def test_float_keys_bind_to_the_doubles_msgspec_reads_them_as() -> None:
    """Round 140, F2: a `dict[float, ...]`'s keys were read by msgspec's own reader, twice (1
    MiB of `1.5e300` 1.15 s); those with a fraction or an exponent are read by float() now,
    the same doubles; the others as before (`-0` is 0.0, `nan` taken, `1e400` refused)."""
    keys = [f"{i}.5e{i % 300}" for i in range(60000)] + ["1.0", "1.00", "-0", "-0.0", "nan", "1e-400", "7"]
    given = {key: i for i, key in enumerate(keys)}
    params = json.dumps([given]).encode()
    expected = msgspec.convert(given, dict[float, int], str_keys=True)
    bound = typing.cast(dict[float, int], bind("weights", params)[0][0])
    assert [(bits(k), v) for k, v in bound.items() if k == k] == [(bits(k), v) for k, v in expected.items() if k == k]
    assert sum(k != k for k in bound) == 1 and len(bound) == len(expected)
    assert refusal("weights", json.dumps([{**given, "1e400": 1}]).encode()) == ("v", "Number out of range (a key)")
    # (round 141: dicts of 8 keys or fewer, F6, and a union taking a float, F7, read so too)
    for hint in (list[dict[float, int]], list[dict[float | int, int]], list[dict[float | None, int]]):
        def small(v):  # type: ignore[no-untyped-def]
            return v

        small.__annotations__ = {"v": hint}
        dicts = [{"1.5e300": i, "7": 2, "-0": 3, "2.0": 4} for i in range(100)]
        expected_small = msgspec.convert(dicts, hint, str_keys=True)
        bound_small = Method("small", small).bind(json.dumps([dicts]).encode(), 64)[0][0]
        assert [[(type(k), bits(k) if type(k) is float else k, v) for k, v in d.items()]
                for d in typing.cast(list[dict[typing.Any, int]], bound_small)] == [
            [(type(k), bits(k) if type(k) is float else k, v) for k, v in d.items()] for d in expected_small], hint


SEEN: list[object] = []  # what `Watched.__post_init__` saw


class Watched(msgspec.Struct):
    a: typing.Any = None

    def __post_init__(self) -> None:
        SEEN.append(self.a)
        if isinstance(self.a, int) and self.a < 0:
            raise ValueError("negative")


def watched(d: Decimal, p: Watched) -> None: ...


def watched_alone(p: Watched) -> None: ...


@pytest.mark.parametrize("fn", [watched, watched_alone])
def test_a_number_past_range_never_reaches_an_apps_post_init(fn: typing.Callable[..., None]) -> None:
    """Hostile testing, round 141, F8: beside a Decimal, `1e400` in an `Any` field was read as the
    internal `BEYOND` and the Struct built with it to place the refusal: its `__post_init__` ran on
    it (its TypeError's text, naming `NumberOutOfRange`, was the refusal; a LookupError escaped as
    -32603). Where a type of the params has a `__post_init__`, the refusal is placed from the text's
    read, nothing built; the general path's placement alike."""
    method = Method(fn.__name__, fn)
    params = b'{"d": 1, "p": {"a": 1e400}}' if fn is watched else b'{"p": {"a": [1, 1e400]}}'
    SEEN.clear()
    with pytest.raises(InvalidParams) as refused:
        method.bind(params, 64)
    assert SEEN == []
    assert (refused.value.param, refused.value.reason) == (
        ("p", "Number out of range - at `p[...]`") if fn is watched else ("p", "Number out of range - at `p[...][1]`"))
    assert method.bind(params.replace(b"1e400", b"1e300"), 64)[0][-1] == Watched([1, 1e300] if fn is watched_alone else 1e300)


@pytest.fixture(scope="module")
def broker() -> typing.Iterator[Broker]:
    b = start_broker("--workers", "1", "--app", "tests.apps.bignums:registry")
    yield b
    assert b.stop() == 0, b.read_log()


def post(broker: Broker, body: bytes) -> typing.Any:
    status, _, answer = broker.post(body, timeout=60)
    assert status == 200, answer[:300]
    return json.loads(answer)


def call(method: str, params: bytes, id_: int = 7) -> bytes:
    return b'{"jsonrpc": "2.0", "method": "' + method.encode() + b'", "params": ' + params + b', "id": ' + str(id_).encode() + b"}"


def test_a_mib_of_slow_floats_is_bound_over_http(broker: Broker) -> None:
    """Round 136 refused a MiB of `1e308` -32602 for their count; round 137's halfway floats held
    the worker 0.25 s. Both are bound now, and refused for a `str` as any float is."""
    for token in (b"1e308", HALFWAY):
        values = array_of(token, MIB - 40)
        answer = post(broker, call("spread", b"[" + values + b"]"))
        assert answer == {"jsonrpc": "2.0", "id": 7, "result": [values.count(b",") + 1, float(token), float(token)]}
        answer = post(broker, call("mark", values))
        assert answer["error"]["code"] == -32602, answer
        assert answer["error"]["data"] == {"param": "tag", "reason": "Expected `str`, got `float`"}, answer


def test_a_batch_of_small_calls_of_slow_floats_over_http(broker: Broker) -> None:
    """Round 137, F2: a 1 MiB batch of 127 calls, each of 8 KiB of `1e300` (under the count's
    8 KiB floor: 1.4 s of the worker); each is answered, and the honest F9 payload too."""
    values = array_of(b"1e300", 8187)
    batch = b"[" + b",".join(call("spread", b"[" + values + b"]", i) for i in range(127)) + b"]"
    answers = post(broker, batch)
    spread = [values.count(b",") + 1, 1e300, 1e300]
    assert sorted((a["id"], a.get("result")) for a in answers) == [(i, spread) for i in range(127)]
    sentinels = json.dumps([1.5, sys.float_info.max] * 300).encode()
    assert post(broker, call("spread", b"[" + sentinels + b"]"))["result"] == [600, 1.5, sys.float_info.max]


def test_a_refusal_builds_the_params_twice_at_most_over_http(broker: Broker) -> None:
    before = post(broker, call("made", b"[]"))["result"]
    answer = post(broker, call("counted", b'[{"x": 1}, 1.5, 2.0]'))
    assert answer["error"]["data"] == {"param": "tag", "reason": "Expected `str`, got `float`"}, answer
    assert post(broker, call("made", b"[]"))["result"] - before == 2
