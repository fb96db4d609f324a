"""BROKER_TEST_PORTS: the suite's listeners confined to a range of ports (tests/conftest.py).

New user, round 114: on a shared host where other services hold fixed ports, the suite bound
`--port 0` and random free ports anywhere; `make bench` had `--ports LOW-HIGH`, the tests nothing."""

from __future__ import annotations

import socket

import pytest
from conftest import TEST_PORTS_ENV, free_port, listen_port, start_broker, test_ports


def _free_range(width: int) -> range:
    """`width` consecutive loopback ports free now, below the ephemeral range (found by `free_port`)."""
    for _ in range(50):
        low = free_port()
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
    raise AssertionError("no free range")


def test_a_broker_and_the_tests_listeners_take_their_ports_from_the_range(monkeypatch):
    ports = _free_range(8)
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
        monkeypatch.setenv(TEST_PORTS_ENV, f"{ports.start}-{ports.start + 1}")
        assert {free_port() for _ in range(20)} == {ports.start + 1}


def test_unset_the_kernel_picks_and_a_malformed_range_is_a_usage_error(monkeypatch):
    monkeypatch.delenv(TEST_PORTS_ENV, raising=False)
    assert test_ports() is None and listen_port() == 0
    for bad in ("x", "5-1", "0-10", "65000-70000"):
        monkeypatch.setenv(TEST_PORTS_ENV, bad)
        with pytest.raises(pytest.UsageError, match=TEST_PORTS_ENV):
            test_ports()
