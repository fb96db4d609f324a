"""The NDJSON front-end (broker/frontend/stream.py) end to end: a real broker, real sockets.

Every test talks to a real `rpc-broker serve` child process over loopback TCP
(`--stream-port`) or a Unix socket (`--stream-socket`, under pytest's tmp dir): one
JSON-RPC body per line in, one answer per line out, answers as soon as ready (clients
match ids). Most tests share one broker per module and leave it as they found it;
tests that need other flags or stop the broker start their own. Every wait is bounded.

Where a test proves that nothing more was answered, it sends a sentinel call after
the lines under test and checks that the sentinel's answer is the next line.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import select
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import (
    ROOT,
    Broker,
    Samples,
    free_port,
    listen_port,
    sample,
    scrape_metrics,
    start_broker,
    wait_for,
)

pytestmark = pytest.mark.usefixtures("event_loop_name")  # (on both event loops: conftest.BOTH_LOOPS)

MAX_BODY = 2000  # --max-body-bytes of the shared broker
PARSE_ERROR = b'{"jsonrpc":"2.0","id":null,"error":{"code":-32700,"message":"Parse error"}}'
INVALID_NULL = b'{"jsonrpc":"2.0","id":null,"error":{"code":-32600,"message":"Invalid Request"}}'  # (`[]`: spec example)


def invalid(id_: bytes, why: bytes) -> bytes:
    """A -32600 line whose `data` says which member is wrong (new user, round 100)."""
    return b'{"jsonrpc":"2.0","id":%b,"error":{"code":-32600,"message":"Invalid Request","data":"%b"}}' % (id_, why)


NO_JSONRPC = invalid(b"null", b'member \\"jsonrpc\\" missing: it must be \\"2.0\\"')
NOT_AN_OBJECT = invalid(b"null", b"a Request object is a JSON object (a batch: an array of them)")
TOO_LONG = (
    b'{"jsonrpc":"2.0","id":null,"error":{"code":-32600,"message":"Invalid Request",'
    b'"data":"line exceeds max_body_bytes 2000"}}'
)  # the one answer to a line past --max-body-bytes 2000
TRANSPORTS = ("tcp", "unix")

# -- helpers ------------------------------------------------------------------------------


def socket_path(directory: Path, name: str = "broker.sock") -> str:
    path = str(directory / name)
    assert len(path) <= 100, path  # the setting's limit (sun_path is 108 bytes)
    return path


def line(method: str, params: object = None, id_: object = None) -> bytes:
    """One request (a notification when `id_` is None) as compact JSON, no newline."""
    r: dict[str, object] = {"jsonrpc": "2.0", "method": method}
    if params is not None:
        r["params"] = params
    if id_ is not None:
        r["id"] = id_
    return json.dumps(r, separators=(",", ":")).encode()


def result(id_: str | int, value: str | int | float) -> bytes:
    """The exact answer line (no newline) the broker writes for a result."""
    return b'{"jsonrpc":"2.0","id":%s,"result":%s}' % (json.dumps(id_).encode(), json.dumps(value).encode())


class Closed(AssertionError):
    """The broker closed (or reset) the connection while the test expected data."""


class Stream:
    """A blocking NDJSON client on one connected socket; every read has a deadline."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray()
        self.sentinels = 0

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.sock.close()

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def readline(self, timeout: float = 10.0) -> bytes:
        """The next answer line, without its newline; Closed on EOF/reset, AssertionError on timeout."""
        deadline = time.monotonic() + timeout
        while True:
            nl = self.buf.find(b"\n")
            if nl >= 0:
                out = bytes(self.buf[:nl])
                del self.buf[: nl + 1]
                return out
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no answer line within {timeout} s (have {bytes(self.buf[:200])!r})")
            self.sock.settimeout(left)
            try:
                chunk = self.sock.recv(65536)
            except TimeoutError:
                continue
            except ConnectionResetError as exc:
                raise Closed(f"connection reset: {exc}") from None
            if not chunk:
                raise Closed(f"connection closed by the broker (pending {bytes(self.buf[:200])!r})")
            self.buf += chunk

    def lines(self, n: int, timeout: float = 10.0) -> list[bytes]:
        deadline = time.monotonic() + timeout
        return [self.readline(max(0.01, deadline - time.monotonic())) for _ in range(n)]

    def call(self, data: bytes, timeout: float = 10.0) -> bytes:
        self.send(data + b"\n")
        return self.readline(timeout)

    def assert_nothing_more(self) -> None:
        """No answer is pending: a fresh call's answer is the very next line."""
        self.sentinels += 1
        id_ = f"sentinel-{self.sentinels}"
        assert self.call(line("add", [self.sentinels, 1], id_)) == result(id_, self.sentinels + 1)
        assert not self.buf

    def closed_within(self, timeout: float) -> float:
        """Seconds until the broker closes the connection (EOF or reset); fails after `timeout`.
        Fails too if any data arrives."""
        start = time.monotonic()
        deadline = start + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"connection still open after {timeout} s")
            self.sock.settimeout(left)
            try:
                chunk = self.sock.recv(65536)
            except TimeoutError:
                continue
            except ConnectionResetError:
                return time.monotonic() - start
            if not chunk:
                return time.monotonic() - start
            raise AssertionError(f"unexpected data before close: {chunk[:200]!r}")

    def assert_open_and_silent(self, seconds: float) -> None:
        """Nothing arrives and the connection is not closed for `seconds`."""
        readable, _, _ = select.select([self.sock], [], [], seconds)
        assert not readable, "the broker wrote or closed while the connection should stay open and silent"


def connect(where: str | int, timeout: float = 10.0) -> Stream:
    """A Stream on tcp://127.0.0.1:`where` (an int) or unix://`where` (a path)."""
    if isinstance(where, int):
        sock = socket.create_connection(("127.0.0.1", where), timeout=timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    else:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect(where)
        except OSError:
            sock.close()
            raise
    return Stream(sock)


def scrape(b: Broker, port: int | None = None) -> Samples:
    return scrape_metrics(b, port)


metric = sample


def delta(before: Samples, after: Samples, name: str, transport: str) -> float:
    return metric(after, name, transport=transport) - metric(before, name, transport=transport)


def open_streams(b: Broker, transport: str, port: int | None = None) -> float:
    """rpc_broker_connections{transport} as GET /metrics says now."""
    return metric(scrape(b, port), "rpc_broker_connections", transport=transport)


@dataclass
class StreamBroker:
    broker: Broker
    tcp_port: int
    unix_path: str

    def where(self, transport: str) -> str | int:
        return self.tcp_port if transport == "tcp" else self.unix_path

    def connect(self, transport: str) -> Stream:
        return connect(self.where(transport))


def start_stream_broker(directory: Path, *flags: str) -> StreamBroker:
    port = free_port()
    path = socket_path(directory)
    b = start_broker("--stream-port", str(port), "--stream-socket", path, *flags)
    # The NDJSON lines are printed right after the HTTP one.
    wait_for(lambda: "unix://" in b.read_log(0.05), timeout=10)
    return StreamBroker(b, port, path)


@pytest.fixture(scope="module")
def sb(event_loop_name: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[StreamBroker]:
    """The shared broker: 2 workers, NDJSON on TCP and on a Unix socket, 2000-byte lines."""
    s = start_stream_broker(
        tmp_path_factory.mktemp("stream"), "--workers", "2", "--max-body-bytes", str(MAX_BODY)
    )
    yield s
    status = s.broker.stop()
    assert status == 0, s.broker.read_log()


@pytest.fixture(scope="module")
def kb(event_loop_name: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[StreamBroker]:
    """A broker with `--keepalive-timeout 1` (room for 2000 concurrent sleeps)."""
    s = start_stream_broker(
        tmp_path_factory.mktemp("keepalive"), "--workers", "2", "--keepalive-timeout", "1",
        "--worker-concurrency", "1000",
    )  # fmt: skip
    yield s
    status = s.broker.stop()
    assert status == 0, s.broker.read_log()


# -- startup -----------------------------------------------------------------------------


def test_startup_announces_both_listeners(sb):
    log = sb.broker.read_log()
    assert f"rpc-broker: serving NDJSON JSON-RPC on tcp://127.0.0.1:{sb.tcp_port}\n" in log
    assert f"rpc-broker: serving NDJSON JSON-RPC on unix://{sb.unix_path}\n" in log


def test_unix_socket_is_mode_0600(sb):
    st = os.stat(sb.unix_path)
    assert stat.S_ISSOCK(st.st_mode)
    assert stat.S_IMODE(st.st_mode) == 0o600


# -- one line, one body --------------------------------------------------------------------


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_single_call_named_and_positional(sb, transport):
    with sb.connect(transport) as s:
        assert s.call(line("subtract", [42, 23], 1)) == result(1, 19)
        assert s.call(line("subtract", {"subtrahend": 23, "minuend": 42}, "two")) == result("two", 19)
        # ids and params are echoed byte for byte
        assert s.call(b'{"jsonrpc":"2.0","method":"echo","params":[1.50],"id":1.5e3}') == (
            b'{"jsonrpc":"2.0","id":1.5e3,"result":[1.50]}'
        )
        s.assert_nothing_more()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_batch_is_one_line_answered_by_one_array_line(sb, transport):
    batch = b"[%s]" % b",".join([
        line("sleep", [0.3], "slow"),
        line("add", [1, 2], "fast"),
        line("notify_hello", [7]),
        b'{"foo":"boo"}',
        line("foo.get", None, "5"),
    ])  # fmt: skip
    with sb.connect(transport) as s:
        assert s.call(batch) == (
            b'[{"jsonrpc":"2.0","id":"slow","result":0.3},{"jsonrpc":"2.0","id":"fast","result":3},'
            + NO_JSONRPC
            + b',{"jsonrpc":"2.0","id":"5","error":{"code":-32601,"message":"Method not found"}}]'
        )
        s.assert_nothing_more()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_notification_only_lines_get_no_answer(sb, transport):
    notes = line("update", [1, 2, 3]) + b"\n" + b"[%s,%s]\n" % (line("notify_hello", [7]), line("update"))
    with sb.connect(transport) as s:
        s.send(notes)
        s.assert_nothing_more()  # the sentinel's answer is the first line of all
        s.assert_open_and_silent(0.2)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_blank_lines_and_crlf_endings(sb, transport):
    data = (
        b"\n\n   \n\t\r\n"
        + line("add", [1, 1], "crlf")
        + b"\r\n\r\n\n"
        + line("add", [2, 2], "lf")
        + b"\n  \r\n"
    )
    with sb.connect(transport) as s:
        s.send(data)
        assert sorted(s.lines(2)) == sorted([result("crlf", 2), result("lf", 4)])
        s.assert_nothing_more()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_bad_lines_are_answered_and_the_connection_keeps_working(sb, transport):
    with sb.connect(transport) as s:
        assert s.call(b'{"jsonrpc":"2.0","method":"subtract","params":[42,23') == PARSE_ERROR
        assert s.call(line("add", [1, 2], 1)) == result(1, 3)
        assert s.call(b"not json at all") == PARSE_ERROR
        assert s.call(b'{"jsonrpc":"2.0","method":1,"params":"bar","id":3}') == (
            invalid(b"3", b'member \\"method\\" must be a string')
        )
        assert s.call(b'{"foo":"boo"}') == NO_JSONRPC
        assert s.call(b"[]") == INVALID_NULL
        assert s.call(b"[1]") == b"[" + NOT_AN_OBJECT + b"]"
        assert s.call(line("Subtract", [42, 23], 4)) == (
            b'{"jsonrpc":"2.0","id":4,"error":{"code":-32601,"message":"Method not found"}}'
        )
        # invalid UTF-8 inside a string: not JSON text (RFC 8259 section 8.1)
        assert s.call(b'{"jsonrpc":"2.0","method":"echo","params":["\xff\xfe"],"id":5}') == PARSE_ERROR
        assert s.call(line("add", [2, 3], 6)) == result(6, 5)
        # a byte order mark before a JSON text (RFC 8259 section 8.1: never sent), in one
        # write or split: a bad line, as over HTTP, not another protocol (hostile testing,
        # rounds 64 and 66: the connection closed)
        assert s.call(b"\xef\xbb\xbf" + line("add", [2, 3], 7)) == PARSE_ERROR
        s.send(b"\xef")
        time.sleep(0.05)
        assert s.call(b"\xbb\xbf" + line("add", [2, 3], 8)) == PARSE_ERROR
        assert s.call(line("add", [3, 3], 9)) == result(9, 6)
        s.assert_nothing_more()
        # A line starting with a byte no JSON text starts with (a control byte, or not
        # ASCII, as `\xc3\x28` is) is another protocol: -32700 saying so, then the close
        # (see test_cross_site's TLS ClientHello)
        answer = json.loads(s.call(b"\xc3\x28"))
        assert (answer["id"], answer["error"]["code"]) == (None, -32700)
        assert "not JSON text" in answer["error"]["data"]
        s.closed_within(5)
    # ... and so is a line begun as a BOM might be, then not one (hostile testing, round 70:
    # `\xef` alone, then `\x16\x03\x01`, was answered and the connection kept)
    with sb.connect(transport) as s:
        s.send(b"\xef")
        time.sleep(0.05)
        answer = json.loads(s.call(b"\x16\x03\x01"))
        assert (answer["id"], answer["error"]["code"]) == (None, -32700)
        assert "not JSON text" in answer["error"]["data"]
        s.closed_within(5)


def test_notifications_past_the_parser_limit_get_no_answer_line(tmp_path):
    """Hostile testing (F6): a valid notification whose params nest past the parser's
    limit was answered with an id-null -32600 line, which a client cannot tell from the
    answer to a call it could not read (the bundled bench pinned it on its oldest call
    in flight). It is a notification: no line, alone or in a batch; counted as dropped."""
    sbd = start_stream_broker(tmp_path, "--workers", "1")
    try:
        deep = b"[" * 1200 + b"]" * 1200
        note = b'{"jsonrpc":"2.0","method":"update","params":' + deep + b"}"
        other = b'{"jsonrpc":"2.0","method":"update","x":{"y":' + deep + b"}}"  # no id member, nor params
        for transport in TRANSPORTS:
            with sbd.connect(transport) as s:
                s.send(note + b"\n" + other + b"\n" + b"[%s,%s]\n" % (note, other))
                assert s.call(b"[%s,%s,%s]" % (note, line("add", [1, 2], 7), other)) == b"[" + result(7, 3) + b"]"
                s.assert_nothing_more()  # (the sentinel's answer is the next line: none came between)
        samples = scrape(sbd.broker)
        assert metric(samples, "rpc_broker_notifications_dropped_total", reason="invalid_request") == 2 * 6
    finally:
        assert sbd.broker.stop() == 0


# -- answers as soon as ready ---------------------------------------------------------------


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_fast_answer_overtakes_slow_one_on_the_same_connection(sb, transport):
    with sb.connect(transport) as s:
        s.send(line("sleep", [1.0], "slow") + b"\n" + line("add", [1, 2], "fast") + b"\n")
        assert s.readline() == result("fast", 3)  # not held back behind the sleep sent before it
        assert s.readline() == result("slow", 1.0)
        s.assert_nothing_more()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_5000_pipelined_calls_each_answered_once(sb, transport):
    n = 5000
    data = b"".join(line("add", [i, i], i) + b"\n" for i in range(n))
    got: list[bytes] = []
    failure: list[BaseException] = []
    with sb.connect(transport) as s:

        def reader() -> None:
            try:
                got.extend(s.lines(n, timeout=45))
            except BaseException as exc:
                failure.append(exc)

        t = threading.Thread(target=reader, daemon=True)
        t.start()
        s.sock.settimeout(45)
        s.send(data)  # everything before reading anything (the reader runs alongside)
        t.join(50)
        assert not t.is_alive(), "reader still waiting"
        assert not failure, failure
        answers = [json.loads(g) for g in got]
        ids = Counter(a["id"] for a in answers)
        assert set(ids) == set(range(n))
        assert max(ids.values()) == 1
        assert all(a == {"jsonrpc": "2.0", "id": a["id"], "result": 2 * a["id"]} for a in answers)
        s.assert_nothing_more()


# -- the line length limit ----------------------------------------------------------------


def echo_line(length: int, id_: int = 1) -> bytes:
    """An `echo` call exactly `length` bytes long (no newline)."""
    head = b'{"jsonrpc":"2.0","method":"echo","params":["'
    tail = b'"],"id":%d}' % id_
    out = head + b"x" * (length - len(head) - len(tail)) + tail
    assert len(out) == length
    return out


def send_in_pieces(s: Stream, data: bytes, cuts: list[int], pause: float = 0.002) -> None:
    """Send `data` cut at the given offsets, pausing between sends so they arrive apart."""
    last = 0
    for cut in [*cuts, len(data)]:
        if cut > last:
            s.send(data[last:cut])
            time.sleep(pause)
        last = cut


SPLITS = {
    "one_send": lambda n: [],
    "newline_alone": lambda n: [n],
    "halves": lambda n: [n // 2],
    "1500_then_rest": lambda n: [1500],
    "trickle_100_bytes": lambda n: list(range(100, n + 1, 100)),
}


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("split", list(SPLITS))
def test_line_longer_than_max_body_bytes_gets_one_error_then_next_line_is_served(sb, transport, split):
    long = echo_line(3 * MAX_BODY, id_=99) + b"\n"
    following = line("add", [40, 2], "after")
    with sb.connect(transport) as s:
        send_in_pieces(s, long, SPLITS[split](len(long) - 1))
        s.send(following + b"\n")
        assert s.lines(2) == [TOO_LONG, result("after", 42)]
        s.assert_nothing_more()


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("split", ["one_send", "newline_alone", "halves"])
@pytest.mark.parametrize("ending", [b"\n", b"\r\n"])
def test_line_of_exactly_max_body_bytes_is_served_one_more_is_refused(sb, transport, split, ending):
    # The limit is on the body: a "\r" before the newline is the line's ending, not the body's.
    with sb.connect(transport) as s:
        ok = echo_line(MAX_BODY, id_=1) + ending
        send_in_pieces(s, ok, SPLITS[split](len(ok) - 1))
        pad = ok.count(b"x")
        assert s.readline() == b'{"jsonrpc":"2.0","id":1,"result":["%s"]}' % (b"x" * pad)
        over = echo_line(MAX_BODY + 1, id_=2) + ending
        send_in_pieces(s, over, SPLITS[split](len(over) - 1))
        assert s.readline() == TOO_LONG
        s.assert_nothing_more()


# -- keepalive_timeout ---------------------------------------------------------------------


UNFINISHED = {"jsonrpc": "2.0", "id": None, "error": {
    "code": -32600, "message": "Invalid Request", "data": "line unfinished after keepalive_timeout 1 s"}}


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_partial_line_that_never_completes_closes_the_connection(kb, transport):
    with kb.connect(transport) as s:
        assert s.call(line("add", [1, 2], 1)) == result(1, 3)
        started = time.monotonic()
        s.send(b'{"jsonrpc":"2.0","method":"add",')  # ... and nothing more
        assert json.loads(s.readline(6.0)) == UNFINISHED  # keepalive 1 s, swept every second
        assert time.monotonic() - started >= 0.9
        s.closed_within(2.0)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_line_left_unfinished_closes_the_connection_after_the_answers_owed(kb, transport):
    """Hostile testing (round 21): a call's line, then a line never finished: at
    keepalive_timeout the connection was closed at once, and the call, which ran, was
    never answered. It is answered first now (as HTTP answers 408 after what it owes),
    the unfinished line with -32600; what comes after it is discarded."""
    with kb.connect(transport) as s:
        s.send(line("sleep", [2.5], "owed") + b"\n" + b'{"jsonrpc":"2.0","method":"add",')
        assert json.loads(s.readline(6.0)) == UNFINISHED
        s.send(b'"params":[1,2],"id":"after"}\n' + line("add", [1, 2], "later") + b"\n")  # (discarded)
        assert s.readline(6.0) == result("owed", 2.5)
        s.closed_within(2.0)


# TCP only: a reset is TCP's. On a Unix socket, whose buffers hold ~200 kB, the client's own
# sends block behind its unread answers (the broker's reading paused): the test hung there.
@pytest.mark.parametrize("refused", ["unfinished", "http"])
@pytest.mark.parametrize("transport", ["tcp"])
def test_a_refused_line_loses_no_answer_owed_to_a_client_still_sending(kb, transport, refused):
    """Hostile testing (round 22): after a refused line (one left unfinished, an HTTP
    request line) the connection closed once the lines before it were answered, but
    fully: the client, still sending (trickling its line, or its request's headers),
    got a reset for its next bytes, which dropped the answers its kernel had not
    delivered yet (24 kB of 800 kB). It half-closes now and discards what comes, as
    HTTP's lingering close does: the client reads every answer, then the end."""
    big = "x" * 400_000
    with kb.connect(transport) as s:
        s.send(line("echo", [big], "a") + b"\n" + line("echo", [big], "b") + b"\n")
        if refused == "http":
            s.send(b"POST / HTTP/1.1\r\n")
        trickle = b'{"jsonrpc":"2.0","method":"add","params":[1,2],"id":"trickled"' if refused == "unfinished" else (
            b"Host: 127.0.0.1\r\nX-Pad: " + b"y" * 60)
        for byte in trickle[:15]:  # 3 s, past keepalive 1 s and a sweep, still sending (answers unread)
            s.send(bytes([byte]))
            time.sleep(0.2)
        answers = [json.loads(a) for a in s.lines(3, timeout=20)]
        s.closed_within(5.0)
    assert sorted(a["result"][0] == big for a in answers if "result" in a) == [True, True]
    [error] = [a for a in answers if "error" in a]
    assert error["id"] is None and error["error"]["code"] == -32600, error


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_idle_connections_outlive_keepalive_timeout(kb, transport):
    with kb.connect(transport) as silent, kb.connect(transport) as used, kb.connect(transport) as owed:
        assert used.call(line("add", [1, 2], 1)) == result(1, 3)
        owed.send(line("sleep", [2.5], "long") + b"\n")  # owed an answer past the timeout
        used.assert_open_and_silent(2.6)  # > keepalive 1 s + the 1 s sweep period
        silent.assert_open_and_silent(0.0)
        assert owed.readline() == result("long", 2.5)
        for s in (silent, used, owed):
            s.assert_nothing_more()


# -- max_connections -----------------------------------------------------------------------


def test_max_connections_closes_extra_stream_connections_and_counts_them(tmp_path):
    mport = free_port()
    sb = start_stream_broker(
        tmp_path, "--workers", "1", "--max-connections", "2", "--metrics-port", str(mport)
    )
    try:
        for transport in TRANSPORTS:
            before = scrape(sb.broker, mport)
            with sb.connect(transport) as a, sb.connect(transport) as b:
                assert a.call(line("add", [1, 1], "a")) == result("a", 2)
                assert b.call(line("add", [2, 2], "b")) == result("b", 4)
                # Neither can give its place (a call in flight on each, owed its answer).
                a.send(line("sleep", [0.5], "h0") + b"\n")
                b.send(line("sleep", [0.5], "h1") + b"\n")
                time.sleep(0.1)
                with sb.connect(transport) as third:
                    assert json.loads(third.readline()) == {
                        "jsonrpc": "2.0", "id": None,
                        "error": {"code": -32000, "message": "Server overloaded", "data": "too many connections"},
                    }
                    assert third.closed_within(5.0) < 5.0
                assert (a.readline(), b.readline()) == (result("h0", 0.5), result("h1", 0.5))
                after = scrape(sb.broker, mport)
                refused = "rpc_broker_connections_refused_total"
                assert {t: delta(before, after, refused, t) for t in ("http", *TRANSPORTS)} == {
                    "http": 0, "tcp": 1 if transport == "tcp" else 0, "unix": 1 if transport == "unix" else 0,
                }  # fmt: skip
                assert metric(after, "rpc_broker_connections", transport=transport) == 2
                # the two admitted connections still work
                a.assert_nothing_more()
                b.assert_nothing_more()
                b.sock.close()
                wait_for(lambda t=transport: open_streams(sb.broker, t, mport) == 1)
                with sb.connect(transport) as again:  # a slot is free again
                    assert again.call(line("add", [3, 3], "c")) == result("c", 6)
            wait_for(lambda t=transport: open_streams(sb.broker, t, mport) == 0)
    finally:
        assert sb.broker.stop() == 0, sb.broker.read_log()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_idle_stream_connections_make_room_at_max_connections(tmp_path, transport):
    """As for HTTP (test_http_hardening.py): at max_connections the least recently active
    idle connection is closed for a new one. A connection that served a line is idle at
    once; one that never sent a byte only after a second (its first line may be coming).
    Before, two silent connections locked everyone out (the third got a reset)."""
    mport = free_port()
    sb = start_stream_broker(tmp_path, "--workers", "1", "--max-connections", "2", "--metrics-port", str(mport))
    refused = "rpc_broker_connections_refused_total"
    try:
        with sb.connect(transport) as a, sb.connect(transport) as b:
            assert a.call(line("add", [1, 1], "a")) == result("a", 2)
            time.sleep(0.005)  # apart in the loop's clock (uvloop's has 1 ms steps): a strict order
            assert b.call(line("add", [2, 2], "b")) == result("b", 4)  # b is the more recently active
            with sb.connect(transport) as c:
                assert c.call(line("add", [3, 3], "c")) == result("c", 6)
                assert a.closed_within(5.0) < 5.0  # the least recently active made room
                b.assert_nothing_more()
        wait_for(lambda: open_streams(sb.broker, transport, mport) == 0)
        with sb.connect(transport) as d:  # silent
            # (one scrape apart: the loop's clock ticks in ms, and ties have no order)
            wait_for(lambda: open_streams(sb.broker, transport, mport) == 1)
            e = sb.connect(transport)
            wait_for(lambda: open_streams(sb.broker, transport, mport) == 2)
            time.sleep(1.5)  # past SWEEP_SECONDS without a byte: they count as idle now
            with sb.connect(transport) as f:
                assert f.call(line("add", [4, 4], "f")) == result("f", 8)
                assert d.closed_within(5.0) < 5.0  # the older of the two silent ones
                with e:
                    e.assert_nothing_more()
        assert metric(scrape(sb.broker, mport), refused, transport=transport) == 0
    finally:
        assert sb.broker.stop() == 0, sb.broker.read_log()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_connections_sending_only_empty_lines_make_room(tmp_path, transport):
    """Hostile testing: an empty line counted as activity, though it is no line served, so
    connections sending one every 0.1 s were never idle and held every place: new clients
    got the -32000 "too many connections" line for as long as they kept at it."""
    sb = start_stream_broker(tmp_path, "--workers", "1", "--max-connections", "2")
    try:
        with sb.connect(transport) as a, sb.connect(transport) as b:
            for _ in range(15):  # 1.5 s: past SWEEP_SECONDS, the age of a silent idle one
                a.send(b"\n")
                b.send(b"  \r\n")
                time.sleep(0.1)
            with sb.connect(transport) as c:
                assert c.call(line("add", [3, 3], "c")) == result("c", 6)
            # one of them made room (they are of an age, within the loop clock's 1 ms steps)
            closed = []
            for conn in (a, b):
                try:
                    closed.append(conn.closed_within(2.5) < 2.5)
                except AssertionError:  # still open
                    closed.append(False)
            assert closed.count(True) == 1, closed
    finally:
        assert sb.broker.stop() == 0, sb.broker.read_log()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_lines_left_unfinished_at_the_limit_make_room_slowest_first(tmp_path, transport):
    """Hostile testing, round 76: a connection with a line under way was never closed to
    make room, so one client holding every place with a line it never finished shut every
    other client out ("too many connections") for keepalive_timeout, 75 s. At the limit,
    a connection with a line under way gives its place, the one whose line comes slowest
    first (round 78: the longest open went first, an honest long-lived connection whose
    line came in two writes), answered -32600 saying why; the newcomer is served."""
    sb = start_stream_broker(tmp_path, "--workers", "1", "--max-connections", "2")
    try:
        with sb.connect(transport) as b:
            time.sleep(0.01)  # (apart in the loop's clock, 1 ms steps: b is the longest open)
            a = sb.connect(transport)
            a.send(b'{"jsonrpc":')
            time.sleep(0.3)  # a: about 40 bytes a second
            b.send(b'{"jsonrpc":"2.0","method":"add",')  # b: its line's first piece, just now
            time.sleep(0.02)
            with sb.connect(transport) as c:
                assert c.call(line("add", [3, 3], "c")) == result("c", 6)
            evicted = json.loads(a.readline(5))
            assert evicted["id"] is None and evicted["error"]["code"] == -32600, evicted
            assert evicted["error"]["data"].startswith("line still arriving after "), evicted
            assert evicted["error"]["data"].endswith(" s while the broker is at max_connections"), evicted
            assert a.closed_within(5) < 5
            b.send(b'"params":[1,1],"id":"b"}\n')  # the longest open, faster, kept its place
            assert b.readline(5) == result("b", 2)
            a.sock.close()
    finally:
        assert sb.broker.stop() == 0, sb.broker.read_log()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_large_lines_on_one_connection_are_all_answered(tmp_path, transport):
    """Reading pauses for a loop turn after TURN_BYTES (as for HTTP): nothing is lost."""
    sb2 = start_stream_broker(tmp_path, "--workers", "1")
    try:
        with sb2.connect(transport) as s:
            s.send(b"".join(b'{"jsonrpc":"2.0","method":"nope","params":["' + b"a" * 250_000 + b'"],"id":%d}\n' % i
                            for i in range(40)))
            got = [json.loads(answer)["id"] for answer in s.lines(40, timeout=60)]
            assert sorted(got) == list(range(40))
    finally:
        assert sb2.broker.stop() == 0, sb2.broker.read_log()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_runs_of_empty_lines_and_leading_white_space_are_skipped(sb, transport):
    """Empty lines, and white space before a line, are skipped in one step (they cost
    1 µs a byte, and a turn each, before): a megabyte of them, then calls whose lines
    start with white space or follow CRLF runs, all in few reads, are answered."""
    with sb.connect(transport) as s:
        s.send(b"\n" * (1 << 20) + b" \t\r\n" * 1000 + b"   " + line("add", [1, 2], 1) + b"\r\n"
               + b"\r\n\r\n\t" + line("add", [3, 4], 2) + b"\n   \n")
        assert sorted(s.lines(2)) == sorted([result(1, 3), result(2, 7)])
        s.send(b"  ")  # white space that ends a read, then a line in the next one
        time.sleep(0.05)
        s.send(line("add", [5, 6], 3) + b"\n")
        assert s.lines(1) == [result(3, 11)]
        s.assert_nothing_more()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_lines_before_an_http_request_line_are_answered_before_the_close(sb, transport):
    """A new user's check: the lines before an HTTP request line lost their answers (the
    connection was closed at once). They are answered now, with the error line for the
    HTTP line; what comes after it is never read, and the connection then closes."""
    with sb.connect(transport) as s:
        s.send(line("sleep", [0.3], 1) + b"\n" + line("add", [1, 2], 2) + b"\n"
               + b"POST / HTTP/1.1\r\n" + line("add", [5, 5], 3) + b"\n")
        got = sorted(s.lines(3))
        error = b'{"jsonrpc":"2.0","id":null,"error":{"code":-32600,"message":"Invalid Request",' \
                b'"data":"an HTTP request: this stream speaks newline-delimited JSON-RPC"}}'
        assert got == sorted([result(1, 0.3), result(2, 3), error])
        assert s.closed_within(5.0) < 5.0  # and id 3, after the HTTP line, was never run


def test_a_refused_stream_client_that_already_wrote_reads_the_error_not_a_reset(tmp_path):
    """At max_connections with no connection that can give its place (one owed an
    answer), a client whose line is already sent (as `socat` or `nc` send it) reads one
    -32000 "too many connections" line and an orderly close: its unread line must not
    turn the close into a reset."""
    sb = start_stream_broker(tmp_path, "--workers", "1", "--max-connections", "1")
    try:
        for transport in TRANSPORTS:
            with sb.connect(transport) as busy:
                busy.send(line("sleep", [2], 1) + b"\n")  # a call in flight: owed, not evictable
                time.sleep(0.1)
                for n in range(3):
                    sock = socket.create_connection(("127.0.0.1", sb.tcp_port)) if transport == "tcp" else None
                    if sock is None:
                        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                        sock.connect(sb.unix_path)
                    with Stream(sock) as late:
                        late.send(line("add", [n, 1], n) + b"\n")
                        answer = json.loads(late.readline())
                        assert answer["error"]["code"] == -32000 and answer["error"]["data"] == "too many connections"
                        with pytest.raises(Closed, match="closed by the broker"):
                            late.readline()
                assert busy.readline() == result(1, 2.0)
    finally:
        assert sb.broker.stop() == 0, sb.broker.read_log()


# -- metrics ---------------------------------------------------------------------------------


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_metrics_count_connections_and_bytes_by_transport(sb, transport):
    other = "unix" if transport == "tcp" else "tcp"
    names = ("rpc_broker_received_bytes_total", "rpc_broker_sent_bytes_total")
    wait_for(lambda: open_streams(sb.broker, "tcp") == open_streams(sb.broker, "unix") == 0)
    before = scrape(sb.broker)
    sent = line("add", [20, 22], "m") + b"\n" + b"garbage\n" + line("update", [1]) + b"\n"
    with sb.connect(transport) as s:
        wait_for(lambda: open_streams(sb.broker, transport) == 1)
        s.send(sent)
        answers = s.lines(2)
        assert sorted(answers) == sorted([result("m", 42), PARSE_ERROR])
        during = scrape(sb.broker)
        assert metric(during, "rpc_broker_connections", transport=transport) == 1
        assert metric(during, "rpc_broker_connections", transport=other) == 0
        # exact bytes: the three lines read, the two answer lines written (with their newlines)
        assert [delta(before, during, name, transport) for name in names] == [
            len(sent),
            sum(len(a) + 1 for a in answers),
        ]
        assert [delta(before, during, name, other) for name in names] == [0, 0]
    wait_for(lambda: open_streams(sb.broker, transport) == 0)


# -- the Unix socket file ---------------------------------------------------------------------


def run_to_exit(*flags: str, timeout: float = 60.0) -> tuple[int, str]:
    """Run `rpc-broker serve` expecting it to exit on its own; (status, stderr)."""
    argv = [sys.executable, "-m", "broker", "serve", "--host", "127.0.0.1", "--port", str(listen_port()), *flags]
    proc = subprocess.run(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        cwd=ROOT,
        timeout=timeout,
        check=False,
    )
    return proc.returncode, proc.stderr.decode(errors="replace")


def test_stale_socket_file_is_replaced_and_removed_after_sigterm(tmp_path):
    path = socket_path(tmp_path)
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(path)
    stale.close()  # the file stays, nobody listens: what a killed broker leaves behind
    assert stat.S_ISSOCK(os.stat(path).st_mode)
    b = start_broker("--workers", "1", "--stream-socket", path)
    try:
        wait_for(lambda: f"serving NDJSON JSON-RPC on unix://{path}" in b.read_log(0.05), timeout=10)
        st = os.stat(path)
        assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
        with connect(path) as s:
            assert s.call(line("add", [1, 2], 1)) == result(1, 3)
    finally:
        assert b.stop() == 0, b.read_log()
    assert not os.path.exists(path)


def test_second_broker_on_a_live_socket_fails_and_leaves_it_alone(tmp_path):
    path = socket_path(tmp_path)
    first = start_broker("--workers", "1", "--stream-socket", path)
    try:
        wait_for(lambda: f"unix://{path}" in first.read_log(0.05), timeout=10)
        inode = os.stat(path).st_ino
        status, log = run_to_exit("--workers", "1", "--stream-socket", path)
        assert status == 1, log
        assert f"{path} is in use" in log
        # (round 31, a new user: no next step was given)
        assert "another process listens there: stop it, or choose another with --stream-socket" in log
        assert "serving NDJSON" not in log
        assert "worker 0 ready" not in log  # checked before the workers start: it fails at once
        assert os.stat(path).st_ino == inode  # the first broker's socket, untouched
        with connect(path) as s:
            assert s.call(line("add", [2, 3], 1)) == result(1, 5)
    finally:
        assert first.stop() == 0, first.read_log()
    assert not os.path.exists(path)


def test_a_listener_with_a_full_queue_is_in_use_and_the_start_fails_at_once(tmp_path):
    """Hostile testing (round 32): the probe of an existing socket connected blocking; on a
    listener whose queue was full (`listen(0)`, never accepting, a connection waiting) it
    blocked the loop's thread: the broker hung at start, logged nothing and ignored
    SIGTERM. The probe does not block now: a full queue is a listener, exit 1 at once."""
    path = socket_path(tmp_path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    queued: list[socket.socket] = []
    try:
        listener.bind(path)
        listener.listen(0)
        for _ in range(16):  # (Linux queues one connection past a backlog of 0)
            client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            client.setblocking(False)
            queued.append(client)
            code = client.connect_ex(path)
            if code != 0:
                assert code == errno.EAGAIN, os.strerror(code)  # full: a blocking connect waits
                break
        else:
            pytest.fail("the listen queue never filled")
        inode = os.stat(path).st_ino
        t0 = time.monotonic()
        status, log = run_to_exit("--workers", "1", "--stream-socket", path, timeout=30)
        assert status == 1, log
        assert time.monotonic() - t0 < 20, log
        assert f"{path} is in use" in log, log
        assert "another process listens there: stop it, or choose another with --stream-socket" in log
        assert "worker 0 ready" not in log  # checked before the workers start
        assert os.stat(path).st_ino == inode  # the listener's socket, untouched
    finally:
        for client in queued:
            client.close()
        listener.close()


@pytest.mark.parametrize("target", ["dangling", "stale socket", "file"])
def test_a_symbolic_link_at_the_socket_path_is_refused_at_once(tmp_path, target):
    """Hostile testing (round 32): a dangling symbolic link at --stream-socket passed the
    check (`os.path.exists` follows it), the workers started, then the bind failed with
    EADDRINUSE and "another process listens there: stop it", which nobody did. A link is
    refused before the workers start, saying so, and left as it is (and what it names)."""
    path = socket_path(tmp_path)
    where = str(tmp_path / "elsewhere")
    if target == "stale socket":
        stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        stale.bind(where)
        stale.close()
    elif target == "file":
        Path(where).write_text("precious")
    os.symlink(where, path)
    status, log = run_to_exit("--workers", "1", "--stream-socket", path, timeout=30)
    assert status == 1, log
    assert f"{path} is a symbolic link: not replaced; give the socket's own path" in log, log
    assert "another process listens there" not in log
    assert "worker 0 ready" not in log  # checked before the workers start: it fails at once
    assert os.readlink(path) == where
    assert os.path.lexists(where) == (target != "dangling")
    if target == "file":
        assert Path(where).read_text() == "precious"


def test_a_relative_socket_path_is_shown_absolute(tmp_path):
    """Hostile testing (round 31, a new user): a relative --stream-socket was shown in the
    banner as `unix://relative`, which reads as a host named so. It is shown absolute."""
    path = socket_path(tmp_path)
    relative = os.path.relpath(path, ROOT)  # (the broker runs in ROOT)
    assert not relative.startswith("/")
    b = start_broker("--workers", "1", "--stream-socket", relative)
    try:
        wait_for(lambda: "serving NDJSON" in b.read_log(0.05), timeout=10)
        assert f"serving NDJSON JSON-RPC on unix://{os.path.realpath(path)}\n" in b.read_log() or (
            f"serving NDJSON JSON-RPC on unix://{os.path.abspath(path)}\n" in b.read_log()), b.read_log()
        with connect(path) as s:
            assert s.call(line("add", [1, 2], 1)) == result(1, 3)
    finally:
        assert b.stop() == 0, b.read_log()


@pytest.mark.parametrize(("name", "says"), [
    ("missing/broker.sock", "does not exist or is not a directory"),
    ("file/broker.sock", "does not exist or is not a directory"),
    ("dir/", "names a directory, not a socket file"),
])
def test_a_socket_path_that_cannot_be_bound_fails_before_the_workers_start(tmp_path, name, says):
    """Hostile testing (round 33): a socket path in a missing directory, under a file, or
    ending in `/` passed the start-up check and failed only at the bind, once every worker
    had imported the app. It fails at once now, exit 1, saying why."""
    (tmp_path / "file").write_text("x")
    (tmp_path / "dir").mkdir()
    status, log = run_to_exit("--workers", "1", "--stream-socket", str(tmp_path / name) + ("/" if name.endswith("/") else ""))
    assert status == 1, log
    assert says in log, log
    assert "worker 0 ready" not in log


def test_path_that_is_not_a_socket_is_refused_and_kept(tmp_path):
    path = socket_path(tmp_path)
    Path(path).write_text("precious")
    status, log = run_to_exit("--workers", "1", "--stream-socket", path)
    assert status == 1, log
    assert "is not a socket" in log
    assert Path(path).read_text() == "precious"


# -- SIGTERM ------------------------------------------------------------------------------------


def test_sigterm_answers_calls_in_flight_then_closes_streams_and_exits_0(tmp_path):
    sb = start_stream_broker(tmp_path, "--workers", "1")
    streams = {t: sb.connect(t) for t in TRANSPORTS}
    idle = sb.connect("tcp")
    try:
        for t, s in streams.items():
            assert s.call(line("add", [1, 1], "warm")) == result("warm", 2)
            s.send(line("sleep", [1.0], f"in-flight-{t}") + b"\n")
        wait_for(lambda: metric(scrape(sb.broker), "rpc_broker_calls_in_flight") == 2, timeout=10)
        sb.broker.proc.send_signal(signal.SIGTERM)
        for t, s in streams.items():
            assert s.readline(10) == result(f"in-flight-{t}", 1.0)
            s.closed_within(5.0)
        idle.closed_within(5.0)  # owed nothing: closed at once
        assert sb.broker.proc.wait(30) == 0, sb.broker.read_log()
        assert not os.path.exists(sb.unix_path)
    finally:
        for s in (*streams.values(), idle):
            s.sock.close()
        sb.broker.stop()


# -- bugs found by these tests, fixed -------------------------------------------------------------


def test_paused_reading_does_not_count_as_a_trickling_line(kb):
    # > PIPELINE_HIGH: reading pauses, and the rest of the read waits too (round 34), 65 calls
    # at a time: the last line, cut in two, completes some 8 s later (keepalive 1 s).
    n = 1100
    calls = b"".join(line("sleep", [0.5], i) + b"\n" for i in range(n))
    last = line("add", [1, 2], "last")
    with kb.connect("tcp") as s:
        s.send(calls + last[:20])
        time.sleep(0.2)
        s.send(last[20:] + b"\n")  # the line is complete 0.2 s later, well within keepalive 1 s
        answers = [json.loads(a) for a in s.lines(n + 1, timeout=20)]
        ids = Counter(a["id"] for a in answers)
        assert set(ids) == {*range(n), "last"} and max(ids.values()) == 1


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_half_closed_client_still_gets_its_answers(sb, transport):
    with sb.connect(transport) as s:
        s.send(line("sleep", [0.2], "slow") + b"\n" + line("add", [1, 2], "fast") + b"\n")
        s.sock.shutdown(socket.SHUT_WR)  # no more requests; answers still wanted
        assert sorted(s.lines(2)) == sorted([result("slow", 0.2), result("fast", 3)])
        s.closed_within(5.0)  # and then the broker closes its side


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_last_line_without_its_newline_ends_at_eof(sb, transport):
    """Hostile testing (round 8): `printf '%s' "$call" | nc -N` (no newline, then EOF)
    got no answer at all, and its bytes stayed counted in max_incoming_bytes until the
    connection closed. EOF ends the last line, as a file's last line ends; one cut
    short is not JSON: -32700."""
    with sb.connect(transport) as s:
        s.send(line("sleep", [0.2], "slow") + b"\n" + line("add", [1, 2], "last"))
        s.sock.shutdown(socket.SHUT_WR)
        assert sorted(s.lines(2)) == sorted([result("slow", 0.2), result("last", 3)])
        s.closed_within(5.0)
    with sb.connect(transport) as s:
        s.send(line("add", [1, 2], "cut")[:-5])
        s.sock.shutdown(socket.SHUT_WR)
        assert json.loads(s.readline(10))["error"]["code"] == -32700
        s.closed_within(5.0)


# -- found by a new user's check, fixed ------------------------------------------------------------


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_sigterm_delivers_every_owed_answer_to_a_client_still_writing(tmp_path, transport):
    # Closing a socket with unread bytes in it sends a reset, which destroys answers the
    # client has not read yet: the broker half-closes and drains instead.
    sb = start_stream_broker(tmp_path, "--workers", "2")
    s = sb.connect(transport)
    try:
        s.send(b"".join(line("sleep", [1.0], i) + b"\n" for i in range(20)))
        wait_for(lambda: metric(scrape(sb.broker), "rpc_broker_calls_in_flight") == 20, timeout=10)
        sb.broker.proc.send_signal(signal.SIGTERM)
        s.sock.setblocking(False)
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:  # keeps writing, reads nothing yet
            try:
                s.sock.send(line("add", [1, 1], "late") + b"\n")
            except (BlockingIOError, BrokenPipeError, ConnectionResetError):
                break
            time.sleep(0.01)
        s.sock.setblocking(True)
        s.sock.settimeout(10)
        data = b""
        while True:
            try:
                chunk = s.sock.recv(65536)
            except ConnectionResetError:  # would lose the answers: the bug
                break
            if not chunk:
                break
            data += chunk
        answers = [json.loads(x) for x in data.splitlines() if x]
        assert sorted(a["id"] for a in answers if a["id"] != "late") == list(range(20)), data[:300]
        assert sb.broker.proc.wait(30) == 0, sb.broker.read_log()
    finally:
        s.sock.close()
        sb.broker.stop()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_lines_sent_after_the_stop_on_a_connection_still_owed_answers_are_answered(tmp_path, transport):
    """Hostile testing, round 109 (MEDIUM): at SIGTERM a connection with calls in flight and
    nothing more received stopped reading; what its client sent while it waited for their
    answers was dropped, no answer at all (an HTTP connection serves requests pipelined
    behind one in flight). It reads on while it owes answers, within the grace period; it
    half-closes once it owes nothing, and what comes after is discarded unread."""
    sb = start_stream_broker(tmp_path, "--workers", "2", "--grace-period", "20")
    s = sb.connect(transport)
    try:
        s.send(b"".join(line("sleep", [1.0], i) + b"\n" for i in range(3)))
        wait_for(lambda: metric(scrape(sb.broker), "rpc_broker_calls_in_flight") == 3, timeout=10)
        sb.broker.proc.send_signal(signal.SIGTERM)
        wait_for(lambda: "stopping: no new connections" in sb.broker.read_log(), timeout=10)
        time.sleep(0.2)  # (the drain has looked at the connection: nothing more received)
        s.send(line("add", [1, 2], "late") + b"\n")
        s.send(line("sleep", [0.2], "later") + b"\n")
        answers = sorted(s.lines(5, timeout=10))
        assert answers == sorted([result(i, 1.0) for i in range(3)] + [result("late", 3), result("later", 0.2)])
        s.closed_within(5.0)  # (half-closed once it owed nothing)
        assert sb.broker.proc.wait(30) == 0, sb.broker.read_log()
    finally:
        s.sock.close()
        sb.broker.stop()


def test_a_broker_removes_only_its_own_socket_file(tmp_path):
    first = start_stream_broker(tmp_path, "--workers", "1")
    path = first.unix_path
    os.rename(path, path + ".moved")  # an operator moves it away ...
    second = start_stream_broker(tmp_path, "--workers", "1")  # ... and starts another on the path
    try:
        assert second.unix_path == path
        assert first.broker.stop() == 0
        assert os.path.exists(path), "the first broker removed the second one's socket"
        with second.connect("unix") as s:
            assert s.call(line("add", [1, 2], 1)) == result(1, 3)
    finally:
        first.broker.stop()
        second.broker.stop()


def test_a_refused_line_read_after_the_stop_does_not_hold_the_drain(tmp_path):
    """Hostile testing (round 23): at SIGTERM a connection reads what its client sent
    before the stop (bytes in the kernel) and the drain waits for that; among them an
    HTTP request line, refused: nothing after it is read, but the drain went on waiting
    for the rest, until the lingering close ended (30 s, the broker's stop with it). The
    refused line ends what the drain waits for there."""
    s_b = start_stream_broker(tmp_path, "--workers", "2", "--grace-period", "60")
    s = socket.create_connection(("127.0.0.1", s_b.tcp_port))
    try:
        for _ in range(300):  # (the broker's receive buffer grows: blank lines are read fast)
            s.sendall(b"\n" * 65536)
        time.sleep(0.5)
        s.sendall(b"".join(line("sleep", [1.5], i) + b"\n" for i in range(65)))  # reading pauses (64 owed)
        time.sleep(0.3)
        tail = b"".join(line("add", [1, 2], 100 + i) + b"\n" for i in range(4))
        tail += b"POST / HTTP/1.1\r\n" + b" " * 1_000_000 + b"\n"  # (in the kernel at the stop)
        def send_tail() -> None:
            with contextlib.suppress(OSError):
                s.sendall(tail)

        threading.Thread(target=send_tail, daemon=True).start()
        time.sleep(0.5)
        started = time.monotonic()
        s_b.broker.proc.send_signal(signal.SIGTERM)
        got = b""
        s.settimeout(0.5)
        while time.monotonic() - started < 40 and s_b.broker.proc.poll() is None:
            try:
                chunk = s.recv(65536)
                got += chunk
            except TimeoutError:
                chunk = b"."
            except OSError:
                break
            if not chunk:  # (the end: answered; it keeps its socket open, and sends now and then)
                time.sleep(0.5)
            if not chunk or chunk == b".":
                with contextlib.suppress(OSError):
                    s.send(b" ")
        assert s_b.broker.proc.wait(40) == 0
        assert time.monotonic() - started < 15  # (the calls take 1.5 s; it waited 30 s for the linger)
        assert got.count(b'"result"') == 65 + 4 and b"an HTTP request" in got, got[-300:]
    finally:
        s.close()
        s_b.broker.stop()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_refused_line_behind_slow_answers_reads_on(tmp_path, transport):
    """Hostile testing (round 24): a large answer, a slow call, then a refused line (an
    HTTP request line) whose client goes on sending before it reads: reading stayed
    paused while answers were owed, the client read nothing, and send_timeout cut the
    first answer and lost the second. Its input is discarded from the refusal on: reading
    goes on, and every answer arrives, then the end."""
    s_b = start_stream_broker(tmp_path, "--workers", "2", "--app", "tests.apps.ledger:registry",
                              "--send-timeout", "4", "--method-timeout", "hold=60")
    try:
        with s_b.connect(transport) as s:
            s.send(line("big", [8_000_000], 1) + b"\n" + line("hold", [6.0], 2) + b"\n" + b"POST / HTTP/1.1\r\n")
            time.sleep(1.0)
            s.sock.settimeout(40)
            for _ in range(300):  # 19 MB more, all of it before reading
                s.sock.sendall(b"y" * 65536)
            answers = [json.loads(a) for a in s.lines(3, timeout=40)]
            s.closed_within(10.0)
        assert sorted(str(a["id"]) for a in answers) == ["1", "2", "None"]
        assert {a["id"]: a.get("result") for a in answers if a["id"]} == {1: "x" * 8_000_000, 2: 6.0}
    finally:
        s_b.broker.stop()


def test_a_client_that_reads_at_once_keeps_its_calls_concurrent_past_a_full_buffer(tmp_path):
    """Hostile testing (round 26): answers larger than a Unix socket's buffer (about
    208 KiB) fill the write buffer for a moment even when the client reads at once; any
    answer written meanwhile made the connection go one call at a time for as long as it
    kept sending (40 pipelined lines: 3.9 s on the Unix socket, 0.42 s on TCP). Only a
    client whose unread answers reach a quarter of max_response_bytes fell behind. Here
    10 sleeps of 0.5 s, between 300 kB answers, overlap on both transports (one after
    another they take 5 s)."""
    s = start_stream_broker(tmp_path, "--workers", "2")
    try:
        lines = b""
        for i in range(10):
            lines += line("echo", ["e" * 300_000], f"e{i}") + b"\n" + line("sleep", [0.5], f"s{i}") + b"\n"
        for transport in TRANSPORTS:
            where = s.where(transport)
            if isinstance(where, int):
                sock = socket.create_connection(("127.0.0.1", where))
            else:
                sock = socket.socket(socket.AF_UNIX)
                sock.connect(where)
            with sock:
                sock.setblocking(False)
                sent, buf, started = 0, bytearray(), time.monotonic()
                while buf.count(b"\n") < 20 and time.monotonic() - started < 30:
                    if sent < len(lines):
                        with contextlib.suppress(BlockingIOError):
                            sent += sock.send(lines[sent:sent + 65536])
                    try:
                        chunk = sock.recv(1 << 20)
                    except BlockingIOError:
                        time.sleep(0.0005)
                        continue
                    assert chunk, transport
                    buf += chunk
                took = time.monotonic() - started
            ids = sorted(json.loads(answer)["id"] for answer in bytes(buf).splitlines())
            assert ids == sorted([f"e{i}" for i in range(10)] + [f"s{i}" for i in range(10)]), transport
            assert took < 4.0, (transport, took)
    finally:
        assert s.broker.stop() == 0, s.broker.read_log()


@pytest.mark.parametrize(("opening", "code"), [(b"POST / HTTP/1.1\r\n", "-32600"), (b"\x16\x03\x01\x02\x00\x01", "-32700")])
def test_a_line_of_another_protocol_is_counted_as_the_error_it_is_answered(sb, opening, code):
    """Hostile testing (round 26): an HTTP request line (a browser's cross-site POST) and
    bytes no JSON text starts with (a TLS ClientHello: the ALPACA attack) are answered
    with an error line, -32600 and -32700, that no metric counted: the attempts an
    operator most wants to see left no trace. Each is counted in rpc_broker_errors_total
    by its code, as every error object sent."""
    before = metric(scrape(sb.broker), "rpc_broker_errors_total", code=code)
    with sb.connect("tcp") as s:
        s.send(opening + b'{"jsonrpc":"2.0","method":"add","params":[1,2],"id":1}\n')
        answer = json.loads(s.readline())
    assert answer["error"]["code"] == int(code) and answer["id"] is None
    wait_for(lambda: metric(scrape(sb.broker), "rpc_broker_errors_total", code=code) == before + 1)


def test_a_client_that_caught_up_keeps_its_next_burst_concurrent(tmp_path):
    """Hostile testing (round 28): a client fell behind once (a 3 MB answer left unread
    for a second, past a quarter of its 4 MiB budget), then read it all: owed nothing,
    it was put one at a time all the same when its buffer drained, and its next burst of
    8 sleeps of 0.5 s took 4 s. Owed nothing, it is not behind: the burst overlaps."""
    s = start_stream_broker(tmp_path, "--workers", "2", "--max-response-bytes", str(4 * 1024 * 1024),
                            "--max-body-bytes", str(4 * 1024 * 1024))
    try:
        with s.connect("unix") as stream:
            stream.send(line("echo", ["z" * 3_000_000], "big") + b"\n")
            time.sleep(1.0)  # not reading: the answer fills the socket, then the write buffer
            assert json.loads(stream.readline(timeout=30))["id"] == "big"
            time.sleep(0.2)  # caught up: owed nothing
            started = time.monotonic()
            stream.send(b"".join(line("sleep", [0.5], i) + b"\n" for i in range(8)))
            ids = sorted(json.loads(stream.readline(timeout=30))["id"] for _ in range(8))
            took = time.monotonic() - started
        assert ids == list(range(8))
        assert took < 3.0, took  # (one at a time: 4 s)
    finally:
        assert s.broker.stop() == 0, s.broker.read_log()
