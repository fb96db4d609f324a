"""A crash's isolation shared by every front-end (`serve --frontends N`; broker/worker/alone.py).

Hostile testing, round 130: with several front-ends, a call the front-end that saw a crash ran
*alone* was alone only in that front-end's view: the other front-ends' calls shared its worker,
and died with it (-32002). The worker holds its other connections now (wire.HOLD) while such a
call runs, giving back their calls unstarted (wire.RETURN, `RETURN_ASIDE`). Real brokers on
loopback with two front-ends, real workers, real connections.
"""

from __future__ import annotations

import os
import signal
import threading
import time

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


def _two_front_ends(broker_factory, *flags: str):  # type: ignore[no-untyped-def]
    b = broker_factory("--workers", "2", "--frontends", "2", "--app", "tests.apps.crashy:registry", *flags)
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
    crashes: list[object] = []
    innocent: list[object] = []
    threads = [threading.Thread(target=_loop, args=(crasher, "crash_async", [], 40, 4.0, crashes))]
    threads += [threading.Thread(target=_loop, args=(s, "nap", [0.01], 400, 4.0, innocent)) for s in innocents]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(crashes) >= 3 and set(crashes) <= {-32002, -32001}, crashes
    assert innocent and set(innocent) == {"ok"}, (innocent.count("ok"), [o for o in innocent if o != "ok"])
