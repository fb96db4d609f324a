"""A handler's answer is one valid JSON-RPC answer, and only the broker answers with
the broker's codes (attack B, findings 1, 6, 9 and 10): the real daemon, real worker
processes running tests/apps/answers.py.

- A `msgspec.Raw` in a result or in an RpcError's data is checked as JSON and made
  compact: never invalid JSON, a second answer, or a newline splitting an NDJSON line.
- An RpcError's code and message are read when the error object is built: a code that
  is not an integer, or one of the broker's (-32099..-32000), answers -32603.
- A handler that stops its worker's loop: the other calls in flight get -32002 (the
  worker died) from the broker, not a -32603 CancelledError from the dying worker.
- An async handler behind a decorator runs as an async one.
"""

from __future__ import annotations

import concurrent.futures
import json
import socket
from collections.abc import Iterator

import pytest
from conftest import Broker, sample, scrape_metrics, start_broker, wait_for

APP = "tests.apps.answers:registry"


@pytest.fixture(scope="module")
def answers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Broker, str]]:
    path = str(tmp_path_factory.mktemp("answers") / "stream.sock")
    b = start_broker("--workers", "1", "--app", APP, "--stream-socket", path,
                     "--max-frame-bytes", "65536", "--max-body-bytes", "32768", "--timeout", "20")
    yield b, path
    assert b.stop() == 0, b.read_log()


def post(b: Broker, body: object) -> tuple[int, bytes]:
    status, _, raw = b.post(json.dumps(body))
    return status, raw


def call(method: str, params: object, id_: object = 1) -> dict[str, object]:
    return {"jsonrpc": "2.0", "method": method, "params": params, "id": id_}


INVALID = [
    "}{",
    "",
    '1},{"jsonrpc":"2.0","id":99,"result":"forged"',  # a forged batch element
    '"a"}\n{"jsonrpc":"2.0","id":7,"result":"forged"',  # a forged NDJSON line
]


@pytest.mark.parametrize(("method", "text"), [
    (method, text) for method in ("raw", "async_raw", "raw_nested") for text in INVALID
    # (nested in [{"v": ...}], the forged element makes a valid array: one JSON value)
    if (method, text) != ("raw_nested", INVALID[2])
])
def test_a_raw_result_that_is_not_json_answers_internal_error(answers: tuple[Broker, str], method: str, text: str) -> None:
    b, _ = answers
    params: list[object] = [text, True] if method == "raw_nested" else [text]
    status, body = post(b, [call(method.removesuffix("_nested"), params, 1), call("pid", [], 2)])
    replies = json.loads(body)  # one valid JSON value, whatever the Raw held
    assert status == 200 and [r["id"] for r in replies] == [1, 2], body
    error = replies[0]["error"]
    assert error["code"] == -32603 and "not valid JSON" in error["data"]["reason"], error
    assert isinstance(replies[1]["result"], int)


PRETTY = '{\n  "a" : 1.000e+05,\n  "b" : [ 1 , 123456789012345678901234567890 ],\n  "s" : "x  y\\n"\n}'
COMPACT = b'{"a":1.000e+05,"b":[1,123456789012345678901234567890],"s":"x  y\\n"}'


@pytest.mark.parametrize("method", ["raw", "async_raw"])
def test_a_valid_raw_result_is_made_compact_with_numbers_and_strings_kept(answers: tuple[Broker, str], method: str) -> None:
    b, _ = answers
    status, body = post(b, call(method, [PRETTY], 5))
    assert status == 200 and body == b'{"jsonrpc":"2.0","id":5,"result":' + COMPACT + b"}", body
    status, body = post(b, call("raw", [PRETTY, True], 6))
    assert body == b'{"jsonrpc":"2.0","id":6,"result":{"inner":[{"v":' + COMPACT + b"}]}}", body


def test_a_raw_result_with_invalid_utf8_answers_internal_error(answers: tuple[Broker, str]) -> None:
    b, _ = answers
    status, body = post(b, call("raw_bytes", ["22ff22"]))
    error = json.loads(body)["error"]
    assert status == 200 and error["code"] == -32603 and "UTF-8" in error["data"]["reason"], body


def test_on_the_stream_each_call_gets_one_line(answers: tuple[Broker, str]) -> None:
    _, path = answers
    lines = [
        call("raw", [INVALID[3]], 7),
        call("raw", [PRETTY], 8),
        call("raw_error_data", ['{\n"bad'], 9),
        call("raw_error_data", ['{\n "ok" : [1 ,2]\n}'], 10),
    ]
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(20)
        s.connect(path)
        s.sendall(b"".join(json.dumps(x).encode() + b"\n" for x in lines))
        data = b""
        while data.count(b"\n") < len(lines):
            chunk = s.recv(65536)
            assert chunk, data
            data += chunk
        s.settimeout(0.3)  # nothing more may come: no forged or split line
        try:
            extra = s.recv(65536)
        except TimeoutError:
            extra = b""
    assert extra == b"", data + extra
    replies = {r["id"]: r for r in map(json.loads, data.splitlines())}
    assert sorted(replies) == [7, 8, 9, 10], data
    assert replies[7]["error"]["code"] == -32603
    assert b'{"jsonrpc":"2.0","id":8,"result":' + COMPACT + b"}" in data.splitlines()
    assert replies[9]["error"]["code"] == -32603 and "data is not valid JSON" in replies[9]["error"]["data"]["reason"]
    assert replies[10]["error"] == {"code": 1001, "message": "with raw data", "data": {"ok": [1, 2]}}


@pytest.mark.parametrize(("what", "code", "message"), [
    ("code_str", -32603, "Internal error"),
    ("code_none", -32603, "Internal error"),
    ("code_raw", -32603, "Internal error"),
    ("code_bool", -32603, "Internal error"),
    ("message_int", 1001, "123"),
    ("unchanged", 1001, "made fine"),
])
def test_an_rpc_error_changed_after_it_was_made_is_read_when_answered(
    answers: tuple[Broker, str], what: str, code: int, message: str
) -> None:
    b, _ = answers
    status, body = post(b, call("mutated_error", [what]))
    reply = json.loads(body)
    assert status == 200 and set(reply) == {"jsonrpc", "id", "error"}, body
    assert (reply["error"]["code"], reply["error"]["message"]) == (code, message), body
    if code == -32603:
        assert "not an integer" in reply["error"]["data"]["reason"], body


@pytest.mark.parametrize("code", [1.5, "5", True, -32000.5, "abc"])
def test_an_rpc_error_made_with_a_code_that_is_not_an_integer_answers_internal_error(
    answers: tuple[Broker, str], code: object
) -> None:
    """Hostile testing (round 9): RpcError(1.5, ...) answered code 1, "5" code 5, True 1
    (the constructor took int() of it), "abc" a ValueError; docs/tools.md promises -32603
    saying the code is not an integer."""
    b, _ = answers
    status, body = post(b, call("made_with_code", [code]))
    error = json.loads(body)["error"]
    assert (status, error["code"]) == (200, -32603), body
    assert "not an integer" in error["data"]["reason"], body


@pytest.mark.parametrize("code", [10**30, 2**64 - 1, -(2**63) - 1, 2**53])
def test_an_rpc_error_code_past_the_interoperable_integers_answers_internal_error(
    answers: tuple[Broker, str], code: int
) -> None:
    """Hostile testing (round 10): RpcError(10**30) was sent as is; a Go or Rust client
    reading codes as 64-bit integers fails on it, JavaScript rounds it. Past
    +-(2**53 - 1) (I-JSON, RFC 7493 2.2): -32603 saying so."""
    b, _ = answers
    status, body = post(b, call("made_with_code", [code]))
    error = json.loads(body)["error"]
    assert (status, error["code"]) == (200, -32603), body
    assert "RFC 7493" in error["data"]["reason"], body
    assert json.loads(post(b, call("made_with_code", [2**53 - 1]))[1])["error"]["code"] == 2**53 - 1


def test_an_rpc_error_code_set_after_it_was_made_is_read_as_the_constructor_reads_it(answers: tuple[Broker, str]) -> None:
    """Round 10: numpy's int64 given to RpcError() was taken, set on it afterwards refused."""
    b, _ = answers
    assert json.loads(post(b, call("code_set_after", ["numpy"]))[1])["error"] == {"code": 5, "message": "set after"}
    error = json.loads(post(b, call("code_set_after", ["huge"]))[1])["error"]
    assert error["code"] == -32603 and "RFC 7493" in error["data"]["reason"]


@pytest.mark.parametrize("code", [-32000, -32001, -32002, -32003, -32004, -32099, -32700, -32600])
def test_a_tools_rpc_error_with_a_broker_code_is_not_taken_for_the_brokers(answers: tuple[Broker, str], code: int) -> None:
    b, _ = answers
    before = scrape_metrics(b)
    status, body = post(b, call("broker_code", [code]))
    error = json.loads(body)["error"]
    assert status == 200, body  # not the 503/504/502 of the broker's own error (round 34: nor -32700's 400)
    assert error["code"] == -32603 and error["data"]["code"] == code and "reserved" in error["data"]["reason"], body
    after = scrape_metrics(b)
    assert sample(after, "rpc_broker_timeouts_total", method="broker_code") == 0
    assert sample(after, "rpc_broker_errors_total", code=str(code)) == sample(before, "rpc_broker_errors_total", code=str(code))
    assert (sample(after, "rpc_broker_calls_total", method="broker_code", outcome="internal_error")
            == sample(before, "rpc_broker_calls_total", method="broker_code", outcome="internal_error") + 1)


def test_a_tools_code_outside_the_brokers_range_is_kept(answers: tuple[Broker, str]) -> None:
    b, _ = answers
    for code in (-32100, -31999, 1001):
        status, body = post(b, call("broker_code", [code]))
        assert status == 200 and json.loads(body)["error"] == {
            "code": code, "message": "the tool's own message", "data": {"mine": True}}, body


def test_an_rpc_error_past_max_frame_bytes_is_called_an_error_object(answers: tuple[Broker, str]) -> None:
    b, _ = answers
    status, body = post(b, [call("big_error", [70_000], 1), call("big_error", [10], 2)])
    replies = {r["id"]: r for r in json.loads(body)}
    assert status == 200
    assert replies[1]["error"]["code"] == -32603 and replies[1]["error"]["data"].startswith("error object of "), body
    assert replies[2]["error"] == {"code": 1001, "message": "big", "data": "x" * 10}


@pytest.mark.parametrize("killer", ["stop_loop", "exit_later"])
def test_calls_in_flight_on_a_worker_whose_loop_a_handler_stops_get_worker_died(broker_factory, killer: str) -> None:
    b = broker_factory("--workers", "1", "--app", APP, "--timeout", "30")
    worker = b.call("pid")["result"]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        naps = [pool.submit(b.call, "nap", [20], i) for i in range(3)]
        batch = pool.submit(post, b, [call("nap", [20], i) for i in range(3, 6)])  # (one CHUNK)
        wait_for(lambda: sample(scrape_metrics(b), "rpc_broker_calls_in_flight") == 6, timeout=10)
        b.call(killer, id_="killer")  # answered or not: the worker goes down
        replies = [nap.result(timeout=25) for nap in naps] + json.loads(batch.result(timeout=25)[1])
        assert sorted(r["id"] for r in replies) == list(range(6)), replies
        for reply in replies:
            assert reply["error"]["code"] == -32002, reply
            assert reply["error"]["data"]["pid"] == worker and "exited" in reply["error"]["data"]["status"], reply
    wait_for(lambda: isinstance(b.call("pid").get("result"), int) and b.call("pid")["result"] != worker, timeout=20)


@pytest.mark.parametrize("method", ["wrapped_nap", "returns_coroutine"])
def test_an_async_handler_behind_a_decorator_runs_as_async(answers: tuple[Broker, str], method: str) -> None:
    b, _ = answers
    status, body = post(b, [call(method, [0.01], i) for i in range(3)])
    assert status == 200 and sorted((r["id"], r.get("result")) for r in json.loads(body)) == [
        (0, 0.01), (1, 0.01), (2, 0.01)], body
    log = b.read_log()
    assert "never awaited" not in log, log
