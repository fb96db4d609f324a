"""The chaos benchmark (`benchmarks/chaos.py`, issue 11 item 3): a short run in the suite, and its
recording client's verdicts on answers that are duplicated, wrong or missing.

The short run: 15 s of load over HTTP and NDJSON while workers are SIGKILLed and SIGSTOPped, the
broker is sent SIGHUP twice in a row, `crash` and `hang` are called and connections are dropped
mid-request; nothing may be lost, duplicated or wrong. No timing is asserted.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import typing
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from chaos import KINDS, failures_of, schedule  # noqa: E402
from chaos_client import BodyMaker, Fates, HttpConnection, Ledger, StreamConnection  # noqa: E402
from conftest import children, descendants, stopped_with_its_processes, wait_for  # noqa: E402

from broker.loadgen.target import Target  # noqa: E402

SEED = 20261206


@pytest.mark.timeout(240)
def test_a_short_chaos_run_loses_duplicates_and_garbles_nothing() -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "chaos.py"), "--seconds", "15",
                           "--seed", str(SEED), "--json"], cwd=ROOT, capture_output=True, timeout=220)
    assert proc.returncode in (0, 1), proc.stderr.decode()[-3000:]
    r = json.loads(proc.stdout)
    problems = {k: r[k] for k in ("lost", "duplicated", "wrong")}
    assert problems == {"lost": 0, "duplicated": 0, "wrong": 0}, (problems, r["examples"], r["event_log"])
    assert r["broker_exit"] == 0, proc.stderr.decode()[-3000:]
    assert r["broker_log_problems"] == [], r["broker_log_problems"]
    assert all(r["events"][kind] >= 1 for kind in KINDS), r["events"]
    assert r["sent"] >= 500 and r["sent_http"] > 0 and r["sent_ndjson"] > 0 and r["batches"] > 0, r
    assert r["answered_once"] >= 0.9 * r["sent"], r
    assert r["answered_once"] + r["dropped"] == r["sent"]
    # the crash and hang calls were answered as such: worker died, timed out
    assert r["errors_by_code"].get("-32002", 0) >= 1 and r["errors_by_code"].get("-32001", 0) >= 1, r
    assert proc.returncode == 0


def test_the_schedule_is_the_seeds_and_has_every_kind() -> None:
    for seed in range(50):
        events = schedule(seed, 15, 1.0)
        assert events == schedule(seed, 15, 1.0)
        assert {kind for _, kind in events} == set(KINDS)
        assert all(0 < t < 15 for t, _ in events)
        assert [t for t, _ in events] == sorted(t for t, _ in events)


def _judge(kind: str, answer: Callable[[list[bytes], list[bytes]], bytes]) -> tuple[Ledger, Fates]:
    """Send three calls on a connection of `kind` ("http" or "ndjson") over a socketpair, let the
    other end send `answer(ids, results)` (the calls' raw ids, their right results as JSON), and
    return the ledger and its summary."""

    async def go() -> tuple[Ledger, Fates]:
        loop = asyncio.get_running_loop()
        ledger = Ledger()
        maker = BodyMaker(ledger, random.Random(1), batch_share=0, slow_share=0, notification_share=0)
        ours, theirs = socket.socketpair()
        conn: HttpConnection | StreamConnection
        if kind == "http":
            conn = HttpConnection(ledger, Target.parse("http://127.0.0.1:1/"))
        else:
            conn = StreamConnection(ledger)
        await loop.create_unix_connection(lambda: conn, sock=ours)
        bodies = [maker.body() for _ in range(3)]
        for body, calls in bodies:
            conn.send(body, calls)
        theirs.sendall(answer([body.keys[0] for body, _ in bodies],
                              [json.dumps(calls[0][2]).encode() for _, calls in bodies]))
        await asyncio.sleep(0.2)
        conn.close()
        theirs.close()
        return ledger, ledger.summary()

    return asyncio.run(go())


def _line(key: bytes, result: bytes) -> bytes:
    return b'{"jsonrpc":"2.0","id":%s,"result":%s}\n' % (key, result)


def _response(body: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)


def test_the_recording_client_counts_duplicates_wrong_answers_and_lost_calls_on_a_stream() -> None:
    # the first call answered twice (not "exactly once"), the second with another result (once,
    # wrongly), an id never sent (wrong); the third never answered (lost)
    ledger, fates = _judge("ndjson", lambda ids, results: (
        _line(ids[0], results[0]) + _line(ids[0], results[0]) + _line(ids[1], b'"no"') + _line(b"999999", b"1")))
    assert (fates["answered_once"], fates["duplicated_calls"], fates["duplicated"], fates["wrong"],
            fates["lost"]) == (1, 1, 1, 2, 1), (fates, dict(ledger.examples))


def test_the_recording_client_checks_each_http_answer_against_its_own_request() -> None:
    # the first request answered with the second's id (wrong, and the first call stays unanswered:
    # lost), the second answered right, the third with an error code not the broker's (wrong)
    ledger, fates = _judge("http", lambda ids, results: (
        _response(_line(ids[1], results[1])) + _response(_line(ids[1], results[1]))
        + _response(b'{"jsonrpc":"2.0","id":%s,"error":{"code":-32602,"message":"Invalid params"}}' % ids[2])))
    assert (fates["wrong"], fates["results_ok"], fates["lost"]) == (2, 1, 1), (fates, dict(ledger.examples))


def test_chaos_sent_sigterm_stops_its_broker(tmp_path: Path) -> None:
    """Hostile testing, round 112: SIGTERM to chaos.py left its broker and workers serving; it
    now stops them first (the broker and its 2 workers: 3 under it). Round 113: with SIGTERM,
    not SIGKILL, so that the broker removes its workers' socket directory (in TMPDIR)."""
    stopped = stopped_with_its_processes([sys.executable, str(ROOT / "benchmarks" / "chaos.py"), "--seconds", "60",
                                          "--seed", "1"], 3, env={"TMPDIR": str(tmp_path)})
    assert not stopped.left, stopped.left
    # (new user, round 105: a KeyboardInterrupt traceback, exit 130)
    assert stopped.status == 143 and "Traceback" not in stopped.stderr, stopped.stderr
    assert "chaos: interrupted by SIGTERM; what it started is stopped" in stopped.stderr
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("rpc-broker-")] == []
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("rb-chaos-")]  # (its log, kept)


def chaos(*flags: str, env: dict[str, str] | None = None,
          during: Callable[[subprocess.Popen[bytes]], None] | None = None) -> tuple[int, dict[str, typing.Any], str]:
    """Run chaos.py --json with `flags` (`during`: called once its broker and 2 workers run);
    (its exit status, its report, its stderr)."""
    proc = subprocess.Popen([sys.executable, str(ROOT / "benchmarks" / "chaos.py"), "--json", *flags], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, **(env or {})})
    try:
        if during is not None:
            wait_for(lambda: len(descendants(proc.pid)) >= 3, timeout=60, interval=0.2)
            during(proc)
        out, err = proc.communicate(timeout=200)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    return proc.returncode, json.loads(out), err.decode()


FATES = {"lost": 0, "duplicated": 0, "wrong": 0, "results_ok": 93, "answered_once": 100}


@pytest.mark.parametrize(("fates", "status", "died", "problems", "failures"), [
    ({}, 0, None, 0, []),
    ({"results_ok": 50}, 0, None, 0, []),  # (half: the floor, met)
    ({"results_ok": 49}, 0, None, 0, ["49 of 100 calls answered got a result, under 50%: the broker refused most"
                                      " calls, not only those the chaos took"]),
    ({"lost": 2, "wrong": 1}, 0, None, 0, ["2 calls lost", "1 calls wrong"]),
    ({}, -9, -9, 0, ["the broker exited during the run, with status -9"]),
    ({}, 1, None, 0, ["the broker stopped with status 1"]),
    ({}, None, None, 0, ["the broker did not stop within its wait (SIGKILLed)"]),
    ({}, 0, None, 3, ["3 problem lines in the broker's log (tracebacks, loop errors)"]),
])
def test_the_verdict_fails_a_run_for_each_reason_and_says_which(fates, status, died, problems, failures) -> None:
    """Hostile testing, round 113: a run whose broker refused 99 % of its calls -32000 passed
    (any broker error was an expected one, and the results were not counted)."""
    assert failures_of({**FATES, **fates}, status, died, problems) == failures


@pytest.mark.timeout(240)
def test_the_environments_broker_settings_are_not_taken() -> None:
    """Hostile testing, round 113: RPC_BROKER_MAX_QUEUE=0 in the caller's shell was taken by
    the run's broker, silently: 29,921 of 30,580 answers -32000."""
    status, r, err = chaos("--seconds", "3", "--seed", "4", env={"RPC_BROKER_MAX_QUEUE": "0"})
    assert "chaos: ignoring RPC_BROKER_MAX_QUEUE (the run's broker takes its own settings only)" in err
    assert r["errors_by_code"].get("-32000", 0) <= 0.05 * r["answered_once"], r["errors_by_code"]
    assert status == 0 and r["ok"] and r["failures"] == [], r["failures"]


@pytest.mark.timeout(240)
def test_a_run_whose_broker_dies_ends_with_a_verdict() -> None:
    """Hostile testing, round 113: a broker SIGKILLed mid-run ended chaos.py in a traceback."""
    def kill_broker(proc: subprocess.Popen[bytes]) -> None:
        [broker] = children(proc.pid)
        time.sleep(1.0)
        os.kill(broker, signal.SIGKILL)

    status, r, err = chaos("--seconds", "6", "--seed", "3", during=kill_broker)
    assert status == 1 and "Traceback" not in err, err[-2000:]
    assert "the broker exited during the run, with status -9" in r["failures"], r["failures"]
    assert r["broker_exit"] == -9
