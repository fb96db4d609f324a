"""The log pipe in process (broker/logpipe.py): access entries rendered in batches (by the
loop's timer once attached) and the broker's records through one bounded deque to a writer
thread, written in order to a pipe; a chunk's entry a line per result; past the bound lines
dropped and counted; the stop writes what is captured and queued; a banner is one write."""

from __future__ import annotations

import asyncio
import fcntl
import io
import json
import logging
import os
import re
import subprocess
import sys
import threading
import time
import typing

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from broker import server
from broker.accesslog import Entry, Renderer
from broker.logpipe import FLUSH_SECONDS, LineWriter, LogPipe

SINGLE: Entry = (1.5, ("10.0.0.1", 80), "ci", "http", "m", b"7", 0.25, 0, 42, None)
CHUNK: Entry = (1.5, "", "", "unix", ["m", "n"], [b'"a"', b"9" * 70], 0.0, 0, 42, None)


@pytest.fixture
def pipe_fds() -> typing.Iterator[tuple[int, int]]:
    r, w = os.pipe()
    os.set_blocking(r, False)
    yield r, w
    os.close(r)
    os.close(w)


def read_until(fd: int, lines: int, timeout: float = 5.0) -> list[str]:
    """The lines read from `fd` once there are `lines` of them (or the deadline passed)."""
    data = b""
    deadline = time.monotonic() + timeout
    while data.count(b"\n") < lines and time.monotonic() < deadline:
        try:
            data += os.read(fd, 65536)
        except BlockingIOError:
            time.sleep(0.005)
    return data.decode().splitlines()


def test_entries_and_records_are_written_in_order_a_chunk_a_line_per_result(pipe_fds):
    r, w = pipe_fds
    pipe = LogPipe(fd=w)
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        pipe.start()
        pipe.access(SINGLE)
        # (the root logger's handler, as a record reaches it; not through a logger, whose level
        # or handlers another test in the same process may have changed: seen in the full suite)
        pipe.handler.handle(logging.LogRecord("broker.test", logging.WARNING, __file__, 1, "between %d and %d", (1, 2),
                                              None))
        pipe.access(CHUNK)
        pipe.flush()  # (what the loop's timer does: `attach`)
        lines = read_until(r, 4)
    finally:
        pipe.stop()
        root.handlers[:], _ = saved
        root.setLevel(saved[1])
    renderer = Renderer("text")
    assert lines[0] == renderer.entry(SINGLE)[0]
    assert lines[1].endswith("WARNING between 1 and 2")
    assert lines[2:] == renderer.entry(CHUNK)
    assert lines[3].split(" id=")[1].startswith("9" * 64 + "... ")  # (truncated at ID_BYTES)
    assert pipe.queued == 3 and pipe.records == 1 and pipe.taken == 4 and pipe.dropped == {"access": 0, "broker": 0, "worker": 0}


def test_past_its_bound_lines_are_dropped_and_counted_and_the_stop_writes_what_is_queued(pipe_fds):
    r, w = pipe_fds
    pipe = LogPipe(fd=w, max_lines=3, broker_reserve=0)  # (not started: nothing takes the lines off)
    pipe.access(SINGLE)
    pipe.access(CHUNK)
    pipe.access(CHUNK)
    pipe.flush()  # 5 lines queued: past the bound, but the deque was empty (a stderr keeping up loses none)
    assert pipe.queued == 5 and pipe.dropped == {"access": 0, "broker": 0, "worker": 0}
    pipe.access(SINGLE)
    pipe.access(CHUNK)
    pipe.record(logging.LogRecord("broker", logging.INFO, __file__, 1, "dropped", None, None))  # (flushes first)
    assert pipe.dropped == {"access": 3, "broker": 1, "worker": 0} and pipe.queued == 5
    pipe.taken = 4  # (as if the writer had taken 4 of them: 1 line left, room for 2)
    pipe.access(CHUNK)  # 2 lines: fit
    pipe.access(SINGLE)
    pipe.access(CHUNK)  # past the room: not rendered, dropped
    pipe.flush()
    assert pipe.queued == 7 and pipe.dropped == {"access": 6, "broker": 1, "worker": 0}
    pipe.taken = 6  # (room for 2)
    pipe.access(CHUNK)
    pipe.access(CHUNK)  # 2 entries fit the room, their 4 lines do not: the last 2 dropped
    pipe.flush()
    assert pipe.queued == 9 and pipe.dropped == {"access": 8, "broker": 1, "worker": 0}
    pipe.taken = 0
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        pipe.start()
        pipe.stop()
    finally:
        root.handlers[:], _ = saved
        root.setLevel(saved[1])
    lines = read_until(r, 9)
    renderer = Renderer("text")
    single, chunk = renderer.entry(SINGLE), renderer.entry(CHUNK)
    assert lines == single + chunk * 4 and pipe.taken == 9


class _Writes(io.FileIO):
    """A file that keeps each write it is given (the system calls a stream makes)."""

    def __init__(self, fd: int) -> None:
        super().__init__(fd, "wb", closefd=False)
        self.calls: list[bytes] = []

    def write(self, data: typing.Any) -> int:
        self.calls.append(bytes(data))
        return typing.cast(int, super().write(data))


def test_a_banner_is_one_write_so_no_log_line_lands_inside_it(pipe_fds, monkeypatch):
    """The writer thread writes to the same stderr: print's two writes (the text, then the
    newline) let an access line in between (seen: a line empty, JSON lines unreadable)."""
    _r, w = pipe_fds
    raw = _Writes(w)
    # (as Python makes sys.stderr: its text layer straight on the file, no buffer between)
    monkeypatch.setattr(sys, "stderr", io.TextIOWrapper(typing.cast(typing.BinaryIO, raw), "utf-8",
                                                        line_buffering=True, write_through=True))
    server._banner("rpc-broker: serving JSON-RPC on http://127.0.0.1:1/")
    assert raw.calls == [b"rpc-broker: serving JSON-RPC on http://127.0.0.1:1/\n"]


def test_attached_to_a_loop_lines_are_rendered_there_in_batches_records_after_earlier_lines(pipe_fds):
    r, w = pipe_fds
    pipe = LogPipe(fd=w)
    root = logging.getLogger()
    saved = root.handlers[:], root.level

    async def main() -> list[str]:
        pipe.attach(asyncio.get_running_loop())
        pipe.access(SINGLE)
        pipe.access(CHUNK)
        assert pipe.queued == 0  # (captured: rendered at the timer's next turn)
        await asyncio.sleep(FLUSH_SECONDS * 3)
        assert pipe.queued == 3
        pipe.access(SINGLE)
        pipe.handler.handle(logging.LogRecord("broker.test", logging.WARNING, __file__, 1, "after the line before it",
                                              None, None))  # (on the loop's thread; as in the test above)
        pipe.access(CHUNK)
        pipe.detach()  # (renders what is captured)
        return read_until(r, 7)

    try:
        pipe.start()
        lines = asyncio.run(main())
    finally:
        pipe.stop()
        root.handlers[:], _ = saved
        root.setLevel(saved[1])
    renderer = Renderer("text")
    single, chunk = renderer.entry(SINGLE), renderer.entry(CHUNK)
    assert lines[:4] == single + chunk + single
    assert lines[4].endswith("WARNING after the line before it") and lines[5:] == chunk
    assert pipe.queued == 6 and pipe.records == 1 and pipe.taken == 7


_IDS = st.one_of(
    st.integers(-(10**80), 10**80).map(lambda n: str(n).encode()),
    st.text(max_size=80).map(lambda t: json.dumps(t, ensure_ascii=False).encode()),
    st.sampled_from([b"null", b"1.5e3", b"0012", b"9" * 64, b"9" * 65]),
)
_NAMES = st.text(min_size=1, max_size=12)
_PEERS = st.sampled_from([("127.0.0.1", 5), ("::1", 80, 0, 0), "", None, ("10.0.0.1", 1)])
_SINGLES = st.tuples(
    st.floats(-1e10, 4e9), _PEERS, st.sampled_from(["", "ci", "a b"]), st.sampled_from(["http", "tcp", "unix"]),
    _NAMES, _IDS, st.floats(0, 1e4), st.sampled_from([0, -32000, -32601, 7]), st.sampled_from([0, 42]),
    st.one_of(st.none(), st.just(b'{"token": "s", "a": [1]}'), st.just(9000)),
)  # fmt: skip


@st.composite
def _entries(draw: st.DrawFn) -> Entry:
    entry = draw(_SINGLES)
    if draw(st.booleans()):  # (a chunk's results: method and id lists of one length)
        n = draw(st.integers(1, 4))
        entry = (*entry[:4], draw(st.lists(_NAMES, min_size=n, max_size=n)),
                 draw(st.lists(_IDS, min_size=n, max_size=n)), *entry[6:])  # fmt: skip
    return typing.cast(Entry, entry)


@settings(max_examples=300, deadline=None)
@given(st.lists(_entries(), max_size=12), st.sampled_from(["text", "json"]))
@example([(-1.0, ("127.0.0.1", 5), "", "http", "0", b"0", 0.0, 0, 0, None)], "text")  # (found: its second unset)
def test_lines_renders_a_batch_as_each_entry_alone(entries, fmt):
    """`Renderer.lines` (the loop's batch, its fast paths) makes the lines `Renderer.entry`
    makes of each entry, whatever the ids, names, peers, times and params."""
    want = [line for entry in entries for line in Renderer(fmt).entry(entry)]
    renderer = Renderer(fmt)
    assert renderer.lines(entries) == want
    assert renderer.lines(entries) == want  # (its caches filled)


_WORKER = "import os\nfor i in range(3000):\n    os.write(2, b'worker %d ' % i + b'y' * 100 + b'\\n')\n"


def test_lines_stay_whole_beside_another_process_writing_to_a_slow_pipe(pipe_fds):
    """The writer's lines and another process's (a worker's, to the same stderr) cross a pipe
    read slowly: every line arrives whole (writes of whole lines at most PIPE_BUF; round
    117 saw workers' lines spliced into 64 KiB writes)."""
    r, w = pipe_fds
    writer = LineWriter(w)
    data = "".join(f"line {i} " + "x" * 140 + "\n" for i in range(6000)).encode()
    child = subprocess.Popen([sys.executable, "-c", _WORKER], stderr=w)
    thread = threading.Thread(target=writer.write, args=(data,))
    thread.start()
    got = b""
    deadline = time.monotonic() + 60
    while (thread.is_alive() or child.poll() is None or got.count(b"\n") < 9000) and time.monotonic() < deadline:
        try:
            got += os.read(r, 2048)
        except BlockingIOError:
            pass
        time.sleep(0.0005)  # (a slow reader: the pipe stays nearly full, both writers waiting on it)
    thread.join(10)
    child.wait(10)
    lines = got.decode().splitlines()
    assert len(lines) == 9000
    assert all(re.fullmatch(r"line \d+ x{140}|worker \d+ y{100}", line) for line in lines), \
        [line for line in lines if not re.fullmatch(r"line \d+ x{140}|worker \d+ y{100}", line)][:3]


def test_a_workers_stderr_is_forwarded_in_whole_lines_and_closed_at_its_end(pipe_fds):
    """`follow`: lines read as they come, a line begun kept until its newline, a line with no
    newline cut once past 64 KiB (a read's), the rest at the end of file given its newline; the pipe closed."""
    _r, w = pipe_fds
    pipe = LogPipe(fd=w)  # (not started: what is queued stays on the deque, looked at here)
    worker_r, worker_w = os.pipe()

    async def main() -> None:
        loop = asyncio.get_running_loop()
        pipe.attach(loop, ticks=False)
        pipe.follow(worker_r, 4242)
        os.write(worker_w, b"one\ntw")
        await asyncio.sleep(0.05)
        os.write(worker_w, b"o\n" + b"x" * 40000)  # (a pipe holds 64 KiB: written in two)
        await asyncio.sleep(0.05)
        os.write(worker_w, b"x" * 30000)
        await asyncio.sleep(0.05)
        os.write(worker_w, b"\nlast, no newline")
        os.close(worker_w)
        await asyncio.sleep(0.05)
        pipe.detach()

    asyncio.run(main())
    queued = b"".join(item[0] for item in pipe._pending if type(item) is tuple)
    assert queued == b"".join(b"worker pid 4242 | " + line + b"\n" for line in (
        b"one", b"two", b"x" * 70000, b"...", b"last, no newline"))  # (a cut line's rest marked "...")
    assert pipe.queued == 5 and all(type(i) is tuple and i[2] == "worker" for i in pipe._pending)
    with pytest.raises(OSError):
        os.fstat(worker_r)  # (closed at its end of file)


@pytest.mark.parametrize("logging_pipe", [True, False], ids=["logging pipe", "output pipe"])
@pytest.mark.parametrize("style", ["text", "json"])
def test_a_workers_lines_are_written_safe_to_show(pipe_fds, style: str, logging_pipe: bool) -> None:
    """Control characters (an ANSI escape, a carriage return, a C1 CSI) and bytes not UTF-8
    in a worker's line are escaped in text; in json each line is an object of the broker's,
    the worker's text its message, so every line parses and none is a forged access line. A
    line in the worker's own form shows as its log line from its logging's pipe only: from its
    stdout and stderr (a print) it is marked as the others are (hostile testing, round 131)."""
    _r, w = pipe_fds
    pipe = LogPipe(fd=w, style=style)  # (not started: what is queued stays on the deque)
    worker_r, worker_w = os.pipe()
    forged = b'{"time":"2026-01-01T00:00:00.000Z","log":"access","method":"add","outcome":"ok"}'
    own = b"2026-12-06 10:00:00,000 worker[0] pid 4242 ERROR handler boom raised"
    other = b"2026-12-06 10:00:00,000 worker[0] pid 4243 ERROR not this worker's"
    written = (b"plain \xc3\xa9\n\x1b[31mred\rover\x07 \xc2\x9b2J \xff\xfe\n" + forged + b"\n" + own + b"\n"
               + other + b"\n")
    try:
        async def main() -> None:
            pipe.attach(asyncio.get_running_loop(), ticks=False)
            pipe.follow(worker_r, 4242, logging_pipe)
            os.write(worker_w, written)
            await asyncio.sleep(0.05)
            pipe.detach()

        asyncio.run(main())
    finally:
        os.close(worker_w)
    queued = b"".join(item[0] for item in pipe._pending if type(item) is tuple)
    assert pipe.queued == 5
    if style == "text":
        assert queued == (b"worker pid 4242 | plain \xc3\xa9\n"
                          b"worker pid 4242 | \\x1b[31mred\\x0dover\\x07 \\x9b2J \\xff\\xfe\n"
                          b"worker pid 4242 | " + forged + b"\n" + (b"" if logging_pipe else b"worker pid 4242 | ")
                          + own + b"\nworker pid 4242 | " + other + b"\n")
        return
    lines = [json.loads(line) for line in queued.decode().splitlines()]
    assert [(line["log"], line["pid"], line["level"], line["message"]) for line in lines] == [
        ("worker", 4242, None, "plain \u00e9"), ("worker", 4242, None, "\x1b[31mred\rover\x07 \x9b2J \\xff\\xfe"),
        ("worker", 4242, None, forged.decode()), ("worker", 4242, "ERROR" if logging_pipe else None, own.decode()),
        ("worker", 4242, None, other.decode())]
    assert all(re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", line["time"]) for line in lines)


def test_a_workers_lines_past_the_bound_are_dropped_and_counted_and_detach_reads_what_is_left(pipe_fds):
    _r, w = pipe_fds
    pipe = LogPipe(fd=w, max_lines=6)  # (not started: nothing takes the lines off; a worker's: 3 at most)
    worker_r, worker_w = os.pipe()
    try:
        async def main() -> None:
            pipe.attach(asyncio.get_running_loop(), ticks=False)
            pipe.follow(worker_r, 4242)
            os.write(worker_w, b"a\nb\n")
            await asyncio.sleep(0.05)  # (the deque empty: taken)
            os.write(worker_w, b"c\nd\n")
            await asyncio.sleep(0.05)  # (2 + 2 past half the bound, 6 // 2: dropped)
            pipe.taken = 2  # (as if the writer had written the first 2)
            os.write(worker_w, b"e\n")  # (not read by the loop: `detach` reads it, queues it)
            pipe.detach()

        asyncio.run(main())
        assert pipe.queued == 3 and pipe.dropped == {"access": 0, "broker": 0, "worker": 2}
        with pytest.raises(OSError):
            os.fstat(worker_r)  # (closed by `detach`, its worker alive or not)
    finally:
        os.close(worker_w)


def test_the_bytes_the_writer_holds_count_against_the_bound(pipe_fds):
    """Until written, a buffer the writer took counts against `max_bytes` (hostile testing,
    round 118: the writer's buffer in hand uncounted, 2-3 times the bound held); a flush on
    an empty deque keeps the lines that fit the bound, not all."""
    r, w = pipe_fds
    os.set_blocking(w, False)
    try:
        while True:
            os.write(w, b"x" * 4096)  # (stderr full: the writer blocks on its first write)
    except BlockingIOError:
        pass
    os.set_blocking(w, True)
    pipe = LogPipe(fd=w, max_lines=10000, max_bytes=20000)
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        pipe.start()
        for i in range(1000):
            pipe.access((1.5, "", "", "unix", "m", str(i).encode(), 0.0, 0, 42, None))
        pipe.flush()  # (the deque empty: the lines that fit 20,000 bytes)
        assert 0 < pipe.queued < 1000 and pipe.queued_bytes <= 20000
        queued = pipe.queued
        deadline = time.monotonic() + 10
        while pipe._pending and time.monotonic() < deadline:
            time.sleep(0.01)  # (the writer takes the buffer, and blocks writing it)
        assert not pipe._pending and pipe.taken == 0
        for i in range(10):
            pipe.access((1.5, "", "", "unix", "m", str(i).encode(), 0.0, 0, 42, None))
        pipe.flush()  # (the deque empty, but the writer's buffer fills the bound: dropped)
        assert pipe.queued == queued and pipe.dropped["access"] == 1000 - queued + 10
    finally:
        thread = pipe._thread
        pipe.stop(timeout=0.2)
        root.handlers[:], _ = saved
        root.setLevel(saved[1])
        os.set_blocking(r, False)
        deadline = time.monotonic() + 10
        while thread is not None and thread.is_alive() and time.monotonic() < deadline:
            try:  # (read until the abandoned writer has written what it held and ended: its
                os.read(r, 65536)  # descriptor's number is another test's pipe once this one's is closed)
            except BlockingIOError:
                time.sleep(0.01)
        assert thread is None or not thread.is_alive()


def test_past_its_bytes_bound_a_buffer_is_dropped_whole(pipe_fds):
    """Lines of 12 kB (params, escaped) held 155 MB in 10,000 lines (hostile testing, round
    117): the access lines queued are bounded in bytes too."""
    _r, w = pipe_fds
    big: Entry = (1.5, "", "", "unix", "m", b"7", 0.25, 0, 42, 5000)  # ("(5000 bytes, not kept)")
    pipe = LogPipe(fd=w, max_lines=1000, max_bytes=500)  # (not started: nothing takes them off)
    for _ in range(3):
        pipe.access(big)
    pipe.flush()  # (the deque empty: taken whole, past the bound)
    assert pipe.queued == 3 and pipe.queued_bytes > 300
    pipe.access(big)
    pipe.access(big)
    pipe.flush()  # (past 500 bytes: dropped whole)
    assert pipe.queued == 3 and pipe.dropped == {"access": 2, "broker": 0, "worker": 0}
    pipe.taken, pipe.taken_bytes = 3, pipe.queued_bytes  # (as if the writer had taken them)
    pipe.access(big)
    pipe.flush()
    assert pipe.queued == 4 and pipe.dropped["access"] == 2


def test_the_broker_s_own_lines_have_a_reserve_past_the_access_lines_bound(pipe_fds):
    _r, w = pipe_fds
    pipe = LogPipe(fd=w, max_lines=3, broker_reserve=2)  # (not started)
    pipe.access(SINGLE)
    pipe.access(CHUNK)
    pipe.flush()
    pipe.access(SINGLE)
    pipe.flush()  # (the bound reached: access lines dropped)
    assert pipe.queued == 3 and pipe.dropped == {"access": 1, "broker": 0, "worker": 0}
    for _ in range(3):
        pipe.record(logging.LogRecord("broker", logging.WARNING, __file__, 1, "kept", None, None))
    assert pipe.records == 2 and pipe.dropped == {"access": 1, "broker": 1, "worker": 0}


def test_a_small_pipe_and_a_line_past_half_of_it_are_written(pipe_fds):
    """A pipe of one page (Linux's past fs.pipe-user-pages-soft), read: writes of 4 KiB and a
    line of 6 kB, each more than half of it, are written once it is empty (hostile testing,
    round 118: the writer waited for room that could never be, and wrote nothing again)."""
    r, w = pipe_fds
    fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, 4096)
    assert fcntl.fcntl(w, fcntl.F_GETPIPE_SZ) == 4096
    writer = LineWriter(w)
    data = "".join(f"line {i} " + "x" * 140 + "\n" for i in range(100)).encode() + b"y" * 6000 + b"\n"
    thread = threading.Thread(target=writer.write, args=(data,))
    thread.start()
    got = b""
    deadline = time.monotonic() + 20
    while len(got) < len(data) and time.monotonic() < deadline:
        try:
            got += os.read(r, 65536)
        except BlockingIOError:
            time.sleep(0.001)
    thread.join(10)
    assert got == data and not thread.is_alive()


def _follow_writes(pipe: LogPipe, *writes: bytes) -> bytes:
    """What `pipe` (not started) queued of a worker's (pid 4242) pipe given `writes`, each
    read on its own by the loop, then the pipe closed."""
    worker_r, worker_w = os.pipe()

    async def main() -> None:
        pipe.attach(asyncio.get_running_loop(), ticks=False)
        pipe.follow(worker_r, 4242)
        for data in writes:
            os.write(worker_w, data)
            await asyncio.sleep(0.05)
        os.close(worker_w)
        await asyncio.sleep(0.05)
        pipe.detach()

    asyncio.run(main())
    return b"".join(item[0] for item in pipe._pending if type(item) is tuple)


def test_the_rest_of_a_cut_line_never_passes_for_a_line_of_the_workers_own(pipe_fds) -> None:
    """Hostile testing, round 120: a client's text logged by a worker, past 64 KiB, was cut
    there, and its rest, read as a line of its own, wrote a line of the worker's own format."""
    _r, w = pipe_fds
    forged = b"2026-12-06 16:58:59,720 worker[0] pid 4242 CRITICAL FORGED-BY-CLIENT\n"
    queued = _follow_writes(LogPipe(fd=w, max_lines=100), b"y" * 65536, forged)
    assert queued.split(b"\n")[1] == b"worker pid 4242 | ..." + forged.rstrip(b"\n"), queued[-200:]


def test_line_separators_are_escaped_and_empty_lines_left_out_in_text(pipe_fds) -> None:
    """Hostile testing, round 120: U+2028 and U+2029 went through, and str.splitlines (a log
    viewer's) read the rest as a line of the broker's; empty lines made 18 bytes each. Round
    121: bidirectional and invisible formatting characters (RLO, zero-width space, BOM) too."""
    _r, w = pipe_fds
    queued = _follow_writes(LogPipe(fd=w), "a\u2028b\u2029c\n\n\n\nd\u202ee\u200bf\ufeff\u061c\U000e0041\n".encode())
    assert queued == (b"worker pid 4242 | a\\u2028b\\u2029c\n"
                      b"worker pid 4242 | d\\u202ee\\u200bf\\ufeff\\u061c\\U000e0041\n")


def test_one_read_of_more_lines_than_half_the_bound_is_dropped_even_on_an_empty_deque(pipe_fds) -> None:
    """Hostile testing, round 120: one read of 32,768 short lines, put on an empty deque,
    was taken whole, past the bound, and the access lines after it dropped."""
    _r, w = pipe_fds
    pipe = LogPipe(fd=w, max_lines=100)
    assert _follow_writes(pipe, b"y\n" * 60, b"z\n" * 40) == b"worker pid 4242 | z\n" * 40
    assert pipe.dropped["worker"] == 60 and pipe.queued == 40


def test_escaping_a_read_full_of_control_characters_is_not_a_call_a_character(pipe_fds) -> None:
    """Hostile testing, round 120: each control character escaped by a Python function (50 ms
    of the loop a read of 64 KiB of DEL). Counted here in Python calls, not timed."""
    _r, w = pipe_fds
    pipe = LogPipe(fd=w)
    calls = [0]
    not_own = re.compile(rb"^(?!x)(?=[\s\S])", re.M)

    def count(frame: object, event: str, arg: object) -> None:
        if event in ("call", "c_call"):
            calls[0] += 1

    sys.setprofile(count)
    try:
        out = pipe._worker_lines(b"\x7f\x01" * 30000 + b"\n", 4242, not_own, True)
    finally:
        sys.setprofile(None)
    assert out == b"worker pid 4242 | " + b"\\x7f\\x01" * 30000 + b"\n"
    assert calls[0] < 100, calls


def test_a_writer_held_back_for_a_few_flushes_of_a_batch_flood_loses_no_line(pipe_fds):
    """Four clients' batches of 1,000 `add`s, flushed four times while the
    writer takes nothing (CI's full run held it back so: 2,500 of them dropped when the queue
    held 10,000 lines): the default bounds keep every line."""
    _r, w = pipe_fds
    pipe = LogPipe(fd=w)  # (not started: nothing takes the lines off)
    for _ in range(4):
        for i in range(4000):
            pipe.access((1.5, "127.0.0.1:5", "tok", "http", "add", str(i).encode(), 0.0001, 0, 42, None))
        pipe.flush()
    assert pipe.dropped["access"] == 0 and pipe.queued == 16000 and pipe.queued_bytes < 16 * 1024 * 1024
