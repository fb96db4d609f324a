"""The dispatcher core in memory, told to an access log (broker/accesslog.py): which answers
make a line, with what method, id, code, duration, worker pid and params; with
access_log "errors" a result makes none. The set-up is test_dispatch_core.py's (time injected)."""

from __future__ import annotations

import json
import typing

import pytest
from test_dispatch import body, req
from test_dispatch_core import Clock, chunk_answers, one_worker

from broker import wire
from broker.accesslog import (
    PARAMS_CHARS,
    REDACT_VALUES,
    REDACTED,
    AccessLine,
    AccessLog,
    _params_text,
    address,
    entry_lines,
    redact,
)
from broker.answers import ResponseBudget
from broker.jsonrpc import ErrorCode
from broker.metrics import CallMetrics
from broker.ratelimit import Bucket, Rate
from broker.wire import ERROR, RESULT

NO = b'{"code":-32602,"message":"no"}'


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> typing.Iterator[Clock]:
    c = Clock(monkeypatch)
    yield c
    c.loop.close()


def setup(clock: Clock, mode: str, log_params: bool = False, **settings: typing.Any):
    """A dispatcher serving "m" and "n" on one worker (pid 4242), its access log in `mode`: the
    lines it made, as (method, id, code, pid, duration, params) each."""
    lines: list[AccessLine] = []
    access = AccessLog(mode, lambda entry: lines.extend(entry_lines(entry)), log_params=log_params, clock=lambda: 1.5)
    d, w, codec, done = one_worker(clock.loop, ["m", "n"], access_log=access, **settings)
    w.pid = 4242
    return d, w, codec, done, lines


def told(lines: list[AccessLine]) -> list[tuple[object, ...]]:
    return [(x.method, x.id.decode(), x.code, x.pid, round(x.duration, 6), x.params) for x in lines]


def test_errors_mode_makes_no_line_for_a_result_and_one_for_an_error(clock):
    d, w, codec, done, lines = setup(clock, "errors", metrics=CallMetrics())
    assert d.access is not None and d.access_ok is None
    d.submit(body(codec, req("m", [1], 1)), done.append)
    d.submit(body(codec, req("n", [2], "two")), done.append)
    first, second = w.channel.take()
    clock.advance(0.25)
    d.on_reply(w, wire.Kind.RESULT, first[1], 10, b"1")
    d.on_reply(w, wire.Kind.ERROR, second[1], 10, NO)
    assert told(lines) == [("n", '"two"', -32602, 4242, 0.25, None)]
    assert lines[0].when == 1.5 and lines[0].transport == "http" and lines[0].token == ""


def test_all_mode_makes_a_line_for_a_result_with_code_0_and_with_no_metrics(clock):
    d, w, codec, done, lines = setup(clock, "all")
    assert d.metrics is None and d.access_ok is d.access
    d.submit(body(codec, req("m", [1], 1)), done.append)
    [frame] = w.channel.take()
    clock.advance(0.5)
    d.on_reply(w, wire.Kind.RESULT, frame[1], 10, b"1")
    assert told(lines) == [("m", "1", 0, 4242, 0.5, None)]


def test_a_chunks_results_are_a_line_each_in_all_mode_and_its_errors_in_both(clock):
    for mode, expected in (("all", [("m", "1", -32602, 4242, 0.0, None), ("m", "0", 0, 4242, 0.0, None),
                                    ("n", "2", 0, 4242, 0.0, None)]),
                           ("errors", [("m", "1", -32602, 4242, 0.0, None)])):
        d, w, codec, done, lines = setup(clock, mode)
        d.submit(body(codec, [req("m", [0], 0), req("m", [1], 1), req("n", [2], 2)]), done.append)
        [frame] = w.channel.take()
        assert frame[0] == wire.Kind.CHUNK
        d.on_reply(w, wire.Kind.CHUNK_REPLY, frame[1], 0, chunk_answers((0, RESULT, b"0"), (1, ERROR, NO),
                                                                         (2, RESULT, b"2")))
        assert told(lines) == expected, mode


def test_a_chunk_all_results_is_one_entry_and_a_part_then_the_rest_a_line_each_once(clock, monkeypatch):
    import broker.replies

    read_again = broker.replies.results_of
    monkeypatch.setattr(broker.replies, "results_of", None)  # (every call a result: the payload not read again)
    entries: list[tuple[object, ...]] = []
    access = AccessLog("all", entries.append, clock=lambda: 1.5)
    d, w, codec, done = one_worker(clock.loop, ["m", "n"], access_log=access)
    long_id = "i" * 80
    d.submit(body(codec, [req("m", [0], 0), req("n", [1], long_id), req("m", [2], 2)]), done.append)
    [frame] = w.channel.take()
    assert frame[0] == wire.Kind.CHUNK
    d.on_reply(w, wire.Kind.CHUNK_REPLY, frame[1], 0, chunk_answers(*((i, RESULT, b"0") for i in range(3))))
    [entry] = entries
    assert entry[4] == ["m", "n", "m"] and entry[5] == [b"0", b'"' + b"i" * 64, b"2"] and entry[7] == 0
    assert [(x.method, x.id, x.truncated) for x in entry_lines(entry)] == [  # type: ignore[arg-type]
        ("m", b"0", False), ("n", b'"' + b"i" * 63, True), ("m", b"2", False)]
    entries.clear()
    monkeypatch.setattr(broker.replies, "results_of", read_again)
    d.submit(body(codec, [req("m", [0], 0), req("n", [1], 1), req("m", [2], 2)]), done.append)
    [frame] = w.channel.take()
    d.on_reply(w, wire.Kind.CHUNK_PART, frame[1], 0, chunk_answers((1, RESULT, b"1")))
    d.on_reply(w, wire.Kind.CHUNK_REPLY, frame[1], 0, chunk_answers((0, RESULT, b"0"), (1, RESULT, b"1"),
                                                                     (2, RESULT, b"2")))
    assert [[(x.method, x.id) for x in entry_lines(e)] for e in entries] == [  # type: ignore[arg-type]
        [("n", b"1")], [("m", b"0"), ("m", b"2")]]


def test_a_chunk_failed_whole_or_past_its_budget_is_a_line_per_call(clock):
    d, w, codec, done, lines = setup(clock, "errors")
    d.submit(body(codec, [req("m", [], i) for i in range(3)]), done.append)
    [frame] = w.channel.take()
    d.on_reply(w, wire.Kind.ERROR, frame[1], 0, b'{"code":-32603,"message":"boom"}')
    assert [(x.id, x.code) for x in lines] == [(b"0", -32603), (b"1", -32603), (b"2", -32603)]
    size = len(b'{"jsonrpc":"2.0","id":0,"result":0}')
    d, w, codec, done, lines = setup(clock, "errors", max_response_bytes=3 * size - 1)
    d.submit(body(codec, [req("m", [], i) for i in range(3)]), done.append)
    [frame] = w.channel.take()
    d.on_reply(w, wire.Kind.CHUNK_REPLY, frame[1], 0, chunk_answers(*((i, RESULT, b"0") for i in range(3))))
    assert [(x.id, x.code) for x in lines] == [(b"2", ErrorCode.INTERNAL_ERROR)]


def test_a_chunk_failed_whole_past_its_budget_is_a_line_per_call_with_its_method_and_duration(clock):
    big = b'{"code":7,"message":"' + b"b" * 40 + b'"}'
    one = len(b'{"jsonrpc":"2.0","id":0,"error":' + big + b"}")
    d, w, codec, done, lines = setup(clock, "errors", max_response_bytes=one + 10)
    d.submit(body(codec, [req("m", [], 0), req("n", [], 1), req("m", [], 2)]), done.append)
    [frame] = w.channel.take()
    clock.advance(0.5)
    d.on_reply(w, wire.Kind.ERROR, frame[1], 0, big)  # (the first fits; the others' -32603 in its place)
    assert told(lines) == [("m", "0", 7, 4242, 0.5, None), ("n", "1", ErrorCode.INTERNAL_ERROR, 4242, 0.5, None),
                           ("m", "2", ErrorCode.INTERNAL_ERROR, 4242, 0.5, None)]  # fmt: skip


def test_a_timeout_says_the_worker_it_ran_on_and_one_in_the_queue_none(clock):
    d, w, codec, done, lines = setup(clock, "errors", timeout=1.0)
    w.concurrency = w.limit = 1
    d.submit(body(codec, req("m", [], "run")), done.append)
    d.submit(body(codec, req("n", [], "wait")), done.append)
    clock.advance(1.05)
    assert sorted(told(lines)) == [("m", '"run"', -32001, 4242, 1.05, None), ("n", '"wait"', -32001, 0, 1.05, None)]


def test_a_shed_call_and_one_answered_by_the_drain_are_lines(clock):
    d, w, codec, done, lines = setup(clock, "errors", max_queue=0)
    w.concurrency = w.limit = 1
    d.submit(body(codec, req("m", [], 1)), done.append)
    d.submit(body(codec, req("m", [], 2)), done.append)  # (not to a busy worker: refused)
    assert told(lines) == [("m", "2", ErrorCode.OVERLOADED, 0, 0.0, None)]


def test_requests_answered_before_they_are_calls_are_lines_with_a_bounded_method(clock):
    d, _w, codec, done, lines = setup(clock, "errors")
    budget = ResponseBudget(d.outgoing)
    budget.peer, budget.caller, budget.transport = ("10.0.0.1", 5), "alice", "tcp"
    d.submit(body(codec, [req("x\nforged", [], "u"), {"bad": 1}, req("m", [], 1), req("m", [], 2),
                          req("m", [], 3)]), done.append, budget)
    assert told(lines)[:2] == [("other", '"u"', -32601, 0, 0.0, None), ("other", "null", -32600, 0, 0.0, None)]
    assert {(x.client, x.token, x.transport) for x in lines} == {("10.0.0.1:5", "alice", "tcp")}
    lines.clear()
    budget.bucket = Bucket(Rate(0.001, 1))
    d.submit(body(codec, [req("m", [], 7), req("n", [], 8), {"jsonrpc": "2.0", "method": "m"}]), done.append, budget)
    assert told(lines) == [("n", "8", ErrorCode.RATE_LIMITED, 0, 0.0, None)]  # (no line for the notification)


def test_answers_to_a_connection_gone_are_lines_as_the_worker_answered(clock):
    d, w, codec, done, lines = setup(clock, "all")
    gone = ResponseBudget(d.outgoing)
    d.submit(body(codec, req("m", [], 1)), done.append, gone)
    d.submit(body(codec, req("n", [], 2)), done.append, gone)
    first, second = w.channel.take()
    gone.lost()
    clock.advance(0.5)
    d.on_reply(w, wire.Kind.RESULT, first[1], 0, b"1")
    d.on_reply(w, wire.Kind.ERROR, second[1], 0, NO)
    assert [(x.method, x.code, x.duration) for x in lines] == [("m", 0, 0.5), ("n", -32602, 0.5)]


def test_a_large_result_kept_as_owed_first_is_a_line_and_one_refused_too(clock):
    d, w, codec, done, lines = setup(clock, "all", max_response_bytes=60)
    budget = ResponseBudget(d.outgoing)
    first_exchange = d.submit(body(codec, req("m", [], 1)), done.append, budget)
    d.submit(body(codec, req("m", [], 2)), done.append, budget)
    d.submit(body(codec, req("m", [], 3)), done.append, budget)
    budget.owed = [first_exchange]  # (HTTP: the first answer the connection owes)
    first, second, third = w.channel.take()
    clock.advance(0.25)
    d.on_reply(w, wire.Kind.RESULT, second[1], 0, b'"' + b"y" * 10 + b'"')  # (fits: on the hot path)
    d.on_reply(w, wire.Kind.RESULT, third[1], 0, b'"' + b"z" * 20 + b'"')  # (past the budget: refused)
    d.on_reply(w, wire.Kind.RESULT, first[1], 0, b'"' + b"x" * 20 + b'"')  # (owed first: kept, `_large_result`)
    assert [(x.id, x.code, x.duration) for x in lines] == [
        (b"2", 0, 0.25), (b"3", ErrorCode.INTERNAL_ERROR, 0.25), (b"1", 0, 0.25)]


def test_log_params_keeps_a_sent_calls_params_and_a_chunks_each(clock):
    d, w, codec, done, lines = setup(clock, "all", log_params=True)
    d.submit(body(codec, req("m", {"password": "p", "a": 1}, 1)), done.append)
    d.submit(body(codec, [req("n", [i], i) for i in range(3)]), done.append)
    single, chunk = w.channel.take()
    d.on_reply(w, wire.Kind.RESULT, single[1], 0, b"1")
    d.on_reply(w, wire.Kind.CHUNK_REPLY, chunk[1], 0, chunk_answers(*((i, RESULT, b"0") for i in range(3))))
    assert [x.params for x in lines] == [b'{"password": "p", "a": 1}', b"[0]", b"[1]", b"[2]"]
    assert json.loads(lines[0].render("json"))["params"] == '{"password":"[redacted]","a":1}'


def test_a_chunks_params_are_read_in_one_pass_of_its_payload(clock, monkeypatch: pytest.MonkeyPatch):
    """Hostile testing, round 121: each result's params were read from the payload's start,
    a chunk's lines costing its size squared (61 ms a chunk of 500). One pass now: the real
    `read_call` counted, once a call, and each line its own params."""
    from broker import accesslog

    reads = [0]
    real = accesslog.read_call

    def counted(payload: typing.Any, pos: int) -> typing.Any:
        reads[0] += 1
        return real(payload, pos)

    monkeypatch.setattr(accesslog, "read_call", counted)
    d, w, codec, done, lines = setup(clock, "all", log_params=True)
    d.submit(body(codec, [req("n", [i], i) for i in range(40)]), done.append)
    (chunk,) = w.channel.take()
    d.on_reply(w, wire.Kind.CHUNK_REPLY, chunk[1], 0, chunk_answers(*((i, RESULT, b"0") for i in range(40))))
    assert [x.params for x in lines] == [f"[{i}]".encode() for i in range(40)]
    assert reads[0] == 40


def test_a_line_renders_every_field_escaped_in_text_and_in_json():
    line = AccessLine(0.0, "[::1]:80", "", "http", "m", b'"a\nb"', True, 0.25, -32001, 7, None)
    text = line.render("text")
    assert text == ('time=1970-01-01T00:00:00.000Z client=[::1]:80 token=- transport=http method=m '
                    'id="\\"a\\nb\\"..." duration=0.250000 outcome=timed_out code=-32001 pid=7')
    assert "\n" not in text
    assert json.loads(AccessLine(0.0, "unix", "ci", "unix", "m", b"1", False, 0.0, 0, 0, b"{}").render("json")) == {
        "time": "1970-01-01T00:00:00.000Z", "log": "access", "client": "unix", "token": "ci", "transport": "unix",
        "method": "m", "id": "1", "duration": 0.0, "outcome": "ok", "code": None, "pid": None, "params": "{}"}


def test_redaction_reaches_nested_objects_and_lists_and_the_address_its_forms():
    assert redact({"A": [{"Api-Key": 1, "x": {"TOKEN": [2]}}], "b": "secret"}) == {
        "A": [{"Api-Key": REDACTED, "x": {"TOKEN": REDACTED}}], "b": "secret"}
    assert (address(("1.2.3.4", 5)), address(("::1", 5, 0, 0)), address(""), address(None), address(3)) == (
        "1.2.3.4:5", "[::1]:5", "unix", "unix", "-")
    with pytest.raises(ValueError, match="access_log"):
        AccessLog("off", print)


SECRETS = ["password", "PASS-WORD", "pass_word", "db_password", "accessToken", "x-auth-token", "clientSecret",
           "secret_key", "X-Api-Key", "x_api_key", "X-Private-Key", "privateKey", "passphrase", "auth", "bearer",
           "Authorization ", "proxy-authorization", "Set-Cookie", "session_id", "jwt", "token\x00",
           "\uff30\uff21\uff33\uff33\uff37\uff2f\uff32\uff24", "\u212aey", "pwd", "pin", "credentials"]  # fmt: skip


@pytest.mark.parametrize("key", SECRETS)
def test_a_key_named_like_a_secret_in_any_spelling_is_redacted(key):
    """Hostile testing, round 117, and new users, round 108: camelCase, prefixes, suffixes,
    other punctuation and fullwidth letters were logged in clear."""
    assert redact({"a": [{key: "S"}], key: {"x": 1}}) == {"a": [{key: REDACTED}], key: REDACTED}


# Common names of secrets the rule missed (hostile testing, after round 117's fix), in the
# spellings clients use: each must be redacted
NAMED = ["pw", "userPw", "passcode", "pincode", "PIN_CODE", "creds", "awsCreds", "credentials", "otp", "OTP",
         "mfa_code", "mfaCode", "totp", "totpSecret", "keys", "ssh_keys", "accessKeyId", "aws_access_key_id",
         "aws_secret_access_key", "privKeyPem", "private_key", "mnemonic", "seedPhrase", "seed", "wallet_seed",
         "recovery_codes", "csrf", "_csrf", "xsrf", "X-XSRF-TOKEN", "dsn", "SENTRY_DSN", "connectionString",
         "database_url", "DATABASE_URL", "db_url", "cvv", "cvv2", "cvc", "ssn", "SSNLast4", "card_number",
         "cardNumber", "iban", "IBAN", "credit_card", "creditCardNumber", "cc_number", "account_number",
         "verification_code", "access_code", "security_answer", "hmac", "webhook_hmac", "jwk", "salt",
         "password_salt", "conn_str"]  # fmt: skip
# Ordinary names, some holding a short secret name inside a word ("shipping", "footprint",
# "keyboard"), which stay visible
PLAIN = ["query", "path", "name", "limit", "url", "id", "city", "page", "keyboard_layout", "keyId", "method",
         "email", "username", "offset", "database", "code", "number", "passenger", "shipping", "footprint",
         "pinned", "seeds", "dns", "mfa_enabled", "redirect_url", "keyword", "salty", "account", "cc"]  # fmt: skip


@pytest.mark.parametrize("key", NAMED)
def test_a_key_of_a_common_secret_name_is_redacted(key):
    assert redact({"a": [{key: "S"}], key: {"x": 1}}) == {"a": [{key: REDACTED}], key: REDACTED}


@pytest.mark.parametrize("key", PLAIN)
def test_a_key_of_an_ordinary_name_is_kept(key):
    assert redact({key: "v"}) == {key: "v"}


def test_plain_keys_are_kept_and_a_params_walk_is_bounded():
    assert redact({"id": 1, "name": "n", "method": "m", "query": "q", "path": "/p"}) == {
        "id": 1, "name": "n", "method": "m", "query": "q", "path": "/p"}
    wide = b"[" + b",".join([b"[]"] * 1364) + b"]"  # (no object: nothing to redact, nothing walked)
    assert _params_text(wide) == wide.decode()[:PARAMS_CHARS] + "..."
    objects = b'{"a":[' + b",".join([b"{}"] * (REDACT_VALUES + 1)) + b"]}"
    assert _params_text(objects) == f"({len(objects)} bytes, more than {REDACT_VALUES} values: not written)"
    assert _params_text(b'{"password":1,"x":[1,2]}') == '{"password":"[redacted]","x":[1,2]}'
