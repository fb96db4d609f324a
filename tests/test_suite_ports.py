"""BROKER_TEST_PORTS: the suite's listeners confined to a range of ports (tests/conftest.py).

New user, round 114: on a shared host where other services hold fixed ports, the suite bound
`--port 0` and random free ports anywhere; `make bench` had `--ports LOW-HIGH`, the tests nothing."""

from __future__ import annotations

import collections
import os
import random
import socket
import subprocess
import sys
import time

import pytest
from conftest import (
    MANY_TESTS_PORTS,
    MIN_WORKER_PORTS,
    ROOT,
    TEST_PORTS_ENV,
    free_port,
    listen_port,
    start_broker,
    test_ports,
    worker_slice,
)


def _free_range(width: int) -> range:
    """`width` consecutive loopback ports free now: below the ephemeral range (found by `free_port`),
    or within this process's BROKER_TEST_PORTS (under pytest-xdist, its worker's slice: each place
    of it tried, as ports lingering in TIME_WAIT may leave few)."""
    given = test_ports()
    ends = time.monotonic() + 65  # (a port lingers 60 s in TIME_WAIT: the whole slice may be spent a while)
    while True:
        lows = [free_port() for _ in range(50)] if given is None else \
            random.sample(range(given.start, given.stop - width + 1), len(given) - width + 1)
        for low in lows:
            ports = range(low, low + width)
            taken = []
            try:
                for port in ports:
                    s = socket.socket()
                    taken.append(s)
                    s.bind(("127.0.0.1", port))
            except OSError:
                continue
            finally:
                for s in taken:
                    s.close()
            return ports
        if time.monotonic() > ends:
            raise AssertionError("no free range")
        time.sleep(1)


def test_a_broker_and_the_tests_listeners_take_their_ports_from_the_range(monkeypatch):
    ports = _free_range(8)
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)  # (the whole range: not a worker's slice)
    monkeypatch.setenv(TEST_PORTS_ENV, f"{ports.start}-{ports.stop - 1}")
    assert test_ports() == ports
    assert {free_port() for _ in range(20)} <= set(ports)
    assert listen_port() in ports
    b = start_broker("--workers", "1", "--no-metrics")
    try:
        assert b.port in ports
        assert b.call("add", [1, 2])["result"] == 3
    finally:
        assert b.stop() == 0
    with socket.socket() as held:  # (a port of the range taken: never given)
        held.bind(("127.0.0.1", ports.start))
        held.listen()
        monkeypatch.setattr("conftest.MIN_WORKER_PORTS", 2)
        monkeypatch.setenv(TEST_PORTS_ENV, f"{ports.start}-{ports.start + 1}")
        assert {free_port() for _ in range(20)} == {ports.start + 1}


def test_unset_the_kernel_picks_and_a_malformed_range_is_a_usage_error(monkeypatch):
    monkeypatch.delenv(TEST_PORTS_ENV, raising=False)
    assert test_ports() is None and listen_port() == 0
    for bad in ("x", "5-1", "0-10", "65000-70000", "1000-1099,1050-1200", "1000-1099,x", "1000-1004"):
        monkeypatch.setenv(TEST_PORTS_ENV, bad)
        with pytest.raises(pytest.UsageError, match=TEST_PORTS_ENV):
            test_ports()


def test_each_xdist_worker_gets_its_own_slice_of_the_ranges(monkeypatch):
    monkeypatch.setenv(TEST_PORTS_ENV, "38450-38499, 38650-38699")
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "4")
    slices = []
    for index in range(4):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", f"gw{index}")
        slices.append(test_ports())
    assert slices == [range(38450, 38475), range(38475, 38500), range(38650, 38675), range(38675, 38700)]
    monkeypatch.delenv("PYTEST_XDIST_WORKER")  # (not a worker: both ranges, the first taken whole)
    assert test_ports() == range(38450, 38500)
    # 3 workers: a slice straddling the two ranges keeps its longer part; none shares a port
    three = [worker_slice([range(38450, 38500), range(38650, 38700)], index, 3) for index in range(3)]
    assert three == [range(38450, 38483), range(38483, 38500), range(38666, 38700)]
    assert all(len(ports) >= MIN_WORKER_PORTS for ports in three)
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "16")  # (100 ports: 6 a worker, too few)
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw15")
    with pytest.raises(pytest.UsageError, match="fewer workers"):
        test_ports()


def test_a_port_given_lately_is_given_again_only_when_no_other_is_free_the_latest_last(monkeypatch):
    ports = _free_range(4)
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    monkeypatch.setattr("conftest.MIN_WORKER_PORTS", 2)
    monkeypatch.setattr("conftest._GIVEN", collections.deque([ports[2], ports[3]], maxlen=16))
    monkeypatch.setenv(TEST_PORTS_ENV, f"{ports.start}-{ports.stop - 1}")
    assert {free_port() for _ in range(2)} == {ports[0], ports[1]}  # (not given lately: first)
    with socket.socket() as a, socket.socket() as b:  # (those two bound now: only given ones are free)
        a.bind(("127.0.0.1", ports[0]))
        b.bind(("127.0.0.1", ports[1]))
        assert [free_port() for _ in range(3)] == [ports[2], ports[3], ports[2]]  # (the oldest given first)


@pytest.mark.parametrize("jobs", [0, 2])
def test_a_run_of_many_tests_with_too_few_ports_a_process_stops_before_any_test(jobs):
    """New user, round 116: 25 ports a process ran out two thirds of the way through the
    suite (200 tests failed "no free port in ..."). A run of that many tests is stopped at
    once, status 4, saying why, in one process or under pytest-xdist (its controller); with
    enough ports a process it goes on (one process, collecting only: xdist does not collect
    so). Nothing listens: no test of theirs runs."""
    files = ["tests/test_codec.py", "tests/test_worker_sdk.py", "tests/test_worker_answers.py"]  # (over 400 tests)
    short = 2 * MANY_TESTS_PORTS - 2 if jobs else MANY_TESTS_PORTS - 1  # (one port short a process)
    for ports, status in ((short, 4),) if jobs else ((short, 4), (short + 1, 0)):
        env = {**os.environ, TEST_PORTS_ENV: f"20000-{20000 + ports - 1}"}
        env.pop("PYTEST_XDIST_WORKER", None)
        env.pop("PYTEST_XDIST_WORKER_COUNT", None)
        run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", str(jobs),
                              *(["--collect-only"] if not jobs else []), *files],
                             cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        said = run.stdout + run.stderr
        assert run.returncode == status, said[-2000:]
        assert (f"{TEST_PORTS_ENV}='20000-{20000 + ports - 1}' gives" in said) == bool(status), said[-2000:]
