"""Rate limits (issue 12, item 3): a token bucket per caller, a token's or a client
address's (broker/ratelimit.py), counting calls, not requests: past it a single call gets
-32005 with 429 and Retry-After, a batch's calls past it get -32005 and the rest run.
The buckets with time injected, then a real broker over loopback.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import typing
from pathlib import Path

import pytest
from conftest import ROOT, Broker, sample, scrape_metrics
from test_response_limits import http_request, read_http_response, recv_until

from broker import ratelimit
from broker.auth import ENV_TOKENS, AuthError, load_file
from broker.ratelimit import Bucket, Limiter, Rate, address_of

CI = "ci-token-0123456789abcdef-XYZ"
ALICE = "alice-token-0123456789abcdef"


class Clock:
    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.now = 100.0
        monkeypatch.setattr(ratelimit, "_clock", lambda: self.now)


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    return Clock(monkeypatch)


def test_a_bucket_gives_its_burst_then_refills_at_its_rate(clock):
    bucket = Bucket(Rate(2.0, 3))
    assert [bucket.take() for _ in range(4)] == [True, True, True, False]
    assert bucket.refused_total == 1 and bucket.retry_after() == 0.5
    clock.now += 0.25
    assert not bucket.take() and bucket.retry_after() == 0.25  # (half a call back: a quarter second more)
    tiny = Bucket(Rate(1e-310, 1))  # (hostile testing, round 115, L1: OverflowError, the answer lost)
    assert tiny.take() and not tiny.take() and tiny.retry_after() == ratelimit.MAX_WAIT_SECONDS
    clock.now += 0.25
    assert bucket.take() and not bucket.take()
    clock.now += 100  # (never more than its burst)
    assert [bucket.take() for _ in range(4)] == [True, True, True, False]
    assert bucket.refused_total == 4


def test_the_buckets_of_addresses_are_bounded_least_recently_used_first(clock, monkeypatch):
    monkeypatch.setattr(ratelimit, "MAX_ADDRESSES", 2)
    limiter = Limiter(Rate(1.0, 1), {"ci": Rate(5.0, 5)}, ["ci", "alice"])
    a = limiter.for_address("10.0.0.1")
    assert limiter.for_address("10.0.0.1") is a and a is not None
    assert a.take() and not a.take()
    limiter.for_address("10.0.0.2")
    assert limiter.for_address("10.0.0.1") is a  # (used last: kept)
    limiter.for_address("10.0.0.3")  # 10.0.0.2 goes
    assert limiter.for_address("10.0.0.1") is a
    limiter.for_address("10.0.0.4")  # 10.0.0.3 goes, then 10.0.0.1 (with its refusal, still counted)
    limiter.for_address("10.0.0.5")
    assert limiter.for_address("10.0.0.1") is not a
    ci, alice = limiter.for_token("ci"), limiter.for_token("alice")
    assert ci is not None and alice is not None and (ci.burst, alice.burst) == (5.0, 1.0)
    assert limiter.refused() == {"ci": 0, "alice": 0, "": 1}
    assert Limiter().for_address("10.0.0.1") is None and Limiter().for_token("ci") is None


@pytest.mark.parametrize(("peer", "address"), [
    (("127.0.0.1", 5000), "127.0.0.1"), (("::1", 5000, 0, 0), "::1"), ("", "unix"), (None, "unix"),
])
def test_a_callers_address_is_its_ip_whatever_its_port(peer, address):
    assert address_of(peer) == address


@pytest.mark.parametrize(("table", "rate", "problem"), [
    ("rate_limit = 2.5", Rate(2.5, 3), ""),
    ("rate_limit = 10\nrate_burst = 1", Rate(10.0, 1), ""),
    ("rate_limit = 0", ratelimit.UNLIMITED, ""),
    ("rate_limit = -1", None, r"rate_limit must be a number of calls a second, >= 0 \(0: no limit for this token\)"),
    ("rate_limit = 0\nrate_burst = 3", None, r"rate_burst with rate_limit 0 \(no limit for this token\): drop"),
    ('rate_limit = "5"', None, "rate_limit must be a number"),
    ("rate_limit = true", None, "rate_limit must be a number"),
    ("rate_limit = 5\nrate_burst = 0", None, "rate_burst must be a whole number of calls, >= 1"),
    ("rate_limit = 5\nrate_burst = 2.5", None, "rate_burst must be a whole number"),
    ("rate_burst = 5", None, "rate_burst without rate_limit: give the token's rate_limit too"),
])
def test_a_tokens_own_rate_is_read_from_its_table(tmp_path: Path, table, rate, problem):
    path = tmp_path / "tokens.toml"
    path.write_text(f'[tokens.ci]\ntoken = "{CI}"\n{table}\n')
    if problem:
        with pytest.raises(AuthError, match=problem):
            load_file(str(path))
    else:
        assert load_file(str(path))[0].rate == rate


# -- a real broker ---------------------------------------------------------------------


def post(b: Broker, payload: object, token: str | None = None,
         source: str = "127.0.0.1") -> tuple[int, typing.Any]:
    """POST `payload` from address `source` (a loopback one) on a connection of its own."""
    data = json.dumps(payload).encode()
    head = http_request(data)
    if token:
        head = head.replace(b"\r\n\r\n", f"\r\nAuthorization: Bearer {token}\r\n\r\n".encode(), 1)
    with socket.socket() as sock:
        sock.settimeout(30)
        sock.bind((source, 0))
        sock.connect((b.host, b.port))
        sock.sendall(head)
        status, body = read_http_response(sock, bytearray())
    return status, json.loads(body) if body else None


def call(method: str, params: object, id_: object) -> dict[str, object]:
    return {"jsonrpc": "2.0", "method": method, "params": params, "id": id_}


def test_calls_past_a_client_addresss_rate_are_refused_429_each_batch_element_counted(broker_factory):
    b = broker_factory("--workers", "1", "--rate-limit", "0.5", "--rate-burst", "4")
    assert [post(b, call("add", [1, i], i))[1]["result"] for i in range(3)] == [1, 2, 3]
    with socket.create_connection((b.host, b.port), timeout=30) as sock:
        sock.sendall(http_request(json.dumps(call("add", [2, 2], "x")).encode()))
        sock.sendall(http_request(json.dumps(call("add", [3, 3], "y")).encode()))
        buf = bytearray()
        assert read_http_response(sock, buf) == (200, b'{"jsonrpc":"2.0","id":"x","result":4}')
        status, raw = read_http_response(sock, buf)  # (the fifth call: its bucket is empty)
        assert (status, json.loads(raw)["error"]["code"]) == (429, -32005)
    status, answer = post(b, call("add", [1, 1], 9))
    assert status == 429
    assert answer["error"]["code"] == -32005 and answer["error"]["message"] == "Rate limited"
    assert 1.0 < answer["error"]["data"]["retry_after_seconds"] <= 2.0
    # Another address has its own bucket; a batch there: its first 4 calls run, the rest -32005
    status, answers = post(b, [call("add", [i, i], i) for i in range(6)] + [{"jsonrpc": "2.0", "method": "add",
                                                                               "params": [0, 0]}],
                              source="127.0.0.2")
    assert status == 200
    assert [a.get("result", a.get("error", {}).get("code")) for a in answers] == [0, 2, 4, 6, -32005, -32005]
    metrics = scrape_metrics(b)
    assert sample(metrics, "rpc_broker_rate_limited_total", token="") == 1 + 1 + 2 + 1  # (y, 9, two, the notification)
    # (the notification refused: its only trace, with the others dropped; new user, round 107)
    assert sample(metrics, "rpc_broker_notifications_dropped_total", reason="rate_limited") == 1
    # (under their method, the caller's to call: round 107, they were all "other")
    assert sample(metrics, "rpc_broker_calls_total", method="add", outcome="rate_limited") == 4
    assert sample(metrics, "rpc_broker_calls_total", method="other", outcome="rate_limited") == 0
    assert sample(metrics, "rpc_broker_http_responses_total", path="rpc", status="429") == 2


def test_the_429_carries_retry_after(broker_factory):
    b = broker_factory("--workers", "1", "--rate-limit", "1", "--rate-burst", "1")
    conn = b.connection()
    try:
        statuses = []
        for i in range(2):
            conn.request("POST", "/", body=json.dumps(call("add", [i, 1], i)), headers={"content-type": "application/json"})
            resp = conn.getresponse()
            resp.read()
            statuses.append((resp.status, resp.getheader("retry-after")))
    finally:
        conn.close()
    assert statuses == [(200, None), (429, "1")]


def test_a_429s_retry_after_is_its_buckets_wait_rounded_up(broker_factory):
    """Hostile testing, round 114, M2: Retry-After was always 1, whatever the rate: at 0.1
    calls a second, a client that waited as told was refused again, nine times."""
    b = broker_factory("--workers", "1", "--rate-limit", "0.1", "--rate-burst", "1")
    assert post(b, call("add", [1, 1], 1))[0] == 200
    conn = b.connection()
    try:
        conn.request("POST", "/", body=json.dumps(call("add", [1, 2], 2)), headers={"content-type": "application/json"})
        resp = conn.getresponse()
        answer = json.loads(resp.read())
    finally:
        conn.close()
    wait = answer["error"]["data"]["retry_after_seconds"]
    assert resp.status == 429 and 9.0 < wait <= 10.0
    assert resp.getheader("retry-after") == "10"


def test_each_token_has_its_own_bucket_and_its_own_rate(broker_factory, tmp_path: Path):
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(f'[tokens.ci]\ntoken = "{CI}"\nrate_limit = 1000\n\n[tokens.alice]\ntoken = "{ALICE}"\n')
    b = broker_factory("--workers", "1", "--auth-tokens-file", str(tokens), "--rate-limit", "0.1",
                       "--rate-burst", "2", env={ENV_TOKENS: ""})
    assert [post(b, call("add", [i, 0], i), ALICE)[0] for i in range(3)] == [200, 200, 429]
    assert [post(b, call("add", [i, 0], i), CI)[0] for i in range(20)] == [200] * 20
    assert post(b, call("add", [0, 0], 0), ALICE, source="127.0.0.3")[0] == 429  # (the token's, wherever from)
    metrics = scrape_metrics(b)
    assert sample(metrics, "rpc_broker_rate_limited_total", token="alice") == 2
    assert sample(metrics, "rpc_broker_rate_limited_total", token="ci") == 0


def test_a_tokens_rate_limit_0_exempts_it_from_the_global_rate(broker_factory, tmp_path: Path):
    """New user, round 106: a token could not be exempted (its rate_limit 0 was refused)."""
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(f'[tokens.ci]\ntoken = "{CI}"\nrate_limit = 0\n\n[tokens.alice]\ntoken = "{ALICE}"\n')
    b = broker_factory("--workers", "1", "--auth-tokens-file", str(tokens), "--rate-limit", "0.1",
                       "--rate-burst", "2", env={ENV_TOKENS: ""})
    assert [post(b, call("add", [i, 0], i), CI)[0] for i in range(30)] == [200] * 30
    assert [post(b, call("add", [i, 0], i), ALICE)[0] for i in range(3)] == [200, 200, 429]
    assert sample(scrape_metrics(b), "rpc_broker_rate_limited_total", token="alice") == 1
    tokens.write_text(f'[tokens.ci]\ntoken = "{CI}"\nrate_limit = 0\nrate_burst = 5\n')
    done = subprocess.run([sys.executable, "-m", "broker", "check-config", "--auth-tokens-file", str(tokens)],
                          cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={k: v for k, v in os.environ.items() if not k.startswith("RPC_BROKER_")})
    assert done.returncode == 2 and "rate_burst with rate_limit 0 (no limit for this token)" in done.stderr, \
        done.stderr


def test_without_a_rate_nothing_is_limited(broker_factory):
    b = broker_factory("--workers", "1")
    started = time.monotonic()
    statuses = {post(b, [call("add", [i, 0], i) for i in range(50)])[0] for _ in range(10)}
    assert statuses == {200} and time.monotonic() - started < 30
    assert sample(scrape_metrics(b), "rpc_broker_rate_limited_total", token="") == 0


def test_a_pipelined_429s_retry_after_is_its_own_wait_not_the_buckets_when_written(broker_factory):
    """Hostile testing, round 115, L2: a 429 pipelined behind a slow call took its
    Retry-After from its bucket when it was written, after another refusal had moved it
    (8, where its body said 10): it is now the refusal's own wait, rounded up."""
    b = broker_factory("--workers", "1", "--rate-limit", "0.1", "--rate-burst", "1", "--app", "broker.demo:faults")
    with socket.create_connection((b.host, b.port), timeout=30) as sock:
        sock.sendall(http_request(json.dumps(call("slow", [2.5], "slow")).encode()))  # (takes the call there is)
        time.sleep(0.2)
        sock.sendall(http_request(json.dumps(call("add", [1, 1], "limited")).encode()))  # refused now: 10 s
        time.sleep(1.2)
        assert post(b, call("add", [2, 2], "other"))[0] == 429  # (the bucket's wait moves: about 9 s)
        buf = bytearray()
        assert read_http_response(sock, buf)[0] == 200
        recv_until(sock, buf, lambda: b"\r\n\r\n" in buf)
        head = bytes(buf).partition(b"\r\n\r\n")[0]
        status, raw = read_http_response(sock, buf)
    wait = json.loads(raw)["error"]["data"]["retry_after_seconds"]
    assert status == 429 and 9.5 < wait <= 10.0
    assert b"\r\nretry-after: 10\r\n" in head + b"\r\n", head
