"""Method policy (issue 12, item 2): allow_methods and deny_methods, global and per token
(broker/policy.py), checked per call (a batch cannot smuggle one past), a denied call
answered exactly as a call to a method that does not exist, on a real broker over loopback
(the Dispatcher's check in memory: tests/test_dispatch_core_routing.py).
"""

from __future__ import annotations

import json
import os
import socket
import time
import typing
from pathlib import Path

import pytest
from conftest import Broker, sample, scrape_metrics
from test_response_limits import http_request, read_http_response

from broker import cli
from broker.auth import ENV_TOKENS
from broker.policy import MethodRule, Policy

ALICE = "alice-token-0123456789abcdef"
CI = "ci-token-0123456789abcdef-XYZ"
NOT_FOUND = {"code": -32601, "message": "Method not found"}


# -- broker/policy.py ------------------------------------------------------------------


@pytest.mark.parametrize(("rule", "served"), [
    (MethodRule(), {"add", "sum", "notes.get", "notes.put", "fib"}),
    (MethodRule(("notes.*",)), {"notes.get", "notes.put"}),
    (MethodRule(deny=("notes.*", "fib")), {"add", "sum"}),
    (MethodRule(("notes.*", "add"), ("notes.put",)), {"notes.get", "add"}),
    (MethodRule(("[as]*",)), {"add", "sum"}),
    (MethodRule(("Add",)), set()),  # (case-sensitive, as method names are)
    (MethodRule(("?dd",)), {"add"}),
])
def test_a_rule_serves_what_an_allow_pattern_matches_and_no_deny_pattern_does(rule, served):
    names = ["add", "sum", "notes.get", "notes.put", "fib"]
    assert {n for n in names if rule.allows(n)} == served


def test_install_makes_each_callers_denied_set_in_place_and_warns_of_patterns_matching_nothing():
    policy = Policy(MethodRule(deny=("fib", "slep")), {"ci": MethodRule(("add", "sum"))}, ["ci", "alice"])
    anyone, ci, alice = policy.denied[""], policy.denied["ci"], policy.denied["alice"]
    assert alice is anyone  # (no rule of its own: the global set itself)
    warnings = policy.install(["add", "sum", "sleep", "fib"])
    assert (anyone, ci) == ({"fib"}, {"fib", "sleep"})
    assert warnings == ["allow_methods/deny_methods: 'slep' matches no method the workers registered"
                        " (did you mean 'sleep'?)"]
    policy.install(["add", "fib2", "echo"])  # (a reload: the same sets, changed)
    assert policy.denied[""] is anyone and policy.denied["ci"] is ci
    assert (anyone, ci) == (set(), {"fib2", "echo"})


# -- a real broker ---------------------------------------------------------------------


def call(b: Broker, method: str, params: object, token: str | None = None) -> dict[str, typing.Any]:
    headers = {"authorization": f"Bearer {token}"} if token else {}
    _status, _, raw = b.post(json.dumps({"jsonrpc": "2.0", "method": method, "params": params, "id": 7}),
                             headers=headers)
    return json.loads(raw)


def test_global_lists_deny_per_call_as_if_absent_and_warn_of_a_pattern_matching_nothing(broker_factory):
    b = broker_factory("--workers", "1", "--allow-methods", "add,sum,fib,echo", "--deny-methods", "fib,slep")
    absent = call(b, "nonexistent", [])
    assert absent == {"jsonrpc": "2.0", "id": 7, "error": NOT_FOUND}
    assert call(b, "fib", [10]) == absent  # denied
    assert call(b, "sleep", [0]) == absent  # not allowed
    assert call(b, "add", [2, 3])["result"] == 5
    _status, _, raw = b.post(json.dumps([
        {"jsonrpc": "2.0", "method": "add", "params": [1, 1], "id": 1},
        {"jsonrpc": "2.0", "method": "fib", "params": [30], "id": 2},
        {"jsonrpc": "2.0", "method": "sum", "params": [1, 2, 3], "id": 3},
        {"jsonrpc": "2.0", "method": "get_data", "id": 4},
    ]))
    assert json.loads(raw) == [
        {"jsonrpc": "2.0", "id": 1, "result": 2}, {"jsonrpc": "2.0", "id": 2, "error": NOT_FOUND},
        {"jsonrpc": "2.0", "id": 3, "result": 6}, {"jsonrpc": "2.0", "id": 4, "error": NOT_FOUND},
    ]
    assert "WARNING allow_methods/deny_methods: 'slep' matches no method the workers registered" \
           " (did you mean 'sleep'?)" in b.read_log()
    metrics = scrape_metrics(b)  # (denied calls counted as unknown methods: under `other`)
    assert sample(metrics, "rpc_broker_calls_total", method="fib", outcome="ok") == 0
    assert sample(metrics, "rpc_broker_calls_total", method="other", outcome="method_not_found") == 5


def test_a_tokens_own_lists_hold_for_it_alone_even_pipelined_with_another_tokens_calls(broker_factory, tmp_path: Path):
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(f'[tokens.ci]\ntoken = "{CI}"\nallow_methods = ["add", "slow*"]\n\n'
                      f'[tokens.alice]\ntoken = "{ALICE}"\n')
    b = broker_factory("--workers", "1", "--auth-tokens-file", str(tokens), "--deny-methods", "fib",
                       "--max-response-bytes", "65536", env={ENV_TOKENS: ""})
    assert call(b, "add", [2, 3], CI)["result"] == 5
    assert call(b, "sum", [2, 3], CI)["error"] == NOT_FOUND
    assert call(b, "sum", [2, 3], ALICE)["result"] == 5
    assert call(b, "fib", [5], ALICE)["error"] == NOT_FOUND  # (the global list holds for every token)
    assert "WARNING the allow_methods/deny_methods of token 'ci': 'slow*' matches no method" in b.read_log()
    # One connection, pipelined: a slow call of alice's, a 60 KB echo and 404s owed behind it
    # (max_response_bytes reached), then ci's and alice's calls, which wait to be dispatched
    # (`Deferred`), each then under its own token's lists
    def post(method: str, params: object, token: str, id_: int) -> bytes:
        data = json.dumps({"jsonrpc": "2.0", "method": method, "params": params, "id": id_}).encode()
        return http_request(data).replace(b"\r\n\r\n", f"\r\nAuthorization: Bearer {token}\r\n\r\n".encode(), 1)

    with socket.create_connection((b.host, b.port), timeout=30) as sock:
        sock.sendall(post("sleep", [0.5], ALICE, 1) + post("echo", ["x" * 60_000], ALICE, 5))
        time.sleep(0.2)
        sock.sendall(b"GET /nope HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n" * 60)
        time.sleep(0.1)
        assert sample(scrape_metrics(b), "rpc_broker_outgoing_bytes") >= 65536  # (what makes the next wait)
        sock.sendall(post("sum", [1, 2], CI, 2) + post("sum", [3, 4], ALICE, 3) + post("add", [5, 6], CI, 4))
        buf = bytearray()
        first = [json.loads(read_http_response(sock, buf)[1]) for _ in range(2)]
        assert [read_http_response(sock, buf)[0] for _ in range(60)] == [404] * 60
        answers = [json.loads(read_http_response(sock, buf)[1]) for _ in range(3)]
    assert [a["id"] for a in first] == [1, 5] and first[1]["result"] == ["x" * 60_000]
    assert answers == [
        {"jsonrpc": "2.0", "id": 2, "error": NOT_FOUND},
        {"jsonrpc": "2.0", "id": 3, "result": 7}, {"jsonrpc": "2.0", "id": 4, "result": 11},
    ]


@pytest.mark.parametrize(("text", "problem"), [
    ('deny_methods = ["a b"]', "deny_methods"),
    ('allow_methods = ["x\\u00e9"]', "allow_methods"),
])
def test_a_pattern_that_is_not_a_glob_of_method_names_is_refused(tmp_path, capsys, monkeypatch, text, problem):
    for var in [v for v in os.environ if v.startswith("RPC_BROKER_")]:
        monkeypatch.delenv(var)
    path = tmp_path / "b.toml"
    path.write_text(text + "\n")
    assert cli.main(["check-config", str(path)]) == 2
    assert f"config error: config file {path}: {problem}" in capsys.readouterr().err


def test_a_token_files_pattern_that_is_not_a_glob_is_refused(tmp_path, capsys, monkeypatch):
    for var in [v for v in os.environ if v.startswith("RPC_BROKER_")]:
        monkeypatch.delenv(var)
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(f'[tokens.ci]\ntoken = "{CI}"\ndeny_methods = ["a b"]\n')
    config = tmp_path / "b.toml"
    config.write_text(f'auth_tokens_file = "{tokens}"\n')
    assert cli.main(["check-config", str(config)]) == 2
    assert "[tokens.ci]: deny_methods: 'a b' is not a glob of method names" in capsys.readouterr().err


def test_without_tokens_or_lists_every_method_is_served(broker_factory):
    b = broker_factory("--workers", "1")
    assert call(b, "fib", [10])["result"] == 55
