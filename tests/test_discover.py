"""`rpc.discover` (issue 13, item 4): the OpenRPC 1.3.2 document of the workers' methods,
answered by the broker itself (broker/catalog.py, broker/replies.py `_discover`).

On real brokers with real workers, over HTTP, an NDJSON stream and stdio, alone and in batches,
the document validated against the OpenRPC meta-schema (tests/data/openrpc/, draft 07, as the
specification says); under the method policy per token; after a reload that changed only a
title. In memory (the dispatcher core, as tests/test_dispatch_core.py drives it): before any
HELLO, held to max_response_bytes, its params, its metrics and access-log lines.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import typing
from pathlib import Path

import jsonschema
import pytest
import referencing
import referencing.jsonschema
import test_dispatch_core
from conftest import TESTDATA, Broker, sample, scrape_metrics, wait_for
from test_dispatch import body, req
from test_dispatch_core import one_worker
from test_stdio import ends_cleanly, stdio_broker  # noqa: F401  (a fixture)

from broker.accesslog import AccessLog
from broker.answers import ResponseBudget
from broker.auth import ENV_TOKENS
from broker.catalog import DISCOVER
from broker.dispatch import Dispatcher
from broker.jsonrpc import Codec, ErrorCode
from broker.metrics import CallMetrics
from broker.policy import MethodRule, Policy
from broker.ratelimit import Bucket, Rate
from broker.wire import MethodInfo

clock = test_dispatch_core.clock  # (the fixture: time injected)

APP = "tests.apps.toolbox:registry"
TOOLBOX = ["greet", "grow", "leaves", "midpoint", "ns.total", "raw", DISCOVER, "tally"]
DEMO = ["add", "echo", "fib", "get_data", "notify_hello", DISCOVER, "sleep", "subtract", "sum", "update",
        "worker_info"]
STREAM_PORTS = iter(range(38621, 38640))  # (this suite's share of the ports: 38620-38639)
CI = "ci-token-0123456789abcdef-XYZ"
ALICE = "alice-token-0123456789abcdef"


def meta_schema() -> jsonschema.Draft7Validator:
    """The OpenRPC 1.3 meta-schema's validator, the JSON Schema meta-schema it refers to
    (https://meta.json-schema.tools) served from tests/data, not the network."""
    here = TESTDATA / "openrpc"
    tools = referencing.jsonschema.DRAFT7.create_resource(json.loads((here / "json-schema-tools.json").read_text()))
    registry: referencing.Registry[typing.Any] = referencing.Registry().with_resources(
        [("https://meta.json-schema.tools", tools), ("https://meta.json-schema.tools/", tools)])
    return jsonschema.Draft7Validator(json.loads((here / "schema.json").read_text()), registry=registry)


def discover(b: Broker, id_: object = 1, token: str | None = None) -> dict[str, typing.Any]:
    headers = {"authorization": f"Bearer {token}"} if token else {}
    status, _, answer = b.post(json.dumps({"jsonrpc": "2.0", "method": DISCOVER, "id": id_}), headers=headers)
    assert status == 200, answer
    return typing.cast(dict[str, typing.Any], json.loads(answer))


def method_names(document: dict[str, typing.Any]) -> list[str]:
    return [m["name"] for m in document["methods"]]


# -- real brokers, real workers ---------------------------------------------------------------


@pytest.mark.parametrize(("app", "names"), [(APP, TOOLBOX), (None, DEMO)])
def test_rpc_discover_over_http_answers_a_document_the_openrpc_meta_schema_validates(broker_factory, app, names):
    b = broker_factory("--workers", "2", *(("--app", app) if app else ()))
    answer = discover(b)
    document = answer["result"]
    validator = meta_schema()
    validator.validate(document)
    assert document["openrpc"] == "1.3.2" and document["info"]["title"] == "rpc-broker"
    assert method_names(document) == names
    broken = json.loads(json.dumps(document))  # (and the validator does refuse what is not OpenRPC)
    broken["methods"][0]["paramStructure"] = "sideways"
    assert not validator.is_valid(broken)
    broken["methods"][0]["paramStructure"] = "either"
    broken["methods"][0]["params"] = [{"name": "x", "schema": {"type": 5}}]
    assert not validator.is_valid(broken)
    if app == APP:
        methods = {m["name"]: m for m in document["methods"]}
        assert methods["greet"]["summary"] == "Greet" and methods["greet"]["paramStructure"] == "by-name"
        assert methods["leaves"]["params"] == [{"name": "tree", "schema": {"$ref": "#/components/schemas/Tree"},
                                                "required": True}]
        assert b.call("leaves", {"tree": {"label": "r", "children": [{"label": "a"}]}})["result"] == ["a"]
    samples = scrape_metrics(b)
    assert sample(samples, "rpc_broker_calls_total", method=DISCOVER, outcome="ok") == 1
    assert sample(samples, "rpc_broker_calls_total", method="other", outcome="method_not_found") == 0


def test_rpc_discover_over_an_ndjson_stream_and_in_batches(broker_factory):
    port = next(STREAM_PORTS)
    b = broker_factory("--workers", "2", "--app", APP, "--stream-port", str(port))
    over_http = discover(b, id_="h")["result"]
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        stream = sock.makefile("rwb")
        batch = [{"jsonrpc": "2.0", "method": DISCOVER, "id": 1},
                 {"jsonrpc": "2.0", "method": "greet", "params": {"name": "Ada"}, "id": 2},
                 {"jsonrpc": "2.0", "method": DISCOVER},  # (a notification: no answer)
                 {"jsonrpc": "2.0", "method": DISCOVER, "params": [], "id": 3},
                 {"jsonrpc": "2.0", "method": DISCOVER, "params": {"verbose": True}, "id": 4}]
        stream.write(json.dumps({"jsonrpc": "2.0", "method": DISCOVER, "id": "s"}).encode() + b"\n")
        stream.write(json.dumps(batch).encode() + b"\n")
        stream.flush()
        single = json.loads(stream.readline())
        answers = json.loads(stream.readline())
    assert single == {"jsonrpc": "2.0", "id": "s", "result": over_http}
    assert [a["id"] for a in answers] == [1, 2, 3, 4]
    assert answers[0]["result"] == answers[2]["result"] == over_http and answers[1]["result"] == "Hello, Ada!"
    assert answers[3]["error"] == {"code": -32602, "message": "Invalid params",
                                   "data": {"param": None, "reason": "rpc.discover takes no params"}}
    samples = scrape_metrics(b)
    assert sample(samples, "rpc_broker_calls_total", method=DISCOVER, outcome="ok") == 4
    assert sample(samples, "rpc_broker_calls_total", method=DISCOVER, outcome="invalid_params") == 1
    assert sample(samples, "rpc_broker_notifications_total", method=DISCOVER) == 1


def test_rpc_discover_over_stdio(stdio_broker):  # noqa: F811
    b = stdio_broker("--workers", "1", "--app", APP)
    b.send({"jsonrpc": "2.0", "method": DISCOVER, "id": "stdio"})
    answer = b.answer(60)
    assert answer["id"] == "stdio" and method_names(answer["result"]) == TOOLBOX
    meta_schema().validate(answer["result"])
    ends_cleanly(b)


def test_a_caller_s_document_lists_only_what_it_may_call_and_the_lists_may_deny_rpc_discover(broker_factory,
                                                                                           tmp_path: Path):
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(f'[tokens.ci]\ntoken = "{CI}"\nallow_methods = ["greet", "mid*", "rpc.discover"]\n\n'
                      f'[tokens.alice]\ntoken = "{ALICE}"\ndeny_methods = ["rpc.*"]\n')
    b = broker_factory("--workers", "1", "--app", APP, "--auth-tokens-file", str(tokens), "--deny-methods", "raw",
                       env={ENV_TOKENS: ""})
    assert method_names(discover(b, token=CI)["result"]) == ["greet", "midpoint", DISCOVER]
    assert discover(b, token=ALICE)["error"] == {"code": -32601, "message": "Method not found"}
    status, _, _ = b.post(json.dumps({"jsonrpc": "2.0", "method": DISCOVER, "id": 1}))
    assert status == 401  # (authenticated as any call)
    log = b.read_log()
    assert "matches no method" not in log  # ("rpc.discover" and "rpc.*" match the broker's own)


def test_a_reload_that_changes_only_a_title_changes_the_document(broker_factory, tmp_path: Path):
    title = tmp_path / "title"
    title.write_text("Greet v1")
    b = broker_factory("--workers", "2", "--app", APP, env={"TOOLBOX_TITLE_FILE": str(title)})
    before = discover(b)["result"]
    assert next(m for m in before["methods"] if m["name"] == "greet")["summary"] == "Greet v1"
    title.write_text("Greet v2")
    os.kill(b.pid, signal.SIGHUP)
    wait_for(lambda: sample(scrape_metrics(b), "rpc_broker_reloads_total", result="success") == 1, timeout=60)
    after = discover(b)["result"]
    assert next(m for m in after["methods"] if m["name"] == "greet")["summary"] == "Greet v2"
    assert method_names(after) == method_names(before)


# -- the dispatcher in memory -----------------------------------------------------------------


def answered(d: Dispatcher, payload: object, budget: ResponseBudget | None = None) -> list[typing.Any]:
    """The answers the dispatcher makes at once for `payload` (one Response object, or a batch's)."""
    exchange = d.submit(body(Codec(), payload), lambda _: None, budget)
    assert exchange is not None and exchange.remaining == 0
    return typing.cast(list[typing.Any], json.loads(exchange.body()) if exchange.batch else [json.loads(exchange.body())])


def test_before_any_hello_the_document_lists_rpc_discover_alone(clock):
    d = Dispatcher(clock.loop)
    [answer] = answered(d, req(DISCOVER, [], 7))
    assert answer["id"] == 7 and method_names(answer["result"]) == [DISCOVER]
    meta_schema().validate(answer["result"])


def test_each_method_table_replaces_the_catalogue_even_when_only_a_title_changed(clock):
    d, _w, _codec, _done = one_worker(clock.loop, ["greet"])
    first = d.catalog
    assert first.tools() == []  # (names alone: no tool)
    d.set_methods(["greet"], methods=[MethodInfo("greet", tool=True, title="One", input_schema={"type": "object"})])
    d.set_methods(["greet"], methods=[MethodInfo("greet", tool=True, title="Two", input_schema={"type": "object"})])
    assert d.catalog is not first and d.catalog.tools() == [{"name": "greet", "title": "Two",
                                                             "inputSchema": {"type": "object"}}]
    [answer] = answered(d, req(DISCOVER, {}, 1))
    assert answer["result"]["methods"][0]["summary"] == "Two"


@pytest.mark.parametrize(("params", "ok"), [
    (None, True), ("[]", True), ("{}", True), (" [ \t\r\n] ", True), ("[1]", False), ('{"a": 1}', False),
    ("[[]]", False),
])
def test_rpc_discover_takes_no_params(clock, params, ok):
    d, _w, _codec, _done = one_worker(clock.loop, ["a"])
    given = "" if params is None else f', "params": {params}'
    text = f'{{"jsonrpc": "2.0", "method": "{DISCOVER}", "id": 1{given}}}'
    exchange = d.submit(Codec().decode(text.encode()), lambda _: None)
    assert exchange is not None and exchange.remaining == 0
    answer = json.loads(exchange.body())
    assert ("result" in answer) is ok and (ok or answer["error"]["code"] == ErrorCode.INVALID_PARAMS)


def test_a_document_past_max_response_bytes_is_answered_internal_error_as_a_large_result_is(clock):
    metrics = CallMetrics()
    d, _w, _codec, _done = one_worker(clock.loop, [f"method_{i}" for i in range(40)], metrics=metrics,
                                      max_response_bytes=2000)
    [refused] = answered(d, req(DISCOVER, [], 1))
    assert refused["error"] == {"code": -32603, "message": "Internal error",
                                "data": "responses owed on this connection exceed max_response_bytes 2000"}
    assert d.oversize_total == 1 and metrics.outcomes[metrics.discover] == {ErrorCode.INTERNAL_ERROR: 1}
    d.set_methods(["a"])
    [served] = answered(d, req(DISCOVER, [], 2))
    assert method_names(served["result"]) == ["a", DISCOVER]


def test_rpc_discover_is_counted_and_logged_under_its_own_name_rate_limited_too(clock, monkeypatch):
    monkeypatch.setattr("broker.ratelimit._clock", lambda: 50.0)  # (no refill)
    metrics = CallMetrics()
    entries: list[tuple[object, ...]] = []
    d, _w, _codec, _done = one_worker(clock.loop, ["a"], metrics=metrics,
                                      access_log=AccessLog("all", entries.append, clock=lambda: 1.5))
    budget = ResponseBudget(d.outgoing)
    budget.bucket = Bucket(Rate(0.5, 2))
    answers = answered(d, [req(DISCOVER, [], 1), req(DISCOVER, [1], 2), {"jsonrpc": "2.0", "method": DISCOVER},
                           req(DISCOVER, [], 3), req("nope", [], 4)], budget)
    assert [a["id"] for a in answers] == [1, 2, 3, 4]
    assert "result" in answers[0] and answers[1]["error"]["code"] == ErrorCode.INVALID_PARAMS
    assert answers[2]["error"]["code"] == answers[3]["error"]["code"] == ErrorCode.RATE_LIMITED
    assert metrics.outcomes[metrics.discover] == {0: 1, ErrorCode.INVALID_PARAMS: 1, ErrorCode.RATE_LIMITED: 1}
    assert metrics.outcomes[metrics.other] == {ErrorCode.RATE_LIMITED: 1}
    assert metrics.names[metrics.discover] == DISCOVER and metrics.names[metrics.other] == "other"
    assert [(e[4], e[7]) for e in entries] == [(DISCOVER, 0), (DISCOVER, ErrorCode.INVALID_PARAMS),
                                              (DISCOVER, ErrorCode.RATE_LIMITED), ("other", ErrorCode.RATE_LIMITED)]


def test_the_policy_hides_denied_methods_from_the_document_and_may_deny_rpc_discover_itself(clock):
    for rule, names in ((MethodRule(deny=("b",)), ["a", DISCOVER]), (MethodRule(("b", "rpc.*")), ["b", DISCOVER]),
                        (MethodRule(("a", "b")), None), (MethodRule(deny=(DISCOVER,)), None)):
        d, _w, _codec, _done = one_worker(clock.loop, ["a", "b"], policy=Policy(rule))
        [answer] = answered(d, req(DISCOVER, [], 1))
        if names is None:
            assert answer["error"] == {"code": -32601, "message": "Method not found"}, rule
        else:
            assert method_names(answer["result"]) == names, rule
