"""A worker blocked in one front-end's sync call, as the others see it (`serve --frontends N`;
wire.BLOCKED, broker/worker/held.py; `Membership.worker_blocked`).

New user, round 114: each front-end routed by its own calls alone, so a fast call of one went to
a worker blocked in another's sync call and waited behind it while the other worker was idle; and
a worker hung in a front-end's own sync call was killed only once the longest deadline any call
may have was past, not its own. Real brokers on loopback with two front-ends, real workers."""

from __future__ import annotations

import json
import re
import socket
import time

import pytest
from conftest import free_port, wait_for
from test_frontends import answer, connection_to, request, tcp_sockets, workers_of
from test_frontends_alone import _pids
from test_frontends_alone import _two_front_ends as two_front_ends


def _two_front_ends(broker_factory, workers: int, *flags: str):  # type: ignore[no-untyped-def]
    return two_front_ends(broker_factory, *flags, workers=workers, app="tests.apps.stuck:registry")


def test_another_front_end_routes_nothing_to_a_worker_blocked_in_a_sync_call(broker_factory):
    b, peer = _two_front_ends(broker_factory, 2)
    blocker, other = connection_to(peer, b), connection_to(b.pid, b)
    with blocker, other:
        assert len(_pids(other, 20)) == 2  # (both workers serve the first front-end)
        blocker.sendall(request("spin", [8], "blocks"))
        time.sleep(0.5)  # (the worker says so within a few ms of the call's start)
        seen = _pids(other, 40)
        blocker.setblocking(False)
        try:  # every call answered while the spin still runs: none waited behind it
            assert blocker.recv(1) == b"", "the spin ended"
        except BlockingIOError:
            pass
        blocker.setblocking(True)
        assert len(seen) == 1, seen
        assert "result" in answer(blocker)
        assert len(_pids(other, 20)) == 2  # (back in the rotation once it returned)


def test_a_worker_hung_in_a_front_end_s_call_is_killed_at_that_call_s_deadline(broker_factory):
    """Not once the longest deadline a call may have (60 s here) is past."""
    b, peer = _two_front_ends(broker_factory, 1, "--timeout", "1", "--cancel-grace", "0.5",
                              "--method-timeout", "linger=60")
    [first] = workers_of(b.pid)
    s = connection_to(peer, b)
    with s:
        s.sendall(request("spin", [120], "stuck"))
        assert answer(s)["error"]["code"] == -32001  # type: ignore[index]
    said = re.compile(rf"\(pid {first}\) has not answered call \d+ \(spin\) [\d.]+ s after its deadline: killing it"
                      r" as hung \(blocked in this front-end's call, its deadline and cancel_grace past\)")
    wait_for(lambda: said.search(b.read_log(0.05)) is not None, timeout=20)
    wait_for(lambda: bool(workers_of(b.pid)) and workers_of(b.pid) != [first], timeout=20)


def test_a_front_end_s_calls_wait_for_its_only_worker_blocked_in_another_s_call(broker_factory):
    """Out of the rotation is not down: they are not answered "no worker available" (-32003)."""
    b, peer = _two_front_ends(broker_factory, 1)
    blocker, other = connection_to(peer, b), connection_to(b.pid, b)
    with blocker, other:
        _pids(other, 5)
        blocker.sendall(request("spin", [1.5], "blocks"))
        time.sleep(0.5)
        assert len(_pids(other, 3)) == 1
        assert "result" in answer(blocker)


def _stream_to(peer: int, port: int) -> socket.socket:
    """An NDJSON connection (`--stream-port`) the front-end process `peer` took."""
    for i in range(100):
        before = tcp_sockets(peer)
        s = socket.create_connection(("127.0.0.1", port), timeout=30)
        s.sendall(b'{"jsonrpc": "2.0", "method": "rpc.discover", "id": %d}\n' % i)
        assert b'"result"' in s.makefile("rb").readline()
        if tcp_sockets(peer) - before:
            return s
        s.close()
    raise AssertionError("no stream connection landed on that front-end in 100")


def test_a_connection_s_share_comes_back_when_the_worker_is_free_again(broker_factory):
    """Hostile testing, round 133: a worker blocked in another front-end's call is out of the
    rotation, and a connection's share of the places shrank with it; back in, the share grew but
    the connection held past the smaller one stayed held until its own long call ended (7 s)."""
    port = free_port()
    b, peer = _two_front_ends(broker_factory, 1, "--stream-port", str(port))
    blocker, stream = connection_to(peer, b), _stream_to(b.pid, port)
    with blocker, stream:
        lines = stream.makefile("rb")
        stream.sendall(b'{"jsonrpc": "2.0", "method": "nap", "params": [6], "id": "long"}\n')
        time.sleep(0.5)
        blocker.sendall(request("spin", [0.4], "blocks"))  # (its worker benched here, then back)
        time.sleep(0.1)
        stream.sendall(b'{"jsonrpc": "2.0", "method": "pid", "id": "fast"}\n')  # (while it is out)
        assert "result" in answer(blocker)
        first = json.loads(lines.readline())
        assert first["id"] == "fast" and "result" in first, first  # (not after the nap's answer)
        assert json.loads(lines.readline())["id"] == "long"


@pytest.mark.serial  # (its ~5 s GIL call, sized by this process's speed, ran past 6 s in a worker beside 3 other tests)
def test_a_silent_worker_s_legitimate_call_is_not_killed_beside_another_front_end_s_async_call(broker_factory):
    """Hostile testing, round 133: a call holding the GIL in C says nothing (its worker's thread
    cannot run); another front-end's async call, started before it and past its deadline, had the
    worker killed as hung once that async call's *arrival* and the longest deadline were past,
    though the GIL call was well within its own. Its deadline bounds the silent call's start now."""
    b, peer = _two_front_ends(broker_factory, 1, "--timeout", "1", "--cancel-grace", "0.3",
                              "--method-timeout", "nap=3", "--method-timeout", "gil=6")
    waiter, holder = connection_to(b.pid, b), connection_to(peer, b)
    with waiter, holder:
        holder.sendall(request("gil", [1000], "learnt"))  # (a method known fast: not told ahead)
        assert "result" in answer(holder)
        began = time.monotonic()
        sum(range(2 * 10**7))  # (here: a call of it 1 ms or more long would have it told ahead there)
        n = int(2 * 10**7 * 5.0 / max(time.monotonic() - began, 1e-3))  # (about 5 s of it)
        waiter.sendall(request("nap", [30], "async"))  # (its deadline at 3 s; the loop free until then)
        time.sleep(2.5)
        holder.sendall(request("gil", [n], "holds"))  # (silent, from 2.5 s; its deadline at 8.5 s)
        assert answer(waiter)["error"]["code"] == -32001  # type: ignore[index]
        got = answer(holder)
    assert "result" in got, (got, b.read_log(0.05)[-2000:])  # (on main: killed at 6.3 s, -32002)
    assert "killing it as hung" not in b.read_log(0.05)


def test_calls_behind_another_front_end_s_hung_call_are_not_blamed_for_its_kill(broker_factory):
    """Hostile testing, round 133: calls one front-end sent before the worker said it was blocked in
    another front-end's call died with it when that call was killed as hung (-32002: they cannot be
    known unstarted), and their method took the strike, run alone on every front-end since."""
    b, peer = _two_front_ends(broker_factory, 1, "--timeout", "1", "--cancel-grace", "0.3", "--method-timeout", "pid=10")
    waiter, holder = connection_to(b.pid, b), connection_to(peer, b)
    with waiter, holder:
        holder.sendall(request("spin", [0], "learnt"))  # (known fast: not told ahead)
        assert "result" in answer(holder)
        holder.sendall(request("spin", [60], "hangs"))
        time.sleep(0.002)  # (its worker says it is blocked 5 ms in: these reach it before)
        batch = json.dumps([{"jsonrpc": "2.0", "method": "pid", "id": i} for i in range(5)]).encode()
        waiter.sendall(b"POST / HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                       b"Content-Length: %d\r\n\r\n%s" % (len(batch), batch))
        outcomes = {r.get("error", {}).get("code", "ok") for r in answer(waiter)}  # type: ignore[attr-defined]
        assert answer(holder)["error"]["code"] == -32001  # type: ignore[index]
    assert outcomes <= {"ok", -32002}, outcomes
    wait_for(lambda: "killing it as hung" in b.read_log(0.05), timeout=20)
    wait_for(lambda: bool(workers_of(b.pid)), timeout=20)
    log = b.read_log(0.5)
    assert not re.search(rf"broker pid {b.pid} WARNING worker 0 \(pid \d+\) died holding.*pid: after", log), log[-3000:]


def test_a_reload_retires_on_every_front_end_a_worker_blocked_in_a_peer_s_call(broker_factory):
    """New user, round 115: the first front-end had the worker out of its rotation (blocked in the
    peer's sync call) when a reload retired it, and told the peer nothing: the peer routed to the
    old worker until it was killed, 42 s later, its calls with it."""
    import signal

    b, peer = _two_front_ends(broker_factory, 2)
    blocker, other = connection_to(peer, b), connection_to(peer, b)
    with blocker, other:
        old = set(workers_of(b.pid))
        blocker.sendall(request("spin", [2], "blocks"))
        time.sleep(0.5)
        b.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: len(set(workers_of(b.pid)) - old) == 2, timeout=30)
        assert "result" in answer(blocker)  # (its old worker answers, then leaves)
        wait_for(lambda: not set(workers_of(b.pid)) & old, timeout=30)
        assert not set(_pids(other, 20)) & old
