"""Numbers msgspec's JSON parser reads slowly (`1e308`, ~15 µs each where `1.5` takes 0.03:
broker/worker/slow_numbers.py), and the refusals whose params were decoded again for nothing
(hostile testing, round 136, F2: 1 MiB of `1e308` given to `mark(tag: str, ...)` held a worker
5 s, decoded three times to be refused). First the count itself and `Method.bind`, then a real
broker and its one worker over HTTP."""

from __future__ import annotations

import json
import typing

import pytest

from broker.worker.params import InvalidParams, Method
from broker.worker.slow_numbers import (
    SLOW_NUMBERS_BYTES,
    SLOW_NUMBERS_MAX,
    TOO_MANY_SLOW_NUMBERS,
    slow_numbers,
)
from tests.apps import bignums
from tests.conftest import Broker, start_broker

MIB = (1 << 20) - 100  # (a MiB with the envelope: max_body_bytes, 1 MiB by default)


def array_of(token: bytes, size: int = MIB) -> bytes:
    """A JSON array of `token` repeated, as many as `size` bytes hold."""
    return b"[" + b",".join([token] * ((size - 1) // (len(token) + 1))) + b"]"


SLOW_FORMS = [b"1e308", b"1E+308", b"-1e290", b"1.7976931348623157e308", b"123456e303", b"0.0001e293",
              b"1e0300", b"1" * 59 + b"e249", b"1" * 308 + b".0", b"1" * 110 + b"e198", b"0." + b"0" * 200 + b"1e500"]


@pytest.mark.parametrize("token", SLOW_FORMS, ids=lambda t: t[-12:].decode())
def test_each_slow_form_is_counted(token: bytes) -> None:
    assert slow_numbers(array_of(token)) == SLOW_NUMBERS_MAX + 1  # (counted up to one past the bound)
    assert slow_numbers(array_of(token, SLOW_NUMBERS_BYTES)) == 0  # (small params are not counted)


ORDINARY = [array_of(b"1.5"), array_of(b"1e200"), array_of(b"1e-300"), array_of(b"1.5e10"), array_of(b"1.5E+10"),
            array_of(b"12345678901234567890"), array_of(b'"' + b"e308 " * 40 + b'"'),
            json.dumps(["%064x" % (k * 0x9E3779B97F4A7C15 ** 3) for k in range(15000)]).encode(),
            json.dumps({"text": "the seventeen elephants entered 3e312f, " * 25000}).encode()]


@pytest.mark.parametrize("params", ORDINARY, ids=range(len(ORDINARY)))
def test_ordinary_numbers_and_strings_are_not_counted(params: bytes) -> None:
    assert len(params) > SLOW_NUMBERS_BYTES
    assert slow_numbers(params) == 0


def test_past_the_bound_params_are_refused_before_they_are_decoded() -> None:
    for fn, params in ((bignums.mark, array_of(b"1e308")), (bignums.total, b"[" + array_of(b"1e308") + b"]")):
        with pytest.raises(InvalidParams) as refused:
            Method(fn.__name__, fn).bind(params, 64)
        assert (refused.value.param, refused.value.reason) == (None, TOO_MANY_SLOW_NUMBERS)
    named = b'{"values": ' + array_of(b"1e308", SLOW_NUMBERS_BYTES) + b"}"
    with pytest.raises(InvalidParams) as refused:
        Method("total", bignums.total).bind(named, 64)
    assert refused.value.reason == TOO_MANY_SLOW_NUMBERS


def test_up_to_the_bound_params_bind_as_before() -> None:
    values = [1e308] * SLOW_NUMBERS_MAX + [1.5] * 4000
    params = json.dumps(values).encode()
    assert len(params) > SLOW_NUMBERS_BYTES
    assert Method("total", bignums.total).bind(b"[" + params + b"]", 64) == ((values,), {})
    with pytest.raises(InvalidParams) as refused:  # (refused as before, not for its numbers)
        Method("mark", bignums.mark).bind(params, 64)
    assert (refused.value.param, refused.value.reason) == ("tag", "Expected `str`, got `float`")


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


@pytest.fixture(scope="module")
def broker() -> typing.Iterator[Broker]:
    b = start_broker("--workers", "1", "--app", "tests.apps.bignums:registry")
    yield b
    assert b.stop() == 0, b.read_log()


def post(broker: Broker, method: str, params: bytes) -> dict[str, typing.Any]:
    body = b'{"jsonrpc": "2.0", "method": "' + method.encode() + b'", "params": ' + params + b', "id": 7}'
    status, _, answer = broker.post(body, timeout=60)
    assert status == 200, answer[:300]
    return typing.cast(dict[str, typing.Any], json.loads(answer))


def test_a_mib_of_slow_numbers_is_refused_over_http(broker: Broker) -> None:
    for method, params in (("mark", array_of(b"1e308")), ("total", b"[" + array_of(b"1e308", MIB - 2) + b"]")):
        answer = post(broker, method, params)
        assert answer["id"] == 7
        assert answer["error"]["code"] == -32602, answer
        assert answer["error"]["data"] == {"param": None, "reason": TOO_MANY_SLOW_NUMBERS}, answer
    # the same worker answers params of ordinary numbers of that size, and those up to the bound
    ordinary = post(broker, "total", b"[" + array_of(b"1.5", MIB - 2) + b"]")
    assert ordinary["result"] == 1.5 * ((MIB - 3) // 4), ordinary
    up_to = [1e300] * SLOW_NUMBERS_MAX + [2.5] * 4000
    assert post(broker, "total", json.dumps([up_to]).encode())["result"] == sum(up_to)


def test_a_refusal_builds_the_params_twice_at_most_over_http(broker: Broker) -> None:
    before = post(broker, "made", b"[]")["result"]
    answer = post(broker, "counted", b'[{"x": 1}, 1.5, 2.0]')
    assert answer["error"]["data"] == {"param": "tag", "reason": "Expected `str`, got `float`"}, answer
    assert post(broker, "made", b"[]")["result"] - before == 2
