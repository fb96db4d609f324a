"""The control channel between front-ends (broker/peerwire.py): its lines, and descriptors
passed beside them over a real Unix socketpair."""

from __future__ import annotations

import itertools
import os
import socket
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker import peerwire
from broker.peerwire import (
    Collect,
    Counters,
    Exposition,
    Lost,
    Methods,
    PeerWireError,
    Ready,
    Receiver,
    Retire,
    Serve,
    Want,
    WorkerJoined,
)
from broker.wire import MethodInfo

MESSAGES = [
    WorkerJoined(slot=3, pid=4242, generation=2),
    Methods(generation=2, names=["add", "fib"], sync=["fib"], infos=[MethodInfo("add"), MethodInfo("fib", doc="f")]),
    Serve(pid=4242),
    Retire(pid=4242),
    Lost(pid=4242, reason="exited with 1 (\"quoted\"\nnewline)"),
    Exposition(body="# HELP x\nx_total 1.0\n"),
    Counters(samples=[("rpc_broker_calls", "rpc_broker_calls_total", {"method": "add", "outcome": "ok"}, 3.0)],
             round=7),
    Counters(),
    Collect(round=7),
    Want(),
    Ready(number=1),
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_each_message_is_one_line_and_decodes_to_itself(message):
    line = peerwire.encode(message)
    assert line.endswith(b"\n") and line.count(b"\n") == 1  # (a newline in a reason is escaped)
    assert peerwire.decode(line) == message


@pytest.mark.parametrize("line", [b"", b"{}", b'{"type": "nope"}', b'{"type": "serve"}', b"[1]", b"\xff"])
def test_a_bad_line_is_refused(line):
    with pytest.raises(PeerWireError):
        peerwire.decode(line)


def send(sock: socket.socket, message: object, fd: int = -1) -> None:
    """As `peers.Control` sends: a WorkerJoined's descriptor with its line's first byte."""
    line = peerwire.encode(message)  # type: ignore[arg-type]
    if fd >= 0:
        socket.send_fds(sock, [line], [fd])
    else:
        sock.sendall(line)


def test_descriptors_travel_beside_their_worker_lines_over_a_real_socketpair():
    a, b = socket.socketpair()
    pipes = [os.pipe() for _ in range(2)]
    try:
        send(a, Serve(pid=1))
        send(a, WorkerJoined(slot=0, pid=11, generation=1), pipes[0][1])
        send(a, WorkerJoined(slot=1, pid=12, generation=1), pipes[1][1])
        send(a, Retire(pid=11))
        receiver = Receiver()
        got: list[tuple[object, int]] = []
        while len(got) < 4:
            more = peerwire.recv(b, receiver, size=7)  # (small reads: lines and descriptors arrive in pieces)
            assert more is not None
            got += more
        assert [m for m, _ in got] == [Serve(1), WorkerJoined(0, 11, 1), WorkerJoined(1, 12, 1), Retire(11)]
        assert got[0][1] == -1 and got[3][1] == -1
        for (_, fd), (r, _) in zip(got[1:3], pipes):  # each descriptor is its own worker's: the same pipe
            os.write(fd, b"x%d" % fd)
            assert os.read(r, 100) == b"x%d" % fd
            os.close(fd)
        a.close()
        assert peerwire.recv(b, receiver) is None  # end of file
    finally:
        b.close()
        for r, w in pipes:
            os.close(r)
            os.close(w)


def test_lines_and_descriptors_that_do_not_pair_up_break_the_channel():
    r, w = os.pipe()
    try:
        with pytest.raises(PeerWireError, match="without its descriptor"):
            Receiver().feed(peerwire.encode(WorkerJoined(0, 1, 0)))
        receiver = Receiver()
        with pytest.raises(PeerWireError, match="no WorkerJoined line"):
            receiver.feed(peerwire.encode(Serve(1)), [os.dup(r)])
        receiver.close()  # (the stray descriptor closed)
        with pytest.raises(PeerWireError, match="past"):
            Receiver(1000).feed(b"x" * 1001)
        assert peerwire.MAX_LINE_BYTES >= 1 << 30  # (a method table's infos may take max_frame_bytes)
    finally:
        os.close(r)
        os.close(w)


@settings(max_examples=200, deadline=None)
@given(cuts=st.lists(st.integers(min_value=0, max_value=2000), max_size=20))
def test_any_split_of_the_stream_gives_the_same_messages(cuts):
    stream = b"".join(peerwire.encode(m) for m in MESSAGES if not isinstance(m, WorkerJoined))
    points = sorted({c % (len(stream) + 1) for c in cuts} | {0, len(stream)})
    receiver = Receiver()
    got = []
    for start, end in itertools.pairwise(points):
        got += receiver.feed(stream[start:end])
    assert [m for m, _ in got] == [m for m in MESSAGES if not isinstance(m, WorkerJoined)]


@pytest.mark.parametrize("sent", [b"garbage\n", peerwire.encode(Ready(number=1)), b""])
def test_a_peer_started_by_hand_with_no_setup_says_so_in_a_line(sent):
    # (hostile testing, round 126: `python -m broker.peer` given garbage printed a traceback)
    ours, theirs = socket.socketpair()
    with ours, theirs:
        ours.sendall(sent)
        ours.shutdown(socket.SHUT_WR)
        done = subprocess.run([sys.executable, "-m", "broker.peer", "--control", str(theirs.fileno())],
                              pass_fds=[theirs.fileno()], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.startswith("rpc-broker peer: "), done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    done = subprocess.run([sys.executable, "-m", "broker.peer", "--control", "0"], stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "no setup from the first front-end on descriptor 0" in done.stderr, done.stderr


def test_a_line_read_in_part_with_the_setup_is_not_lost():
    # (hostile testing, round 127: the peer read its Setup with one 64 KiB read, then read on
    # with a new Receiver: the part of the next line read with it was dropped, the rest was a
    # bad line, and the restarted peer went for good)
    import asyncio

    from broker.peer import _setup
    from broker.peers import Control
    from broker.peerwire import Setup

    methods = Methods(generation=1, names=[f"m{i}" for i in range(9000)], sync=[], infos=[])
    ours, theirs = socket.socketpair()
    with ours, theirs:
        ours.sendall(peerwire.encode(Setup(number=1, config={}, listeners=[])) + peerwire.encode(methods)[:30000])
        setup, pending, receiver = _setup(theirs)
        assert setup.number == 1 and pending == []
        got: list[object] = []

        async def read_on() -> None:
            loop = asyncio.get_running_loop()
            control = Control(loop, theirs, lambda message, fd: got.append(message), receiver=receiver)
            ours.sendall(peerwire.encode(methods)[30000:])
            for _ in range(500):
                if got or control.closed:
                    break
                await asyncio.sleep(0.01)
            control.close()

        asyncio.run(read_on())
        assert got == [methods]
