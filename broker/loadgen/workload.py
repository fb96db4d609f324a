"""What the load generator sends: request bodies with ids patched in, and what it expects back.

Sans-IO. A `Workload` is built once from the CLI's `--method/--params` or `--mix FILE`,
`--batch` and `--ids`; `Workload.body(k)` then returns request body number `k` of a
connection together with its `Expect` record, in about a microsecond per call:

* each call's element is prebuilt as constant bytes up to its `"id":` member
  (`{"jsonrpc":"2.0","method":"add","params":[1,2],"id":`), so a body is one
  ``b"".join`` of prefixes, id bytes and ``}`` (a notification's element is whole);
* the calls of a mix are drawn by weight once, into a fixed cycle (`PLAN_LENGTH`
  entries, seeded), so the hot path makes no random draws;
* ids are bytes built from the request number: each id is unique on its connection
  except in ``repeated`` mode, where all calls of one batch share one id.

Id modes (``--ids``):

    int       1, 2, 3 ...
    string    "r1", "r2" ...
    large     ints past 2**64 (18446744073709551617+n, -36893488147419103232-n) and
              floats written with exponents (n.5e3, n.25E-2): a server must echo
              them byte for byte
    repeated  the request number, the same for every call of a batch; answers are
              then matched as a multiset (count per id), not one by one

In every mode an id names exactly one body of its connection (in ``repeated`` mode
all calls of that body share it), so an out-of-order stream can match each answer
line to its body by id; `Workload.body_of_id` inverts the numbering (slow path: to
tell a duplicate answer from an answer with an id that was never sent).
"""

from __future__ import annotations

import json
import math
import random
import re
import tomllib
import typing
from pathlib import Path

import msgspec
from msgspec import Raw

from broker.files import FileRefused, read_bounded

__all__ = [
    "ID_MODES",
    "PLAN_LENGTH",
    "Call",
    "Expect",
    "IdMode",
    "MixError",
    "Workload",
    "load_mix",
]

IdMode = typing.Literal["int", "string", "large", "repeated"]
ID_MODES: tuple[IdMode, ...] = typing.get_args(IdMode)
MAX_MIX_BYTES = 64 * 1024 * 1024  # bytes of a --mix file, at most
PLAN_LENGTH = 1024  # cycle of drawn calls for a weighted mix (one entry when there is one call)


class MixError(ValueError):
    """A workload that cannot be built: bad mix file, bad params JSON, no answerable call."""


class Call(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One kind of call in the workload (one entry of a ``--mix`` file).

    method: the JSON-RPC method name.
    params: JSON text of the params (an array or object), or None to omit them.
    weight: relative frequency (> 0) among the mix's calls.
    notification: send it without an id; it is then never answered.
    """

    method: str
    params: str | None = None
    weight: float = 1.0
    notification: bool = False


class _MixEntry(msgspec.Struct, forbid_unknown_fields=True):
    method: str
    params: list[object] | dict[str, object] | None = None
    weight: typing.Annotated[float, msgspec.Meta(gt=0)] = 1.0
    notification: bool = False


_JSON_KINDS: dict[type, str] = {list: "an array", dict: "an object", str: "a string", bool: "a boolean",
                                int: "a number", float: "a number", type(None): "null"}


def _kind(value: object) -> str:
    """What a decoded JSON/TOML value is, in JSON's words (for messages)."""
    return _JSON_KINDS.get(type(value), type(value).__name__)


_AT = re.compile(r"(.*) - at `\$(.*)`", re.S)


def _non_finite(value: object, at: str = "") -> tuple[str, float] | None:
    """(where, number) of the first NaN or infinity in a decoded JSON/TOML value, or
    None. JSON has no such numbers (Python's json reads ``NaN`` and TOML has ``nan``
    and ``inf``; encoding them would send null)."""
    if isinstance(value, float):
        return None if math.isfinite(value) else (at, value)
    if isinstance(value, list):
        for i, item in enumerate(value):
            found = _non_finite(item, f"{at}[{i}]")
            if found:
                return found
    elif isinstance(value, dict):
        for key, item in value.items():
            found = _non_finite(item, f"{at}.{key}")
            if found:
                return found
    return None


def _entry_error(path: Path, where: str, exc: msgspec.ValidationError) -> MixError:
    """`exc` (one entry's validation error) as a message naming the file, the entry
    and, where msgspec gives one, the key: ``mix file m.json: entry 2 ($[1]), key
    "weight": Expected `float` > 0.0``."""
    text = str(exc)
    m = _AT.fullmatch(text)
    if m:
        text = m[1]
        where += f", key {m[2].lstrip('.')!r}"
    return MixError(f"mix file {path}: {where}: {text}")


def load_mix(path: str | Path) -> list[Call]:
    """Read a mix file: TOML (``[[call]]`` tables) or JSON (a list of entries, or
    ``{"calls": [...]}``); each entry ``{method, params?, weight?, notification?}``.

    Raises `MixError` on any problem, naming the file and, for a bad entry, which
    one and which key: unreadable file, not TOML/JSON, wrong shape, unknown or
    missing key, bad type, weight not finite and > 0, a NaN or infinity in params,
    empty mix.
    """
    path = Path(path)
    toml = path.suffix.lower() == ".toml"
    try:
        text = read_bounded(path, MAX_MIX_BYTES, pipes=True)
    except FileRefused as exc:  # (hostile testing, round 131: /dev/zero read 8 GB in 9 s)
        raise MixError(f"mix file {path}: {exc}") from None
    except OSError as exc:
        raise MixError(f"mix file {path}: cannot read it: {exc.strerror or exc}") from None
    data: object
    try:
        data = tomllib.loads(text.decode()) if toml else json.loads(text)
    except UnicodeDecodeError as exc:
        raise MixError(f"mix file {path}: not UTF-8 text: {exc}") from None
    except RecursionError:
        raise MixError(f"mix file {path}: nested too deeply to read") from None
    except ValueError as exc:  # tomllib.TOMLDecodeError, json.JSONDecodeError
        hint = "" if toml or path.suffix.lower() == ".json" else " (only a .toml file is read as TOML)"
        raise MixError(f"mix file {path}: not valid {'TOML' if toml else 'JSON'}{hint}: {exc}") from None
    shape = ("expected [[call]] tables" if toml
             else 'expected a list of calls, or an object {"calls": [...]}')
    tables: list[tuple[str, list[object]]]  # (name of the list, for messages; its entries)
    if isinstance(data, list):
        tables = [("", data)]
    elif isinstance(data, dict):
        tables = []
        for key, value in data.items():
            if key not in ("call", "calls"):
                raise MixError(f"mix file {path}: unknown top-level key {key!r}; {shape}")
            if not isinstance(value, list):
                fix = f": write [[{key}]], not [{key}]" if toml and isinstance(value, dict) else ""
                raise MixError(f"mix file {path}: {key!r} must be an array of call tables, "
                               f"got {_kind(value)}{fix}")
            tables.append((key, value))
    else:
        raise MixError(f"mix file {path}: {shape}; got {_kind(data)}")
    calls: list[Call] = []
    for key, entries in tables:
        for i, raw in enumerate(entries):
            if toml:
                where = f"[[{key}]] table {i + 1}"
            else:
                where = f"entry {i + 1} ($[{i}])" if not key else f"entry {i + 1} ($.{key}[{i}])"
            try:
                e = msgspec.convert(raw, _MixEntry)
            except msgspec.ValidationError as exc:
                raise _entry_error(path, where, exc) from None
            if not math.isfinite(e.weight):
                raise MixError(f"mix file {path}: {where}, key 'weight': must be finite, got {e.weight}")
            bad = _non_finite(e.params)
            if bad:
                raise MixError(f"mix file {path}: {where}, key 'params{bad[0]}': {bad[1]} is not a JSON "
                               "number (JSON has no NaN or Infinity)")
            params = None if e.params is None else msgspec.json.encode(e.params).decode()
            calls.append(Call(e.method, params, e.weight, e.notification))
    if not calls:
        raise MixError(f"mix file {path}: no calls ({shape})")
    if not math.isfinite(sum(c.weight for c in calls)):
        raise MixError(f"mix file {path}: the weights add up to more than a float holds; make them smaller")
    return calls


class Expect(typing.NamedTuple):
    """What answer one request body must get.

    batch: the body was a JSON array (the answer must be an array, or nothing).
    ids: the raw id of every call that must be answered, in body order
        (notifications left out); may hold repeats in ``repeated`` id mode.
    calls: number of calls in the body, notifications included.
    """

    batch: bool
    ids: tuple[bytes, ...]
    calls: int


_NOTIF_HEAD = b'{"jsonrpc":"2.0","method":'
_PARAMS = b',"params":'
_ID = b',"id":'
_END = b"}"
_TWO64 = 2**64 + 1  # strictly past 2**64
_TWO65 = 2**65


def _id_int(n: int) -> bytes:
    return b"%d" % n


def _id_string(n: int) -> bytes:
    return b'"r%d"' % n


def _id_large(n: int) -> bytes:
    form = n & 3
    if form == 0:
        return b"%d" % (_TWO64 + n)
    if form == 1:
        return b"%d" % (-_TWO65 - n)
    if form == 2:
        return b"%d.5e3" % n
    return b"%d.25E-2" % n


_INT = re.compile(rb"-?[0-9]+")
_STRING = re.compile(rb'"r([0-9]+)"')
_LARGE_FLOAT = re.compile(rb"([0-9]+)\.(?:5e3|25E-2)")


def _id_numbers(mode: IdMode, id_: bytes) -> list[int]:
    """Candidate id numbers ``n`` with ``make_id(n) == id_`` (checked by the caller)."""
    if mode == "string":
        m = _STRING.fullmatch(id_)
        return [int(m[1])] if m else []
    if mode != "large":
        return [int(id_)] if _INT.fullmatch(id_) else []
    m = _LARGE_FLOAT.fullmatch(id_)
    if m:
        return [int(m[1])]
    if _INT.fullmatch(id_):
        v = int(id_)
        return [v - _TWO64, -_TWO65 - v]
    return []


class Workload:
    """Builds request bodies for one connection-independent workload.

    calls: the kinds of call (at least one must not be a notification unless
        ``batch`` bodies of only notifications are really wanted: allowed).
    batch: calls per body; 1 sends a plain object, >= 2 a JSON array.
    ids: the id mode (see the module docstring).
    seed: seeds the weighted draw of the plan.

    Raises `MixError` for params that are not a JSON array or object.
    """

    __slots__ = ("_fast", "_id", "_plan", "_plen", "batch", "ids")

    def __init__(self, calls: typing.Sequence[Call], batch: int = 1, ids: IdMode = "int",
                 seed: int = 0) -> None:
        if batch < 1:
            raise MixError("batch must be >= 1")
        if not calls:
            raise MixError("no calls")
        self.batch = batch
        self.ids = ids
        pieces: list[tuple[bytes, bool]] = []  # (element prefix or whole element, is_notification)
        for c in calls:
            head = _NOTIF_HEAD + msgspec.json.encode(c.method)
            if c.params is not None:
                try:
                    raw = msgspec.json.decode(c.params.encode(), type=list[object] | dict[str, object])
                except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                    raise MixError(f"params of {c.method!r} must be a JSON array or object: {exc}") from None
                head += _PARAMS + msgspec.json.encode(raw)
            pieces.append((head + _END, True) if c.notification else (head + _ID, False))
        if len(pieces) == 1:
            plan = pieces
        else:
            rng = random.Random(seed)
            plan = rng.choices(pieces, weights=[c.weight for c in calls], k=PLAN_LENGTH)
        self._plan = plan
        self._plen = len(plan)
        self._id = {"int": _id_int, "string": _id_string, "large": _id_large, "repeated": _id_int}[ids]
        # The common case, one call per body and one kind of call: one join, no loop.
        self._fast = plan[0][0] if batch == 1 and len(plan) == 1 and not plan[0][1] else None

    def body(self, k: int) -> tuple[bytes, Expect | Raw]:
        """Request body number ``k`` (>= 0) of a connection, and what it must get back:
        an `Expect`, or, for one plain call (the common case), just its id as a
        `msgspec.Raw`: no NamedTuple to build (~0.4 µs), and Raw == Raw compares in
        30 ns where bytes(raw) == bytes takes 130."""
        fast = self._fast
        if fast is not None:
            id_ = self._id(k)
            return b"".join((fast, id_, _END)), Raw(id_)
        batch = self.batch
        plan = self._plan
        plen = self._plen
        make_id = self._id
        repeated = self.ids == "repeated"
        parts: list[bytes] = []
        ids: list[bytes] = []
        base = k * batch
        for j in range(batch):
            head, notification = plan[(base + j) % plen]
            if j:
                parts.append(b",")
            if notification:
                parts.append(head)
                continue
            id_ = make_id(k if repeated else base + j)
            ids.append(id_)
            parts.append(head)
            parts.append(id_)
            parts.append(_END)
        if batch == 1:
            return b"".join(parts), Expect(False, tuple(ids), 1)
        return b"".join((b"[", *parts, b"]")), Expect(True, tuple(ids), batch)

    def body_of_id(self, id_: bytes) -> int | None:
        """The number ``k`` of the body whose calls carry the raw id ``id_`` (as
        `body` makes them), or None when no body of any connection carries it.
        Slow (it rebuilds the body to be sure): for odd answers only."""
        make_id = self._id
        for n in _id_numbers(self.ids, id_):
            if n < 0 or make_id(n) != id_:
                continue
            k = n if self.ids == "repeated" or self.batch == 1 else n // self.batch
            expect = self.body(k)[1]
            if id_ in ((bytes(expect),) if isinstance(expect, Raw) else expect.ids):
                return k
        return None
