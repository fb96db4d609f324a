"""What the two front-end harnesses share: a transport in memory, a dispatcher that answers at
once, the loop that drives a real protocol, and the check of JSON-RPC answers.

Imported by fuzz/http_frontend.py and fuzz/ndjson_frontend.py inside their `instrumented`
block (so the broker modules it imports are instrumented when fuzzing).

- `MemoryTransport`: an `asyncio.Transport` that keeps what is written, honours `close`,
  `abort`, `write_eof` (a write after it raises `RuntimeError`, as asyncio's transports do) and
  `pause_reading` (the driver feeds no piece while reading is paused); with backpressure on,
  every write takes its buffer past the high-water mark (`pause_writing`), drained a few
  loop iterations later (`resume_writing`), as a client slow to read.
- `EchoDispatcher`: the interface the front-ends use of `broker.dispatch.Dispatcher`
  (`submit`, `submit_held`, `abandon`, `count_refused_body`, `check_idle`, and the attributes
  they read), answering every call with `{"seq":N}` under its own id, at once or in the
  next loop iteration, N numbering the calls; invalid elements get the codec's answers, as
  `Dispatcher._entries` gives them, and notifications none. Each answer's bytes are counted
  in the connection's `ResponseBudget`, as the dispatcher counts them.
- `drive`: one connection's life on a stdlib asyncio loop (its ready queue tells when it is
  idle): `connection_made`, the pieces fed while reading is not paused, EOF, the loop run until
  idle, the client gone. A loop that never idles, reading paused for good with nothing left
  to resume it, requests read and never answered once the loop idles, or a connection left
  open once its client half-closed and it owes nothing, fails; so does any exception, from a
  call or a callback.
- `check_answers`: JSON-RPC responses, each id null or bytes of a body the codec decoded,
  each seq answered once at most, and every call answered.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import typing
from collections.abc import Callable

import msgspec

from broker.answers import Exchange, Outgoing, ResponseBudget
from broker.jsonrpc import Body, Codec, ErrorCode, Request, response_result
from broker.policy import Policy
from broker.ratelimit import Limiter
from fuzz.harness import plan, timed

__all__ = [
    "EchoDispatcher",
    "Flags",
    "MemoryTransport",
    "RecordingCodec",
    "Run",
    "check_answers",
    "connection_check",
    "drive",
    "event_loop",
    "fuzz_connection",
]

MAX_ITERATIONS = 20_000  # loop iterations a run may take before it counts as never idle


class MemoryTransport(asyncio.Transport):
    """A transport in memory for one protocol (see the module docstring).

    backpressure: 0 for none, else the loop iterations a full write buffer takes to drain.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, protocol: asyncio.Protocol, backpressure: int = 0) -> None:
        super().__init__()
        self.loop = loop
        self.protocol = protocol
        self.out = bytearray()
        self.closing = False
        self.lost = False
        self.eof_written = False
        self.reading = True
        self.backpressure = backpressure
        self.buffered = 0
        self.write_paused = False
        self.late_writes = 0  # writes after close (counted: the checks fail on them)

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self.eof_written:
            raise RuntimeError("Cannot call write() after write_eof()")
        if self.closing:
            self.late_writes += 1
            return
        self.out += data
        if self.backpressure and data:
            self.buffered += len(data)
            if not self.write_paused:
                self.write_paused = True
                self.protocol.pause_writing()
                self.loop.call_soon(self._drain, self.backpressure)

    def _drain(self, left: int) -> None:
        if self.lost:
            return
        if left > 1:
            self.loop.call_soon(self._drain, left - 1)
            return
        self.buffered = 0
        self.write_paused = False
        self.protocol.resume_writing()

    def writelines(self, list_of_data: typing.Iterable[bytes | bytearray | memoryview]) -> None:
        self.write(b"".join(list_of_data))

    def close(self) -> None:
        if not self.closing:
            self.closing = True
            self.loop.call_soon(self._lose)

    def abort(self) -> None:
        self.close()

    def _lose(self) -> None:
        if not self.lost:
            self.lost = True
            self.protocol.connection_lost(None)

    def is_closing(self) -> bool:
        return self.closing

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def is_reading(self) -> bool:
        return self.reading

    def get_write_buffer_size(self) -> int:
        return self.buffered

    def get_extra_info(self, name: str, default: typing.Any = None) -> typing.Any:
        return ("127.0.0.1", 40000) if name == "peername" else default

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        self.eof_written = True


class RecordingCodec(Codec):
    """The listener's codec, keeping every body it decodes (`seen`): the bytes an answer's id
    may come from (an HTTP body's chunks joined, a line without its newline)."""

    __slots__ = ("seen",)

    def __init__(self, max_batch: int) -> None:
        super().__init__(max_batch)
        self.seen: list[bytes] = []

    def decode(self, body: bytes | bytearray | memoryview) -> Body:
        self.seen.append(bytes(body))
        return super().decode(body)


class EchoDispatcher:
    """A dispatcher that answers every call with `{"seq":N}` (see the module docstring).

    later: answer in the next loop iteration (else at once, the exchange complete on return).
    max_response_bytes: the connections' bound on answers owed (the front-ends read it).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, later: bool, max_response_bytes: int) -> None:
        self.loop = loop
        self.later = later
        self.max_response_bytes = max_response_bytes
        self.outgoing = Outgoing()
        self.policy = Policy()  # (every method served: the front-ends hand its sets to their budgets)
        self.limiter = Limiter()  # (no rate limit)
        self.accepting = True
        self.answering_workers = self.ready_workers = 1
        self.in_grace = False
        self.metrics = None
        self.refused = 0  # bodies the front-end refused unread (count_refused_body)
        self._seqs = itertools.count()
        self.made: set[int] = set()  # calls answered by this dispatcher (their seqs)
        self.dropped: set[int] = set()  # ... of which those still owed when their connection went
        self._abandoned: set[int] = set()  # id()s of budgets whose connection is gone
        self._owed: list[tuple[Exchange, int, bytes, int]] = []
        self._due = False  # `_answer` is scheduled

    def woke(self) -> None:
        """As `Membership.woke`: it has no workers to read first."""

    def submit(
        self, body: Body, on_done: Callable[[Exchange], None], budget: ResponseBudget | None = None
    ) -> Exchange | None:
        """As `Dispatcher.submit`: the body's `Exchange`, or None if nothing is owed."""
        if budget is None:
            budget = ResponseBudget(self.outgoing)
        exchange = Exchange(body.batch, body.status, on_done, [], budget=budget)
        size = 0
        for item in body.items:
            if type(item) is not Request:
                answer = typing.cast(bytes, item)
                exchange.answers.append(answer)
                size += len(answer)
                continue
            if not item.id:
                continue  # a notification: no answer
            seq = next(self._seqs)
            self.made.add(seq)
            answer = response_result(item.id, b'{"seq":%d}' % seq)
            if self.later:
                self._owed.append((exchange, len(exchange.answers), answer, seq))
                exchange.answers.append(None)
                exchange.remaining += 1
            else:
                exchange.answers.append(answer)
                size += len(answer)
        if size:
            budget.keep(exchange, size)
        if exchange.remaining and not self._due:  # (one callback for all the calls owed)
            self._due = True
            self.loop.call_soon(self._answer)
        return exchange if exchange.answers else None

    submit_held = submit

    def _answer(self) -> None:
        self._due = False
        owed, self._owed = self._owed, []
        for exchange, slot, answer, seq in owed:
            if id(exchange.budget) in self._abandoned:
                self.dropped.add(seq)
                continue
            exchange.budget.keep(exchange, len(answer))
            exchange.fill(slot, answer)

    def abandon(self, budget: ResponseBudget) -> None:
        """The connection of `budget` is gone: its calls still owed are dropped."""
        self._abandoned.add(id(budget))

    def count_refused_body(self, code: int = ErrorCode.INVALID_REQUEST) -> None:
        self.refused += 1

    def check_idle(self) -> None:
        pass


class Run(typing.NamedTuple):
    """What `drive` saw: the transport, whether the server closed before the client was done,
    the loop's exception handler's calls, and the broker's log records at ERROR or above
    (an exception caught and logged: `log.exception`)."""

    transport: MemoryTransport
    closed_early: bool
    loop_errors: list[dict[str, typing.Any]]
    logged: list[str]


class _Logged(logging.Handler):
    """Keeps the broker's ERROR records (its WARNINGs, limits reached, are the fuzzer's daily
    bread: not printed)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(self.format(record))


_LOGGED = _Logged()
_BROKER_LOG = logging.getLogger("broker")
_BROKER_LOG.addHandler(_LOGGED)
_BROKER_LOG.propagate = False


def event_loop() -> asyncio.AbstractEventLoop:
    """The harness's event loop (a stdlib one, made once, whose exception handler keeps what it
    is called with): a front-end's listener and dispatcher are made in it, and `drive` runs it."""
    global _LOOP
    if _LOOP is None:
        _LOOP = asyncio.new_event_loop()
        _LOOP.set_exception_handler(lambda loop, context: _ERRORS.append(context))
    return _LOOP


_LOOP: asyncio.AbstractEventLoop | None = None
_ERRORS: list[dict[str, typing.Any]] = []


def _ready(loop: asyncio.AbstractEventLoop) -> int:
    return len(loop._ready)  # type: ignore[attr-defined]  # (the stdlib loop's ready queue)


async def _settle(loop: asyncio.AbstractEventLoop, until: Callable[[], bool]) -> None:
    """Run the loop until `until()` or idle (no ready callback, no timer due within 50 ms)."""
    for _ in range(MAX_ITERATIONS):
        if until():
            return
        if not _ready(loop):
            timers = [h for h in loop._scheduled if not h.cancelled()]  # type: ignore[attr-defined]
            due = min((h.when() for h in timers), default=None)
            if due is None or due - loop.time() > 0.05:
                return
            await asyncio.sleep(max(due - loop.time(), 0))
            continue
        await asyncio.sleep(0)
    raise AssertionError(f"the loop never idled in {MAX_ITERATIONS} iterations")


def drive(make: Callable[[], asyncio.Protocol], pieces: list[bytes], eof: bool, backpressure: int) -> Run:
    """Run one connection of the protocol `make()` builds (in the loop: its listener needs one)
    over `pieces`, then EOF if `eof`, then the client's close; see the module docstring."""
    loop = event_loop()
    del _ERRORS[:]
    del _LOGGED.records[:]

    async def run() -> Run:
        protocol = make()
        transport = MemoryTransport(loop, protocol, backpressure)
        protocol.connection_made(transport)
        for piece in pieces:
            await _settle(loop, lambda: transport.reading or transport.closing)
            if transport.closing:
                break
            assert transport.reading, "reading paused for good: nothing left to resume it"
            protocol.data_received(piece)
        closed_early = transport.closing
        if eof and not transport.closing:
            await _settle(loop, lambda: transport.reading or transport.closing)
            if not transport.closing and not protocol.eof_received():
                transport.close()
        await _settle(loop, lambda: False)
        if not transport.closing:  # (the loop is idle: nothing may be left half done)
            under_way = typing.cast(typing.Any, protocol)._under_way()
            assert not under_way, "requests read and never answered, the loop idle"
            assert not (eof and not transport.write_paused), "the client half-closed, owed nothing, and the connection stayed open"
        transport.abort()  # (the client goes: connection_lost, if the server had not closed)
        await _settle(loop, lambda: False)
        return Run(transport, closed_early, list(_ERRORS), list(_LOGGED.records))

    try:
        return loop.run_until_complete(run())
    finally:
        for handle in list(loop._scheduled):  # type: ignore[attr-defined]  # (a sweep, a linger: not the next input's)
            handle.cancel()


class _Response(msgspec.Struct, forbid_unknown_fields=True):
    jsonrpc: typing.Literal["2.0"]
    id: msgspec.Raw
    result: msgspec.Raw = msgspec.Raw()
    error: msgspec.Raw = msgspec.Raw()


class _Error(msgspec.Struct, forbid_unknown_fields=True):
    code: int
    message: str
    data: msgspec.Raw = msgspec.Raw()


class _Seq(msgspec.Struct, forbid_unknown_fields=True):
    seq: int


_RESPONSES = msgspec.json.Decoder(_Response | list[_Response])
_ERROR = msgspec.json.Decoder(_Error)
_SEQ = msgspec.json.Decoder(_Seq)


def check_answers(answers: list[bytes], bodies: list[bytes], dispatcher: EchoDispatcher) -> set[int]:
    """Check JSON-RPC answers (each a response object or an array of them): each has exactly one
    of result and error, a result is a `{"seq":N}` the dispatcher made and no earlier answer
    carried, an error is an error object, each id is null or bytes of one of `bodies`. Return
    the seqs answered. Raises `AssertionError` (msgspec's errors for answers that do not parse)."""
    answered: set[int] = set()
    for answer in answers:
        decoded = _RESPONSES.decode(answer)
        responses = decoded if isinstance(decoded, list) else [decoded]
        assert responses, "an empty batch answer"
        for response in responses:
            raw_id = bytes(response.id)
            assert raw_id == b"null" or any(raw_id in body for body in bodies), f"id {raw_id!r} not in any body"
            assert raw_id[:1] in (b'"', b"-", b"n") or raw_id[:1].isdigit(), raw_id
            assert bool(len(response.result)) != bool(len(response.error)), answer[:200]
            if len(response.result):
                seq = _SEQ.decode(response.result).seq
                assert seq in dispatcher.made, f"seq {seq} never made"
                assert seq not in answered, f"seq {seq} answered twice"
                answered.add(seq)
            else:
                _ERROR.decode(response.error)
    return answered


class Flags(typing.NamedTuple):
    """A front-end harness input's flags byte, read (fuzz/ndjson_frontend.py's docstring)."""

    eof: bool  # bit 0: the client half-closes after its last piece
    backpressure: int  # bit 1: every write fills the buffer, drained 1 loop iteration later (bit 7: 3)
    later: bool  # bit 2: calls answered in the next loop iteration
    max_body_bytes: int  # bit 3: 64, else 1 MiB
    max_batch: int  # bit 4: 3, else 1000
    max_response_bytes: int  # bit 5: 256, else 32 MiB
    max_incoming_bytes: int | None  # bit 6: 512, else no bound

    @classmethod
    def of(cls, flags: int) -> Flags:
        return cls(
            bool(flags & 1),
            (3 if flags & 128 else 1) if flags & 2 else 0,
            bool(flags & 4),
            64 if flags & 8 else 1024 * 1024,
            3 if flags & 16 else 1000,
            256 if flags & 32 else 32 * 1024 * 1024,
            512 if flags & 64 else None,
        )


def fuzz_connection(
    data: bytes,
    make: Callable[[EchoDispatcher, Flags], tuple[asyncio.Protocol, RecordingCodec]],
    answers_of: Callable[[bytes], list[bytes]],
    amplification: tuple[int, int],
) -> int:
    """One front-end harness input (`harness.plan`) through the protocol `make` builds on an
    `EchoDispatcher` (with its listener's codec), driven by `drive`; `answers_of(output)`: the
    JSON-RPC answers the output holds (it checks the rest of the output's framing). Checks
    what the module docstring says, and that the output is at most `amplification` (a, b):
    a bytes an input byte, plus b. Returns the pieces fed (`harness.timed`)."""
    flags, pieces = plan(data)
    options = Flags.of(flags)
    dispatcher = EchoDispatcher(event_loop(), options.later, options.max_response_bytes)
    codecs: list[RecordingCodec] = []

    def build() -> asyncio.Protocol:
        protocol, codec = make(dispatcher, options)
        codecs.append(codec)
        return protocol

    run = drive(build, pieces, options.eof, options.backpressure)
    assert not run.loop_errors, run.loop_errors
    assert not run.logged, run.logged
    assert not run.transport.late_writes, f"{run.transport.late_writes} writes after the close"
    out = bytes(run.transport.out)
    answered = check_answers(answers_of(out), codecs[0].seen, dispatcher)
    missing = dispatcher.made - answered - dispatcher.dropped
    assert not missing, f"calls never answered: {sorted(missing)[:10]}"
    assert len(out) <= amplification[0] * len(data) + amplification[1], (len(out), len(data))
    return max(len(pieces), 1)


def connection_check(
    make: Callable[[EchoDispatcher, Flags], tuple[asyncio.Protocol, RecordingCodec]],
    answers_of: Callable[[bytes], list[bytes]],
    amplification: tuple[int, int],
    protocol: str,
) -> Callable[[bytes], None]:
    """A front-end harness's `check`: `fuzz_connection` with these arguments, timed (`harness.timed`)."""

    def run(data: bytes) -> int:
        return fuzz_connection(data, make, answers_of, amplification)

    check = timed(run)
    check.__doc__ = (f"Send `data` (a harness input: `harness.plan`) through {protocol} and check the invariants"
                     " of its module's docstring; raises `AssertionError` (`harness.SlowInput` if too slow).")
    return check
