"""`rpc-broker stdio`: JSON-RPC 2.0 over stdin and stdout, one message a line, as a launcher
sees it: a real `python -m broker stdio` child process, its stdin and stdout pipes (a file,
a socket, a tty in their own tests), real workers."""

from __future__ import annotations

import http.client
import json
import os
import pty
import queue
import re
import select
import signal
import socket
import subprocess
import sys
import termios
import threading
import time
import typing
from collections.abc import Iterator

import pytest
from conftest import ROOT, free_port, wait_for
from conftest import rpc as call

LOOPS = pytest.mark.parametrize("loop", ["uvloop", "asyncio"])  # the broker's event_loop: the relay's ends on both
STOP_SECONDS = 30.0  # a bound on what should take well under a second, not a measure


class StdioBroker:
    """A running `rpc-broker stdio` child: what the test writes goes to its stdin (from a
    thread of its own, so that a large line never blocks the test while the broker writes
    answers it does not read yet); its stdout is read a line at a time; its stderr
    collected by a thread."""

    def __init__(self, *flags: str, env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "broker", "stdio", *flags], cwd=ROOT,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, **(env or {})},
        )
        self._out = b""
        self._err: list[bytes] = []
        self._to_send: queue.Queue[bytes | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read_stderr, daemon=True)
        self._reader.start()
        self._writer = threading.Thread(target=self._write_stdin, daemon=True)
        self._writer.start()

    def _read_stderr(self) -> None:
        assert self.proc.stderr is not None
        while chunk := os.read(self.proc.stderr.fileno(), 65536):
            self._err.append(chunk)

    def _write_stdin(self) -> None:
        assert self.proc.stdin is not None
        while (data := self._to_send.get()) is not None:
            try:
                self.proc.stdin.write(data)
                self.proc.stdin.flush()
            except (BrokenPipeError, ValueError):  # (its reader gone; closed by `end`)
                return
        self.proc.stdin.close()

    @property
    def stderr(self) -> str:
        return b"".join(self._err).decode(errors="replace")

    def send(self, *lines: bytes | str | dict[str, object] | list[object], end: bytes = b"\n") -> None:
        """Write each line (a JSON value is encoded) and `end` after it."""
        for line in lines:
            data = line if isinstance(line, bytes) else (line if isinstance(line, str) else json.dumps(line)).encode()
            self._to_send.put(data + end)

    def close_stdin(self) -> None:
        self._to_send.put(None)

    def line(self, timeout: float = 30.0) -> bytes:
        """The next line of stdout, without its newline; AssertionError if none comes in time."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._out:
            left = deadline - time.monotonic()
            assert left > 0, f"no line on stdout within {timeout} s; stderr:\n{self.stderr[-3000:]}"
            if select.select([fd], [], [], left)[0]:
                chunk = os.read(fd, 1 << 20)
                assert chunk, f"stdout ended; stderr:\n{self.stderr[-3000:]}"
                self._out += chunk
        line, _, self._out = self._out.partition(b"\n")
        return line

    def answer(self, timeout: float = 30.0) -> typing.Any:
        return json.loads(self.line(timeout))

    def answers(self, n: int, timeout: float = 30.0) -> dict[object, typing.Any]:
        """The next `n` answers (single responses), by id."""
        got = [self.answer(timeout) for _ in range(n)]
        return {a["id"]: a for a in got}

    def rest(self, timeout: float = STOP_SECONDS) -> bytes:
        """What stdout still holds until it ends (the broker closed it: exited)."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            if select.select([fd], [], [], left)[0]:
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    rest, self._out = self._out, b""
                    return rest
                self._out += chunk
        raise AssertionError(f"stdout did not end within {timeout} s; stderr:\n{self.stderr[-3000:]}")

    def wait(self, timeout: float = STOP_SECONDS) -> int:
        status = self.proc.wait(timeout)
        self._reader.join(timeout)
        return status

    def end(self) -> None:
        """Stop it if it still runs (SIGKILL, by its pid), and close the pipes."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._to_send.put(None)
        self._writer.join(10)
        self._reader.join(10)
        for pipe in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if pipe is not None:
                pipe.close()


@pytest.fixture
def stdio_broker() -> Iterator[typing.Callable[..., StdioBroker]]:
    """Start `rpc-broker stdio` children; each is SIGKILLed at the end if still running."""
    started: list[StdioBroker] = []

    def start(*flags: str, env: dict[str, str] | None = None) -> StdioBroker:
        b = StdioBroker(*flags, env=env)
        started.append(b)
        return b

    yield start
    for b in started:
        b.end()


def ends_cleanly(b: StdioBroker) -> None:
    """stdin closed: the broker answers what it owes, says why it stops, exits 0, with no
    traceback and no event loop error in its log."""
    b.close_stdin()
    assert b.rest() == b"", "answers after those expected"
    assert b.wait() == 0, b.stderr[-3000:]
    assert "stdio: stdin ended and every call owed was answered: stopping" in b.stderr, b.stderr[-3000:]
    assert "Traceback" not in b.stderr and " ERROR event loop: " not in b.stderr, b.stderr[-3000:]


@LOOPS
def test_calls_notifications_and_a_batch_each_get_their_line(
        stdio_broker: typing.Callable[..., StdioBroker], loop: str) -> None:
    b = stdio_broker("--workers", "2", "--event-loop", loop)
    b.send(call("subtract", [42, 23], 1))
    assert b.line() == b'{"jsonrpc":"2.0","id":1,"result":19}'
    b.send(call("subtract", {"subtrahend": 23, "minuend": 42}, "two"))
    assert b.line() == b'{"jsonrpc":"2.0","id":"two","result":19}'
    # notifications, alone and as a batch of them: no line; the call after them is the next line
    b.send({"jsonrpc": "2.0", "method": "update", "params": [1, 2, 3]},
           [{"jsonrpc": "2.0", "method": "notify_hello", "params": [7]}, {"jsonrpc": "2.0", "method": "update"}],
           call("get_data", None, 3))
    assert b.line() == b'{"jsonrpc":"2.0","id":3,"result":["hello",5]}'
    # a batch: one line, an array in request order, its notification without an element
    b.send(b'[{"jsonrpc":"2.0","method":"sum","params":[1,2,4],"id":"1"},'
           b'{"jsonrpc":"2.0","method":"notify_hello","params":[7]},'
           b'{"jsonrpc":"2.0","method":"subtract","params":[42,23],"id":"2"},{"foo":"boo"},'
           b'{"jsonrpc":"2.0","method":"foo.get","params":{"name":"myself"},"id":"5"},'
           b'{"jsonrpc":"2.0","method":"get_data","id":"9"}]')
    batch = b.answer()
    assert [e.get("id") for e in batch] == ["1", "2", None, "5", "9"]
    assert batch[0]["result"] == 7 and batch[1]["result"] == 19 and batch[4]["result"] == ["hello", 5]
    assert batch[2]["error"]["code"] == -32600 and batch[3]["error"]["code"] == -32601
    assert f"event loop {loop}" in b.stderr
    ends_cleanly(b)


def test_answers_come_as_they_are_ready_matched_by_id(stdio_broker: typing.Callable[..., StdioBroker]) -> None:
    """A slow call does not hold back a fast one sent after it on the same stdin."""
    b = stdio_broker("--workers", "1")
    b.send(call("sleep", [1.5], "slow"), call("add", [1, 1], "fast"))
    assert b.line() == b'{"jsonrpc":"2.0","id":"fast","result":2}'
    assert b.line() == b'{"jsonrpc":"2.0","id":"slow","result":1.5}'
    ends_cleanly(b)


def test_each_line_that_is_not_json_gets_its_parse_error_and_the_next_lines_go_on(
        stdio_broker: typing.Callable[..., StdioBroker]) -> None:
    b = stdio_broker("--workers", "1")
    parse_error = b'{"jsonrpc":"2.0","id":null,"error":{"code":-32700,"message":"Parse error"}}'
    b.send(b'{"jsonrpc":"2.0","method":"add","params":[1,2],"id":1', b"not json", b"[1,2", b'{"a":"\xff"}',
           b"", b"   ", json.dumps(call("add", [2, 3], 4)).encode())
    assert [b.line() for _ in range(4)] == [parse_error] * 4  # (blank lines are skipped: no answer)
    assert b.line() == b'{"jsonrpc":"2.0","id":4,"result":5}'
    ends_cleanly(b)


def test_crlf_line_endings_are_accepted(stdio_broker: typing.Callable[..., StdioBroker]) -> None:
    b = stdio_broker("--workers", "1")
    b.send(call("add", [1, 2], 1), call("add", [3, 4], 2), end=b"\r\n")
    assert b.answers(2) == {1: {"jsonrpc": "2.0", "id": 1, "result": 3}, 2: {"jsonrpc": "2.0", "id": 2, "result": 7}}
    b.send(b'{"jsonrpc":"2.0","method":"add","params":[5,6],"id":3}\r')  # (a last line with its \r: answered at EOF)
    b.close_stdin()
    assert b.line() == b'{"jsonrpc":"2.0","id":3,"result":11}'
    assert b.rest() == b"" and b.wait() == 0, b.stderr[-3000:]


def test_a_raw_line_separator_inside_a_string_is_not_a_line_break(
        stdio_broker: typing.Callable[..., StdioBroker]) -> None:
    """U+2028 and U+2029, raw (not escaped) in a string: valid JSON, one line (only \\n ends a
    line); echoed byte for byte, in one answer line."""
    b = stdio_broker("--workers", "1")
    text = "a\u2028b\u2029c\u0085d"
    b.send(('{"jsonrpc":"2.0","method":"echo","params":["' + text + '"],"id":"sep"}').encode())
    line = b.line()
    assert line == ('{"jsonrpc":"2.0","id":"sep","result":["' + text + '"]}').encode()
    assert b"\xe2\x80\xa8" in line and json.loads(line)["result"] == [text]
    ends_cleanly(b)


def test_a_line_of_2_mib_is_served_within_max_body_bytes_and_refused_past_it(
        stdio_broker: typing.Callable[..., StdioBroker]) -> None:
    limit = 5 * 1024 * 1024 // 2  # 2.5 MiB
    b = stdio_broker("--workers", "1", "--max-body-bytes", str(limit))
    big = "x" * (2 * 1024 * 1024)
    b.send(call("echo", [big], "big"))
    assert b.answer() == {"jsonrpc": "2.0", "id": "big", "result": [big]}
    b.send(call("echo", ["y" * (3 * 1024 * 1024)], "too big"), call("add", [1, 1], "after"))
    assert b.answer() == {"jsonrpc": "2.0", "id": None, "error": {
        "code": -32600, "message": "Invalid Request", "data": f"line exceeds max_body_bytes {limit}"}}
    assert b.answer() == {"jsonrpc": "2.0", "id": "after", "result": 2}  # (the line after it goes on)
    ends_cleanly(b)


@LOOPS
def test_at_the_end_of_stdin_every_call_in_flight_is_answered_then_exit_0(
        stdio_broker: typing.Callable[..., StdioBroker], loop: str) -> None:
    b = stdio_broker("--workers", "2", "--event-loop", loop)
    seconds = [0.2, 0.4, 0.6, 0.8, 1.0]
    b.send(*(call("sleep", [s], i) for i, s in enumerate(seconds)), call("fib", [25], "fib"),
           [call("add", [1, 2], "b1"), call("sleep", [0.5], "b2")])
    b.close_stdin()  # at once: the calls are still running
    got = [json.loads(line) for line in b.rest().splitlines()]
    assert b.wait() == 0, b.stderr[-3000:]
    singles = {a["id"]: a["result"] for a in got if isinstance(a, dict)}
    assert singles == {**dict(enumerate(seconds)), "fib": 75025}
    assert [a for a in got if isinstance(a, list)] == [[{"jsonrpc": "2.0", "id": "b1", "result": 3},
                                                        {"jsonrpc": "2.0", "id": "b2", "result": 0.5}]]
    assert "stdio: stdin ended and every call owed was answered: stopping" in b.stderr


def test_stdout_holds_nothing_but_answers_when_tools_print(stdio_broker: typing.Callable[..., StdioBroker]) -> None:
    """A handler's print, its write to descriptor 1, a child process's print, its stderr
    and its exception's log all go to the broker's stderr, never to stdout; the broker's
    own descriptors 0 and 1 are /dev/null and its stderr, and no worker's is the launcher's
    stdout."""
    b = stdio_broker("--workers", "2", "--app", "tests.apps.chatty:registry", "--access-log", "all")
    b.send(call("say", ["printed-by-say"], 1), call("scribble", ["written-to-fd-1"], 2),
           call("spawn_echo", ["echoed-by-a-child"], 3), call("mutter", ["muttered"], 4),
           call("fail", ["failed-loudly"], 5), call("descriptors", None, 6))
    answers = b.answers(6)
    assert [answers[i].get("result") for i in range(1, 5)] == [True, True, 0, True]
    assert answers[5]["error"]["code"] == -32603
    assert b.proc.stdout is not None
    launchers = f"pipe:[{os.fstat(b.proc.stdout.fileno()).st_ino}]"
    assert launchers not in answers[6]["result"], answers[6]
    assert answers[6]["result"][0] == "/dev/null"
    broker_fds = [os.readlink(f"/proc/{b.proc.pid}/fd/{fd}") for fd in (0, 1, 2)]
    assert broker_fds[0] == "/dev/null" and broker_fds[1] == broker_fds[2] != launchers, broker_fds
    b.close_stdin()
    assert b.rest() == b"" and b.wait() == 0
    for text in ("printed-by-say", "written-to-fd-1", "echoed-by-a-child", "muttered", "failed-loudly"):
        assert text in b.stderr, (text, b.stderr[-3000:])
    assert "client=stdio token=- transport=stdio method=say" in b.stderr  # (the access lines: stderr too; "client=unix" once: new user, round 112)


def test_a_worker_that_dies_mid_call_is_answered_32002_and_the_other_calls_go_on(
        stdio_broker: typing.Callable[..., StdioBroker]) -> None:
    """The sleep goes to one worker, the crash to the other (the one with fewer calls in
    flight): the crash is answered -32002, the sleep in flight beside it its result, and
    the calls after it are served (by the worker left, then by its replacement too)."""
    b = stdio_broker("--workers", "2", "--app", "broker.demo:faults")
    b.send(call("sleep", [1.0], "long"), call("crash", {"how": "exit"}, "crash"))
    crashed = b.answer()
    assert crashed["id"] == "crash" and crashed["error"]["code"] == -32002, crashed
    assert crashed["error"]["data"]["status"] == "exited with 1"
    b.send(*(call("add", [i, i], f"after{i}") for i in range(6)))
    answers = b.answers(7)
    assert {i: a.get("result") for i, a in answers.items()} == {"long": 1.0, **{f"after{i}": 2 * i for i in range(6)}}
    ends_cleanly(b)


@LOOPS
def test_stdout_closed_by_its_reader_stops_the_broker_without_a_traceback(
        stdio_broker: typing.Callable[..., StdioBroker], loop: str) -> None:
    b = stdio_broker("--workers", "1", "--event-loop", loop)
    b.send(call("add", [1, 1], 1))
    assert b.line() == b'{"jsonrpc":"2.0","id":1,"result":2}'
    b.send(call("sleep", [0.3], 2), call("sleep", [30], 3))
    assert b.proc.stdout is not None
    b.proc.stdout.close()  # (the reader gone: the answer's write fails, EPIPE)
    assert b.wait() == 0, b.stderr[-3000:]  # (within STOP_SECONDS: not the 30 s call's end)
    assert "stdio: stdout has no reader (EPIPE), or is not open: stopping" in b.stderr, b.stderr[-3000:]
    assert "Traceback" not in b.stderr and " ERROR " not in b.stderr, b.stderr[-3000:]


@LOOPS
def test_sigterm_answers_what_is_in_flight_then_exits_0_with_stdin_still_open(
        stdio_broker: typing.Callable[..., StdioBroker], loop: str) -> None:
    b = stdio_broker("--workers", "1", "--event-loop", loop)
    b.send(call("sleep", [1.0], "flight"), call("add", [1, 1], "read"))
    assert b.line() == b'{"jsonrpc":"2.0","id":"read","result":2}'  # (so the sleep's line was read before it)
    b.proc.send_signal(signal.SIGTERM)
    assert b.answer() == {"jsonrpc": "2.0", "id": "flight", "result": 1.0}
    assert b.rest() == b"" and b.wait() == 0, b.stderr[-3000:]
    assert "stopping: no new connections; answering what is in flight" in b.stderr
    assert "stdin ended" not in b.stderr


def _run_with(stdin: int, stdout: int, *flags: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([sys.executable, "-m", "broker", "stdio", "--workers", "1", *flags], cwd=ROOT,
                          stdin=stdin, stdout=stdout, stderr=subprocess.PIPE, timeout=120, check=False)


def test_stdin_and_stdout_may_be_regular_files(tmp_path: typing.Any) -> None:
    requests = tmp_path / "requests.ndjson"
    requests.write_bytes(b"".join(json.dumps(call("add", [i, 1], i)).encode() + b"\n" for i in range(50))
                         + json.dumps(call("sleep", [0.2], "last")).encode())  # (no newline after the last)
    out = tmp_path / "answers.ndjson"
    with requests.open("rb") as stdin, out.open("wb") as stdout:
        done = _run_with(stdin.fileno(), stdout.fileno())
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    answers = {a["id"]: a["result"] for a in map(json.loads, out.read_bytes().splitlines())}
    assert answers == {**{i: i + 1 for i in range(50)}, "last": 0.2}


def test_stdin_and_stdout_may_be_one_socket() -> None:
    ours, theirs = socket.socketpair()
    with ours, theirs:
        ours.sendall(json.dumps(call("add", [2, 2], 1)).encode() + b"\n")
        ours.shutdown(socket.SHUT_WR)
        proc = subprocess.Popen([sys.executable, "-m", "broker", "stdio", "--workers", "1"], cwd=ROOT,
                                stdin=theirs, stdout=theirs, stderr=subprocess.DEVNULL)
        theirs.close()
        ours.settimeout(60)
        received = b""
        while chunk := ours.recv(65536):
            received += chunk
        assert proc.wait(STOP_SECONDS) == 0
    assert received == b'{"jsonrpc":"2.0","id":1,"result":4}\n'


def test_stdin_and_stdout_may_be_a_tty_whose_flags_are_left_as_they_were() -> None:
    """A terminal: a line typed is served, ^D ends stdin; the tty is not left non-blocking
    (a flag of the file description the shell shares: the relay's threads block instead)."""
    import fcntl

    controller, terminal = pty.openpty()
    try:
        attributes = termios.tcgetattr(terminal)
        attributes[3] &= ~termios.ECHO  # (what is typed is not echoed back to the reader)
        termios.tcsetattr(terminal, termios.TCSANOW, attributes)
        flags = fcntl.fcntl(terminal, fcntl.F_GETFL)
        proc = subprocess.Popen([sys.executable, "-m", "broker", "stdio", "--workers", "1"], cwd=ROOT,
                                stdin=terminal, stdout=terminal, stderr=subprocess.DEVNULL)
        os.write(controller, json.dumps(call("add", [20, 22], "tty")).encode() + b"\n")
        received = b""
        deadline = time.monotonic() + 60
        while b"\n" not in received and time.monotonic() < deadline:
            if select.select([controller], [], [], 1.0)[0]:
                received += os.read(controller, 65536)
        os.write(controller, b"\x04")  # ^D
        assert proc.wait(STOP_SECONDS) == 0
        assert received == b'{"jsonrpc":"2.0","id":"tty","result":42}\r\n'  # (the tty's \n -> \r\n)
        assert fcntl.fcntl(terminal, fcntl.F_GETFL) == flags
    finally:
        os.close(controller)
        os.close(terminal)


def test_no_port_is_opened_so_two_start_at_once_and_metrics_port_opens_its_own(
        stdio_broker: typing.Callable[..., StdioBroker]) -> None:
    """serve's listeners (port 8080 by default) are not opened: two launchers' brokers run
    side by side on the defaults; metrics_port gives Prometheus its listener, the stdio
    connection counted under transport "stdio"."""
    from prometheus_client.parser import text_string_to_metric_families

    unused, metrics_port = free_port(), free_port()  # (not fixed ports: run in parallel, a connection took one)
    first = stdio_broker("--workers", "1", "--stream-port", str(unused), "--frontends", "2")
    second = stdio_broker("--workers", "1", "--metrics-port", str(metrics_port))
    for b in (first, second):
        b.send(call("add", [1, 2], 1))
        assert b.line() == b'{"jsonrpc":"2.0","id":1,"result":3}'
    assert f"stdio: stream_port {unused} set, but stdio mode opens no JSON-RPC listener" in first.stderr
    assert "stdio: frontends 2 set, but stdio mode runs one front-end" in first.stderr  # (new user, round 112)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", unused), timeout=10).close()
    # (the banner is written once the listeners are up, and read by a thread: it may come after an
    # answer; CI once read stderr before it)
    wait_for(lambda: f"rpc-broker: metrics on http://127.0.0.1:{metrics_port}/metrics" in second.stderr, timeout=10)
    conn = http.client.HTTPConnection("127.0.0.1", metrics_port, timeout=30)
    try:
        conn.request("GET", "/metrics")
        response = conn.getresponse()
        body = response.read().decode()
        assert response.status == 200
        conn.request("POST", "/", body=json.dumps(call("add", [1, 1])), headers={"content-type": "application/json"})
        refused = conn.getresponse()
        refused.read()
        assert refused.status == 404  # (no JSON-RPC there: the metrics listener's)
    finally:
        conn.close()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(body) for s in family.samples}
    assert samples[("rpc_broker_connections", (("transport", "stdio"),))] == 1
    assert samples[("rpc_broker_calls_total", (("method", "add"), ("outcome", "ok")))] == 1
    for b in (first, second):
        ends_cleanly(b)


def test_it_takes_serves_settings_from_a_file_the_environment_and_flags(
        stdio_broker: typing.Callable[..., StdioBroker], tmp_path: typing.Any) -> None:
    settings = tmp_path / "broker.toml"
    settings.write_text('app = "tests.apps.chatty:registry"\nworkers = 1\n')
    b = stdio_broker("--config", str(settings), "--workers", "2", env={"RPC_BROKER_ACCESS_LOG": "all"})
    b.send(call("say", ["hello"], 1))
    assert b.answer() == {"jsonrpc": "2.0", "id": 1, "result": True}
    ends_cleanly(b)  # (its log read to the end: said once every worker is ready, after the first answer may be)
    assert "serving JSON-RPC on stdin and stdout with 2 workers (app tests.apps.chatty:registry" in b.stderr
    assert "transport=stdio method=say" in b.stderr


@pytest.mark.parametrize(("flags", "status", "said"), [
    (["--workers", "many"], 2, "config error"),
    (["--app", "tests.apps.no_such_module:registry"], 3, "No module named 'tests.apps.no_such_module'"),
])
def test_a_start_that_fails_exits_as_serve_does_with_nothing_on_stdout(
        flags: list[str], status: int, said: str) -> None:
    done = subprocess.run([sys.executable, "-m", "broker", "stdio", "--workers", "1", *flags], cwd=ROOT,
                          input=json.dumps(call("add", [1, 1])).encode() + b"\n",
                          capture_output=True, timeout=120, check=False)
    assert done.returncode == status and done.stdout == b"", done
    assert said in done.stderr.decode(), done.stderr.decode()[-3000:]


@pytest.mark.parametrize("line", [b"\x01\x02 binary", b"GET / HTTP/1.1"])
def test_a_line_of_another_protocol_is_answered_and_ends_the_session(
        stdio_broker: typing.Callable[..., StdioBroker], line: bytes) -> None:
    """As on a stream socket: one error line, then the broker stops reading, answers what it
    owes and exits 0; the lines after it are never run."""
    b = stdio_broker("--workers", "1")
    b.send(call("sleep", [0.5], "before"), line, call("add", [1, 1], "after"))
    got = [json.loads(x) for x in [b.line(), b.line()]]
    assert got[0]["id"] is None and got[0]["error"]["code"] in (-32700, -32600), got
    assert "newline-delimited JSON-RPC" in got[0]["error"]["data"]
    assert got[1] == {"jsonrpc": "2.0", "id": "before", "result": 0.5}
    assert b.rest() == b"" and b.wait() == 0, b.stderr[-3000:]
    assert "stdio: the broker ended the connection: stopping" in b.stderr


def test_help_describes_stdio_and_the_command_list_names_it() -> None:
    done = subprocess.run([sys.executable, "-m", "broker", "stdio", "--help"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, check=True)
    assert done.stdout.startswith("usage: rpc-broker stdio")
    for words in ("stdin", "stdout", "stderr", "metrics_port", "--workers", "--app", "exits 0",
                  "Example: rpc-broker stdio --workers 2 --app mytools:registry"):
        assert words in " ".join(done.stdout.split()), words
    listing = subprocess.run([sys.executable, "-m", "broker", "--help"], cwd=ROOT, capture_output=True,
                             text=True, timeout=60, check=True).stdout
    assert re.search(r"^\s+stdio\s+serve JSON-RPC on stdin and stdout", listing, re.M), listing
