"""Params binding: the raw JSON params of a call bound to a handler's parameters.

`Method` holds one handler and what its signature needs: a msgspec type per parameter (a
Struct for named params, a tuple type for positional ones), built once at registration
(broker/worker/signature.py, `Signature`, which it inherits). `Method.bind(params,
max_depth)` decodes and validates in one msgspec pass on the fast path (typed params, no
nesting past max_depth), and only when that pass fails takes the slow paths that say
which parameter is wrong and where in it (`InvalidParams`, from msgspec's messages),
check numbers that no float holds exactly (both in broker/worker/param_errors.py), and
refuse values built to flood a set or a dict with colliding hashes
(broker/collisions.py). Params nested past max_depth raise `NestingTooDeep`; a
`raw_params` handler gets the checked JSON itself (`_check_raw`). The enum.Flag members
that binding makes and caches for good are dropped once nothing holds them
(`_drop_flag_members`, `FLAG_PSEUDO_MEMBERS_MAX`).

Nothing here does I/O: the worker's run loop (broker/worker/runtime.py) calls `bind`.
"""

from __future__ import annotations

import gc
import inspect
import re
import sys
import typing
from collections.abc import Callable

import msgspec

from broker import collisions
from broker.errors import RemoteError
from broker.floats import (
    _BEYOND_READ,
    BEYOND,
    first_beyond,
    plain_numbers,
    read_json,
    read_json_beyond,
)
from broker.jsonscan import nests_deeper
from broker.worker.integral import holds_int, integral_params
from broker.worker.param_errors import (
    _DECIMAL_JSON,
    _NOT_DECIMAL,
    _OUT_OF_RANGE,
    _UNDERFLOWED,
    _array_of,
    _first_past_decimal,
    _float_form,
    _inside,
    _located,
    _number_out_of_range,
    _object_of,
    _refuses,
    _split_path,
    _tail_message,
    _values_decoded,
)
from broker.worker.param_errors import _decimal_or_zero as _decimal_or_zero  # (tests read it from params)
from broker.worker.signature import Signature, Typed, too_many_objects

if typing.TYPE_CHECKING:
    from broker.worker.tools import Described


class InvalidParams(RemoteError):
    """params did not fit the signature: which parameter (or None) and why."""

    hint = "answered -32602, its data {param, reason}"

    def __init__(self, param: str | None, reason: str) -> None:
        super().__init__(param, reason)
        self.param = param
        self.reason = reason


QUIET_BYTES = 64 * 1024
"""Params longer than this are bound with the cyclic garbage collector off (`Method.bind`)."""
_FIELD_IN_MSG = re.compile(r"field `([^`]+)`")
_decode_plain = msgspec.json.decode  # (params whose numbers it reads fast: `plain_numbers`)
_decode_json = read_json  # (the others: floats read by float(), broker/floats.py)
_astuple = msgspec.structs.astuple
_convert = msgspec.convert
_UNREAD = object()  # (`bind`: params not decoded yet)


class Method(Signature):
    """One registered handler and how to bind JSON params to it.

    Built by `Registry.method`; `bind(params)` turns the raw JSON params of a call
    into `(args, kwargs)` or raises `InvalidParams`. The types it binds to are read from
    the handler's signature at registration (`signature.Signature`, which it inherits).
    """

    __slots__ = ("annotations", "check_result", "described", "doc", "fn", "is_async", "name", "title", "tool")

    def __init__(self, name: str, fn: Callable[..., object], raw_params: bool = False) -> None:
        self.name = name
        self.fn = fn
        self.is_async = _is_async(fn)
        self.doc = inspect.getdoc(fn) or ""
        # What `Registry.method` sets of a tool (broker/worker/tools.py): its flag, title, MCP
        # annotations (a JSON object) and its schemas, described at registration
        self.tool = False
        self.title: str | None = None
        self.annotations: dict[str, object] | None = None
        self.described: Described | None = None
        # A tool's with an outputSchema: its result's JSON decoded as its return type, which
        # raises msgspec.ValidationError where the result breaks the schema (`sdk.Registry.method`)
        self.check_result: Callable[[bytes], object] | None = None
        super().__init__(name, fn, raw_params)  # (its types: broker/worker/signature.py)

    def bind(self, params: bytes, max_depth: int, _quiet: bool = False,
             _rewritten: bool = False) -> tuple[tuple[object, ...], dict[str, object]]:
        """Raw JSON params (b"" when absent) → `(args, kwargs)` for the handler.

        Raises `InvalidParams` when they do not fit the signature, and
        `NestingTooDeep` past `max_depth` levels of arrays and objects.

        Params longer than QUIET_BYTES are bound with the cyclic garbage collector off:
        what binding makes holds no cycle, and the collections its hundreds of thousands of
        objects set off took most of the time (hostile testing, round 46: 1 MiB of small
        Structs holding a set held a worker 2.1 to 3.7 s, msgspec's conversion 1 to 2.5 s
        of it, 0.1 to 0.2 s without them).

        A number written as a float that is an integer (`5.0`, `1e2`: JSON Schema's
        "integer", draft 2020-12, Validation 6.1.1) binds to an `int` where the types want
        one; the params are written again so, once, after they were refused
        (`_bind_integral`, broker/worker/integral.py): params that fit cost nothing more,
        and neither do those refused for a parameter whose type holds no int (hostile
        testing, round 136, F2: `tag: str` given a float was refused, then its params
        decoded twice more, all to be refused the same).

        Params holding a number written with an exponent, which msgspec may read slowly
        (`1e308`, `1.2345000000000000576e249`: 2-20 µs each, broker/floats.py), are
        decoded with their floats read by float() (at most ~0.1 s a MiB), then converted to the
        fast path's types, or bound by the general path (hostile testing, rounds 136 and 137:
        1 MiB of them held a worker 0.25-5 s, or was refused for their count). A float past a
        double's range is read as `BEYOND` there, so that its refusal is placed from that one
        decoding (`_beyond`; round 137, F5: refused after ~6 decodings).
        """
        size = len(params)
        if self._objects is not None and size > QUIET_BYTES and not _quiet and (why := too_many_objects(params, self._objects)):
            raise InvalidParams(None, why)
        if size > QUIET_BYTES and not _quiet and gc.isenabled():
            gc.disable()
            try:
                return self.bind(params, max_depth, True)
            finally:
                gc.enable()
        try:  # (no cost until raised: the error path alone makes integral floats integers)
            if not params:
                if self.raw_params:
                    return (None,), {}
                params = b"[]"
                size = 2
            fast = self._fast
            # Whether they nest past max_depth (exact for JSON; params that are not go on to
            # the checks below, which say so first). Params shorter than max_depth cannot
            # hold more brackets, nor can those with fewer (counted inline: the usual case,
            # no call); `nests_deeper` looks further (brackets in strings do not count:
            # they took every such call off the fast path and through a whole `scan_json`,
            # hostile testing).
            deep = (
                size > max_depth
                and params.count(b"[") + params.count(b"{") > max_depth
                and nests_deeper(params, max_depth)
            )
            placed = None  # the fast path's refusal of a number out of range, if it said where
            plain = None  # (whether msgspec reads their numbers fast: `plain_numbers`, once asked)
            obj: object = _UNREAD  # (read by float() for the fast path's types: not read again)
            if fast is not None and not deep:
                if plain := (0x65 not in params and 0x45 not in params) or plain_numbers(params):  # (inline: no 'e', 'E')
                    try:
                        first = params[0]
                        if first == 0x5B:  # "["
                            return _astuple(fast[0].decode(params)), {}
                        if first == 0x7B and fast[1] is not None:  # "{"
                            return _astuple(fast[1].decode(params)), {}
                    except msgspec.ValidationError as exc:
                        placed = str(exc)
                    except (msgspec.DecodeError, RecursionError):
                        pass
                elif self._typed is None:  # (the same types, converted to: ~5,000 CPU instructions more)
                    try:
                        obj = self._read_floats(params)
                        if type(obj) is list:
                            return _astuple(_convert(obj, self._pos_type, str_keys=True)), {}
                        if type(obj) is dict and fast[1] is not None:
                            return _astuple(_convert(obj, self._named_type, str_keys=True)), {}
                    except msgspec.ValidationError:  # (said below, by the general path's conversion)
                        pass
                    except (msgspec.DecodeError, RecursionError):  # (said below, read again)
                        obj = _UNREAD
            if self.raw_params:
                _check_raw(params, max_depth, deep)
                return (msgspec.Raw(params),), {}
            if self._flags is not None:  # (its checks count the Flag members the params make: never on the fast path)
                collisions.new_call()
            if deep and self._typed is not None:  # (round 45: decoded, checked and built value by value first,
                raise NestingTooDeep(max_depth)  # each __post_init__ run: 1 MiB took 1.3-1.6 s to be refused)
            try:
                if obj is not _UNREAD:
                    pass
                elif self._typed is not None:
                    obj = self._decode_typed(params, self._typed)
                elif plain if plain is not None else plain_numbers(params):
                    obj = _decode_plain(params)
                else:
                    obj = self._read_floats(params)
            except RecursionError:  # deeper than the parser takes, whatever max_depth says
                raise NestingTooDeep(max_depth) from None
            except (msgspec.ValidationError, InvalidParams) as exc:  # valid JSON, with a number msgspec cannot hold
                if deep:  # (its nesting said first, as for params that hold none: hostile testing, round 141, F11)
                    raise NestingTooDeep(max_depth) from None
                if isinstance(exc, InvalidParams):  # (`_read_floats`' refusal, placed)
                    raise
                obj = _values_decoded(params, _decode_json)  # (unless a later duplicate key replaced it)
                if obj is None:
                    raise self._out_of_range(params, str(exc), placed) from None
            except msgspec.DecodeError as exc:
                raise InvalidParams(None, f"params are not valid JSON: {exc}") from None
            if deep:
                raise NestingTooDeep(max_depth)
            if self._guards is not None and self._typed is None:  # (typed: each value was checked)
                try:
                    self._check_floods(obj, self._guards)
                except RecursionError:  # (msgspec converting a set's elements deeper than the parser takes)
                    raise NestingTooDeep(max_depth) from None
            if type(obj) is list:
                return self._bind_positional(obj), {}
            if type(obj) is not dict:  # section 4.2: params is an array or an object
                raise InvalidParams(None, "params must be an array or an object")
            return self._bind_named(obj)
        except InvalidParams as exc:
            if self._integers is None or _rewritten or not _about_a_number(exc.reason) or not self._may_want_int(exc.param):
                raise
            if plain_numbers(params) and not _ZERO_FRACTION.search(params):
                # (no float in them is integral, `5.0`: none to make an int, so the refused one has a
                # fractional part; hostile testing, round 140, F7: the params walked in Python to be
                # refused the same, 1 MiB of nested Structs and a `1.5` 2.1 s)
                if exc.reason.startswith("Expected `int") and _GOT_FLOAT in exc.reason:
                    raise InvalidParams(exc.param, exc.reason.replace(_GOT_FLOAT, _GOT_FRACTION, 1)) from None
                raise
            return self._bind_integral(params, max_depth, exc)

    def _bind_integral(self, params: bytes, max_depth: int,
                       refusal: InvalidParams) -> tuple[tuple[object, ...], dict[str, object]]:
        """Bind `params`, which `bind` refused (`refusal`, about a float or a number out of
        range), once more with their integral floats made integers where the types want an
        int (`integral.integral_params`). Raises that binding's refusal, or `refusal` if no
        number changed; either said of a number with a fractional part (5.5) where one was
        met, not of a `float` (which 5.0 now is not refused as). Cold path."""
        integers = typing.cast(tuple[typing.Any, typing.Any], self._integers)
        rewrite = integral_params(params or b"[]", *integers)
        try:
            if rewrite.text is None:
                raise refusal
            return self.bind(rewrite.text, max_depth, True, True)
        except InvalidParams as exc:
            reason = exc.reason
            if not (rewrite.fractional and reason.startswith("Expected `int") and _GOT_FLOAT in reason):
                raise
            raise InvalidParams(exc.param, reason.replace(_GOT_FLOAT, _GOT_FRACTION, 1)) from None

    def _may_want_int(self, param: str | None) -> bool:
        """Whether the parameter a refusal names (None: none) may take an int somewhere in its
        type. If not, `_bind_integral` would refuse the same: no number in it nor before it is
        written again (those before it were taken, so held no integral float where an int is
        wanted), and msgspec refuses the first value that does not fit. Cold path."""
        (types, var_pos), (by_name, var_kw) = typing.cast(tuple[typing.Any, typing.Any], self._integers)
        if param is None or param in self._pos_only:  # (beside **kwargs, also a key of its: unsure)
            return True
        if param in self._pos_names:
            return holds_int(types[self._pos_names.index(param)])
        if param in by_name:
            return holds_int(by_name[param])
        if var_pos is not None and param == self._var_pos_name():
            return holds_int(var_pos)
        return var_kw is None or holds_int(var_kw)  # (a key of **kwargs', or unknown: its refusal says so)

    def _decode_typed(self, params: bytes,
                      typed: dict[str, Typed]) -> object:
        """Decode params whose parameters' hints hold a `msgspec.Raw`: each value such a
        parameter takes is decoded from its own text with its own type, the others as
        `bind` decodes them. Raises `InvalidParams` for a value that does not fit."""
        try:
            top = _RAW_TOP(params)
        except msgspec.ValidationError:
            raise InvalidParams(None, "params must be an array or an object") from None
        n = len(self._pos_names)
        if type(top) is list:
            values = [self._decode_value(raw, typed.get(name), name, "") for name, raw in zip(self._pos_names, top)]
            if len(top) > n:
                star = typed.get("*")
                if star is None:  # (no *args: `_bind_positional` refuses them, too many)
                    values.extend([None] * (len(top) - n))
                else:  # one list, one check, one decode (`_tail_message` places an error)
                    rest = top[n:]
                    try:
                        values.extend(typing.cast(list[object], self._decode_value(_array_of(rest), star,
                                                                                  self._var_pos_name(), "", n)))
                    except InvalidParams as exc:
                        if exc.reason != _OUT_OF_RANGE:  # (placed, or not about a number)
                            raise
                        at = n + _first_past_decimal(rest)  # (round 50)
                        raise InvalidParams(exc.param, f"{_OUT_OF_RANGE} (params[{at}])") from None
            return values
        known, kw_only = self._named_type.__struct_fields__, self._pos_only  # (as in _check_floods)
        named: dict[str, object] = {}
        extra: list[tuple[str, msgspec.Raw]] = []  # **kwargs' (or unexpected: `_bind_named` refuses them)
        for key, raw in typing.cast(dict[str, msgspec.Raw], top).items():
            if key in known and key not in kw_only:
                named[key] = self._decode_value(raw, typed.get(key), key, "")
            else:
                extra.append((key, raw))
        stars = typed.get("**")
        if stars is None:
            named.update((key, _decode_json(raw)) for key, raw in extra)
        elif extra and stars[2] is not None and not plain_numbers(bytes(text := _object_of(extra))):
            # (read by float() and converted, as `_decode_value` does: round 140, F1, 1 MiB 1.6 s; a
            # refusal placed as below, its values converted as one array, `$[i]`)
            try:
                named.update(typing.cast(dict[str, object], self._converted(text, stars[2], stars[1], "", "", None)))
            except msgspec.ValidationError as exc:
                hint = typing.get_args(self._var_kw)[1]
                array = _array_of([raw for _, raw in extra])
                raise _keyed(extra, _refuses(lambda raws: self._converted(raws, list[hint], None, "", "", None), array),  # type: ignore[valid-type]
                             str(exc)) from None
        elif extra:
            decoder, check, _ = stars
            try:  # (a flood is refused naming its key)
                text = self._checked(_object_of(extra), check, "", "")
            except msgspec.ValidationError as exc:  # a number the check cannot read: which key's
                if str(exc) == _OUT_OF_RANGE:  # (a Decimal past decimal's limits)
                    raise InvalidParams(extra[_first_past_decimal([raw for _, raw in extra])][0], _OUT_OF_RANGE) from None
                # (its values as one array, read as the check reads them, plain values: no set
                # or Flag is built; msgspec places the refused one, `$[i]`: round 51)
                raise _keyed(extra, _refuses(self._guard_decode, _array_of([raw for _, raw in extra])), str(exc)) from None
            try:
                named.update(decoder.decode(text))
            except msgspec.ValidationError as exc:
                # msgspec names no key ("$[...]"): the values the check read, written again, are
                # decoded once more as one array, where it places the refused one, `$[i]` (round
                # 50: over the text sent, duplicate keys in a value, which the check reads as one,
                # built a set of 40,000 ints of one hash, 13 s; round 52: halved, the refused
                # value was decoded again in each half that held it, 18 times, 5-7 s)
                items = list(msgspec.json.decode(text, type=dict[str, msgspec.Raw]).items())
                hint = typing.get_args(self._var_kw)[1]
                decode = msgspec.json.Decoder(list[hint]).decode  # type: ignore[valid-type]
                refusal = _refuses(decode, _array_of([raw for _, raw in items]))
                raise _keyed(items, refusal, str(exc)) from None
        return named

    def _decode_value(self, raw: msgspec.Raw,
                      typed: Typed | None,
                      name: str, where: str, tail: int | None = None) -> object:
        """One value params give, decoded with its own type (checked for hash flooding first
        if the type holds a set or a dict with keys other than strings). `name`: the
        parameter's; `where`: its place, if its name does not say it; `tail`: the value is
        the list of *args' values, the first at params[tail]. Raises `InvalidParams`."""
        try:
            if typed is None:
                return _decode_json(raw)
            decoder, check, kind = typed
            if kind is not None and not plain_numbers(bytes(raw)):  # (a copy: ~1 ms a MiB)
                return self._converted(raw, kind, check, name, where, tail)
            return decoder.decode(self._checked(raw, check, name, where, tail))
        except msgspec.ValidationError as exc:
            message = str(exc)
            if message.startswith(_NOT_DECIMAL):
                message = _number_out_of_range(message, raw)
            if tail is not None:
                raise InvalidParams(name, _tail_message(message, tail) or message) from None
            raise InvalidParams(name or None, _inside(message, where or name, f"{message} ({where})" if where
                                                      else message)) from None

    def _checked(self, raw: msgspec.Raw, check: collisions.Check | None, name: str, where: str,
                 tail: int | None = None) -> msgspec.Raw:
        """`raw` checked by `check` for hash flooding (and the members a Flag would make), and
        written again from what the check read: what is decoded then is what was checked (an
        object's duplicate keys are gone, as they were for the check: round 39, the decoder
        built the set of every duplicate, the check saw the last; 1 MiB held a worker 12.8 s).
        `raw` itself when there is nothing to check. `name`, `where`, `tail`: as
        `_decode_value` takes them ("" `name`: **kwargs' values, the key the first step).
        Raises `InvalidParams` (flooded), `msgspec.ValidationError` (a Decimal past decimal's
        limits, round 38: "Number out of range", with no place)."""
        if check is None:
            return raw
        try:  # (round 53: a read refused kept what `_decimal_or_zero` put in _UNDERFLOWED, 45,000 a MiB, for good)
            try:
                read = self._guard_decode(raw)
                _check_value(read, check, name, where, tail)
            except ArithmeticError:
                raise msgspec.ValidationError(_OUT_OF_RANGE) from None
            return msgspec.Raw(_REWRITE(_float_form(read) if self._guard_decode is _DECIMAL_JSON else read))
        finally:
            _UNDERFLOWED.clear()

    def _converted(self, raw: msgspec.Raw, kind: object, check: collisions.Check | None, name: str, where: str,
                   tail: int | None) -> object:
        """`raw`, a value whose type `kind` holds neither a Decimal nor a msgspec.Raw, read as
        the general path reads params (its floats by float()), checked by `check` (None: none)
        and converted to `kind`: what `kind`'s decoder makes of it, without msgspec's float
        reader (hostile testing, round 139, F4: 1 MiB of `1e308` beside a Decimal parameter
        held a worker 1.6 s). `name`, `where`, `tail`: as `_decode_value` takes them. Raises
        msgspec.ValidationError as the decoder says it, "Number out of range - at `$...`" for a
        float past a double's range (placed by `kind` where its conversion meets it first, or
        where an `Any` took it; one in a field `kind` ignores is dropped, as the decoder skips
        it: round 140, F3), and `InvalidParams` (flooded)."""
        read = _BEYOND_READ[0]
        value = read_json_beyond(raw)
        beyond = _BEYOND_READ[0] != read  # (placed below, once converted: a later duplicate key's value may replace it)
        if beyond and self._post_init and (place := first_beyond(value)) is not None:  # (not converted: round 141, F8)
            raise msgspec.ValidationError(f"{_OUT_OF_RANGE} - at `${_inner(place)}`" if place else _OUT_OF_RANGE)
        try:
            _check_value(value, check, name, where, tail)
            converted = _convert(value, kind, str_keys=True)
        except msgspec.ValidationError as exc:
            reason, path = _split_path(str(exc)) or (str(exc), "")
            if not (beyond and reason.endswith(_GOT_BEYOND)):  # (a value before it refused first, as the decoder does)
                raise
            raise msgspec.ValidationError(f"{_OUT_OF_RANGE} - at `${path}`" if path else _OUT_OF_RANGE) from None
        if beyond and self._holds_any and (place := first_beyond(converted)) is not None:  # (an Any took it)
            raise msgspec.ValidationError(f"{_OUT_OF_RANGE} - at `${_inner(place)}`" if place else _OUT_OF_RANGE)
        return converted

    def _check_floods(self, obj: object, guards: tuple[collisions.Check | None, ...]) -> None:
        """Refuse params putting more than `collisions.SHARED_HASH_MAX` distinct values of
        one hash in a set or an object's keys (hash flooding: building them would take
        time quadratic in their count), naming the parameter and where in it."""
        pos, named, var_pos, var_kw = guards
        n = len(self._pos_names)
        if type(obj) is list:
            try:
                if pos is not None:
                    pos(obj)
            except collisions.Flooded as exc:
                raise _flooded(exc, self._pos_names[typing.cast(int, exc.where[0])], exc.where[1:]) from None
            try:
                if var_pos is not None and len(obj) > n:
                    var_pos(obj[n:])
            except collisions.Flooded as exc:
                index = n + typing.cast(int, exc.where[0])
                raise _flooded(exc, self._var_pos_name(), [index, *exc.where[1:]], "params") from None
        elif type(obj) is dict:
            # (as `_bind_named` takes them: beside **kwargs, a positional-only parameter's name
            # is **kwargs's; round 37, it was checked as the parameter's, built unchecked)
            known, kw_only = self._named_type.__struct_fields__, self._pos_only
            try:
                if named is not None:
                    named({k: v for k, v in obj.items() if k not in kw_only} if kw_only else obj)
                if var_kw is not None:
                    var_kw({k: v for k, v in obj.items() if k not in known or k in kw_only})
            except collisions.Flooded as exc:
                raise _flooded(exc, str(exc.where[0]), exc.where[1:]) from None

    def _bind_positional(self, values: list[object]) -> tuple[object, ...]:
        if self._required_kwonly:
            raise InvalidParams(
                self._required_kwonly[0], "keyword-only parameter: pass params by name"
            )
        n = len(self._pos_names)
        pos_type, _, var_pos, _ = self._into
        head = values[:n] if var_pos is not None else values
        try:
            bound = msgspec.structs.astuple(msgspec.convert(head, pos_type, str_keys=True))
        except msgspec.ValidationError as exc:
            raise self._invalid(str(exc), len(head)) from None
        if var_pos is None or len(values) <= n:
            return bound
        try:
            rest = msgspec.convert(values[n:], var_pos, str_keys=True)
        except msgspec.ValidationError as exc:
            raise self._invalid_extra(values[n:], str(exc)) from None
        return bound + tuple(rest)

    def _bind_named(self, values: dict[str, object]) -> tuple[tuple[object, ...], dict[str, object]]:
        extra: dict[str, object] = {}
        if self._pos_only:  # (beside **kwargs)
            if self._pos_only_required:
                raise InvalidParams(self._pos_only_required[0],
                                    "positional-only parameter beside **kwargs: pass params as an array")
            named = [k for k in values if k in self._pos_only]
            if named:  # (**kwargs's, as in Python; the parameter keeps its default)
                extra = {k: values[k] for k in named}
                values = {k: v for k, v in values.items() if k not in self._pos_only}
        _, named_type, _, var_kw = self._into
        if var_kw is not None:
            known = set(self._pos_names) | set(self._kwonly)
            extra |= {k: values[k] for k in values if k not in known}
            try:
                extra = msgspec.convert(extra, var_kw, str_keys=True)
            except msgspec.ValidationError as exc:
                raise self._invalid_extra(extra, str(exc)) from None
        try:
            bound = msgspec.structs.astuple(msgspec.convert(values, named_type, str_keys=True))
        except msgspec.ValidationError as exc:
            raise self._invalid(str(exc), None, values) from None
        n = len(self._pos_names)
        kwargs = dict(zip(self._named_kwonly_order(), bound[n:]))
        kwargs.update(extra)
        return bound[:n], kwargs

    def _invalid_extra(self, values: list[object] | dict[str, object], message: str) -> InvalidParams:
        """Name the value taken by `*args` (its name and place in params) or by
        `**kwargs` (the key) that does not fit the hint, from `message`, msgspec's refusal
        of them all. An *args value's place is in it; a key is not ("$[...]"): the values
        are converted once more as a list, where msgspec places it (round 49: one value at a
        time up to the one refused, 1 MiB held a worker 0.3-1 s; round 52: halved, the
        refused value was converted again in each half that held it)."""
        if type(values) is list:
            return InvalidParams(self._var_pos_name(), _tail_message(message, len(self._pos_names)) or message)
        items = list(typing.cast(dict[str, object], values).items())
        hint = list[typing.get_args(self._var_kw)[1]]  # type: ignore[misc,valid-type]  # (its values as a list: `$[i]`)
        return _keyed(items, _refuses(lambda value: msgspec.convert(value, hint, str_keys=True),
                                      [value for _, value in items]), message)

    def _out_of_range(self, params: bytes, message: str, placed: str | None = None, typed: bool = True) -> InvalidParams:
        """Name the parameter holding a value msgspec cannot hold (a number past a
        double's range, e.g. 1e400). msgspec's `message` locates it as `$[i]...` in an
        array (the i-th positional parameter, or `*args`), but only as `$[...]...` in an
        object: its key is then found by decoding each value alone. Where the parameters'
        types place it better (a Struct's or a dataclass's field: `$.a.y`, where the
        untyped decoding says `$[...][...]`), their message is taken instead (new user,
        round 99, L1): `placed`, the fast path's refusal, if it has one; else they are decoded
        once with them here, when there is no fast path (with one, that refusal said
        something else first, and decoding again ran an app's `__post_init__` a second time:
        hostile testing, round 103, L1); not if `typed` is False (tried already). Cold path."""
        if placed is not None and placed.startswith(_OUT_OF_RANGE + " - at `$"):
            return self._invalid(placed, None)
        # (not with a number msgspec may read slowly in them: those before the one refused cost
        # 2-20 µs each, decoded with their types; a float past a double's range is placed by
        # `_beyond`, an integer of more than 4300 digits is said of its parameter, unplaced)
        placing = typed and self._fast is None and plain_numbers(params)
        placed = self._placed_out_of_range(params) if placing else None
        if placed is not None:
            return self._invalid(placed, None)
        at = _located(message)
        if at is not None and at[1] is not None:  # $[i]
            index = at[1]
            if index < len(self._pos_names):
                return self._invalid(message, None)
            if self._var_pos is not None:
                reason, inner = at[0], at[3]
                where = f" - at `params[{index}]{inner}`" if inner else f" (params[{index}])"
                return InvalidParams(self._var_pos_name(), reason + where)
            return InvalidParams(None, message)  # past the positional parameters
        try:
            values = msgspec.json.decode(params, type=dict[str, msgspec.Raw])
        except (msgspec.ValidationError, msgspec.DecodeError):
            return InvalidParams(None, message)
        for key, value in values.items():
            try:
                _decode_json(value)
            except msgspec.ValidationError as exc:
                reason, _, inner = str(exc).partition(" - at `$")  # (inner ends with its `)
                return InvalidParams(key, f"{reason} - at `{key}{inner}" if inner else reason)
        return InvalidParams(None, message)

    def _read_floats(self, params: bytes) -> object:
        """`params` decoded with their floats read by float() (broker/floats.py), or
        `InvalidParams` if one past a double's range is left in them (not replaced by a later
        duplicate key's value): `_beyond`. Raises msgspec's errors as msgspec.json.decode does."""
        read = _BEYOND_READ[0]
        obj = read_json_beyond(params)
        if _BEYOND_READ[0] != read:
            where = first_beyond(obj)
            if where is not None:
                raise self._beyond(obj, where)
        return obj

    def _beyond(self, value: object, where: list[int | str]) -> InvalidParams:
        """The refusal of params decoded as `value` (`read_json_beyond`) that hold a float past
        a double's range, the first (in the text's order) at `where` (`first_beyond`): as
        `_out_of_range` says it, from this one decoding (hostile testing, round 137, F5: the
        params were decoded ~6 times to refuse them, 1.6 s a MiB). Where the parameters' types
        place it better (`$.a.y`), their place: the value converted to them, which refuses the
        `BEYOND` there ("got `NumberOutOfRange`"), as their decoding refused the number. Cold path."""
        typed = self._placed_beyond(value)
        if typed is not None:
            return self._invalid(typed, None)
        inner = _inner(where[1:])
        if type(value) is dict:  # (its key: the first step)
            key = typing.cast(str, where[0])
            return InvalidParams(key, f"{_OUT_OF_RANGE} - at `{key}{inner}`" if inner else _OUT_OF_RANGE)
        top = f"[{where[0]}]" if where else ""
        return self._out_of_range(b"", f"{_OUT_OF_RANGE} - at `${top}{inner}`" if where else _OUT_OF_RANGE, typed=False)

    def _placed_beyond(self, value: object) -> str | None:
        """msgspec's "Number out of range" message placing the first `BEYOND` in `value` with
        the parameters' types (`$.name...` or `$[i]...`), as `_placed_out_of_range` does from the
        text; None if their conversion says something else first, passes it (an `Any` takes
        it), or may not be tried (sets and dicts with keys other than strings: see there)."""
        if self._guards is not None or self._post_init or (type(value) is not list and type(value) is not dict):
            return None  # (post_init: the app's code would run on `BEYOND`, hostile testing, round 141, F8)
        kind = self._pos_type if type(value) is list else self._named_type
        try:
            msgspec.convert(value, kind, str_keys=True)
        except (msgspec.ValidationError, RecursionError) as exc:
            split = _split_path(str(exc))
            if split is not None and split[0].endswith(_GOT_BEYOND):
                return f"{_OUT_OF_RANGE} - at `${split[1]}`"
        return None

    def _placed_out_of_range(self, params: bytes) -> str | None:
        """msgspec's "Number out of range" message for `params` decoded with the parameters'
        own types (a Struct of them: `$.name...` or `$[i]...`), or None if that decoding
        says something else first, or may not be tried: types that hold sets or dicts with
        keys other than strings are checked for hash flooding before anything is built
        (`collisions`), so they are not decoded here."""
        if self._guards is not None or self.raw_params or params[:1] not in (b"[", b"{"):
            return None
        kind = self._pos_type if params[:1] == b"[" else self._named_type
        try:
            msgspec.json.decode(params, type=kind)
        except (msgspec.ValidationError, msgspec.DecodeError, RecursionError) as exc:
            message = str(exc)
            return message if message.startswith(_OUT_OF_RANGE + " - at `$") else None
        return None

    def _var_pos_name(self) -> str:
        """The name of the `*args` parameter (cold path: read from the signature)."""
        return next(p.name for p in inspect.signature(self.fn).parameters.values()
                    if p.kind is inspect.Parameter.VAR_POSITIONAL)

    def _named_kwonly_order(self) -> list[str]:
        return list(self._named_type.__struct_fields__[len(self._pos_names):])

    def _invalid(self, message: str, given: int | None, values: dict[str, object] | None = None) -> InvalidParams:
        """Map a msgspec validation message to the parameter it is about. `values`: the
        params given by name, whose keys are checked here rather than read back from the
        message, which quotes them (hostile testing, round 34: a key holding " - at
        `$[7]" was taken for the place of the error, and answered -32603)."""
        if values is not None and self._var_kw is None:
            known = self._named_type.__struct_fields__
            unknown = next((key for key in values if key not in known), None)
            if unknown is not None:
                return InvalidParams(unknown, "unexpected parameter")
        at = _located(message)
        if at is not None:
            reason, index, field, inner = at
            if index is not None and index >= len(self._pos_names):
                return InvalidParams(None, message)
            name = self._pos_names[index] if index is not None else typing.cast(str, field)
            if inner:  # inside the parameter: say where, e.g. `items[0].qty`
                reason = f"{reason} - at `{name}{inner}`"
            return InvalidParams(name, reason)
        if given is not None and "array" in message:
            n = len(self._pos_names)
            if given < n:
                return InvalidParams(self._pos_names[given], "missing required parameter")
            return InvalidParams(None, f"too many positional params: takes at most {n}, got {given}")
        f = _FIELD_IN_MSG.search(message)
        if f and "missing" in message:
            return InvalidParams(f.group(1), "missing required parameter")
        if f and "unknown" in message:
            return InvalidParams(f.group(1), "unexpected parameter")
        return InvalidParams(None, message)


def _inner(place: list[int | str]) -> str:
    """A place `first_beyond` gives, as msgspec writes one: `[3][...]` (an object's key as `[...]`)."""
    return "".join(f"[{step}]" if type(step) is int else "[...]" for step in place)


def _check_value(value: object, check: collisions.Check | None, name: str, where: str, tail: int | None) -> None:
    """One parameter's value, as read, checked by `check` for hash flooding (None: nothing to
    check); `name`, `where`, `tail` as `Method._decode_value` takes them. Raises `InvalidParams`
    naming the parameter and the place."""
    if check is None:
        return
    try:
        check(value)
    except collisions.Flooded as exc:
        if tail is not None:
            index = tail + typing.cast(int, exc.where[0])
            raise _flooded(exc, name, [index, *exc.where[1:]], "params") from None
        if not name:
            raise _flooded(exc, str(exc.where[0]), exc.where[1:]) from None
        raise _flooded(exc, name, exc.where, where or None) from None


def _flooded(exc: collisions.Flooded, name: str, path: list[str | int], root: str | None = None) -> InvalidParams:
    """`Method._check_floods`'s refusal: the parameter, and where in it (`path`, from
    `root` if the parameter's own name does not say where: an *args value's `params[i]`,
    round 46: on the typed path a flood in one was refused without its place)."""
    inner = "".join(f"[{step}]" if type(step) is int else f".{step}" for step in path)
    return InvalidParams(name, exc.reason.format(at=f" - at `{root or name}{inner}`" if inner or root else ""))


_GOT_FLOAT = ", got `float`"
_GOT_FRACTION = ", got a number with a fractional part"
_ZERO_FRACTION = re.compile(rb"\.0+(?![0-9])")  # (an integral float, `5.0`, `5.000`, or text in a string that looks so)
_GOT_BEYOND = f", got `{type(BEYOND).__name__}`"


def _about_a_number(reason: str) -> bool:
    """Whether a refusal's reason may be of an integral float where an int is wanted: msgspec's
    "Expected `...`, got `float`", or "Number out of range" (1e400, an integer all the same)."""
    return _GOT_FLOAT in reason or reason.startswith(_OUT_OF_RANGE)


_RAW_TOP = msgspec.json.Decoder(list[msgspec.Raw] | dict[str, msgspec.Raw]).decode
_REWRITE = msgspec.json.encode  # (of `_float_form`'s values: numbers in the form they were sent)


FLAG_PSEUDO_MEMBERS_MAX = 4096
"""How many members an `enum.Flag` class that params bind to may make and cache (one
per value that is not one of its own: `IntFlag` takes any integer) before those that
nothing else holds are dropped."""
_FLAG_KEPT: dict[type, int] = {}  # a Flag class: how many members its map held after the last drop


def _drop_flag_members(classes: tuple[type, ...], afresh: bool = False) -> None:
    """Drop from each class's `_value2member_map_` the members that `enum.Flag`'s
    `_missing_` made and cached there for good (CPython's enum module) and that nothing
    else holds, once it has grown by `FLAG_PSEUDO_MEMBERS_MAX` since the last drop:
    binding `IntFlag` params from a client's distinct integers grew a worker by 36 MiB
    per 780 KiB request, never given back (hostile testing, round 36). The worker calls
    it after each call that binds such params, for every such class (round 38: dropped
    only when the class's own method was called next, each class kept a call's members). A member still held (by a module, or a call under way) stays, the same object;
    one made again after its drop is a new object, indistinguishable (no one held the old)."""
    for cls in classes:
        members = vars(cls).get("_value2member_map_")
        if type(members) is not dict or len(members) <= (0 if afresh else _FLAG_KEPT.get(cls, 0)) + FLAG_PSEUDO_MEMBERS_MAX:
            continue
        for value in _held_only_by(members):
            members.pop(value, None)  # (a tool's thread may have dropped it meanwhile)
        _FLAG_KEPT[cls] = len(members)


def _held_only_by(mapping: dict[object, object]) -> list[object]:
    """The keys of `mapping` whose values nothing else references: CPython reference
    counts, read the same way as that of a value a dict alone holds."""
    probe = {None: object()}  # (held by a dict, and by a list of its items, alone)
    alone = _reference_counts(list(probe.items()))[0][2]
    items = list(mapping.items())  # (one step: a tool's thread may add to it meanwhile)
    times: dict[int, int] = {}  # a value's id: how many keys it is the value of
    for _, value in items:
        times[id(value)] = times.get(id(value), 0) + 1
    # A value under k keys is held by the map and by `items` k times each: 2 (k - 1) more
    # than one under one key (round 37: a member cached under two keys, a negative value
    # and its positive twin, was never dropped, and a worker grew by 10 MiB a call).
    return [key for key, ident, count in _reference_counts(items) if count <= alone + 2 * (times[ident] - 1)]


def _reference_counts(items: list[tuple[object, object]]) -> list[tuple[object, int, int]]:
    return [(key, id(value), sys.getrefcount(value)) for key, value in items]


def _keyed(items: list[tuple[str, typing.Any]], refusal: str | None, message: str) -> InvalidParams:
    """The refusal of **kwargs' values: `refusal`, msgspec's of them as one array ("<reason>
    - at `$[i]<inner>`"), said of the key of the i-th of `items` as a refusal of that value
    alone is ("<reason>", or "<reason> - at `key<inner>`"); `message` (the refusal of them
    as an object) with no key if it places none."""
    at = None if refusal is None else _located(refusal)
    index = None if at is None else at[1]
    if at is None or index is None or index >= len(items):
        return InvalidParams(None, message)
    reason, _, _, inner = at
    key = items[index][0]
    if not inner and not reason.endswith(" (a key)"):
        return InvalidParams(key, reason)
    return InvalidParams(key, f"{reason} - at `{key}{inner}`")


def _is_async(fn: Callable[..., object]) -> bool:
    """Is `fn` an async handler: a coroutine function, one marked so
    (`inspect.markcoroutinefunction`, 3.12+), or a sync wrapper of one made with
    `functools.wraps` (which returns the coroutine: run as a task, not inline)? A sync
    handler that returns an awaitable anyway is still run as a task (`_execute`)."""
    if inspect.iscoroutinefunction(fn):
        return True
    try:
        inner = inspect.unwrap(fn)
    except ValueError:  # a __wrapped__ cycle
        return False
    return inner is not fn and inspect.iscoroutinefunction(inner)


class NestingTooDeep(RemoteError):
    """params nest arrays/objects deeper than the configured max_depth."""

    hint = "answered -32600 (max_depth)"


def _check_raw(params: bytes, max_depth: int, deep: bool) -> None:
    """The checks raw params get before a `raw_params` handler sees them: JSON
    (RFC 8259), UTF-8 (section 8.1) and max_depth (`deep`: `nests_deeper` said they
    nest past it, which holds once they are JSON). Any valid JSON passes: `1e400` and
    a 5000-digit integer are JSON, though no float or int of msgspec holds them."""
    try:
        _decode_raw(params)
    except RecursionError:
        raise NestingTooDeep(max_depth) from None
    except msgspec.DecodeError as exc:
        raise InvalidParams(None, f"params are not valid JSON: {exc}") from None
    if not params.isascii():
        try:
            params.decode()
        except UnicodeDecodeError:
            raise InvalidParams(None, "params are not valid UTF-8") from None
    if deep:
        raise NestingTooDeep(max_depth)


_decode_raw = msgspec.json.Decoder(msgspec.Raw).decode
