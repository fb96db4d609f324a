"""The recording client of `benchmarks/chaos.py`: every call it sends, by id, and every answer
it gets, checked against the call.

Why not the bundled load generator itself: `broker.loadgen` counts answers in a `Tally` and
never keeps a call once answered; it sends requests again, under new ids, after a server's
unannounced close; and it cannot close a connection on purpose mid-request. The chaos
benchmark needs the fate of each call by its id (answered once, twice, wrong, lost, or
dropped with its connection). So this is a thin recording client on top of the load
generator's pieces: its `Target` (the address forms), its envelope-only `Answer` struct
(raw `id`, `result`, `error`, decoded by msgspec), and the same framing it uses (an HTTP/1.1
POST with a prebuilt head, answers parsed by httptools in request order; one NDJSON line per
body, answer lines matched by id in any order). No task per request: everything happens in
the protocol callbacks, as in `broker.loadgen.connection`.

Shapes:

* `Ledger.calls`: raw id bytes (`7` or `"c8"`, as sent, which the broker echoes byte for
  byte) -> `CallRecord`. Ids are unique across the whole run, ints and strings mixed.
* A `Body` is one request body (a single call, a notification, or a batch array) with the
  keys of its calls that have an id; notifications have none and are counted apart.
* Every answer goes through `Ledger.answer`, which decides its fate: right (the expected
  result, or an error of `EXPECTED_ERRORS`), duplicate (its call was answered already), or
  wrong (an id never sent, or sent on another connection, `"id": null`, a result not equal
  to the expected one, an error with another code, a malformed answer).
* A call is *dropped* when this client closed its connection before the answer came
  (`RecordingConnection.drop`), *cut* when the broker closed it; at the end a call neither
  answered nor dropped is *lost* (the cut ones among them too, said apart).
"""

from __future__ import annotations

import asyncio
import collections
import random
import time
import typing
from collections.abc import Callable

import httptools
import msgspec

from broker.loadgen.check import Answer
from broker.loadgen.target import Target

__all__ = ["EXPECTED_ERRORS", "NO_RESULT", "Body", "BodyMaker", "CallRecord", "Fates", "HttpConnection", "Ledger",
           "RecordingConnection", "StreamConnection", "connect"]

EXPECTED_ERRORS = frozenset({-32000, -32001, -32002, -32003, -32004})
"""The broker's own capacity and failure codes (README, "Errors"): overloaded, timed out, worker
died, no worker available, shutting down. Any of them is a right answer to any call under chaos;
any other error code answering these well-formed calls is a wrong answer."""

NO_RESULT = object()  # a call that must not get a result (crash, hang): only an error is right
_decode_answers = msgspec.json.Decoder(Answer | list[Answer]).decode
_decode_any = msgspec.json.Decoder().decode


class _ErrorObject(msgspec.Struct):
    code: int
    message: str


_decode_error = msgspec.json.Decoder(_ErrorObject).decode


class Fates(typing.TypedDict):
    """`Ledger.summary`: how many calls met each fate (see there)."""

    sent: int
    answered_once: int
    lost: int
    lost_cut: int
    duplicated: int
    duplicated_calls: int
    wrong: int
    dropped: int
    results_ok: int
    errors: int
    notifications: int
    sent_http: int
    sent_ndjson: int


class CallRecord:
    """One call that has an id. `expected`: the decoded result it must get, or `NO_RESULT`.
    `answers`: how many answers came for it; `fate`: "" while it waits, then "ok", "error",
    "wrong" (its first answer's verdict) or "dropped"; `cut`: its connection was closed by the
    broker before it was answered."""

    __slots__ = ("answers", "conn", "cut", "expected", "fate", "method", "transport")

    def __init__(self, method: str, expected: object, conn: RecordingConnection) -> None:
        self.method = method
        self.expected = expected
        self.conn = conn
        self.transport = conn.kind
        self.answers = 0
        self.fate = ""
        self.cut = False


class Body(typing.NamedTuple):
    """One request body: its bytes, the keys (raw ids) of its calls with an id, in order, and
    how many notifications it holds."""

    data: bytes
    keys: tuple[bytes, ...]
    notifications: int
    batch: bool


class Ledger:
    """Every call of the run and the verdict on every answer (see the module docstring).

    Counters: `notifications` sent; `duplicated` answers past a call's first; `wrong`
    answers (each counted once, on the call it names when it names one); `errors_by_code`
    of the right error answers, and `error_times` when each came (`time.monotonic()`, s); `ok` right results; `examples` of each failure kind (the
    first few, as text, to tell a harness bug from a broker bug).
    """

    EXAMPLES = 8

    def __init__(self) -> None:
        self.calls: dict[bytes, CallRecord] = {}
        self.next_id = 1
        self.notifications = 0
        self.duplicated = 0
        self.wrong = 0
        self.ok = 0
        self.errors_by_code: collections.Counter[int] = collections.Counter()
        self.error_times: dict[int, list[float]] = collections.defaultdict(list)  # time.monotonic() of each
        self.examples: dict[str, list[str]] = collections.defaultdict(list)

    def example(self, kind: str, text: str) -> None:
        if len(self.examples[kind]) < self.EXAMPLES:
            self.examples[kind].append(text)

    def new_key(self, rng: random.Random) -> bytes:
        """A fresh id, unique across the run: an int or a string, at random."""
        n = self.next_id
        self.next_id += 1
        return b"%d" % n if rng.random() < 0.5 else b'"c%d"' % n

    def answer(self, a: Answer, conn: RecordingConnection, line: bytes) -> None:
        """Judge one Response object `a` (from `line`, for examples) that came on `conn`."""
        key = bytes(a.id)
        rec = self.calls.get(key)
        if rec is None:
            self.wrong += 1
            what = "an answer to no call (a notification's?)" if key in (b"", b"null") else "an id never sent"
            self.example("wrong", f"{what} on {conn.kind}: {line[:200]!r}")
            return
        if rec.answers:
            rec.answers += 1
            self.duplicated += 1
            self.example("duplicated", f"{rec.method} {key.decode()} on {conn.kind} answered again: {line[:200]!r}")
            return
        rec.answers = 1
        if rec.fate == "dropped" or rec.conn is not conn:
            self.example("wrong", f"{rec.method} {key.decode()} sent on another connection"
                         f"{' (dropped)' if rec.fate == 'dropped' else ''}, answered on this {conn.kind}: {line[:200]!r}")
            rec.fate = "wrong"
            self.wrong += 1
            return
        conn.pending.discard(key)
        verdict = self._verdict(a, rec)
        if verdict:
            rec.fate = "wrong"
            self.wrong += 1
            self.example("wrong", f"{rec.method} {key.decode()} on {conn.kind}: {verdict}: {line[:200]!r}")

    def _verdict(self, a: Answer, rec: CallRecord) -> str:
        """Set `rec.fate` to "ok" or "error" and count it, or return what is wrong."""
        has_result, has_error = len(a.result) > 0, len(a.error) > 0
        if a.jsonrpc != "2.0" or has_result == has_error:
            return "not a Response object"
        if has_error:
            try:
                code = _decode_error(a.error).code
            except (msgspec.DecodeError, msgspec.ValidationError):
                return "a malformed error object"
            if code not in EXPECTED_ERRORS:
                return f"error {code}, not one of the broker's capacity or failure codes"
            rec.fate = "error"
            self.errors_by_code[code] += 1
            self.error_times[code].append(time.monotonic())
            return ""
        if rec.expected is NO_RESULT:
            return "a result to a call that cannot have one"
        try:
            result = _decode_any(a.result)
        except msgspec.DecodeError:
            return "a result that is not JSON"
        if result != rec.expected or type(result) is not type(rec.expected):
            return f"result {result!r}, expected {rec.expected!r}"
        rec.fate = "ok"
        self.ok += 1
        return ""

    def malformed(self, conn: RecordingConnection, keys: typing.Iterable[bytes], why: str) -> None:
        """A whole answer that could not be read: each of `keys` (its body's calls still
        waiting) answered wrongly."""
        for key in keys:
            rec = self.calls[key]
            if rec.answers == 0:
                rec.answers = 1
                rec.fate = "wrong"
                self.wrong += 1
                conn.pending.discard(key)
        self.example("wrong", f"on {conn.kind}: {why}")

    def summary(self) -> Fates:
        """The fates of all calls: sent, answered_once (a wrong answer included), duplicated
        (answers past the first) and duplicated_calls (calls answered more than once), lost (not answered, not dropped; `lost_cut` of them on a connection the broker
        closed), dropped, results_ok, errors, wrong, notifications; sent_http and sent_ndjson."""
        answered_once = more = lost = cut = dropped = http = 0
        for key, rec in self.calls.items():
            http += rec.transport == "http"
            if rec.answers == 1:
                answered_once += 1
            elif rec.answers > 1:
                more += 1
            elif rec.answers == 0:
                if rec.fate == "dropped":
                    dropped += 1
                else:
                    lost += 1
                    cut += rec.cut
                    self.example("lost", f"{rec.method} {key.decode()} on {rec.transport}"
                                 f"{' (connection closed by the broker)' if rec.cut else ''}")
        return Fates(sent=len(self.calls), answered_once=answered_once, lost=lost, lost_cut=cut,
                     duplicated=self.duplicated, duplicated_calls=more, wrong=self.wrong, dropped=dropped,
                     results_ok=self.ok, errors=sum(self.errors_by_code.values()), notifications=self.notifications,
                     sent_http=http, sent_ndjson=len(self.calls) - http)


class BodyMaker:
    """Builds request bodies whose every result the harness can check.

    Calls: `add` [a, b] (a the call's number, b random: a + b), `echo` with params of mixed
    types (itself), `slow` (the async sleep, 0..`slow_max` s: its seconds, so that calls are in
    flight when a worker dies), and `update` notifications. `batch_share` of the bodies are
    batches of 2..`batch_max` elements. `rng`: the run's random draws (seeded).
    """

    def __init__(self, ledger: Ledger, rng: random.Random, batch_share: float = 0.35, batch_max: int = 8,
                 slow_share: float = 0.08, slow_max: float = 0.3, notification_share: float = 0.08) -> None:
        self.ledger = ledger
        self.rng = rng
        self.batch_share = batch_share
        self.batch_max = batch_max
        self.slow_share = slow_share
        self.slow_max = slow_max
        self.notification_share = notification_share
        self.batches = 0  # batch bodies made

    def element(self) -> tuple[bytes, bytes | None, str, object]:
        """One call element: (bytes, its key or None for a notification, method, expected)."""
        rng = self.rng
        draw = rng.random()
        if draw < self.notification_share:
            self.ledger.notifications += 1
            return (b'{"jsonrpc":"2.0","method":"update","params":[%d]}' % rng.randrange(1 << 30)), None, "update", None
        key = self.ledger.new_key(rng)
        draw -= self.notification_share
        if draw < self.slow_share:
            seconds = round(rng.uniform(0, self.slow_max), 3)
            params = msgspec.json.encode({"seconds": seconds})
            return self._call(b"slow", params, key), key, "slow", seconds
        if draw < 0.55:
            a = self.ledger.next_id
            b = rng.randrange(-(10**12), 10**12)
            return self._call(b"add", b"[%d,%d]" % (a, b), key), key, "add", a + b
        value: object = [f"e{self.ledger.next_id}\u00e9\n", rng.randrange(-(2**62), 2**62),
                         {"k": rng.random() < 0.5, "n": None}, round(rng.uniform(-1e6, 1e6), 6)]
        if rng.random() < 0.3:
            value = {"v": value}
        return self._call(b"echo", msgspec.json.encode(value), key), key, "echo", value

    @staticmethod
    def _call(method: bytes, params: bytes, key: bytes) -> bytes:
        return b'{"jsonrpc":"2.0","method":"%s","params":%s,"id":%s}' % (method, params, key)

    def one(self, method: str, params: object) -> tuple[bytes, bytes]:
        """A single call of a fault tool (`crash`, `hang`): it must be answered by an error."""
        key = self.ledger.new_key(self.rng)
        return self._call(method.encode(), msgspec.json.encode(params), key), key

    def body(self) -> tuple[Body, list[tuple[bytes, str, object]]]:
        """The next load body, and its calls as (key, method, expected) to record once sent."""
        n = self.rng.randint(2, self.batch_max) if self.rng.random() < self.batch_share else 1
        parts: list[bytes] = []
        calls: list[tuple[bytes, str, object]] = []
        notes = 0
        for _ in range(n):
            data, key, method, expected = self.element()
            parts.append(data)
            if key is None:
                notes += 1
            else:
                calls.append((key, method, expected))
        self.batches += n > 1
        data = parts[0] if n == 1 else b"[" + b",".join(parts) + b"]"
        return Body(data, tuple(k for k, _, _ in calls), notes, n > 1), calls


class RecordingConnection(asyncio.Protocol):
    """One client connection whose calls are recorded in the `Ledger`.

    kind: "http" or "ndjson". `pending`: keys sent here and not answered. `on_answer`: called
    (with this connection) after each answer read, to refill. `send` writes a body and records
    its calls; `drop` closes the socket at once, its pending calls *dropped*; a close by the
    broker marks them *cut*. Subclasses frame and read.
    """

    kind = ""

    def __init__(self, ledger: Ledger, on_answer: Callable[[RecordingConnection], None] | None = None) -> None:
        self.ledger = ledger
        self.on_answer = on_answer
        self.pending: set[bytes] = set()
        self.transport: asyncio.Transport | None = None
        self.closed = asyncio.get_running_loop().create_future()
        self.dropped = False  # closed by us: its pending calls were dropped
        self.cut = 0  # calls cut by the broker's close

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = typing.cast(asyncio.Transport, transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if not self.dropped:
            for key in self.pending:
                rec = self.ledger.calls[key]
                if rec.answers == 0:
                    rec.cut = True
                    self.cut += 1
            if self.pending:
                self.ledger.example("cut", f"{self.kind} connection closed by the broker with {len(self.pending)} "
                                    f"call(s) unanswered ({exc or 'a clean close'})")
        if not self.closed.done():
            self.closed.set_result(None)

    @property
    def open(self) -> bool:
        return self.transport is not None and not self.transport.is_closing()

    def send(self, body: Body, calls: list[tuple[bytes, str, object]]) -> bool:
        """Write `body` and record its calls (False, nothing recorded, if the connection is not open)."""
        if not self.open:
            return False
        records = self.ledger.calls
        for key, method, expected in calls:
            records[key] = CallRecord(method, expected, self)
            self.pending.add(key)
        self._queued(body)
        assert self.transport is not None
        self.transport.write(self._frame(body.data))
        return True

    def drop(self) -> int:
        """Close the socket now, before the answers: its pending calls are dropped; returns how many."""
        self.dropped = True
        for key in self.pending:
            rec = self.ledger.calls[key]
            if rec.answers == 0:
                rec.fate = "dropped"
        n = len(self.pending)
        self.pending.clear()
        if self.transport is not None:
            self.transport.abort()
        return n

    def close(self) -> None:
        """Close at the end of the run (whatever is pending stays pending: lost)."""
        self.dropped = True
        if self.transport is not None:
            self.transport.abort()

    def _answered(self) -> None:
        if self.on_answer is not None and self.open:
            self.on_answer(self)

    # -- by subclasses ---------------------------------------------------------------------
    def _frame(self, data: bytes) -> bytes:
        raise NotImplementedError

    def _queued(self, body: Body) -> None:
        """A body was sent (HTTP keeps them in order)."""

    def can_send(self, depth: int) -> bool:
        raise NotImplementedError


class HttpConnection(RecordingConnection):
    """HTTP/1.1 keep-alive: POSTs, answered in order; each response is checked against the body
    at the head of `bodies` (an id of another body there is wrong; a call of the body left out
    of its answer stays unanswered: lost)."""

    kind = "http"

    def __init__(self, ledger: Ledger, target: Target, on_answer: Callable[[RecordingConnection], None] | None = None
                 ) -> None:
        super().__init__(ledger, on_answer)
        self.bodies: collections.deque[Body] = collections.deque()
        self._head = (f"POST {target.path} HTTP/1.1\r\nHost: {target.host}:{target.port}\r\n"
                      "Content-Type: application/json\r\nContent-Length: ").encode()
        self._parser = httptools.HttpResponseParser(self)
        self._chunks: list[bytes] = []

    def _frame(self, data: bytes) -> bytes:
        return b"%s%d\r\n\r\n%s" % (self._head, len(data), data)

    def _queued(self, body: Body) -> None:
        self.bodies.append(body)

    def can_send(self, depth: int) -> bool:
        return self.open and len(self.bodies) < depth

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.ledger.malformed(self, list(self.pending), f"not an HTTP response ({exc}): {data[:120]!r}")
            self.bodies.clear()
            self.close()

    def on_body(self, chunk: bytes) -> None:
        self._chunks.append(chunk)

    def on_message_complete(self) -> None:
        data = b"".join(self._chunks)
        self._chunks.clear()
        status = self._parser.get_status_code()
        if not self.bodies:
            self.ledger.wrong += 1
            self.ledger.example("wrong", f"an HTTP response to no request: {status} {data[:200]!r}")
            return
        body = self.bodies.popleft()
        self._check(body, status, data)
        self._answered()

    def _check(self, body: Body, status: int, data: bytes) -> None:
        ledger = self.ledger
        if not body.keys:
            if data.strip():  # only notifications: no answer is owed
                ledger.wrong += 1
                ledger.example("wrong", f"an answer to notifications only: {status} {data[:200]!r}")
            return
        try:
            decoded = _decode_answers(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            ledger.malformed(self, body.keys, f"HTTP {status}, body not JSON-RPC answers ({exc}): {data[:200]!r}")
            return
        answers = decoded if isinstance(decoded, list) else [decoded]
        if isinstance(decoded, list) != body.batch:
            ledger.wrong += 1
            ledger.example("wrong", f"HTTP {status}: an array answering a single call, or the reverse: {data[:200]!r}")
        owed = set(body.keys)
        for a in answers:
            key = bytes(a.id)
            if key not in owed and key in ledger.calls and ledger.calls[key].answers == 0:
                ledger.wrong += 1  # another body's call, answered here: wrong, and it stays owed
                ledger.example("wrong", f"HTTP answer for {key.decode()}, a call of another request: {data[:200]!r}")
                continue
            ledger.answer(a, self, data)


class StreamConnection(RecordingConnection):
    """NDJSON over TCP or a Unix socket: one body per line; answer lines in any order, each
    answer (or each element of an array line) matched by its id."""

    kind = "ndjson"

    def __init__(self, ledger: Ledger, on_answer: Callable[[RecordingConnection], None] | None = None) -> None:
        super().__init__(ledger, on_answer)
        self._partial = bytearray()

    def _frame(self, data: bytes) -> bytes:
        return data + b"\n"

    def can_send(self, depth: int) -> bool:
        return self.open and len(self.pending) < depth

    def data_received(self, data: bytes) -> None:
        buf = self._partial
        buf += data
        end = buf.rfind(b"\n")
        if end < 0:
            return
        lines = bytes(buf[:end]).split(b"\n")
        del buf[: end + 1]
        for line in lines:
            if not line.strip():
                continue
            try:
                decoded = _decode_answers(line)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                self.ledger.wrong += 1
                self.ledger.example("wrong", f"an NDJSON line that is not answers ({exc}): {line[:200]!r}")
                continue
            for a in decoded if isinstance(decoded, list) else (decoded,):
                self.ledger.answer(a, self, line)
        self._answered()


async def connect(target: Target, conn: RecordingConnection, timeout: float = 5.0) -> bool:
    """Open `conn` to `target` (http, tcp or unix); False if it cannot be opened in `timeout` s."""
    loop = asyncio.get_running_loop()
    try:
        if target.scheme == "unix":
            await asyncio.wait_for(loop.create_unix_connection(lambda: conn, target.path), timeout)
        else:
            await asyncio.wait_for(loop.create_connection(lambda: conn, target.host, target.port), timeout)
    except (TimeoutError, OSError):
        if conn.transport is not None:
            conn.transport.abort()
        return False
    return conn.open
