"""The demo's fault tools (`--app broker.demo:faults`, issue 11 item 1), served by a real
broker with real worker processes: each fails as its docstring says, the broker answers
that failure with the right code, and the calls after it are served."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest
from conftest import Broker, children, rss_kib, start_broker, wait_for

MIB = 1024 * 1024


@pytest.fixture(scope="module")
def faults() -> Iterator[Broker]:
    b = start_broker("--app", "broker.demo:faults", "--workers", "2", "--method-timeout", "hang=0.5",
                     "--cancel-grace", "0.5", "--max-response-bytes", str(1 * MIB))
    yield b
    b.stop()


def workers_of(b: Broker, count: int = 2) -> set[int]:
    """The worker processes' pids, once `count` of them are serving again."""
    wait_for(lambda: len(children(b.pid)) == count and _all_ready(b), timeout=30)
    return children(b.pid)


def _all_ready(b: Broker) -> bool:
    status, _body = b.get("/readyz")
    return status == 200


def test_the_default_app_has_no_fault_tools() -> None:
    from broker.demo import faults as fault_tools
    from broker.demo import registry

    names = {m.name for m in registry.methods()}
    assert names.isdisjoint({"crash", "hang", "slow", "huge_reply", "leak", "raise_error"})
    assert {m.name for m in fault_tools.methods()} == names | {"crash", "hang", "slow", "huge_reply", "leak",
                                                               "raise_error"}


def test_the_demo_tools_are_served_beside_the_faults(faults: Broker) -> None:
    assert faults.call("subtract", [42, 23]) == {"jsonrpc": "2.0", "id": 1, "result": 19}
    assert faults.call("slow", [0.01], id_="s") == {"jsonrpc": "2.0", "id": "s", "result": 0.01}


@pytest.mark.parametrize("how", ["exit", "kill"])
def test_crash_kills_its_worker_answers_worker_died_and_another_worker_serves(faults: Broker, how: str) -> None:
    before = workers_of(faults)
    answer = faults.call("crash", {"how": how}, id_=7)
    assert answer["id"] == 7 and answer["error"]["code"] == -32002, answer  # type: ignore[index]
    after = workers_of(faults)
    assert len(before - after) == 1  # (one worker replaced, the other untouched)
    assert faults.call("add", [2, 3]) == {"jsonrpc": "2.0", "id": 1, "result": 5}


def test_crash_with_another_how_is_invalid_params_and_kills_nothing(faults: Broker) -> None:
    before = workers_of(faults)
    answer = faults.call("crash", {"how": "abort"})
    assert answer["error"]["code"] == -32602  # type: ignore[index]
    assert answer["error"]["data"] == {"param": "how", "reason": 'must be "exit" or "kill"'}  # type: ignore[index]
    assert workers_of(faults) == before


def test_hang_times_out_and_its_worker_is_killed_as_hung(faults: Broker) -> None:
    before = workers_of(faults)
    began = time.monotonic()
    answer = faults.call("hang", id_="h")
    assert answer["id"] == "h" and answer["error"]["code"] == -32001, answer  # type: ignore[index]
    assert 0.4 < time.monotonic() - began < 10
    wait_for(lambda: len(before - children(faults.pid)) == 1, timeout=15)  # (killed 0.5 s after the deadline)
    assert "hung" in faults.read_log(0.5)
    workers_of(faults)
    assert faults.call("add", [1, 1])["result"] == 2


def test_huge_reply_gives_the_string_and_past_max_response_bytes_is_internal_error(faults: Broker) -> None:
    answer = faults.call("huge_reply", [1000])
    assert answer["result"] == "x" * 1000
    _status, _, body = faults.post(json.dumps({"jsonrpc": "2.0", "method": "huge_reply", "params": [2 * MIB], "id": 3}))
    refused = json.loads(body)
    assert refused["id"] == 3 and refused["error"]["code"] == -32603, refused
    assert faults.call("huge_reply", [-1])["error"]["code"] == -32602  # type: ignore[index]
    assert faults.call("huge_reply", [256 * MIB + 1])["error"]["code"] == -32602  # type: ignore[index]


def test_leak_keeps_resident_memory_in_its_worker(faults: Broker) -> None:
    first = faults.call("leak", [0])["result"]
    pid, held = first["pid"], first["held_bytes"]  # type: ignore[index]
    before = rss_kib(pid)
    grown = None
    for _ in range(20):  # (the calls go to either worker: until this one has grown by 64 MiB)
        result = faults.call("leak", [16 * MIB])["result"]
        if result["pid"] == pid:  # type: ignore[index]
            grown = result["held_bytes"]  # type: ignore[index]
            if grown - held >= 64 * MIB:
                break
    assert grown is not None and grown - held >= 64 * MIB
    assert rss_kib(pid) - before >= (grown - held) // 1024 * 9 // 10  # (resident, not only reserved)
    refused = faults.call("leak", [256 * MIB + 1])["error"]  # type: ignore[index]
    assert refused["code"] == -32602 and refused["data"]["param"] == "bytes", refused  # type: ignore[index]


def test_raise_error_answers_its_error_object_and_broker_codes_are_internal_error(faults: Broker) -> None:
    assert faults.call("raise_error", {"code": 4001, "message": "no such user", "data": {"user": 7}}) == {
        "jsonrpc": "2.0", "id": 1, "error": {"code": 4001, "message": "no such user", "data": {"user": 7}}}
    assert faults.call("raise_error", [-1, "bad"]) == {"jsonrpc": "2.0", "id": 1,
                                                        "error": {"code": -1, "message": "bad"}}
    kept = faults.call("raise_error", [-32001, "timed out"])["error"]  # type: ignore[index]
    assert kept["code"] == -32603, kept  # type: ignore[index]
