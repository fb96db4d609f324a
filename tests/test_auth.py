"""Bearer-token authentication (issue 12, item 1): broker/auth.py's token files and checks,
and a real broker asking for tokens on rpc_path (and /metrics with auth_metrics) over real
sockets on loopback: accepted and refused, 401 with `WWW-Authenticate: Bearer`.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import typing
from pathlib import Path

import pytest
from conftest import ROOT, Broker, free_port, listen_port, start_broker
from test_response_limits import read_http_response

from broker import cli
from broker.auth import ENV_TOKENS, Authenticator, AuthError, load_file, load_tokens
from broker.startup import secret_file_warnings

ALICE = "alice-token-0123456789abcdef"
BOB = "bob-token-0123456789abcdef-XYZ"
ENV = {ENV_TOKENS: f"alice:{ALICE}, bob:{BOB}"}
CALL = json.dumps({"jsonrpc": "2.0", "method": "add", "params": [2, 3], "id": 1})


# -- broker/auth.py --------------------------------------------------------------------


def write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_a_token_file_of_lines_gives_each_token_its_name(tmp_path):
    path = write(tmp_path, "tokens", f"# the CI's and Alice's\n\nci:{BOB}\n  alice : {ALICE}  \n")
    auth = Authenticator(load_file(path))
    assert auth.names == ("ci", "alice")
    assert auth.check(f"Bearer {ALICE}".encode()) == "alice"
    assert auth.check(f"bearer   {BOB}".encode()) == "ci"  # (the scheme's case ignored: RFC 9110 11.1)
    assert auth.check(f"Bearer {ALICE}x".encode()) is None
    assert auth.check(f"Basic {ALICE}".encode()) is None
    assert auth.check(ALICE.encode()) is None
    assert auth.check(b"Bearer") is None and auth.check(b"") is None and auth.check(None) is None


def test_a_toml_token_file_has_a_table_per_token(tmp_path):
    path = write(tmp_path, "tokens.toml", f'[tokens.ci]\ntoken = "{BOB}"\n\n[tokens.alice]\ntoken = "{ALICE}"\n')
    auth = Authenticator(load_file(path))
    assert auth.names == ("ci", "alice") and auth.check(f"Bearer {BOB}".encode()) == "ci"


def test_tokens_come_from_the_file_and_the_environment(tmp_path):
    path = write(tmp_path, "tokens", f"ci:{'c' * 20}\n")
    tokens = load_tokens(path, ENV)
    assert [t.name for t in tokens] == ["ci", "alice", "bob"]
    assert load_tokens("", {}) == []
    assert all(ALICE.encode() not in t.digest for t in tokens)  # (only digests kept)


@pytest.mark.parametrize(("name", "text", "problem"), [
    ("tokens", f"# one\nalice {ALICE}\n", "line 2: no colon: write NAME:TOKEN"),
    ("tokens", "alice:short\n", "line 1: the token (after the colon) breaks its rule: use 16 to 512 characters"),
    ("tokens", f"alice:{'x' * 15}\n", "use 16 to 512 characters"),
    ("tokens", f"alice:{'x' * 513}\n", "use 16 to 512 characters"),
    ("tokens", f"alice:{'x' * 20} y\n", "use 16 to 512 characters"),  # (a space: not a b64token)
    ("tokens", f"al ice:{ALICE}\n", "line 1: the token's name (before the colon) breaks its rule: use 1 to 64"),
    ("tokens", f":{ALICE}\n", "the token's name (before the colon) breaks its rule"),
    # (round 114, M1: written the wrong way round, the name is the secret: shown in the error)
    ("tokens", f"{ALICE}:alice\n", "the token (after the colon) breaks its rule"),
    ("tokens", f"{'s' * 70}:{ALICE}\n", "the token's name (before the colon) breaks its rule"),
    # (new user, round 109: both said "the token (after the colon) breaks its rule" / "no colon")
    ("tokens", f"ci:{ALICE}   # the CI runner\n", "line 1: a comment after the token: a comment goes on a line of its"
                                                " own, '#' first"),
    ("tokens", f"ci:{ALICE}\t#x\n", "line 1: a comment after the token"),
    ("tokens.conf", f'# ours\n\n  [tokens.ci]\ntoken = "{ALICE}"\n', "tokens.conf: it starts with '[', as TOML "
                                                                    "does: a TOML token file must be named *.toml"),
    # (round 114, H2: an empty file asked for no token, silently)
    ("tokens", "# nothing yet\n\n", "no token in it (one NAME:TOKEN a line): an empty file would ask for none"),
    # (new user, round 108: the file and the line of each entry, a TOML one's and a duplicate's too)
    ("tokens", f"a:{ALICE}\n\na:{BOB}\n", "tokens, line 3: token name 'a' given twice (first at auth_tokens_file: "),
    ("tokens", f"a:{ALICE}\nb:{ALICE}\n", "tokens, line 2: the token of 'b' is also the token of 'a' (at auth_tokens_file:"),
    ("tokens.toml", f'[tokens.a]\ntoken = "{ALICE}"\nallow = 1\n', "tokens.toml, line 1: [tokens.a]: unknown key 'allow'"),
    ("tokens.toml", "[tokens.a]\ntoken = 5\n", 'tokens.toml, line 1: [tokens.a] needs token = "..." (a string)'),
    ("tokens.toml", f'# ci\n[tokens.ci]\ntoken = "{BOB}"\n\n[tokens.alice]\ntoken = "short"\n',
     "tokens.toml, line 5: [tokens.alice]: the token (token = ...) breaks its rule: use 16 to 512 characters"),
    ("tokens.toml", f'[tokens.ci]\ntoken = "{BOB}"\n[ tokens . "b" ]\ntoken = "{BOB}"\n',
     "tokens.toml, line 3: [tokens.b]: the token of 'b' is also the token of 'ci' (at auth_tokens_file: "),
    ("tokens.toml", f'[tokens]\nx = {{ token = "{ALICE}" }}\n"y z".token = "{BOB}x"\n',
     "tokens.toml, line 3: [tokens.y z]: the token's name ([tokens.NAME]) breaks its rule"),
    ("tokens.toml", f'tokens.ci.token = "{BOB}"\n\ntokens.x = {{ token = 1 }}\n',
     'tokens.toml, line 3: [tokens.x] needs token = "..."'),
    ("tokens.toml", f'[tokens.ci]\ntoken = "{BOB}"\nrate_burst = 2\n', "tokens.toml, line 1: [tokens.ci]: rate_burst without"),
    ("tokens.toml", "# none yet\n", "no [tokens.NAME] table"),
    # (hostile testing, round 131: keys and tables beside [tokens.*] were skipped without a word: a
    # top-level deny_methods meant for every token held for none, and [token.bob] was no token)
    ("tokens.toml", f'allow_methods = ["text"]\ndeny_methods = ["*"]\n[tokens.a]\ntoken = "{ALICE}"\n',
     "tokens.toml: unknown key 'allow_methods' at the top (every setting of a token goes in its own "
     "[tokens.NAME] table: token, allow_methods"),
    ("tokens.toml", f'[tokens.a]\ntoken = "{ALICE}"\n[token.bob]\ntoken = "{BOB}"\n',
     "tokens.toml: unknown table 'token' at the top (did you mean [tokens.NAME]?)"),
    ("tokens.toml", "x = 1\n", "unknown key 'x' at the top"),
    ("tokens.toml", "[tokens\n", "not valid TOML"),
])
def test_a_token_file_that_breaks_a_rule_is_refused_saying_where_and_why(tmp_path, name, text, problem):
    path = write(tmp_path, name, text)
    with pytest.raises(AuthError) as caught:
        load_tokens(path, {})
    assert problem in str(caught.value)
    assert "-token-" not in str(caught.value) and "ssssss" not in str(caught.value)  # (nothing of a secret shown)
    if "characters" in problem:
        assert "secrets.token_urlsafe(32)" in str(caught.value)  # (how to make a good one)


def test_a_token_source_that_gives_no_token_or_is_no_file_is_refused(tmp_path):
    """Hostile testing, round 114: H2, a variable of separators only turned the tokens off,
    silently ("" is as unset); M4, /dev/zero as the file was read whole (2.6 GB)."""
    with pytest.raises(AuthError, match=f"environment variable {ENV_TOKENS}: no NAME:TOKEN in it"):
        load_tokens("", {ENV_TOKENS: " , "})
    assert load_tokens("", {ENV_TOKENS: ""}) == []
    with pytest.raises(AuthError, match="/dev/zero: not a regular file"):
        load_tokens("/dev/zero", {})
    big = tmp_path / "big"
    big.write_bytes(b"#" * (2 << 20))
    with pytest.raises(AuthError, match="larger than 1048576 bytes"):
        load_tokens(str(big), {})


def test_an_unreadable_token_file_or_a_bad_variable_is_refused(tmp_path):
    with pytest.raises(AuthError, match="cannot read it"):
        load_tokens(str(tmp_path / "absent"), {})
    with pytest.raises(AuthError, match=f"environment variable {ENV_TOKENS}, entry 2: no colon: write NAME:TOKEN"):
        load_tokens("", {ENV_TOKENS: f"a:{ALICE} x"})


# -- the settings: check-config and serve ----------------------------------------------


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in list(os.environ):
        if var.startswith("RPC_BROKER_"):
            monkeypatch.delenv(var)


def test_check_config_reads_the_tokens_and_refuses_bad_ones(tmp_path, clean_env, capsys, monkeypatch):
    good = write(tmp_path, "tokens", f"alice:{ALICE}\n")
    config = write(tmp_path, "broker.toml", f'auth_tokens_file = "{good}"\nauth_metrics = true\n')
    assert cli.main(["check-config", config]) == 0
    assert 'auth_tokens_file = "' in capsys.readouterr().out
    bad = write(tmp_path, "bad-tokens", "alice:short\n")
    assert cli.main(["check-config", write(tmp_path, "bad.toml", f'auth_tokens_file = "{bad}"\n')]) == 2
    assert f"config error: config file {tmp_path}/bad.toml: {bad}, line 1: the token (after the colon)" \
        in capsys.readouterr().err
    monkeypatch.setenv(ENV_TOKENS, "x")
    assert cli.main(["check-config", write(tmp_path, "none.toml", "")]) == 2
    assert f"environment variable {ENV_TOKENS}, entry 1: no colon" in capsys.readouterr().err


# -- a real broker ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def guarded() -> typing.Iterator[Broker]:
    """A broker asking for ALICE's or BOB's token, /metrics too, on 1 worker."""
    b = start_broker("--workers", "1", "--auth-metrics", env=ENV)
    yield b
    assert b.stop() == 0, b.read_log()


def request(b: Broker, method: str, path: str, body: bytes = b"",
            headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    conn = b.connection()
    try:
        conn.request(method, path, body=body or None, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


JSON = {"content-type": "application/json"}


def test_a_call_with_a_token_given_is_served(guarded):
    for token in (ALICE, BOB):
        status, _, body = guarded.post(CALL, headers={"authorization": f"Bearer {token}"})
        assert (status, json.loads(body)) == (200, {"jsonrpc": "2.0", "id": 1, "result": 5})
    status, _, body = guarded.post(json.dumps([json.loads(CALL)] * 2), headers={"authorization": f"bearer {ALICE}"})
    assert status == 200 and [a["result"] for a in json.loads(body)] == [5, 5]


@pytest.mark.parametrize(("authorization", "error"), [
    (None, None),
    (f"Bearer {ALICE}x", "invalid_token"),
    (f"Bearer {ALICE[:-1]}", "invalid_token"),
    (f"Basic {ALICE}", None),  # (another scheme's credentials: no error code, RFC 6750 3.1; round 107)
    (ALICE, None),
    ("Bearer ", "invalid_token"),
])
def test_a_call_without_a_good_token_gets_401_with_a_bearer_challenge(guarded, authorization, error):
    headers = {} if authorization is None else {"authorization": authorization}
    status, got, body = guarded.post(CALL, headers=headers)
    challenge = 'Bearer realm="rpc-broker"' + (f', error="{error}"' if error else "")
    assert (status, got["www-authenticate"]) == (401, challenge)
    answer = json.loads(body)
    assert answer["id"] is None and answer["error"]["code"] == -32600
    assert answer["error"]["data"] == (
        "a bearer token is required: send Authorization: Bearer TOKEN" if error is None
        else "the bearer token is not one of auth_tokens_file's or RPC_BROKER_AUTH_TOKENS'"
    )


def test_mcp_needs_a_token_too_and_is_refused_with_a_json_rpc_error(guarded):
    """New user, round 111: /mcp's 401 was a plain {"error": ...}, unlike its 403, 415 and the JSON-RPC path's."""
    ping = b'{"jsonrpc":"2.0","id":1,"method":"ping"}'
    status, got, body = request(guarded, "POST", "/mcp", ping, JSON)
    assert (status, got["www-authenticate"]) == (401, 'Bearer realm="rpc-broker"')
    assert json.loads(body)["error"] == {"code": -32600, "message": "Invalid Request",
                                         "data": "a bearer token is required: send Authorization: Bearer TOKEN"}
    status, _, body = request(guarded, "POST", "/mcp", ping, {**JSON, "authorization": f"Bearer {ALICE}"})
    assert (status, json.loads(body)["result"]) == (200, {})


def test_two_authorization_fields_are_refused_even_if_one_is_good(guarded):
    with socket.create_connection((guarded.host, guarded.port), timeout=10) as sock:
        sock.sendall(
            b"POST / HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer " + ALICE.encode() + b"\r\nAuthorization: Bearer " + BOB.encode()
            + b"\r\nContent-Length: %d\r\n\r\n" % len(CALL) + CALL.encode()
        )
        status, body = read_http_response(sock, bytearray())
    assert status == 401 and b"not one of" in body


def test_a_connection_whose_token_changes_is_checked_again(guarded):
    conn = guarded.connection()
    try:
        answers = []
        for token in (ALICE, ALICE, "x" * 20, BOB, None):
            headers = {**JSON, **({"authorization": f"Bearer {token}"} if token else {})}
            conn.request("POST", "/", body=CALL, headers=headers)
            resp = conn.getresponse()
            resp.read()
            answers.append(resp.status)
    finally:
        conn.close()
    assert answers == [200, 200, 401, 200, 401]


def test_health_probes_and_a_preflight_need_no_token_and_metrics_do(tmp_path):
    b = start_broker("--workers", "1", "--auth-metrics", "--allowed-origins", "https://app.example", env=ENV)
    try:
        assert request(b, "GET", "/healthz")[0] == 200
        assert request(b, "GET", "/readyz")[0] == 200
        status, headers, body = request(b, "GET", "/metrics")
        assert (status, headers["www-authenticate"], body) == (
            401, 'Bearer realm="rpc-broker"', b'{"error":"a bearer token is required: send Authorization: Bearer TOKEN"}')
        status, _, body = request(b, "GET", "/metrics", headers={"authorization": f"Bearer {BOB}"})
        assert status == 200 and b'rpc_broker_http_responses_total{path="metrics",status="401"} 1.0' in body
        preflight = {"origin": "https://app.example", "access-control-request-method": "POST",
                     "access-control-request-headers": "authorization, content-type"}
        status, headers, _ = request(b, "OPTIONS", "/", headers=preflight)
        assert status == 204 and headers["access-control-allow-origin"] == "https://app.example"
        status, _, _ = request(b, "POST", "/", CALL.encode(), {**JSON, "origin": "https://app.example"})
        assert status == 401
        status, _, body = request(b, "POST", "/", CALL.encode(),
                                  {**JSON, "origin": "https://app.example", "authorization": f"Bearer {ALICE}"})
        assert (status, json.loads(body)["result"]) == (200, 5)
        assert " INFO bearer tokens asked for on / and /mcp and /metrics: 2 (alice, bob)\n" in b.read_log()
    finally:
        assert b.stop() == 0, b.read_log()


def test_without_auth_metrics_the_metrics_stay_open_and_a_token_file_serves(tmp_path):
    path = write(tmp_path, "tokens.toml", f'[tokens.ci]\ntoken = "{BOB}"\n')
    b = start_broker("--workers", "1", "--auth-tokens-file", path, env={ENV_TOKENS: ""})
    try:
        assert request(b, "GET", "/metrics")[0] == 200
        assert b.post(CALL)[0] == 401
        assert b.post(CALL, headers={"authorization": f"Bearer {BOB}"})[0] == 200
        assert b.post(CALL, headers={"authorization": f"Bearer {ALICE}"})[0] == 401
    finally:
        assert b.stop() == 0, b.read_log()


def test_serve_refuses_to_start_with_a_bad_token(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("RPC_BROKER_")}
    proc = subprocess.run(
        [sys.executable, "-m", "broker", "serve", "--port", str(listen_port()), "--auth-tokens-file", write(tmp_path, "t", "a:b\n")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2
    assert f"config error: flag --auth-tokens-file: {tmp_path}/t, line 1: the token (after the colon) breaks its" \
        " rule: use 16" in proc.stderr


def test_an_http_client_sees_the_challenge(guarded):
    conn = http.client.HTTPConnection(guarded.host, guarded.port, timeout=10)
    try:
        conn.request("POST", "/", body=CALL, headers=JSON)
        resp = conn.getresponse()
        resp.read()
        assert resp.status == 401 and resp.reason == "Unauthorized"
    finally:
        conn.close()


# -- the NDJSON streams: a token on TCP's first line, the Unix socket by its file mode -------


def lines_over(sock: socket.socket, payload: bytes, want: int) -> tuple[list[dict[str, typing.Any]], bool]:
    """Send `payload`, read `want` answer lines (or until the broker closes): (them, closed)."""
    sock.sendall(payload)
    data = b""
    closed = False
    while data.count(b"\n") < want:
        chunk = sock.recv(65536)
        if not chunk:
            closed = True
            break
        data += chunk
    return [json.loads(line) for line in data.splitlines() if line], closed


def auth_line(token: str, id_: object = "auth") -> bytes:
    msg: dict[str, object] = {"jsonrpc": "2.0", "method": "rpc.authenticate", "params": {"_meta": {"token": token}}}
    if id_ is not None:
        msg["id"] = id_
    return json.dumps(msg).encode() + b"\n"


@pytest.fixture(scope="module")
def streams(tmp_path_factory: pytest.TempPathFactory) -> typing.Iterator[tuple[Broker, int, str]]:
    """A broker asking for tokens (ci may call `add` only), with an NDJSON TCP port and a Unix socket."""
    folder = tmp_path_factory.mktemp("streams")
    tokens = folder / "tokens.toml"
    tokens.write_text(f'[tokens.ci]\ntoken = "{BOB}"\nallow_methods = ["add"]\n\n[tokens.alice]\ntoken = "{ALICE}"\n')
    port, path = free_port(), str(folder / "s.sock")
    b = start_broker("--workers", "1", "--auth-tokens-file", str(tokens), "--stream-port", str(port),
                     "--stream-socket", path, env={ENV_TOKENS: ""})
    yield b, port, path
    assert b.stop() == 0, b.read_log()


def test_a_tcp_stream_shows_its_token_in_its_first_line_then_calls_under_it(streams) -> None:
    b, port, _ = streams
    with socket.create_connection((b.host, port), timeout=10) as sock:
        answers, closed = lines_over(sock, auth_line(BOB) + CALL.encode() + b"\n"
                                     + json.dumps({"jsonrpc": "2.0", "method": "sum", "params": [1], "id": 2}).encode()
                                     + b"\n", 3)
    assert not closed and answers[0] == {"jsonrpc": "2.0", "id": "auth", "result": {"token": "ci"}}
    assert sorted(answers[1:], key=lambda a: a["id"]) == [  # (NDJSON answers come as they are made)
        {"jsonrpc": "2.0", "id": 1, "result": 5},
        {"jsonrpc": "2.0", "id": 2, "error": {"code": -32601, "message": "Method not found"}}]  # (ci: add only)
    with socket.create_connection((b.host, port), timeout=10) as sock:  # (as a notification: no answer)
        answers, closed = lines_over(sock, auth_line(ALICE, id_=None) + CALL.encode() + b"\n", 1)
    assert answers == [{"jsonrpc": "2.0", "id": 1, "result": 5}] and not closed


@pytest.mark.parametrize(("first", "why"), [
    (CALL.encode() + b"\n", "a bearer token is required: the first line must be "),  # (the call is not run)
    (auth_line("x" * 20), "the bearer token is not one of"),  # (a token no one has: said so, round 107)
    (auth_line(BOB[:-1]), "the bearer token is not one of"),
    (json.dumps({"jsonrpc": "2.0", "method": "rpc.authenticate", "params": {"token": BOB}, "id": 1}).encode() + b"\n",
     "a bearer token is required: the first line must be "),
    (json.dumps([json.loads(auth_line(BOB))]).encode() + b"\n", "a bearer token is required: "),  # (a batch)
    (b"not json\n", "a bearer token is required: the first line must be "),
    # (hostile testing, round 139: a token no one has beside numbers msgspec reads slowly, which are skipped)
    (b'{"jsonrpc":"2.0","method":"rpc.authenticate","params":{"pad":[' + b",".join([b"1e308"] * 2000)
     + b'],"_meta":{"token":"' + b"x" * 20 + b'","n":[1.2345000000000000576e249]}},"id":1}\n',
     "the bearer token is not one of"),
    (b'{"jsonrpc":"2.0","method":"rpc.authenticate","params":{"_meta":{"token":5}},"id":1}\n',
     "a bearer token is required: "),
    (b'{"jsonrpc":"2.0","method":"rpc.authenticate","params":{"_meta":[1e308]},"id":1}\n',
     "a bearer token is required: "),
    (b'{"jsonrpc":"2.0","method":"rpc.authenticate","params":[{"_meta":{"token":"' + BOB.encode() + b'"}}],"id":1}\n',
     "a bearer token is required: "),
])
def test_a_tcp_stream_whose_first_line_shows_no_good_token_is_refused_and_closed(streams, first: bytes, why) -> None:
    b, port, _ = streams
    with socket.create_connection((b.host, port), timeout=10) as sock:
        answers, closed = lines_over(sock, first + CALL.encode() + b"\n", 2)
    assert closed and len(answers) == 1, answers
    assert answers[0]["id"] is None and answers[0]["error"]["code"] == -32600
    assert answers[0]["error"]["data"].startswith(why)
    assert BOB not in json.dumps(answers)


def test_a_tokens_params_beside_it_are_skipped_their_numbers_unread(streams) -> None:
    # (hostile testing, round 139: all of rpc.authenticate's params were decoded on the front-end's
    # loop, a MiB of `1e308` in 1.6-1.8 s before any token was checked; now only `_meta.token` is read,
    # so a number past a double's range beside it, once refused with the whole params, is skipped)
    b, port, _ = streams
    first = (b'{"jsonrpc":"2.0","method":"rpc.authenticate","params":{"pad":[' + b",".join([b"1e308"] * 2000)
             + b'],"far":1e400,"_meta":{"n":1e999,"token":"' + BOB.encode() + b'","m":[1e23]},"_meta2":0},"id":"a"}\n')
    with socket.create_connection((b.host, port), timeout=10) as sock:
        answers, closed = lines_over(sock, first + CALL.encode() + b"\n", 2)
    assert not closed and answers == [{"jsonrpc": "2.0", "id": "a", "result": {"token": "ci"}},
                                      {"jsonrpc": "2.0", "id": 1, "result": 5}]


def test_the_unix_socket_is_trusted_by_its_file_mode(streams) -> None:
    _, _, path = streams
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(10)
        sock.connect(path)
        answers, closed = lines_over(sock, CALL.encode() + b"\n", 1)
    assert answers == [{"jsonrpc": "2.0", "id": 1, "result": 5}] and not closed


@pytest.mark.parametrize(("host", "tokens", "tls", "said"), [
    ("0.0.0.0", False, False, "no bearer tokens are asked for"), ("::", False, True, "no bearer tokens"),
    ("192.0.2.7", False, False, "no bearer tokens"), ("rpc.example", False, False, "no bearer tokens"),
    ("0.0.0.0", True, False, "its bearer tokens travel in clear text"), ("0.0.0.0", True, True, ""),
    ("127.0.0.1", False, False, ""), ("127.9.9.9", False, False, ""), ("::1", False, False, ""),
    ("[::1]", False, False, ""), ("localhost", True, False, ""),
])
def test_a_broker_listening_past_loopback_without_tokens_or_tls_is_warned_about(host, tokens, tls, said):
    """Hostile testing, round 114 (H2): nothing said that a broker on 0.0.0.0 asked for no
    token; new user, round 106: nor that tokens went in clear text, nor that auth_metrics
    without tokens asks for none."""
    from broker.startup import exposure_warnings

    warnings = exposure_warnings(host, tokens, tls, False)
    if said:
        assert len(warnings) == 1 and warnings[0].startswith(f"host {host} is reachable past this machine and ")
        assert said in warnings[0]
    else:
        assert warnings == []
    assert exposure_warnings("127.0.0.1", False, False, True) == [
        "auth_metrics is set but no bearer tokens are given: /metrics asks for none"]
    assert exposure_warnings("127.0.0.1", True, False, True) == []


@pytest.mark.parametrize("expect", [True, False])
def test_a_call_with_no_good_token_is_refused_before_its_body(guarded, expect: bool) -> None:
    """Hostile testing, round 114 (M5): a call with no token got 100 Continue, then its whole
    body was read (held in max_incoming_bytes), then the 401. Now the 401 comes at the head's
    end, no 100, the connection closes, and the body is never read."""
    head = (b"POST / HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 900000\r\n"
            + (b"Expect: 100-continue\r\n" if expect else b"") + b"\r\n")
    with socket.create_connection((guarded.host, guarded.port), timeout=10) as sock:
        sock.sendall(head)  # (no body sent)
        buf = bytearray()
        status, body = read_http_response(sock, buf)
        assert status == 401 and b"a bearer token is required" in body
        assert b"100 Continue" not in bytes(buf)


def test_requests_refused_for_want_of_a_token_are_logged_now_and_then(broker_factory) -> None:
    """New user, round 106: a refused token left no line. The first refusal is logged
    (WARNING: the listener, how many so far, the last one's address and whether a token
    was sent), then each thousandth, as max_connections' refusals are."""
    port = free_port()
    b = broker_factory("--workers", "1", "--stream-port", str(port), env=ENV)
    assert b.post(CALL)[0] == 401
    assert b.post(CALL, headers={"authorization": f"Bearer {ALICE[:-1]}x"})[0] == 401
    with socket.create_connection((b.host, port), timeout=10) as sock:
        lines_over(sock, b'{"jsonrpc":"2.0","method":"rpc.authenticate","params":{"_meta":{"token":"nope-nope-nope-nope"}}}\n', 1)
    log = b.read_log(0.2)
    assert "http: refused 1 request(s) without a good bearer token so far (the last from 127.0.0.1: no token)" in log
    assert "tcp: refused 1 request(s) without a good bearer token so far (the last from 127.0.0.1: a token no one" \
        " has)" in log
    assert "refused 2 request(s)" not in log  # (the second: counted, not logged)
    assert ALICE[:-1] not in log


def test_a_token_file_others_may_read_is_warned_about_at_the_start(broker_factory, tmp_path: Path) -> None:
    """New user, round 106: a 0644 token file (and TLS key) were taken silently, though the
    README asks for 0600: warned about (not refused: a Kubernetes Secret's files are 0644
    unless told otherwise)."""
    tokens = tmp_path / "tokens"
    tokens.write_text(f"ci:{BOB}\n")
    tokens.chmod(0o644)
    b = broker_factory("--workers", "1", "--auth-tokens-file", str(tokens), env={ENV_TOKENS: ""})
    assert f"auth_tokens_file {tokens} is readable by users other than its owner (mode 0644): make it 0600" \
        in b.read_log()
    tokens.chmod(0o600)
    assert secret_file_warnings({"auth_tokens_file": str(tokens), "tls_key_file": ""}) == []
    tokens.chmod(0o640)
    assert [w.split(" (mode")[1][:5] for w in secret_file_warnings({"auth_tokens_file": str(tokens)})] == [" 0640"]
