"""Worker wire protocol, sans-IO: frame encoding and an incremental frame decoder.

The broker and each worker process talk over one Unix stream socket. Every message
is a frame with a fixed 17-byte header, all integers big-endian:

     0                   4     5                               13              17
    +-------------------+-----+-------------------------------+---------------+
    | payload length u32| kind| call id u64                   | aux u32       |
    +-------------------+-----+-------------------------------+---------------+
    | payload (length bytes) ...
    +- - - - - - - - - - - - - - - -

Kinds, who sends them, and what `aux` and the payload hold:

    HELLO   worker → broker  aux 0; payload: JSON `Hello` (pid, slot, methods, concurrency,
                             which methods are sync, the wire version it speaks)
    CALL    broker → worker  aux: method index (its place in HELLO's list);
                             payload: the call's deadline and flow (`DEADLINE`), then the
                             request's raw JSON params (none if absent)
    NOTIFY  broker → worker  as CALL, for a notification; the worker still replies, so
                             the broker can account for the worker's capacity
    RESULT  worker → broker  aux: service time in µs (with `AWAITED` set for a method
                             HELLO calls sync whose call returned an awaitable at
                             once: that time is not how long it held the worker);
                             payload: raw JSON result
    ERROR   worker → broker  aux: service time in µs, or NOT_RUN (0xFFFFFFFF): the
                             handler never ran (its params did not bind, or no such
                             method), so the time says nothing of the method;
                             payload: raw JSON error object
    CANCEL  broker → worker  aux 0; no payload: the call's (or chunk's) deadline passed
    BYE     both ways        aux 0; no payload. Broker → worker: no CALL, NOTIFY or
                             CHUNK comes after it: answer every one that came before,
                             then exit. Worker → broker: it asks to leave (it was sent
                             SIGTERM) and serves on; the broker stops routing to it and
                             answers BYE (if it has not sent one already), and the
                             worker exits as above: no call written to it is lost.
    CHUNK   broker → worker  several calls of one batch in one frame; aux: their count;
                             payload: their deadline and flow (`DEADLINE`), then per call a
                             `CALL_ENTRY` (method index u16, flags u8 (1 = notification),
                             id length u32, params length u32), then the client's raw id
                             (none for a notification), then the raw params
    CHUNK_RESULTS worker → broker  every answer of a CHUNK of calls (no notification)
                             when all are results and no CHUNK_PART went before: the
                             finished Response objects, `{"jsonrpc":"2.0","id":<the raw
                             id as sent>,"result":<raw JSON>}`, in the chunk's order,
                             separated by one `\n` (none inside: ids and results are
                             compact JSON, which the worker checks); it ends the chunk as
                             CHUNK_REPLY does, aux as CHUNK_REPLY's. The broker puts each
                             in its slot as it is (`Replies._fill_results`), checked against
                             its connection's bounds as one piece; otherwise it reads them
                             one by one as a CHUNK_REPLY's.
    CHUNK_PART worker → broker  answers to some calls of a CHUNK, sent when running
                             it takes longer than one slice (so no answer waits for
                             the whole chunk); payload: per answer a `REPLY_ENTRY`
                             (the call's place in the chunk u32, kind u8: RESULT or
                             ERROR, length u32), then the raw JSON result or error
    CHUNK_REPLY worker → broker  the rest of a CHUNK's answers (as CHUNK_PART), sent
                             once all of its calls are done (unless CHUNK_RESULTS is); it
                             ends the chunk.
                             aux: service time in µs (NOT_RUN: no handler of the
                             chunk ran). A worker may instead answer a
                             whole CHUNK with one ERROR frame (e.g. cancelled before
                             it ran). Answers that together pass max_frame_bytes are
                             split over several CHUNK_PARTs; one part holds at most
                             max_frame_bytes of answers plus one REPLY_ENTRY header.
    RETURN  worker → broker  calls sent `RETURNABLE` that the worker gives back unstarted,
                             because their method turned out slow (see below). For a
                             CALL or NOTIFY: aux 0, payload its raw params (as sent, after
                             `DEADLINE`); it is owed no other reply. For a CHUNK: aux is the
                             place of its first call given back, and the calls from there
                             on are (payload: their `CALL_ENTRY`s and params, as sent); at
                             aux 0 the whole chunk is, and it is owed no other reply, else
                             the calls before aux are answered as usual, their CHUNK_REPLY
                             after this frame. With `RETURN_ASIDE` set in aux (the place
                             below it), the calls were given back not for their method's
                             speed but for another front-end's call run alone (`ALONE`,
                             below), whatever their flow: the broker routes them again as
                             they were, to another worker, and blames them for nothing.
    HOLD    both ways        no payload. Worker → broker: aux 1 (hold): it runs another
                             front-end's call alone: route nothing new to it until aux 0
                             (release); every call of this connection waiting in it comes
                             back (RETURN, `RETURN_ASIDE`). Worker → broker, aux
                             `STARTS` (2), id a call sent ALONE: it starts now (the frame
                             is in the socket before it does); a worker that dies before
                             never ran it, and the broker sends it again. Broker → worker: aux 1, the
                             answer to a hold: no call comes after it until the release,
                             so once the worker has read it, it holds no call of this
                             connection it has not seen (several front-ends only).
    BLOCKED worker → broker  (several front-ends only) aux 1: a handler has held the
                             worker's loop HELD_SECONDS (a sync call, or a chunk's), and
                             every connection is told: payload the call's deadline (f64,
                             as below); call id the call's for the connection that sent
                             it, 0 for every other, which routes nothing new to the
                             worker until aux 0 (no payload, id 0): the handler returned.
                             A front-end tells by it whether a worker that does not answer
                             a cancelled call is hung in its own call or busy in another's,
                             and until when (new user, round 114).

A call's deadline (CALL, NOTIFY, CHUNK) is a big-endian f64: CLOCK_MONOTONIC seconds,
the clock the broker's event loop and `time.monotonic` read on Linux, one for every
process of the machine (clock_gettime(2)); inf for none. The worker starts no call whose
deadline has passed: it answers it as it answers one cancelled before it started
(`CANCEL_ACK`, aux NOT_RUN), and a chunk's calls not started by then likewise. The
broker answers such a call -32001 at that deadline and sends CANCEL, but the CANCEL
can wait behind other frames (hostile testing, round 19: a worker whose loop a slow
call held ran calls answered -32001 long before, their CANCELs still in the broker's
buffer behind a few hundred kB of frames); the deadline in the frame needs no CANCEL.
After the deadline comes the call's flow, a big-endian u32: the client connection it came
on (any number below 2**30 the broker picks, one per connection), with `RETURNABLE` (bit 31)
set when the broker sent it as a call of a method not known to block (a sync method measured
fast, or async) to a worker not busy in a blocking one: a worker whose sync call of such a
method took a millisecond or more gives back, unstarted, those of its calls waiting to run
that are of a method now slow there, and the broker routes them again as blocking (hostile
testing, round 63: a sync method learnt fast, then a batch of its slow calls sent 50 a
worker, and another client's batch of 1000 fast calls waited one slow call per round trip
of its share, 1.9 s; without them on the worker, the share keeps that client to half the
workers). A worker runs the calls waiting in
it in the order they came, except that when one took the whole of a slice of the worker's
loop, they go in the order of the time their flows' calls have taken there, least first
(`WorkerProtocol._next_turn`): a client whose calls turn out slow holds another's calls
back for about one of them, not for all of its own that reached the worker first (hostile testing, round 60: a sync method learnt
fast from a cheap call, then a batch of its slow calls, 50 a worker, held every other
client's call 10 s).

With several front-ends (`serve --frontends N`) a single call may carry `ALONE` (bit 30) in its
flow: the front-end runs its method's calls alone after a worker died under them (broker/isolation.py),
and only the worker sees every front-end's calls. A worker with other connections that comes to
such a call holds them (HOLD, aux 1), gives back unstarted every call of theirs waiting in it
(RETURN with `RETURN_ASIDE`; of a chunk started, its calls not started), and starts the call
once each of them has answered the hold and none of their calls runs in it; a call of theirs
that arrives meanwhile is given back at once, but an `ALONE` one waits its turn, in order. Its
answer (or its deadline, or its cancel) releases them (HOLD, aux 0). (Hostile testing, round
130: a call one front-end ran alone shared its worker with another front-end's calls, which
died with it, -32002.) Each such call's front-end is told when it starts (HOLD, aux `STARTS`):
one the worker dies before that is sent again, not answered -32002 (round 132: one waiting
beside another front-end's crash died with it). A worker with one connection has nothing to
hold: it runs such a call as any.

A chunk travels and is accounted for as one unit (one call id, one deadline): it
saves the per-call frame work on both sides for batches. The worker replies to every
CALL, NOTIFY and CHUNK exactly once (a call it cancelled, or never ran, with an ERROR
whose payload is exactly `CANCEL_ACK`, so the broker can tell that acknowledgement from
a result that merely came late), so the broker's count of a worker's outstanding calls
stays exact.
Payloads are JSON or raw bytes only: nothing on this wire is ever unpickled.
"""

from __future__ import annotations

import math
import struct
import typing
from enum import IntEnum

import msgspec

from broker.errors import RemoteError
from broker.jsonrpc import ErrorCode, error_object

__all__ = [
    "ALONE",
    "AWAITED",
    "BLOCKED",
    "BYE",
    "CALL",
    "CALL_ENTRY",
    "CALL_HEADER",
    "CANCEL",
    "CANCEL_ACK",
    "CANCEL_ACK_RAN",
    "CHUNK",
    "CHUNK_PART",
    "CHUNK_REPLY",
    "CHUNK_RESULTS",
    "DEADLINE",
    "ERROR",
    "FLOW_MASK",
    "HEADER",
    "HEADER_SIZE",
    "HELLO",
    "HOLD",
    "MAX_FRAME_BYTES",
    "MAX_METHODS",
    "NOTIFY",
    "NOTIFY_FLAG",
    "NOT_RUN",
    "REPLY_ENTRY",
    "RESULT",
    "RETURN",
    "RETURNABLE",
    "RETURN_ASIDE",
    "STARTS",
    "VERSION",
    "FrameDecoder",
    "FrameError",
    "Hello",
    "Kind",
    "MethodInfo",
    "ParamStructure",
    "WireMismatch",
    "decode_hello",
    "encode_call",
    "encode_frame",
]


class Kind(IntEnum):
    """Frame kinds; see the module docstring for who sends each."""

    HELLO = 1
    CALL = 2
    NOTIFY = 3
    RESULT = 4
    ERROR = 5
    CANCEL = 6
    BYE = 7
    CHUNK = 8
    CHUNK_REPLY = 9
    CHUNK_RESULTS = 10
    CHUNK_PART = 11
    RETURN = 12
    HOLD = 13
    BLOCKED = 14


# The kinds as plain ints, declared here once for every module that reads or writes
# frames: the hot paths compare a frame's kind per frame, and an IntEnum member compares
# slower than an int (IntEnum.__eq__ is looked up on the subclass). (CHUNK_PART, RETURN,
# HOLD and BLOCKED last: `Replies.on_reply` tells them from the rest with one comparison.)
(HELLO, CALL, NOTIFY, RESULT, ERROR, CANCEL, BYE, CHUNK, CHUNK_REPLY, CHUNK_RESULTS, CHUNK_PART, RETURN, HOLD,
 BLOCKED) = map(int, Kind)


HEADER = struct.Struct(">IBQI")
HEADER_SIZE = HEADER.size  # 17
# A call's deadline, the first bytes of a CALL, NOTIFY or CHUNK payload, and the header
# with it, packed at once (the broker's hot path).
DEADLINE = struct.Struct(">dI")  # the call's deadline and its flow (a connection's number, RETURNABLE, ALONE)
RETURNABLE = 0x80000000  # in a call's flow: it may be given back unstarted (RETURN)
ALONE = 0x40000000  # ... it runs alone in its worker, whatever the other front-ends send (HOLD)
FLOW_MASK = ALONE - 1  # ... and the connection's number
RETURN_ASIDE = 0x80000000  # in a RETURN's aux: given back for another front-end's call run alone
STARTS = 2  # in a worker's HOLD's aux: the call sent ALONE (its id) starts now
HOLD_WAIT_S = 1.0  # a front-end held is waited for this long at most (worker/alone.py)
WOKE_SECONDS = HOLD_WAIT_S / 2  # a front-end that read no client this long reads its workers first (`Membership.woke`)
CALL_HEADER = struct.Struct(">IBQIdI")
CALL_ENTRY = struct.Struct(">HBII")  # in a CHUNK: method index, flags, id length, params length
REPLY_ENTRY = struct.Struct(">IBI")  # in a CHUNK_PART/REPLY: call's place, kind, length
NOTIFY_FLAG = 1
# The most methods one worker may serve: CALL_ENTRY holds a method's index in 16 bits,
# and index len(methods) is taken too (a queued call whose method a reload lost).
MAX_METHODS = 0xFFFF
# A reply's aux meaning "the handler never ran" (params that did not bind, an unknown
# method): not a service time, so neither side learns a method's speed from it. Real
# service times are capped one below AWAITED.
NOT_RUN = 0xFFFFFFFF
# A flag in a reply's aux (not NOT_RUN): the call, of a method HELLO lists as sync, returned
# an awaitable within 10 ms, which the worker ran as a task (a decorator's wrapper made
# without functools.wraps): its time, what it awaited included, is not how long it held the
# worker, and the broker learns it blocked ~0 us (hostile testing, round 23: such a method
# awaiting 1 s was learnt a slow sync one, and its calls ran one at a time per worker). The
# rest of aux is that time. One that blocked longer before returning its awaitable is sent
# unflagged, its aux the time it blocked (round 24).
AWAITED = 0x80000000
# The error object a worker answers a call with when it cancelled it on CANCEL (or
# dropped it unstarted): byte for byte, so the broker recognises it (late replies).
CANCEL_ACK = error_object(ErrorCode.TIMED_OUT, data="cancelled by the broker")
# ... and the one for a call of which some code of the app's may have run: a sync handler's
# awaitable that its deadline stopped before its first step, or a call whose deadline passed
# while its params were bound (a __post_init__ runs then). A CANCEL_ACK says nothing of the
# app's ran (the broker tells the client `"started": false`); this one does not.
CANCEL_ACK_RAN = error_object(ErrorCode.TIMED_OUT, data="cancelled by the broker after its handler ran")
_KINDS = frozenset(int(k) for k in Kind)
# This format's version, in HELLO: 2 since calls carry their deadline, 3 since they carry
# their flow too, 4 since a worker may give calls back (RETURN), 5 since a CHUNK carries its
# calls' ids and may be answered with finished Response objects (CHUNK_RESULTS), 6 since a call
# may run alone in its worker whatever the other front-ends send (ALONE, HOLD, RETURN_ASIDE), 7 since
# a worker tells every front-end when a handler blocks it (BLOCKED), 8 since a call sent ALONE
# waits its turn and its front-end is told when it starts (HOLD, STARTS); a HELLO
# without one is version 1's. A worker started from code upgraded in place under a running
# broker (a SIGHUP after `pip install -U`) speaks another, and is refused with a message saying so.
VERSION = 8
# The default of max_frame_bytes (config/settings.py's too): the largest frame either side takes.
MAX_FRAME_BYTES = 16 * 1024 * 1024


ParamStructure = typing.Literal["either", "by-name", "by-position"]
"""OpenRPC's `paramStructure` of a method (Method Object): how its params may be given."""


class MethodInfo(msgspec.Struct, frozen=True, omit_defaults=True):
    """One method a worker serves, as its HELLO describes it (every field but `name`
    optional: left out when it has its default). The broker's catalogue of them
    (broker/catalog.py) answers `rpc.discover` and lists MCP tools.

    name: its JSON-RPC method name.
    params_schema: msgspec's JSON Schema of its params by name, as generated (a `$ref` to
        `$defs`); {} when unknown.
    doc: its docstring (`inspect.getdoc`): OpenRPC's `description`, a tool's `description`.
    tool: it is offered to MCP hosts as a tool (`Registry.method(tool=True)`).
    title: a human-readable name: a tool's `title`, OpenRPC's `summary`; None: none.
    annotations: a tool's MCP ToolAnnotations as JSON (`readOnlyHint`...), None: none.
    input_schema: the params by name as one object schema, `$ref`s inlined (a tool's
        `inputSchema`; broker/worker/tools.py); None when unknown (never for a tool).
    output_schema: a tool's `outputSchema`: an object schema of its result, or of
        `{"result": <its result>}` when `wrap_result`; None: none (no structured content).
    wrap_result: a tool's structured content is `{"result": <the JSON result>}`, not the
        result itself.
    result_schema: the JSON Schema of its result as it is (OpenRPC's), {} when unknown.
    param_structure: OpenRPC's `paramStructure`: "either", "by-name" or "by-position".
    """

    name: str
    params_schema: dict[str, object] = {}
    doc: str = ""
    tool: bool = False
    title: str | None = None
    annotations: dict[str, object] | None = None
    input_schema: dict[str, object] | None = None
    output_schema: dict[str, object] | None = None
    wrap_result: bool = False
    result_schema: dict[str, object] = {}
    param_structure: ParamStructure = "either"


class Hello(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """HELLO payload: the worker introduces itself after connecting.

    pid, slot: the worker process and the pool slot it was started for.
    methods: the methods it serves; their order gives each its index (CALL's aux).
    concurrency: calls it may have in flight.
    sync_methods: names of the methods whose handler is a plain (sync) function: it
        runs on the worker's event loop and blocks the whole process until it returns,
        so the broker routes around a worker busy in one (`Dispatcher`). Optional: a
        HELLO without it (an older worker) says every method is async.
    wire: the version of this format the worker speaks (`VERSION`; a HELLO without it is
        version 1's, refused by `decode_hello` before this struct is decoded).
    """

    pid: int
    slot: int
    methods: list[MethodInfo]
    concurrency: int
    sync_methods: list[str] = []
    wire: int = VERSION


class FrameError(RemoteError):
    """The peer sent bytes that are not a valid frame; the connection must close."""

    hint = "the worker is killed and replaced; its calls in flight are answered -32002"


class WireMismatch(FrameError):
    """A HELLO of another version of this format (`VERSION`): the worker runs other
    rpc-broker code than the broker (upgraded in place under it). pid, slot, version: the
    worker's, as its HELLO gives them."""

    hint = "restart the broker (not a reload) to run the code on disk"

    def __init__(self, pid: int, slot: int, version: int) -> None:
        self.pid, self.slot, self.version = pid, slot, version
        super().__init__(
            f"worker {slot} (pid {pid}) speaks wire version {version}, this broker {VERSION}: rpc-broker's"
            " own code changed on disk under the running broker (an upgrade in place?); restart the"
            " broker to run it (a reload cannot cross it)"
        )


class _Greeting(msgspec.Struct):
    """What every version's HELLO holds, read first, whatever else it holds (unknown
    fields allowed): a HELLO of another version is refused as that, not as malformed."""

    pid: int = 0
    slot: int = -1
    wire: int = 1


def encode_frame(kind: int, call_id: int, aux: int = 0, payload: bytes = b"") -> bytes:
    """One whole frame as bytes (header and payload).

    Hot paths append to a bytearray with `HEADER.pack` instead; this is for the rest.
    """
    return HEADER.pack(len(payload), kind, call_id, aux) + payload


def encode_call(
    kind: int, call_id: int, aux: int, params: bytes = b"", deadline: float = math.inf, flow: int = 0
) -> bytes:
    """One whole CALL, NOTIFY or CHUNK frame: `params` (a CHUNK's entries) after the
    call's `deadline` (CLOCK_MONOTONIC s, `time.monotonic()`; inf for none) and `flow`
    (0 <= flow < 2**32: its connection's number, below 2**30, and maybe `RETURNABLE` or `ALONE`).

    The broker's hot path packs `CALL_HEADER` into its buffer instead; this is for the rest.
    """
    return CALL_HEADER.pack(DEADLINE.size + len(params), kind, call_id, aux, deadline, flow) + params


class FrameDecoder:
    """Incremental frame decoder: feed bytes as they arrive, get whole frames back.

    max_frame_bytes: largest payload accepted; a larger length raises `FrameError`
    at once (before the payload arrives), as does an unknown kind.
    Leftover bytes of an incomplete frame are kept (compacted once per `feed`).
    """

    __slots__ = ("_buf", "max_frame_bytes")

    def __init__(self, max_frame_bytes: int = MAX_FRAME_BYTES) -> None:
        self._buf = bytearray()
        self.max_frame_bytes = max_frame_bytes

    @property
    def buffered(self) -> int:
        """Bytes held of an incomplete frame."""
        return len(self._buf)

    def feed(self, data: bytes | bytearray | memoryview) -> list[tuple[int, int, int, bytes]]:
        """Add `data`; return the frames it completes as (kind, call id, aux, payload).

        Raises `FrameError` for an unknown kind or an oversize length; after that
        the decoder must not be fed again.
        """
        buf = self._buf
        if buf:
            buf += data
            src: bytes | bytearray = buf
        else:
            src = bytes(data)
        frames: list[tuple[int, int, int, bytes]] = []
        end_all = len(src)
        pos = 0
        unpack = HEADER.unpack_from
        limit = self.max_frame_bytes
        while end_all - pos >= HEADER_SIZE:
            length, kind, call_id, aux = unpack(src, pos)
            if kind not in _KINDS:
                raise FrameError(
                    f"unknown frame kind {kind} in header {bytes(src[pos:pos + HEADER_SIZE])!r}"
                )
            if length > limit:
                raise FrameError(
                    f"frame of {length} bytes exceeds max_frame_bytes {limit}"
                    f" (header {bytes(src[pos:pos + HEADER_SIZE])!r})"
                )
            start = pos + HEADER_SIZE
            end = start + length
            if end > end_all:
                break
            frames.append((kind, call_id, aux, bytes(src[start:end])))
            pos = end
        if src is buf:
            if pos:
                del buf[:pos]
        elif pos < end_all:
            buf += src[pos:]
        return frames


def decode_hello(payload: bytes) -> Hello:
    """Decode a HELLO payload; raises `WireMismatch` for one of another version (whatever
    fields it has), else `FrameError` if it is not a valid `Hello`."""
    try:
        greeting = _greeting_decoder.decode(payload)
        if greeting.wire != VERSION:
            raise WireMismatch(greeting.pid, greeting.slot, greeting.wire)
        return _hello_decoder.decode(payload)
    except msgspec.MsgspecError as exc:
        raise FrameError(f"bad HELLO: {exc}") from None


_greeting_decoder = msgspec.json.Decoder(_Greeting)
_hello_decoder = msgspec.json.Decoder(Hello)
