"""`rpc-broker bench`: the answer checker, the schedule, histograms, the report schema,
the plot, and whole runs against real servers on loopback.

`FaultyServer` is a small uvloop + httptools JSON-RPC server (answers echo their params)
run in a thread; its `mode` makes it answer wrongly in one precise way. With
``ndjson=True`` it speaks newline-delimited JSON over TCP instead (`FaultyNdjson`), as the
broker's stream front-end does. Run this file as a script (`python tests/test_loadgen.py
PORT`) to serve it in "ok" mode, e.g. to measure the load generator's ceiling.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import typing
from collections.abc import Iterator
from pathlib import Path

import httptools
import msgspec
import pytest
from conftest import ROOT, free_port, listen_port, wait_for

from broker import cli
from broker.jsonrpc import Codec, Request, response_result
from broker.loadgen import http as loadgen_http
from broker.loadgen import runner, schedule
from broker.loadgen.check import Answer, Checker, Tally
from broker.loadgen.plot import PlotError, load_reports
from broker.loadgen.report import build_report, merge, mostly_refused
from broker.loadgen.stats import SCHEMA, Latency, Report
from broker.loadgen.workload import Call, Expect, MixError, Workload, load_mix

# -- a server that answers wrongly on purpose --------------------------------------------------

FAULT_EVERY = 25  # the faulty modes spoil every 25th request body (server-wide count)


class _ServerState:
    def __init__(self, mode: str, stall_after: int, stall_s: float) -> None:
        self.mode = mode
        self.requests = 0
        self.stall_after = stall_after
        self.stall_s = stall_s
        self.stall_until = 0.0
        self.held = 0  # NDJSON "shuffle": answers written late


class _HttpServer(asyncio.Protocol):
    """A test server's HTTP connection: httptools parses, the body is gathered in
    `body`; subclasses answer in `on_message_complete`."""

    def __init__(self) -> None:
        self.parser = httptools.HttpRequestParser(self)
        self.body: list[bytes] = []
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_body(self, chunk: bytes) -> None:
        self.body.append(chunk)


class FaultyHttp(_HttpServer):
    """One server connection. Modes: ok, missing (drops the last answer of a batch),
    wrong_id, duplicate (answers the first call twice), malformed (cuts the JSON),
    close (closes the connection instead of answering), stall (holds every answer
    for `stall_s` once `stall_after` requests have arrived)."""

    def __init__(self, state: _ServerState, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__()
        self.state = state
        self.loop = loop
        self.codec = Codec()
        self.held: list[bytes] = []
        self.flush_at: asyncio.TimerHandle | None = None

    def on_message_complete(self) -> None:
        st = self.state
        st.requests += 1
        n = st.requests
        body = b"".join(self.body)
        self.body.clear()
        decoded = self.codec.decode(body)
        answers = [response_result(r.id, r.params or b"3") for r in decoded.items
                   if isinstance(r, Request) and len(r.id)]
        fault = n % FAULT_EVERY == 0
        mode = st.mode
        if fault and mode == "close":
            assert self.transport is not None
            self.transport.close()
            return
        if fault and mode == "missing" and answers:
            answers.pop()
        if fault and mode == "duplicate" and answers:
            answers.append(answers[0])
        if fault and mode == "wrong_id" and answers:
            answers[0] = response_result(b'"not-an-id-we-sent"', b"3")
        if mode == "endless":  # (every answer: a chunked body that does not end, 64 KiB a ms, 8 MiB at most)
            assert self.transport is not None
            self.transport.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                                 b"Transfer-Encoding: chunked\r\n\r\n")
            self.loop.call_soon(self.chunk, 128)
            return
        if not answers:
            out = b"HTTP/1.1 204 No Content\r\n\r\n"
        else:
            payload = b"[" + b",".join(answers) + b"]" if decoded.batch else answers[0]
            if fault and mode == "malformed":
                payload = payload[:-3]
            out = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (
                len(payload), payload)
        now = self.loop.time()
        if mode == "stall" and n == st.stall_after:
            st.stall_until = now + st.stall_s
        if now < st.stall_until or self.held:
            self.held.append(out)
            if self.flush_at is None:
                self.flush_at = self.loop.call_at(max(st.stall_until, now), self.flush)
            return
        assert self.transport is not None
        if mode == "interim":  # (RFC 9110 15.2: 1xx, interim answers a client ignores, before each)
            out = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 102 Processing\r\n\r\n" + out
        self.transport.write(out)

    def chunk(self, left: int) -> None:
        if left and self.transport is not None and not self.transport.is_closing():
            self.transport.write(b"10000\r\n" + b" " * 65536 + b"\r\n")
            self.loop.call_later(0.001, self.chunk, left - 1)

    def flush(self) -> None:
        self.flush_at = None
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(b"".join(self.held))
        self.held.clear()


class FaultyNdjson(asyncio.Protocol):
    """One NDJSON server connection: one request body per line, one answer line per
    answered body. Modes: ok; shuffle (the answers of odd-numbered lines are held 5 ms,
    so later answers overtake them); split (each answer line ends in \\r\\n and is
    written in two pieces 1 ms apart); and, for every 25th line: silent (never answers
    it), wrong_id, duplicate (answers it twice, as two lines), malformed (cuts its answer
    line), missing (drops the last answer of a batch array), close (closes the
    connection instead of answering)."""

    def __init__(self, state: _ServerState, loop: asyncio.AbstractEventLoop) -> None:
        self.state = state
        self.loop = loop
        self.codec = Codec()
        self.buffer = b""
        self.tail: bytes | None = None  # "split": the rest of the lines, written 1 ms later
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        *lines, self.buffer = (self.buffer + data).split(b"\n")
        for line in lines:
            if self.transport is not None and not self.transport.is_closing():
                self.line(line)

    def line(self, line: bytes) -> None:
        st = self.state
        st.requests += 1
        n = st.requests
        decoded = self.codec.decode(line)
        answers = [response_result(r.id, r.params or b"3") for r in decoded.items
                   if isinstance(r, Request) and len(r.id)]
        fault = n % FAULT_EVERY == 0
        mode = st.mode
        assert self.transport is not None
        if fault and mode == "close":
            self.transport.close()
            return
        if not answers or (fault and mode == "silent"):
            return
        if fault and mode == "missing":
            answers.pop()
        if fault and mode == "wrong_id":
            answers[0] = response_result(b'"not-an-id-we-sent"', b"3")
        payload = b"[" + b",".join(answers) + b"]" if decoded.batch else answers[0]
        if fault and mode == "malformed":
            payload = payload[:-3]
        out = payload + b"\n"
        if fault and mode == "duplicate":
            out += out
        if mode == "shuffle" and n % 2:
            st.held += 1
            self.loop.call_later(0.005, self.write, out)
        elif mode == "split":
            out = out[:-1] + b"\r\n"
            if self.tail is not None:
                self.tail += out  # keep the byte order: behind the piece still to come
            else:
                self.transport.write(out[:7])
                self.tail = out[7:]
                self.loop.call_later(0.001, self.flush_tail)
        else:
            self.transport.write(out)

    def write(self, data: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    def flush_tail(self) -> None:
        tail, self.tail = self.tail, None
        if tail:
            self.write(tail)


class _ThreadServer:
    """A uvloop server on 127.0.0.1, in a thread, making one `factory()` per connection."""

    def __init__(self, factory: typing.Callable[[], asyncio.Protocol]) -> None:
        import uvloop

        self.loop = uvloop.new_event_loop()
        self.loop_errors: list[dict[str, object]] = []
        self.loop.set_exception_handler(lambda _loop, ctx: self.loop_errors.append(ctx))
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", listen_port()))
        self.port = self.sock.getsockname()[1]
        self.connections = 0
        started = threading.Event()

        def counted() -> asyncio.Protocol:
            self.connections += 1
            return factory()

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            server = self.loop.run_until_complete(self.loop.create_server(counted, sock=self.sock))
            self.loop.call_soon(started.set)
            self.loop.run_forever()
            server.close()
            self.loop.run_until_complete(server.wait_closed())
            self.loop.close()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        assert started.wait(10)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        assert not self.loop_errors, self.loop_errors


class FaultyServer(_ThreadServer):
    """A `FaultyHttp` (or `FaultyNdjson`) server on 127.0.0.1 in a thread with its own
    uvloop loop."""

    def __init__(self, mode: str = "ok", stall_after: int = 0, stall_s: float = 0.0,
                 ndjson: bool = False) -> None:
        self.state = _ServerState(mode, stall_after, stall_s)
        self.ndjson = ndjson
        kind = FaultyNdjson if ndjson else FaultyHttp
        super().__init__(lambda: kind(self.state, self.loop))
        self.url = f"tcp://127.0.0.1:{self.port}" if ndjson else f"http://127.0.0.1:{self.port}/"


@pytest.fixture
def serve() -> Iterator[object]:
    servers: list[FaultyServer] = []

    def start(mode: str = "ok", **kw: object) -> FaultyServer:
        s = FaultyServer(mode, **kw)  # type: ignore[arg-type]
        servers.append(s)
        return s

    yield start
    for s in servers:
        s.stop()


def bench(tmp_path: Path, url: str, *flags: str) -> tuple[int, Report]:
    """Run `rpc-broker bench` through the real CLI; return its exit code and JSON report."""
    out = tmp_path / f"run{len(list(tmp_path.glob('run*.json')))}.json"
    code = cli.main(["bench", url, "--quiet", "--json", str(out), "--duration", "1",
                     "--warmup", "0.2", "-c", "4", *flags])
    return code, Report.from_json(out.read_bytes())


# -- workload ----------------------------------------------------------------------------------

def test_bodies_are_valid_requests_with_the_expected_ids():
    codec = Codec()
    w = Workload([Call("add", "[1, 2]")])
    body, exp = w.body(7)
    assert body == b'{"jsonrpc":"2.0","method":"add","params":[1,2],"id":7}'
    assert exp == msgspec.Raw(b"7")  # one plain call: just its id
    for ids in ("int", "string", "large", "repeated"):
        w = Workload([Call("add", "[1,2]", 3.0), Call("echo", '{"a":1}'), Call("update", "[1]", 1.0, True)],
                     batch=8, ids=ids)  # type: ignore[arg-type]
        for k in range(5):
            body, exp = w.body(k)
            decoded = codec.decode(body)
            assert decoded.batch and len(decoded.items) == 8 == exp.calls
            sent = [bytes(r.id) for r in decoded.items if isinstance(r, Request) and len(r.id)]
            assert tuple(sent) == exp.ids
            if ids == "repeated":
                assert set(sent) <= {b"%d" % k}
            else:
                assert len(set(sent)) == len(sent)
    big = [bytes(Workload([Call("add")], ids="large").body(k)[1]) for k in range(8)]  # type: ignore[arg-type]
    assert int(big[0]) > 2**64 and int(big[1]) < -(2**64)
    assert b"e3" in big[2] and b"E-2" in big[3]
    assert Workload([Call("add")], ids="string").body(1)[1] == msgspec.Raw(b'"r1"')


def test_mix_files_toml_and_json(tmp_path):
    t = tmp_path / "mix.toml"
    t.write_text('[[call]]\nmethod = "add"\nparams = [1, 2]\nweight = 2\n\n'
                 '[[call]]\nmethod = "update"\nparams = {x = 1}\nnotification = true\n')
    calls = load_mix(t)
    assert calls == [Call("add", "[1,2]", 2.0), Call("update", '{"x":1}', 1.0, True)]
    j = tmp_path / "mix.json"
    j.write_text(json.dumps([{"method": "add", "params": [1, 2]}]))
    assert load_mix(j) == [Call("add", "[1,2]")]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"method": "add", "wieght": 2}]))
    with pytest.raises(MixError, match="wieght"):
        load_mix(bad)
    with pytest.raises(MixError):
        Workload([Call("add", "3")])


_CALL = '[[call]]\nmethod = "add"\n'


@pytest.mark.parametrize(("name", "text", "words"), [
    # not JSON / not TOML / not UTF-8
    ("bad.json", '[{"method": "add",]', "not valid JSON: "),
    ("bad.toml", '[[call]\nmethod = "add"\n', "not valid TOML: "),
    ("mix.txt", _CALL, "not valid JSON (only a .toml file is read as TOML): "),
    ("latin1.toml", b'[[call]]\nmethod = "\xe9"\n', "not UTF-8 text: "),
    # the wrong shape
    ("scalar.json", "3", 'expected a list of calls, or an object {"calls": [...]}; got a number'),
    ("top.json", '{"cals": []}', "unknown top-level key 'cals'"),
    ("top.toml", 'kall = 1\n' + _CALL, "unknown top-level key 'kall'; expected [[call]] tables"),
    ("object.json", '{"calls": {"method": "add"}}', "'calls' must be an array of call tables, got an object"),
    ("table.toml", '[call]\nmethod = "add"\n', "'call' must be an array of call tables, got an object: "
                                               "write [[call]], not [call]"),
    ("entry.json", '[{"method": "add"}, 7]', "entry 2 ($[1]): Expected `object`, got `int`"),
    ("empty.toml", "", "no calls (expected [[call]] tables)"),
    ("empty.json", "[]", "no calls (expected a list of calls"),
    # a key missing, unknown, of the wrong type or out of range, in a given entry
    ("missing.json", '{"calls": [{"method": "add"}, {"params": [1]}]}',
     "entry 2 ($.calls[1]): Object missing required field `method`"),
    ("missing.toml", _CALL + '\n[[call]]\nweight = 2\n', "[[call]] table 2: Object missing required field `method`"),
    ("unknown.toml", _CALL + "wieght = 2\n", "[[call]] table 1: Object contains unknown field `wieght`"),
    ("type.json", '[{"method": 3}]', "entry 1 ($[0]), key 'method': Expected `str`, got `int`"),
    ("params.json", '[{"method": "add", "params": 3}]', "entry 1 ($[0]), key 'params': Expected `object | array"),
    ("weight.toml", _CALL + "weight = 0\n", "[[call]] table 1, key 'weight': Expected `float` > 0.0"),
    ("inf.toml", _CALL + "weight = inf\n", "[[call]] table 1, key 'weight': must be finite, got inf"),
    ("huge.json", '[{"method": "a", "weight": 1e308}, {"method": "b", "weight": 1e308}]', "weights add up"),
])
def test_mix_file_errors_name_the_file_and_the_entry(tmp_path, capsys, name, text, words):
    """Every way a --mix file can be wrong gives one message that names the file, and for
    a bad entry which entry and which key; the command exits 2 before any load."""
    path = tmp_path / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(MixError) as caught:
        load_mix(path)
    message = str(caught.value)
    assert message.startswith(f"mix file {path}: ") and words in message, message
    assert cli.main(["bench", "http://127.0.0.1:1/", "-q", "--mix", str(path)]) == 2
    assert capsys.readouterr().err == f"rpc-broker bench: {message}\n"


def test_an_unreadable_mix_file_is_named(tmp_path, capsys):
    for path, why in ((tmp_path / "nowhere.toml", "No such file or directory"), (tmp_path, "Is a directory")):
        assert cli.main(["bench", "http://127.0.0.1:1/", "-q", "--mix", str(path)]) == 2
        assert capsys.readouterr().err == f"rpc-broker bench: mix file {path}: cannot read it: {why}\n"


def test_a_mix_or_report_path_that_is_no_regular_file_is_refused_at_once(tmp_path, capsys):
    """Hostile testing, round 131: `--mix /dev/zero` read 8 GB in 9 s."""
    for path, why in (("/dev/zero", "a device"),):
        assert cli.main(["bench", "http://127.0.0.1:1/", "-q", "--mix", path]) == 2
        assert capsys.readouterr().err == f"rpc-broker bench: mix file {path}: not a regular file ({why})\n"
        assert cli.main(["bench", "plot", path, "-o", str(tmp_path / "out.png")]) == 2
        assert capsys.readouterr().err == f"rpc-broker bench plot: input file {path}: not a regular file ({why})\n"


# -- bench plot: its inputs ----------------------------------------------------------------------

def _saved_report(requests: int = 10) -> Report:
    spec = runner.Spec(target="http://127.0.0.1:1/", calls=[Call("add", "[1,2]")], duration=2.0)
    t = Tally()
    t.requests = t.calls = requests
    h = Latency()
    h.record_many([1000, 2000] * requests)
    return build_report(spec, t, h)


@pytest.mark.parametrize(("codes", "calls", "refused", "words"), [
    ({"-32005": 6}, 10, 0, "most calls were rate limited (-32005)"),
    ({"-32000": 6, "-32005": 3}, 10, 0, "most calls were answered -32000 (on rpc-broker: server\noverloaded"),
    ({"-32000": 6}, 9, 2, "most calls were answered -32000"),  # (a batch refused whole: one error, no call)
    ({"-32005": 5}, 10, 0, ""),  # (half: not most)
    ({"-32005": 4, "-32000": 4}, 10, 0, ""),  # (no one code is most)
    ({"-32601": 10}, 10, 0, ""),  # (a wrong --method: not the server turning the load away)
    ({}, 0, 0, ""),
])
def test_a_run_is_mostly_refused_past_half_its_calls_with_one_code(codes, calls, refused, words):
    rep = msgspec.structs.replace(_saved_report(), errors_by_code=codes, calls=calls, refused_batches=refused)
    got = mostly_refused(rep)
    assert got.startswith(words) if words else got == "", got


def _edit(**changes: object) -> str:
    data = json.loads(_saved_report().to_json())
    for key, value in changes.items():
        if value is None:
            del data[key]
        else:
            data[key] = value
    return json.dumps(data)


@pytest.mark.parametrize(("text", "words"), [
    ("{not json", "not valid JSON: "),
    ("", "not valid JSON: "),
    ("[1, 2]", "Expected `object`, got `array`"),
    (_edit(check=None), "Object missing required field `check`"),
    (_edit(requests="many"), "key 'requests': Expected `int`, got `str`"),
    (_edit(check={"wrong_id": 0, "missing": 0, "duplicate": 0, "malformed": 0, "ok": "yes"}),
     "key 'check.ok': Expected `bool`, got `str`"),
    (_edit(schema="rpc-broker-bench/9"), "key 'schema': Invalid enum value 'rpc-broker-bench/9'"),
    (_edit(extra=1), "Object contains unknown field `extra`"),
], ids=["bad-json", "empty", "array", "missing-key", "wrong-type", "nested-key", "other-schema", "unknown-key"])
def test_plot_input_errors_name_the_file_and_the_key(tmp_path, capsys, text, words):
    """`bench plot good.json bad.json`: the message names bad.json (and the key that is
    wrong), not good.json; nothing is drawn."""
    good = tmp_path / "good.json"
    good.write_bytes(_saved_report().to_json())
    bad = tmp_path / "bad.json"
    bad.write_text(text)
    png = tmp_path / "out.png"
    assert cli.main(["bench", "plot", str(good), str(bad), "-o", str(png)]) == 2
    err = capsys.readouterr().err
    prefix = f"rpc-broker bench plot: input file {bad}: "
    assert err.startswith(prefix) and words in err and str(good) not in err, err
    if words.startswith("not valid JSON"):
        assert "schema" not in err
    else:
        assert err.startswith(f"{prefix}not a report of 'rpc-broker bench --json' (schema {SCHEMA}): "), err
    assert not png.exists()
    with pytest.raises(PlotError, match=re.escape(f"input file {bad}: ")):
        load_reports([good, bad])


def test_plot_unreadable_inputs_and_unwritable_output_are_named(tmp_path, capsys):
    good = tmp_path / "good.json"
    good.write_bytes(_saved_report().to_json())
    for path, why in ((tmp_path / "nowhere.json", "No such file or directory"), (tmp_path, "Is a directory")):
        assert cli.main(["bench", "plot", str(good), str(path), "-o", str(tmp_path / "out.png")]) == 2
        assert capsys.readouterr().err == f"rpc-broker bench plot: input file {path}: cannot read it: {why}\n"
    out = tmp_path / "missing-dir" / "out.png"
    assert cli.main(["bench", "plot", str(good), "-o", str(out)]) == 2
    assert capsys.readouterr().err == f"rpc-broker bench plot: cannot write {out}: No such file or directory\n"
    # a run with no answer measured has no curve: alone, there is nothing to draw
    empty = tmp_path / "empty.json"
    empty.write_bytes(_saved_report(requests=0).to_json())
    assert cli.main(["bench", "plot", str(empty), "-o", str(tmp_path / "empty.png")]) == 2
    assert f"nothing to plot: no input has a latency curve (no answer was measured in {empty})" in (
        capsys.readouterr().err)
    assert not (tmp_path / "empty.png").exists()


# -- the checker, sans-IO ----------------------------------------------------------------------

def _check(status: int, body: bytes, exp: Expect) -> Tally:
    t = Tally()
    Checker(t).check(status, body, exp)
    return t


def _counts(t: Tally) -> tuple[int, int, int, int]:
    return t.wrong_id, t.missing, t.duplicate, t.malformed


ONE = Expect(False, (b"1.5e3",), 1)
THREE = Expect(True, (b"1", b"2", b"3"), 3)
REPEATED = Expect(True, (b"7", b"7"), 2)


def _r(id_: str, result: str = "3") -> str:
    return f'{{"jsonrpc":"2.0","id":{id_},"result":{result}}}'


@pytest.mark.parametrize(("status", "body", "exp", "counts", "errors"), [
    (200, _r("1.5e3"), ONE, (0, 0, 0, 0), {}),
    (200, _r("1500.0"), ONE, (1, 0, 0, 0), {}),  # ids are compared byte for byte
    (200, '{"jsonrpc":"2.0","id":1.5e3,"error":{"code":-32601,"message":"x"}}', ONE, (0, 0, 0, 0), {-32601: 1}),
    (400, '{"jsonrpc":"2.0","id":null,"error":{"code":-32700,"message":"x"}}', ONE, (0, 0, 0, 0), {-32700: 1}),
    (500, _r("1.5e3"), ONE, (0, 0, 0, 1), {}),  # a result with a 5xx status
    (200, '{"jsonrpc":"2.0","id":1.5e3,"result":3', ONE, (0, 0, 0, 1), {}),
    (200, '{"jsonrpc":"1.0","id":1.5e3,"result":3}', ONE, (0, 0, 0, 1), {}),
    (200, '{"jsonrpc":"2.0","id":1.5e3,"result":3,"error":{"code":1,"message":"x"}}', ONE, (0, 0, 0, 1), {}),
    # A malformed answer stands in for one call left without an answer: never counted
    # missing too (round 26: an object for a batch counted each call both ways)
    (200, f"[{_r('1.5e3')}]", ONE, (0, 0, 0, 1), {}),  # an array for a single call
    (204, "", ONE, (0, 1, 0, 0), {}),
    (302, _r("1.5e3"), ONE, (0, 0, 0, 1), {}),
    (200, f"[{_r('1')},{_r('2')},{_r('3')}]", THREE, (0, 0, 0, 0), {}),
    (200, f"[{_r('3')},{_r('1')},{_r('2')}]", THREE, (0, 0, 0, 0), {}),  # any order
    (200, f"[{_r('1')},{_r('2')}]", THREE, (0, 1, 0, 0), {}),
    (200, f"[{_r('1')},{_r('2')},{_r('3')},{_r('2')}]", THREE, (0, 0, 1, 0), {}),
    (200, f"[{_r('1')},{_r('2')},{_r('9')}]", THREE, (1, 0, 0, 0), {}),
    (200, f'[{_r("1")},{_r("2")},{{"id":3}}]', THREE, (0, 0, 0, 1), {}),
    (200, f'[{_r("1")},{_r("2")},7]', THREE, (0, 0, 0, 1), {}),
    (200, "[]", THREE, (0, 2, 0, 1), {}),
    (200, _r("1"), THREE, (0, 2, 0, 1), {}),  # an object for a batch
    (502, "", THREE, (0, 2, 0, 1), {}),
    (200, "not json", THREE, (0, 2, 0, 1), {}),
    (200, f"[{_r('7')},{_r('7')}]", REPEATED, (0, 0, 0, 0), {}),
    (200, f"[{_r('7')}]", REPEATED, (0, 1, 0, 0), {}),
    (200, f"[{_r('7')},{_r('7')},{_r('7')}]", REPEATED, (0, 0, 1, 0), {}),
    (204, "", Expect(True, (), 3), (0, 0, 0, 0), {}),  # only notifications
    (200, "", Expect(False, (), 1), (0, 0, 0, 0), {}),
    (200, _r("1"), Expect(False, (), 1), (0, 0, 0, 1), {}),  # an answer to a notification
])
def test_checker(status, body, exp, counts, errors):
    t = _check(status, body.encode(), exp)
    assert _counts(t) == counts
    assert t.errors_by_code == errors
    # calls answered: a call whose answer is missing, wrong or malformed is not counted
    answered = exp.calls - min(len(exp.ids), counts[0] + counts[1] + counts[3])
    assert (t.requests, t.calls) == (1, answered)
    if exp is ONE:  # the fast path (`Workload.body` gives a single call's id as a Raw) agrees
        fast = _check(status, body.encode(), msgspec.Raw(ONE.ids[0]))
        assert (_counts(fast), fast.errors_by_code, fast.requests, fast.calls) == (counts, errors, 1, answered)


REFUSED = (b'{"jsonrpc":"2.0","id":null,"error":{"code":-32600,"message":"Invalid Request",'
           b'"data":"batch of 3 elements exceeds max_batch 2"}}')


def _refusal(t: Tally) -> tuple[int, int, int, dict[int, int], tuple[int, int, int, int]]:
    return t.requests, t.calls, t.refused_batches, t.errors_by_code, _counts(t)


def test_a_batch_refused_whole_is_one_error_answer_and_no_calls():
    """One error object with "id": null answering a batch: the server refused the whole
    body (a broker past its max_batch). It is an answer, not a failure: one request, one
    error under its code, one refused batch, and no calls (none of them ran)."""
    refused = (1, 0, 1, {-32600: 1}, (0, 0, 0, 0))
    for status in (400, 200):
        assert _refusal(_check(status, REFUSED, THREE)) == refused
    # the same answer as an NDJSON line, decoded by the reader or not
    for decoded in (None, msgspec.json.decode(REFUSED, type=Answer | list[Answer])):
        t = Tally()
        Checker(t).check_line(REFUSED, THREE, decoded)
        assert _refusal(t) == refused
    # a batch of only notifications refused whole: the same (an invalid request is answered)
    assert _refusal(_check(400, REFUSED, Expect(True, (), 3))) == refused
    # during warm-up it is checked, not counted
    t = Tally()
    t.recording = False
    Checker(t).check(400, REFUSED, THREE)
    assert _refusal(t) == (0, 0, 0, {}, (0, 0, 0, 0))
    # not a refusal: an error with an id of its own for a batch; id null for a single call
    other = b'{"jsonrpc":"2.0","id":1,"error":{"code":-32600,"message":"x"}}'
    assert _refusal(_check(400, other, THREE)) == (1, 0, 0, {}, (0, 2, 0, 1))  # (the malformed one stands in for a call)
    assert _refusal(_check(400, REFUSED, ONE)) == (1, 1, 0, {-32600: 1}, (0, 0, 0, 0))
    # the count goes from the load processes to the parent, and adds up there
    t = _check(400, REFUSED, THREE)
    result = runner.ProcessResult(t.requests, t.calls, t.errors_by_code, 0, 0, 0, 0, 0, 0, Latency().encode(),
                                  refused_batches=t.refused_batches)
    result = msgspec.msgpack.decode(msgspec.msgpack.encode(result), type=runner.ProcessResult)
    merged = merge([result, result])[0]
    assert _refusal(merged) == (2, 0, 2, {-32600: 2}, (0, 0, 0, 0))


# -- schedule, histograms ----------------------------------------------------------------------

def test_schedule_math():
    assert schedule.connection_timing(100.0, 4, 1) == (0.01, 0.04)
    phase, interval = schedule.connection_timing(100.0, 4, 1)
    assert schedule.intended(10.0, phase, interval, 3) == pytest.approx(10.13)
    # due: intended <= now and < t_end, minus those already sent
    assert schedule.due(0.0, 0.0, 0.1, 0, -0.5, 10.0) == 0
    assert schedule.due(0.0, 0.0, 0.1, 0, 0.0, 10.0) == 1
    assert schedule.due(0.0, 0.0, 0.1, 0, 0.35, 10.0) == 4
    assert schedule.due(0.0, 0.0, 0.1, 3, 0.35, 10.0) == 1
    assert schedule.due(0.0, 0.0, 0.1, 9, 0.35, 10.0) == 0
    assert schedule.due(0.0, 0.0, 0.1, 0, 99.0, 1.0) == 10  # t_end excluded
    # the connections interleave into R evenly spaced requests/s
    times = sorted(schedule.intended(0.0, *schedule.connection_timing(50.0, 3, g), i)
                   for g in range(3) for i in range(20))
    assert [round(b - a, 9) for a, b in itertools.pairwise(times)] == [0.02] * 59
    assert schedule.planned(1000.0, 16, 2.0) == 2000
    assert schedule.planned(7.0, 3, 1.0) == 7
    with pytest.raises(ValueError):
        schedule.connection_timing(0.0, 1, 0)


def test_histograms_merge_across_processes():
    a, b = Latency(), Latency()
    a.record_many([100] * 900 + [10_000] * 100)
    b.record_many([200] * 1000)
    merged = Latency()
    for h in (a, b):
        merged.add(Latency(h.encode()))  # as the parent does with each process's histogram
    assert merged.count == a.count + b.count == 2000
    assert merged.percentile_ms(40) == pytest.approx(0.1, rel=1e-3)
    assert merged.percentile_ms(60) == pytest.approx(0.2, rel=1e-3)
    assert merged.percentile_ms(99) == pytest.approx(10.0, rel=1e-3)
    assert merged.max_ms == pytest.approx(10.0, rel=1e-3)
    curve = merged.curve()
    assert curve[-1][0] == 100.0
    assert [p for p, _ in curve] == sorted(p for p, _ in curve)
    assert [ms for _, ms in curve] == sorted(ms for _, ms in curve)
    huge = Latency()
    huge.record_many([0, 10**12])  # clamped into 1 µs .. 60 s
    assert huge.count == 2


def test_report_schema_is_exact():
    spec = runner.Spec(target="http://127.0.0.1:1/", calls=[Call("add", "[1,2]")], duration=2.0)
    t = Tally()
    t.requests, t.calls, t.errors_by_code = 10, 10, {-32601: 2}
    h = Latency()
    h.record_many([1000, 2000])
    t.refused_batches = 3
    data = json.loads(build_report(spec, t, h, unsent=7).to_json())
    assert list(data) == ["schema", "target", "mode", "connections", "depth", "pipeline", "rate", "batch",
                          "processes", "duration_s", "warmup_s", "timeout_s", "ids", "seed", "workload",
                          "requests", "calls", "calls_counted", "requests_per_s", "calls_per_s",
                          "errors_by_code", "transport_errors", "resent", "refused_batches", "unsent_requests",
                          "sent_per_s", "generator_behind", "generator_late_requests", "check",
                          "latency_ms", "percentiles", "interrupted", "processes_lost", "mcp"]
    assert data["schema"] == SCHEMA and data["rate"] is None and data["requests_per_s"] == 5.0
    assert data["mcp"] is None  # (a JSON-RPC run; `rpc-broker bench --mcp`'s: tests/test_bench_mcp.py)
    assert data["errors_by_code"] == {"-32601": 2}
    assert (data["refused_batches"], data["unsent_requests"]) == (3, 7)
    # a file written before these two keys existed still loads (bench plot reads old runs)
    assert data["interrupted"] is False
    older = {k: v for k, v in data.items()
             if k not in ("refused_batches", "unsent_requests", "interrupted", "mcp", "resent")}
    rep = Report.from_json(json.dumps(older).encode())
    assert (rep.refused_batches, rep.unsent_requests, rep.requests, rep.interrupted, rep.mcp) == (0, 0, 10, False, None)
    assert rep.resent == 0
    assert list(data["check"]) == ["wrong_id", "missing", "duplicate", "malformed", "ok"]
    assert list(data["latency_ms"]) == ["p50", "p90", "p99", "p99.9", "max", "mean"]
    assert all(len(pt) == 2 for pt in data["percentiles"])
    with pytest.raises(msgspec.ValidationError):
        Report.from_json(json.dumps({**data, "extra": 1}).encode())


# -- whole runs ----------------------------------------------------------------------------------

def test_correct_server_passes(serve, tmp_path):
    s = serve("ok")
    code, rep = bench(tmp_path, s.url, "--batch", "5", "--ids", "large", "-d", "2")
    assert code == 0
    assert rep.check.ok and rep.transport_errors == 0 and rep.requests > 0
    assert rep.calls == 5 * rep.requests
    assert rep.mode == "closed" and rep.depth == 2 and rep.batch == 5


@pytest.mark.parametrize(("mode", "counter"), [
    ("missing", "missing"), ("wrong_id", "wrong_id"), ("duplicate", "duplicate"), ("malformed", "malformed"),
])
def test_wrong_answers_are_caught(serve, tmp_path, mode, counter):
    s = serve(mode)
    code, rep = bench(tmp_path, s.url, "--batch", "4")
    assert code == 1
    assert not rep.check.ok
    assert getattr(rep.check, counter) > 0
    others = {"missing", "wrong_id", "duplicate", "malformed"} - {counter}
    if mode != "malformed":  # a cut body also leaves its calls unanswered
        assert all(getattr(rep.check, o) == 0 for o in others), rep.check


def test_interim_1xx_answers_are_skipped_not_taken_for_the_answer(serve, tmp_path):
    """Hostile testing, round 131: each `100 Continue` was counted as an answer (malformed),
    and the next request sent for it. RFC 9110 15.2: a client parses and ignores 1xx."""
    s = serve("interim")
    code, rep = bench(tmp_path, s.url, "--batch", "3")
    assert code == 0 and rep.check.ok and rep.check.malformed == 0 and rep.transport_errors == 0, rep.check
    assert 0 < rep.requests <= s.state.requests and rep.calls == 3 * rep.requests


def test_an_answer_body_past_the_bound_drops_the_connection(serve, tmp_path, monkeypatch, capsys):
    """Hostile testing, round 131: an endless chunked body (or a huge Content-Length, or an
    endless SSE event) grew the generator by ~170 MB/s to GBs. Past MAX_ANSWER_BYTES (here 1 MiB)
    the answer is malformed, its connection dropped, its memory freed."""
    monkeypatch.setattr(loadgen_http, "MAX_ANSWER_BYTES", 1024 * 1024)
    s = serve("endless")
    code, rep = bench(tmp_path, s.url, "--timeout", "20")
    assert code == 1 and rep.check.malformed > 0 and rep.transport_errors > 0, rep
    assert "an answer's body longer than 1048576 bytes" in " ".join(capsys.readouterr().out.split())


def test_connection_closed_mid_run_is_a_transport_error(serve, tmp_path):
    s = serve("close")
    code, rep = bench(tmp_path, s.url, "--pipeline", "2")
    assert code == 1
    assert rep.transport_errors > 0 and rep.check.ok
    assert rep.requests > 0  # it reconnected and went on


def test_nothing_listening_and_bad_targets(tmp_path, capsys):
    sock = socket.socket()
    sock.bind(("127.0.0.1", listen_port()))
    port = sock.getsockname()[1]
    sock.close()
    code = cli.main(["bench", f"http://127.0.0.1:{port}/", "-q", "--duration", "0.3", "--warmup", "0",
                     "-c", "2", "--timeout", "2"])
    assert code == 1
    err = capsys.readouterr().err
    assert f"first problem: cannot connect to 127.0.0.1:{port}" in err, err
    for bad in ("tcp://127.0.0.1", "tcp://127.0.0.1:1/path", "unix://", "ftp://127.0.0.1:1/",
                "unix:///" + "x" * 120,
                # malformed IPv6 (hostile testing, round 9: a traceback, exit 1)
                "http://[::1/", "tcp://[::1:18342", "http://[zz]:80/"):
        assert cli.main(["bench", bad, "-q"]) == 2, bad
    assert cli.main(["bench", "http://127.0.0.1:1/", "--params", "3", "-q"]) == 2
    assert cli.main(["bench", "http://127.0.0.1:1/", "-c", "1", "-P", "2", "-q"]) == 2
    # (hostile testing, round 27: a typo got no hint, and a prefix was taken, where `serve` refuses it)
    capsys.readouterr()
    assert cli.main(["bench", "http://127.0.0.1:1/", "--durration", "1"]) == 2
    assert capsys.readouterr().err.endswith("unrecognized arguments: --durration 1 (did you mean --duration?)\n")
    assert cli.main(["bench", "http://127.0.0.1:1/", "--dur", "1"]) == 2
    assert "unrecognized arguments: --dur 1" in capsys.readouterr().err


def test_real_broker_batches_and_odd_ids(broker, tmp_path):
    url = f"http://{broker.host}:{broker.port}{broker.path}"
    for flags in (["--batch", "10", "--ids", "large"], ["--batch", "10", "--ids", "repeated", "-d", "2"],
                  ["--ids", "string", "--method", "echo", "--params", '{"a":[1,2]}']):
        code, rep = bench(tmp_path, url, *flags)
        assert (code, rep.check, rep.transport_errors) == (0, rep.check, 0)
        assert rep.check.ok and rep.requests > 0, flags
        assert rep.errors_by_code == {}


def test_real_broker_mix_with_notifications_and_errors(broker, tmp_path):
    url = f"http://{broker.host}:{broker.port}{broker.path}"
    mix = tmp_path / "mix.json"
    mix.write_text(json.dumps([
        {"method": "add", "params": [1, 2], "weight": 3},
        {"method": "update", "params": [1], "notification": True},
        {"method": "no_such_method"},
    ]))
    code, rep = bench(tmp_path, url, "--mix", str(mix), "--batch", "3")
    assert code == 0 and rep.check.ok
    assert rep.errors_by_code.get("-32601", 0) > 0
    # a body of notifications only: 204, nothing to match
    code, rep = bench(tmp_path, url, "--method", "update", "--params", "[1]", "--mix", str(_notif(tmp_path)))
    assert code == 0 and rep.requests > 0


def _notif(tmp_path: Path) -> Path:
    p = tmp_path / "notif.toml"
    p.write_text('[[call]]\nmethod = "update"\nparams = [1]\nnotification = true\n')
    return p


def test_open_loop_counts_a_stall_from_intended_send_times(serve):
    """The server holds every answer for 0.6 s after its 60th request. At 200 requests/s
    about 120 requests are due during the stall; measured from their intended times many
    wait hundreds of ms (a closed loop would show only one slow request per connection)."""
    rate, duration, stall = 200.0, 2.0, 0.6
    s = serve("stall", stall_after=60, stall_s=stall)
    spec = runner.Spec(target=s.url, calls=[Call("add", "[1,2]")], connections=4, rate=rate,
                       duration=duration, warmup=0.0, timeout=10.0)
    tally, hist, unsent, _drain = merge(runner.run(spec))
    assert tally.failures == 0 and tally.transport_errors == 0
    planned = schedule.planned(rate, 4, duration)
    assert planned == 400
    assert 0.8 * planned <= tally.requests + unsent <= planned
    assert hist.count == tally.requests
    assert hist.max_ms >= stall * 1000 * 0.9
    # >= 5 % of the requests waited >= 200 ms (about 15 % expected, vs 1 % for a closed loop)
    assert hist.percentile_ms(95) >= 200


def test_processes_merge_and_plot(serve, tmp_path):
    s = serve("ok")
    code, rep = bench(tmp_path, s.url, "-P", "2", "--rate", "400", "--batch", "2")
    assert code == 0 and rep.processes == 2 and rep.mode == "open" and rep.rate == 400.0
    # 400/s over 1 s, both processes' requests merged into one report
    assert 0.8 * 400 <= rep.requests <= 400
    assert rep.percentiles[-1][0] == 100.0
    assert bench(tmp_path, s.url)[0] == 0
    png = tmp_path / "out.png"
    files = sorted(str(p) for p in tmp_path.glob("run*.json"))
    assert cli.main(["bench", "plot", *files, "-o", str(png)]) == 0
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def main() -> None:
    """Serve `FaultyHttp` in "ok" mode on PORT (argv[1]) until interrupted."""
    import uvloop

    port = int(sys.argv[1]) if len(sys.argv) > 1 else 0

    async def serve_forever() -> None:
        loop = asyncio.get_running_loop()
        state = _ServerState("ok", 0, 0.0)
        server = await loop.create_server(lambda: FaultyHttp(state, loop), "127.0.0.1", port)
        print(f"serving on http://127.0.0.1:{server.sockets[0].getsockname()[1]}/", flush=True)
        await server.serve_forever()

    uvloop.run(serve_forever())


if __name__ == "__main__":
    main()


def test_open_loop_rate_counts_the_drain_of_a_server_that_fell_behind(serve, tmp_path):
    """Answers that only arrive after the window (the server fell behind) stretch the
    time the requests took: requests/s is what the server managed, not the offered rate."""
    s = serve("stall", stall_after=150, stall_s=1.0)
    code, report = bench(tmp_path, s.url, "--rate", "200", "--warmup", "0", "--timeout", "10")
    assert code == 0
    assert report.duration_s == 1.0  # the configured window, as before
    assert report.requests >= 150
    assert report.requests_per_s < 0.8 * 200  # the ~0.7 s drain counts


def test_a_plain_http_server_is_named_as_the_first_problem(tmp_path, capsys):
    """Not a JSON-RPC server: the run fails and says what came back, not just a count."""
    import http.server
    import threading

    server = http.server.ThreadingHTTPServer(("127.0.0.1", listen_port()), http.server.SimpleHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        code = cli.main(["bench", f"http://127.0.0.1:{server.server_address[1]}/", "-q", "--duration", "0.3",
                         "--warmup", "0", "-c", "1"])
    finally:
        server.shutdown()
        server.server_close()
    assert code == 1
    assert "first problem: bad answer: HTTP 501" in capsys.readouterr().err


def test_an_unwritable_json_path_is_refused_before_the_run(tmp_path, capsys):
    code = cli.main(["bench", "http://127.0.0.1:1/", "-q", "--json", str(tmp_path / "missing-dir" / "run.json")])
    assert code == 2
    assert "cannot write" in capsys.readouterr().err  # refused up front, before any load


# -- NDJSON stream targets (tcp://, unix://) ------------------------------------------------------

@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A directory with a short path, for Unix sockets (108-byte limit)."""
    d = Path(tempfile.mkdtemp(prefix="lg", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def stream_broker(broker_factory, short_dir) -> tuple[str, str]:
    """A real broker (2 workers) with both NDJSON listeners: (tcp URL, unix URL)."""
    port = free_port()
    sock = short_dir / "b.sock"
    b = broker_factory("--workers", "2", "--stream-port", str(port), "--stream-socket", str(sock))
    assert "serving NDJSON JSON-RPC on unix://" in b.read_log(5.0) or sock.exists()
    return f"tcp://127.0.0.1:{port}", f"unix://{sock}"


BENCH_TOKEN = "bench-token-0123456789abcdef"


@pytest.fixture
def auth_broker(broker_factory) -> tuple[str, str]:
    """A real broker asking for a token (RPC_BROKER_AUTH_TOKENS), with an NDJSON TCP
    listener: (http URL, tcp URL)."""
    port = free_port()
    b = broker_factory("--workers", "1", "--stream-port", str(port),
                       env={"RPC_BROKER_AUTH_TOKENS": f"bench:{BENCH_TOKEN}"})
    return f"http://{b.host}:{b.port}{b.path}", f"tcp://127.0.0.1:{port}"


@pytest.mark.parametrize("transport", ["http", "tcp"])
def test_bench_sends_the_token_of_token_file_and_fails_plainly_when_refused(auth_broker, tmp_path, capsys,
                                                                            transport):
    """New user, round 108: bench could send no token, so against a broker asking for one
    every call was refused, the table said to check --method and --params, and it exited 0.
    --token-file sends it (a header over HTTP, the stream's first line over TCP); a run whose
    every call is refused as unauthorized says so and exits 1."""
    url = auth_broker[0] if transport == "http" else auth_broker[1]
    good, bad = tmp_path / "good.token", tmp_path / "bad.token"
    good.write_text(BENCH_TOKEN + "\n")
    bad.write_text("not-the-token-0123456789abcdef\n")
    code, rep = bench(tmp_path, url, "--token-file", str(good))
    captured = capsys.readouterr()
    assert code == 0, captured.out + captured.err
    assert rep.check.ok and rep.errors_by_code == {} and rep.transport_errors == 0 and rep.requests > 0, rep
    for flags, words in (([], "the server asks for a bearer token: give it with --token-file PATH"),
                         (["--token-file", str(bad)], f"the server does not take the token of --token-file {bad}")):
        code, rep = bench(tmp_path, url, *flags)
        captured = capsys.readouterr()
        assert code == 1, captured.out + captured.err
        assert "first problem: every call was refused as unauthorized" in captured.err, captured.err
        assert words in captured.err, captured.err
        assert "every call was refused as unauthorized" in captured.out  # the table's errors row
        assert "check --method" not in captured.out and "exit status stays 0" not in captured.out
        assert rep.errors_by_code.get("-32600", 0) > 0 or rep.requests == 0, rep
        assert rep.check.ok, rep  # (a stream's refusal of its token line, come before any call: no wrong id)
    for run in tmp_path.glob("run*.json"):
        assert BENCH_TOKEN not in run.read_text()  # the report keeps no secret


def test_a_run_mostly_rate_limited_says_so_and_exits_0_as_errors_do(broker_factory, tmp_path, capsys):
    """New user, round 109: against a token limited to 5 calls/s, 35,646 of 35,651 calls were
    answered -32005, and the table read as a fast clean run. It now says most calls were rate
    limited and what to change; the exit status stays 0, as for any run of error answers
    (they are answers); a run within the limit says nothing of it."""
    b = broker_factory("--workers", "1", "--rate-limit", "5", env={"RPC_BROKER_AUTH_TOKENS": f"bench:{BENCH_TOKEN}"})
    token = tmp_path / "bench.token"
    token.write_text(BENCH_TOKEN + "\n")
    url = f"http://{b.host}:{b.port}{b.path}"
    code, rep = bench(tmp_path, url, "--token-file", str(token))
    captured = capsys.readouterr()
    assert code == 0, captured.out + captured.err
    assert 2 * rep.errors_by_code.get("-32005", 0) > rep.calls > 0, rep
    words = " ".join(captured.out.split())
    assert "most calls were rate limited (-32005): the server's rate_limit for this caller (its token, or its" \
           " address) is below the load: lower --rate (or --connections, --depth), or raise the limit" in words, \
        captured.out
    assert "check --method" not in captured.out  # (not the hint of a run of wrong calls)
    code, rep = bench(tmp_path, url, "--token-file", str(token), "-c", "1", "--rate", "2")  # within the limit
    captured = capsys.readouterr()
    assert code == 0 and rep.calls > 0 and "-32005" not in rep.errors_by_code, rep
    assert "rate limited" not in captured.out, captured.out


@pytest.mark.parametrize(("text", "words"), [
    ("", "empty: put the token in it"),
    (f"bench:{BENCH_TOKEN}\n", "a NAME:TOKEN line: put the token alone in it"),
    (f"{BENCH_TOKEN} {BENCH_TOKEN}\n", "more than one word in it"),
    (f"{BENCH_TOKEN}\u00e9\n", "not a bearer token"),
])
def test_a_bad_token_file_is_refused_before_the_run_without_showing_it(tmp_path, capsys, text, words):
    path = tmp_path / "t.token"
    path.write_text(text)
    assert cli.main(["bench", "http://127.0.0.1:1/", "-q", "--token-file", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"--token-file {path}: {words}" in err, err
    assert BENCH_TOKEN not in err


def test_token_file_errors_for_a_missing_file_and_a_unix_target(tmp_path, capsys):
    assert cli.main(["bench", "http://127.0.0.1:1/", "-q", "--token-file", str(tmp_path / "none")]) == 2
    assert "cannot read it: No such file or directory" in capsys.readouterr().err
    path = tmp_path / "t.token"
    path.write_text(BENCH_TOKEN)
    assert cli.main(["bench", "unix:///tmp/x.sock", "-q", "--token-file", str(path)]) == 2
    assert "a unix:// socket asks for no token" in capsys.readouterr().err


def test_stream_targets_parse():
    t = runner.Target.parse("tcp://127.0.0.1:9000")
    assert (t.scheme, t.host, t.port, t.stream, t.where) == ("tcp", "127.0.0.1", 9000, True, "127.0.0.1:9000")
    t = runner.Target.parse("tcp://[::1]:9000/")
    assert (t.host, t.port) == ("::1", 9000)
    t = runner.Target.parse("unix:///tmp/x.sock")
    assert (t.scheme, t.path, t.stream, t.where) == ("unix", "/tmp/x.sock", True, "unix:///tmp/x.sock")
    assert runner.Target.parse("unix://rel.sock").path == "rel.sock"
    assert not runner.Target.parse("http://h/").stream
    for bad, words in [("tcp://127.0.0.1", "no port"), ("tcp://h:1/x", "no path"), ("tcp://h:1?q", "no path"),
                       ("unix://", "no socket path"), ("unix:///" + "x" * 110, "too long"),
                       ("udp://h:1", "tcp://host:port")]:
        with pytest.raises(runner.RunError, match=words):
            runner.Target.parse(bad)


def test_body_of_id_inverts_the_id_numbering():
    """On a stream an answer whose body is not in flight is a duplicate when its id was
    sent on the connection, else a wrong id: the id numbering must be invertible."""
    for ids in ("int", "string", "large", "repeated"):
        for batch, calls in ((1, [Call("add", "[1]")]), (4, [Call("add", "[1]"), Call("u", "[1]", 1.0, True)])):
            w = Workload(calls, batch=batch, ids=ids)  # type: ignore[arg-type]
            for k in range(50):
                exp = w.body(k)[1]
                for id_ in (bytes(exp),) if isinstance(exp, msgspec.Raw) else exp.ids:
                    assert w.body_of_id(id_) == k, (ids, batch, k, id_)
            for never in (b'"not-an-id-we-sent"', b"null", b"1.5", b"-1", b'"r-1"', b"[1]"):
                assert w.body_of_id(never) is None, (ids, never)


def test_real_broker_stream_closed_loop_tcp_and_unix(stream_broker, tmp_path):
    tcp, unix = stream_broker
    mix = tmp_path / "mix.json"
    mix.write_text(json.dumps([
        {"method": "add", "params": [1, 2], "weight": 3},
        {"method": "update", "params": [1], "notification": True},
        {"method": "no_such_method"},
    ]))
    runs = [
        (tcp, ["-d", "4"]),
        (unix, ["-d", "4", "--pipeline", "2"]),
        (unix, ["--batch", "10", "--ids", "large"]),
        (tcp, ["--batch", "5", "--ids", "repeated", "-d", "2"]),
        (tcp, ["--ids", "string", "--method", "echo", "--params", '{"a":[1,2]}']),
        (unix, ["--mix", str(mix), "--batch", "3", "-d", "2"]),
        (tcp, ["--mix", str(mix)]),
    ]
    for url, flags in runs:
        code, rep = bench(tmp_path, url, *flags)
        assert code == 0, (url, flags, rep)
        assert rep.check.ok and rep.transport_errors == 0 and rep.requests > 0, (url, flags, rep)
        assert rep.latency_ms.p50 > 0 and rep.target == url
        if "--mix" in flags:
            assert rep.errors_by_code.get("-32601", 0) > 0, flags
        else:
            assert rep.errors_by_code == {}, flags
    # a body of only notifications gets no line: done once written, nothing to match
    code, rep = bench(tmp_path, tcp, "--mix", str(_notif(tmp_path)), "-c", "1")
    assert code == 0 and rep.check.ok and rep.requests > 0


def test_real_broker_stream_open_loop_two_processes(stream_broker, tmp_path):
    tcp, _unix = stream_broker
    code, rep = bench(tmp_path, tcp, "--rate", "400", "-P", "2", "-d", "4")
    assert code == 0 and rep.check.ok and rep.transport_errors == 0
    assert rep.mode == "open" and rep.processes == 2
    assert 0.8 * 400 <= rep.requests <= 400  # 400/s over the 1 s window, both processes merged


def test_stream_answers_out_of_order_are_matched_by_id(serve, tmp_path):
    s = serve("shuffle", ndjson=True)
    for flags in (["-d", "8"], ["-d", "4", "--batch", "3", "--ids", "large"], ["--rate", "400", "-d", "4"]):
        code, rep = bench(tmp_path, s.url, *flags)
        assert code == 0 and rep.check.ok and rep.transport_errors == 0 and rep.requests > 0, (flags, rep)
    assert s.state.held > 0  # answers really were overtaken


def test_stream_lines_split_across_reads_and_crlf(serve, tmp_path):
    s = serve("split", ndjson=True)
    code, rep = bench(tmp_path, s.url, "-d", "4", "--batch", "2")
    assert code == 0 and rep.check.ok and rep.transport_errors == 0 and rep.requests > 0


@pytest.mark.parametrize(("mode", "flags", "counter", "words"), [
    ("silent", ["-d", "4"], "transport_errors", "first problem: no answer to id "),
    ("wrong_id", ["-d", "4"], "wrong_id", "first problem: an answer with an id nobody is waiting for"),
    ("wrong_id", ["-d", "1"], "wrong_id", "first problem: an answer with an id nobody is waiting for"),
    ("duplicate", ["-d", "4"], "duplicate", "first problem: a duplicate answer"),
    ("malformed", ["-d", "4"], "malformed", "first problem: malformed answer line"),
    ("missing", ["-d", "2", "--batch", "4"], "missing", "first problem: bad answer line"),
    ("close", ["-d", "4"], "transport_errors", "first problem: connection lost with"),
])
def test_stream_wrong_answers_are_caught(serve, tmp_path, capsys, mode, flags, counter, words):
    """A faulty NDJSON server spoils every 25th line in one way: each is caught, the run
    exits 1 and names the first problem; nothing else is counted."""
    s = serve(mode, ndjson=True)
    code, rep = bench(tmp_path, s.url, "--timeout", "1", *flags)
    assert code == 1
    err = capsys.readouterr().err
    assert words in err, err
    counts = {"wrong_id": rep.check.wrong_id, "missing": rep.check.missing, "duplicate": rep.check.duplicate,
              "malformed": rep.check.malformed, "transport_errors": rep.transport_errors}
    assert counts.pop(counter) > 0, counts
    assert set(counts.values()) == {0}, counts  # a stray line stands in for the call it spoiled
    assert rep.requests > 0


def test_stream_nothing_listening(short_dir, capsys):
    sock = short_dir / "none.sock"
    code = cli.main(["bench", f"unix://{sock}", "-q", "--duration", "0.3", "--warmup", "0", "-c", "1",
                     "--timeout", "2"])
    assert code == 1
    assert f"first problem: cannot connect to unix://{sock}" in capsys.readouterr().err


# -- the final report: requests never sent, batches refused whole, 80 columns ---------------------

def test_open_loop_requests_never_sent_are_in_the_json(serve, tmp_path):
    """The server stops answering after its 20th request: each connection's one slot
    stays taken until --timeout gives it up, so most of the schedule is never sent.
    Every planned request is accounted for once: answered, lost, or never sent."""
    s = serve("stall", stall_after=20, stall_s=600.0)
    rate, connections = 200, 2
    code, rep = bench(tmp_path, s.url, "--rate", str(rate), "-c", str(connections), "--warmup", "0",
                      "--timeout", "0.3")
    assert code == 1  # lost requests are transport errors
    assert rep.unsent_requests > 0 and rep.transport_errors > 0 and rep.requests >= 19
    planned = schedule.planned(rate, connections, rep.duration_s)
    assert rep.requests + rep.transport_errors + rep.unsent_requests == planned
    # a closed loop has no schedule: nothing is ever "due but unsent"
    code, rep = bench(tmp_path, serve("ok").url)
    assert code == 0 and rep.unsent_requests == 0


def test_a_batch_over_the_brokers_max_batch_is_one_refused_request(broker_factory, broker, tmp_path):
    """A broker refuses a batch past its max_batch with one -32600 error object (not an
    array). The run counts what happened: one answered request per batch, one error under
    -32600, one refused batch, and no calls (none ran). It is an answer, not a wrong one:
    exit 0, as for single calls answered with errors. Over HTTP and NDJSON, with one and
    two load processes; and a batch that fits still counts all its calls."""
    port = free_port()
    b = broker_factory("--workers", "1", "--max-batch", "4", "--stream-port", str(port))
    wait_for(lambda: "serving NDJSON JSON-RPC on tcp://" in b.read_log())
    http = f"http://{b.host}:{b.port}{b.path}"
    for url in (http, f"tcp://127.0.0.1:{port}"):
        code, rep = bench(tmp_path, url, "--batch", "4", "-c", "2")
        assert code == 0 and rep.check.ok and rep.transport_errors == 0, (url, rep)
        assert rep.requests > 0 and rep.calls == 4 * rep.requests and rep.refused_batches == 0
        assert rep.errors_by_code == {}
        for flags in (["--batch", "5", "-c", "2"], ["--batch", "5", "-c", "2", "-P", "2", "-d", "2"]):
            code, rep = bench(tmp_path, url, *flags)
            assert code == 0 and rep.check.ok and rep.transport_errors == 0, (url, flags, rep)
            assert rep.requests > 0 and rep.refused_batches == rep.requests, (url, flags, rep)
            assert rep.errors_by_code == {"-32600": rep.requests}
            assert rep.calls == 0 and rep.calls_per_s == 0.0
    # a batch of only notifications refused whole: the same (HTTP answers every body)
    code, rep = bench(tmp_path, http, "--mix", str(_notif(tmp_path)), "--batch", "5", "-c", "2")
    assert code == 0 and rep.check.ok and rep.requests > 0
    assert (rep.refused_batches, rep.calls, rep.errors_by_code) == (rep.requests, 0, {"-32600": rep.requests})
    # the case as users meet it: --batch 1001 against the default max_batch of 1000
    code, rep = bench(tmp_path, f"http://{broker.host}:{broker.port}{broker.path}", "--batch", "1001", "-c", "2")
    assert code == 0 and rep.check.ok and rep.requests > 0
    assert (rep.refused_batches, rep.calls, rep.errors_by_code) == (rep.requests, 0, {"-32600": rep.requests})


TABLE_LABELS = ("load", "workload", "requests/s", "calls/s", "JSON-RPC errors", "check failures", "transport errors",
                "latency ms")


def _bench_piped(tmp_path: Path, columns: str | None, url: str, *flags: str) -> tuple[int, str, Report]:
    """Run `rpc-broker bench` in a child process with its stdout a pipe (COLUMNS unset or
    set); return its exit code, what it printed and its --json report."""
    out = tmp_path / f"piped{len(list(tmp_path.glob('piped*.json')))}.json"
    env = {k: v for k, v in os.environ.items()
           if k not in ("COLUMNS", "LINES", "FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE")}
    if columns is not None:
        env["COLUMNS"] = columns
    done = subprocess.run([sys.executable, "-m", "broker", "bench", url, "--json", str(out), "-c", "2",
                           "--duration", "0.5", "--warmup", "0.1", *flags],
                          cwd=ROOT, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode in (0, 1), done.stderr
    return done.returncode, done.stdout, Report.from_json(out.read_bytes())


def _figures(rep: Report) -> list[str]:
    """Every figure of the report, as the table writes it."""
    c, lat = rep.check, rep.latency_ms
    figures = [f"rpc-broker bench: {rep.target}", f"{rep.connections} connections", f"batch {rep.batch}",
               f"{rep.duration_s:g} s measured after {rep.warmup_s:g} s warm-up",
               f"requests/s {rep.requests_per_s:,.1f} ({rep.requests:,} request",
               f"calls/s {rep.calls_per_s:,.1f} ({rep.calls:,} call",
               "JSON-RPC errors " + (", ".join(f"{k}: {n:,}" for k, n in rep.errors_by_code.items()) or "none"),
               f"check failures wrong id {c.wrong_id:,}, missing {c.missing:,}, duplicate {c.duplicate:,}, "
               f"malformed {c.malformed:,}",
               f"transport errors {rep.transport_errors:,}"]
    if rep.refused_batches:
        figures.append(f"refused batches {rep.refused_batches:,} (each answered by one error")
    if rep.unsent_requests:
        figures.append(f"never sent {rep.unsent_requests:,} scheduled requests")
    if lat.p50 is not None:
        figures += [f"p50 {lat.p50:.3f} p90 {lat.p90:.3f} p99 {lat.p99:.3f}",
                    f"p99.9 {lat.p99_9:.3f} max {lat.max:.3f} mean {lat.mean:.3f}"]
    else:
        figures.append("latency ms n/a (no answer was measured)")
    return figures


@pytest.mark.parametrize("columns", [None, "80"], ids=["COLUMNS-unset", "COLUMNS-80"])
def test_final_table_fits_80_columns_in_a_pipe(serve, broker_factory, tmp_path, columns):
    """The final table read from a pipe (as in CI logs) or an 80-column terminal: no line
    past 80 characters, each label whole at the start of its line, every figure there.
    Three runs fill every row: an open loop against a server that stops answering (lost
    and never-sent requests, a first problem), batches a broker refuses whole (errors by
    code), and wrong ids (check failures, a long first problem that must wrap)."""
    b = broker_factory("--workers", "1", "--max-batch", "4")
    runs = [
        (serve("stall", stall_after=20, stall_s=600.0).url, ["--rate", "200", "--timeout", "0.3"], 1),
        (f"http://{b.host}:{b.port}{b.path}", ["--batch", "5", "-P", "2"], 0),
        (serve("wrong_id").url, ["--batch", "4"], 1),
    ]
    for url, flags, expected in runs:
        code, stdout, rep = _bench_piped(tmp_path, columns, url, *flags)
        assert code == expected, stdout
        lines = stdout.splitlines()
        assert "\x1b" not in stdout  # no colour codes into a pipe
        assert max(len(line) for line in lines) <= 80, stdout
        assert all(line == line.rstrip() for line in lines), stdout  # (round 37: padded to 80 with spaces)
        for label in TABLE_LABELS:
            assert any(line.startswith(f"{label} ") for line in lines), (label, stdout)
        flat = " ".join(stdout.split())  # values that wrapped inside their column read on
        for figure in _figures(rep):
            assert figure in flat, (figure, stdout)
        if code:
            assert any(line.startswith("first problem ") for line in lines), stdout
    assert rep.check.wrong_id > 0  # the last run


# runner robustness ------------------------------------------------------------------------------
# Refused and closed connections, interrupts, the drain, reconnects, counting across transports.

class _OneShotHttp(_HttpServer):
    """Answers each request with one JSON-RPC result (its own id) and `Connection: close`,
    then closes: every answer is complete and announces the close (as a server that
    does not keep connections alive, or a 413, does). `CONNECTION` is the header sent."""

    CONNECTION = b"close"

    def on_message_complete(self) -> None:
        request = json.loads(b"".join(self.body))
        self.body.clear()
        payload = json.dumps({"jsonrpc": "2.0", "id": request["id"], "result": 3}).encode()
        assert self.transport is not None
        if not self.transport.is_closing():
            self.transport.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: %s\r\n"
                                 b"Content-Length: %d\r\n\r\n%s" % (self.CONNECTION, len(payload), payload))
            self.transport.close()


class _WrongIds(asyncio.Protocol):
    """Answers every request body, over HTTP or NDJSON, with a result whose id was never sent."""

    ANSWER = b'{"jsonrpc":"2.0","id":"not-an-id-we-sent","result":3}'

    def __init__(self, ndjson: bool) -> None:
        self.ndjson = ndjson
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.buffer = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        assert self.transport is not None
        if not self.ndjson:
            self.parser.feed_data(data)
            return
        *lines, self.buffer = (self.buffer + data).split(b"\n")
        self.transport.write(b"".join(self.ANSWER + b"\n" for _ in lines))

    def on_message_complete(self) -> None:
        assert self.transport is not None
        self.transport.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                             % (len(self.ANSWER), self.ANSWER))


@pytest.fixture
def thread_server() -> Iterator[typing.Callable[[typing.Callable[[], asyncio.Protocol]], _ThreadServer]]:
    servers: list[_ThreadServer] = []

    def start(factory: typing.Callable[[], asyncio.Protocol]) -> _ThreadServer:
        servers.append(_ThreadServer(factory))
        return servers[-1]

    yield start
    for s in servers:
        s.stop()


def test_connections_past_the_brokers_max_connections_are_refused_not_a_crash(broker_factory, tmp_path, capsys):
    """A broker with --max-connections 2 answers the connections past it (and its few
    probe-only spares) 503 and closes them, some before the generator starts sending.
    None of them is written to once closed; each refusal is a transport error named as
    such; the run ends with its table and exit 1."""
    b = broker_factory("--workers", "1", "--max-connections", "2")
    out = tmp_path / "refused.json"
    code = cli.main(["bench", f"http://{b.host}:{b.port}{b.path}", "-c", "40", "--duration", "1",
                     "--warmup", "0", "--timeout", "5", "--json", str(out)])
    captured = capsys.readouterr()
    assert code == 1, captured.err
    assert "first problem: the server refused the connection: HTTP 503" in captured.err, captured.err
    assert "transport errors" in captured.out  # the table
    rep = Report.from_json(out.read_bytes())
    assert rep.transport_errors > 0 and rep.requests > 0  # the two it kept were served
    assert not rep.interrupted


def test_reconnects_after_an_orderly_close_at_once_and_back_off_after_failures(thread_server):
    """A server that answers once with `Connection: close` and closes: the generator
    reopens at once (no back-off taken), and the run is clean. With nothing listening,
    every reconnect waits (backs off) first."""
    s = thread_server(_OneShotHttp)
    spec = runner.Spec(target=f"http://127.0.0.1:{s.port}/", calls=[Call("add", "[1,2]")], connections=2,
                       duration=1.0, warmup=0.0, timeout=5.0)
    results = runner.run(spec)
    tally = merge(results)[0]
    assert tally.failures == 0 and tally.transport_errors == 0, tally.first_problem
    reconnects = sum(r.reconnects for r in results)
    assert reconnects > 0 and sum(r.backoffs for r in results) == 0
    assert tally.requests >= reconnects  # one answer per connection, each one reopened
    assert s.connections >= reconnects
    port = free_port()
    spec = msgspec.structs.replace(spec, target=f"http://127.0.0.1:{port}/", duration=0.5)
    results = runner.run(spec)
    assert sum(r.reconnects for r in results) == sum(r.backoffs for r in results) > 0


@pytest.mark.parametrize(("ndjson", "flags"), [(False, ["-d", "1"]), (False, ["-d", "4"]),
                                                (True, ["-d", "1"]), (True, ["-d", "4"])])
def test_wrong_ids_count_as_answered_requests_on_every_transport(thread_server, tmp_path, ndjson, flags):
    """Every answer carries an id never sent: over HTTP and over a tcp:// stream alike,
    each counts once in requests (it was answered) and once in wrong_id, and the run
    fails."""
    s = thread_server(lambda: _WrongIds(ndjson))
    url = f"tcp://127.0.0.1:{s.port}" if ndjson else f"http://127.0.0.1:{s.port}/"
    code, rep = bench(tmp_path, url, "--warmup", "0", "--timeout", "2", *flags)
    assert code == 1
    assert rep.check.wrong_id > 0 and rep.requests == rep.check.wrong_id, rep
    assert (rep.check.missing, rep.check.duplicate, rep.check.malformed, rep.transport_errors) == (0, 0, 0, 0)


def test_http_against_a_non_http_port_names_the_problem(broker_factory, capsys):
    """`bench http://` pointed at the broker's NDJSON port: the answer is not HTTP, and
    the first problem says so and shows what came back."""
    port = free_port()
    b = broker_factory("--workers", "1", "--stream-port", str(port))
    wait_for(lambda: "serving NDJSON JSON-RPC on tcp://" in b.read_log())
    code = cli.main(["bench", f"http://127.0.0.1:{port}/", "-q", "--duration", "0.5", "--warmup", "0",
                     "-c", "2", "--timeout", "2"])
    assert code == 1
    err = capsys.readouterr().err
    assert "first problem: not an HTTP response (" in err and "it began b'" in err, err


def test_open_loop_sends_nothing_after_the_window(serve, tmp_path):
    """The server holds its answers from its 20th request for 1.5 s, past the end of the
    1 s window: the backlog of requests due during the stall is never sent (not sent in
    the drain either), the drain waits only for the two held answers, and the run is
    clean: every request sent was answered and counted."""
    s = serve("stall", stall_after=20, stall_s=1.5)
    rate, connections = 200, 2
    code, rep = bench(tmp_path, s.url, "--rate", str(rate), "-c", str(connections), "--warmup", "0",
                      "--timeout", "5")
    assert code == 0, rep
    assert rep.transport_errors == 0 and rep.check.ok
    assert rep.unsent_requests > 0
    assert rep.requests == s.state.requests  # nothing was sent beyond what was answered
    assert rep.requests + rep.unsent_requests == schedule.planned(rate, connections, rep.duration_s)


def _bench_process(url: str, out: Path, *flags: str) -> subprocess.Popen[str]:
    """`rpc-broker bench` in its own session (so a signal can go to its process group)."""
    return subprocess.Popen([sys.executable, "-m", "broker", "bench", url, "--json", str(out), "-c", "4",
                             "--duration", "20", "--warmup", "0", "--timeout", "5", *flags],
                            cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def _load_processes(pid: int) -> list[int]:
    """The load processes of bench ``pid`` (its spawned children, not the resource tracker)."""
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        children = [int(p) for p in f.read().split()]
    return [c for c in children if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]


@pytest.mark.parametrize(("processes", "how", "expected"), [
    (1, "SIGINT", 130), (1, "SIGTERM", 143), (2, "group SIGINT", 130), (2, "group SIGTERM", 143),
    (2, "kill -9 one load process", 1),
])
def test_an_interrupted_run_reports_what_it_measured(serve, tmp_path, processes, how, expected):
    """Interrupted mid-run (a 20 s run, stopped once answers flow), the generator stops
    sending, drains briefly, prints the table of the window it really measured, writes
    --json with "interrupted": true, and exits 128 + the signal (1 when a load process
    was killed: the survivors are stopped and still reported). No traceback from any
    process."""
    s = serve("ok")
    out = tmp_path / "cut.json"
    proc = _bench_process(s.url, out, "-P", str(processes))
    try:
        wait_for(lambda: s.state.requests > 500, timeout=60)
        if how == "kill -9 one load process":
            os.kill(_load_processes(proc.pid)[0], signal.SIGKILL)
        elif how.startswith("group "):
            os.killpg(proc.pid, getattr(signal, how.split()[1]))
        else:
            proc.send_signal(getattr(signal, how))
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == expected, stderr
    assert "Traceback" not in stderr and "Error" not in stderr.replace("errors", ""), stderr
    assert "transport errors" in stdout  # the table
    assert ("died" if expected == 1 else f"interrupted by {how.split()[-1]}") in stderr, stderr
    rep = Report.from_json(out.read_bytes())
    assert rep.interrupted and rep.requests > 0 and 0 < rep.duration_s < 20
    if expected != 1:
        assert rep.check.ok and rep.transport_errors == 0, rep


# validation and report ---------------------------------------------------------------------------
# Parse-time bounds, null latencies, calls answered, the plot's inputs and formats, -q, --json,
# the workload in the JSON, --help, NaN params, the progress line and the table's wording.

def _refused_flag(capsys, *flags: str) -> str:
    """Run `bench` with `flags` against a port nothing listens on; it must exit 2 at once."""
    assert cli.main(["bench", "http://127.0.0.1:1/", "-q", *flags]) == 2, flags
    return capsys.readouterr().err


@pytest.mark.parametrize(("flags", "words"), [
    (["--rate", "inf"], "argument -R/--rate: must be a finite number, got inf"),
    (["--rate", "nan"], "argument -R/--rate: must be a finite number, got nan"),
    (["--rate", "1e300"], "argument -R/--rate: must be <= 10,000,000 requests/s, got 1e300"),
    (["--rate", "1e15"], "argument -R/--rate: must be <= 10,000,000 requests/s, got 1e15"),
    (["--rate", "0"], "argument -R/--rate: must be > 0, got 0"),
    (["--rate", "fast"], "argument -R/--rate: not a number: 'fast'"),
    (["--duration", "inf"], "argument --duration: must be a finite number, got inf"),
    (["--duration", "86401"], "argument --duration: must be <= 86,400 s (one day), got 86401"),
    (["--warmup", "inf"], "argument --warmup: must be a finite number, got inf"),
    (["--warmup=-1"], "argument --warmup: must be >= 0, got -1"),
    (["--timeout", "1e9"], "argument --timeout: must be <= 86,400 s (one day), got 1e9"),
    (["--timeout=-inf"], "argument --timeout: must be a finite number, got -inf"),
    (["--rate", "100", "--pipeline", "2"], "--pipeline is for the closed loop; with --rate"),
    (["--rate", "100", "--pipeline", "1"], "--pipeline is for the closed loop; with --rate"),
], ids=lambda v: "_".join(v) if isinstance(v, list) else "")
def test_bad_load_flags_are_refused_at_parse_time(capsys, flags, words):
    """inf crashed (ZeroDivisionError), 1e300 hung, 1e15 reported a quadrillion requests
    never sent, inf durations ran forever: all are refused before anything starts."""
    err = _refused_flag(capsys, *flags)
    assert words in err, err


def test_port_0_in_a_target_is_refused(capsys):
    for url in ("http://127.0.0.1:0/", "tcp://127.0.0.1:0"):
        assert cli.main(["bench", url, "-q"]) == 2, url
        assert f"port 0 in {url!r}" in capsys.readouterr().err


def test_schedule_due_refuses_what_it_cannot_count_and_never_spins():
    for rate in (math.inf, math.nan, 0.0, -1.0):
        with pytest.raises(ValueError):
            schedule.connection_timing(rate, 4, 0)
    for interval in (0.0, math.inf, math.nan, -0.1):
        with pytest.raises(ValueError):
            schedule.due(0.0, 0.0, interval, 0, 1.0, 2.0)
    # 1e300 requests/s: the span is past float precision; refused at once, not looped over
    phase, interval = schedule.connection_timing(1e300, 1, 0)
    with pytest.raises(ValueError, match="too long"):
        schedule.due(0.0, phase, interval, 0, 1.0, 2.0)
    with pytest.raises(ValueError):
        schedule.due(0.0, 0.0, 0.1, 0, math.inf, math.inf)
    # the bounds the CLI allows stay exact: 10,000,000 requests/s for a day
    phase, interval = schedule.connection_timing(10_000_000.0, 1, 0)
    assert schedule.due(0.0, phase, interval, 0, 86_400.0, 86_400.0) == 864_000_000_000
    assert schedule.due(0.0, 0.0, 0.1, 0, 0.35, math.inf) == 4  # t_end inf, now finite: fine


def test_no_answers_is_null_latency_not_zero(tmp_path, capsys):
    """Nothing listening: no latency was measured, so the JSON says null (not 0.0, which a
    script would read as a perfect p99) and the table says n/a."""
    out = tmp_path / "refused.json"
    sock = socket.socket()
    sock.bind(("127.0.0.1", listen_port()))
    port = sock.getsockname()[1]
    sock.close()
    code = cli.main(["bench", f"http://127.0.0.1:{port}/", "-q", "--duration", "0.3", "--warmup", "0",
                     "-c", "2", "--timeout", "2", "--json", str(out)])
    assert code == 1
    data = json.loads(out.read_bytes())
    assert data["latency_ms"] == {"p50": None, "p90": None, "p99": None, "p99.9": None, "max": None,
                                  "mean": None}
    assert data["percentiles"] == [] and data["requests"] == 0 and data["calls"] == 0
    assert "latency ms n/a (no answer was measured)" in " ".join(capsys.readouterr().out.split())
    # older files (floats everywhere) still load under the same schema name
    older = json.loads(_saved_report().to_json())
    for key in ("pipeline", "timeout_s", "ids", "seed", "workload", "calls_counted"):
        del older[key]
    rep = Report.from_json(json.dumps(older).encode())
    assert rep.schema == SCHEMA and rep.latency_ms.p99 == 2.0 and rep.calls_counted == "sent"
    assert rep.workload is None and rep.timeout_s is None


def test_a_notification_only_load_has_no_latency_and_counts_what_was_written(serve, tmp_path, capsys):
    """On a stream a body of notifications gets no line: done once written, no latency
    (null and n/a, not 0.000), and the table says the rate is of requests written."""
    s = serve("ok", ndjson=True)
    code, rep = bench(tmp_path, s.url, "--mix", str(_notif(tmp_path)), "-c", "1")
    assert code == 0 and rep.requests > 0 and rep.calls == rep.requests
    assert rep.latency_ms.p50 is None and rep.latency_ms.max is None and rep.percentiles == []
    flat = " ".join(capsys.readouterr().out.split())
    assert f"({rep.requests:,} requests written; notifications only: no answer is expected)" in flat
    assert f"({rep.calls:,} notifications written)" in flat
    assert "latency ms n/a (notifications only: no answer to time)" in flat and "0.000" not in flat
    # over HTTP each such body is answered by an empty 204: a real latency, and "answered"
    code, rep = bench(tmp_path, serve("ok").url, "--mix", str(_notif(tmp_path)), "-c", "1")
    assert code == 0 and rep.requests > 0 and rep.latency_ms.p50 is not None
    flat = " ".join(capsys.readouterr().out.split())
    assert f"({rep.requests:,} requests answered, empty: notifications only)" in flat


def test_calls_are_calls_answered(serve, tmp_path):
    """The server drops the last answer of every 25th batch: those calls were sent, not
    answered, and calls/s leaves them out (it counted them before)."""
    s = serve("missing")
    code, rep = bench(tmp_path, s.url, "--batch", "4", "--warmup", "0", "-c", "2")
    assert code == 1 and rep.check.missing > 0 and rep.calls_counted == "answered"
    assert rep.calls == 4 * rep.requests - rep.check.missing
    assert rep.calls_per_s == pytest.approx(rep.requests_per_s * rep.calls / rep.requests)
    # sans-IO: an object answering a batch of 4 answers no call; a wrong id answers none;
    # an "id": null error to a single call (refused for size) is one call answered
    four = Expect(True, (b"1", b"2", b"3", b"4"), 4)
    assert _check(200, _r("1").encode(), four).calls == 0
    assert _check(200, f"[{_r('1')},{_r('2')},{_r('3')},{_r('9')}]".encode(), four).calls == 3
    t = _check(400, REFUSED, ONE)
    assert (t.calls, t.errors_by_code) == (1, {-32600: 1})
    assert _check(400, REFUSED, four).calls == 0  # a batch refused whole: none ran
    # a duplicate answer takes nothing back; notifications count once written
    mixed = Expect(True, (b"1", b"2"), 3)
    assert _check(200, f"[{_r('1')},{_r('2')},{_r('2')}]".encode(), mixed).calls == 3
    assert _check(200, f"[{_r('1')}]".encode(), mixed).calls == 2
    # the stream reader's decoded path agrees
    t = Tally()
    line = f"[{_r('1')}]".encode()
    Checker(t).check_line(line, mixed, msgspec.json.decode(line, type=Answer | list[Answer]))
    assert (t.calls, t.missing) == (2, 1)


def test_quiet_keeps_the_table_and_the_json_records_the_workload(serve, tmp_path, capsys):
    s = serve("ok")
    mix = tmp_path / "mix.json"
    mix.write_text(json.dumps([{"method": "add", "params": [1, 2], "weight": 3},
                               {"method": "update", "params": {"a": 1.5e3}, "notification": True}]))
    code, rep = bench(tmp_path, s.url, "--mix", str(mix), "--batch", "3", "--ids", "large", "-d", "2",
                      "--pipeline", "2", "--timeout", "5", "--seed", "7")
    assert code == 0
    out = capsys.readouterr().out
    assert "calls/s" in out and "latency ms" in out  # -q with --json: the table is still printed
    assert re.search(r"\nworkload +--mix", out)  # (new user, round 76)
    assert "add x3, update (notification)" in " ".join(out.split())
    assert (rep.depth, rep.pipeline, rep.ids, rep.seed, rep.timeout_s, rep.batch) == (2, 2, "large", 7, 5.0, 3)
    assert rep.workload is not None and rep.workload.mix == str(mix)
    assert [(c.method, c.params, c.weight, c.notification) for c in rep.workload.calls] == [
        ("add", [1, 2], 3.0, False), ("update", {"a": 1500.0}, 1.0, True)]
    code, rep = bench(tmp_path, s.url, "--method", "echo", "--params", '{"x":[1]}', "--rate", "100")
    assert code == 0 and rep.workload is not None and rep.workload.mix is None
    assert [(c.method, c.params) for c in rep.workload.calls] == [("echo", {"x": [1]})]
    assert re.search(r'\nworkload +echo\(\{"x":\[1\]\}\)\n', capsys.readouterr().out)
    assert (rep.rate, rep.pipeline, rep.mode, rep.connections, rep.processes) == (100.0, 1, "open", 4, 1)
    assert rep.target == s.url and rep.warmup_s == 0.2 and rep.duration_s == 1.0


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_json_write_failure_after_the_run_is_exit_1(serve, capsys):
    s = serve("ok")
    code = cli.main(["bench", s.url, "-q", "--json", "/dev/full", "--duration", "0.2", "--warmup", "0",
                     "-c", "1"])
    assert code == 1
    assert "rpc-broker bench: cannot write /dev/full: No space left on device" in capsys.readouterr().err


def test_json_path_is_opened_before_the_load_and_a_probe_leaves_nothing(tmp_path, capsys):
    new = tmp_path / "new.json"
    # refused later (bad -P) after the --json probe: the probe's empty file is not left behind
    assert cli.main(["bench", "http://127.0.0.1:1/", "-q", "--json", str(new), "-c", "1", "-P", "2"]) == 2
    assert not new.exists()
    old = tmp_path / "old.json"
    old.write_text("kept")
    assert cli.main(["bench", "http://127.0.0.1:1/", "-q", "--json", str(old), "-c", "1", "-P", "2"]) == 2
    assert old.read_text() == "kept"
    assert cli.main(["bench", "http://127.0.0.1:1/", "-q", "--json", str(tmp_path)]) == 2
    assert f"cannot write {tmp_path}: Is a directory" in capsys.readouterr().err


def test_help_lists_exit_codes_and_the_longest_run(capsys):
    assert cli.main(["bench", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    for words in ("Exit codes:", "0 every answer was checked and right", "1 a check failed",
                  "2 bad usage", "130/143 interrupted by SIGINT/SIGTERM",
                  "a run lasts up to --warmup + --duration + --timeout",
                  "the final table is still printed", "at most 10,000,000", "at most 86400"):
        assert words in text, words


@pytest.mark.parametrize(("name", "text", "key"), [
    ("nan.json", '[{"method": "a", "params": [1, NaN]}]', "'params[1]': nan"),
    ("inf.json", '[{"method": "a", "params": {"x": {"y": -Infinity}}}]', "'params.x.y': -inf"),
    ("nan.toml", '[[call]]\nmethod = "a"\nparams = [1, nan]\n', "'params[1]': nan"),
    ("inf.toml", '[[call]]\nmethod = "a"\nparams = {x = inf}\n', "'params.x': inf"),
])
def test_non_finite_numbers_in_mix_params_are_refused(tmp_path, capsys, name, text, key):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(MixError, match=re.escape(f"key {key} is not a JSON number")):
        load_mix(path)
    assert cli.main(["bench", "http://127.0.0.1:1/", "-q", "--mix", str(path)]) == 2
    assert f"mix file {path}: " in capsys.readouterr().err


def test_plot_warns_about_runs_without_a_curve_and_writes_the_suffix_format(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    good = tmp_path / "run.json"
    good.write_bytes(_saved_report().to_json())
    refused = tmp_path / "refused.json"
    refused.write_bytes(_saved_report(requests=0).to_json())
    png = tmp_path / "mixed.png"
    assert cli.main(["bench", "plot", str(refused), str(good), "-o", str(png)]) == 0
    captured = capsys.readouterr()
    assert captured.err == (f"rpc-broker bench plot: warning: {refused}: no latency curve (no answer was "
                            "measured); left out of the chart\n")
    assert captured.out == f"wrote {png}\n" and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for suffix, magic in ((".pdf", b"%PDF"), (".svg", b"<svg"), (".PNG", b"\x89PNG")):
        out = tmp_path / f"chart{suffix}"
        assert cli.main(["bench", "plot", str(good), "-o", str(out)]) == 0
        assert magic in out.read_bytes()[:400], suffix
    for name in ("chart.xyz", "chart"):
        out = tmp_path / name
        assert cli.main(["bench", "plot", str(good), "-o", str(out)]) == 2
        err = capsys.readouterr().err
        assert f"cannot write {out}: unknown image format" in err and ".png, .pdf or .svg" in err, err
        others = err.split("(or ", 1)[1].split(")", 1)[0].split(", ")
        assert not {".png", ".pdf", ".svg"} & set(others), err  # each named once
        assert not out.exists()


@pytest.mark.parametrize(("curve", "key"), [
    ([[50.0, 1.0], [150.0, 2.0]], "key 'percentiles[1][0]': Expected `float` <= 100.0"),
    ([[-1.0, 1.0]], "key 'percentiles[0][0]': Expected `float` >= 0.0"),
    ([[50.0, -2.0]], "key 'percentiles[0][1]': Expected `float` >= 0.0"),
    # (hostile testing, round 11: 1.7e308 ms, finite, overflowed matplotlib's axis: a traceback)
    ([[50.0, 1.0], [99.0, 1.7e308]], "key 'percentiles[1][1]': Expected `float` <= 1000000000000.0"),
])
def test_plot_refuses_percentiles_outside_0_to_100(tmp_path, capsys, curve, key):
    bad = tmp_path / "bad.json"
    bad.write_text(_edit(percentiles=curve))
    assert cli.main(["bench", "plot", str(bad), "-o", str(tmp_path / "out.png")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"rpc-broker bench plot: input file {bad}: ") and key in err, err


def test_plot_draws_a_latency_at_the_schema_bound(tmp_path, capsys):
    """1e12 ms, the largest latency the schema takes, is drawn (1.7e308 overflowed)."""
    report = tmp_path / "far.json"
    report.write_text(_edit(percentiles=[[50.0, 1.0], [99.0, 1e12]]))
    out = tmp_path / "far.png"
    assert cli.main(["bench", "plot", str(report), "-o", str(out)]) == 0, capsys.readouterr().err
    assert out.stat().st_size > 0


def test_progress_line_fits_80_columns():
    from broker.loadgen.report import PROGRESS_WIDTH, progress_line

    typical = progress_line(runner.Progress(512_345, 12, 0, 3, 1.234), 10.0)
    assert typical == "  10.0 s  51,234 calls/s  errors 12  failures 0  transport 3  p99 1.234 ms"
    assert progress_line(runner.Progress(5, 0, 0, 0, 0.0), 1.0) == (
        "   1.0 s  5 calls/s  errors 0  check failures 0  transport errors 0")
    assert len(typical) <= PROGRESS_WIDTH < 80
    huge = runner.Progress(10**15, 10**12, 10**12, 10**12, 59_999.999)
    for elapsed in (0.0, 0.1, 86_400.0 * 2 + 0.5):
        assert len(progress_line(huge, elapsed)) <= PROGRESS_WIDTH


def test_table_wording_counts_and_thousands(capsys):
    import io

    from rich.console import Console

    from broker.loadgen.report import print_table

    spec = runner.Spec(target="http://127.0.0.1:1/", calls=[Call("add", "[1,2]")], connections=12_000,
                       processes=1, duration=2.0)
    t = Tally()
    t.requests = t.calls = 1
    h = Latency()
    h.record_many([1000])
    buf = io.StringIO()
    print_table(build_report(spec, t, h), Console(file=buf, width=80))
    flat = " ".join(buf.getvalue().split())
    assert "12,000 connections" in flat and "1 process," in flat
    assert "(1 request answered)" in flat and "(1 call answered)" in flat and "requests)" not in flat


def test_an_open_loop_the_generator_cannot_make_says_so_in_the_table_and_the_json(serve, tmp_path, capsys):
    """An open loop at a rate far past what this process can send (2,000,000 requests/s), with
    room on every connection (64 x depth 4,096: 262,144 places, more than it sends in 0.3 s, so
    a server slowed by a loaded machine never fills one: with 8 it did once, and the run rightly
    blamed the server), to a server that answers: the load generator itself fell behind, and the
    run says so, achieved against offered, and that the figures measure the generator (wrk2's
    and h2load's caveat), in the table and in the JSON; the requests it never sent are not put
    on the server."""
    s = serve("ok")
    out = tmp_path / "behind.json"
    code = cli.main(["bench", s.url, "--json", str(out), "--rate", "2000000", "-c", "64", "--depth", "4096",
                     "--duration", "0.3", "--warmup", "0", "--timeout", "20", "--quiet"])
    table = " ".join(capsys.readouterr().out.split())
    rep = Report.from_json(out.read_bytes())
    assert code == 0 and rep.check.ok and rep.transport_errors == 0
    assert rep.generator_behind is True and rep.sent_per_s is not None and rep.rate == 2_000_000
    assert 0 < rep.sent_per_s < rep.rate and rep.generator_late_requests > 0
    assert f"open loop at 2,000,000 req/s offered ({rep.sent_per_s:,.0f} sent)" in table
    assert (f"load generator fell behind: sent {rep.sent_per_s:,.0f} req/s of the 2,000,000 offered;" in table
            and "the rates and latencies measure the load generator, not the server" in table), table
    assert "(the load generator fell behind)" in table and "the server could not keep up" not in table


def test_the_generator_is_said_behind_only_past_its_share_of_the_schedule():
    """`BEHIND_SHARE` of the window's schedule (sent and never sent) late or never sent by the
    generator itself makes the verdict; less, or what the server held back (a full connection:
    not counted in `behind`), does not; a closed loop has no offered rate."""
    import io

    from rich.console import Console

    from broker.loadgen.report import BEHIND_SHARE, print_table

    spec = runner.Spec(target="http://127.0.0.1:1/", calls=[Call("add", "[1,2]")], rate=1000.0, duration=2.0)
    t = Tally()
    t.requests = t.calls = 1900
    h = Latency()
    h.record_many([1000])
    under = build_report(spec, t, h, unsent=100, sent=1900, behind=int(BEHIND_SHARE * 2000) - 1)
    at = build_report(spec, t, h, unsent=100, sent=1900, behind=int(BEHIND_SHARE * 2000))
    assert (under.generator_behind, at.generator_behind) == (False, True) and at.sent_per_s == 950.0
    buf = io.StringIO()
    print_table(under, Console(file=buf, width=80))
    flat = " ".join(buf.getvalue().split())
    assert "fell behind" not in flat and "100 scheduled requests (the server could not keep up)" in flat
    assert "open loop at 1,000 req/s offered (950 sent)" in flat
    closed = build_report(runner.Spec(target="http://127.0.0.1:1/", calls=[Call("add", "[1,2]")], duration=2.0),
                          t, h, behind=50)
    assert (closed.sent_per_s, closed.generator_behind) == (None, False)


# bounds, warm-up backlog, silent close -----------------------------------------------------------
# Upper bounds of the counts (and RLIMIT_NOFILE), the open loop's warm-up backlog dropped at the
# window's start, a window with nothing answered, a server closing keep-alive connections without
# announcing it, a load process lost under -P.

@pytest.mark.parametrize(("flags", "words"), [
    (["-c", "99999999999"], "argument -c/--connections: must be <= 100,000, got 99999999999"),
    (["-d", "99999999999"], "argument -d/--depth: must be <= 4,096 requests in flight per connection"),
    (["--pipeline", "99999999999"], "argument --pipeline: must be <= 4,096 requests in flight"),
    (["-b", "99999999999"], "argument -b/--batch: must be <= 100,000 calls per request body"),
    (["-P", "99999999999"], f"argument -P/--processes: must be <= {4 * (os.cpu_count() or 1)} (4 per CPU"),
    (["-c", "0"], "argument -c/--connections: must be >= 1, got 0"),
    (["-c", "inf"], "argument -c/--connections: not a whole number: 'inf'"),
    (["-d", "nan"], "argument -d/--depth: not a whole number: 'nan'"),
    (["-b", "1e400"], "argument -b/--batch: not a whole number: '1e400'"),
    (["-P", "2.5"], "argument -P/--processes: not a whole number: '2.5'"),
    (["--seed", "inf"], "argument --seed: not a whole number: 'inf'"),
    (["--seed", str(2**64)], "argument --seed: must be <= 18,446,744,073,709,551,615"),
    (["--duration", "1e-300"], "argument --duration: must be >= 0.01, got 1e-300"),
    (["-c", "1000", "-d", "4096"], "--connections x --depth x --batch (1,000 x 4,096 x 1) must be <= 2,000,000"),
    (["-c", "100", "-b", "100000"], "must be <= 2,000,000 calls in flight"),
], ids=lambda v: "_".join(v) if isinstance(v, list) else "")
def test_counts_are_bounded_and_named_at_parse_time(capsys, flags, words):
    """-c/-d/--pipeline/-b 99999999999 ran the machine out of memory; inf, nan and 1e400
    were refused with argparse's internal function name; --duration 1e-300 was taken."""
    err = _refused_flag(capsys, *flags)
    assert words in err and "invalid" not in err and "_whole" not in err, err


def _nofile(soft: int, hard: int) -> typing.Callable[[], None]:
    import resource

    def set_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, min(hard, resource.getrlimit(resource.RLIMIT_NOFILE)[1])))
    return set_limit


def test_connections_past_the_open_files_limit_are_refused_or_the_soft_limit_raised(serve, tmp_path):
    """Past the hard RLIMIT_NOFILE: exit 2 naming --connections and the limit, before any
    connection is made. Past only the soft limit: it is raised and the run is clean."""
    s = serve("ok")
    argv = [sys.executable, "-m", "broker", "bench", s.url, "-q", "--duration", "0.3", "--warmup", "0",
            "--timeout", "5", "-c", "300"]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=60, preexec_fn=_nofile(200, 200))
    assert done.returncode == 2, done.stderr
    assert "--connections: 300 need 364 open files" in done.stderr and "RLIMIT_NOFILE" in done.stderr
    assert s.connections == 0  # refused before connecting
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=60, preexec_fn=_nofile(200, 4096))
    assert done.returncode == 0, done.stderr + done.stdout
    assert s.connections == 300


def test_open_loop_past_capacity_drops_the_warmup_backlog(broker_factory, tmp_path):
    """A real broker at 100,000 requests/s, far past what it answers, after a warm-up: the
    backlog built in the warm-up is dropped when the window begins, so "never sent" counts
    only requests due inside the window, and the window's answers are counted (they were
    0, with more requests never sent than the window's whole schedule)."""
    b = broker_factory("--workers", "1")
    rate, duration, connections = 100_000, 1.0, 4
    code, rep = bench(tmp_path, f"http://{b.host}:{b.port}{b.path}", "--rate", str(rate), "-c", str(connections),
                      "--duration", str(duration), "--warmup", "0.5", "--timeout", "2")
    assert code == 0, rep
    assert rep.requests > 0 and rep.requests_per_s > 0 and rep.transport_errors == 0
    assert rep.unsent_requests <= rate * duration + connections
    # every request the window scheduled was answered or never sent (one either way per connection)
    assert abs(rep.requests + rep.unsent_requests - rate * duration) <= connections, rep


@pytest.mark.serial  # (beside 3 other tests on 2 cores its warm-up sent fewer than the 20 calls before the stall)
def test_a_window_with_nothing_answered_fails(serve, tmp_path, capsys):
    """The warm-up's request holds the only slot through the whole window (answered in the
    drain): nothing of the window is answered, all of it never sent. Not a silent exit 0."""
    s = serve("stall", stall_after=20, stall_s=1.2)
    code, rep = bench(tmp_path, s.url, "-c", "1", "--rate", "100", "--warmup", "0.5", "--duration", "0.5",
                      "--timeout", "3")
    err = capsys.readouterr().err
    assert code == 1, err
    assert rep.requests == 0 and rep.transport_errors == 0 and rep.unsent_requests == 50, rep
    assert "no request of the measured 0.5 s window was answered (50 never sent" in err, err


class _SilentClose(_OneShotHttp):
    """Answers each request (a correct JSON-RPC result, keep-alive headers, no
    `Connection: close`) and then closes the connection, as HTTP/1.1 allows."""

    CONNECTION = b"keep-alive"


def test_an_unannounced_close_after_an_answer_is_orderly(thread_server):
    """Each connection gets one answer, then the server closes it without announcing it
    (the generator has just written its next request): no transport error, no back-off
    (it reopened at once and sent that request again), every answer right."""
    s = thread_server(_SilentClose)
    spec = runner.Spec(target=f"http://127.0.0.1:{s.port}/", calls=[Call("add", "[1,2]")], connections=2,
                       duration=1.0, warmup=0.0, timeout=5.0)
    results = runner.run(spec)
    tally = merge(results)[0]
    assert tally.failures == 0 and tally.transport_errors == 0, tally.first_problem
    assert sum(r.backoffs for r in results) == 0
    reconnects = sum(r.reconnects for r in results)
    assert tally.requests > 10 and reconnects >= tally.requests - 2
    # Each sent again is said (new user, round 112: a server killed with calls in flight showed
    # "transport errors 0, missing 0", and a call it had read may have run twice)
    assert tally.resent == sum(r.resent for r in results) > 0
    assert build_report(spec, tally, merge(results)[1]).resent == tally.resent


def test_requests_sent_again_are_in_the_json_and_the_table(thread_server, tmp_path, capsys):
    s = thread_server(_SilentClose)
    out = tmp_path / "again.json"
    assert cli.main(["bench", f"http://127.0.0.1:{s.port}/", "--json", str(out), "--duration", "0.5",
                     "--warmup", "0", "-c", "2"]) == 0
    rep = Report.from_json(out.read_bytes())
    assert rep.resent > 0 and rep.transport_errors == 0
    text = capsys.readouterr().out
    assert "sent again" in text and f"{rep.resent:,} requests, on a new connection" in text, text


def test_interrupted_in_the_warmup_measures_nothing_and_never_sent_is_0(serve, tmp_path):
    """SIGINT during an open loop's warm-up: 0 s measured, requests/s n/a (not 0.0), and
    none of the warm-up's requests counted as never sent."""
    s = serve("ok")
    out = tmp_path / "warm.json"
    proc = _bench_process(s.url, out, "--rate", "1000", "--warmup", "30")
    try:
        wait_for(lambda: s.state.requests > 50, timeout=60)
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 130, stderr
    rep = Report.from_json(out.read_bytes())
    assert rep.interrupted and rep.duration_s == 0 and rep.requests == 0 and rep.unsent_requests == 0, rep
    assert "requests/s        n/a (0 s measured" in stdout, stdout


def test_a_load_process_lost_is_in_the_json_and_the_table(serve, tmp_path):
    """kill -9 of one of two load processes: exit 1, "processes_lost": 1 in the JSON, and a
    table row saying the figures miss it."""
    s = serve("ok")
    out = tmp_path / "lost.json"
    proc = _bench_process(s.url, out, "-P", "2")
    try:
        wait_for(lambda: s.state.requests > 500, timeout=60)
        os.kill(_load_processes(proc.pid)[0], signal.SIGKILL)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 1, stderr
    rep = Report.from_json(out.read_bytes())
    assert rep.processes == 2 and rep.processes_lost == 1 and rep.interrupted and rep.requests > 0
    assert "processes lost" in stdout and "1 of 2 load processes died" in stdout, stdout
    assert "the figures of 1 are missing" in stderr, stderr


def test_a_run_where_every_call_errs_says_so(broker_factory, tmp_path):
    """A new user's check (round 26): a mistyped --params had every call answered -32602,
    and the run printed a throughput in green and exited 0. It still exits 0 (errors are
    answers), but the table says every call erred and what to check."""
    b = broker_factory("--workers", "1")
    code, printed, rep = _bench_piped(tmp_path, "200", f"http://{b.host}:{b.port}{b.path}", "-m", "subtract",
                                      "--params", "[5]")
    assert code == 0 and rep.check.ok and rep.calls > 0 and rep.errors_by_code == {"-32602": rep.calls}
    assert "every call was answered with an error: check --method and --params" in " ".join(printed.split())
    code, printed, rep = _bench_piped(tmp_path, "200", f"http://{b.host}:{b.port}{b.path}")
    assert code == 0 and not rep.errors_by_code and "every call was answered" not in printed
