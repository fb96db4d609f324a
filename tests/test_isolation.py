"""Calls of a method that killed its worker run alone (broker/isolation.py), on real brokers.

Hostile testing, round 78 (HIGH): a worker that crashes or is killed as hung takes every
call it holds, and other clients' calls sent beside a crashing one died with it, -32002,
never run (a third to a half of them). A method whose call was the only one its worker held
when it died now runs alone, one call a worker, on at most one connection's share of the
workers: the other clients' calls go to the others, and none dies with it.
"""

from __future__ import annotations

import threading
import time

from conftest import sample, scrape_metrics, wait_for


def _loop(b, method: str, params: object, seconds: float, outcomes: list[object]) -> None:
    """Call `method` one call at a time for `seconds` (bounded), each outcome "ok" or its error code."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        reply = b.call(method, params, timeout=30)
        outcomes.append("ok" if "result" in reply else reply["error"]["code"])  # type: ignore[index]


def test_other_clients_calls_never_die_beside_a_method_that_crashes_its_worker(broker_factory):
    b = broker_factory("--workers", "2", "--app", "tests.apps.crashy:registry")
    # Its first crash, alone on its worker: `crash_async` is convicted (its calls run alone from
    # now). (Async, it is never routed as blocking its worker: before, every call sent beside it died.)
    assert b.call("crash_async", timeout=20)["error"]["code"] == -32002  # type: ignore[index]
    assert "died holding one call only, of crash_async: its calls run alone" in b.read_log(timeout=1.0)
    wait_for(lambda: sample(scrape_metrics(b), "rpc_broker_workers", state="ready") == 2, timeout=20)
    crashes: list[object] = []
    innocent: list[object] = []
    threads = [threading.Thread(target=_loop, args=(b, "crash_async", None, 3.0, crashes)) for _ in range(3)]
    threads += [threading.Thread(target=_loop, args=(b, "pid", None, 3.0, innocent)) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert crashes and set(crashes) <= {-32002, -32001}, crashes
    assert innocent and set(innocent) == {"ok"}, (innocent.count("ok"), [o for o in innocent if o != "ok"])
    # One slot of the two takes the crashes (one connection's share): the other kept serving.
    assert sample(scrape_metrics(b), "rpc_broker_worker_restarts_total", reason="exited") <= len(crashes) + 1


def test_bystanders_of_a_crash_run_alone_until_one_of_their_calls_answers(broker_factory):
    """Calls of several methods die together: each method is a suspect, its calls alone
    until one answers; the one that crashes again, alone, is convicted."""
    b = broker_factory("--workers", "1", "--app", "tests.apps.crashy:registry", "--sync-prefetch", "1")
    b.call("pid")
    with_it: list[object] = []
    crasher = threading.Thread(target=lambda: with_it.append(b.call("slow_crash", [0.5], timeout=20)))
    crasher.start()
    wait_for(lambda: sample(scrape_metrics(b), "rpc_broker_calls_in_flight") == 1, timeout=10)
    bystander = b.call("pid", timeout=20)  # (behind the sync call, its prefetch: it dies with it)
    crasher.join(30)
    assert bystander["error"]["code"] == -32002 and with_it[0]["error"]["code"] == -32002, (bystander, with_it)
    log = b.read_log(timeout=1.0)
    assert "died holding calls of pid among others: they run alone until one answers" in log, log[-2000:]
    assert "died holding calls of slow_crash among others" in log
    assert "result" in b.call("pid", timeout=20)
    assert "pid answered on a worker of its own: its calls no longer run alone" in b.read_log(timeout=1.0)
    assert b.call("slow_crash", [0.0], timeout=20)["error"]["code"] == -32002  # type: ignore[index]
    assert "died holding one call only, of slow_crash" in b.read_log(timeout=1.0)
