"""The NDJSON load connection over ``tcp://`` and ``unix://``: one request body per line
out, answer lines back in any order, each matched to its body by id and checked with
the HTTP rules; stray, duplicate and late lines counted as below.

NDJSON: matching out-of-order answers
-------------------------------------
The stream front-end writes each answer line as soon as it is ready, so lines come
in any order. Every id names exactly one body of its connection (`workload`: ids
count up across reconnects; in ``repeated`` mode the calls of one batch share their
body's id), so the in-flight table is a dict keyed by raw id bytes: a single call
by its id, a batch by its first id, with a second dict from each of a batch's ids
to that key. A line is decoded once (msgspec, envelope only) and its (first
known) id pops the record; the line is then checked against that body's `Expect`
with the HTTP rules (an array must answer a batch, by its set of ids as a
multiset, and so on). Lines that match no record:

* an id sent on this connection whose body was answered already: ``duplicate``;
* an id never sent on this connection: ``wrong_id``; a line that is not JSON, or
  has no id: ``malformed``. Such a *stray* line stands in for one body left without
  an answer (as a wrong-id answer does over HTTP): that body is given up when its
  ``--timeout`` passes, when the connection closes or the run ends, or at once
  when there are as many strays as bodies in flight (with ``--depth 1``: at once);
  it then counts no transport error but one answered request, as a wrong answer
  does over HTTP (a batch: its calls beyond the stray's count are ``missing``). An answer arriving after its body was given up is ignored;
* an error answer with ``"id": null`` (the server could not read the request):
  taken as the answer to the oldest body in flight.

With a token (``--token-file``), each connection's first line is ``rpc.authenticate``
carrying it (a notification: no line answers it).

A body of only notifications gets no line: it is done once written (counted in
``requests``, no latency) and holds no slot, so the connection goes on at the next
loop iteration, paced by the transport's write buffer. Per-call timeouts do not
close a stream connection: later answers keep coming on it.

Cost per single call on the hot path: one ``split`` per chunk, one msgspec decode
of the envelope, ``bytes(id)`` (~0.2 µs) and one dict pop; no NamedTuple, no
second decode (`Checker.check_line` gets the decoded line on the slow path).
"""

from __future__ import annotations

import asyncio
import collections
import time
import typing

import msgspec

from broker.loadgen.check import Answer, refuses_token
from broker.loadgen.connection import LoadConnection, _Record, _Shared

__all__ = ["MAX_LINE_BYTES", "StreamLoadConnection"]

_now = time.monotonic
_DECODE_ERRORS = (msgspec.DecodeError, msgspec.ValidationError)
_NL = b"\n"
_NULL = b"null"
MAX_LINE_BYTES = 64 * 1024 * 1024  # an answer line longer than this: malformed, connection dropped


class _IdOnly(msgspec.Struct, gc=False):
    """Just the id of an answer that is not a well-formed Response (to find its body)."""

    id: msgspec.Raw = msgspec.Raw()


class StreamLoadConnection(LoadConnection):
    """NDJSON over TCP or a Unix socket: one request body per line out, one answer line
    per answered body back, in any order (matched by id: see the module docstring).

    `_pending` is the in-flight table: raw id bytes of a single call, or first id of a
    batch, to its record; insertion order is send order, so its first entry is the
    oldest. `_owner` maps each id of a batch in flight to its key.
    """

    __slots__ = ("_decode", "_decode_id", "_decode_raws", "_expired", "_k_first", "_owner", "_parts",
                 "_parts_len", "_pending", "_quiet", "_refill_armed", "_strays", "_write_paused")

    def __init__(self, shared: _Shared, phase: float = 0.0, interval: float = 0.0) -> None:
        super().__init__(shared, phase, interval)
        self._pending: dict[bytes, _Record] = {}
        self._inflight = self._pending
        self._push = self._register
        self._owner: dict[bytes, bytes] = {}
        # (failures it counted, arrival time) of each stray line not yet tied to a body
        self._strays: collections.deque[tuple[int, float]] = collections.deque()
        self._expired: set[bytes] = set()  # ids of bodies given up on: their late answers are ignored
        self._parts: list[bytes] = []  # the incomplete last line, in chunks (never rescanned)
        self._parts_len = 0
        self._k_first = 0  # first body number sent on the current connection
        self._quiet = 0  # bodies of only notifications written by the current `_fill`
        self._refill_armed = False
        self._write_paused = False
        self._decode = msgspec.json.Decoder(Answer | list[Answer]).decode
        self._decode_id = msgspec.json.Decoder(_IdOnly).decode
        self._decode_raws = msgspec.json.Decoder(list[msgspec.Raw]).decode

    def _frame(self, body: bytes) -> bytes:
        return body + _NL

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        if self._s.token and self.connected:
            # A broker asks a TCP stream for its token once, in the connection's first line
            # (README, Rate limits): a notification, so no answer line to match; a token it
            # refuses is answered -32600 with "id": null and the connection closed, which
            # `Checker.check_line` counts as unauthorized.
            line = {"jsonrpc": "2.0", "method": "rpc.authenticate", "params": {"_meta": {"token": self._s.token}}}
            typing.cast(asyncio.Transport, transport).write(msgspec.json.encode(line) + _NL)

    def _reset_reader(self) -> None:
        self._parts.clear()
        self._parts_len = 0
        self._owner.clear()
        self._strays.clear()
        self._expired.clear()
        self._k_first = self._k
        self._write_paused = False

    # -- sending ---------------------------------------------------------------------------
    def _register(self, rec: _Record) -> None:
        """Enter a request just framed in the in-flight table (its `_push`)."""
        expect = rec[2]
        if type(expect) is msgspec.Raw:
            self._pending[bytes(expect)] = rec
            return
        ids = expect.ids
        if not ids:  # only notifications: no line will answer it; done once written
            self._quiet += 1
            if rec[0] >= self._s.t_measure:
                tally = self._s.checker.tally
                tally.requests += 1
                tally.calls += expect.calls
            return
        key = ids[0]
        self._pending[key] = rec
        if expect.batch:
            owner = self._owner
            for id_ in ids:
                owner[id_] = key

    def _fill(self) -> None:
        self._quiet = 0
        super()._fill()
        # Notification-only bodies hold no slot and get no answer to refill on: go on
        # at the next loop iteration (paced by the transport's write buffer).
        if self._quiet and not self._refill_armed and not self._write_paused:
            self._refill_armed = True
            self._s.loop.call_soon(self._refill)

    def _refill(self) -> None:
        self._refill_armed = False
        if not self._write_paused:
            self._fill()

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        self._fill()

    # -- answers ---------------------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        self._now = now = _now()
        if self._parts or data.find(_NL) < 0:
            data = self._join_partial(data)
            if not data:
                return
        self._answered_here = True  # a complete line came: the connection works
        lines = data.split(_NL)
        tail = lines.pop()
        if tail:
            self._parts.append(tail)
            self._parts_len = len(tail)
        s = self._s
        pending = self._pending
        decode = self._decode
        t_measure = s.t_measure
        tally = s.checker.tally
        lat = s.lat
        for line in lines:
            try:
                d = decode(line)
            except _DECODE_ERRORS:
                self._odd_line(line, None)
                continue
            if type(d) is Answer:
                rec = pending.pop(bytes(d.id), None)
                if (rec is not None and type(rec[2]) is msgspec.Raw and len(d.error) == 0
                        and len(d.result) and d.jsonrpc == "2.0"):
                    # Fast path: one call, answered by a result (its id matched by the pop).
                    t_start = rec[0]
                    if t_start >= t_measure:
                        tally.requests += 1
                        tally.calls += 1
                        lat.append(int((now - t_start) * 1e6))
                    continue
                if rec is not None:
                    self._answered(rec, line, d)
                    continue
            self._odd_line(line, d)
        if self._transport is not None:
            self._fill()

    def _join_partial(self, data: bytes) -> bytes:
        """Add ``data`` to the incomplete line; return the bytes to split into lines
        (b"" while no line is complete). Drops the connection past `MAX_LINE_BYTES`."""
        nl = data.find(_NL)
        if nl < 0:
            self._parts.append(data)
            self._parts_len += len(data)
            if self._parts_len > MAX_LINE_BYTES:
                tally = self._s.checker.tally
                tally.malformed += 1
                tally.problem(f"an answer line longer than {MAX_LINE_BYTES} bytes")
                self._parts.clear()
                self._parts_len = 0
                self.abort()  # connection_lost counts what is in flight
            return b""
        self._parts.append(data)
        joined = b"".join(self._parts)
        self._parts.clear()
        self._parts_len = 0
        return joined

    def _find(self, key: bytes) -> _Record | None:
        """Pop the record of the body that the id ``key`` belongs to, if in flight."""
        rec = self._pending.pop(key, None)
        if rec is None and self._owner:
            owner_key = self._owner.get(key)
            if owner_key is not None:
                rec = self._pending.pop(owner_key, None)
        return rec

    def _answered(self, rec: _Record, line: bytes, decoded: Answer | list[Answer] | None) -> None:
        """Check ``line`` as the answer to the body of ``rec`` (popped from `_pending`)."""
        t_start, _sent, expect = rec
        if type(expect) is not msgspec.Raw and expect.batch:
            owner = self._owner
            for id_ in expect.ids:
                owner.pop(id_, None)
        recording = self._recording(t_start)
        self._s.checker.check_line(line, expect, decoded)
        if recording:
            self._record_latency(t_start)

    def _ids_of(self, line: bytes) -> list[bytes] | None:
        """The ids in a line that is not a well-formed answer (None: not JSON at all)."""
        try:
            one = self._decode_id(line)
        except _DECODE_ERRORS:
            pass
        else:
            return [bytes(one.id)] if len(one.id) else []
        try:
            raws = self._decode_raws(line)
        except _DECODE_ERRORS:
            return None
        ids: list[bytes] = []
        for raw in raws:
            try:
                one = self._decode_id(raw)
            except _DECODE_ERRORS:
                continue
            if len(one.id):
                ids.append(bytes(one.id))
        return ids

    def _odd_line(self, line: bytes, decoded: Answer | list[Answer] | None) -> None:
        """The slow path: a line that did not decode as answers, an array, or an answer
        whose id is not in flight."""
        if decoded is None:
            if not line.strip():
                return  # a blank line (or the \r of a \r\n one)
            ids = self._ids_of(line)
        elif type(decoded) is Answer:
            ids = [bytes(decoded.id)]
        else:
            ids = [bytes(a.id) for a in typing.cast(list[Answer], decoded)]
        for key in ids or ():
            rec = self._find(key)
            if rec is not None:
                self._answered(rec, line, decoded)
                return
        tally = self._s.checker.tally
        if not ids:  # not JSON, or no id anywhere
            tally.malformed += 1
            tally.problem(f"malformed answer line: {line[:120]!r}")
            self._stray(1)
            return
        if type(decoded) is Answer and ids[0] == _NULL and len(decoded.error) and len(decoded.result) == 0:
            if self._pending:
                # The server could not read a request's id (spec 5): take it as the answer
                # to the oldest body in flight.
                self._answered(self._pending.pop(next(iter(self._pending))), line, decoded)
                return
            if self._s.token and refuses_token(decoded):
                # The refusal of the token line itself, come before any call was sent on
                # the connection: no call's answer, no wrong id either.
                if self._now >= self._s.t_measure:
                    tally.unauthorized += 1
                return
        wrong = duplicate = 0
        body_of_id = self._s.workload.body_of_id
        for key in ids:
            if key in self._expired:
                continue  # late: its body was given up (and counted) already
            k = body_of_id(key)
            if k is not None and self._k_first <= k < self._k:
                duplicate += 1
            else:
                wrong += 1
        tally.duplicate += duplicate
        tally.wrong_id += wrong
        if wrong:
            tally.problem(f"an answer with an id nobody is waiting for: {line[:120]!r}")
            self._stray(wrong)
        elif duplicate:
            tally.problem(f"a duplicate answer (its call was answered already): {line[:120]!r}")

    def _stray(self, failures: int) -> None:
        """A line tied to no body, which counted ``failures``: it stands in for one body
        that will get no answer; if the strays now cover every body in flight, give
        those up at once (nothing else could answer them). With nothing in flight it
        stands in for nothing."""
        if not self._pending:
            return  # nothing in flight: an unsolicited line, it stands in for nothing
        strays = self._strays
        strays.append((failures, self._now))
        if len(self._pending) <= len(strays):
            self._expire(list(self._pending))

    def _expire(self, keys: list[bytes], why: str = "no answer to id {id}") -> None:
        """Give up on the bodies ``keys``: each taken by a stray line if one is left
        (no more counted), else one transport error (first problem: ``why``, with
        ``{id}`` filled in)."""
        pending = self._pending
        strays = self._strays
        tally = self._s.checker.tally
        for key in keys:
            rec = pending.pop(key, None)
            if rec is None:
                continue
            expect = rec[2]
            if type(expect) is msgspec.Raw:
                ids: tuple[bytes, ...] = (key,)
            else:
                ids = expect.ids
                if expect.batch:
                    for id_ in ids:
                        self._owner.pop(id_, None)
            self._expired.update(ids)
            if strays:
                # Answered, wrongly: a request like a wrong answer over HTTP (the checker
                # counts those as requests too), its calls beyond the stray's count missing.
                failures, t_answer = strays.popleft()
                tally.missing += max(0, len(ids) - failures)
                t_start = rec[0]
                if t_start >= self._s.t_measure:
                    tally.requests += 1
                    tally.calls += 1 if type(expect) is msgspec.Raw else expect.calls
                    self._s.lat.append(int((t_answer - t_start) * 1e6))
            else:
                tally.transport_errors += 1
                tally.problem(why.format(id=key.decode(errors="replace")))

    def _lose_all(self) -> None:
        """Before the base class counts what is in flight as lost: the strays take
        the oldest bodies they can stand in for."""
        if self._strays and self._pending:
            self._expire(list(self._pending)[: len(self._strays)])

    # -- failures --------------------------------------------------------------------------
    def sweep(self, now: float) -> None:
        """Give up on each request older than the timeout, alone: the connection stays
        (the answers of later requests can overtake a stuck one)."""
        pending = self._pending
        if not pending:
            return
        limit = now - self._s.timeout
        late: list[bytes] = []
        for key, rec in pending.items():
            if rec[1] >= limit:
                break
            late.append(key)
        if late:
            self._expire(late, f"no answer to id {{id}} within --timeout {self._s.timeout:g} s")
        if self._strays and len(pending) <= len(self._strays) and not self.wanted():
            self._expire(list(pending))  # draining: only the bodies the strays stood for are left
        if late:
            self._fill()  # their slots are free again, and no answer may come to refill them

    def give_up(self, count: bool = True) -> int:
        n = len(self._pending)
        self._lose_all()
        super().give_up(count)
        self._owner.clear()
        return n

    def connection_lost(self, exc: Exception | None) -> None:
        self._lose_all()
        self._owner.clear()
        self._strays.clear()
        super().connection_lost(exc)
