"""Calls of a method that killed its worker run alone (broker/isolation.py), on real brokers.

Hostile testing, round 78 (HIGH): a worker that crashes or is killed as hung takes every
call it holds, and other clients' calls sent beside a crashing one died with it, -32002,
never run (a third to a half of them). The methods of the calls a dead worker held now run
alone, one call per worker, on at most one connection's share of the workers, until 1, 2,
4... of their calls (doubling with each death) have answered: the other clients' calls go to
the other workers, and do not die with them.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import threading
import time
import typing

from conftest import free_port, sample, scrape_metrics, wait_for
from test_frontends import answer, request


def _loop(b, method: str, params: object, seconds: float, outcomes: list[object]) -> None:
    """Call `method` one call at a time for `seconds` (bounded), each outcome "ok" or its error code."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        reply = b.call(method, params, timeout=30)
        outcomes.append("ok" if "result" in reply else reply["error"]["code"])  # type: ignore[index]


def test_other_clients_calls_never_die_beside_a_method_that_crashes_its_worker(broker_factory):
    b = broker_factory("--workers", "2", "--app", "tests.apps.crashy:registry")
    # Its first crash: `crash_async` takes a strike (its calls run alone from now). (Async, it is
    # never routed as blocking its worker: before, every call sent beside it died.)
    assert b.call("crash_async", timeout=20)["error"]["code"] == -32002  # type: ignore[index]
    assert re.search(r"died holding 1 call \(of 127\.0\.0\.1:\d+\): their methods' calls now run alone, one per "
                     "worker, until so many of them have answered or so long has passed: crash_async: after 1 answer or 4 s", b.read_log(timeout=1.0))
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
    """Calls of several methods die together: each takes a strike, its calls alone until
    one answers; the one that crashes again, alone, takes a second (two answers owed)."""
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
    assert re.search(r"died holding 2 calls \(of 127\.0\.0\.1:\d+, 127\.0\.0\.1:\d+\): their methods' calls now "
                     "run alone, one per worker, until so many of them have answered or so long has passed: "
                     "slow_crash: after 1 answer or 4 s, pid: after 1 answer or 4 s", log), log[-2000:]
    assert sample(scrape_metrics(b), "rpc_broker_method_isolated", method="pid") == 1
    assert "result" in b.call("pid", timeout=20)
    assert "pid: its calls run as any again (as many of them as asked answered, run alone)" in b.read_log(timeout=1.0)
    assert sample(scrape_metrics(b), "rpc_broker_method_isolated", method="pid") == 0  # (absent)
    assert b.call("slow_crash", [0.0], timeout=20)["error"]["code"] == -32002  # type: ignore[index]
    assert re.search(r"died holding 1 call \(of 127\.0\.0\.1:\d+\): their methods' calls now run alone, one per "
                     "worker, until so many of them have answered or so long has passed: slow_crash: after 2 answers or 8 s", b.read_log(timeout=1.0))
    assert sample(scrape_metrics(b), "rpc_broker_method_isolated", method="slow_crash") == 2


def test_a_method_that_crashes_for_some_params_between_good_calls_soon_takes_no_other_call(broker_factory):
    """Round 79's new user (HIGH): a method crashing its worker for some params only, called
    bad, good, bad, good..., was cleared by each good call, so each bad one ran beside other
    clients' calls and took them along (68 in 15 s). Each death doubles the good answers it
    needs: after two, every bad call runs alone, and the innocent calls that die are those of
    the first two deaths at most."""
    b = broker_factory("--workers", "2", "--app", "tests.apps.crashy:registry")
    innocent: list[object] = []
    attacker: list[object] = []
    dead_pids: set[int] = set()

    done = threading.Event()

    def attack() -> None:
        deadline = time.monotonic() + 20.0
        try:
            while time.monotonic() < deadline and sum(1 for r in attacker if "error" in r) < 5:  # bounded: 20 s
                for crash in (True, False):
                    attacker.append(b.call("crash_if", [crash], timeout=30))
        finally:
            done.set()

    def innocent_loop() -> None:
        while not done.is_set():
            reply = b.call("pid", timeout=30)
            innocent.append("ok" if "result" in reply else reply["error"]["code"])  # type: ignore[index]
            if "error" in reply:
                dead_pids.add(reply["error"]["data"]["pid"])  # type: ignore[index]

    threads = [threading.Thread(target=attack)] + [threading.Thread(target=innocent_loop) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    deaths = sum(1 for reply in attacker if "error" in reply)
    assert deaths >= 5, attacker  # (the attack ran)
    assert set(innocent) <= {"ok", -32002}, innocent
    assert len(dead_pids) <= 2, (dead_pids, deaths, innocent.count(-32002))  # (innocent calls died in 2 deaths at most)


def test_a_worker_killed_as_hung_blames_only_the_methods_of_its_calls_past_their_deadline(broker_factory):
    """Round 79's new user (MEDIUM): killed as hung, a worker's death blamed every method it
    held, the calls waiting behind the hung one too: a slow bystander then took the only
    worker for calls run alone, and its clients waited. Only the calls past their deadline
    (the hung one) are blamed; the others, which waited, are not."""
    b = broker_factory("--workers", "1", "--app", "tests.apps.stuck:registry", "--method-timeout", "spin=0.5",
                       "--cancel-grace", "0.5", "--sync-prefetch", "2")
    naps = []
    threads = [threading.Thread(target=lambda: naps.append(b.call("nap", [5], timeout=30))) for _ in range(2)]
    for t in threads:
        t.start()
    wait_for(lambda: sample(scrape_metrics(b), "rpc_broker_calls_in_flight") == 2, timeout=10)
    assert b.call("spin", [30], timeout=30)["error"]["code"] == -32001  # type: ignore[index]
    for t in threads:
        t.join(30)
    assert [reply["error"]["code"] for reply in naps] == [-32002, -32002], naps  # (died with it)
    log = b.read_log(timeout=1.0)
    assert re.search(r"died holding 3 calls \(of (127\.0\.0\.1:\d+, ){2}127\.0\.0\.1:\d+\): their methods' calls "
                     "now run alone, one per worker, until so many of them have answered or so long has passed: spin: after 1 answer or 4 s\n",
                     log), log[-2000:]
    metrics = scrape_metrics(b)
    assert sample(metrics, "rpc_broker_method_isolated", method="spin") == 1
    assert sample(metrics, "rpc_broker_method_isolated", method="nap") == 0


def test_a_worker_s_death_is_logged_with_its_calls_clients_and_its_notifications_counted_lost(broker_factory, tmp_path):
    """Round 80's new user (MEDIUM): the log of a worker's death named no client, and the
    notifications it held were counted nowhere (they get no answer). Two calls and a
    notification, each on its own Unix socket connection (one connection's calls past its
    share would wait), die with their worker: the log names the clients, with their count,
    and rpc_broker_notifications_dropped_total{reason="worker_died"} counts the notification."""
    path = str(tmp_path / "b.sock")
    b = broker_factory("--workers", "1", "--app", "tests.apps.crashy:registry", "--sync-prefetch", "2",
                       "--stream-socket", path)
    wait_for(lambda: "unix://" in b.read_log(0.05), timeout=10)
    assert sample(scrape_metrics(b), "rpc_broker_notifications_dropped_total", reason="worker_died") == 0
    b.call("pid")  # (known fast: its calls are a blocked worker's prefetch)
    lines = [b'{"jsonrpc":"2.0","method":"slow_crash","params":[1.0],"id":1}\n', b'{"jsonrpc":"2.0","method":"pid"}\n',
             b'{"jsonrpc":"2.0","method":"pid","id":2}\n']
    sockets = [socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) for _ in lines]
    try:
        for n, (s, line) in enumerate(zip(sockets, lines), 1):
            s.settimeout(30)
            s.connect(path)
            s.sendall(line)
            wait_for(lambda n=n: sample(scrape_metrics(b), "rpc_broker_calls_in_flight") == n, timeout=10)
        answers = [json.loads(s.makefile("rb").readline()) for s in (sockets[0], sockets[2])]
    finally:
        for s in sockets:
            s.close()
    assert [(a["id"], a["error"]["code"]) for a in answers] == [(1, -32002), (2, -32002)], answers
    log = b.read_log(timeout=1.0)
    assert "died holding 2 calls and 1 notification (of unix socket x3): their methods' calls now run alone" in log, \
        log[-2000:]
    assert sample(scrape_metrics(b), "rpc_broker_notifications_dropped_total", reason="worker_died") == 1



def test_calls_queued_as_their_worker_died_go_to_its_replacement_not_blamed(broker_factory):
    """Hostile testing, round 137 (F8): one worker of 2 places holds `nap_then_crash(0.5)` and
    `nap(0.2)`; `pid` calls (and a batch) wait in the front-end's queue. The front-end is stopped from
    before the nap answers until after the crash: resumed, it read the answer, which freed a place,
    and wrote the next queued call into the dead worker's socket before its loop read the end; the
    call died with it (-32002, "may have run") though it never reached a live process, and its
    method was struck (run alone). Such a write fails (EPIPE): the calls it held are kept, never
    sent (`WorkerChannel.unsent`), and go to the next worker, answered; only the crasher is blamed."""
    b = broker_factory("--workers", "1", "--worker-concurrency", "2", "--app", "tests.apps.crashy:registry",
                       "--method-timeout", "nap=20")
    assert b.call("nap", [0])["result"] == 0
    socks = [socket.create_connection((b.host, b.port), timeout=30) for _ in range(8)]
    crasher, napper, queued, batched = socks[0], socks[1], socks[2:7], socks[7]
    try:
        crasher.sendall(request("nap_then_crash", [0.5], "crash"))
        napper.sendall(request("nap", [0.2], "nap"))
        time.sleep(0.05)
        body = json.dumps([{"jsonrpc": "2.0", "method": "pid", "id": k} for k in range(3)]).encode()
        batched.sendall(b"POST / HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                        b"Content-Length: %d\r\n\r\n%s" % (len(body), body))  # (queued: the worker's 2
        time.sleep(0.02)  # places are taken; first in line)
        for i, s in enumerate(queued):
            s.sendall(request("pid", [], i))
        time.sleep(0.1)
        os.kill(b.pid, signal.SIGSTOP)  # (the front-end: the worker answers the nap, then dies)
        try:
            time.sleep(0.9)
        finally:
            os.kill(b.pid, signal.SIGCONT)
        bodies: list[typing.Any] = [answer(s) for s in socks]
    finally:
        for s in socks:
            s.close()
    assert bodies[0]["error"]["code"] == -32002, bodies[0]  # type: ignore[index]
    assert bodies[1].get("result") == 0.2, bodies[1]
    pids = {body.get("result") for body in bodies[2:7]} | {a.get("result") for a in bodies[7]}
    assert len(pids) == 1 and None not in pids, bodies[2:]  # (each answered, by the next worker)
    assert sorted(a["id"] for a in bodies[7]) == [0, 1, 2], bodies[7]
    log = b.read_log(timeout=1.0)
    assert "died holding 1 call" in log and ": nap_then_crash: after 1 answer" in log, log[-2000:]
    assert "pid:" not in log, log[-2000:]
    metrics = scrape_metrics(b)  # (hostile testing, round 138: a chunk queued again was counted as one call)
    assert (sample(metrics, "rpc_broker_calls_queued"), sample(metrics, "rpc_broker_calls_in_flight")) == (0, 0)



def test_calls_waiting_behind_a_large_call_the_kernel_did_not_take_go_to_the_next_worker(broker_factory):
    """Hostile testing, round 138 (F2): an async handler holds its worker's loop (time.sleep),
    then exits it; meanwhile a call with 900 KiB of params goes to it, of which the kernel takes
    about 200 KiB, and calls behind it went into the front-end's transport buffer, not a byte of
    them written: they died with the worker (-32002) and their methods were struck. The channel
    pauses as soon as a write is not taken whole: those behind it wait in its own buffer, never
    written (`WorkerChannel.unsent`), and go to the next worker, answered, their method not struck."""
    b = broker_factory("--workers", "1", "--app", "tests.apps.crashy:registry")
    assert b.call("size", ["x"])["result"] == 1
    socks = [socket.create_connection((b.host, b.port), timeout=30) for _ in range(4)]
    try:
        socks[0].sendall(request("block_then_crash", [1.5], "crash"))
        time.sleep(0.3)
        socks[1].sendall(request("size", ["x" * (900 << 10)], "large"))  # (part of it in the kernel)
        time.sleep(0.1)
        socks[2].sendall(request("size", ["y" * (300 << 10)], "behind"))
        time.sleep(0.1)
        socks[3].sendall(request("pid", [], "small"))
        bodies: list[typing.Any] = [answer(s) for s in socks]
    finally:
        for s in socks:
            s.close()
    assert bodies[0]["error"]["code"] == -32002, bodies[0]
    assert bodies[1].get("result") == 900 << 10 or bodies[1]["error"]["code"] == -32002, bodies[1]  # (cut: unknown)
    assert (bodies[2].get("result"), type(bodies[3].get("result"))) == (300 << 10, int), bodies[2:]
    log = b.read_log(timeout=1.0)
    assert "pid:" not in log, log[-2000:]


def test_calls_of_one_write_past_what_the_kernel_took_go_to_the_next_worker(broker_factory):
    """Hostile testing, round 139 (C1): a handler holds its worker's loop, then exits it; 40 calls of
    9 KB, read at once off one NDJSON connection, go to it in one write, of which the kernel takes
    what its socket holds (about 200 KB). Those past that were left in the transport's buffer, never
    written, and died with the worker (-32002). The kernel is given the bytes by the channel itself:
    only the frame it cut goes on; the rest wait in the channel, and go to the next worker."""
    left, right = socket.socketpair()  # (what a Unix socket holds here, as the worker's does)
    with left, right:
        left.setblocking(False)
        held = 0
        with contextlib.suppress(BlockingIOError):
            while True:
                held += left.send(b"x" * 65536)
    port = free_port()
    b = broker_factory("--workers", "1", "--app", "tests.apps.crashy:registry", "--stream-port", str(port))
    wait_for(lambda: "tcp://" in b.read_log(0.05), timeout=10)
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        reader = s.makefile("rb")
        s.sendall(b'{"jsonrpc":"2.0","method":"block_then_crash","params":[1.5],"id":"crash"}\n')
        time.sleep(0.3)
        pad = "x" * 9000
        s.sendall(b"".join(json.dumps({"jsonrpc": "2.0", "method": "size", "params": [pad], "id": i}).encode() + b"\n"
                           for i in range(40)))
        answers = [json.loads(reader.readline()) for _ in range(41)]
    outcomes = {a["id"]: a.get("result", a.get("error", {}).get("code")) for a in answers}
    assert outcomes.pop("crash") == -32002
    assert set(outcomes.values()) <= {9000, -32002}, outcomes
    died = sorted(i for i, o in outcomes.items() if o == -32002)
    assert len(died) <= held // 9000 + 2, (held, died)  # (in the kernel, or cut: may have been read; no more)
