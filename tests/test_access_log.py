"""The access log (issue 12, item 6) of a real broker, its workers real, over loopback: a line
per call answered (access_log errors, all, off), each field checked; params redacted; text
(logfmt) and JSON lines; hostile ids that cannot forge a line; and a stderr nobody reads,
which must not stop the broker answering (lines dropped and counted instead)."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import re
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import typing
from pathlib import Path

import pytest
from conftest import ROOT, Broker, free_port, listen_port, rpc, sample, scrape_metrics, start_broker

ALICE = "alice-token-0123456789abcdef"
SLOW = "slow-token-0123456789abcdef-XY"
ALICE_H = {"authorization": f"Bearer {ALICE}"}
SLOW_H = {"authorization": f"Bearer {SLOW}"}
_FIELD = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|\S*)')


def fields(line: str) -> dict[str, str]:
    """A logfmt line's fields, quoted values read as JSON strings."""
    out = {}
    for key, value in _FIELD.findall(line):
        out[key] = json.loads(value) if value.startswith('"') else value
    return out


def access_lines(log: str) -> list[dict[str, str]]:
    """The access lines of a text log, parsed (each must be exactly logfmt, nothing else)."""
    lines = []
    for line in log.splitlines():
        if line.startswith("time="):
            parsed = fields(line)
            assert " ".join(f"{k}={v}" for k, v in _FIELD.findall(line)) == line, line  # (nothing outside fields)
            lines.append(parsed)
    return lines


def settled(b: Broker) -> int:
    """How many access lines the log has once none has come for 0.3 s (the last test's, on a
    shared broker, written up to 50 ms after their calls, later on a loaded machine)."""
    count, quiet = -1, 0
    while quiet < 3:
        now = len(access_lines(b.read_log(0.1)))
        quiet = quiet + 1 if now == count else 0
        count = now
    return count


def wait_lines(b: Broker, n: int, timeout: float = 10.0) -> list[dict[str, str]]:
    """The access lines once there are `n` (or more) of them, or raise."""
    deadline = time.monotonic() + timeout
    while True:
        lines = access_lines(b.read_log(0.05))
        if len(lines) >= n or time.monotonic() > deadline:
            assert len(lines) >= n, f"{len(lines)} access lines, not {n}:\n{b.read_log()}"
            return lines


@pytest.fixture(scope="module")
def tokens(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tokens") / "tokens.toml"
    path.write_text(f'[tokens.alice]\ntoken = "{ALICE}"\n\n[tokens.slow]\ntoken = "{SLOW}"\nrate_limit = 0.01\n'
                    'rate_burst = 1\n')
    return path


@pytest.fixture(scope="module")
def all_broker(tokens: Path) -> object:
    stream_port = free_port()
    b = start_broker("--workers", "1", "--access-log", "all", "--log-params", "--timeout", "0.5",
                     "--auth-tokens-file", str(tokens), "--stream-port", str(stream_port))
    b.stream_port = stream_port  # type: ignore[attr-defined]
    yield b
    assert b.stop() == 0, b.read_log()


def worker_pid(b: Broker) -> str:
    return re.findall(r"worker 0 ready \(pid (\d+)", b.read_log())[-1]


def test_all_logs_a_result_an_unknown_method_a_timeout_and_a_rate_limited_call(all_broker: Broker) -> None:
    b = all_broker
    before = settled(b)
    status, _, body = b.post(json.dumps(rpc("add", [2, 3], 7)), headers=ALICE_H)
    assert status == 200 and json.loads(body)["result"] == 5
    assert json.loads(b.post(json.dumps(rpc("no.such", None, "u")), headers=ALICE_H)[2])["error"]["code"] == -32601
    sent = time.time()
    assert json.loads(b.post(json.dumps(rpc("sleep", [5], 9)), headers=ALICE_H)[2])["error"]["code"] == -32001
    assert json.loads(b.post(json.dumps(rpc("add", [1, 1], 10)), headers=SLOW_H)[2])["result"] == 2
    status, _, body = b.post(json.dumps(rpc("add", [1, 1], 11)), headers=SLOW_H)
    assert status == 429 and json.loads(body)["error"]["code"] == -32005
    ok, unknown, timeout, slow_ok, limited = wait_lines(b, before + 5)[before:]
    pid = worker_pid(b)
    assert ok["client"].startswith("127.0.0.1:") and ok["token"] == "alice" and ok["transport"] == "http"
    assert (ok["method"], ok["id"], ok["outcome"], ok["code"], ok["pid"]) == ("add", "7", "ok", "-", pid)
    assert 0 < float(ok["duration"]) < 5 and ok["params"] == "[2,3]"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", ok["time"])
    assert (unknown["method"], unknown["id"], unknown["outcome"], unknown["code"], unknown["pid"]) == (
        "other", '"u"', "method_not_found", "-32601", "-")
    assert (timeout["method"], timeout["id"], timeout["outcome"], timeout["code"], timeout["pid"]) == (
        "sleep", "9", "timed_out", "-32001", pid)
    assert 0.5 <= float(timeout["duration"]) < 3
    # (README: a line's time is when its answer was made, its arrival `duration` before: the ms
    # stamp is truncated, and the clocks are one machine's)
    answered = datetime.datetime.strptime(timeout["time"], "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=datetime.UTC)
    assert answered.timestamp() + 0.001 >= sent + float(timeout["duration"]) >= sent + 0.5, (timeout, sent)
    assert slow_ok["token"] == "slow" and slow_ok["outcome"] == "ok"
    assert (limited["token"], limited["method"], limited["id"], limited["outcome"], limited["code"]) == (
        "slow", "add", "11", "rate_limited", "-32005")
    # (README: answered as the body was read, before any queue: no duration)
    assert unknown["duration"] == limited["duration"] == "0.000000", (unknown, limited)


def test_a_batch_is_a_line_per_call_and_no_notification_is_logged(all_broker: Broker) -> None:
    b = all_broker
    before = settled(b)
    batch = [rpc("add", [i, 1], i) for i in range(1, 5)]
    batch[1:1] = [{"jsonrpc": "2.0", "method": "add", "params": [0, 0]}, rpc("nope", None, "n"), {"x": 1}]
    status, _, body = b.post(json.dumps(batch), headers=ALICE_H)
    answers = json.loads(body)
    assert status == 200 and len(answers) == 6  # (4 results, 2 errors; the notification has none)
    lines = wait_lines(b, before + 6)[before:]
    time.sleep(0.3)
    assert len(access_lines(b.read_log(0.1))) == before + 6, "one line per call, none for the notification"
    by_id = {line["id"]: line for line in lines}
    assert set(by_id) == {"1", "2", "3", "4", '"n"', "null"}
    assert all(by_id[str(i)]["outcome"] == "ok" and by_id[str(i)]["method"] == "add" for i in range(1, 5))
    assert by_id['"n"']["outcome"] == "method_not_found" and by_id["null"]["outcome"] == "invalid_request"
    assert by_id["null"]["code"] == "-32600" and all(line["token"] == "alice" for line in lines)
    assert by_id['"n"']["duration"] == by_id["null"]["duration"] == "0.000000"  # (README: answered as read)


def test_log_params_redacts_secrets_at_any_depth(all_broker: Broker) -> None:
    b = all_broker
    before = settled(b)
    params = {"a": 1, "Password": "hunter2", "nested": {"API-Key": "k-123", "list": [{"token": "t-456"}, 3]},
              "authorization": "Bearer x-789", "ok": "visible"}
    b.post(json.dumps(rpc("add", params, 1)), headers=ALICE_H)  # (-32602: add takes a and b)
    (line,) = wait_lines(b, before + 1)[before:]
    assert line["outcome"] == "invalid_params"
    logged = json.loads(line["params"])
    assert logged == {"a": 1, "Password": "[redacted]", "nested": {"API-Key": "[redacted]", "list": [
        {"token": "[redacted]"}, 3]}, "authorization": "[redacted]", "ok": "visible"}
    log = b.read_log()
    assert not any(secret in log for secret in ("hunter2", "k-123", "t-456", "x-789"))


def test_log_params_writes_floats_msgspec_reads_slowly_as_their_values(all_broker: Broker) -> None:
    # (hostile testing, round 139: they were read by msgspec's slow reader on the front-end's loop;
    # now by float(), as the worker's broker/floats.py does: the same values, the same text)
    b = all_broker
    before = settled(b)
    floats = "[1e308,1E-300,1e23,1.2345000000000000576e249,2.5e3,-0.0,7]"
    b.post('{"jsonrpc":"2.0","method":"add","params":{"a":' + floats + ',"Secret":"s-1"},"id":1}', headers=ALICE_H)
    b.post('{"jsonrpc":"2.0","method":"add","params":[1e308,1e400],"id":2}', headers=ALICE_H)  # (-32602 both)
    b.post('{"jsonrpc":"2.0","method":"add","params":{"x":1e400},"id":3}', headers=ALICE_H)
    lines = sorted(wait_lines(b, before + 3)[before:], key=lambda line: line["id"])
    assert [line["outcome"] for line in lines] == ["invalid_params"] * 3
    assert json.loads(lines[0]["params"]) == {"a": json.loads(floats), "Secret": "[redacted]"}
    assert lines[0]["params"] == '{"a":[1e308,1e-300,1e23,1.2345000000000002e249,2500.0,-0.0,7],"Secret":"[redacted]"}'
    # (a float past a double's range: refused by either reader, the params then not written)
    assert (lines[1]["params"], lines[2]["params"]) == ("(13 bytes, not decoded)", "(11 bytes, not decoded)")


def test_hostile_ids_and_methods_cannot_forge_a_line(all_broker: Broker) -> None:
    b = all_broker
    before = settled(b)
    forged = 'x"\n2026-01-01T00:00:00.000Z time=1 client=1.2.3.4 outcome=ok\r\x1b[2J\u2028'
    method = "evil\nmethod time=2 \x00"
    b.post(json.dumps([rpc("add", [1, 2], forged), rpc(method, None, "m" * 500)]), headers=ALICE_H)
    lines = wait_lines(b, before + 2)[before:]
    time.sleep(0.2)
    log = b.read_log(0.1)
    assert len(access_lines(log)) == before + 2
    assert not any(line.startswith(("2026-01-01", "method", " time=")) for line in log.splitlines())
    assert "\x1b" not in log and "\u2028" not in log and "\r" not in log
    first, second = sorted(lines, key=lambda line: line["method"])  # ("other" is answered first, at once)
    assert first["id"] == json.dumps(forged)[:64] + "..."  # (its raw JSON, as sent, truncated)
    assert first["client"].startswith("127.0.0.1:")
    assert second["method"] == "other" and second["id"] == '"' + "m" * 63 + "..."


def test_a_stream_call_says_its_transport_and_token(all_broker: Broker) -> None:
    b = all_broker
    before = settled(b)
    with socket.create_connection(("127.0.0.1", b.stream_port), timeout=10) as s:  # type: ignore[attr-defined]
        f = s.makefile("rwb")
        f.write(json.dumps({"jsonrpc": "2.0", "method": "rpc.authenticate", "params": {"_meta": {"token": ALICE}},
                            "id": 0}).encode() + b"\n")
        f.write(json.dumps(rpc("add", [1, 2], 3)).encode() + b"\n")
        f.flush()
        assert json.loads(f.readline())["result"] == {"token": "alice"}
        assert json.loads(f.readline())["result"] == 3
    (line,) = wait_lines(b, before + 1)[before:]
    assert (line["transport"], line["token"], line["method"], line["id"], line["outcome"]) == (
        "tcp", "alice", "add", "3", "ok")


def test_errors_logs_only_calls_not_answered_with_a_result_and_json_lines_parse(broker_factory: object) -> None:
    b = broker_factory("--workers", "1", "--log-format", "json", "--timeout", "0.5")  # type: ignore[operator]
    assert json.loads(b.post(json.dumps(rpc("add", [2, 3], 1)))[2])["result"] == 5
    b.post(json.dumps([rpc("add", [1, 1], 2), rpc("nope", None, 3), rpc("add", [1, 2], 4), rpc("add", [1, 3], 5)]))
    assert json.loads(b.post(json.dumps(rpc("sleep", [5], 6)))[2])["error"]["code"] == -32001
    deadline = time.monotonic() + 10
    while b.read_log(0.05).count('"log":"access"') < 2 and time.monotonic() < deadline:
        pass
    time.sleep(0.3)
    records = [json.loads(line) for line in b.read_log(0.1).splitlines() if not line.startswith("rpc-broker: ")]
    access = [r for r in records if r.get("log") == "access"]
    own = [r for r in records if r.get("log") != "access"]
    assert [(r["id"], r["method"], r["outcome"], r["code"]) for r in access] == [
        ("3", "other", "method_not_found", -32601), ("6", "sleep", "timed_out", -32001)]
    assert access[1]["pid"] > 0 and access[0]["pid"] is None and access[0]["token"] is None
    assert access[1]["transport"] == "http" and access[1]["duration"] >= 0.5 and "params" not in access[1]
    assert any(r["message"].startswith("worker 0 ready") for r in own)
    assert all({"time", "level", "logger", "pid", "message"} <= set(r) and r["log"] == "broker" for r in own)


def test_off_logs_no_call(broker_factory: object) -> None:
    b = broker_factory("--workers", "1", "--access-log", "off")  # type: ignore[operator]
    b.post(json.dumps([rpc("nope", None, 1), rpc("add", [1, 2], 2)]))
    b.post(b"{not json")
    time.sleep(0.3)
    assert not access_lines(b.read_log(0.1))
    b.stop()
    assert "stopped" in b.read_log() and not access_lines(b.read_log())


def test_a_stderr_nobody_reads_does_not_stop_the_broker(tmp_path: Path) -> None:
    """The broker's stderr is a pipe read only until it serves: then its 64 KiB fill, and the
    log's queue; calls are answered all the same, the lines past the queue counted dropped."""
    argv = [sys.executable, "-m", "broker", "serve", "--host", "127.0.0.1", "--port", str(listen_port()), "--workers", "1",
            "--access-log", "all"]
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.stderr is not None
    try:
        log = b""
        deadline = time.monotonic() + 60
        while not (m := re.search(rb"serving JSON-RPC on http://127\.0\.0\.1:(\d+)(/\S*)", log)):
            assert time.monotonic() < deadline and proc.poll() is None, log.decode()
            if select.select([proc.stderr], [], [], 0.1)[0]:
                log += os.read(proc.stderr.fileno(), 65536)
        b = Broker(proc, "127.0.0.1", int(m.group(1)), m.group(2).decode(), [])
        batch = json.dumps([rpc("nope", None, i) for i in range(1000)])  # (a line each: ~180 bytes)
        began = time.monotonic()
        # 120,000 lines: past the half of the 64 KiB pipe the writer fills, the batch it holds, one
        # more taken whole on an empty queue (each at most 50 ms of lines) and the queue's 50,000
        for _ in range(120):
            t = time.monotonic()
            status, _, body = b.post(batch, timeout=10)
            assert status == 200 and len(json.loads(body)) == 1000
            assert time.monotonic() - t < 5
        t = time.monotonic()
        assert json.loads(b.post(json.dumps(rpc("add", [2, 3], 1)), timeout=5)[2])["result"] == 5
        assert time.monotonic() - t < 1 and time.monotonic() - began < 60
        deadline = time.monotonic() + 5  # (drops are counted at the loop's next flush, 50 ms on)
        while sample(samples := scrape_metrics(b), "rpc_broker_log_lines_dropped_total", log="access") == 0:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert sample(samples, "rpc_broker_log_lines_dropped_total", log="broker") == 0
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0  # (its stop waits for the writer a bounded time)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        proc.stderr.close()


def test_a_batch_flood_to_a_stderr_that_keeps_up_loses_no_line(tmp_path: Path) -> None:
    """Batches of 1,000 from 4 clients at once, access_log all, stderr a file: every call gets
    exactly one line, none dropped. (A flush past the queue's 50,000 lines, kept whole when the
    writer has taken everything before it, needs more calls in 50 ms than these cores make:
    tests/test_logpipe.py holds that.)"""
    log_path = tmp_path / "broker.log"
    argv = [sys.executable, "-m", "broker", "serve", "--host", "127.0.0.1", "--port", str(listen_port()), "--workers", "2",
            "--access-log", "all"]
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log_file,
                                cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        deadline = time.monotonic() + 60
        while not (m := re.search(r"serving JSON-RPC on http://127\.0\.0\.1:(\d+)(/\S*)", log_path.read_text())):
            assert time.monotonic() < deadline and proc.poll() is None, log_path.read_text()
            time.sleep(0.05)
        b = Broker(proc, "127.0.0.1", int(m.group(1)), m.group(2), [])

        def client(first: int) -> None:
            for k in range(5):
                ids = range(first + k * 1000, first + (k + 1) * 1000)
                status, _, body = b.post(json.dumps([rpc("add", [i, 1], i) for i in ids]), timeout=30)
                assert status == 200 and sorted(a["id"] for a in json.loads(body)) == list(ids)

        errors: list[BaseException] = []

        def run(first: int) -> None:
            try:
                client(first)
            except BaseException as exc:  # (said by the test's thread)
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(n * 100_000,)) for n in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors
        samples = scrape_metrics(b)
        assert sample(samples, "rpc_broker_log_lines_dropped_total", log="access") == 0
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        ids = sorted(int(line["id"]) for line in access_lines(log_path.read_text()) if line["method"] == "add")
        assert ids == sorted(n * 100_000 + i for n in range(4) for i in range(5000))  # (one line each, no more)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def _spawn(stderr: object, *args: str, workers: str = "1") -> tuple[subprocess.Popen[bytes], Broker]:
    """A broker on a free port whose stderr is `stderr` (a descriptor, or a command line's
    redirection via sh when a str), ready (GET /readyz), not read from its banner."""
    port = free_port()
    argv = [sys.executable, "-m", "broker", "serve", "--host", "127.0.0.1", "--port", str(port), "--workers", workers,
            *args]  # fmt: skip
    if isinstance(stderr, str):  # (e.g. "2>&-")
        proc = subprocess.Popen(["sh", "-c", 'exec "$@" ' + stderr, "sh", *argv], stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    else:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=stderr, cwd=ROOT,
                                env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    b = Broker(proc, "127.0.0.1", port, "/", [])
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None and time.monotonic() < deadline, f"exit {proc.poll()}"
        try:
            conn = b.connection(1.0)
            conn.request("GET", "/readyz")
            if conn.getresponse().status == 200:
                conn.close()
                return proc, b
            conn.close()
        except OSError:
            pass
        time.sleep(0.1)


def _end(proc: subprocess.Popen[bytes]) -> int:
    """SIGTERM our broker; its exit status (killed after 30 s: the test fails on it)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
            raise
    return typing.cast(int, proc.returncode)


def test_a_stderr_pipe_full_at_the_start_neither_hangs_the_broker_nor_its_stop() -> None:
    """Hostile testing, round 117, and new users, round 108: the banner, written on the loop
    to a pipe already full, hung the broker, SIGTERM unheard until the pipe was read."""
    r, w = os.pipe()
    os.set_blocking(w, False)
    try:
        while True:
            os.write(w, b"x" * 4096)
    except BlockingIOError:
        pass
    os.set_blocking(w, True)
    try:
        proc, b = _spawn(w)
        try:
            assert b.call("add", [2, 3], timeout=10)["result"] == 5
            began = time.monotonic()
            assert _end(proc) == 0 and time.monotonic() - began < 15  # (the writer abandoned after 2 s)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    finally:
        os.close(r)
        os.close(w)


def test_a_closed_stderr_still_serves() -> None:
    """`2>&-`: the broker exited 1 saying nothing (new users, round 108; hostile, round 117)."""
    proc, b = _spawn("2>&-", "--access-log", "all")
    try:
        assert b.call("add", [2, 3], timeout=10)["result"] == 5
        assert _end(proc) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


@pytest.mark.parametrize("kind", ["pipe", "unix socket"])
def test_a_worker_logging_to_a_stderr_nobody_reads_is_not_held_up_by_the_access_lines(kind: str) -> None:
    """stderr a pipe or a Unix socket (journald's) nobody reads, filled by access lines: the
    workers write to pipes the broker reads, so a worker logging an error line is not held up,
    nor its calls or the others' (hostile testing, round 117: a worker blocked on a full pipe,
    a probe waited 10 s; round 118: the same on a socket, which the writer did not leave room
    in); its lines are dropped and counted as the access lines are."""
    if kind == "pipe":
        r, w = os.pipe()
    else:
        a, c = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        r, w = a.detach(), c.detach()
    try:
        proc, b = _spawn(w, "--app", "broker.demo:faults", "--access-log", "all", "--timeout", "10", workers="2")
        try:
            batch = json.dumps([rpc("add", [i, 1], i) for i in range(1000)])
            deadline = time.monotonic() + 60
            while sample(scrape_metrics(b), "rpc_broker_log_lines_dropped_total", log="access") == 0:
                assert time.monotonic() < deadline  # (stderr full: the writer waits, its queue fills)
                assert b.post(batch, timeout=10)[0] == 200
            for _ in range(3):
                t = time.monotonic()
                answer = b.call("raise_error", [-32000, "a code the broker keeps"], timeout=15)  # (the worker logs)
                assert answer["error"]["code"] == -32603 and time.monotonic() - t < 3, answer
                t = time.monotonic()
                assert b.call("add", [1, 2], timeout=15)["result"] == 3 and time.monotonic() - t < 3
            deadline = time.monotonic() + 10
            while sample(scrape_metrics(b), "rpc_broker_log_lines_dropped_total", log="worker") < 3:
                assert time.monotonic() < deadline  # (the workers' lines, past the full queue: counted)
                time.sleep(0.05)
            assert sample(scrape_metrics(b), "rpc_broker_worker_restarts_total", reason="hung") == 0
        finally:
            _end(proc)
    finally:
        os.close(r)
        os.close(w)


@contextlib.contextmanager
def _broker_stderr(*args: str, workers: str = "1") -> typing.Iterator[tuple[Broker, bytearray]]:
    """A broker (`_spawn`'s) whose stderr a thread reads until its end: the broker, and what
    was read so far; once the block ends, the broker stopped (exit 0 asserted) and all read."""
    r, w = os.pipe()
    got = bytearray()

    def read_all() -> None:
        while chunk := os.read(r, 65536):
            got.extend(chunk)

    reader = threading.Thread(target=read_all, daemon=True)
    reader.start()
    try:
        proc, b = _spawn(w, *args, workers=workers)
        try:
            yield b, got
        finally:
            assert _end(proc) == 0
    finally:
        os.close(w)
        reader.join(10)
        os.close(r)


@pytest.mark.parametrize("style", ["text", "json"])
def test_the_workers_lines_reach_stderr_through_the_broker(style: str) -> None:
    """The workers' lines (a refused error's WARNING) are read by the broker
    and written whole to its stderr, each its own line; in json each an object (every line
    but the start's banners parses)."""
    with _broker_stderr("--app", "broker.demo:faults", "--log-format", style, workers="2") as (b, got):
        answer = b.call("raise_error", [-32000, "a code the broker keeps"], timeout=15)
        assert answer["error"]["code"] == -32603
    text = got.decode()
    if style == "json":
        records = [json.loads(line) for line in text.splitlines() if not line.startswith("rpc-broker: ")]
        workers = [r for r in records if r.get("log") == "worker"]
        assert workers and all(f" pid {r['pid']} " in r["message"] for r in workers), workers  # (its own pid)
        text = "\n".join(r["message"] for r in workers)
    assert "raised an RpcError the worker refuses" in text, text[-2000:]
    assert re.search(r"worker\[[01]\] pid \d+ ", text), text[-2000:]
    assert all(line.count(" pid ") <= 1 for line in text.splitlines()), text[-2000:]  # (no line in another)


def test_a_handlers_print_reaches_the_brokers_stderr_at_once_as_a_line_of_its_own(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A handler's print goes to the worker's stdout: the pipe the broker reads too, line
    buffered (block-buffered, it came out at the worker's exit), and never to the broker's
    own stdout (MCP's stdio transport is that); a write with no newline ends as a line."""
    monkeypatch.delenv("PYTHONUNBUFFERED", raising=False)  # (as a service's environment has it)
    with _broker_stderr("--app", "tests.apps.chatty:registry") as (b, got):
        assert b.call("say", ["printed-by-a-handler"], timeout=15)["result"] is True
        deadline = time.monotonic() + 10
        while b" | printed-by-a-handler\n" not in got:
            assert time.monotonic() < deadline, bytes(got[-2000:])
            time.sleep(0.05)
        assert b.call("mutter", ["no newline"], timeout=15)["result"] is True
    assert re.search(rb"\nworker pid \d+ \| no newline\n", got), bytes(got[-2000:])


def test_a_clients_text_in_a_workers_line_cannot_pass_for_the_brokers_or_an_access_line() -> None:
    """An exception's message a client chose, with newlines, logged by the worker: its lines
    after the first are the record's (indented by the worker), shown by the broker as the
    worker's (`worker pid PID | `), not as lines of the broker's or access lines (hostile
    testing, round 119: they were written as they came)."""
    forged = ["2026-12-06 10:00:00,000 broker pid 1 INFO stopped",
              "time=2026-12-06T10:00:00.000Z client=10.0.0.7:4 token=admin transport=http method=add id=7 "
              "duration=0.000001 outcome=ok code=- pid=4242"]
    with _broker_stderr("--app", "tests.apps.chatty:registry") as (b, got):
        answer = b.call("fail", ["mallory\n" + "\n".join(forged) + "\n\x1b[2K\r"], timeout=15)
        assert answer["error"]["code"] == -32603
    lines = got.decode().splitlines()
    shown = [line for line in lines if "token=admin" in line or ("INFO stopped" in line and "pid 1 " in line)]
    assert len(shown) == 2 and all(re.match(r"worker pid \d+ \| ", line) for line in shown), lines[-30:]
    assert not any("\x1b" in line or "\r" in line for line in lines), lines[-30:]


@pytest.mark.parametrize("style", ["text", "json"])
def test_a_print_of_a_clients_text_cannot_pass_for_the_workers_own_log_line(style: str) -> None:
    """Hostile testing, round 131: a tool that printed its input, given a line in the worker's own
    form with its pid (a -32002's data tells it), wrote a CRITICAL line of the worker's, unmarked
    (and in json with its level, which `jq 'select(.level=="ERROR")'` alerting reads). The
    worker's logging has a pipe of its own: what it prints is marked a print, whatever it says."""
    with _broker_stderr("--app", "tests.apps.chatty:registry", "--log-format", style) as (b, got):
        pid = b.call("pid", [], timeout=15)["result"]
        forged = f"2026-12-07 10:00:00,000 worker[0] pid {pid} CRITICAL FORGED by a client"
        assert b.call("say", [forged], timeout=15)["result"] is True
        assert b.call("fail", ["a real error"], timeout=15)["error"]["code"] == -32603  # (its own line)
    lines = got.decode().splitlines()
    if style == "text":
        [shown] = [line for line in lines if "FORGED" in line]
        assert shown == f"worker pid {pid} | {forged}", lines[-20:]
        assert any(re.match(rf"\S+ \S+ worker\[0\] pid {pid} ERROR ", line) for line in lines), lines[-20:]
        return
    records = [json.loads(line) for line in lines if line.startswith("{")]
    [shown] = [r for r in records if "FORGED" in r.get("message", "")]
    assert (shown["log"], shown["pid"], shown["level"]) == ("worker", pid, None), shown
    assert any(r.get("log") == "worker" and r["level"] == "ERROR" for r in records), records[-10:]


def test_every_lines_time_is_utc_whatever_the_time_zone(monkeypatch: pytest.MonkeyPatch) -> None:
    """New user, round 110: under TZ=America/New_York the broker's own lines and the workers'
    were in local time, the access lines in UTC, none saying which. All are UTC now."""
    monkeypatch.setenv("TZ", "XYZ+05")  # (a POSIX zone five hours behind UTC: no tz database needed)
    before = datetime.datetime.now(datetime.UTC).replace(tzinfo=None)
    with _broker_stderr("--app", "tests.apps.chatty:registry", "--access-log", "all") as (b, got):
        assert b.call("fail", ["boom"], timeout=15)["error"]["code"] == -32603
    after = datetime.datetime.now(datetime.UTC).replace(tzinfo=None)
    text = got.decode()
    stamps = re.findall(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),\d{3} (broker|worker\[0\]) pid", text, re.M)
    stamps += [(m, "access") for m in re.findall(r"^time=(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)", text, re.M)]
    assert {kind for _, kind in stamps} == {"broker", "worker[0]", "access"}, text[-2000:]
    for stamp, kind in stamps:
        when = datetime.datetime.fromisoformat(stamp.replace(" ", "T"))
        assert before - datetime.timedelta(seconds=2) <= when <= after, (kind, stamp, before, after)


def test_lines_a_stderr_with_no_reader_loses_are_counted() -> None:
    """EPIPE (the reader gone): the lines lost counted as dropped (new users, round 108: 0)."""
    r, w = os.pipe()
    proc, b = _spawn(w, "--access-log", "all")
    os.close(r)  # (from now on every write fails: EPIPE)
    try:
        for _ in range(5):
            assert b.post(json.dumps([rpc("add", [i, 1], i) for i in range(100)]), timeout=10)[0] == 200
        deadline = time.monotonic() + 10
        while sample(scrape_metrics(b), "rpc_broker_log_lines_dropped_total", log="access") < 500:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert _end(proc) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        os.close(w)


def _post_and_leave(b: Broker, path: str, body: object, reset: bool, headers: str = "") -> None:
    """POST `body` on a connection of its own, and leave once the broker had it (0.3 s: by then a
    call of `sleep` is under way, or queued: either is owed an answer): closed (FIN, a half-close to
    the broker) or reset (RST, SO_LINGER 0)."""
    data = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", b.port), timeout=10)
    if reset:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{b.port}\r\nContent-Type: application/json\r\n"
              f"Accept: application/json, text/event-stream\r\n{headers}Content-Length: {len(data)}\r\n\r\n".encode()
              + data)
    time.sleep(0.3)
    s.close()


def test_a_call_whose_client_left_before_its_answer_has_one_line_mcp_tools_call_too(broker_factory: object) -> None:
    """Each call gets exactly one line whoever closed first (an MCP tools/call whose client closed,
    which cancels it, and a JSON-RPC call whose client reset, which drops it, had none). A call dropped or cancelled for its client is `abandoned` (as
    rpc_broker_calls_abandoned counts it; code `-`, the worker's pid if it was running); a JSON-RPC
    call whose client only half-closed is answered, and logged with the worker's outcome."""
    b = broker_factory("--workers", "1", "--access-log", "all")  # type: ignore[operator]
    meta = {"io.modelcontextprotocol/protocolVersion": "2026-07-28", "io.modelcontextprotocol/clientCapabilities": {}}
    mcp = "MCP-Protocol-Version: 2026-07-28\r\nMcp-Method: tools/call\r\nMcp-Name: sleep\r\n"

    def tool_call(id_: int) -> dict[str, object]:
        return {"jsonrpc": "2.0", "method": "tools/call", "id": id_,
                "params": {"name": "sleep", "arguments": {"seconds": 1.0}, "_meta": meta}}

    _post_and_leave(b, "/", rpc("sleep", [1.0], 1), reset=True)
    _post_and_leave(b, "/", [rpc("sleep", [1.0], 2), rpc("sleep", [1.0], 3)], reset=True)
    _post_and_leave(b, "/mcp", tool_call(4), reset=False, headers=mcp)
    _post_and_leave(b, "/mcp", tool_call(5), reset=True, headers=mcp)
    _post_and_leave(b, "/", rpc("sleep", [1.0], 6), reset=False)
    lines = wait_lines(b, 6)
    time.sleep(1.5)  # (past the sleeps: a late second line of any of them would be here by now)
    lines = access_lines(b.read_log(0.1))
    assert sorted(line["id"] for line in lines) == ["1", "2", "3", "4", "5", "6"], lines
    by_id = {line["id"]: line for line in lines}
    pid = worker_pid(b)
    for id_ in "12345":
        line = by_id[id_]
        assert (line["method"], line["outcome"], line["code"]) == ("sleep", "abandoned", "-"), line
        assert line["pid"] in (pid, "-"), line
    assert (by_id["6"]["outcome"], by_id["6"]["code"], by_id["6"]["pid"]) == ("ok", "-", pid)
    samples = scrape_metrics(b)
    assert sum(sample(samples, "rpc_broker_calls_abandoned_total", where=where) or 0
               for where in ("queued", "in_flight")) == 5
