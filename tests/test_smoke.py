"""First end-to-end checks: the daemon starts, answers, takes its settings, stops cleanly."""

import json
import os
import signal
import threading
import time

from conftest import wait_for

from broker.server import SAME_STOP_S


def test_call_and_clean_stop(broker_factory):
    b = broker_factory("--workers", "1")
    assert b.call("subtract", [42, 23]) == {"jsonrpc": "2.0", "id": 1, "result": 19}
    assert b.get("/healthz")[0] == 200
    assert b.stop() == 0
    assert "stopped" in b.read_log()


def test_serve_layers_file_env_and_flags(broker_factory, tmp_path):
    """The real daemon takes its settings from file < environment < flags."""
    cfg = tmp_path / "broker.toml"
    cfg.write_text('rpc_path = "/rpc"\nworkers = 1\nmax_batch = 50\n\n[method_timeouts]\nsleep = 0.3\n')
    b = broker_factory("--config", str(cfg), "--workers", "2", env={"RPC_BROKER_MAX_BATCH": "2",
                                                                      "RPC_BROKER_EVENT_LOOP": "asyncio"})
    assert b.path == "/rpc"
    assert "with 2 workers (app broker.demo:registry, event loop asyncio, pid" in b.read_log()  # (round 53, LOW)
    ok = b"".join([b'[{"jsonrpc":"2.0","method":"add","params":[1,2],"id":1},',
                   b'{"jsonrpc":"2.0","method":"add","params":[3,4],"id":2}]'])
    status, _, body = b.post(ok)
    assert (status, body) == (200, b'[{"jsonrpc":"2.0","id":1,"result":3},{"jsonrpc":"2.0","id":2,"result":7}]')
    status, _, body = b.post(b"[" + b",".join([b'{"jsonrpc":"2.0","method":"add","params":[1,2],"id":1}'] * 3) + b"]")
    assert status == 400
    assert b"max_batch 2" in body
    reply = b.call("sleep", [2])
    assert reply["error"]["code"] == -32001
    assert reply["error"]["data"] == {"timeout_seconds": 0.3}


def test_hung_worker_is_killed_and_replaced(broker_factory):
    """A sync handler stuck past its deadline + cancel_grace gets its worker killed."""
    b = broker_factory("--workers", "1", "--app", "tests.apps.stuck:registry",
                       "--timeout", "0.3", "--cancel-grace", "0.5")
    first = b.call("pid")["result"]
    reply = b.call("spin", [60])
    assert reply["error"]["code"] == -32001
    wait_for(lambda: "killing it as hung" in b.read_log(0.1), timeout=20)
    wait_for(lambda: b.call("pid").get("result") not in (None, first), timeout=20)


def test_one_at_a_time_calls_spread_over_idle_workers(broker):
    """Ties in least-outstanding routing go round-robin, not always to worker 0."""
    pids = [broker.call("worker_info")["result"]["pid"] for _ in range(4)]
    assert len(set(pids)) == 2, pids


def test_a_hung_worker_is_killed_once_and_its_calls_say_why(broker_factory):
    """Two cancelled calls stuck on one worker: one kill, one log line; a call still in
    flight behind them gets -32002 whose status names the hang. (--sync-prefetch 100:
    by default the pid call would wait in the broker instead, not behind the spins.)"""
    b = broker_factory("--workers", "1", "--app", "tests.apps.stuck:registry", "--sync-prefetch", "100",
                       "--timeout", "0.3", "--cancel-grace", "0.5", "--method-timeout", "pid=30")
    first = b.call("pid")["result"]
    batch = [{"jsonrpc": "2.0", "method": "spin", "params": [60], "id": 1},
             {"jsonrpc": "2.0", "method": "spin", "params": [60], "id": 2},
             {"jsonrpc": "2.0", "method": "pid", "id": 3}]
    _, _, body = b.post(json.dumps(batch), timeout=30)
    replies = json.loads(body)
    assert [r["error"]["code"] for r in replies] == [-32001, -32001, -32002], replies
    assert replies[2]["error"]["data"] == {
        "pid": first, "status": "killed by SIGKILL (hung: no answer 0.5 s after a cancelled call)"}
    wait_for(lambda: b.call("pid").get("result") not in (None, first), timeout=20)
    assert b.read_log().count("killing it as hung") == 1


def test_a_second_sigterm_cuts_the_grace_period_short(broker_factory):
    b = broker_factory("--workers", "1", "--grace-period", "60")
    reply: dict[str, object] = {}
    t = threading.Thread(target=lambda: reply.update(b.call("sleep", [30], timeout=60)))
    t.start()
    wait_for(lambda: b.call("add", [1, 2]).get("result") == 3, timeout=10)
    os.kill(b.pid, signal.SIGTERM)
    wait_for(lambda: "stopping" in b.read_log(0.05), timeout=10)
    time.sleep(SAME_STOP_S + 0.1)  # (one sooner is the same stop: a process-group kill under make)
    start = time.monotonic()
    os.kill(b.pid, signal.SIGTERM)
    assert b.proc.wait(20) == 0
    t.join(20)
    assert time.monotonic() - start < 10
    assert reply["error"]["code"] == -32004, reply
