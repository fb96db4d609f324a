"""A worker serving several front-ends (`serve --frontends N`): broker/worker/links.py.

In-process: a real `WorkerProtocol` on a socketpair (the first front-end's) and `Link`s on
more socketpairs, each driven by the raw wire as a front-end drives it; then a real worker
process (`python -m broker.worker` with two `--socket`s) over real Unix sockets."""

from __future__ import annotations

import asyncio
import json
import math
import os
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from test_worker_sdk import (
    CANCELLED,
    CHUNK_IDS,
    ENDS,
    INDEX,
    LOOPS,
    Broker,
    chunk_answers,
    chunk_frame,
    read_chunk,
    registry,
    result,
)

from broker import wire
from broker.wire import CANCEL_ACK, Kind, encode_call, encode_frame
from broker.worker import WorkerProtocol
from broker.worker.links import ID_MASK, LINK_SHIFT, Link, split

ROOT = Path(__file__).resolve().parent.parent


def test_split_routes_each_frame_to_its_link_with_the_front_end_s_own_id():
    frames = [
        encode_frame(Kind.RESULT, 7, 1, b"1"),
        encode_frame(Kind.RESULT, (1 << LINK_SHIFT) | 7, 2, b"22"),
        encode_frame(Kind.ERROR, 8, 3, b"{}"),
        encode_frame(Kind.RESULT, (2 << LINK_SHIFT) | ID_MASK, 4, b""),
        encode_frame(Kind.RESULT, (9 << LINK_SHIFT) | 1, 5, b"gone"),  # (no such link: dropped)
        encode_frame(Kind.CHUNK_REPLY, (1 << LINK_SHIFT) | 9, 6, b"x" * 100),
    ]
    links = [object(), object()]  # (split reads only how many there are)
    first, by_link = split(b"".join(frames), links)  # type: ignore[arg-type]
    assert bytes(first) == frames[0] + frames[2]
    assert by_link[0] == encode_frame(Kind.RESULT, 7, 2, b"22") + encode_frame(Kind.CHUNK_REPLY, 9, 6, b"x" * 100)
    assert by_link[1] == encode_frame(Kind.RESULT, ID_MASK, 4, b"")
    only_first, none = split(frames[0] + frames[2], links)  # type: ignore[arg-type]
    assert bytes(only_first) == frames[0] + frames[2] and none == [None, None]


def test_a_link_numbered_out_of_range_is_refused():
    with pytest.raises(ValueError):
        Link(None, 0, 1 << 20)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        Link(None, 256, 1 << 20)  # type: ignore[arg-type]


@pytest.fixture(params=sorted(LOOPS))
def run_links(request: pytest.FixtureRequest) -> Callable[..., object]:
    """run_links(test, n): a WorkerProtocol with n - 1 links, each front-end's end a `Broker`."""

    def runner(test: Callable[[WorkerProtocol, list[Broker]], Awaitable[None]], n: int = 2) -> None:
        errors: list[dict[str, object]] = []

        async def main() -> None:
            loop = asyncio.get_running_loop()
            loop.set_exception_handler(lambda _loop, ctx: errors.append(ctx))
            proto = WorkerProtocol(registry, slot=3, concurrency=10)
            transports = []
            brokers = []
            for number in range(n):
                worker_sock, broker_sock = socket.socketpair()
                if number == 0:
                    transport, _ = await loop.create_unix_connection(lambda: proto, sock=worker_sock)
                else:
                    link = Link(proto, number, wire.MAX_FRAME_BYTES)
                    proto.add_link(link)
                    transport, _ = await loop.create_unix_connection(lambda link=link: link, sock=worker_sock)
                transports.append(transport)
                reader, writer = await asyncio.open_unix_connection(sock=broker_sock)
                b = Broker(reader, writer)
                [hello] = await b.read()
                assert hello[:3] == (Kind.HELLO, 0, 0)
                b.hello = hello[3]
                brokers.append(b)
            try:
                await test(proto, brokers)
            finally:
                for transport in transports:
                    transport.close()
                for b in brokers:
                    b.writer.close()
                await asyncio.wait_for(proto.done, 5)

        with asyncio.Runner(loop_factory=LOOPS[request.param]) as runner_:
            runner_.run(main())
        assert not errors, errors

    return runner


def test_each_front_end_gets_its_own_answers_under_its_own_ids(run_links):
    async def test(proto: WorkerProtocol, bs: list[Broker]) -> None:
        assert all(b.hello == bs[0].hello for b in bs)  # the same HELLO on every connection
        for i, b in enumerate(bs):  # the same call ids on every front-end, other params
            b.send(b.call(1, "add_ints", b"[%d, 1]" % i), b.call(2, "async_add", b"[%d, 2]" % i),
                   b.call(ID_MASK, "add_ints", b"[%d, 3]" % i))
        for i, b in enumerate(bs):
            frames = await b.read(3)
            assert {f[1]: result(f) for f in frames} == {1: i + 1, 2: i + 2, ID_MASK: i + 3}
            await b.nothing_more()

    run_links(test, 3)


def test_a_chunk_and_a_cancel_on_a_link(run_links):
    async def test(proto: WorkerProtocol, bs: list[Broker]) -> None:
        first, second = bs
        second.send(chunk_frame(5, [("add_ints", b"[1, 2]", False), ("async_add", b"[3, 4]", False),
                                    ("add_ints", b"[0, 0]", True)]))
        _, answers = await read_chunk(second, 5)
        assert {i: json.loads(body) for i, (kind, body) in answers.items()} == {0: 3, 1: 7, 2: 0}  # (a notification too: the front-end counts it done)
        second.send(second.call(6, "nap", b"[30]"))
        await asyncio.sleep(0.05)
        first.send(first.call(6, "add_ints", b"[5, 5]"))  # (the same id on the other front-end runs on)
        assert result((await first.read())[0]) == 10
        second.send(encode_frame(Kind.CANCEL, 6))
        [f] = await second.read()
        assert f[:2] == (Kind.ERROR, 6) and f[3] == CANCEL_ACK
        await first.nothing_more()

    run_links(test)


def test_each_front_end_gets_its_chunks_objects_with_the_ids_it_sent(run_links):
    """The same chunk id and the same client ids from three front-ends at once, other params:
    each gets one CHUNK_RESULTS, its own results under the ids as it wrote them; and a chunk
    answered in entries (an async call in it) on one link leaves the others' objects whole."""

    async def test(proto: WorkerProtocol, bs: list[Broker]) -> None:
        for rounds in range(2):
            for n, b in enumerate(bs):
                calls = [(id_, b"[%d, %d]" % (i, 100 * n)) for i, id_ in enumerate(CHUNK_IDS)]
                method = "async_add" if rounds and n == 1 else "add_ints"
                b.send(encode_call(Kind.CHUNK, 5, len(calls), b"".join(
                    wire.CALL_ENTRY.pack(INDEX[method], 0, len(id_), len(p)) + id_ + p for id_, p in calls)))
            for n, b in enumerate(bs):
                frames = await b.read(timeout=10)
                while frames[-1][0] not in ENDS:
                    frames += await b.read(timeout=10)
                assert {f[1] for f in frames} == {5}
                if rounds and n == 1:
                    assert frames[-1][0] == Kind.CHUNK_REPLY
                    assert chunk_answers(frames) == {i: (Kind.RESULT, b"%d" % (i + 100)) for i in range(len(CHUNK_IDS))}
                else:
                    assert [f[0] for f in frames] == [Kind.CHUNK_RESULTS]
                    assert frames[0][3] == b"\n".join(b'{"jsonrpc":"2.0","id":%s,"result":%d}' % (id_, i + 100 * n)
                                                      for i, id_ in enumerate(CHUNK_IDS))
                await b.nothing_more()

    run_links(test, 3)


def test_the_worker_closes_only_once_every_front_end_said_bye(run_links):
    async def test(proto: WorkerProtocol, bs: list[Broker]) -> None:
        first, second = bs
        second.send(second.call(1, "nap", b"[0.2]"))
        await asyncio.sleep(0.02)
        first.send(encode_frame(Kind.BYE, 0))
        await first.nothing_more(0.1)  # the second still owes a call and said no BYE: open
        second.send(encode_frame(Kind.BYE, 0))
        [f] = await second.read()
        assert f[:2] == (Kind.RESULT, 1) and result(f) == 0.2
        await first.read_eof()
        await second.read_eof()
        await asyncio.wait_for(proto.done, 5)

    run_links(test)


def test_a_front_end_gone_takes_its_calls_and_leaves_the_others_served(run_links):
    async def test(proto: WorkerProtocol, bs: list[Broker]) -> None:
        first, second = bs
        started = time.monotonic()
        CANCELLED.clear()
        second.send(second.call(1, "watched", b'["x"]'), second.call(2, "nap", b"[30]"))
        first.send(first.call(1, "nap", b"[0.1]"))
        await asyncio.sleep(0.05)
        second.writer.close()  # that front-end exits
        await asyncio.sleep(0.05)
        [f] = await first.read()
        assert f[:2] == (Kind.RESULT, 1)
        first.send(first.call(2, "add_ints", b"[2, 2]"))
        assert result((await first.read())[0]) == 4
        assert not proto._tasks and "x" in CANCELLED, "the gone front-end's calls were not cancelled"
        assert time.monotonic() - started < 10

    run_links(test)


def test_a_call_id_past_the_mask_from_a_front_end_closes_its_link_only(run_links):
    async def test(proto: WorkerProtocol, bs: list[Broker]) -> None:
        first, second = bs
        second.send(encode_call(Kind.CALL, ID_MASK + 1, INDEX["add_ints"], b"[1, 2]"))
        await second.read_eof()
        first.send(first.call(1, "add_ints", b"[1, 2]"))
        assert result((await first.read())[0]) == 3

    run_links(test)


def accept_hello(server: socket.socket) -> tuple[socket.socket, wire.Hello, wire.FrameDecoder]:
    """Accept a worker's connection on `server`; return it, its HELLO and the decoder after it."""
    conn, _ = server.accept()
    conn.settimeout(60)
    decoder = wire.FrameDecoder()
    frames: list[tuple[int, int, int, bytes]] = []
    while not frames:
        data = conn.recv(65536)
        assert data, "the worker closed before its HELLO"
        frames = decoder.feed(data)
    assert frames[0][0] == Kind.HELLO
    return conn, wire.decode_hello(bytes(frames[0][3])), decoder


def _read(conn: socket.socket, decoder: wire.FrameDecoder, n: int,
          blocked: list[tuple[int, int, int, bytes]] | None = None) -> list[tuple[int, int, int, bytes]]:
    """`n` frames from `conn` (60 s at most), but BLOCKED ones (wire.BLOCKED: a handler blocks
    the worker), which go to `blocked`."""
    frames: list[tuple[int, int, int, bytes]] = []
    deadline = time.monotonic() + 60
    while len(frames) < n and time.monotonic() < deadline:
        data = conn.recv(65536)
        assert data, f"closed after {len(frames)} of {n} frames"
        for f in decoder.feed(data):
            (frames if f[0] != Kind.BLOCKED else blocked if blocked is not None else []).append(
                (f[0], f[1], f[2], bytes(f[3])))
    return frames


class _TwoFrontEnds:
    """A real worker process (`python -m broker.worker`) of `app` connected to two listening
    Unix sockets, as two front-ends: `conns` and their decoders once both HELLOs are in."""

    def __init__(self, tmp_path: Path, app: str) -> None:
        paths = [str(tmp_path / "a.sock"), str(tmp_path / "b.sock")]
        self.servers = []
        for path in paths:
            s = socket.socket(socket.AF_UNIX)
            s.bind(path)
            s.listen(1)
            s.settimeout(60)
            self.servers.append(s)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "broker.worker", "--socket", paths[0], "--socket", paths[1], "--slot", "0",
             "--app", app, "--parent-pid", str(os.getpid())],
            cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )
        (a, hello_a, dec_a), (b, hello_b, dec_b) = (accept_hello(s) for s in self.servers)
        assert hello_a == hello_b and hello_a.pid == self.proc.pid
        self.conns, self.decoders = [a, b], [dec_a, dec_b]
        self.hello = hello_a
        self.blocked: list[list[tuple[int, int, int, bytes]]] = [[], []]
        self.index = {m.name: i for i, m in enumerate(hello_a.methods)}

    def call(self, fe: int, *calls: tuple[int, str, bytes]) -> None:
        """Send (call id, method, params) calls to the worker in one write, as front-end `fe`."""
        self.conns[fe].sendall(b"".join(encode_call(Kind.CALL, call_id, self.index[method], params, math.inf, 1)
                                        for call_id, method, params in calls))

    def chunk(self, fe: int, chunk_id: int, *calls: tuple[bytes, str, bytes]) -> None:
        """Send a CHUNK of (raw id, method, params) calls to the worker, as front-end `fe`."""
        payload = b"".join(wire.CALL_ENTRY.pack(self.index[method], 0, len(id_), len(params)) + id_ + params
                           for id_, method, params in calls)
        self.conns[fe].sendall(encode_call(Kind.CHUNK, chunk_id, len(calls), payload, math.inf, 1))

    def read(self, fe: int, n: int = 1) -> list[tuple[int, int, int, bytes]]:
        """`n` frames from front-end `fe`'s socket; its BLOCKED ones go to `blocked[fe]`."""
        return _read(self.conns[fe], self.decoders[fe], n, self.blocked[fe])

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        assert self.proc.stderr is not None
        self.proc.stderr.close()
        for s in [*self.conns, *self.servers]:
            s.close()


def test_a_real_worker_process_serves_two_front_ends_and_exits_after_both_byes(tmp_path: Path):
    w = _TwoFrontEnds(tmp_path, "broker.demo:registry")
    try:
        assert w.hello.concurrency == 50  # (--concurrency 100: each front-end's share)
        w.call(0, (1, "add", b"[1, 2]"))
        w.call(1, (1, "add", b"[10, 20]"))
        [fa], [fb] = w.read(0), w.read(1)
        assert (fa[:2], fa[3], fb[:2], fb[3]) == ((Kind.RESULT, 1), b"3", (Kind.RESULT, 1), b"30")
        w.conns[0].sendall(encode_frame(Kind.BYE, 0))
        time.sleep(0.2)
        assert w.proc.poll() is None, "exited before the second front-end's BYE"
        w.conns[1].sendall(encode_frame(Kind.BYE, 0))
        assert w.proc.wait(60) == 0
    finally:
        w.close()


def test_answers_held_behind_a_blocking_call_reach_every_front_end(tmp_path: Path):
    """The held answers' thread (broker/worker/held.py) sends each front-end's answers to its
    own socket while a sync handler holds the loop: they arrive before it may return."""
    release = tmp_path / "release"
    path = json.dumps(str(release)).encode()
    w = _TwoFrontEnds(tmp_path, "tests.apps.holding:registry")
    try:
        release.touch()
        for fe in (0, 1):  # `hold` learnt fast (at once while the file exists): what is ready
            for i in range(3):  # is not written before its next call, but by the held answers' thread
                w.call(fe, (100 + i, "hold", b"[%s]" % path))
                assert w.read(fe)[0][3] == b'"released"'
        release.unlink()
        for fe in (1, 0):
            w.call(fe, (1, "add", b"[1, 1]"), (2, "hold", b"[%s]" % path))  # (read together: one slice)
            [f] = w.read(fe)  # while `hold` holds the loop
            assert f[:2] == (Kind.RESULT, 1) and f[3] == b"2"
            release.touch()  # (only now may `hold` return)
            [h] = w.read(fe)
            assert h[:2] == (Kind.RESULT, 2) and h[3] == b'"released"'
            release.unlink()
        for fe in (1, 0):  # a chunk's: the result it kept for its objects goes as a part, to its own front-end
            release.touch()
            w.call(fe, (3, "hold", b"[%s]" % path))  # (learnt fast again)
            assert w.read(fe)[0][:2] == (Kind.RESULT, 3)
            release.unlink()
            w.chunk(fe, 4, (b'"a"', "add", b"[2, %d]" % fe), (b"1e2", "hold", b"[%s]" % path))
            [part] = w.read(fe)  # while `hold` holds the loop
            assert part[:2] == (Kind.CHUNK_PART, 4) and chunk_answers([part]) == {0: (Kind.RESULT, b"%d" % (2 + fe))}
            release.touch()
            [end] = w.read(fe)
            assert end[:2] == (Kind.CHUNK_REPLY, 4) and chunk_answers([end]) == {1: (Kind.RESULT, b'"released"')}
            release.unlink()
    finally:
        w.close()


def test_a_real_worker_process_serves_a_front_end_on_an_inherited_socket(tmp_path: Path):
    """`--link-fd`: the other front-end's connection made by the broker (a socketpair's end,
    inherited), not by a path: served as a link, under its own ids."""
    path = str(tmp_path / "a.sock")
    ours, theirs = socket.socketpair()
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(path)
        server.listen(1)
        server.settimeout(60)
        proc = subprocess.Popen(
            [sys.executable, "-m", "broker.worker", "--socket", path, "--link-fd", str(theirs.fileno()), "--slot", "0",
             "--app", "broker.demo:registry", "--parent-pid", str(os.getpid())],
            cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            pass_fds=[theirs.fileno()],
        )
        theirs.close()
        try:
            first, hello, dec_first = accept_hello(server)
            ours.settimeout(60)
            dec_link = wire.FrameDecoder()
            frames: list[tuple[int, int, int, bytes]] = []
            while not frames:
                frames = dec_link.feed(ours.recv(65536))
            assert frames[0][0] == Kind.HELLO and wire.decode_hello(bytes(frames[0][3])) == hello
            index = {m.name: i for i, m in enumerate(hello.methods)}
            ours.sendall(encode_call(Kind.CALL, 9, index["add"], b"[4, 5]", math.inf, 1))
            first.sendall(encode_call(Kind.CALL, 9, index["add"], b"[1, 1]", math.inf, 1))
            [f] = _read(ours, dec_link, 1)
            [g] = _read(first, dec_first, 1)
            assert (f[:2], f[3], g[:2], g[3]) == ((Kind.RESULT, 9), b"9", (Kind.RESULT, 9), b"2")
            first.sendall(encode_frame(Kind.BYE, 0))
            ours.sendall(encode_frame(Kind.BYE, 0))
            assert proc.wait(60) == 0
            first.close()
        finally:
            ours.close()
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
            assert proc.stderr is not None
            proc.stderr.close()
