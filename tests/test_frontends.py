"""`serve --frontends N` (issue 14, item 3): front-end processes on one port (SO_REUSEPORT)
sharing every worker (broker/peers.py, broker/peer.py, broker/members.py). Real brokers on
loopback, real workers, real connections."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import threading
import time
from pathlib import Path

import msgspec
import pytest
from conftest import free_port, sample, scrape_metrics, wait_for

from broker.config import SHARED_LIMITS, Config, per_frontend
from broker.metrics import FRONTEND_RESTART_REASONS


def children(pid: int) -> list[int]:
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def peers_of(pid: int) -> list[int]:
    return [c for c in children(pid) if "broker.peer" in cmdline(c)]


def restarts(samples: dict) -> dict[str, float]:
    """rpc_broker_frontend_restarts_total by reason, those above 0 (every reason exported)."""
    got = {r: sample(samples, "rpc_broker_frontend_restarts_total", reason=r) for r in FRONTEND_RESTART_REASONS}
    assert all(("rpc_broker_frontend_restarts_total", (("reason", r),)) in samples for r in got), samples
    return {r: n for r, n in got.items() if n}


def workers_of(pid: int) -> list[int]:
    return [c for c in children(pid) if "broker.worker" in cmdline(c)]


def tcp_sockets(pid: int) -> set[int]:
    """The inodes of the TCP sockets process `pid` holds (its fds' "socket:[N]")."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    tcp = {int(line.split()[9]) for name in ("tcp", "tcp6") for line in
           Path(f"/proc/{pid}/net/{name}").read_text().splitlines()[1:]}
    return inodes & tcp


def request(method: str, params: object, id_: object) -> bytes:
    body = json.dumps({"jsonrpc": "2.0", "method": method, "params": params, "id": id_}).encode()
    return (b"POST / HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
            % (len(body), body))


def answer(sock: socket.socket) -> dict[str, object]:
    """Read one HTTP answer (Content-Length framed) off `sock`; its decoded body."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, "closed"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, "closed"
        body += chunk
    return json.loads(body[:length])


def test_each_front_end_holds_its_share_of_the_bounds():
    config = Config(frontends=3, max_connections=1000, max_queue=4000, max_outgoing_bytes=300 * 2**20)
    shared = per_frontend(config)
    assert shared.max_connections == 333 and shared.max_queue == 1333
    assert shared.max_outgoing_bytes == 100 * 2**20
    assert shared.max_incoming_bytes == config.max_incoming_bytes // 3
    assert per_frontend(Config(frontends=1)) == Config(frontends=1)
    # (new user, round 115: a bound of 1 on 2 front-ends was 0 each, and 0 is no bound)
    assert per_frontend(Config(frontends=2, max_worker_params_bytes=1)).max_worker_params_bytes == 1
    assert per_frontend(Config(frontends=2, max_worker_params_bytes=0)).max_worker_params_bytes == 0
    assert {name for name in SHARED_LIMITS} <= set(msgspec.structs.asdict(config))
    assert Config(frontends=0).frontend_count == max(1, (os.cpu_count() or 1) // 8) or Config().frontend_count == 1


def test_each_share_holds_one_request_at_least():
    # (hostile testing, round 126: an 800 KB body refused with max_incoming_bytes 1 MB and 2
    # front-ends; a 500-call batch with max_queue 600)
    config = Config(frontends=2, max_incoming_bytes=10**6, max_body_bytes=800_000, max_queue=600, max_batch=500,
                    max_queue_bytes=10**6, max_outgoing_bytes=10**6, max_response_bytes=900_000)
    shared = per_frontend(config)
    assert (shared.max_incoming_bytes, shared.max_queue_bytes) == (800_000, 800_000)
    assert shared.max_queue == 500 and shared.max_outgoing_bytes == 900_000
    small = per_frontend(Config(frontends=4, max_queue=2, max_batch=1000, max_queue_bytes=0))
    assert small.max_queue == 2 and small.max_queue_bytes == 0  # (never past the setting itself)


@pytest.mark.parametrize(("setting", "value"), [("max_connections", 3), ("worker_concurrency", 3)])
def test_a_bound_smaller_than_the_front_ends_number_is_refused_at_start(tmp_path, setting, value):
    # (hostile testing, round 126: max_connections 1 with 4 front-ends held 4; worker_concurrency 1
    # gave each front-end a place of its own, about 3 calls at once)
    from broker.config import ConfigError, load

    with pytest.raises(ConfigError, match=f"{setting} = {value} must be at least the front-ends' number, 4"):
        load(None, {}, {"frontends": 4, setting: value})
    assert load(None, {}, {"frontends": 4, setting: 4}).frontend_count == 4


def test_a_request_one_front_end_takes_every_front_end_takes(broker_factory):
    # (hostile testing, round 126: each front-end's share of max_incoming_bytes refused an
    # 800 KB body on an idle broker, its share of max_queue a 500-call batch)
    b = broker_factory("--workers", "1", "--worker-concurrency", "2", "--frontends", "2", "--max-body-bytes", "800000",
                       "--max-incoming-bytes", "1000000", "--max-queue", "600", "--max-batch", "500")
    wait_for(lambda: "front-end 1 (pid" in b.read_log(0.05), timeout=30)
    [peer] = peers_of(b.pid)
    for pid in (b.pid, peer):
        with connection_to(pid, b) as s:
            text = "x" * 799_000
            s.sendall(request("echo", [text], "big"))
            assert answer(s) == {"jsonrpc": "2.0", "id": "big", "result": [text]}
            batch = json.dumps([{"jsonrpc": "2.0", "method": "add", "params": [i, 1], "id": i}
                                for i in range(500)]).encode()
            s.sendall(b"POST / HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n%s" % (len(batch), batch))
            got = answer(s)
            assert sorted((r["id"], r.get("result")) for r in got) == [(i, i + 1) for i in range(500)]  # type: ignore[union-attr,index]


def test_two_front_ends_accept_on_one_port_share_the_workers_and_stop_cleanly(broker_factory):
    b = broker_factory("--workers", "2", "--frontends", "2")
    log = b.read_log(0.2)
    assert "2 front-end processes" in log
    wait_for(lambda: "front-end 1 (pid" in b.read_log(0.05), timeout=30)
    [peer] = peers_of(b.pid)
    workers = workers_of(b.pid)
    assert len(workers) == 2
    conns = []
    try:
        for i in range(48):  # (the kernel spreads new connections over both listening sockets)
            s = socket.create_connection((b.host, b.port), timeout=30)
            conns.append(s)
            s.sendall(request("worker_info", [], i))
            assert answer(s)["result"]["pid"] in workers  # type: ignore[index]
        mine, theirs = tcp_sockets(b.pid), tcp_sockets(peer)
        assert len(theirs) >= 5 and len(mine) >= 5, (len(mine), len(theirs))  # both took connections
        for i, s in enumerate(conns):  # and every one serves on, on whichever front-end took it
            s.sendall(request("add", [i, 1], f"x{i}"))
            assert answer(s) == {"jsonrpc": "2.0", "id": f"x{i}", "result": i + 1}
    finally:
        for s in conns:
            s.close()
    assert b.stop() == 0
    wait_for(lambda: not any(os.path.exists(f"/proc/{p}") and "broker" in cmdline(p) for p in [peer, *workers]),
             timeout=30)
    assert "front-end 1" not in b.read_log() or "ERROR" not in b.read_log()


def scrape_on(pid: int, b) -> dict:  # type: ignore[no-untyped-def,type-arg]
    """GET /metrics answered by the front-end process `pid` (`connection_to`), parsed."""
    conn = http.client.HTTPConnection(b.host, b.port, timeout=30)
    conn.sock = connection_to(pid, b)
    return scrape_metrics(b, connection=conn)


def test_metrics_are_one_view_whichever_front_end_answers(broker_factory):
    b = broker_factory("--workers", "2", "--frontends", "2")
    wait_for(lambda: "front-end 1 (pid" in b.read_log(0.05), timeout=30)
    [peer] = peers_of(b.pid)
    # Each body is made for its scrape from every front-end's series, asked for after it came
    # (broker/scrapes.py): a call answered on one front-end is counted by the next scrape on
    # any, at once (a body shared every second was up to 2 s behind).
    for i in range(8):
        with connection_to((b.pid, peer)[i % 2], b) as s:
            s.sendall(request("add", [i, 1], i))
            assert answer(s)["result"] == i + 1
        got = scrape_on((peer, b.pid)[i // 2 % 2], b)
        assert sample(got, "rpc_broker_calls_total", method="add", outcome="ok") == i + 1, i
    calls = 8
    for i in range(60):  # one connection each: spread over both front-ends
        s = socket.create_connection((b.host, b.port), timeout=30)
        with s:
            s.sendall(request("add", [i, 1], i))
            assert answer(s)["result"] == i + 1
            calls += 1
    seen = [sample(scrape_metrics(b), "rpc_broker_calls_total", method="add", outcome="ok") for _ in range(20)]
    assert seen == [calls] * 20
    samples = scrape_metrics(b)
    assert sample(samples, "rpc_broker_workers", state="ready") == 2  # (the first front-end's: not doubled)


def test_a_reload_under_load_loses_no_call_on_any_front_end(broker_factory):
    b = broker_factory("--workers", "2", "--frontends", "2")
    wait_for(lambda: "front-end 1 (pid" in b.read_log(0.05), timeout=30)
    failures: list[object] = []
    done = threading.Event()

    def client(n: int) -> None:
        s = socket.create_connection((b.host, b.port), timeout=30)
        with s:
            i = 0
            deadline = time.monotonic() + 30
            while not done.is_set() and time.monotonic() < deadline:
                s.sendall(request("add", [n, i], i))
                got = answer(s)
                if got.get("result") != n + i:
                    failures.append(got)
                i += 1

    threads = [threading.Thread(target=client, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    os.kill(b.pid, signal.SIGHUP)
    wait_for(lambda: "reload: all 2 workers replaced" in b.read_log(0.05), timeout=60)
    time.sleep(0.5)
    done.set()
    for t in threads:
        t.join(60)
    assert not failures, failures[:3]
    new = set(workers_of(b.pid))
    s = socket.create_connection((b.host, b.port), timeout=30)
    with s:
        for i in range(10):
            s.sendall(request("worker_info", [], i))
            assert answer(s)["result"]["pid"] in new  # type: ignore[index]


@pytest.mark.parametrize("target", ["worker", "peer"])
def test_a_dead_worker_or_front_end_loses_no_other_call(broker_factory, target):
    b = broker_factory("--workers", "2", "--frontends", "2")
    wait_for(lambda: "front-end 1 (pid" in b.read_log(0.05), timeout=30)
    [peer] = peers_of(b.pid)
    if target == "worker":
        victim = workers_of(b.pid)[0]
    else:
        victim = peer
        s = connection_to(peer, b)  # (calls it answers and counts, before it goes)
        with s:
            for i in range(5):
                s.sendall(request("add", [i, 1], i))
                assert answer(s)["result"] == i + 1
        samples = scrape_metrics(b)
        assert sample(samples, "rpc_broker_calls_total", method="add", outcome="ok") == 5
        assert sample(samples, "rpc_broker_frontends", state="serving") == 2
        assert restarts(samples) == {}
    os.kill(victim, signal.SIGKILL)
    time.sleep(0.5)
    for i in range(20):  # whichever front-end takes them: answered (a worker restarted, or the other front-end)
        s = socket.create_connection((b.host, b.port), timeout=30)
        with s:
            s.sendall(request("add", [i, 1], i))
            got = answer(s)
            assert got.get("result") == i + 1, got
    if target == "peer":  # (said; another takes its place, and the workers are reloaded to connect to it)
        wait_for(lambda: f"front-end 1 (pid {peer}) exited with -9" in b.read_log(0.05), timeout=10)
        wait_for(lambda: "reload: all 2 workers replaced" in b.read_log(0.05), timeout=60)
        [again] = peers_of(b.pid)
        assert again != peer
        wait_for(lambda: f"front-end 1 (pid {again}) serving" in b.read_log(0.05), timeout=30)
        s = connection_to(again, b)  # (it takes connections again, and serves them)
        with s:
            s.sendall(request("add", [2, 2], "again"))
            assert answer(s) == {"jsonrpc": "2.0", "id": "again", "result": 4}
        # The dead front-end's counts stay in the broker's: a counter never goes back
        samples = scrape_metrics(b)
        assert sample(samples, "rpc_broker_calls_total", method="add", outcome="ok") == 5 + 20 + 1
        assert sample(samples, "rpc_broker_frontends", state="serving") == 2
        assert restarts(samples) == {"killed": 1}  # (it had served: SIGKILL, not ours)
    assert b.stop() == 0


def test_a_front_end_restart_s_reason_is_how_the_one_before_ended():
    from broker.peers import frontend_restart_reason

    assert frontend_restart_reason(-9, hung=True, served=True) == "hung"  # (killed by us as silent)
    assert frontend_restart_reason(-9, hung=True, served=False) == "hung"
    assert frontend_restart_reason(1, hung=False, served=False) == "never_served"
    assert frontend_restart_reason(0, hung=False, served=True) == "stopped"
    assert frontend_restart_reason(-9, hung=False, served=True) == "killed"
    assert frontend_restart_reason(-11, hung=False, served=True) == "killed"
    assert frontend_restart_reason(1, hung=False, served=True) == "exited"
    assert {frontend_restart_reason(st, h, sv) for st in (0, 1, -9) for h in (True, False)
            for sv in (True, False)} == set(FRONTEND_RESTART_REASONS)


def test_rate_limits_are_shared_among_the_front_ends():
    from broker.ratelimit import UNLIMITED, Rate, share

    assert share(Rate(10.0, 10), 1) == Rate(10.0, 10)
    assert share(Rate(10.0, 10), 3) == Rate(10.0 / 3, 3)  # (rounded down: never more than the burst)
    assert share(Rate(10.0, 3), 2) == Rate(5.0, 1)  # (new user, round 114: 2 each let 4 through)
    assert share(Rate(0.5, 1), 2) == Rate(0.25, 1)  # (a burst of one at least)
    assert share(UNLIMITED, 4) == UNLIMITED


def test_a_caller_gets_no_more_than_its_rate_limit_across_front_ends(broker_factory):
    b = broker_factory("--workers", "1", "--frontends", "2", "--rate-limit", "5", "--rate-burst", "10")
    wait_for(lambda: "front-end 1 (pid" in b.read_log(0.05), timeout=30)
    ok = limited = 0
    started = time.monotonic()
    for i in range(60):  # a new connection each: spread over both front-ends' buckets
        s = socket.create_connection((b.host, b.port), timeout=30)
        with s:
            s.sendall(request("add", [i, 1], i))
            got = answer(s)
            if "result" in got:
                ok += 1
            else:
                assert got["error"]["code"] == -32005, got  # type: ignore[index]
                limited += 1
    elapsed = time.monotonic() - started
    # Each front-end holds burst 5 and 2.5 calls a second: together the caller's burst of 10 and
    # 5 a second, never twice that (each front-end with the whole rate let 20 through at once).
    assert ok <= 10 + 5 * elapsed + 1, (ok, elapsed)
    assert limited and ok >= 2


def connection_to(peer: int, b) -> socket.socket:  # type: ignore[no-untyped-def]
    """A connection the front-end process `peer` took (tried until one lands there; 100 at most;
    `b.pid`: the first front-end)."""
    for i in range(100):
        before = tcp_sockets(peer)
        s = socket.create_connection((b.host, b.port), timeout=30)
        s.sendall(request("rpc.discover", [], i))  # (the broker's own: any app)
        assert "result" in answer(s)
        if tcp_sockets(peer) - before:
            return s
        s.close()
    raise AssertionError("no connection landed on the other front-end in 100")


def landed_on(pid: int, b) -> socket.socket:  # type: ignore[no-untyped-def]
    """A connection the front-end process `pid` took, found with GET /healthz (no token needed;
    200 tries at most)."""
    for _ in range(200):
        before = tcp_sockets(pid)
        s = socket.create_connection((b.host, b.port), timeout=30)
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        s.recv(65536)
        if tcp_sockets(pid) - before:
            return s
        s.close()
    raise AssertionError("no connection landed on that front-end in 200")


def test_a_worker_another_front_end_kills_as_hung_is_said_so_and_restarted(broker_factory):
    b = broker_factory("--workers", "1", "--frontends", "2", "--app", "tests.apps.stuck:registry",
                       "--timeout", "0.3", "--cancel-grace", "0.5")
    wait_for(lambda: "front-end 1 (pid" in b.read_log(0.05), timeout=30)
    [peer] = peers_of(b.pid)
    [first] = workers_of(b.pid)
    s = connection_to(peer, b)
    with s:
        s.sendall(request("spin", [60], "stuck"))
        assert answer(s)["error"]["code"] == -32001  # type: ignore[index]
    # Killed by the other front-end: the first says why when it reaps it, and restarts it at once
    said = re.compile(rf"\(pid {first}\) killed by SIGKILL \(hung: no answer (\d+\.\d) s after a cancelled call"
                      r" \(front-end 1\)\)")
    wait_for(lambda: said.search(b.read_log(0.05)) is not None, timeout=20)
    assert float(said.search(b.read_log(0.05)).group(1)) >= 0.5  # type: ignore[union-attr]
    assert "killing it as hung (blocked in this front-end's call, its deadline and cancel_grace past)" in b.read_log(0.05)
    wait_for(lambda: bool(workers_of(b.pid)) and workers_of(b.pid) != [first], timeout=20)


def test_a_stopped_front_end_is_killed_as_hung_and_replaced(broker_factory):
    """SIGSTOP on a front-end other than the first: its listening socket still takes connections
    (SO_REUSEPORT knows nothing of it) that nobody serves. Silent past SILENT_SECONDS, it is
    killed, another takes its place, and the workers are reloaded to connect to it."""
    from broker.peers import SILENT_SECONDS

    b = broker_factory("--workers", "1", "--frontends", "2", "--no-metrics")  # (its heartbeat without metrics too)
    wait_for(lambda: "front-end 1 (pid" in b.read_log(0.05), timeout=30)
    [peer] = peers_of(b.pid)
    os.kill(peer, signal.SIGSTOP)
    try:
        wait_for(lambda: f"front-end 1 (pid {peer}) said nothing for" in b.read_log(0.05),
                 timeout=SILENT_SECONDS + 20)
    finally:
        if os.path.exists(f"/proc/{peer}"):
            os.kill(peer, signal.SIGCONT)
    wait_for(lambda: "reload: the worker replaced" in b.read_log(0.05), timeout=60)
    wait_for(lambda: len(peers_of(b.pid)) == 1 and peers_of(b.pid) != [peer], timeout=30)
    [again] = peers_of(b.pid)
    wait_for(lambda: f"front-end 1 (pid {again}) serving" in b.read_log(0.05), timeout=30)
    s = connection_to(again, b)
    with s:
        s.sendall(request("add", [1, 2], 1))
        assert answer(s)["result"] == 3
    assert b.stop() == 0


def test_mcp_hands_out_no_session_a_front_end_alone_would_know(broker_factory):
    """Hostile testing, round 126 (HIGH): a 2025-11-25 session begun on one front-end was
    unknown to the others (404, "Session not found": the client starts over). With several
    front-ends, initialize answers with no Mcp-Session-Id (a server may), and every request
    after it is served on whichever front-end takes it."""
    b = broker_factory("--workers", "1", "--frontends", "2")
    wait_for(lambda: "front-end 1 (pid" in b.read_log(0.05), timeout=30)
    legacy = {"mcp-protocol-version": "2025-11-25"}
    for i in range(8):  # (each on a new connection: both front-ends)
        status, headers, body = b.post(json.dumps({"jsonrpc": "2.0", "id": i, "method": "initialize", "params": {
            "protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}}),
            path="/mcp")
        assert status == 200 and json.loads(body)["result"]["protocolVersion"] == "2025-11-25"
        assert "mcp-session-id" not in headers
        status, _, body = b.post(json.dumps({"jsonrpc": "2.0", "id": i, "method": "tools/list"}), path="/mcp",
                                 headers=legacy)
        assert status == 200 and json.loads(body)["result"]["tools"], body


def test_no_front_end_kills_a_worker_busy_in_another_ones_long_call(broker_factory):
    """Hostile testing, round 126 (HIGH): a front-end killed a worker as hung 0.5 s after its own
    1 s call's deadline, while the worker ran another front-end's sync call well within its 20 s
    deadline: that call was lost (-32002). It waits out the longest deadline a call may have."""
    b = broker_factory("--workers", "1", "--frontends", "2", "--app", "tests.apps.stuck:registry",
                       "--timeout", "1", "--method-timeout", "spin=20", "--cancel-grace", "0.5")
    wait_for(lambda: "front-end 1 (pid" in b.read_log(0.05), timeout=30)
    [peer] = peers_of(b.pid)
    mine = connection_to(b.pid, b)  # (the first front-end's)
    theirs = connection_to(peer, b)
    with mine, theirs:
        mine.sendall(request("spin", [4], "long"))
        time.sleep(0.3)
        theirs.sendall(request("pid", [], "short"))
        assert answer(theirs)["error"]["code"] == -32001  # type: ignore[index]
        got = answer(mine)
        assert got.get("id") == "long" and "result" in got, got
    assert "killing it as hung" not in b.read_log()


def test_a_second_broker_on_the_port_is_refused_as_without_frontends(broker_factory):
    """Hostile testing, round 126 (HIGH): SO_REUSEPORT, which the front-ends share the port by, let
    a second broker of the same user start on it and take part of the first's connections. It
    fails as with one front-end, unless reuse_port asks for that (a handover)."""
    import subprocess
    import sys

    from conftest import ROOT

    b = broker_factory("--workers", "1", "--frontends", "2")
    done = subprocess.run([sys.executable, "-m", "broker", "serve", "--host", "127.0.0.1", "--port", str(b.port),
                           "--workers", "1", "--frontends", "2"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, stdin=subprocess.DEVNULL)
    assert done.returncode == 1, done.stderr[-2000:]
    assert "cannot listen (JSON-RPC over HTTP: --port)" in done.stderr and "address already in use" in done.stderr.lower()
    assert b.call("add", [1, 2])["result"] == 3


def test_recycling_by_calls_counts_every_front_ends_calls(broker_factory):
    # (a worker's calls sent by the other front-ends count toward max_calls_per_worker: the
    # first front-end's alone did, and a worker serving them all was never recycled)
    b = broker_factory("--workers", "1", "--frontends", "2", "--max-calls-per-worker", "40",
                       "--max-calls-jitter", "0")
    wait_for(lambda: "front-end 1 (pid" in b.read_log(0.05), timeout=30)
    [peer] = peers_of(b.pid)
    [first] = workers_of(b.pid)
    with connection_to(peer, b) as s:
        for i in range(60):
            s.sendall(request("add", [i, 1], i))
            assert answer(s)["result"] == i + 1
    wait_for(lambda: first not in workers_of(b.pid) and len(workers_of(b.pid)) == 1, timeout=30)
    # (the count said is every front-end's, not the first's alone: new user, round 114 read "was
    # sent 39 calls, its limit 50")
    said = re.search(r"recycled \(max_calls: pid \d+ was sent (\d+) calls, its limit 40", b.read_log(0.2))
    assert said and int(said.group(1)) >= 40, b.read_log(0.05)


def test_with_a_metrics_port_no_front_end_serves_metrics_on_the_rpc_port(broker_factory):
    # (new user, round 112: 3 of 8 GET /metrics on the RPC port were answered 200, by the
    # other front-end, with metrics moved to a loopback metrics port)
    port = free_port()
    b = broker_factory("--workers", "1", "--frontends", "2", "--metrics-port", str(port))
    wait_for(lambda: "front-end 1 (pid" in b.read_log(0.05), timeout=30)
    [peer] = peers_of(b.pid)
    for pid in (b.pid, peer):
        with connection_to(pid, b) as s:
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            head = b""
            while b"\r\n\r\n" not in head:
                chunk = s.recv(65536)
                assert chunk, "closed"
                head += chunk
            assert head.startswith(b"HTTP/1.1 404 "), head[:100]
    assert sample(scrape_metrics(b, port), "rpc_broker_workers", state="ready") == 1


def test_a_front_end_stopped_alone_drains_and_is_replaced_without_an_error(broker_factory):
    # (new user, round 112: SIGTERM to front-end 1 drained it, 10 of 10 calls answered, and
    # the first front-end logged ERROR "exited with 0: its connections were lost")
    b = broker_factory("--workers", "1", "--frontends", "2")
    wait_for(lambda: "front-end 1 (pid" in b.read_log(0.05), timeout=30)
    [peer] = peers_of(b.pid)
    with connection_to(peer, b) as s:
        s.sendall(request("sleep", [1.0], "slow"))
        time.sleep(0.3)
        os.kill(peer, signal.SIGTERM)
        assert answer(s) == {"jsonrpc": "2.0", "id": "slow", "result": 1.0}
    wait_for(lambda: f"front-end 1 (pid {peer}) stopped, its calls answered: starting another" in b.read_log(0.05),
             timeout=30)
    wait_for(lambda: len(peers_of(b.pid)) == 1 and peers_of(b.pid) != [peer], timeout=30)
    assert f"(pid {peer}) exited with" not in b.read_log(0.05)
    assert restarts(scrape_metrics(b)) == {"stopped": 1}


def test_a_front_end_stopped_before_it_serves_is_killed_and_started_again(broker_factory):
    # (hostile testing, round 127: a peer stopped as it started was never killed, what it was
    # sent piled up for it; and one that exited before it served was never started again)
    b = broker_factory("--workers", "1", "--frontends", "2")
    wait_for(lambda: "front-end 1 (pid" in b.read_log(0.05), timeout=30)
    [dead] = peers_of(b.pid)
    os.kill(dead, signal.SIGKILL)  # (its replacement, started at once, is stopped as it starts)
    deadline = time.monotonic() + 30
    while not (fresh := [p for p in peers_of(b.pid) if p != dead]) and time.monotonic() < deadline:
        time.sleep(0.001)
    [first] = fresh
    os.kill(first, signal.SIGSTOP)
    wait_for(lambda: f"front-end 1 (pid {first}) said nothing for" in b.read_log(0.1), timeout=60)
    assert "s since it started: killing it as hung" in b.read_log(0.05)
    wait_for(lambda: f"front-end 1 (pid {first}) exited with -9 before it served (1 time in a row): starting"
             " another in 10.0 s" in b.read_log(0.05), timeout=10)
    wait_for(lambda: [p for p in peers_of(b.pid) if p not in (dead, first)], timeout=30)
    [again] = peers_of(b.pid)
    wait_for(lambda: f"front-end 1 (pid {again}) serving" in b.read_log(0.05), timeout=30)
    with connection_to(again, b) as s:
        s.sendall(request("add", [2, 2], "again"))
        assert answer(s) == {"jsonrpc": "2.0", "id": "again", "result": 4}
    assert restarts(scrape_metrics(b)).get("hung") == 1  # (and `dead`: killed, or never_served)


def test_a_stall_of_the_first_front_end_kills_no_peer_that_spoke(broker_factory):
    # (hostile testing, round 127: the first front-end stopped 12 s killed, once resumed, a peer
    # whose words waited unread in its socket all along)
    b = broker_factory("--workers", "1", "--frontends", "2")
    wait_for(lambda: "front-end 1 (pid" in b.read_log(0.05), timeout=30)
    [peer] = peers_of(b.pid)
    os.kill(b.pid, signal.SIGSTOP)
    try:
        time.sleep(12)
    finally:
        os.kill(b.pid, signal.SIGCONT)
    time.sleep(3)
    assert peers_of(b.pid) == [peer] and "killing it as hung" not in b.read_log(0.05)


def test_the_stop_ends_a_stopped_front_end_at_once(broker_factory):
    # (hostile testing, round 127: SIGTERM with a peer stopped (SIGSTOP) waited grace_period
    # + 15 s, 45 s, to kill it, its socket taking connections meanwhile)
    b = broker_factory("--workers", "1", "--frontends", "2")
    wait_for(lambda: "front-end 1 (pid" in b.read_log(0.05), timeout=30)
    [peer] = peers_of(b.pid)
    os.kill(peer, signal.SIGSTOP)
    began = time.monotonic()
    assert b.stop(timeout=60) == 0
    assert "did not stop in" not in b.read_log(0.05), time.monotonic() - began


def test_a_front_end_started_again_serves_the_tokens_the_broker_read_at_its_start(broker_factory, tmp_path):
    # (hostile testing, round 127: a peer started again read the token file edited since: a
    # token was taken or refused by which front-end took the connection; only a restart of the
    # broker reads the file again)
    old, new = "o" * 32, "n" * 32
    path = tmp_path / "tokens"
    path.write_text(f"ci:{old}\n")
    b = broker_factory("--workers", "1", "--frontends", "2", "--auth-tokens-file", str(path),
                       env={"RPC_BROKER_AUTH_TOKENS": ""})
    wait_for(lambda: "front-end 1 (pid" in b.read_log(0.05), timeout=30)
    [peer] = peers_of(b.pid)
    path.write_text(f"ci:{new}\n")
    os.kill(peer, signal.SIGKILL)
    wait_for(lambda: [p for p in peers_of(b.pid) if p != peer], timeout=30)
    [again] = peers_of(b.pid)
    wait_for(lambda: f"front-end 1 (pid {again}) serving" in b.read_log(0.05), timeout=30)
    body = json.dumps({"jsonrpc": "2.0", "method": "add", "params": [1, 2], "id": 1}).encode()
    for pid in (again, b.pid):
        for secret, status in ((old, b"200"), (new, b"401")):
            with landed_on(pid, b) as s:
                s.sendall(b"POST / HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nAuthorization:"
                          b" Bearer %s\r\nContent-Length: %d\r\n\r\n%s" % (secret.encode(), len(body), body))
                assert s.recv(65536).startswith(b"HTTP/1.1 " + status), (pid, secret)


def test_a_front_end_that_stops_leaves_its_counts_in_the_broker(broker_factory):
    # (hostile testing, round 128: the calls a front-end answered since the last scrape were
    # lost from /metrics when it stopped)
    b = broker_factory("--workers", "1", "--frontends", "2")
    wait_for(lambda: "front-end 1 (pid" in b.read_log(0.05), timeout=30)
    [peer] = peers_of(b.pid)
    with connection_to(peer, b) as s:
        for i in range(20):
            s.sendall(request("add", [i, 1], i))
            assert answer(s)["result"] == i + 1
    os.kill(peer, signal.SIGTERM)
    wait_for(lambda: f"front-end 1 (pid {peer}) stopped, its calls answered" in b.read_log(0.05), timeout=30)
    assert sample(scrape_metrics(b), "rpc_broker_calls_total", method="add", outcome="ok") == 20


def test_a_front_end_whose_workers_cannot_connect_yet_is_reloaded_again_until_they_do(broker_factory, tmp_path):
    # (new user, round 113: a front-end started again while the app on disk was broken never
    # served, even once the app was fixed, until an operator's SIGHUP)
    app = tmp_path / "fragile.py"
    good = "from broker.worker import Registry\nregistry = Registry()\n\n@registry.method()\ndef one() -> int:\n" \
           "    return 1\n"
    app.write_text(good)
    b = broker_factory("--workers", "1", "--frontends", "2", "--app", "fragile:registry",
                       env={"PYTHONPATH": f"{tmp_path}:{os.environ.get('PYTHONPATH', '')}"})
    wait_for(lambda: "front-end 1 (pid" in b.read_log(0.05), timeout=30)
    [peer] = peers_of(b.pid)
    app.write_text(good + "this is not python\n")
    os.kill(peer, signal.SIGKILL)
    wait_for(lambda: "reload failed" in b.read_log(0.05), timeout=30)
    [again] = peers_of(b.pid)
    samples = scrape_metrics(b)
    assert (sample(samples, "rpc_broker_frontends", state="serving"),
            sample(samples, "rpc_broker_frontends", state="starting")) == (1, 1)
    app.write_text(good)
    wait_for(lambda: f"front-end 1 (pid {again}) is not serving yet: its workers are not connected" in b.read_log(0.05),
             timeout=30)
    wait_for(lambda: f"front-end 1 (pid {again}) serving" in b.read_log(0.05), timeout=30)
    assert sample(scrape_metrics(b), "rpc_broker_frontends", state="serving") == 2


def test_answers_the_held_thread_writes_in_part_reach_the_first_front_end_whole(broker_factory, tmp_path):
    # (hostile testing, round 129: with several front-ends, the worker's held answers' thread
    # wrote the first connection's replies in part (its socket full) and left the rest of a
    # frame where the next split read it as a frame: "unknown frame kind 120", the worker
    # killed, or answers lost and the worker killed as hung)
    (tmp_path / "bulky.py").write_text(
        "import time\nfrom broker.worker import Registry\nregistry = Registry()\n\n"
        "@registry.method()\ndef blob(n: int) -> str:\n    return 'x' * n\n\n"
        "@registry.method()\ndef spike(ms: float = 0) -> float:\n    if ms:\n        time.sleep(ms / 1000)\n"
        "    return ms\n")
    port = free_port()
    # (max_response_bytes past the 120 MB of answers: a client reading them slower than they come,
    # on a loaded machine, was owed past 32 MiB and answered -32603 for it, as it should be; this
    # test is of the frames, not of that bound)
    b = broker_factory("--workers", "1", "--frontends", "2", "--stream-port", str(port), "--timeout", "10",
                       "--max-response-bytes", str(256 * 1024 * 1024), "--max-outgoing-bytes", str(1 << 30),
                       "--app", "bulky:registry", env={"PYTHONPATH": f"{tmp_path}:{os.environ.get('PYTHONPATH', '')}"})
    wait_for(lambda: "front-end 1 (pid" in b.read_log(0.05), timeout=30)
    for _ in range(100):  # (a connection the first front-end took)
        before = tcp_sockets(b.pid)
        s = socket.create_connection((b.host, port), timeout=30)
        s.sendall(b'{"jsonrpc":"2.0","method":"spike","params":[0],"id":"probe"}\n')
        assert s.makefile("rb").readline()
        if tcp_sockets(b.pid) - before:
            break
        s.close()
    lines, want = [], {}
    for i in range(60):  # 2 MB results between calls of a fast method whose every 10th call blocks 30 ms
        for method, param in (("blob", 2_000_000), ("spike", 30 if i % 10 == 9 else 0)):
            want[len(want)] = "x" * param if method == "blob" else param
            lines.append(json.dumps({"jsonrpc": "2.0", "method": method, "params": [param], "id": len(want) - 1}))
    with s:
        s.sendall(("\n".join(lines) + "\n").encode())
        reader = s.makefile("rb")
        got = {}
        for _ in range(len(want)):
            answer_ = json.loads(reader.readline())
            got[answer_["id"]] = answer_.get("result", answer_.get("error"))
    assert got == want
    assert "bad frame" not in b.read_log(0.05) and "killing it as hung" not in b.read_log(0.05)


def test_a_scrape_waiting_for_its_round_at_the_stop_is_answered(broker_factory):
    # (hostile testing, round 130: it was closed unanswered)
    b = broker_factory("--workers", "1", "--frontends", "2")
    wait_for(lambda: "front-end 1 (pid" in b.read_log(0.05), timeout=30)
    [peer] = peers_of(b.pid)
    got: list[bytes] = []
    with connection_to(b.pid, b) as s:
        os.kill(peer, signal.SIGSTOP)  # (the round waits for it: COLLECT_SECONDS)
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        reader = threading.Thread(target=lambda: got.append(s.recv(100)))
        reader.start()
        time.sleep(0.2)
        os.kill(b.pid, signal.SIGTERM)
        reader.join(30)
    assert got and got[0].startswith(b"HTTP/1.1 200 "), got
    assert b.stop() == 0


def test_the_metrics_port_answers_through_the_other_front_ends_drain(broker_factory):
    """New user, round 114: with a metrics port, a scrape there in the drain waited on an empty
    body until the exit (no round made yet) and got no answer; and the listener closed as soon as
    the first front-end's own calls were done, while another's still ran: /readyz refused."""
    port = free_port()
    b = broker_factory("--workers", "2", "--frontends", "2", "--metrics-port", str(port))
    wait_for(lambda: "front-end 1 (pid" in b.read_log(0.05), timeout=30)
    [peer] = peers_of(b.pid)
    with connection_to(peer, b) as s:
        s.sendall(request("sleep", [3.0], "slow"))  # (in flight on the other front-end alone)
        time.sleep(0.3)
        os.kill(b.pid, signal.SIGTERM)
        time.sleep(1.0)  # (the first front-end has no call left: its own drain is over)
        conn = http.client.HTTPConnection(b.host, port, timeout=10)
        conn.request("GET", "/metrics")
        scraped = conn.getresponse()
        assert scraped.status == 200 and b"rpc_broker_calls_total" in scraped.read()
        conn.request("GET", "/readyz")
        ready = conn.getresponse()
        assert ready.status == 503 and b"stopping" in ready.read()
        conn.close()
        assert answer(s) == {"jsonrpc": "2.0", "id": "slow", "result": 3.0}
    assert b.proc.wait(60) == 0


def test_a_token_exempt_from_rate_limits_is_exempt_on_every_front_end(broker_factory, tmp_path):
    """New user, round 115: a token's `rate_limit = 0` (no limit) reached a peer as a Rate equal to,
    not the same object as, ratelimit.UNLIMITED: the peer gave it a bucket of rate 0, whose refusal
    divided by zero (HTTP 400 "callback error", an NDJSON connection closed unanswered)."""
    secret = "e" * 32
    path = tmp_path / "tokens.toml"
    path.write_text(f'[tokens.ci]\ntoken = "{secret}"\nrate_limit = 0\n')
    b = broker_factory("--workers", "1", "--frontends", "2", "--auth-tokens-file", str(path), "--rate-limit", "2",
                       env={"RPC_BROKER_AUTH_TOKENS": ""})
    wait_for(lambda: "front-end 1 (pid" in b.read_log(0.05), timeout=30)
    [peer] = peers_of(b.pid)
    wait_for(lambda: f"front-end 1 (pid {peer}) serving" in b.read_log(0.05), timeout=30)
    with landed_on(peer, b) as s:
        for i in range(30):
            body = json.dumps({"jsonrpc": "2.0", "method": "add", "params": [i, 1], "id": i}).encode()
            s.sendall(b"POST / HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nAuthorization:"
                      b" Bearer %s\r\nContent-Length: %d\r\n\r\n%s" % (secret.encode(), len(body), body))
            assert answer(s)["result"] == i + 1
    assert "Traceback" not in b.read_log(0.05)
