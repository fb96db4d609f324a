"""A crash's isolation shared by every front-end (`serve --frontends N`; broker/worker/alone.py).

Hostile testing, round 130: with several front-ends, a call the front-end that saw a crash ran
*alone* was alone only in that front-end's view: the other front-ends' calls shared its worker,
and died with it (-32002). The worker holds its other connections now (wire.HOLD) while such a
call runs, giving back their calls unstarted (wire.RETURN, `RETURN_ASIDE`). Real brokers on
loopback with two front-ends, real workers, real connections.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time

import pytest
from conftest import sample, scrape_metrics, wait_for
from test_frontends import answer, connection_to, peers_of, request, workers_of


def _loop(sock, method: str, params: object, count: int, seconds: float, outcomes: list[object]) -> None:  # type: ignore[no-untyped-def]
    """Call `method` on `sock` one call at a time, `count` calls or `seconds` at most; each
    outcome "ok" or its error code."""
    deadline = time.monotonic() + seconds
    with sock:
        for i in range(count):
            if time.monotonic() >= deadline:
                return
            sock.sendall(request(method, params, i))
            got = answer(sock)
            outcomes.append("ok" if "result" in got else got["error"]["code"])  # type: ignore[index]


def _crashes_beside(crasher, method: str, params: object, count: int, innocents: list, nap: float) -> None:  # type: ignore[no-untyped-def]
    """`method` called on `crasher` (`count` calls, 4 to 6 s) while each of `innocents` calls
    `nap(nap)`: every crash answered -32002 (or -32001), every innocent call answered."""
    crashes: list[object] = []
    innocent: list[object] = []
    threads = [threading.Thread(target=_loop, args=(crasher, method, params, count, 6.0, crashes))]
    threads += [threading.Thread(target=_loop, args=(s, "nap", [nap], 400, 4.0, innocent)) for s in innocents]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(crashes) >= min(count, 3) and set(crashes) <= {-32002, -32001}, crashes
    assert innocent and set(innocent) == {"ok"}, (innocent.count("ok"), [o for o in innocent if o != "ok"])


def _two_front_ends(broker_factory, *flags: str, workers: int = 2,  # type: ignore[no-untyped-def]
                    app: str = "tests.apps.crashy:registry"):
    """A broker of `app` with 2 front-ends and `workers` workers, once both serve; it and the peer's pid."""
    b = broker_factory("--workers", str(workers), "--frontends", "2", "--app", app, *flags)
    wait_for(lambda: "front-end 1 (pid" in b.read_log(0.05), timeout=30)
    [peer] = peers_of(b.pid)
    wait_for(lambda: f"front-end 1 (pid {peer}) serving" in b.read_log(0.05), timeout=30)
    return b, peer


def test_another_front_end_s_calls_never_die_beside_a_call_one_front_end_runs_alone(broker_factory):
    b, peer = _two_front_ends(broker_factory)
    crasher = connection_to(peer, b)
    # Its first crash, on the peer: `crash_async` takes a strike there (its calls run alone from now)
    crasher.sendall(request("crash_async", [], "first"))
    assert answer(crasher)["error"]["code"] == -32002  # type: ignore[index]
    wait_for(lambda: sample(scrape_metrics(b), "rpc_broker_workers", state="ready") == 2, timeout=20)
    innocents = [connection_to(b.pid, b) for _ in range(3)]  # (the first front-end's: it saw no crash)
    _crashes_beside(crasher, "crash_async", [], 40, innocents, 0.01)
    log = b.read_log(0.05)
    assert "which it does not hold" not in log and "Traceback" not in log, log[-3000:]


def _batches(sock, size: int, count: int, seconds: float, outcomes: list[object]) -> None:  # type: ignore[no-untyped-def]
    """Batches of `size` `nap` calls on `sock`, `count` or `seconds` at most; each call's outcome."""
    deadline = time.monotonic() + seconds
    with sock:
        for n in range(count):
            if time.monotonic() >= deadline:
                return
            body = json.dumps([{"jsonrpc": "2.0", "method": "nap", "params": [0.01], "id": i} for i in range(size)])
            sock.sendall(b"POST / HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(body), body.encode()))
            got = answer(sock)
            assert isinstance(got, list) and sorted(a["id"] for a in got) == list(range(size)), (n, got)
            outcomes += ["ok" if "result" in a else a["error"]["code"] for a in got]


def test_another_front_end_s_batches_are_given_back_whole_or_in_part_never_lost(broker_factory):
    b, peer = _two_front_ends(broker_factory)
    crasher = connection_to(peer, b)
    crasher.sendall(request("crash_async", [], "first"))
    assert answer(crasher)["error"]["code"] == -32002  # type: ignore[index]
    wait_for(lambda: sample(scrape_metrics(b), "rpc_broker_workers", state="ready") == 2, timeout=20)
    innocents = [connection_to(b.pid, b) for _ in range(2)]
    crashes: list[object] = []
    innocent: list[object] = []
    threads = [threading.Thread(target=_loop, args=(crasher, "crash_async", [], 30, 4.0, crashes))]
    threads += [threading.Thread(target=_batches, args=(s, 40, 200, 4.0, innocent)) for s in innocents]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(crashes) >= 3 and set(crashes) <= {-32002, -32001}, crashes
    assert innocent and set(innocent) == {"ok"}, (innocent.count("ok"), [o for o in innocent if o != "ok"][:5])


def _pids(sock, count: int) -> set[int]:  # type: ignore[no-untyped-def]
    """The workers' pids `count` calls of `pid` on `sock` reached."""
    seen = set()
    for i in range(count):
        sock.sendall(request("pid", [], i))
        got = answer(sock)
        assert "result" in got, got
        seen.add(got["result"])
    return seen  # type: ignore[return-value]


def test_a_worker_stopped_or_hung_while_it_holds_is_routed_to_again_once_replaced(broker_factory):
    """The call run alone stops its worker (SIGSTOP) while it holds the other front-end: that
    front-end's calls go to the other worker meanwhile, none lost; the worker is killed as hung
    (past the call's deadline and cancel_grace), and its replacement takes both front-ends' calls."""
    b, peer = _two_front_ends(broker_factory, "--timeout", "1", "--cancel-grace", "0.5")
    stopper = connection_to(peer, b)
    innocent_sock = connection_to(b.pid, b)
    assert len(_pids(innocent_sock, 20)) == 2
    stopper.sendall(request("stop_self", [], "first"))  # (beside nothing: caught, its calls run alone)
    assert answer(stopper)["error"]["code"] == -32001  # type: ignore[index]
    wait_for(lambda: "their methods' calls now run alone" in b.read_log(0.05), timeout=20)
    wait_for(lambda: sample(scrape_metrics(b), "rpc_broker_workers", state="ready") == 2, timeout=20)
    innocent: list[object] = []
    thread = threading.Thread(target=_loop, args=(innocent_sock, "nap", [0.01], 400, 4.0, innocent))
    before = set(int(p) for p in workers_of(b.pid))
    thread.start()
    with stopper:
        stopper.sendall(request("stop_self", [], "alone"))  # run alone, holding the first front-end
        assert answer(stopper)["error"]["code"] == -32001  # type: ignore[index]
    thread.join(60)
    assert innocent and set(innocent) == {"ok"}, (innocent.count("ok"), [o for o in innocent if o != "ok"][:5])
    wait_for(lambda: len(set(workers_of(b.pid)) - before) == 1 and len(workers_of(b.pid)) == 2, timeout=30)
    wait_for(lambda: sample(scrape_metrics(b), "rpc_broker_workers", state="ready") == 2, timeout=20)
    again = connection_to(b.pid, b)  # (the first front-end, held by the stopped one: routes to its replacement)
    with again:
        assert _pids(again, 40) == set(workers_of(b.pid))


def test_a_crash_one_front_end_saw_makes_every_front_end_run_that_method_alone(broker_factory):
    """Hostile testing, round 132: each front-end kept its own strikes, so a front-end that had
    not seen a method crash sent its first crash of it as any call, and the other front-end's
    innocent calls beside it died (-32002), though that one already ran the method alone. A
    front-end that sees a worker die tells the others (peerwire.Struck): they strike the same
    methods, and send their calls of them ALONE."""
    b, peer = _two_front_ends(broker_factory)
    with connection_to(b.pid, b) as first:  # the first front-end sees `crash_if` crash once
        first.sendall(request("crash_if", [True], "first"))
        assert answer(first)["error"]["code"] == -32002  # type: ignore[index]
    wait_for(lambda: "another front-end's worker died holding calls of crash_if" in b.read_log(0.05), timeout=10)
    wait_for(lambda: sample(scrape_metrics(b), "rpc_broker_workers", state="ready") == 2, timeout=20)
    innocents = [connection_to(b.pid, b) for _ in range(3)]
    crasher = connection_to(peer, b)  # (the peer saw no crash of it itself)
    _crashes_beside(crasher, "crash_if", [True], 3, innocents, 0.05)


def test_a_peer_s_call_of_a_method_struck_runs_alone_on_its_only_worker(broker_factory):
    """Hostile testing, round 132: a front-end past the first took every slot for one on its
    way back (`Members._restarting` always True), so its one worker was always "the last open
    to other calls" and never ran its calls of a method struck alone: they waited to their
    deadline (-32001, "started": false, the worker idle), or until the method's time alone was
    over, and went then as any call. With the deadline (3 s) under the time alone (8 s, two
    strikes), each of the peer's calls of the method struck is answered."""
    b, peer = _two_front_ends(broker_factory, "--timeout", "3", workers=1)
    with connection_to(b.pid, b) as first:  # caught twice on the first front-end: it waits for a worker of its own
        for i in range(2):
            first.sendall(request("crash_if", [True], i))
            assert answer(first)["error"]["code"] == -32002  # type: ignore[index]
            wait_for(lambda: sample(scrape_metrics(b), "rpc_broker_workers", state="ready") == 1, timeout=20)
    wait_for(lambda: "another front-end's worker died holding calls of crash_if: their calls run alone here too: "
                     "crash_if: after 2 answers" in b.read_log(0.05), timeout=10)
    outcomes: list[object] = []
    _loop(connection_to(peer, b), "crash_if", [False], 3, 20.0, outcomes)
    assert outcomes == ["ok"] * 3, outcomes


def _alternate(sock, count: int, seconds: float, goods: list[object], crashes: list[object]) -> None:  # type: ignore[no-untyped-def]
    """crash_if(true) and crash_if(false) in turn on `sock`, `count` calls or `seconds` at most."""
    deadline = time.monotonic() + seconds
    with sock:
        for i in range(count):
            if time.monotonic() >= deadline:
                return
            sock.sendall(request("crash_if", [i % 2 == 0], i))
            got = answer(sock)
            (crashes if i % 2 == 0 else goods).append("ok" if "result" in got else got["error"]["code"])  # type: ignore[index]


def test_two_front_ends_crashing_one_method_in_turn_lose_none_of_its_good_calls(broker_factory):
    """Hostile testing, round 132 (t5): a client on each front-end calls crash_if(true) and
    crash_if(false) in turn, one worker: every crash runs alone, so every good call is answered
    (none -32002 beside another front-end's crash, none -32001 unstarted, waiting for a worker
    that is idle between the crashes), and each client's calls get turns."""
    b, peer = _two_front_ends(broker_factory, "--timeout", "3", workers=1)
    results: dict[int, tuple[list[object], list[object]]] = {pid: ([], []) for pid in (b.pid, peer)}
    threads = [threading.Thread(target=_alternate, args=(connection_to(pid, b), 40, 8.0, *results[pid]))
               for pid in (b.pid, peer)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for goods, crashes in results.values():
        assert len(goods) >= 2 and set(goods) == {"ok"}, results
        assert set(crashes) <= {-32002, -32001}, results
    # Every worker that died died of a crash answered -32002: none ran twice (a call that never
    # started goes again; one that started, never)
    wait_for(lambda: sample(scrape_metrics(b), "rpc_broker_workers", state="ready") == 1, timeout=20)
    died = sum(crashes.count(-32002) for _goods, crashes in results.values())
    assert 0 < b.read_log(0.05).count(") exited with 1") <= died, results


def test_a_call_sent_alone_that_waited_behind_another_front_end_s_crash_is_sent_again(broker_factory):
    """Hostile testing, round 132: a call sent ALONE waits in its worker for the other front-ends'
    calls running there to end; one of them crashed the worker, and the call, which never
    started, was answered -32002 (and its method struck once more). The worker tells a call's
    front-end when it starts (wire.STARTS): one that never did goes again, to the next worker."""
    b, peer = _two_front_ends(broker_factory, workers=1)
    with connection_to(b.pid, b) as first:  # `nap` caught: its calls run alone on every front-end
        first.sendall(request("nap", [30], "caught"))
        time.sleep(0.5)  # (the nap runs)
        os.kill(workers_of(b.pid)[0], signal.SIGKILL)
        assert answer(first)["error"]["code"] == -32002  # type: ignore[index]
    wait_for(lambda: "another front-end's worker died holding calls of nap" in b.read_log(0.05), timeout=10)
    wait_for(lambda: sample(scrape_metrics(b), "rpc_broker_workers", state="ready") == 1, timeout=20)
    crasher, innocent = connection_to(b.pid, b), connection_to(peer, b)
    with crasher, innocent:
        crasher.sendall(request("nap_then_crash", [2.0], "crash"))  # (not struck: it goes as any call)
        time.sleep(0.5)  # (it sleeps in the worker)
        innocent.sendall(request("nap", [0], "innocent"))  # sent ALONE: it waits for the crasher's call there
        assert answer(crasher)["error"]["code"] == -32002  # type: ignore[index]
        got = answer(innocent)
    assert got.get("result") == 0, got
    deaths = re.findall(r"\(pid \d+\) died holding .*", b.read_log(0.05))  # (the kill's, the crash's: no strike for `nap`)
    assert len(deaths) == 2 and "nap_then_crash: after 1 answer" in deaths[1], deaths


def _struck_on_both(b, method: str = "crash_if", params: object = (True,), workers: int = 1) -> None:  # type: ignore[no-untyped-def]
    """`method` crashes once on the first front-end: its calls run alone on both from now."""
    with connection_to(b.pid, b) as first:
        first.sendall(request(method, list(params), "first"))  # type: ignore[call-overload]
        assert answer(first)["error"]["code"] == -32002  # type: ignore[index]
    wait_for(lambda: f"another front-end's worker died holding calls of {method}" in b.read_log(0.05), timeout=10)
    wait_for(lambda: sample(scrape_metrics(b), "rpc_broker_workers", state="ready") >= workers, timeout=20)


def test_a_stopped_front_end_holds_a_call_run_alone_on_another_a_second_at_most(broker_factory):
    """Hostile testing, round 135: a SIGSTOPped front-end never answers the worker's HOLD, and
    every call another front-end ran alone there waited for it to its deadline, until the
    stopped one was killed as silent (10 s). It is waited for `alone.HOLD_WAIT_S` (1 s), then
    not, until it answers: each call here (deadline 5 s) is answered. Resumed, it is served
    and holds as before."""
    b, peer = _two_front_ends(broker_factory, "--method-timeout", "crash_if=5", workers=1)
    _struck_on_both(b)
    held = connection_to(peer, b)
    with held, connection_to(b.pid, b) as first:
        os.kill(peer, signal.SIGSTOP)
        try:
            outcomes: list[object] = []
            _loop(first, "crash_if", [False], 3, 30.0, outcomes)
        finally:
            os.kill(peer, signal.SIGCONT)
        assert outcomes == ["ok"] * 3, outcomes
        assert _pids(held, 3) == set(workers_of(b.pid))  # (the peer, resumed, answered the holds it owed)
        outcomes = []
        _loop(connection_to(b.pid, b), "crash_if", [False], 2, 30.0, outcomes)
        assert outcomes == ["ok"] * 2, outcomes


def test_a_call_alone_timed_out_waiting_its_turn_says_it_never_started(broker_factory):
    """Hostile testing, round 135: a call sent ALONE that timed out waiting in its worker for
    another front-end's call to end (no STARTS) was answered -32001 without `"started": false`:
    the front-end reads what its worker wrote first, and, no STARTS there, says it never ran."""
    b, peer = _two_front_ends(broker_factory, "--method-timeout", "crash_if=0.5", workers=1)
    _struck_on_both(b)
    with connection_to(b.pid, b) as first, connection_to(peer, b) as second:
        first.sendall(request("nap", [2.0], "long"))  # (not struck: it runs as any call, 2 s)
        time.sleep(0.3)
        second.sendall(request("crash_if", [False], "alone"))  # ALONE: waits there for the nap to end
        got = answer(second)
        assert got["error"] == {"code": -32001, "message": "Call timed out",  # type: ignore[index]
                                "data": {"timeout_seconds": 0.5, "started": False}}, got
        assert answer(first).get("result") == 2.0


def _naps_answered(socks: list) -> list[object]:  # type: ignore[type-arg]
    """The answer to the `nap(0)` sent on each of `socks` (closed after): "ok", or its error code."""
    outcomes: list[object] = []
    for sock in socks:
        with sock:
            got = answer(sock)
            outcomes.append("ok" if got.get("result") == 0 else got["error"]["code"])  # type: ignore[index]
    return outcomes


def test_a_front_end_resumed_reads_its_workers_before_what_its_clients_sent_meanwhile(broker_factory):
    """Hostile testing, round 136: a stopped front-end is waited for a second (`HOLD_WAIT_S`), then
    a call runs alone without its answer. Resumed while that call (a sync one) ran, the front-end
    routed what its clients had sent meanwhile before its loop read the worker's HOLD: into the
    worker busy in the call, whose loop read nothing more, and every one died with it when it
    crashed (-32002), none run. It reads its workers first after such a gap (`Membership.woke`):
    its calls go to the other worker, each answered."""
    b, peer = _two_front_ends(broker_factory, workers=2)
    _struck_on_both(b, "slow_crash", (0,), workers=2)
    waiting = [connection_to(peer, b) for _ in range(8)]
    first = connection_to(b.pid, b)
    os.kill(peer, signal.SIGSTOP)
    try:
        for i, sock in enumerate(waiting):
            sock.sendall(request("nap", [0], i))  # (read by the stopped front-end once resumed)
        first.sendall(request("slow_crash", [2.0], "crash"))  # alone: a second's wait for the stopped one, then 2 s in it
        time.sleep(1.6)
    finally:
        os.kill(peer, signal.SIGCONT)
    outcomes = _naps_answered(waiting)
    assert outcomes == ["ok"] * 8, outcomes
    with first:
        assert answer(first)["error"]["code"] == -32002  # type: ignore[index]


@pytest.mark.parametrize("after", [("sleep_then", [1.5, True], 2.3), ("nap_then_crash", [0.5], 2.0)],
                         ids=["held-again", "died-meanwhile"])
def test_a_front_end_resumed_after_a_release_routes_its_queue_to_a_live_worker(broker_factory, after):
    """The peer's calls wait in its queue while its one worker is held by the first front-end's
    call run alone; the peer is stopped; that call ends (a release), and then:
    - held-again (hostile testing, round 137, F6): the next call run alone holds it again (a sync
      call that crashes its worker), started a second later without the peer's answer. Resumed,
      the peer read both at once, and the release routed its queue into the worker before the hold
      was read: each call died with it (-32002), never run. The release now waits for the rest of
      the read (`worker_held`);
    - died-meanwhile (round 137, F7): the next call, of a method not struck, crashes the worker
      while the peer is stopped. Resumed, the peer read the release and routed its queue into the
      dead worker's socket before its loop read the end: each call died (-32002, "may have run"),
      never run, and its method was struck. The write fails (EPIPE): the calls are kept, never sent
      (`WorkerChannel.unsent`).
    Either way the calls wait for the next worker, and are answered; `nap` is not struck."""
    method, params, stopped = after
    b, peer = _two_front_ends(broker_factory, "--method-timeout", "nap=20", workers=1)
    _struck_on_both(b, "sleep_then", (0, True))
    waiting = [connection_to(peer, b) for _ in range(6)]
    first, second = connection_to(b.pid, b), connection_to(b.pid, b)
    first.sendall(request("sleep_then", [1.0], "held"))  # run alone: holds the peer
    time.sleep(0.05)
    second.sendall(request(method, params, "crash"))  # next: waits its turn in the worker, then crashes it
    time.sleep(0.05)
    for i, sock in enumerate(waiting):
        sock.sendall(request("nap", [0], i))  # (queued in the peer: its one worker is held)
    time.sleep(0.2)
    os.kill(peer, signal.SIGSTOP)
    try:
        time.sleep(stopped)  # (the first call ended; the second runs, or ran and crashed the worker)
    finally:
        os.kill(peer, signal.SIGCONT)
    outcomes = _naps_answered(waiting)
    assert outcomes == ["ok"] * 6, outcomes
    with first, second:
        assert answer(first).get("result") == 1.0
        assert answer(second)["error"]["code"] == -32002  # type: ignore[index]
    assert "nap:" not in b.read_log(0.5)  # (not struck)


def test_an_answer_that_closes_a_connection_with_bytes_unread_ends_it_with_a_fin_not_a_reset(broker_factory):
    """Hostile testing, round 137 (F4): a request with `Connection: close`, answered while the
    front-end was stopped, and another request sent after it meanwhile (a client that did not wait
    for the answer). Resumed, the front-end read the answer before those bytes (`woke`), closed
    the connection with them unread, and the kernel reset it (RST): over a network the client
    could lose the answer of a call that ran. It half-closes and discards them instead, as at any
    close with bytes unread (`unread_bytes`): the answer, then the end."""
    b, peer = _two_front_ends(broker_factory, workers=1)
    sock = connection_to(peer, b)
    closing = request("sleep_then", [0.3], "first").replace(b"Host:", b"Connection: close\r\nHost:")
    with sock:
        sock.sendall(closing)
        time.sleep(0.1)
        os.kill(peer, signal.SIGSTOP)
        try:
            time.sleep(0.3)
            sock.sendall(request("sleep_then", [0], "second"))  # (unread: the front-end is stopped)
            time.sleep(0.6)
        finally:
            os.kill(peer, signal.SIGCONT)
        data = b""
        while chunk := sock.recv(65536):  # (a reset raises ConnectionResetError)
            data += chunk
    assert data.count(b"HTTP/1.1 200") == 1 and b'"result":0.3' in data and b"second" not in data, data
