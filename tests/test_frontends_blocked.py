"""A worker blocked in one front-end's sync call, as the others see it (`serve --frontends N`;
wire.BLOCKED, broker/worker/held.py; `Membership.worker_blocked`).

New user, round 114: each front-end routed by its own calls alone, so a fast call of one went to
a worker blocked in another's sync call and waited behind it while the other worker was idle; and
a worker hung in a front-end's own sync call was killed only once the longest deadline any call
may have was past, not its own. Real brokers on loopback with two front-ends, real workers."""

from __future__ import annotations

import re
import time

from conftest import wait_for
from test_frontends import answer, connection_to, peers_of, request, workers_of
from test_frontends_alone import _pids


def _two_front_ends(broker_factory, workers: int, *flags: str):  # type: ignore[no-untyped-def]
    b = broker_factory("--workers", str(workers), "--frontends", "2", "--app", "tests.apps.stuck:registry", *flags)
    wait_for(lambda: "front-end 1 (pid" in b.read_log(0.05), timeout=30)
    [peer] = peers_of(b.pid)
    wait_for(lambda: f"front-end 1 (pid {peer}) serving" in b.read_log(0.05), timeout=30)
    return b, peer


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
