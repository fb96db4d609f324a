"""Params a client makes costly to bind: values of one hash in a set or an object's keys
(hash flooding, broker/collisions.py) and the members enum.Flag makes for good (issue 9,
hostile testing round 36: 12,000 UUIDs of one hash held a worker 7.4 s; IntFlag params
grew a worker by 36 MiB per request, never given back)."""

from __future__ import annotations

import dataclasses
import decimal
import enum
import gc
import json
import math
import sys
import tracemalloc
import typing
import uuid

import msgspec
import pytest
from conftest import Broker, start_broker, wait_for
from hypothesis import given, settings
from hypothesis import strategies as st

from broker import collisions
from broker.collisions import MADE_MEMBERS_MAX, UNNAMED_COST_MAX
from broker.worker import FLAG_PSEUDO_MEMBERS_MAX, InvalidParams, Method, NestingTooDeep
from broker.worker.params import QUIET_BYTES, _drop_flag_members

MODULUS = 2**61 - 1  # CPython hashes an int as its value modulo this (sys.hash_info.modulus)
MAX = collisions.SHARED_HASH_MAX


def one_hash(count: int, base: int = 5) -> list[int]:
    """`count` distinct integers of one hash."""
    return [base + k * MODULUS for k in range(count)]


def uuids(values: list[int]) -> list[str]:
    return [str(uuid.UUID(int=v)) for v in values]


@pytest.fixture(scope="module")
def flooding() -> typing.Iterator[Broker]:
    b = start_broker("--workers", "1", "--app", "tests.apps.flooding:registry")
    yield b
    assert b.stop() == 0, b.read_log()


def refused(answer: dict[str, object], param: str) -> str:
    error = typing.cast(dict[str, typing.Any], answer.get("error"))
    assert error is not None, answer
    assert error["code"] == -32602, answer
    assert error["data"]["param"] == param, answer
    reason = typing.cast(str, error["data"]["reason"])
    assert "hash flooding" in reason, answer
    return reason


def test_uuids_of_one_hash_are_refused_over_http(flooding: Broker) -> None:
    # Before: bound (quadratic time; 12,000 took 7 s) and answered 3000.
    reason = refused(flooding.call("distinct", [uuids(one_hash(3000))]), "ids")
    assert f"more than {MAX} distinct values of one hash" in reason
    by_name = flooding.call("distinct", {"ids": uuids(one_hash(3000, 7))})
    refused(by_name, "ids")
    assert flooding.call("pid")["result"] == flooding.call("pid")["result"]  # (the same worker, still serving)


def test_sets_that_are_not_floods_bind(flooding: Broker) -> None:
    assert flooding.call("distinct", [[str(uuid.uuid4()) for _ in range(3000)]])["result"] == 3000
    assert flooding.call("distinct", [uuids([5] * 3000)])["result"] == 1  # (duplicates: one value)
    assert flooding.call("distinct", [uuids(one_hash(MAX)) * 3])["result"] == MAX  # (the bound itself)
    refused(flooding.call("distinct", [uuids(one_hash(MAX + 1))]), "ids")


def test_tuples_and_int_keys_of_one_hash_are_refused(flooding: Broker) -> None:
    # hash((a, b)) is not randomized: pairs (v, 0) with v of one hash share one.
    refused(flooding.call("pairs", {"points": [[v, 0] for v in one_hash(2000)], "scale": 2}), "points")
    assert flooding.call("pairs", {"points": [[i, i] for i in range(2000)], "scale": 2})["result"] == 4000
    reason = refused(flooding.call("weights", [{str(v): 1.5 for v in one_hash(2000)}]), "table")
    assert "one object's keys" in reason
    assert flooding.call("weights", [{str(i): 0.5 for i in range(2000)}])["result"] == 1000.0
    # A wrong value still gets msgspec's own reason, not the flood's.
    error = typing.cast(dict[str, typing.Any], flooding.call("weights", [{"x": 1.5}])["error"])
    assert error["code"] == -32602 and error["data"]["param"] == "table" and "flood" not in error["data"]["reason"]


def test_a_flood_deep_in_a_recursive_struct_is_located(flooding: Broker) -> None:
    root = {"tags": [1, 2], "children": [{"children": [{"tags": one_hash(100)}]}]}
    reason = refused(flooding.call("tree", [root]), "root")
    assert "root.children[0].children[0].tags" in reason
    root["children"][0]["children"][0]["tags"] = list(range(100))  # type: ignore[index]
    assert flooding.call("tree", [root])["result"] == 102


def test_intflag_members_a_client_makes_are_bounded(flooding: Broker) -> None:
    """Each distinct value an IntFlag param takes makes a member the enum module caches
    for good; past FLAG_PSEUDO_MEMBERS_MAX those nothing holds are dropped. Before: every
    value sent stayed (18,003 members after three calls). One call makes at most
    MADE_MEMBERS_MAX of a class (round 44), so the calls here make 4000 each."""
    before = typing.cast(dict[str, int], flooding.call("flag_members")["result"])
    per_call = 4000
    for round_ in range(3):
        flags = [(round_ * per_call + i) * 7 % (1 << 24) for i in range(1, per_call + 1)]
        assert flooding.call("perms", flags)["result"] == per_call
    after = typing.cast(dict[str, int], flooding.call("flag_members")["result"])
    assert after["Perm"] <= before["Perm"] + FLAG_PSEUDO_MEMBERS_MAX, (before, after)
    # Round 38: each class's members were dropped only when its own method was called
    # next: two classes in two methods kept a call's members each (55 MB per MiB). Mode
    # passes the bound in the second `modes` call, and is read after a `perms` call.
    for round_ in range(2):
        assert flooding.call("modes", [(round_ * per_call + i) * 5 for i in range(1, per_call + 1)])["result"] == per_call
    assert flooding.call("perms", [1, 2, 3])["result"] == 3
    last = typing.cast(dict[str, int], flooding.call("flag_members")["result"])
    assert last["Mode"] <= before["Mode"] + FLAG_PSEUDO_MEMBERS_MAX, (before, last)
    assert last["Perm"] <= before["Perm"] + FLAG_PSEUDO_MEMBERS_MAX, (before, last)
    # Round 42: a sync handler returning a coroutine kept its call's members after it
    # ended. They are dropped once its task has ended, two loop turns after its answer
    # went out: the next call may come first (stop 27 read them once, at once: 1 run in 2).
    # (A sync call first, whose members stay below the bound, so that the second passes it.)
    assert flooding.call("perms", [i * 13 % (1 << 24) for i in range(1, per_call + 1)])["result"] == per_call
    assert flooding.call("perms_later", [i * 11 % (1 << 24) for i in range(1, per_call + 1)])["result"] == per_call
    wait_for(lambda: typing.cast(dict[str, int], flooding.call("flag_members")["result"])["Perm"]
             <= before["Perm"] + FLAG_PSEUDO_MEMBERS_MAX, timeout=5)
    # Round 44: more than MADE_MEMBERS_MAX new members of one class in one call are refused
    # (110,000 valid values held a worker 0.8 to 1.9 s a call).
    error = typing.cast(dict[str, typing.Any], flooding.call("perms", [i * 17 % (1 << 24) for i in range(1, 20_001)])["error"])
    assert error["code"] == -32602 and error["data"]["param"] == "flags", error
    assert error["data"]["reason"].startswith(f"more than {MADE_MEMBERS_MAX} distinct values of Perm that it has no member")
    assert flooding.call("perms", [1, 2, 4] * 10_000)["result"] == 30_000  # (its own members: none made)
    # New user, round 118, F10: one combination throughout a bulk call (R|W in every record) was
    # refused past UNNAMED_COST_MAX; a member made already is now looked up, and costs nothing of it.
    assert flooding.call("perms", [3] * (UNNAMED_COST_MAX + 4000))["result"] == UNNAMED_COST_MAX + 4000
    # Round 40: values not made of the members' bits are refused (negative ones too).
    error = typing.cast(dict[str, typing.Any], flooding.call("perms", [1, 1 << 24])["error"])
    assert error["code"] == -32602 and error["data"] == {
        "param": "flags", "reason": "16777216 is not made of the bits of Perm's members - at `params[1]`"}
    assert flooding.call("perms", [-1])["error"]["data"]["reason"].startswith("-1 is not made of")  # type: ignore[index]


Wide = enum.IntFlag("Wide", {f"W{i}": 1 << i for i in range(24)})


class Colour(enum.Flag):
    RED = 1
    GREEN = 2
    BLUE = 4


HELD = Wide.W3 | Wide.W7
GREEN_BLUE = Colour.GREEN | Colour.BLUE


def wide_handler(*flags: Wide) -> int:  # type: ignore[valid-type]
    return len(flags)


def colours_handler(colours: list[Colour]) -> int:
    return len(colours)


def test_flag_members_still_held_are_kept_the_same_object() -> None:
    method = Method("wide", wide_handler)
    held = Wide(1 << 20 | 1)
    for round_ in range(3):
        values = b",".join(b"%d" % (round_ * 4000 + i) for i in range(1, 4001))
        args, _ = method.bind(b"[" + values + b"]", 64)
        assert len(args) == 4000
        del args
        _drop_flag_members((Wide,))  # (as the worker does after each such call)
    assert len(Wide._value2member_map_) <= FLAG_PSEUDO_MEMBERS_MAX + 64
    assert Wide(1 << 3 | 1 << 7) is HELD and Wide(1 << 20 | 1) is held
    # A plain Flag compares by identity: a composite a module holds stays the one.
    colours = Method("colours", colours_handler)
    args, _ = colours.bind(b"[[6, 3, 1]]", 64)
    assert args[0][0] is GREEN_BLUE and args[0][2] is Colour.RED


# The guard itself, on decoded JSON values (sans-IO).

class Point(typing.NamedTuple):
    x: int
    y: int


class Shape(typing.TypedDict):
    corners: set[Point]


@dataclasses.dataclass
class Holder:
    keys: dict[decimal.Decimal, str]


class Node(msgspec.Struct, array_like=True):
    label: str
    below: list[Node] = []
    marks: frozenset[frozenset[int]] = frozenset()


def flooded(kind: object, value: object) -> list[str | int] | None:
    check = collisions.guard(kind)
    assert check is not None
    try:
        check(value)
    except collisions.Flooded as exc:
        return exc.where
    return None


def test_types_without_sets_or_non_str_keys_need_no_check() -> None:
    for kind in (int, list[int], dict[str, set[str]], tuple[str, ...], set[str], frozenset[bytes],
                 dict[str, list[dict[str, int]]], typing.Any, set[typing.Literal[1, 2]]):
        assert collisions.guard(kind) is None, kind


def test_the_guard_finds_floods_in_every_container_msgspec_builds() -> None:
    assert flooded(Shape, {"corners": [[v, 1] for v in one_hash(20)]}) == ["corners"]
    assert flooded(Holder, {"keys": {str(v): "x" for v in one_hash(20)}}) == ["keys"]
    assert flooded(Holder, {"keys": {str(i): "x" for i in range(20)}}) is None
    deep = ["a", [["b", [], [one_hash(3), one_hash(20)]]]]
    assert flooded(Node, deep) == [1, 0, 2, 1]
    assert flooded(list[set[int]] | None, [[1], one_hash(20)]) == [1]
    assert flooded(typing.Annotated[set[int], msgspec.Meta(max_length=5)], one_hash(20)) == []
    assert flooded(dict[str, set[uuid.UUID]], {"k": uuids(one_hash(20))}) == ["k"]


def test_the_guard_passes_over_values_that_do_not_fit() -> None:
    """Shapes the binding refuses with msgspec's own reason: the check says nothing."""
    assert flooded(set[int], {"a": 1}) is None
    assert flooded(set[int], ["x", *one_hash(MAX), "y"]) is None
    # (msgspec stops at the first element it cannot convert: those before it are checked)
    assert flooded(set[int], [*one_hash(MAX + 1), "x"]) == []
    assert flooded(set[int], ["x", *one_hash(MAX + 1)]) is None
    assert flooded(Node, {"label": 3}) is None


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 12)), max_size=60))
def test_refused_exactly_when_more_than_the_bound_share_a_hash(picks: list[tuple[int, int]]) -> None:
    """Values are (hash group g, member k): g + k * MODULUS. Refused iff some group holds
    more than SHARED_HASH_MAX distinct members."""
    values = [g + k * MODULUS for g, k in picks]
    distinct: dict[int, set[int]] = {}
    for g, k in picks:
        distinct.setdefault(g, set()).add(k)
    expected = any(len(members) > MAX for members in distinct.values())
    assert (flooded(set[int], values) is not None) == expected
    method = Method("m", set_handler)
    if expected:
        with pytest.raises(InvalidParams, match="hash flooding"):
            method.bind(msgspec.json.encode([values]), 64)
    else:
        assert method.bind(msgspec.json.encode([values]), 64) == ((set(values),), {})


def set_handler(values: set[int]) -> int:
    return len(values)


# Round 37: ways around the guard, each seen binding a flood (or worse) before its fix.

class TaggedRow(msgspec.Struct, array_like=True, tag=True):
    ids: set[int] = set()


class Leaf(msgspec.Struct, tag=True):
    below: list[Leaf | Fork] = []
    marks: set[int] = set()


class Fork(msgspec.Struct, tag=True):
    below: list[Leaf | Fork] = []
    marks: set[int] = set()


class Keep(enum.Flag, boundary=enum.KEEP):
    ONE = 1


def test_a_tagged_array_like_struct_is_checked_past_its_tag() -> None:
    """Its array opens with the tag: every field was checked one place early, the set never."""
    assert flooded(TaggedRow, ["TaggedRow", one_hash(20)]) == [1]
    assert flooded(TaggedRow, ["TaggedRow", list(range(20))]) is None


@pytest.mark.timeout(60)
def test_a_recursive_union_of_tagged_structs_is_walked_once_per_value() -> None:
    """Each branch of `Leaf | Fork` walked the same value: 2**depth walks (688 bytes of
    params held a worker until it was killed as hung). Depth 40 ends now; before, never."""
    def tree(marks: list[int]) -> dict[str, object]:
        value: dict[str, object] = {"type": "Leaf", "marks": marks}
        for _ in range(40):
            value = {"type": "Fork", "below": [value], "marks": [1, 2]}
        return value

    assert flooded(Leaf | Fork, tree(list(range(20)))) is None  # (every branch walked: no flood to stop at)
    assert flooded(Leaf | Fork, tree(one_hash(20))) == ["below", 0] * 40 + ["marks"]


def test_a_flag_takes_its_members_bits_only() -> None:
    """A KEEP Flag's members of unknown bits have no name and all hash as None (round 37:
    a set of them was built quadratically); the enum module caches each in a dict keyed
    by the value (round 39: IntFlag values of one hash in a list, quadratic), a negative
    one under a twin too, and the values a union holds were not checked (round 40):
    values not made of a Flag's members' bits are refused, wherever they are bound."""
    unknown = [2 << k for k in range(20)]
    assert len({hash(Keep(v)) for v in unknown}) == 1
    for kind, value, where in ((set[Keep], unknown, [0]), (list[Wide], [1, -1], [1]),  # type: ignore[valid-type]
                               (list[Wide | None], [None, 1 << 24], [1]),  # type: ignore[valid-type]
                               (dict[str, Wide | None], {"k": 5 + MODULUS}, ["k"])):  # type: ignore[valid-type]
        with pytest.raises(collisions.UnknownBits) as info:
            check = collisions.guard(kind)
            assert check is not None
            check(value)
        assert info.value.where == where, kind
    assert flooded(set[Keep], [1, 1, 0]) is None
    assert flooded(list[Wide | None], [None, (1 << 24) - 1, 0]) is None  # type: ignore[valid-type]


def posonly_set(a: int = 0, /, **kw: frozenset[uuid.UUID]) -> int:
    return len(kw)


def posonly_any(a: frozenset[uuid.UUID] = frozenset(), /, **kw: typing.Any) -> int:
    return len(kw)


def test_a_positional_only_name_beside_kwargs_is_checked_as_kwargs_takes_it() -> None:
    """Beside **kwargs a positional-only parameter's name is **kwargs's: it was checked with
    the parameter's hint (int: nothing) and then built into **kwargs's set unchecked; with
    **kwargs: Any (no set built) it was refused."""
    with pytest.raises(InvalidParams, match="hash flooding") as info:
        Method("f", posonly_set).bind(msgspec.json.encode({"a": uuids(one_hash(20))}), 64)
    assert info.value.param == "a"
    args, kwargs = Method("g", posonly_any).bind(msgspec.json.encode({"a": uuids(one_hash(20))}), 64)
    assert args == (frozenset(),) and kwargs == {"a": uuids(one_hash(20))}


# Round 38.

class Kind1(msgspec.Struct, tag=True):
    marks: set[int] = set()
    below: list[Kind1 | Kind2 | Kind3 | Kind4] = []


class Kind2(msgspec.Struct, tag=True):
    marks: set[int] = set()
    below: list[Kind1 | Kind2 | Kind3 | Kind4] = []


class Kind3(msgspec.Struct, tag=True):
    marks: set[int] = set()


class Kind4(msgspec.Struct, tag=True):
    marks: set[int] = set()


def counted(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the guard's conversions (each a real msgspec.convert)."""
    calls = [0]
    real = collisions._convert

    def convert(*args: typing.Any, **kwargs: typing.Any) -> typing.Any:
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(collisions, "_convert", convert)
    return calls


def test_a_union_of_tagged_structs_checks_a_value_by_its_tag_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each of a union's branches converted the same set again, those its tag does not
    name too (8 branches: 5.9 s for 660 KB)."""
    calls = counted(monkeypatch)
    value = {"type": "Kind1", "below": [{"type": "Kind3", "marks": list(range(100))}], "marks": list(range(50))}
    assert flooded(Kind1 | Kind2 | Kind3 | Kind4, value) is None
    assert calls[0] == 2  # (one set each: not one per branch)
    assert flooded(Kind1 | Kind2 | Kind3 | Kind4, {"type": "Kind4", "marks": one_hash(20)}) == ["marks"]
    assert flooded(Kind1 | Kind2 | Kind3 | Kind4, {"type": "Kind9", "marks": one_hash(20)}) is None  # (no branch)


def test_a_set_that_does_not_convert_is_checked_up_to_its_first_bad_element(monkeypatch: pytest.MonkeyPatch) -> None:
    """msgspec stops at the first element it cannot convert: those after it were converted
    one by one all the same (0.5 s per MiB of params refused anyway)."""
    calls = counted(monkeypatch)
    assert flooded(set[int], [*range(5000), "x", *range(5000)]) is None
    assert calls[0] == 2  # (the whole list, then the part before "x")
    assert flooded(set[int], [*one_hash(MAX + 1), "x", *range(50)]) == []


class Stored(msgspec.Struct, frozen=True):
    key: decimal.Decimal
    payload: msgspec.Raw = msgspec.Raw(b"null")


@dataclasses.dataclass(frozen=True)
class StoredData:
    key: decimal.Decimal
    payload: msgspec.Raw = dataclasses.field(compare=False, default_factory=lambda: msgspec.Raw(b"null"))


class Chain(msgspec.Struct, frozen=True):
    below: frozenset[Chain] = frozenset()


def store(items: frozenset[Stored]) -> int:
    return len(items)


def store_data(items: frozenset[StoredData]) -> int:
    return len(items)


def nested(groups: frozenset[frozenset[int]]) -> int:
    return len(groups)


def chain(root: Chain) -> int:
    return 0


def labelled(groups: set[frozenset[str]], pairs: set[tuple[str, int]]) -> int:
    return len(groups)


def test_what_the_guard_cannot_read_in_linear_time_fails_the_registration() -> None:
    """A set's elements holding a msgspec.Raw (which the check's conversion cannot make: the
    set was built unchecked, 215 KB held a worker 8.8 s), or a set of their own (each level
    converted whole again: time times the depth)."""
    for handler, why in ((store, "a set's elements hold a msgspec.Raw"),
                         (store_data, "a msgspec.Raw in a dataclass or TypedDict"),
                         (nested, "a set's elements hold a set of their own"),
                         (chain, "a set's elements hold a set of their own")):
        with pytest.raises(TypeError, match=f"method '{handler.__name__}': {why}"):
            Method(handler.__name__, handler)
    assert Method("labelled", labelled).bind(b'[[["a", "b"], ["a"]], [["x", 1]]]', 64) == (
        ({frozenset({"a", "b"}), frozenset({"a"})}, {("x", 1)}), {})


# Round 39.

class Batch(msgspec.Struct):
    ids: set[uuid.UUID]


def place(batch: Batch, amount: decimal.Decimal = decimal.Decimal(0)) -> int:
    return len(batch.ids)


def test_a_duplicate_key_does_not_build_a_flood_the_check_did_not_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """In a method whose values are decoded from their own text (a Decimal in its hints),
    the check read an object's last duplicate key, while the decoder built the set of
    every duplicate: `{"ids": [<UUIDs of one hash>], "ids": [...]}` held a worker 12.8 s.
    The UUIDs' comparisons are counted: building a flood of n costs n**2 / 2 of them."""
    compared = [0]
    real_eq = uuid.UUID.__eq__

    def eq(self: uuid.UUID, other: object) -> bool:
        compared[0] += 1
        return real_eq(self, other)

    monkeypatch.setattr(uuid.UUID, "__eq__", eq)
    flood = msgspec.json.encode(uuids(one_hash(2000)))
    params = b'[{"ids": ' + flood + b', "ids": ["' + str(uuid.UUID(int=7)).encode() + b'"]}, 1.5]'
    args, _ = Method("place", place).bind(params, 64)
    assert args == (Batch({uuid.UUID(int=7)}), decimal.Decimal("1.5"))
    assert compared[0] < 100, compared[0]  # (before: about 2,000,000)


class Shade(enum.IntFlag):
    DARK = 1
    LIGHT = 2


def shades(values: list[Shade | None], *more: Shade, price: decimal.Decimal = decimal.Decimal(0)) -> int:
    return len(values) + len(more)


def shaded(table: dict[Shade | None, int]) -> int:
    return len(table)


def test_flag_values_are_checked_on_every_path() -> None:
    """Round 40: in a method decoded value by value (a Decimal in its hints), each *args
    value was checked apart, hashing the Flag's whole member map each time (40 KB held a
    worker 11.8 s); a Flag in a union was not checked at all. A Flag among dict keys, in a
    union too, fails the registration."""
    method = Method("shades", shades)
    for params, param in ((b"[[null, 5]]", "values"), (b"[[], 1, 2, 4]", "more"), (b'{"values": [8]}', "values")):
        with pytest.raises(InvalidParams, match="is not made of the bits of Shade's members") as info:
            method.bind(params, 64)
        assert info.value.param == param
    assert method.bind(b"[[null, 3], 1, 2]", 64) == (([None, Shade.DARK | Shade.LIGHT], Shade.DARK, Shade.LIGHT), {})
    with pytest.raises(TypeError, match=r"method 'shaded': a dict's keys are enum\.Flag members"):
        Method("shaded", shaded)


# Round 41.

class Access(enum.IntFlag):
    R = 1
    W = 2
    ALL = ~0


class Quota(msgspec.Struct, tag="quota"):
    mode: int


class Limits(msgspec.Struct, tag="limits"):
    mode: Shade


def typed_ids(ids: set[int], price: decimal.Decimal = decimal.Decimal(0)) -> int:
    return len(ids)


def typed_shades(values: list[Shade], price: decimal.Decimal = decimal.Decimal(0)) -> int:
    return len(values)


def access(values: list[Access]) -> int:
    return len(values)


def rule(item: Quota | Limits) -> int:
    return 0


def plain_ids(ids: set[int]) -> int:
    return len(ids)


def test_a_number_written_with_an_exponent_is_read_in_that_form_on_every_path() -> None:
    """In a method decoded value by value (a Decimal among its hints), a value holding a
    set is decoded from what the check read, written again: a Decimal written as `str(d)`
    made `1e0` the integer 1, which the check had not read as an int (round 41: nothing
    was checked, and the set built; round 42: the same with 21 digits `...e0`, 1 MiB held a
    worker 25.6 s), and `8e0` passed as a Flag's value. Such a number is an integer (JSON
    Schema; broker/worker/integral.py): it binds to an int, read as one by the check too,
    which refuses the flood, on every path; one with a fractional part is refused."""
    flood = b", ".join(b"%d" % v for v in one_hash(20))
    for first in (b"1e0", b"123456789012345678901e0", b"8.0"):
        with pytest.raises(InvalidParams, match=r"refused \(hash flooding\)") as info:
            Method("typed_ids", typed_ids).bind(b"[[" + first + b", " + flood + b"]]", 64)
        assert info.value.param == "ids"
        assert Method("plain_ids", plain_ids).bind(b"[[" + first + b", 2]]", 64) == (({int(decimal.Decimal(first.decode())), 2},), {})
    with pytest.raises(InvalidParams, match="Expected `int`, got a number with a fractional part"):
        Method("typed_ids", typed_ids).bind(b"[[0.5, " + flood + b"]]", 64)
    with pytest.raises(InvalidParams, match="8 is not made of the bits of Shade's members"):
        Method("typed_shades", typed_shades).bind(b"[[1, 8e0]]", 64)
    assert Method("typed_shades", typed_shades).bind(b"[[1, 2e0]]", 64) == (([Shade.DARK, Shade.LIGHT], decimal.Decimal(0)), {})
    assert Method("typed_ids", typed_ids).bind(b"[[1, 3], 1e0]", 64) == (({1, 3}, decimal.Decimal("1E+0")), {})


def test_a_flag_with_a_negative_member_keeps_its_bits_and_takes_that_member() -> None:
    """`ALL = ~0` made the mask -1 and let every value in (1 MiB of one hash: 10.9 s), and
    a member's own negative value was refused."""
    method = Method("access", access)
    with pytest.raises(InvalidParams, match="is not made of the bits of Access's members"):
        method.bind(msgspec.json.encode([[1 << 40]]), 64)
    assert method.bind(b"[[-1, 3, 0]]", 64) == (([Access.ALL, Access.R | Access.W, Access(0)],), {})


def test_a_tagged_union_checks_only_the_branch_its_tag_names() -> None:
    """Only one branch holding a Flag, its check ran whatever the tag said: a Quota's int
    `mode` of 8 was refused as a Shade's."""
    method = Method("rule", rule)
    assert method.bind(b'[{"type": "quota", "mode": 8}]', 64) == ((Quota(8),), {})
    with pytest.raises(InvalidParams, match="8 is not made of the bits of Shade's members"):
        method.bind(b'[{"type": "limits", "mode": 8}]', 64)


def test_members_an_async_call_held_are_dropped_when_it_ends() -> None:
    """The drop made as an async call began counted its members as kept (the call held
    them); when it ended, no growth was seen and they stayed (50,675 after one call)."""
    method = Method("wide", wide_handler)
    held = [method.bind(b"[" + b",".join(b"%d" % (7 * i) for i in range(k, k + 3000)) + b"]", 64) for k in (1, 3001)]
    _drop_flag_members((Wide,))  # (as the call begins: every member held)
    assert len(Wide._value2member_map_) > 6000
    del held
    _drop_flag_members((Wide,), True)  # (as the worker does when an async call's task ends)
    assert len(Wide._value2member_map_) <= FLAG_PSEUDO_MEMBERS_MAX + 64


# Round 43.

def priced_tuples(points: set[tuple], fee: decimal.Decimal = decimal.Decimal(0)) -> int:  # type: ignore[type-arg]
    return len(points)


def priced_any(tags: frozenset[typing.Any], *, fee: decimal.Decimal = decimal.Decimal(0)) -> int:
    return len(tags)


def priced_typed(points: set[tuple[float, float]], fee: decimal.Decimal = decimal.Decimal(0)) -> int:
    return len(points)


def test_untyped_set_elements_beside_a_decimal_fail_the_registration() -> None:
    """Beside a Decimal parameter, the check read numbers with a fraction as Decimals, the
    decoder built floats where a set's elements are untyped: float pairs of one hash
    passed the check (1 MB held a worker 12 s, a ping waited 12.2 s)."""
    for handler in (priced_tuples, priced_any):
        with pytest.raises(TypeError, match=f"method '{handler.__name__}': beside a Decimal, a set's elements"):
            Method(handler.__name__, handler)
    assert Method("priced_typed", priced_typed).bind(b"[[[0.5, 1.5]], 0.10]", 64) == (
        ({(0.5, 1.5)}, decimal.Decimal("0.10")), {})


def priced_pair(x: tuple[float, set[int]], fee: decimal.Decimal = decimal.Decimal(0)) -> object:
    return x


def plain_pair(x: tuple[float, set[int]], fee: float = 0.0) -> object:
    return x


def test_a_number_past_decimals_exponent_limits_binds_as_without_a_decimal() -> None:
    """Round 43: beside a Decimal, a value checked for hash flooding is read with its
    numbers as Decimals, and a number whose exponent is past decimal's limits
    (`1e-99999999999999999999`, which msgspec reads as 0.0) was refused "Number out of
    range", where a method without a Decimal bound it as 0.0. Now both bind it; one that
    overflows is refused on both."""
    for text, value in ((b"1e-99999999999999999999", 0.0), (b"-1e-99999999999999999999", -0.0),
                        (b"0e99999999999999999999", 0.0)):
        params = b"[[" + text + b", [1, 2]]]"
        for handler in (priced_pair, plain_pair):
            (bound, _fee), _ = Method(handler.__name__, handler).bind(params, 64)
            assert bound == (value, {1, 2}) and math.copysign(1, bound[0]) == math.copysign(1, value), handler
    for handler in (priced_pair, plain_pair):
        with pytest.raises(InvalidParams, match="Number out of range"):
            Method(handler.__name__, handler).bind(b"[[1e99999999999999999999, [1]]]", 64)
        with pytest.raises(InvalidParams, match="Expected `int`, got a number with a fractional part"):
            Method(handler.__name__, handler).bind(b"[[0.5, [1, 1e-99999999999999999999]]]", 64)


def test_a_deep_recursive_struct_holding_a_set_binds_as_deep_as_a_list(broker_factory: typing.Any) -> None:
    """Round 44: the check for hash flooding walks about 3 Python frames per level of JSON,
    and raised RecursionError past about 500 levels (max_depth raised to 1000): answered
    -32603 with a traceback logged, or -32600 "params nest deeper than max_depth 1000" beside
    a Decimal, where a list as deep bound. Its walk (and the worker's rewriting of what it
    read) now keeps a stack of its own (round 45: raising the recursion limit meanwhile, the
    fix of round 44, raised it for a tool's threads too: one with a small stack crashed)."""
    b = broker_factory("--workers", "1", "--max-depth", "1000", "--app", "tests.apps.flooding:registry")
    depth = 450  # (2 levels of JSON each: 902 with the params' array)
    root = json.loads('{"children":[' * (depth - 1) + '{"tags":[1,2]}' + "]}" * (depth - 1))
    for method in ("tree_depth", "priced_tree_depth"):
        assert b.call(method, [root]) == {"jsonrpc": "2.0", "id": 1, "result": depth}, method
    assert "RecursionError" not in b.read_log(0.05)


class RawAndTags(msgspec.Struct):
    raw: msgspec.Raw
    tags: set[int] = set()


def raw_and_tags(s: RawAndTags) -> object:
    return s


def priced_raw_and_tags(s: RawAndTags, fee: decimal.Decimal = decimal.Decimal(0)) -> object:
    return s


def raw_then_tags(raw: msgspec.Raw, tags: set[int]) -> object:
    return raw, tags


def test_a_raw_beside_a_set_in_one_parameter_fails_the_registration() -> None:
    """Round 44: a parameter holding a msgspec.Raw and a set is decoded from what the check
    for hash flooding read, written again: the Raw's `123456789012345678901234567890.5`
    became `1.2345678901234568e29`, `1e400` was refused, and `1.50` came as `1.5` or
    `1.50e+0` by whether a Decimal was beside. Such a hint now fails the registration; a
    Raw in a parameter of its own keeps its text as sent."""
    for handler in (raw_and_tags, priced_raw_and_tags):
        with pytest.raises(TypeError, match=f"method '{handler.__name__}': parameter 's' holds a msgspec.Raw beside a set"):
            Method(handler.__name__, handler)
    method = Method("raw_then_tags", raw_then_tags)
    for text in (b"123456789012345678901234567890.5", b"1e400", b"1.50", b"-0", b'"caf\\u00e9"'):
        (raw, tags), _ = method.bind(b"[" + text + b", [1, 2]]", 64)
        assert (bytes(raw), tags) == (text, {1, 2})


class DeepTree(msgspec.Struct):
    tags: set[int] = set()
    kids: list[DeepTree] = []


def deep_tree(root: DeepTree) -> object:
    return root


def priced_deep_tree(root: DeepTree, fee: decimal.Decimal = decimal.Decimal(0)) -> object:
    return root


def test_the_check_walks_deep_params_without_touching_the_recursion_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """Round 45: the check (and the rewriting of what it read, beside a Decimal) raised the
    recursion limit while it ran, which is the whole interpreter's: a tool's thread with a
    small stack, relying on RecursionError, ran off its end (SIGSEGV, the worker and its
    calls lost). They walk with stacks of their own now, and bind params nested 900 levels
    (about 1000 frames of recursion before) at the worker's limit without changing it."""
    calls: list[int] = []
    monkeypatch.setattr(sys, "setrecursionlimit", calls.append)
    depth = 450  # (2 levels of JSON each)
    params = ("[" + '{"kids":[' * depth + '{"tags":[1,2]}' + "]}" * depth + "]").encode()
    for handler in (deep_tree, priced_deep_tree):
        (root, *_), _ = Method(handler.__name__, handler).bind(params, 1000)
        for _ in range(depth):
            root = root.kids[0]
        assert root.tags == {1, 2}, handler
    assert calls == []


POST_INIT_RUNS = [0]


class CountedTree(msgspec.Struct):
    tags: set[int] = set()
    kids: list[CountedTree] = []

    def __post_init__(self) -> None:
        POST_INIT_RUNS[0] += 1


def priced_counted_tree(root: CountedTree, fee: decimal.Decimal = decimal.Decimal(0)) -> int:
    return 0


def test_params_past_max_depth_beside_a_decimal_are_refused_before_they_are_built() -> None:
    """Round 45: beside a Decimal, params nested past max_depth were decoded, checked,
    written again and built value by value, each `__post_init__` run, before they were
    refused (1 MiB: 1.3 to 1.6 s, against 0.12 to 0.23 s without a Decimal)."""
    depth = 100
    params = ("[" + '{"kids":[' * depth + '{"tags":[1,2]}' + "]}" * depth + "]").encode()
    POST_INIT_RUNS[0] = 0
    with pytest.raises(NestingTooDeep):
        Method("priced_counted_tree", priced_counted_tree).bind(params, 64)
    assert POST_INIT_RUNS[0] == 0


Wider = enum.IntFlag("Wider", {f"B{i}": 1 << i for i in range(60)})


def wider_handler(*flags: Wider) -> int:  # type: ignore[valid-type]
    return len(flags)


class Minded(enum.IntFlag):
    """A Flag with a `_missing_` of its own, which need not cache what it makes."""

    A = 1
    B = 2

    @classmethod
    def _missing_(cls, value: object) -> typing.Any:
        return super()._missing_(value)


def minded_handler(*flags: Minded) -> int:
    return len(flags)


def test_flag_values_that_are_no_named_member_are_bounded_per_call_by_their_bits() -> None:
    """Round 46: msgspec calls a Flag's `_missing_` for every value that is none of its
    named members, made before or not, so one value repeated 116,000 times (1 MiB) held a
    worker 1.8 to 2.5 s: MADE_MEMBERS_MAX counted only members made. Round 52: the call
    goes through the value's bits, and 16,384 values of 60 bits, counted one apiece, took
    0.3 to 0.4 s. A value costs 1 + its set bits // 8, up to UNNAMED_COST_MAX a call; named
    members cost nothing. New user, round 118, F10: a record list whose Flag field held
    `R|W` throughout was refused past 16,384 records. The enum module's `_missing_` is now
    given a lookup of the members made first (`collisions._memoise_missing`), as calling
    the class does: a value made already, in this call or before, is one lookup and costs
    nothing of the bound; a Flag with a `_missing_` of its own is counted as before."""
    from broker.collisions import _FLAG_MISSING

    method = Method("wide", wide_handler)
    three = 3  # (W0|W1: 2 bits, a cost of 1)
    repeated = b"[" + b",".join([b"%d" % three] * 100_000) + b"]"
    (args, _), counts = _calls(lambda: method.bind(repeated, 64), {_FLAG_MISSING})  # type: ignore[misc]
    assert len(args) == 100_000 and args[0] == three and args[0] is args[-1]
    assert counts[_FLAG_MISSING] <= 1, counts  # (made once, if no call made it before)
    args, _ = method.bind(b"[" + b",".join([b"8"] * 30_000) + b"]", 64)  # (W3, a named member)
    assert len(args) == 30_000
    # Members made anew cost their bits: 57 bits of 60, a cost of 8 each.
    wider = Method("wider", wider_handler)
    full = 2**60 - 1
    distinct = [full ^ (1 << i | 1 << j | 1 << k) for i in range(60) for j in range(i) for k in range(j)]
    refused = f"values of Wider that are none of its named members cost more than {UNNAMED_COST_MAX} calls"
    with pytest.raises(InvalidParams, match=refused):
        wider.bind(msgspec.json.encode(distinct[:UNNAMED_COST_MAX // 8 + 1]), 64)
    args, _ = wider.bind(msgspec.json.encode(distinct[-(UNNAMED_COST_MAX // 8):]), 64)
    assert len(args) == UNNAMED_COST_MAX // 8 and args[0] == distinct[-(UNNAMED_COST_MAX // 8)]
    # A `_missing_` of the app's own: each value costs, repeated or not.
    minded = Method("minded", minded_handler)
    refused = f"values of Minded that are none of its named members cost more than {UNNAMED_COST_MAX} calls"
    with pytest.raises(InvalidParams, match=refused):
        minded.bind(b"[" + b",".join([b"3"] * (UNNAMED_COST_MAX + 1)) + b"]", 64)
    args, _ = minded.bind(b"[" + b",".join([b"3"] * UNNAMED_COST_MAX) + b"]", 64)
    assert len(args) == UNNAMED_COST_MAX and args[0] == 3


GC_SEEN: list[bool] = []


class Noted(msgspec.Struct):
    tags: set[int] = set()

    def __post_init__(self) -> None:
        GC_SEEN.append(gc.isenabled())


def noted(items: list[Noted]) -> int:
    return len(items)


def test_large_params_are_bound_with_the_garbage_collector_off() -> None:
    """Round 46: 1 MiB of small Structs holding a set held a worker 2.1 to 3.7 s, msgspec's
    conversion 1 to 2.5 s of it: the cyclic collections its 349,000 objects set off (0.1 to
    0.2 s without them). Params past QUIET_BYTES are bound with the collector off, and it
    is on again after, whatever the binding raised."""
    method = Method("noted", noted)
    assert gc.isenabled()
    # (filled: 1 MiB of `{}` builds more than 64 bytes a byte of params, refused since round 140)
    big = b"[[" + b",".join([b'{"tags":[1]}'] * (QUIET_BYTES // 8)) + b"]]"
    GC_SEEN.clear()
    bound = method.bind(big, 64)[0][0]
    assert set(GC_SEEN) == {False} and gc.isenabled()
    assert len(bound) == QUIET_BYTES // 8 and bound[0].tags == {1}
    GC_SEEN.clear()
    method.bind(b"[[{}]]", 64)
    assert GC_SEEN == [True]
    with pytest.raises(InvalidParams):
        method.bind(big[:-2] + b',{"tags": "x"}]]', 64)
    assert gc.isenabled()


def test_the_walk_holds_memory_by_depth_not_width() -> None:
    """Round 46: the walk of round 45 pushed every value still to check on a stack of its
    own: 1 MiB of `[[],[],...]` for a `list[set[int]]` held 56 MiB while it ran (and took 5
    to 7 times as long as a recursive walk). It recurses now up to 64 containers down,
    keeping only deeper ones for later."""
    check = collisions.guard(list[set[int]])
    assert check is not None
    value = msgspec.json.decode(b"[" + b",".join([b"[]"] * 350_000) + b"]")
    assert peak_memory(check, value) < 2 * 2**20


def starred_sets(*s: set[int]) -> object:
    return s


def priced_starred_sets(*s: set[int], fee: decimal.Decimal = decimal.Decimal(0)) -> object:
    return s


def test_a_flood_in_an_args_value_is_located_on_every_path() -> None:
    """Round 46: beside a Decimal, a flood that is an *args value itself was refused
    without its place (`params[1]`), which the other paths give."""
    flood = b",".join(b"%d" % v for v in one_hash(20))
    for handler in (starred_sets, priced_starred_sets):
        with pytest.raises(InvalidParams) as info:
            Method(handler.__name__, handler).bind(b"[[], [" + flood + b"]]", 64)
        assert info.value.param == "s" and "- at `params[1]`: refused (hash flooding)" in info.value.reason, handler


ABOUT = msgspec.Meta(description="an Annotated union, which msgspec keeps inside the outer one")


def annotated_ids(ids: typing.Annotated[set[int] | None, ABOUT] | str = "") -> object:
    return ids


def annotated_keys(ids: typing.Annotated[dict[int, int] | None, ABOUT] | str = "") -> object:
    return ids


def annotated_wide(flags: typing.Annotated[list[Wide] | None, ABOUT] | str = "") -> object:  # type: ignore[valid-type]
    return flags


def test_a_union_inside_an_annotated_union_is_checked() -> None:
    """Round 47: msgspec does not flatten `Annotated[set[int] | None, Meta(...)] | str`; the
    check filed the inner union among the scalars and never walked an array or an object
    sent for it (1 MiB of ints of one hash held a worker 10.5 s; two at once had both
    workers killed as hung), nor the Flag values in a list there."""
    flood = one_hash(20)
    for handler, params in ((annotated_ids, [flood]), (annotated_keys, [{str(v): 1 for v in flood}])):
        reason = refused_in_process(handler, msgspec.json.encode(params), "ids")
        assert "hash flooding" in reason, handler
    assert "16777216 is not made of the bits of Wide's members - at `flags[0]`" in refused_in_process(
        annotated_wide, b"[[16777216]]", "flags")
    made = Wide._value2member_map_  # (values made by no test before: one made already costs nothing since round 118)
    four_bits = [v for v in (1 << i | 1 << j | 1 << k | 1 << m for i in range(24) for j in range(i) for k in range(j)
                             for m in range(k)) if v not in made]
    assert f"more than {MADE_MEMBERS_MAX} distinct values of Wide that it has no member for" in refused_in_process(
        annotated_wide, msgspec.json.encode([four_bits[:MADE_MEMBERS_MAX + 1]]), "flags")
    assert Method("annotated_ids", annotated_ids).bind(b"[[1, 2, 3]]", 64) == (({1, 2, 3},), {})


def refused_in_process(handler: typing.Any, params: bytes, param: str) -> str:
    with pytest.raises(InvalidParams) as info:
        Method(handler.__name__, handler).bind(params, 64)
    assert info.value.param == param, info.value.args
    return typing.cast(str, info.value.reason)


class Maybe(msgspec.Struct):
    tags: set[int] = set()


def test_a_union_walking_one_branch_keeps_no_memo() -> None:
    """Round 47: every untagged union, `Maybe | None` too, memoized each Struct value it
    walked (a union can walk several branches of one JSON kind): 1 MiB of `{}` for a
    `list[Maybe | None]` held 60 MiB while checked, and took 2.3 times a `list[Maybe]`'s
    walk. The memo is kept only where more than one branch walks a value."""
    check = collisions.guard(list[Maybe | None])
    assert check is not None
    value = msgspec.json.decode(b"[" + b",".join([b"{}"] * 350_000) + b"]")
    assert peak_memory(check, value) < 2 * 2**20


def peak_memory(check: collisions.Check, value: object) -> int:
    """The bytes `check(value)` held at most while it ran (tracemalloc)."""
    tracemalloc.start()
    try:
        check(value)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


class Colour3(enum.Enum):
    RED = 1
    GREEN = 2


def priced_paint(shade: Colour, price: decimal.Decimal, *more: Colour3, note: str = "", **tags: Colour3) -> object:
    return shade, price, more, note, tags


def test_plain_enum_and_flag_members_bind_beside_a_decimal() -> None:
    """Round 48: beside a Decimal each value is built by its own decoder, then the binding
    converted them all again, and msgspec takes no plain Enum's or Flag's member for its
    own type: `paint(shade: Shade, price: Decimal)` answered "Expected `int`, got `Shade`"
    to every call (and a Flag's _missing_ ran twice a value). Built values are now placed,
    not converted again; what does not fit is refused as before."""
    method = Method("priced_paint", priced_paint)
    assert method.bind(b'[3, "1.50", 1, 2]', 64) == (
        (Colour.RED | Colour.GREEN, decimal.Decimal("1.50"), Colour3.RED, Colour3.GREEN), {})
    assert method.bind(b'{"shade": 1, "price": 2.5, "note": "n", "x": 2}', 64) == (
        (Colour.RED, decimal.Decimal("2.5")), {"note": "n", "x": Colour3.GREEN})
    for params, param, reason in (
        (b'[8, "1"]', "shade", "8 is not made of the bits of Colour's members"),
        (b'[1, "1", 5]', "more", "Invalid enum value 5"),
        (b'{"shade": 1}', "price", "missing required parameter"),
        (b'{"shade": 1, "price": 1, "x": 3}', "x", "Invalid enum value 3"),
    ):
        with pytest.raises(InvalidParams) as info:
            method.bind(params, 64)
        assert info.value.param == param and reason in info.value.reason, (params, info.value.args)


def _calls(fn: typing.Callable[[], object], wanted: set[object]) -> tuple[object, dict[object, int]]:
    """Run `fn`; count the calls it makes of the functions in `wanted` (Python functions
    by code object, C functions by identity), with the interpreter's own profiler hook."""
    counts: dict[object, int] = dict.fromkeys(wanted, 0)
    codes = {getattr(f, "__code__", None): f for f in wanted}

    def profile(frame: typing.Any, event: str, arg: object) -> None:
        if event == "call" and frame.f_code in codes:
            counts[codes[frame.f_code]] += 1
        elif event == "c_call" and arg in counts:
            counts[arg] += 1

    sys.setprofile(profile)
    try:
        try:
            result: object = fn()
        except InvalidParams as exc:
            result = exc
    finally:
        sys.setprofile(None)
    return result, counts


def test_args_values_beside_a_decimal_are_decoded_as_one_list() -> None:
    """Hostile testing, round 49 (HIGH): beside a Decimal (or a Raw), each value *args took
    was checked, written again and decoded on its own, in Python: 1 MiB of `[]` for
    `*a: set[int]` held a worker 0.7-1.9 s, and two such calls stalled every client of two
    workers for a second. *args' values are now one list (**kwargs' one object): one check
    and one decode, whatever their count; places in refusals are as before."""
    from broker.worker.params import Method as M

    def dargs(d: decimal.Decimal, *a: set[int]) -> None: ...
    def dkw(d: decimal.Decimal, **kw: set[int]) -> None: ...

    n = 5000
    method = Method("dargs", dargs)
    params = json.dumps([1.5, *([k] for k in range(n))]).encode()
    bound, counts = _calls(lambda: method.bind(params, 64), {M._decode_value})
    assert bound == ((decimal.Decimal("1.5"), *({k} for k in range(n))), {})
    assert counts[M._decode_value] == 2  # d, then every *args value at once
    kwmethod = Method("dkw", dkw)
    kwparams = json.dumps({"d": "2", **{f"k{k}": [k] for k in range(n)}}).encode()
    bound, counts = _calls(lambda: kwmethod.bind(kwparams, 64), {M._decode_value})
    assert bound == ((decimal.Decimal("2"),), {f"k{k}": {k} for k in range(n)})
    assert counts[M._decode_value] <= 2  # d (and every **kwargs value at once)
    # Refusals name the same parameter and place as one value at a time did.
    bad = json.dumps([1.5, [1], [2], "x"]).encode()
    assert _calls(lambda: method.bind(bad, 64), set())[0].__dict__ == {
        "param": "a", "reason": "Expected `array`, got `str` (params[3])"}
    bad = json.dumps([1.5, [1], [2, "y"]]).encode()
    assert _calls(lambda: method.bind(bad, 64), set())[0].__dict__ == {
        "param": "a", "reason": "Expected `int`, got `str` - at `params[2][1]`"}
    flood = json.dumps([1.5, [1], one_hash(MAX + 1)]).encode()
    error = _calls(lambda: method.bind(flood, 64), set())[0]
    assert isinstance(error, InvalidParams) and error.param == "a"
    assert "- at `params[2]`: refused (hash flooding)" in error.reason
    kwbad = json.dumps({"d": "2", **{f"k{k}": [k] for k in range(n)}, "last": [1, "z"]}).encode()
    assert _calls(lambda: kwmethod.bind(kwbad, 64), set())[0].__dict__ == {
        "param": "last", "reason": "Expected `int`, got `str` - at `last[1]`"}
    kwflood = json.dumps({"d": "2", "a": [1], "b": one_hash(MAX + 1)}).encode()
    error = _calls(lambda: kwmethod.bind(kwflood, 64), set())[0]
    assert isinstance(error, InvalidParams) and error.param == "b" and "hash flooding" in error.reason


def test_a_refused_last_args_or_kwargs_value_costs_what_binding_costs() -> None:
    """Hostile testing, round 49 (MEDIUM): an *args value that did not fit was looked for by
    converting one value after another up to it, in Python (1 MiB with the bad value last:
    0.3-1 s for a -32602). Its place is read from msgspec's refusal of them all; a
    **kwargs key, which msgspec's refusal does not name, is found by halving: about
    2 log2(n) conversions, not n."""

    def rest(*a: int) -> None: ...
    def named(**kw: int) -> None: ...

    n = 4096
    args_method = Method("rest", rest)
    error, counts = _calls(lambda: args_method.bind(json.dumps([*range(n), "x"]).encode(), 64), {msgspec.convert})
    assert isinstance(error, InvalidParams)
    assert (error.param, error.reason) == ("a", f"Expected `int`, got `str` (params[{n}])")
    assert counts[msgspec.convert] <= 3
    kw_method = Method("named", named)
    params = json.dumps({**{f"k{k}": k for k in range(n)}, "bad": "x"}).encode()
    error, counts = _calls(lambda: kw_method.bind(params, 64), {msgspec.convert})
    assert isinstance(error, InvalidParams)
    assert (error.param, error.reason) == ("bad", "Expected `int`, got `str`")
    assert counts[msgspec.convert] <= 2 * math.ceil(math.log2(n + 1)) + 4


class _Tagged(msgspec.Struct):
    qty: int
    tags: set[int] = set()


class _Bits(enum.IntFlag):
    R = 4
    W = 2
    X = 1


class _WithBits(msgspec.Struct):
    f: _Bits = _Bits(0)
    n: int = 0


def test_a_refused_kwargs_key_is_found_over_what_the_check_read() -> None:
    """Hostile testing, round 50 (HIGH x2, MEDIUM): beside a Decimal, when the object of
    **kwargs' values was refused, the key was found by halving over the text sent, whose
    duplicate keys inside a value the check reads as one (the last): a set of ints of one
    hash under a duplicate "tags" was built (1 MiB: 14.8 s in-process, 13.4 s over a
    broker), Flag members of unknown bits were made past every bound, and a value whose
    last duplicate was valid was blamed. The halving now runs over the values the check
    read, written again."""
    def tally(d: decimal.Decimal = decimal.Decimal(0), **k: _Tagged) -> None: ...
    def bits(d: decimal.Decimal = decimal.Decimal(0), **k: _WithBits) -> None: ...

    from broker.worker import params as module

    flood = ",".join(map(str, one_hash(4000)))
    params = ('{"a":{"qty":1,"tags":[' + flood + '],"tags":[]},"b":{"qty":"bad"}}').encode()
    decoded: list[bytes] = []  # every text the halving decodes (`_refuses`' value)

    def profile(frame: typing.Any, event: str, arg: object) -> None:
        if event == "call" and frame.f_code is module._refuses.__code__:
            decoded.append(bytes(frame.f_locals["value"]))

    sys.setprofile(profile)
    try:
        with pytest.raises(InvalidParams) as info:
            Method("tally", tally).bind(params, 64)
    finally:
        sys.setprofile(None)
    assert (info.value.param, info.value.reason) == ("b", "Expected `int`, got `str` - at `b.qty`")
    assert decoded and not any(str(one_hash(2)[1]).encode() in text for text in decoded)  # no flood decoded
    # what the halving builds is what the check read: `a` holds no set of 4000 ints (the
    # built set's size, read through the bound value of a call that binds)
    ok = ('{"a":{"qty":1,"tags":[' + flood + '],"tags":[7]}}').encode()
    assert Method("tally", tally).bind(ok, 64)[1]["a"].tags == {7}
    members = len(_Bits._value2member_map_)
    values = ",".join(f'"f":{-i}' for i in range(1, 20_000))
    error = _calls(lambda: Method("bits", bits).bind(('{"a":{' + values + ',"f":4},"b":{"n":"bad"}}').encode(), 64),
                   set())[0]
    assert isinstance(error, InvalidParams) and error.param == "b", error
    assert len(_Bits._value2member_map_) - members <= 8  # (not one member a duplicate)
    blamed = _calls(lambda: Method("tally", tally).bind(b'{"a":{"qty":"z","qty":1,"tags":[1]},"b":{"qty":"bad"}}', 64),
                    set())[0]
    assert isinstance(blamed, InvalidParams) and blamed.param == "b", blamed


def test_a_number_past_decimal_s_limits_in_args_is_placed() -> None:
    """Round 50 (MEDIUM): decoded as one list, *args' values lost the place of a number past
    decimal's limits ("Number out of range", no params[i]); found by halving now. Extra
    positional values of a method with no *args are refused as too many."""
    def a_set(d: decimal.Decimal, *a: set[int]) -> None: ...
    def a_none(d: decimal.Decimal) -> None: ...

    error = _calls(lambda: Method("a_set", a_set).bind(b"[1, [1], [2], 1e99999999999999999999, [3]]", 64), set())[0]
    assert isinstance(error, InvalidParams)
    assert (error.param, error.reason) == ("a", "Number out of range (params[3])")
    error = _calls(lambda: Method("a_none", a_none).bind(b"[1, 2, 1e400]", 64), set())[0]
    assert isinstance(error, InvalidParams)
    assert error.param is None and error.reason.startswith("too many positional params"), error.reason


_RAW_ZERO = msgspec.Raw(b"0")


def test_a_number_the_check_cannot_read_in_kwargs_is_placed() -> None:
    """Round 51 (MEDIUM): beside a Raw or a Decimal, a number the check's own decode refuses
    (1e400 beside a Raw, an integer of 5000 digits) in a **kwargs value was blamed on the
    last key, "Number out of range": it is found by halving, with msgspec's reason and place.
    (1e5000: past a double's range, and more digits than any int is read with.)"""
    def raw_sets(r: msgspec.Raw = _RAW_ZERO, **k: set[int]) -> None: ...
    def dec_sets(d: decimal.Decimal = decimal.Decimal(0), **k: set[int]) -> None: ...

    error = _calls(lambda: Method("raw_sets", raw_sets).bind(b'{"a":[1],"b":[1e5000],"c":[2],"d":[3]}', 64), set())[0]
    assert isinstance(error, InvalidParams)
    assert (error.param, error.reason) == ("b", "Number out of range - at `b[0]`")
    big = "9" * 5000
    error = _calls(lambda: Method("dec_sets", dec_sets).bind(('{"a":[1],"b":[' + big + '],"c":[2]}').encode(), 64),
                   set())[0]
    assert isinstance(error, InvalidParams)
    assert (error.param, error.reason) == ("b", "Integer value out of range - at `b[0]`")


def test_a_refused_kwargs_value_is_decoded_again_once_not_once_a_half() -> None:
    """Hostile testing, round 52 (HIGH, MEDIUM): the key of a refused **kwargs value was
    found by halving, and each half that held the refused value decoded it again: first of
    65,536 keys, it was decoded 18 times (16,384 unnamed Flag values: 5.1 s of a worker, 6.9
    s over a broker; 175,000 numbers beside a Decimal: 0.6-0.8 s). msgspec places it in one
    more pass, the values decoded as one array; a number past decimal's limits is found by
    its text."""
    from broker.worker import params as module

    # (**k's values hold Decimals, read by `_decimal_or_zero`; a set[int] is read by float() since
    # round 140: `Method._converted`)
    def priced(d: decimal.Decimal = decimal.Decimal(0), **k: set[decimal.Decimal]) -> None: ...

    tail = ",".join(f'"k{i}":[]' for i in range(8192))
    params = ('{"a":[' + ",".join(["7"] * 2000) + ',"bad"],' + tail + "}").encode()  # (7: no named member)
    for typed in (True, False):
        perms = enum.IntFlag("Perms", {"R": 4, "W": 2, "X": 1})  # (afresh: 7 made by no call yet)

        def grant(note=None, **roles):  # its hints set below (the class is made here)
            return roles

        grant.__annotations__ = {"note": decimal.Decimal if typed else int, "roles": list[perms]}
        method = Method("grant", grant)
        error, counts = _calls(lambda method=method: method.bind(params, 64), {perms._missing_.__func__})
        assert isinstance(error, InvalidParams)
        assert (error.param, error.reason) == ("a", "Expected `int`, got `str` - at `a[2000]`")
        assert 0 < counts[perms._missing_.__func__] <= 3 * 2000, (typed, counts)  # (was 15 x 2000)
    floats = ",".join(["1.5"] * 20000)
    params = ('{"a":[' + floats + ',1e99999999999999999999],' + tail + "}").encode()
    error, counts = _calls(lambda: Method("priced", priced).bind(params, 64), {module._decimal_or_zero})
    assert isinstance(error, InvalidParams) and (error.param, error.reason) == ("a", "Number out of range")
    assert counts[module._decimal_or_zero] <= 3 * 20001, counts  # (was 17 x 20001)


def decimal_set(x: set[decimal.Decimal]) -> int:
    return len(x)


def test_numbers_read_beside_a_decimal_are_let_go_when_the_check_refuses_them() -> None:
    """Round 53 (HIGH): beside a Decimal, each number that underflows to 0 was kept (to be
    written again as sent) in a module dict that only a read the check passed emptied: a
    set[Decimal] of 45,000 such numbers then one past decimal's limits, or a hash flood,
    answered -32602 and kept 45,000 entries a MiB for good (40 calls took two workers from
    45 to 271 MiB). It is emptied however the check ends."""
    from broker.worker import params

    method = Method("decimal_set", decimal_set)
    tiny = ",".join(["1e-99999999999999999999"] * 5000)  # (past decimal's limits: kept to be written again as sent)
    flood = ",".join(str(5 + k * (2**61 - 1)) for k in range(12))  # (12 ints of one hash)
    for bad, reason in ((tiny + ",1e99999999999999999999", "Number out of range"), (tiny + "," + flood, "hash")):
        with pytest.raises(InvalidParams, match=reason):
            method.bind(f"[[{bad}]]".encode(), 64)
        assert params._UNDERFLOWED == {}
    assert method.bind(b"[[1e-400,2]]", 64)[0] == ({decimal.Decimal("1e-400"), decimal.Decimal(2)},)


class Tree(msgspec.Struct, array_like=True):
    c: list[Tree] = []
    n: int = 0


class SetTree(msgspec.Struct):
    c: list[SetTree] = []
    tags: set[int] = set()


def tree(v: list[Tree], n: int = 0) -> int:
    return len(v)


def test_a_recursive_struct_holding_nothing_hashed_binds_by_the_fast_path() -> None:
    """Hostile testing, round 140, F7: a Struct holding itself got a check for hash flooding
    though it held no set and no dict, its walk all placeholders: its params took the general
    path (1 MiB of nested empty instances 0.57 s, 0.19 s by msgspec's own decoder)."""
    from broker.worker import params as module

    assert collisions.guard(list[Tree]) is None and collisions.guard(list[SetTree]) is not None
    method = Method("tree", tree)
    chain = b"[[" * 30 + b"]]" * 30
    params = b"[[" + b",".join([chain] * 100) + b",[[], 5]]]"
    error, counts = _calls(lambda: method.bind(params, 64), {module._convert})
    assert typing.cast(tuple[tuple[list[Tree], int], dict[str, object]], error)[0][0][-1] == Tree([], 5)
    assert counts[module._convert] == 0  # (decoded by msgspec with its type: nothing converted)
    sets = Method("sets", _sets)
    flood = b",".join(b"%d" % (1 + i * (2**61 - 1)) for i in range(9))
    with pytest.raises(InvalidParams, match="more than 8 distinct values of one hash"):
        sets.bind(b'[[{"c": [{"tags": [' + flood + b"]}]}]]", 64)


def _sets(v: list[SetTree]) -> int:
    return len(v)


def test_a_refusal_of_a_number_with_a_fraction_in_params_with_no_integral_float_is_not_rewritten() -> None:
    """Round 140, F7: `n: int` given `1.5` beside 1 MiB of nested Structs: the params were walked
    in Python by the integral rewrite (1.7 s), though no float in them is integral, to be
    refused the same. Refused at once now, in the same words; `5.0` is still made an int."""
    from broker.worker import integral

    method = Method("tree", tree)
    chain = b"[[" * 30 + b"]]" * 30
    values = b"[[" + b",".join([chain] * 100)
    for params, param, reason in (
            (values + b"], 1.5]", "n", "Expected `int`, got a number with a fractional part"),
            (values + b", [[], 2.5]]]", "v", "Expected `int`, got a number with a fractional part - at `v[100][1]`")):
        error, counts = _calls(lambda params=params: method.bind(params, 64), {integral.integral_params})
        assert isinstance(error, InvalidParams) and (error.param, error.reason) == (param, reason)
        assert counts[integral.integral_params] == 0
    error, counts = _calls(lambda: method.bind(values + b"], 5.0]", 64), {integral.integral_params})
    assert counts[integral.integral_params] == 1 and typing.cast(tuple[tuple[object, int], object], error)[0][1] == 5


def test_the_integral_rewrite_walks_only_what_holds_a_float() -> None:
    """Round 140, F7: a `1e0` where an int is wanted, after 1 MiB of nested empty Structs: the
    rewrite walked each of their 520,000 arrays in Python (1.8-2.3 s); the arrays that hold no
    float are passed over (found so in C), the `1e0` made an int as before."""
    from broker.worker import integral

    chain = b"[[" * 30 + b"]]" * 30
    params = b"[[" + b",".join([chain] * 100) + b", [[[[], 7]], 1e0], [[], 2.0]]]"
    bound, counts = _calls(lambda: Method("tree", tree).bind(params, 64), {integral._Walk._array})
    v = typing.cast(tuple[tuple[list[Tree], int], object], bound)[0][0]
    assert v[-2:] == [Tree([Tree([], 7)], 1), Tree([], 2)] and type(v[-2].n) is int
    assert counts[integral._Walk._array] <= 10, counts  # (was 100 chains x 60 arrays)


class Filter(msgspec.Struct):
    include: set[str] = set()
    exclude: set[str] = set()
    tags: list[str] = []
    meta: dict[str, str] = {}


class Pair(msgspec.Struct, array_like=True):
    left: list[int] = []
    right: list[int] = []
    more: set[int] = set()


def search(filters: list[Filter], pairs: list[Pair] = []) -> int:  # noqa: B006
    return len(filters) + len(pairs)


def test_params_whose_objects_would_build_past_64_bytes_a_byte_are_refused_before_any_is_built() -> None:
    """Hostile testing, round 140, F9: msgspec makes each empty container default anew for each
    instance, so 1 MiB of `{}` to `list[Filter]` (two sets, a list and a dict) built ~220 MB
    (4 such calls in flight, as max_worker_params_bytes lets in: 918 MiB), 20 set fields 1.6
    GB. Counted by their brackets before any is built, and refused past BUILT_PER_BYTE."""
    from broker.worker.signature import BUILT_PER_BYTE

    method = Method("search", search)
    empties = b"[[" + b",".join([b"{}"] * 350_000) + b"]]"
    before = tracemalloc.is_tracing()
    tracemalloc.start()
    try:
        with pytest.raises(InvalidParams) as refused:
            method.bind(empties, 64)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        if not before:
            tracemalloc.stop()
    assert refused.value.param is None and refused.value.reason.startswith("350002 objects in 1050003 bytes of params, each building up to 640 bytes")
    assert refused.value.reason.endswith(f"more than {BUILT_PER_BYTE} bytes built a byte of params, refused (memory)")
    assert peak < 8 << 20, peak  # (nothing built: the params' own copies at most)
    pairs = b"[[], [" + b",".join([b"[]"] * 350_000) + b"]]"  # (array-like: counted by `[`)
    with pytest.raises(InvalidParams, match="refused \\(memory\\)"):
        method.bind(pairs, 64)
    # filled objects bind, as do small params of empty ones
    filled = [{"include": ["a", "b"], "tags": ["t"], "meta": {"k": "v"}}] * 10_000
    assert method.bind(json.dumps([filled]).encode(), 64)[0][0] == [Filter({"a", "b"}, set(), ["t"], {"k": "v"})] * 10_000
    assert len(typing.cast(list[Filter], method.bind(b"[[" + b",".join([b"{}"] * 20_000) + b"]]", 64)[0][0])) == 20_000


class Hundred(msgspec.Struct):
    values: list[int] = msgspec.field(default_factory=lambda: [0] * 100)


def hundreds(items: list[Hundred]) -> int:
    return len(items)


def note(doc: str, opts: Filter | None = None) -> int:
    return len(doc)


def test_the_objects_built_count_a_filling_factory_and_no_bracket_in_a_string() -> None:
    """New user, round 118: a `default_factory` that fills its list (`[0] * 100`) was counted as
    64 bytes, and 1 MB of `{}` built 270 bytes a byte of params, bound (F3); a string of 100 KB
    of braces beside an optional Struct of empty-container defaults was refused "(memory)",
    though nothing was built (F4)."""
    with pytest.raises(InvalidParams, match="each building up to 920 bytes"):
        Method("hundreds", hundreds).bind(b"[[" + b",".join([b"{}"] * 300_000) + b"]]", 64)
    text = "{" * 100_000
    assert Method("note", note).bind(json.dumps([text]).encode(), 64) == ((text, None), {})
    with pytest.raises(InvalidParams, match="refused \\(memory\\)"):  # (braces outside strings: objects)
        Method("search", search).bind(b"[[" + b",".join([b"{}"] * 40_000) + b"]]", 64)
