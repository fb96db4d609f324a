"""The access log: one line per JSON-RPC call answered (`AccessLog`), its fields, and the redaction of its params.

Theory of operation
-------------------
The dispatcher counts every answer it makes in `CallMetrics`; beside each count it hands
the same answer to an `AccessLog` (`Dispatcher.access` for errors, `Dispatcher.access_ok`
for results too), which is None when no line is wanted: with `access_log = "errors"` and
every call a success the hot path pays one `is not None` test per result, and nothing
else. A line is one call with an id (a request; a batch's element; never a notification,
which has no answer to report, nor an HTTP request as a whole).

On the event loop's thread a line is only captured: an `AccessLine` of values that do not
change afterwards (the client's id copied out of the request body, truncated to `ID_BYTES`;
the params, when logged, copied too), put on the log's bounded queue by
`logpipe.DroppingQueueHandler` (dropped and counted, never waited for, when full). It is
rendered (`AccessLine.render`: escaped, redacted, as text or JSON) by the writer's thread
(broker/logpipe.py), off the loop.

What an attacker controls is bounded and escaped: the method is the registered name or
"other" (never the string sent), the id at most `ID_BYTES` of its raw JSON, the params at
most `PARAMS_KEPT_BYTES` kept and `PARAMS_CHARS` written; in text every value that is not
plain printable ASCII is quoted with JSON's escapes, so no control character, newline or
quote of a client's reaches the line as itself (a line cannot be forged).
"""

from __future__ import annotations

import datetime
import json
import logging
import struct
import typing
from collections.abc import Callable

import msgspec

from broker.chunk import read_call
from broker.metrics import outcome_name
from broker.wire import RESULT

if typing.TYPE_CHECKING:
    from broker.answers import ResponseBudget
    from broker.calls import Call
    from broker.jsonrpc import Request

__all__ = [
    "ID_BYTES", "MODES", "PARAMS_CHARS", "PARAMS_KEPT_BYTES", "REDACTED", "SECRET_KEYS", "AccessLine", "AccessLog",
    "address", "keep_params", "redact",
]  # fmt: skip

MODES = ("off", "errors", "all")  # the access_log setting's values
ID_BYTES = 64  # of a client's raw id, kept for its line (longer ones end in "...")
PARAMS_KEPT_BYTES = 4096  # params longer than this are not kept for the log (their size is written)
PARAMS_CHARS = 1024  # of the redacted params' JSON written (longer ends in "...")
REDACTED = "[redacted]"
# Keys whose values are never logged (compared case-insensitively, "-" read as "_"), at any depth
SECRET_KEYS = frozenset({
    "password", "passwd", "pass", "token", "access_token", "refresh_token", "id_token", "secret", "client_secret",
    "authorization", "api_key", "apikey", "key", "private_key", "cookie", "session", "credentials",
})  # fmt: skip
OTHER = "other"  # the method of a call to a method not registered (as the metrics' label)
_decode = msgspec.json.Decoder().decode
_encode = msgspec.json.Encoder().encode


def address(peer: object) -> str:
    """A transport's "peername" as the line names it: host:port, [v6 host]:port, "unix" for
    a Unix socket's ("" or None), "-" when unknown."""
    if isinstance(peer, tuple) and len(peer) >= 2:
        host = str(peer[0])
        return f"[{host}]:{peer[1]}" if ":" in host else f"{host}:{peer[1]}"
    return "unix" if peer == "" or peer is None else "-"


def redact(value: object) -> object:
    """`value` (decoded JSON) with the value under every key of `SECRET_KEYS` replaced by
    `REDACTED`, in nested objects and in lists too. A new value; `value` is not changed."""
    if type(value) is dict:
        return {
            key: REDACTED if key.lower().replace("-", "_") in SECRET_KEYS else redact(item)
            for key, item in value.items()
        }
    if type(value) is list:
        return [redact(item) for item in value]
    return value


def keep_params(params: bytes | memoryview | msgspec.Raw, calls: int = 1) -> bytes | int:
    """What the log keeps of a call's raw params (of a chunk's `calls`: their CALL_ENTRY
    payload): a copy of them, or their size when they are longer than `PARAMS_KEPT_BYTES`
    a call (a request body is not kept alive for its log line)."""
    size = len(params)
    return bytes(params) if size <= PARAMS_KEPT_BYTES * calls else size


def _params_text(kept: bytes | int | None) -> str:
    """The params as the line writes them: redacted JSON, at most PARAMS_CHARS characters."""
    if kept is None:
        return "-"
    if isinstance(kept, int):
        return f"({kept} bytes, not kept)"
    if not kept:
        return "-"  # (none sent)
    try:
        text = _encode(redact(_decode(kept))).decode()
    except (msgspec.DecodeError, RecursionError):  # (nested past msgspec's limit)
        return f"({len(kept)} bytes, not decoded)"
    return text if len(text) <= PARAMS_CHARS else text[:PARAMS_CHARS] + "..."


def _plain(text: str) -> bool:
    """Whether `text` may go into a text line unquoted: printable ASCII, no space, quote or '='."""
    return bool(text) and text.isascii() and text.isprintable() and not any(c in text for c in ' "=\\')


def _quoted(text: str) -> str:
    """`text` as a logfmt value: as is when plain, else a JSON string (ASCII, every control
    character and quote escaped)."""
    return text if _plain(text) else json.dumps(text)  # (ensure_ascii: U+2028 and the like escaped too)


class AccessLine:
    """One call's line, captured on the loop: values that do not change afterwards.

    when: time.time() of the answer (s); client: `address` of its connection's peer; token:
    its caller's token name ("" for none); transport: "http", "tcp" or "unix"; method: the
    registered name or "other"; id: up to ID_BYTES of the raw id (bytes; b"" when none could
    be read); truncated: the id was longer; duration: seconds from arrival to answer; code: 0
    for a result, else the error's code; pid: of the worker that ran it, 0 if none did;
    params: what `keep_params` kept (None when params are not logged).

    Also what `logging.Handler.handle` reads of a record (`levelno`, `name`...): the log's
    handlers take it as one.
    """

    __slots__ = ("client", "code", "duration", "id", "method", "params", "pid", "token", "transport", "truncated",
                 "when")  # fmt: skip
    levelno = logging.INFO
    levelname = "INFO"
    name = "broker.access"
    exc_info = None
    exc_text = None
    stack_info = None

    def __init__(self, when: float, client: str, token: str, transport: str, method: str, id_: bytes,
                 truncated: bool, duration: float, code: int, pid: int, params: bytes | int | None) -> None:
        self.when = when
        self.client = client
        self.token = token
        self.transport = transport
        self.method = method
        self.id = id_
        self.truncated = truncated
        self.duration = duration
        self.code = code
        self.pid = pid
        self.params = params

    def getMessage(self) -> str:
        """The line as text (what `logging.Handler.handleError` would print)."""
        return self.render("text")

    def _id_text(self) -> str:
        text = self.id.decode("utf-8", "backslashreplace") if self.id else "-"
        return text + "..." if self.truncated else text

    def render(self, fmt: str) -> str:
        """The line, no newline: logfmt (`fmt` "text": key=value, quoted where needed) or one
        JSON object ("json"). Called on the writer's thread."""
        stamp = datetime.datetime.fromtimestamp(self.when, datetime.UTC).isoformat(timespec="milliseconds")
        outcome = outcome_name(self.code)
        if fmt == "json":
            record: dict[str, object] = {
                "time": stamp.replace("+00:00", "Z"), "log": "access", "client": self.client,
                "token": self.token or None, "transport": self.transport, "method": self.method,
                "id": self._id_text(), "duration": round(self.duration, 6), "outcome": outcome,
                "code": self.code or None, "pid": self.pid or None,
            }  # fmt: skip
            if self.params is not None:
                record["params"] = _params_text(self.params)
            return _encode(record).decode()
        fields = [
            "time=" + stamp.replace("+00:00", "Z"), "client=" + _quoted(self.client),
            "token=" + (_quoted(self.token) if self.token else "-"), "transport=" + _quoted(self.transport),
            "method=" + _quoted(self.method), "id=" + _quoted(self._id_text()), f"duration={self.duration:.6f}",
            "outcome=" + outcome, "code=" + (str(self.code) if self.code else "-"),
            "pid=" + (str(self.pid) if self.pid else "-"),
        ]  # fmt: skip
        if self.params is not None:
            fields.append("params=" + _quoted(_params_text(self.params)))
        return " ".join(fields)


class AccessLog:
    """What the dispatcher tells of each call answered, as `AccessLine`s given to `emit`.

    mode: "errors" (calls not ended in a result) or "all" (`MODES`; "off" makes none: the
    dispatcher holds no `AccessLog` then). log_params: keep each call's params for its
    line (redacted, bounded: `keep_params`, `redact`). emit: takes each line, never blocks
    (`logpipe.DroppingQueueHandler.enqueue`). clock: time.time, for the lines' time.
    `names`: the registered methods, in the workers' order (set by the dispatcher's
    method table); index len(names) is "other".
    """

    __slots__ = ("_clock", "_known", "_names", "emit", "log_params", "mode")

    def __init__(self, mode: str, emit: Callable[[AccessLine], None], *, log_params: bool = False,
                 clock: Callable[[], float] | None = None) -> None:
        if mode not in MODES or mode == "off":
            raise ValueError(f"access_log = {mode!r}: it must be 'errors' or 'all' (no AccessLog for 'off')")
        import time

        self.mode = mode
        self.emit = emit
        self.log_params = log_params
        self._clock = clock or time.time
        self._names: list[str] = []
        self._known: frozenset[str] = frozenset()

    @property
    def names(self) -> list[str]:
        """The registered methods, by method index."""
        return self._names

    @names.setter
    def names(self, names: list[str]) -> None:
        self._names = list(names)
        self._known = frozenset(names)

    def _method(self, index: int) -> str:
        names = self._names
        return names[index] if 0 <= index < len(names) else OTHER

    def _line(self, owner: ResponseBudget, method: str, id_: bytes | memoryview | msgspec.Raw, duration: float,
              code: int, pid: int, params: bytes | int | None) -> None:
        truncated = len(id_) > ID_BYTES
        self.emit(AccessLine(
            self._clock(), address(owner.peer), owner.caller, owner.transport, method,
            bytes(memoryview(id_)[:ID_BYTES]) if truncated else bytes(id_), truncated, duration, code, pid, params,
        ))  # fmt: skip

    def call(self, call: Call, code: int, duration: float) -> None:
        """A single call (not a chunk) was answered: `code` 0 for a result, else its error's
        code; `duration` seconds after it arrived."""
        worker = call.worker
        params = None
        if self.log_params:
            params = call.kept if call.kept is not None else keep_params(call.params)
        self._line(call.owner, self._method(call.index), call.id, duration, code,
                   worker.pid if worker is not None else 0, params)

    def element(self, chunk: Call, i: int, code: int, duration: float) -> None:
        """The call at place `i` of the batch chunk `chunk` was answered (`code` as `call`)."""
        worker = chunk.worker
        params = None
        if self.log_params:
            params = _chunk_params(chunk, i)
        self._line(chunk.owner, self._method(typing.cast(list[int], chunk.methods)[i]),
                   typing.cast(list[msgspec.Raw], chunk.ids)[i], duration, code,
                   worker.pid if worker is not None else 0, params)

    def chunk_results(self, chunk: Call, entries: typing.Iterable[int], duration: float) -> None:
        """The calls at places `entries` of `chunk` were answered with results."""
        for i in entries:
            self.element(chunk, i, 0, duration)

    def early(self, owner: ResponseBudget, request: Request, code: int) -> None:
        """A request answered before it became a call (rate limited, its method unknown or
        denied to its caller): its method is named only if registered."""
        method = request.method if request.method in self._known else OTHER
        params = keep_params(request.params) if self.log_params else None
        self._line(owner, method, request.id, 0.0, code, 0, params)

    def invalid(self, owner: ResponseBudget, answer: bytes, code: int) -> None:
        """An invalid element (or body) was answered `answer` (a whole Response object, the
        codec's: its id read back from it, null when none could be read)."""
        try:
            id_ = bytes(_decode_id(answer).id)
        except (msgspec.DecodeError, msgspec.ValidationError):
            id_ = b""
        self._line(owner, OTHER, id_, 0.0, code, 0, None if not self.log_params else b"")


class _IdOnly(msgspec.Struct):
    id: msgspec.Raw = msgspec.Raw(b"null")


_decode_id = msgspec.json.Decoder(_IdOnly).decode


def _chunk_params(chunk: Call, i: int) -> bytes | int | None:
    """The params of the call at place `i` of `chunk`, from its CALL_ENTRY payload as kept
    (`Call.kept` once sent, else its params), or None if they cannot be read."""
    payload = chunk.kept if chunk.kept is not None else chunk.params
    if isinstance(payload, int):
        return payload  # (not kept: its size)
    pos = 0
    try:
        for _ in range(i + 1):
            _method, _notification, start, pos = read_call(payload, pos)
    except struct.error:  # (not a whole payload)
        return None
    return keep_params(memoryview(payload)[start:pos])


def results_of(payload: bytes, slots: list[int], skip: typing.Container[int]) -> list[int]:
    """The places of a CHUNK_REPLY or CHUNK_PART `payload`'s results owed (slot >= 0) and
    not in `skip` (refused past a bound, or answered before)."""
    from broker.chunk import answers as chunk_answers

    return [i for i, kind, _start, _end in chunk_answers(payload)
            if kind == RESULT and i < len(slots) and slots[i] >= 0 and i not in skip]
