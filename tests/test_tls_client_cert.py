"""Client certificates (tls_client_ca_file): a CA for the clients and their certificates made
at test time (trustme), real brokers over TLS on loopback. With bearer tokens a certificate is
optional, and on the NDJSON stream_port one whose subject commonName is a token's name
authenticates the connection as that token (its method policy, its name in the access log);
without tokens every TLS client must show one. A certificate that does not verify fails the
handshake either way; the setting's mistakes stop the broker at the start.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import socket
import ssl
import subprocess
import sys
import time
import typing
from pathlib import Path

import pytest
import trustme
from conftest import ROOT, Broker, free_port, sample, scrape_metrics, start_broker
from test_auth import auth_line, lines_over

from broker.auth import ENV_TOKENS
from broker.startup import exposure_warnings
from broker.tls import certificate_name

CI = "ci-token-0123456789abcdef-XYZ"
ALICE = "alice-token-0123456789abcdef"
CALL = {"jsonrpc": "2.0", "method": "add", "params": [2, 3], "id": 1}
SUM = {"jsonrpc": "2.0", "method": "sum", "params": [1, 2], "id": 2}  # (ci may not call it: allow_methods)
ADDED = {"jsonrpc": "2.0", "id": 1, "result": 5}
NOT_FOUND = {"jsonrpc": "2.0", "id": 2, "error": {"code": -32601, "message": "Method not found"}}


def line(*messages: object) -> bytes:
    return b"".join(json.dumps(m).encode() + b"\n" for m in messages)


class Pki(typing.NamedTuple):
    server_ca: trustme.CA  # (the clients trust it)
    cert: Path  # the broker's certificate, then its chain
    key: Path
    client_ca: Path  # tls_client_ca_file: the CA of the clients' certificates
    clients: dict[str, trustme.LeafCert]  # by name: "ci", "alice" (tokens), "nobody" (no token), "foreign"
    tokens: Path  # ci may call `add` only; alice anything


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    folder = tmp_path_factory.mktemp("pki")
    server_ca, client_ca, other_ca = trustme.CA(), trustme.CA(), trustme.CA()
    issued = server_ca.issue_cert("127.0.0.1")
    cert, key, ca = folder / "cert.pem", folder / "key.pem", folder / "clients-ca.pem"
    cert.write_bytes(b"".join(blob.bytes() for blob in issued.cert_chain_pems))
    key.write_bytes(issued.private_key_pem.bytes())
    key.chmod(0o600)
    client_ca.cert_pem.write_to_path(str(ca))
    clients = {name: client_ca.issue_cert(f"{name}@clients.example", common_name=name)
               for name in ("ci", "alice", "nobody")}
    clients["foreign"] = other_ca.issue_cert("ci@clients.example", common_name="ci")  # (ci's name, another CA)
    tokens = folder / "tokens.toml"
    tokens.write_text(f'[tokens.ci]\ntoken = "{CI}"\nallow_methods = ["add"]\n\n[tokens.alice]\ntoken = "{ALICE}"\n')
    tokens.chmod(0o600)
    return Pki(server_ca, cert, key, ca, clients, tokens)


def context(pki: Pki, client: str = "", version: ssl.TLSVersion | None = None) -> ssl.SSLContext:
    """A client's context: trusting the broker's CA, showing `client`'s certificate ("" none)."""
    ctx = ssl.create_default_context()
    pki.server_ca.configure_trust(ctx)
    if client:
        pki.clients[client].configure_cert(ctx)
    if version is not None:
        ctx.maximum_version = version
    return ctx


def exchange(port: int, ctx: ssl.SSLContext, payload: bytes, want: int) -> tuple[list[dict[str, typing.Any]], bool]:
    """Send `payload` over TLS, read `want` answer lines or until the broker closes: (them, closed)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw, \
            ctx.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
        return lines_over(tls, payload, want)


def handshake_refused(port: int, ctx: ssl.SSLContext, request: bytes) -> str:
    """Connect, send `request` and read: "" if something was answered, else how the connection
    ended (a TLS alert, a reset, or an end with no byte). Under TLS 1.3 the client's handshake
    ends before the server has checked its certificate: the refusal shows at the first read."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as raw, \
                ctx.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
            tls.sendall(request)
            return "" if tls.recv(65536) else "closed with no answer"
    except ssl.SSLError as exc:
        return f"TLS error: {exc.reason}"
    except (ConnectionResetError, BrokenPipeError) as exc:
        return f"reset: {exc}"


def https(pki: Pki, port: int, client: str, method: str, path: str,
          headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    conn = http.client.HTTPSConnection("127.0.0.1", port, context=context(pki, client), timeout=10)
    try:
        body = json.dumps(CALL) if method == "POST" else None
        conn.request(method, path, body=body, headers={"content-type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def post(port: int) -> bytes:
    body = json.dumps(CALL).encode()
    return (b"POST / HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body))


@pytest.fixture(scope="module", params=["uvloop", "asyncio"])
def guarded(request: pytest.FixtureRequest, pki: Pki) -> typing.Iterator[tuple[Broker, int]]:
    """A broker with tokens and tls_client_ca_file (certificates optional), an NDJSON TLS port,
    every call in the access log; on each event loop (the peer certificate is each one's)."""
    port = free_port()
    b = start_broker("--workers", "1", "--event-loop", request.param, "--stream-port", str(port),
                     "--tls-cert-file", str(pki.cert), "--tls-key-file", str(pki.key),
                     "--tls-client-ca-file", str(pki.client_ca), "--auth-tokens-file", str(pki.tokens),
                     "--access-log", "all", env={ENV_TOKENS: ""})
    yield b, port
    assert b.stop() == 0, b.read_log()


def test_a_certificate_naming_a_token_authenticates_the_stream_as_that_token(guarded, pki: Pki) -> None:
    b, port = guarded
    answers, closed = exchange(port, context(pki, "ci"), line(CALL, SUM), 2)  # (no rpc.authenticate line)
    assert not closed and sorted(answers, key=lambda a: a["id"]) == [ADDED, NOT_FOUND]  # (ci's policy: add only)
    answers, closed = exchange(port, context(pki, "alice"), line(SUM), 1)
    assert not closed and answers == [{"jsonrpc": "2.0", "id": 2, "result": 3}]  # (alice's: anything)
    log = b.read_log(0.5)
    assert "token=ci transport=tcp method=add id=1 " in log, log
    assert "token=ci transport=tcp method=sum id=2 duration=0.000000 outcome=method_not_found code=-32601 pid=-" in log
    assert "token=alice transport=tcp method=sum id=2 " in log
    assert "client certificates verified against tls_client_ca_file " in log and ": optional (HTTP keeps" in log


def test_without_a_certificate_or_with_one_naming_no_token_the_stream_shows_a_token(guarded, pki: Pki) -> None:
    _, port = guarded
    for client in ("", "nobody"):  # (no certificate; a verified one whose commonName is no token's name)
        answers, closed = exchange(port, context(pki, client), line(CALL), 2)
        assert closed and len(answers) == 1 and answers[0]["error"]["code"] == -32600, (client, answers)
        assert answers[0]["error"]["data"].startswith("a bearer token is required: the first line must be ")
        assert answers[0]["error"]["data"].endswith(
            "; or, over TLS, a client certificate whose subject commonName is a token's name")
        answers, closed = exchange(port, context(pki, client), auth_line(CI) + line(CALL, SUM), 3)
        assert not closed and answers[0] == {"jsonrpc": "2.0", "id": "auth", "result": {"token": "ci"}}
        assert sorted(answers[1:], key=lambda a: a["id"]) == [ADDED, NOT_FOUND], client


def test_rpc_authenticate_on_a_certificate_connection_is_checked_and_switches_no_token(guarded, pki: Pki) -> None:
    _, port = guarded
    ci = context(pki, "ci")
    answers, closed = exchange(port, ci, auth_line(CI) + line(CALL), 2)  # (the certificate's own token: as before)
    assert not closed and answers == [{"jsonrpc": "2.0", "id": "auth", "result": {"token": "ci"}}, ADDED]
    answers, closed = exchange(port, ci, auth_line(ALICE) + line(SUM), 2)  # (another token's: refused, not run)
    assert closed and len(answers) == 1 and answers[0]["error"]["code"] == -32600, answers
    assert answers[0]["error"]["data"].startswith("the bearer token is not the one the TLS client certificate names")
    # (no one's, or none: refused, saying the certificate authenticates the connection, not that a
    # token is required; hostile testing, round 120)
    for sent in (auth_line("x" * 20), b'{"jsonrpc":"2.0","method":"rpc.authenticate","id":1}\n'):
        answers, closed = exchange(port, ci, sent + line(CALL), 2)
        assert closed and answers[0]["error"]["data"].startswith("the bearer token is not the one the TLS"), answers
    answers, closed = exchange(port, ci, line(CALL) + auth_line(ALICE, id_=3) + line(SUM), 3)  # (later: -32601)
    assert not closed and sorted(answers, key=lambda a: str(a["id"])) == [
        ADDED, NOT_FOUND, {"jsonrpc": "2.0", "id": 3, "error": {"code": -32601, "message": "Method not found"}}]


@pytest.mark.parametrize("version", [ssl.TLSVersion.TLSv1_2, ssl.TLSVersion.TLSv1_3])
def test_a_certificate_that_does_not_verify_fails_the_handshake(guarded, pki: Pki, version: ssl.TLSVersion) -> None:
    """A certificate of another CA, its commonName a token's name: no listener serves it (HTTP
    or NDJSON), where a client showing none, or a good one, is answered."""
    b, port = guarded
    for where, request in ((b.port, post(b.port)), (port, line(CALL))):
        assert handshake_refused(where, context(pki, "foreign", version), request), where
        assert not handshake_refused(where, context(pki, "ci", version), request), where
        assert not handshake_refused(where, context(pki, "", version), request), where


def test_http_keeps_bearer_tokens_and_probes_need_no_certificate(guarded, pki: Pki) -> None:
    b, _ = guarded
    assert https(pki, b.port, "ci", "POST", "/")[0] == 401  # (a certificate is no Authorization header)
    assert https(pki, b.port, "ci", "POST", "/", {"authorization": f"Bearer {CI}"}) == (200, json.dumps(
        ADDED, separators=(",", ":")).encode())
    assert https(pki, b.port, "", "POST", "/", {"authorization": f"Bearer {ALICE}"})[0] == 200
    assert https(pki, b.port, "", "GET", "/healthz")[0] == 200


def test_without_tokens_every_tls_client_must_show_a_certificate(broker_factory, pki: Pki) -> None:
    port = free_port()
    b: Broker = broker_factory("--workers", "1", "--stream-port", str(port), "--tls-cert-file", str(pki.cert),
                               "--tls-key-file", str(pki.key), "--tls-client-ca-file", str(pki.client_ca),
                               "--host", "0.0.0.0", env={ENV_TOKENS: ""})
    for where, request in ((b.port, b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"),
                           (port, line(CALL))):
        assert handshake_refused(where, context(pki), request), where  # (none: refused, probes included)
        assert handshake_refused(where, context(pki, "foreign"), request), where
        assert not handshake_refused(where, context(pki, "nobody"), request), where  # (any verified one)
    assert https(pki, b.port, "nobody", "POST", "/")[0] == 200
    answers, closed = exchange(port, context(pki, "nobody"), line(CALL, SUM), 2)  # (no tokens: no policy of one)
    assert not closed and sorted(answers, key=lambda a: a["id"]) == [ADDED, {"jsonrpc": "2.0", "id": 2, "result": 3}]
    log = b.read_log()
    assert ": required (no bearer tokens: probes and Prometheus need one too)" in log
    assert "no bearer tokens are asked for" not in log  # (past loopback, but the certificates guard it)
    # Each refused handshake counted, and said (new user, round 110: none left a trace)
    deadline = time.monotonic() + 10
    while not re.search(r"http: 1 TLS handshake\(s\) failed so far \(the last from 127\.0\.0\.1: \w+", log):
        assert time.monotonic() < deadline, log
        log = b.read_log(0.1)
    samples = scrape_metrics(b, connection=http.client.HTTPSConnection(
        "127.0.0.1", b.port, context=context(pki, "nobody"), timeout=10))
    assert sample(samples, "rpc_broker_tls_handshakes_failed_total", transport="http") == 2
    assert sample(samples, "rpc_broker_tls_handshakes_failed_total", transport="tcp") == 2


def test_the_exposure_warning_counts_required_certificates_as_access_control() -> None:
    assert exposure_warnings("0.0.0.0", False, True, False, client_certs=True) == []
    assert exposure_warnings("0.0.0.0", False, True, False)[0].endswith("(auth_tokens_file or "
                                                                        "RPC_BROKER_AUTH_TOKENS; README, Authentication)")


def test_certificate_name_is_the_subject_common_name_if_there_is_exactly_one() -> None:
    org = (("organizationName", "Example"),)
    assert certificate_name({"subject": (org, (("commonName", "ci"),))}) == "ci"
    assert certificate_name({"subject": (org,)}) == ""
    assert certificate_name({"subject": ((("commonName", "ci"),), (("commonName", "alice"),))}) == ""
    assert certificate_name({"subject": ((("commonName", "ci"), ("commonName", "alice")),)}) == ""  # (multi-valued)
    assert certificate_name({}) == "" and certificate_name(None) == ""  # (CERT_NONE; no certificate)


def check_config(*flags: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("RPC_BROKER_")}
    return subprocess.run([sys.executable, "-m", "broker", *flags], cwd=ROOT, env={**clean, **(env or {})},
                          capture_output=True, text=True, timeout=60)


def test_the_client_ca_file_is_checked_at_the_start(pki: Pki, tmp_path: Path) -> None:
    server = ("--tls-cert-file", str(pki.cert), "--tls-key-file", str(pki.key))
    done = check_config("check-config", *server, env={"RPC_BROKER_TLS_CLIENT_CA_FILE": str(pki.client_ca)})
    assert done.returncode == 0 and f'tls_client_ca_file = "{pki.client_ca}"' in done.stdout, done.stderr
    config = tmp_path / "broker.toml"
    config.write_text(f'tls_client_ca_file = "{pki.client_ca}"\n')
    for command in ("check-config", "serve"):  # (serve stops before it imports the app or binds a port)
        done = check_config(command, str(config) if command == "check-config" else f"--config={config}")
        assert done.returncode == 2, done.stderr
        assert f"tls_client_ca_file from config file {config}: tls_client_ca_file is set but tls_cert_file and " \
               "tls_key_file are not: client certificates are asked for in TLS handshakes" in done.stderr, done.stderr
    absent = tmp_path / "absent.pem"
    done = check_config("check-config", *server, "--tls-client-ca-file", str(absent))
    assert done.returncode == 2 and f"tls_client_ca_file {absent}: cannot read it: No such file" in done.stderr
    done = check_config("check-config", *server, "--tls-client-ca-file", str(pki.key))  # (a key: no certificate)
    assert done.returncode == 2 and f"tls_client_ca_file {pki.key} cannot be used: NO_CERTIFICATE_OR_CRL_FOUND" \
        in done.stderr, done.stderr


def test_a_token_other_than_the_certificates_is_logged_as_such(broker_factory, pki: Pki) -> None:
    """The refusal is counted and logged with the others for want of a good token, saying
    why: the token is someone's, but not the one the certificate names."""
    port = free_port()
    b: Broker = broker_factory("--workers", "1", "--stream-port", str(port), "--tls-cert-file", str(pki.cert),
                               "--tls-key-file", str(pki.key), "--tls-client-ca-file", str(pki.client_ca),
                               "--auth-tokens-file", str(pki.tokens), env={ENV_TOKENS: ""})
    answers, closed = exchange(port, context(pki, "ci"), auth_line(ALICE) + line(CALL), 2)
    assert closed and answers[0]["error"]["code"] == -32600
    assert "tcp: refused 1 request(s) without a good bearer token so far (the last from 127.0.0.1: a token other" \
           " than its client certificate's)" in b.read_log(0.2)
    assert ALICE not in b.read_log()
