"""A call sent ALONE to a worker serving several front-ends (broker/worker/alone.py, wire.HOLD).

In-process: a real `WorkerProtocol` and its `Link`s on socketpairs (`run_links`), each driven by
the raw wire as a front-end drives it; then a real worker process over real Unix sockets."""

from __future__ import annotations

import asyncio
import math
import socket
import time
from pathlib import Path

import pytest
from test_worker_links import _TwoFrontEnds, run_links  # noqa: F401  # (a fixture, by name)
from test_worker_sdk import INDEX, LOOPS, Broker, chunk_answers, chunk_frame, registry, result

from broker import wire
from broker.wire import CANCEL_ACK, RETURN_ASIDE, Kind, encode_call, encode_frame
from broker.worker import WorkerProtocol
from broker.worker import alone as alone_runs
from broker.worker.links import Link

HOLD_ON = (Kind.HOLD, 0, 1, b"")
HOLD_OFF = (Kind.HOLD, 0, 0, b"")
_ENTRIES = wire.HEADER_SIZE + wire.DEADLINE.size  # where a CALL's params (a CHUNK's entries) start


def alone(call_id: int, method: str, params: bytes, deadline: float = math.inf, flow: int = 2) -> bytes:
    """A CALL sent ALONE (its method's calls run alone after a worker died under them)."""
    return encode_call(Kind.CALL, call_id, INDEX[method], params, deadline, flow | wire.ALONE)


def starts(call_id: int) -> tuple[int, int, int, bytes]:
    """What the front-end of a call sent ALONE reads before it starts (wire.STARTS)."""
    return (Kind.HOLD, call_id, wire.STARTS, b"")


def call(call_id: int, method: str, params: bytes, flow: int = 2) -> bytes:
    return encode_call(Kind.CALL, call_id, INDEX[method], params, math.inf, flow)


def entries(payload: bytes) -> int:
    """How many CALL_ENTRYs a CHUNK's entries (or a RETURN of a chunk's) hold."""
    n = pos = 0
    while pos < len(payload):
        _method, _flags, id_len, params_len = wire.CALL_ENTRY.unpack_from(payload, pos)
        pos += wire.CALL_ENTRY.size + id_len + params_len
        n += 1
    return n


def test_the_other_front_ends_waiting_calls_are_given_back_and_the_call_waits_for_their_answer(run_links):  # noqa: F811  # (the fixture imported)
    async def test(proto: WorkerProtocol, bs: list[Broker]) -> None:
        first, second = bs
        batch = chunk_frame(2, [("add_ints", b"[5, 6]", False), ("async_add", b"[1, 1]", False)], flow=2)
        first.send(call(1, "spin", b"[0.2]"), alone(2, "add_ints", b"[1, 2]"))
        await asyncio.sleep(0.05)  # (`spin` holds the loop: what the second sends now waits behind the call)
        second.send(call(1, "add_ints", b"[3, 4]"), batch, call(3, "nap", b"[0]"))
        assert result((await first.read())[0]) == 0.2
        # The second is held, and its calls come back unstarted, aside (as sent: a chunk's entries whole)
        assert await second.read(4) == [
            HOLD_ON, (Kind.RETURN, 1, RETURN_ASIDE, b"[3, 4]"), (Kind.RETURN, 2, RETURN_ASIDE, batch[_ENTRIES:]),
            (Kind.RETURN, 3, RETURN_ASIDE, b"[0]")]
        await first.nothing_more(0.1)  # (not before the second answers the hold)
        second.send(call(4, "add_ints", b"[0, 0]"))  # sent before it saw the hold: back at once
        assert await second.read() == [(Kind.RETURN, 4, RETURN_ASIDE, b"[0, 0]")]
        second.send(encode_frame(Kind.HOLD, 0, 1))
        assert await first.read() == [starts(2)]
        assert result((await first.read())[0]) == 3
        assert await second.read() == [HOLD_OFF]
        second.send(call(5, "add_ints", b"[2, 2]"))  # served again
        assert result((await second.read())[0]) == 4
        await first.nothing_more()

    run_links(test)


def test_the_call_starts_once_the_other_front_ends_calls_running_ended(run_links):  # noqa: F811  # (the fixture imported)
    async def test(proto: WorkerProtocol, bs: list[Broker]) -> None:
        first, second, third = bs
        second.send(call(1, "nap", b"[0.3]"))
        await asyncio.sleep(0.05)
        first.send(alone(1, "nap", b"[0.01]"))  # (async: the release waits for its answer)
        assert await second.read() == [HOLD_ON] and await third.read() == [HOLD_ON]
        second.send(encode_frame(Kind.HOLD, 0, 1))
        third.send(encode_frame(Kind.HOLD, 0, 1))
        await first.nothing_more(0.1)  # (the second's call runs)
        [f] = await second.read()
        assert f[:2] == (Kind.RESULT, 1) and result(f) == 0.3
        assert await first.read() == [starts(1)]
        assert result((await first.read())[0]) == 0.01
        assert await second.read() == [HOLD_OFF] and await third.read() == [HOLD_OFF]

    run_links(test, 3)


def test_a_chunk_started_gives_back_the_calls_it_has_not_started(run_links):  # noqa: F811  # (the fixture imported)
    async def test(proto: WorkerProtocol, bs: list[Broker]) -> None:
        first, second = bs
        spins = [("spin", b"[0.03]", False)] * 20  # (each a whole slice: the chunk runs in turns)
        second.send(chunk_frame(7, spins, flow=1))
        await asyncio.sleep(0.1)
        first.send(alone(1, "add_ints", b"[1, 1]", flow=2))  # (a flow not charged: it goes ahead of the chunk)
        frames = []
        while not any(f[0] in (Kind.CHUNK_REPLY, Kind.CHUNK_RESULTS) for f in frames):
            frames += await second.read(timeout=10)
        assert HOLD_ON in frames
        [back] = [f for f in frames if f[0] == Kind.RETURN]
        ran = back[2] & ~RETURN_ASIDE
        assert back[:2] == (Kind.RETURN, 7) and back[2] & RETURN_ASIDE and 0 < ran < 20
        assert entries(back[3]) == 20 - ran  # (its calls from `ran` on, as sent)
        answered = chunk_answers([f for f in frames if f[0] in (Kind.CHUNK_PART, Kind.CHUNK_REPLY)])
        assert sorted(answered) == list(range(ran))  # (the ones that ran, answered as usual)
        await first.nothing_more(0.05)
        second.send(encode_frame(Kind.HOLD, 0, 1))
        assert await first.read() == [starts(1)]
        assert result((await first.read())[0]) == 2
        assert await second.read() == [HOLD_OFF]

    run_links(test)


def test_a_call_alone_past_its_deadline_or_cancelled_unheld_releases_the_others(run_links):  # noqa: F811  # (the fixture imported)
    async def test(proto: WorkerProtocol, bs: list[Broker]) -> None:
        first, second = bs
        first.send(alone(1, "add_ints", b"[1, 1]", deadline=time.monotonic() + 0.2))
        assert await second.read() == [HOLD_ON]  # (never answered: a stopped front-end)
        [f] = await first.read(timeout=5)
        assert f == (Kind.ERROR, 1, wire.NOT_RUN, CANCEL_ACK)  # at its deadline, never run
        assert await second.read() == [HOLD_OFF]
        second.send(encode_frame(Kind.HOLD, 0, 1))  # (resumed: the answer it owed; else it is not waited for)
        await asyncio.sleep(0.1)
        first.send(alone(2, "add_ints", b"[1, 1]"))
        assert await second.read() == [HOLD_ON]
        first.send(encode_frame(Kind.CANCEL, 2))
        assert (await first.read())[0][:2] == (Kind.ERROR, 2)
        assert await second.read() == [HOLD_OFF]
        second.send(call(1, "add_ints", b"[2, 3]"))
        assert result((await second.read())[0]) == 5

    run_links(test)


async def _second_waits_its_turn(first: Broker, second: Broker) -> None:
    """The first sends a call ALONE (`nap(0.2)`), the second one too while it runs (`add_ints(1, 1)`)."""
    first.send(alone(1, "nap", b"[0.2]"))
    assert await second.read() == [HOLD_ON]
    second.send(alone(1, "add_ints", b"[1, 1]"), encode_frame(Kind.HOLD, 0, 1))
    assert await first.read() == [starts(1)]


def test_another_call_alone_while_one_holds_the_worker_waits_its_turn_and_runs_next(run_links):  # noqa: F811  # (the fixture imported)
    """Hostile testing, round 132: given back (RETURN_ASIDE), another front-end's call sent ALONE
    went again at the release and lost the race with the holder's next call there each time
    (its calls waited their deadline). It waits here instead, and runs alone next, before a
    call the holder sends after it; each call's front-end is told when it starts."""
    async def test(proto: WorkerProtocol, bs: list[Broker]) -> None:
        first, second = bs
        await _second_waits_its_turn(first, second)
        await second.nothing_more(0.05)  # (not given back: it waits its turn)
        assert result((await first.read())[0]) == 0.2
        first.send(alone(2, "add_ints", b"[2, 2]"))  # (the holder's next: after the second's)
        assert await second.read() == [HOLD_OFF]
        assert await first.read() == [HOLD_ON]  # the second's turn: the first is held
        first.send(encode_frame(Kind.HOLD, 0, 1))
        assert await second.read() == [starts(1)]
        assert result((await second.read())[0]) == 2
        assert await first.read() == [HOLD_OFF]
        assert await second.read() == [HOLD_ON]  # then the first's
        second.send(encode_frame(Kind.HOLD, 0, 1))
        assert await first.read() == [starts(2)]
        assert result((await first.read())[0]) == 4
        assert await second.read() == [HOLD_OFF]

    run_links(test)


def test_a_call_alone_waiting_its_turn_is_cancelled_unstarted(run_links):  # noqa: F811  # (the fixture imported)
    async def test(proto: WorkerProtocol, bs: list[Broker]) -> None:
        first, second = bs
        await _second_waits_its_turn(first, second)
        second.send(encode_frame(Kind.CANCEL, 1))
        assert await second.read() == [(Kind.ERROR, 1, wire.NOT_RUN, CANCEL_ACK)]  # never run
        assert result((await first.read())[0]) == 0.2
        assert await second.read() == [HOLD_OFF]
        await first.nothing_more(0.05)  # (no turn for it: nothing held again)

    run_links(test)


def test_a_front_end_gone_is_not_waited_for_and_the_call_s_own_gone_releases(run_links):  # noqa: F811  # (the fixture imported)
    async def test(proto: WorkerProtocol, bs: list[Broker]) -> None:
        first, second, third = bs
        first.send(alone(1, "add_ints", b"[1, 1]"))
        assert await second.read() == [HOLD_ON] and await third.read() == [HOLD_ON]
        third.send(encode_frame(Kind.HOLD, 0, 1))
        second.writer.close()  # (that front-end exits: nothing more comes from it)
        assert await first.read() == [starts(1)]
        assert result((await first.read())[0]) == 2
        assert await third.read() == [HOLD_OFF]
        third.send(alone(2, "nap", b"[30]"))  # (from a link now: the first connection is held)
        assert await first.read() == [HOLD_ON]
        first.send(encode_frame(Kind.HOLD, 0, 1))
        assert await third.read() == [starts(2)]
        third.writer.close()  # its front-end exits: its call is cancelled, the others released
        assert await first.read() == [HOLD_OFF]
        first.send(call(3, "add_ints", b"[2, 2]"))
        assert result((await first.read())[0]) == 4

    run_links(test, 3)


def test_a_real_worker_process_lets_the_other_front_end_s_call_end_before_the_crash(tmp_path: Path):
    w = _TwoFrontEnds(tmp_path, "tests.apps.crashy:registry")
    try:
        w.conns[1].sendall(encode_call(Kind.CALL, 1, w.index["nap"], b"[0.3]", math.inf, 1))
        time.sleep(0.05)
        w.conns[0].sendall(encode_call(Kind.CALL, 1, w.index["crash_async"], b"", math.inf, 2 | wire.ALONE))
        assert w.read(1) == [HOLD_ON]
        w.conns[1].sendall(encode_frame(Kind.HOLD, 0, 1))
        [f] = w.read(1)  # the other front-end's call ended first, answered; then the crash
        assert f[:2] == (Kind.RESULT, 1) and f[3] == b"0.3"
        assert w.proc.wait(60) == 1
    finally:
        w.close()


def _until_closed(w: _TwoFrontEnds, fe: int) -> list[tuple[int, int, int, bytes]]:
    """Every frame front-end `fe` reads until the worker's end closes (60 s at most), but
    BLOCKED ones (a sync handler blocks it)."""
    conn, frames = w.conns[fe], []
    conn.settimeout(60)
    while data := conn.recv(65536):
        frames += [(f[0], f[1], f[2], bytes(f[3])) for f in w.decoders[fe].feed(data) if f[0] != Kind.BLOCKED]
    return frames


def test_a_real_worker_says_a_call_alone_starts_before_it_can_crash_and_never_for_one_that_did_not(tmp_path: Path):
    """Hostile testing, round 132: a call sent ALONE that waited in its worker for another front-end's
    call, which crashed it, was answered -32002 though it never ran. Its front-end reads STARTS
    before the call starts, the frame in the socket before the handler runs (its crash at once
    loses it not), and none for a call that never started: that one is sent again."""
    w = _TwoFrontEnds(tmp_path, "tests.apps.crashy:registry")
    try:  # the other front-end's call crashes the worker while the call sent ALONE waits for it
        w.conns[1].sendall(encode_call(Kind.CALL, 1, w.index["nap_then_crash"], b"[0.3]", math.inf, 1))
        time.sleep(0.05)
        w.conns[0].sendall(encode_call(Kind.CALL, 1, w.index["nap"], b"[0]", math.inf, 2 | wire.ALONE))
        assert w.read(1) == [HOLD_ON]
        w.conns[1].sendall(encode_frame(Kind.HOLD, 0, 1))
        assert _until_closed(w, 0) == [] and w.proc.wait(60) == 1
    finally:
        w.close()
    for attempt, method in enumerate(["crash_async", "crash"]):  # the call sent ALONE crashes it at once
        (tmp_path / str(attempt)).mkdir()
        w = _TwoFrontEnds(tmp_path / str(attempt), "tests.apps.crashy:registry")
        try:
            w.conns[0].sendall(encode_call(Kind.CALL, 1, w.index[method], b"", math.inf, 2 | wire.ALONE))
            assert w.read(1) == [HOLD_ON]
            w.conns[1].sendall(encode_frame(Kind.HOLD, 0, 1))
            assert _until_closed(w, 0) == [starts(1)] and w.proc.wait(60) == 1
        finally:
            w.close()


@pytest.mark.parametrize("loop", sorted(LOOPS))
def test_a_link_made_after_a_call_alone_came_is_held_too(loop: str):
    """Hostile testing, round 132: a fresh worker read the first front-end's call sent ALONE
    before its connection to the other front-end was made: the HOLD written to that link went
    nowhere, and the call waited for its answer to its deadline (10 s, the other front-end's
    calls given back meanwhile). The link is told once made, after its HELLO."""
    async def main() -> None:
        loop_ = asyncio.get_running_loop()
        proto = WorkerProtocol(registry, slot=3, concurrency=10)
        link = Link(proto, 1, wire.MAX_FRAME_BYTES)
        proto.add_link(link)  # (as the worker's start does: known, not connected yet)
        ends = [socket.socketpair() for _ in range(2)]
        transports = [(await loop_.create_unix_connection(lambda: proto, sock=ends[0][0]))[0]]
        first = Broker(*await asyncio.open_unix_connection(sock=ends[0][1]))
        assert (await first.read())[0][0] == Kind.HELLO
        first.send(alone(1, "add_ints", b"[1, 2]"))
        await first.nothing_more(0.05)  # (it waits for the link: its front-end may send calls)
        transports.append((await loop_.create_unix_connection(lambda: link, sock=ends[1][0]))[0])
        second = Broker(*await asyncio.open_unix_connection(sock=ends[1][1]))
        hello, hold = await second.read(2)
        assert hello[0] == Kind.HELLO and hold == HOLD_ON
        second.send(encode_frame(Kind.HOLD, 0, 1))
        assert await first.read() == [starts(1)]
        assert result((await first.read())[0]) == 3
        assert await second.read() == [HOLD_OFF]
        for transport in transports:
            transport.close()
        for b in (first, second):
            b.writer.close()
        await asyncio.wait_for(proto.done, 5)

    with asyncio.Runner(loop_factory=LOOPS[loop]) as runner:
        runner.run(main())


def test_a_front_end_that_does_not_answer_a_hold_is_waited_for_a_while_then_not_until_it_answers(
        run_links, monkeypatch):  # noqa: F811  # (the fixture imported)
    """Hostile testing, round 135: a stopped front-end never answers HOLD, and every call run
    alone waited for it to its deadline. It is waited for `HOLD_WAIT_S`; then, until it has
    answered every HOLD it was sent, not at all (here however long the wait): what it sends
    meanwhile is given back. Once it answered them all, it is waited for again."""
    async def test(proto: WorkerProtocol, bs: list[Broker]) -> None:
        first, second = bs
        monkeypatch.setattr(alone_runs, "HOLD_WAIT_S", 0.3, raising=False)
        first.send(alone(1, "add_ints", b"[1, 1]"))  # (no deadline)
        assert await second.read() == [HOLD_ON]  # never answered: a stopped front-end
        assert await first.read(timeout=10) == [starts(1)]
        assert result((await first.read())[0]) == 2
        assert await second.read() == [HOLD_OFF]
        monkeypatch.setattr(alone_runs, "HOLD_WAIT_S", 600.0, raising=False)
        first.send(alone(2, "nap", b"[0.3]"))
        assert await second.read() == [HOLD_ON]
        assert await first.read(timeout=10) == [starts(2)]  # (it owes the first answer: not waited for)
        second.send(call(7, "add_ints", b"[2, 2]"))  # sent before it read the hold: given back
        assert await second.read() == [(Kind.RETURN, 7, RETURN_ASIDE, b"[2, 2]")]
        assert result((await first.read())[0]) == 0.3
        assert await second.read() == [HOLD_OFF]
        second.send(encode_frame(Kind.HOLD, 0, 1), encode_frame(Kind.HOLD, 0, 1))  # resumed: both answered
        await asyncio.sleep(0.1)
        first.send(alone(3, "add_ints", b"[3, 3]"))
        assert await second.read() == [HOLD_ON]
        await first.nothing_more(0.3)  # waited for again
        second.send(encode_frame(Kind.HOLD, 0, 1))
        assert await first.read() == [starts(3)]
        assert result((await first.read())[0]) == 6
        assert await second.read() == [HOLD_OFF]

    run_links(test)
