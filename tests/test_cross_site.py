"""Web pages must not be able to call the tools (issue 9 item 11).

A browser sends a cross-site POST without asking first (no CORS preflight) only with a
"simple" Content-Type: text/plain, a form type, or none. The broker answers 415 to any
POST that is not application/json, 403 to an `Origin` not in `allowed_origins`, and 421
to a Host name not in `allowed_hosts` (DNS rebinding: the page's own origin, the socket
on loopback). First raw sockets for each rule, then a real browser (Debian's chromium,
headless, installed by `make chromium-bin`) against a real broker, with pages served
from another loopback port and from a rebound name. Each browser test has a positive
control: the same page is allowed to call when the broker is configured to allow it, so
a page that could not reach the broker at all would fail the test.

The tool is tests/apps/ledger.py's `record(mark)`, which appends to a file: the file
says whether a call ran, whatever the page could or could not read.
"""

from __future__ import annotations

import html
import http.client
import http.server
import json
import re
import shutil
import socket
import struct
import subprocess
import threading
import time
import typing
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import (
    Broker,
    free_port,
    listen_port,
    read_until_closed,
    sample,
    scrape_metrics,
    start_broker,
    wait_for,
)

from broker import config

pytestmark = pytest.mark.usefixtures("event_loop_name")  # (on both event loops: conftest.BOTH_LOOPS)

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
LEDGER_APP = ("--workers", "1", "--app", "tests.apps.ledger:registry")


def marks(ledger: Path) -> list[str]:
    """The marks `record` has written, in order."""
    return ledger.read_text().splitlines() if ledger.exists() else []


def record(mark: str, id_: object = 1) -> bytes:
    return json.dumps({"jsonrpc": "2.0", "method": "record", "params": [mark], "id": id_}).encode()


def request(body: bytes, *, host: str | None = "127.0.0.1", content_type: str | None = "application/json",
            origin: str | None = None, method: str = "POST", path: str = "/", version: str = "HTTP/1.1",
            extra: str = "") -> bytes:
    """A raw HTTP request with exactly the headers asked for (None: header absent)."""
    lines = [f"{method} {path} {version}"]
    if host is not None:
        lines.append(f"Host: {host}")
    if content_type is not None:
        lines.append(f"Content-Type: {content_type}")
    if origin is not None:
        lines.append(f"Origin: {origin}")
    if method == "POST":
        lines.append(f"Content-Length: {len(body)}")
    head = "\r\n".join(lines) + "\r\n" + extra + "\r\n"
    return head.encode("latin-1") + (body if method == "POST" else b"")


def exchange(b: Broker, raw: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send one raw request on a fresh connection; return (status, lower-cased headers, body)."""
    with socket.create_connection((b.host.strip("[]"), b.port), timeout=15) as s:
        s.sendall(raw)
        response = http.client.HTTPResponse(s)
        response.begin()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()


def assert_refused(status: int, body: bytes, expected: int, why: str) -> None:
    """A refusal: the HTTP status, and a JSON-RPC Invalid Request error object (id null)."""
    assert status == expected, body
    answer = json.loads(body)
    assert answer["jsonrpc"] == "2.0" and answer["id"] is None, answer
    assert answer["error"]["code"] == -32600, answer
    assert why in answer["error"]["data"], answer


@pytest.fixture(scope="module")
def ledger_broker(event_loop_name: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Broker, Path]]:
    """A broker with default settings serving the ledger app, and its ledger file."""
    ledger = tmp_path_factory.mktemp("ledger") / "calls.txt"
    b = start_broker(*LEDGER_APP, env={"LEDGER_FILE": str(ledger)})
    yield b, ledger
    assert b.stop() == 0, b.read_log()


# -- Content-Type ------------------------------------------------------------------------


@pytest.mark.parametrize("content_type", [
    "application/json", "Application/JSON", "application/json; charset=utf-8",
    "application/json;charset=UTF-8", "application/json ; charset=utf-8", 'application/json; charset="utf-8"',
    "application/json; charset=utf8", "application/json; version=2",
    # quoted pairs, and a ";" in a quoted value (round 86: 415)
    'application/json; charset="utf\\-8"', 'application/json; x="a;charset=latin1"', "application/json;",
])
def test_json_content_types_are_served(ledger_broker, content_type):
    b, ledger = ledger_broker
    before = len(marks(ledger))
    status, _, body = exchange(b, request(record(content_type), content_type=content_type))
    assert status == 200, body
    assert json.loads(body)["result"] == before + 1
    assert marks(ledger)[-1] == content_type


@pytest.mark.parametrize(("coding", "first"), [("gzip", False), ("br", True), ("gzip, identity", False)])
def test_a_body_with_a_content_coding_gets_415_saying_so_and_runs_nothing(ledger_broker, coding, first):
    """Hostile testing (round 34): Content-Encoding was ignored: a gzip body got 400 -32700,
    and a plain body labelled gzip or br ran. The broker decodes no content coding: 415,
    with Accept-Encoding saying what it takes (RFC 9110 15.5.16), whichever header came
    first; `identity` is no coding."""
    b, ledger = ledger_broker
    before = marks(ledger)
    body = record("coded")
    if first:  # (before Content-Type)
        raw = (f"POST / HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Encoding: {coding}\r\n"
               f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body
    else:
        raw = request(body, extra=f"Content-Encoding: {coding}\r\n")
    status, headers, answer = exchange(b, raw)
    assert_refused(status, answer, 415, "Content-Encoding is not supported")
    assert headers["accept-encoding"] == "identity"
    # No coding: identity, an empty value, empty list elements (RFC 9110 5.6.1.2; round 35: 415)
    for i, value in enumerate(["Identity", "", ",identity,", " , "]):
        status, _, answer = exchange(b, request(record(f"identity{i}"), extra=f"Content-Encoding: {value}\r\n"))
        assert status == 200, (value, answer)
    assert marks(ledger) == [*before, "identity0", "identity1", "identity2", "identity3"]


# -- Host --------------------------------------------------------------------------------


@pytest.mark.parametrize("host", [
    "localhost", "LocalHost:1", "127.0.0.1", "127.0.0.1:65535", "[::1]", "[::1]:8080",
    # an empty port (RFC 3986 3.2.3), after a name or an IPv6 literal alike (round 9: [::1]: was 421)
    "localhost:", "127.0.0.1:", "[::1]:",
    # white space after the value is not part of it (RFC 9112 5; round 10: 421)
    "127.0.0.1 ", "localhost\t",
])
def test_loopback_hosts_with_any_port_are_served(ledger_broker, host):
    b, _ = ledger_broker
    status, _, body = exchange(b, request(record(host), host=host))
    assert status == 200, body


_NOT_JSON = "Content-Type must be application/json"
_NOT_HOST = "Host not in allowed_hosts"


@pytest.mark.parametrize(("header", "status", "why"), [
    *(({"content_type": t}, 415, _NOT_JSON) for t in (
        None, "text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x", "application/jsonx", "application/json-rpc", "json", "",
        # JSON has one charset, UTF-8 (RFC 8259 8.1; round 44: latin1 was taken, its body read as UTF-8)
        "application/json; charset=latin1", "application/json;charset=ISO-8859-1", 'application/json; charset="utf-16"',
        # a quoted value not closed, or a quote in a token (round 83: these were taken)
        'application/json; charset="utf-8', 'application/json; charset=utf-8"', 'application/json; charset="',
        'application/json; version="2', "application/json; charset", "application/json; =x")),
    *(({"host": h}, 421, _NOT_HOST) for h in (
        "rebind.test", "rebind.test:8080", "localhost.rebind.test", "127.0.0.1.nip.io:80", "localhost:80:80",
        "localhost:http", "[::1]x", "[::2]:80", "", "0.0.0.1",
        # (hostile testing, round 9: these were served)
        "[::1", "localhost:99999999999999999999", "127.0.0.1:65536")),
    # Two Content-Type lines: which one a proxy or the browser's CORS check read is anyone's
    # guess (a "simple" text/plain request followed by a JSON one), so neither counts.
    ({"content_type": "text/plain", "extra": "Content-Type: application/json\r\n"}, 415, _NOT_JSON),
    ({"extra": "content-type: application/json\r\n"}, 415, _NOT_JSON),
], ids=repr)
def test_refused_requests_run_nothing(ledger_broker, header, status, why):
    b, ledger = ledger_broker
    before = marks(ledger)
    answer_status, _, body = exchange(b, request(record("refused"), **header))
    assert_refused(answer_status, body, status, why)
    assert marks(ledger) == before


def test_a_second_host_line_is_400_and_runs_nothing(ledger_broker):
    """More than one Host field: 400, as bad HTTP (RFC 9112 3.2); it was 421."""
    b, ledger = ledger_broker
    before = marks(ledger)
    status, _, body = exchange(b, request(record("refused"), extra="Host: rebind.test\r\n"))
    assert (status, json.loads(body)) == (400, {"error": "more than one Host header (RFC 9112 3.2)"})
    assert marks(ledger) == before


def test_a_missing_host_is_400_on_http11_and_served_on_http10(ledger_broker):
    # RFC 9112 3.2: HTTP/1.1 requires Host. HTTP/1.0 had none, and no browser omits it.
    b, ledger = ledger_broker
    status, _, body = exchange(b, request(record("no host 1.1"), host=None))
    assert_refused(status, body, 400, "Host header required")
    status, _, body = exchange(b, request(record("no host 1.0"), host=None, version="HTTP/1.0"))
    assert status == 200, body
    assert marks(ledger)[-1] == "no host 1.0"


@pytest.mark.parametrize(("header", "status"), [
    ({}, 200), ({"version": "HTTP/1.0", "host": None}, 200), ({"host": None}, 400),
    ({"host": "rebind.test"}, 421), ({"content_type": "text/plain"}, 415), ({"origin": "http://rebind.test"}, 403),
], ids=repr)
def test_an_h2c_upgrade_whose_body_comes_later_gets_the_same_checks(ledger_broker, header, status):
    """An Upgrade request's body is read by a second parser (test_http_hardening.py):
    its answer is decided as for any POST, on the request's own version and headers."""
    b, ledger = ledger_broker
    before = marks(ledger)
    body = record("upgrade")
    raw = request(body, extra="Connection: Upgrade\r\nUpgrade: h2c\r\nExpect: 100-continue\r\n", **header)
    # 100 Continue only for a call that will be served, on HTTP/1.1 (RFC 9110 10.1.1).
    continue_ = b"HTTP/1.1 100 Continue\r\n\r\n" if status == 200 and "version" not in header else b""
    with socket.create_connection((b.host, b.port), timeout=15) as s:
        s.sendall(raw[: len(raw) - len(body)])  # the head, then the body in a read of its own
        received = b""
        while len(received) < len(continue_) and (chunk := s.recv(len(continue_) - len(received))):
            received += chunk
        assert received == continue_  # the head is read
        if not continue_:
            time.sleep(0.2)  # nothing to wait for: give the head a read of its own
        s.sendall(body)
        response = http.client.HTTPResponse(s)
        response.begin()  # (would skip a 100: the one answer's status line is checked below)
        answer = response.read()
    assert response.status == status, answer
    assert marks(ledger) == ([*before, "upgrade"] if status == 200 else before)


def test_metrics_checks_the_host_and_the_probes_do_not(ledger_broker):
    """/metrics names the methods: a rebound page must not read it. The probes tell nothing,
    and kubelet sends the pod IP as Host, so they answer whatever the Host or Origin."""
    b, _ = ledger_broker
    status, _, body = exchange(b, request(b"", method="GET", path="/metrics", host="rebind.test:80"))
    assert status == 421 and json.loads(body) == {"error": "Host not in allowed_hosts"}
    status, _, body = exchange(b, request(b"", method="GET", path="/metrics", host="127.0.0.1",
                                          origin="http://rebind.test"))
    assert status == 403, body
    # A HEAD answer has no body, refused or not (RFC 9110 9.3.2): the next response would be misread.
    for path in ("/metrics", "/"):
        with socket.create_connection((b.host, b.port), timeout=15) as s:
            s.sendall(request(b"", method="HEAD", path=path, host="rebind.test") * 2)
            data = b""
            while data.count(b"\r\n\r\n") < 2:
                data += s.recv(65536)
            first, second = data.split(b"\r\n\r\n")[:2]
            assert first.startswith(b"HTTP/1.1 421 ") and second.startswith(b"HTTP/1.1 421 "), (path, data)
    status, headers, _ = exchange(b, request(b"", method="GET", path="/metrics", host="localhost:9"))
    assert status == 200 and headers["content-type"].startswith("text/plain")
    for path in ("/healthz", "/readyz"):
        raw = request(b"", method="GET", path=path, host="10.1.2.3:8080", origin="http://rebind.test")
        assert exchange(b, raw)[0] == 200, path


# -- Origin ------------------------------------------------------------------------------


@pytest.mark.parametrize("origin", ["http://rebind.test", "null", "http://127.0.0.1:1", "http://localhost"])
def test_origins_not_allowed_get_403_and_run_nothing(ledger_broker, origin):
    b, ledger = ledger_broker
    before = marks(ledger)
    status, _, body = exchange(b, request(record("refused"), origin=origin))
    assert_refused(status, body, 403, f"Origin not in allowed_origins: {origin}")
    # A preflight from it is refused too (no CORS headers: the browser stops there).
    preflight = request(b"", method="OPTIONS", origin=origin, extra="Access-Control-Request-Method: POST\r\n")
    status, headers, _ = exchange(b, preflight)
    assert status == 403 and "access-control-allow-origin" not in headers
    assert marks(ledger) == before


def test_an_allowed_origin_gets_cors_headers(broker_factory, tmp_path):
    ledger = tmp_path / "calls.txt"
    b = broker_factory(*LEDGER_APP, "--allowed-origins", "http://app.test:3000,https://other.test",
                       env={"LEDGER_FILE": str(ledger)})
    preflight = request(b"", method="OPTIONS", origin="http://app.test:3000",
                        extra="Access-Control-Request-Method: POST\r\nAccess-Control-Request-Headers: content-type\r\n")
    status, headers, _ = exchange(b, preflight)
    assert status == 204
    assert headers["access-control-allow-origin"] == "http://app.test:3000"
    assert "POST" in headers["access-control-allow-methods"]
    assert headers["access-control-allow-headers"] == "content-type, authorization"  # (a bearer token: README, Authentication)
    assert headers["vary"] == "origin"
    # The origin is compared case-insensitively, and echoed as sent.
    status, headers, body = exchange(b, request(record("cors"), origin="HTTP://APP.test:3000"))
    assert status == 200 and json.loads(body)["result"] == 1
    assert headers["access-control-allow-origin"] == "HTTP://APP.test:3000"
    # Whitespace after it is no part of it (RFC 9110 5.5; round 86: 403)
    status, headers, body = exchange(b, request(record("ws"), origin="http://app.test:3000 \t"))
    assert status == 200 and headers["access-control-allow-origin"] == "http://app.test:3000", body
    notification = json.dumps({"jsonrpc": "2.0", "method": "record", "params": ["note"]}).encode()
    status, headers, _ = exchange(b, request(notification, origin="https://other.test"))
    assert status == 204 and headers["access-control-allow-origin"] == "https://other.test"
    wait_for(lambda: marks(ledger) == ["cors", "ws", "note"])
    # Still only application/json, and only the listed origins.
    # Refused, it can read why (round 34: a 415 and a 413 had no CORS headers, as 400 has)
    status, headers, body = exchange(b, request(record("x"), origin="http://app.test:3000", content_type="text/plain"))
    assert_refused(status, body, 415, "Content-Type")
    assert (headers["access-control-allow-origin"], headers["vary"]) == ("http://app.test:3000", "origin")
    too_large = request(b"", origin="http://app.test:3000").replace(b"Content-Length: 0", b"Content-Length: 99999999")
    status, headers, body = exchange(b, too_large)
    assert status == 413 and json.loads(body)["error"]["code"] == -32600, body
    assert (headers["access-control-allow-origin"], headers["vary"]) == ("http://app.test:3000", "origin")
    status, _, body = exchange(b, request(record("x"), origin="http://app.test:3001"))
    assert_refused(status, body, 403, "Origin not in allowed_origins")
    # Two Origin headers, the last allowed: none is (hostile testing, round 7: the last one
    # was checked)
    status, _, body = exchange(b, request(record("x"), origin="http://evil.test",
                                          extra="Origin: http://app.test:3000\r\n"))
    assert_refused(status, body, 403, "Origin not in allowed_origins")
    assert marks(ledger) == ["cors", "ws", "note"]


# -- settings ----------------------------------------------------------------------------


def test_star_turns_the_host_check_off(broker_factory, tmp_path):
    b = broker_factory(*LEDGER_APP, "--allowed-hosts", "*", env={"LEDGER_FILE": str(tmp_path / "l")})
    assert exchange(b, request(record("a"), host="rebind.test:80"))[0] == 200
    assert exchange(b, request(record("b"), host=None))[0] == 200
    assert exchange(b, request(b"", method="GET", path="/metrics", host="any.test"))[0] == 200
    status, _, body = exchange(b, request(record("c"), host="rebind.test", content_type="text/plain"))
    assert_refused(status, body, 415, "Content-Type")
    assert marks(tmp_path / "l") == ["a", "b"]


def test_listed_hosts_replace_the_loopback_names_and_the_bind_address_stays(broker_factory, tmp_path):
    b = broker_factory(*LEDGER_APP, "--allowed-hosts", "API.example", "--allowed-hosts", "fd00::1",
                       env={"LEDGER_FILE": str(tmp_path / "l")})
    assert exchange(b, request(record("a"), host="api.example:443"))[0] == 200
    assert exchange(b, request(record("b"), host="[FD00::1]:80"))[0] == 200
    assert exchange(b, request(record("c"), host="127.0.0.1:1"))[0] == 200  # the bind address (--host)
    assert exchange(b, request(record("d"), host="localhost"))[0] == 421
    assert marks(tmp_path / "l") == ["a", "b", "c"]


def test_allowed_hosts_and_origins_settings_are_parsed_and_checked():
    cfg = config.load(None, {"RPC_BROKER_ALLOWED_HOSTS": " a.example, 10.0.0.1 ,fd00::1,",
                             "RPC_BROKER_ALLOWED_ORIGINS": "https://a.example"}, {})
    assert cfg.allowed_hosts == ("a.example", "10.0.0.1", "fd00::1")
    assert cfg.allowed_origins == ("https://a.example",)
    assert config.Config().allowed_hosts == ("localhost", "127.0.0.1", "[::1]")
    assert config.Config().allowed_origins == ()
    for bad in ("a b", "http://a.example", "a.example:80", "a/b"):
        with pytest.raises(config.ConfigError, match="RPC_BROKER_ALLOWED_HOSTS"):
            config.load(None, {"RPC_BROKER_ALLOWED_HOSTS": bad}, {})
    for bad in ("a.example", "https://a.example/", "https://a.example/path"):
        with pytest.raises(config.ConfigError, match="allowed_origins"):
            config.load(None, {}, {"allowed_origins": [bad]})


# -- the refusals are answers like the others ----------------------------------------------


def test_refusals_and_cors_answers_have_a_date_and_are_counted_by_path(broker_factory, tmp_path):
    """Every answer carries `Date` (RFC 9110 6.6.1) and is counted in
    rpc_broker_http_responses_total under its path: the refusals and CORS answers too."""
    b = broker_factory(*LEDGER_APP, "--allowed-origins", "http://app.test",
                       env={"LEDGER_FILE": str(tmp_path / "l")})
    note = json.dumps({"jsonrpc": "2.0", "method": "record", "params": ["note"]}).encode()
    cases = [  # (request, status, path label)
        (request(record("a"), content_type="text/plain"), 415, "rpc"),
        (request(record("a"), host="rebind.test"), 421, "rpc"),
        (request(record("a"), origin="http://rebind.test"), 403, "rpc"),
        (request(record("a"), host=None), 400, "rpc"),
        (request(b"", method="OPTIONS", origin="http://app.test",
                 extra="Access-Control-Request-Method: POST\r\n"), 204, "rpc"),
        (request(record("cors"), origin="http://app.test"), 200, "rpc"),
        (request(note, origin="http://app.test"), 204, "rpc"),
        (request(b"", method="GET", path="/metrics", host="rebind.test"), 421, "metrics"),
        (request(b"", method="GET", path="/metrics", origin="http://rebind.test"), 403, "metrics"),
    ]
    name = "rpc_broker_http_responses_total"
    for raw, expected, path in cases:
        before = scrape_metrics(b)
        status, headers, body = exchange(b, raw)
        assert status == expected, (raw, body)
        assert headers["date"].endswith(" GMT"), headers
        after = scrape_metrics(b)  # (this scrape's own answer is counted after it is made)
        moved = {key: after[key] - before.get(key, 0.0) for key in after
                 if key[0] == name and after[key] != before.get(key, 0.0)}
        assert moved == {(name, (("path", path), ("status", str(expected)))): 1.0,
                         (name, (("path", "metrics"), ("status", "200"))): 1.0}, raw


# -- a real browser ----------------------------------------------------------------------

needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="chromium not installed (make chromium-bin)")

_OUTCOME = re.compile(r'<pre id="outcome">(.*?)</pre>', re.S)

# Fired from a page of another origin. The no-cors POSTs are what any site can send
# without a preflight (their answers are opaque to the page, so only the ledger tells
# whether the tool ran); the last fetch is an ordinary CORS call, preflighted.
CROSS_SITE_PAGE = """<!doctype html><html><body><pre id="outcome"></pre><script>
const target = "%(target)s";
// (The newline ends the body as a line, for the NDJSON stream port.)
const call = (mark) => JSON.stringify({jsonrpc: "2.0", method: "record", params: [mark], id: 1}) + "\\n";
const noCors = (body, headers) => fetch(target, {method: "POST", mode: "no-cors", body, headers});
(async () => {
  const out = {sent: 0, failed: []};
  const tries = [
    () => noCors(call("no-cors text/plain")),
    () => noCors(new Blob([call("no-cors no type")])),
    () => noCors(new Blob([call("no-cors form type")], {type: "application/x-www-form-urlencoded"})),
    () => noCors(call("no-cors json header"), {"content-type": "application/json"}),
  ];
  for (const t of tries) {
    try { await t(); out.sent += 1; } catch (e) { out.failed.push(String(e)); }
  }
  try {
    const r = await fetch(target, {method: "POST", headers: {"content-type": "application/json"},
                                   body: call("cors")});
    out.cors = {status: r.status, body: await r.text()};
  } catch (e) { out.cors = {error: String(e)}; }
  document.getElementById("outcome").textContent = JSON.stringify(out);
})();
</script></body></html>"""

# Served from http://rebind.test:PORT/, PORT the broker's port to be: once the page is
# loaded, the attacker's name "resolves" to loopback (the test closes the page server and
# starts the broker on its port), and the page's same-origin POST reaches the broker,
# which would let it read the answer.
REBIND_PAGE = """<!doctype html><html><body><pre id="outcome"></pre><script>
(async () => {
  let out;
  try {
    await fetch("/wait");
    const r = await fetch("/", {method: "POST", headers: {"content-type": "application/json"},
      body: JSON.stringify({jsonrpc: "2.0", method: "record", params: ["rebind"], id: 7})});
    out = {status: r.status, body: await r.text()};
  } catch (e) { out = {error: String(e)}; }
  document.getElementById("outcome").textContent = JSON.stringify(out);
})();
</script></body></html>"""


class PageServer(http.server.ThreadingHTTPServer):
    """The attacker's web server on a loopback port: GET /page is the page; GET /wait
    (with `hold`) answers only once `release` is set, so the test can act meanwhile."""

    daemon_threads = True
    block_on_close = False

    def __init__(self, page: str, hold: bool = False) -> None:
        self.page = page.encode()
        self.waiting = threading.Event()  # the page has asked for /wait
        self.release = threading.Event()
        self.hold = hold
        self.sockets: list[socket.socket] = []  # every connection accepted
        self.held: socket.socket | None = None  # the one /wait is held on
        super().__init__(("127.0.0.1", listen_port()), _PageHandler)
        self.port = self.server_address[1]
        self.thread = threading.Thread(target=self.serve_forever, daemon=True)
        self.thread.start()

    def process_request(self, request: socket.socket, client_address: object) -> None:  # type: ignore[override]
        self.sockets.append(request)
        super().process_request(request, client_address)

    def stop(self) -> None:
        """Stop accepting, close the listening socket and every connection but the one
        /wait is held on. Chromium preconnects spare sockets to an origin: one left open
        here would carry the page's next request to this server instead of the broker
        (a 501 for its POST, seen under load)."""
        self.shutdown()
        self.server_close()
        self.thread.join(10)
        for sock in self.sockets:
            if sock is not self.held:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


class _PageHandler(http.server.BaseHTTPRequestHandler):
    server: PageServer
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        if self.path == "/page":
            self._send(b"text/html", self.server.page)
        elif self.path == "/wait" and self.server.hold:
            self.server.held = self.connection
            self.server.waiting.set()
            self.server.release.wait(60)
            self._send(b"text/plain", b"go")
        else:
            self._send(b"text/plain", b"", status=404)

    def _send(self, content_type: bytes, body: bytes, status: int = 200) -> None:
        # Connection: close, so that no idle connection to this server is left for the
        # browser to reuse once the name points at the broker.
        self.close_connection = True
        self.send_response(status)
        self.send_header("Content-Type", content_type.decode())
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


def chromium(url: str, profile: Path) -> subprocess.Popen[bytes]:
    """Headless chromium loading `url` and printing its DOM when the page is done (virtual
    time stands still while a fetch is under way; the budget bounds the rest)."""
    assert CHROMIUM is not None
    argv = [
        CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--no-default-browser-check",
        "--disable-background-networking", "--disable-extensions", "--disable-sync", "--disable-dev-shm-usage",
        f"--user-data-dir={profile}", "--host-resolver-rules=MAP rebind.test 127.0.0.1",
        "--virtual-time-budget=20000", "--dump-dom", url,
    ]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)


def page_outcome(proc: subprocess.Popen[bytes]) -> dict[str, object]:
    """What the page wrote into its `outcome` element (chromium is killed past 90 s)."""
    try:
        out, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    m = _OUTCOME.search(out.decode())
    assert m and m.group(1), f"no outcome in the page: {out.decode()!r}\n{err.decode()[-2000:]}"
    return typing_dict(json.loads(html.unescape(m.group(1))))


def typing_dict(value: object) -> dict[str, object]:
    assert isinstance(value, dict), value
    return value


def http_responses(b: Broker, status: str) -> float:
    return sample(scrape_metrics(b), "rpc_broker_http_responses_total", path="rpc", status=status)


def cross_site(tmp_path: Path, page_server: PageServer) -> dict[str, object]:
    return page_outcome(chromium(f"http://127.0.0.1:{page_server.port}/page", tmp_path / "profile"))


@needs_chromium
def test_a_page_from_another_port_cannot_run_a_tool(broker_factory, tmp_path):
    ledger = tmp_path / "calls.txt"
    b = broker_factory(*LEDGER_APP, env={"LEDGER_FILE": str(ledger)})
    server = PageServer(CROSS_SITE_PAGE % {"target": f"http://127.0.0.1:{b.port}/"})
    try:
        refused = http_responses(b, "403")
        outcome = cross_site(tmp_path, server)
    finally:
        server.stop()
    # Every no-cors POST was sent (its opaque answer came back), the CORS call's preflight
    # was refused, and nothing ran. The broker saw them all: 4 POSTs and 1 preflight, 403.
    assert marks(ledger) == []
    assert outcome["sent"] == 4, outcome
    assert "error" in typing_dict(outcome["cors"]), outcome
    assert http_responses(b, "403") - refused == 5


@needs_chromium
def test_a_page_from_an_allowed_origin_can_call_but_not_without_json(broker_factory, tmp_path):
    """The positive control: with the page's origin in allowed_origins its CORS call runs
    and it reads the answer; its no-cors POSTs still get 415 and run nothing."""
    ledger = tmp_path / "calls.txt"
    server = PageServer("")
    try:
        b = broker_factory(*LEDGER_APP, "--allowed-origins", f"http://127.0.0.1:{server.port}",
                           env={"LEDGER_FILE": str(ledger)})
        server.page = (CROSS_SITE_PAGE % {"target": f"http://localhost:{b.port}/"}).encode()
        unsupported = http_responses(b, "415")
        outcome = cross_site(tmp_path, server)
    finally:
        server.stop()
    assert outcome["sent"] == 4, outcome
    cors = typing_dict(outcome["cors"])
    assert cors.get("status") == 200, outcome
    assert json.loads(str(cors["body"])) == {"jsonrpc": "2.0", "id": 1, "result": 1}
    assert http_responses(b, "415") - unsupported == 4
    assert marks(ledger) == ["cors"]


# An MCP client in a page of an allowed origin: initialize (2025-11-25: a session), then what the
# page can read of the answer's headers, and a tools/list in the session it was given.
MCP_PAGE = """<!doctype html><html><body><pre id="outcome"></pre><script>
const target = "%(target)s";
const headers = {"content-type": "application/json", "accept": "application/json, text/event-stream"};
(async () => {
  const out = {};
  try {
    const r = await fetch(target, {method: "POST", headers, body: JSON.stringify({jsonrpc: "2.0", id: 1,
      method: "initialize", params: {protocolVersion: "2025-11-25", capabilities: {},
      clientInfo: {name: "page", version: "1"}}})});
    out.status = r.status;
    out.session = r.headers.get("mcp-session-id");
    await r.text();
    const l = await fetch(target, {method: "POST", headers: {...headers, "mcp-session-id": out.session || "",
      "mcp-protocol-version": "2025-11-25"}, body: JSON.stringify({jsonrpc: "2.0", id: 2, method: "tools/list"})});
    out.list = {status: l.status, body: await l.text()};
  } catch (e) { out.error = String(e); }
  document.getElementById("outcome").textContent = JSON.stringify(out);
})();
</script></body></html>"""


@needs_chromium
def test_a_page_from_an_allowed_origin_reads_its_mcp_session(broker_factory, tmp_path):
    """Hostile testing, round 131: `Access-Control-Expose-Headers: mcp-session-id` came on the
    preflight only, where a browser does not read it: a page's MCP client never saw its session
    (null), so it could neither cancel its calls nor end the session."""
    server = PageServer("")
    try:
        b = broker_factory("--allowed-origins", f"http://127.0.0.1:{server.port}")
        server.page = (MCP_PAGE % {"target": f"http://localhost:{b.port}/mcp"}).encode()
        outcome = cross_site(tmp_path, server)
    finally:
        server.stop()
    assert outcome.get("status") == 200 and isinstance(outcome.get("session"), str) and outcome["session"], outcome
    listed = typing_dict(outcome["list"])
    assert listed["status"] == 200 and "tools" in json.loads(str(listed["body"]))["result"], outcome


def assert_only_ndjson_ran(b: Broker, port: int, ledger: Path) -> None:
    """The stream port still serves a real NDJSON call, and the ledger holds only that one:
    nothing sent after an HTTP request line ran."""
    with socket.create_connection((b.host, port), timeout=15) as s:
        s.sendall(record("ndjson") + b"\n")
        assert json.loads(s.makefile("rb").readline())["result"] == 1
    assert marks(ledger) == ["ndjson"]


@pytest.mark.parametrize("version", ["HTTP/1.1", "HTTP/1.0", "HTTP/2.0"])
def test_an_http_request_on_the_stream_port_closes_it(broker_factory, tmp_path, version):
    """A browser can POST to the NDJSON port too: its head comes as lines before a body
    that is a valid call. The request line is answered with one error line saying so, and
    the connection closes before the body is read. (Any version: an `HTTP/2.0` request
    line was taken for a bad JSON line, and the body after the head ran.)"""
    ledger, port = tmp_path / "calls.txt", free_port()
    b = broker_factory(*LEDGER_APP, "--stream-port", str(port), env={"LEDGER_FILE": str(ledger)})
    assert_closed_as_http(b, port, ledger, request(record("http") + b"\n", content_type="text/plain", version=version))


@pytest.mark.parametrize("finished", [True, False], ids=["whole request", "request line never ends"])
def test_an_http_request_line_longer_than_max_body_bytes_closes_the_stream_port(broker_factory, tmp_path, finished):
    """A page can make the request line longer than max_body_bytes (a URL of megabytes):
    it is found as soon as the line is too long, by its start (`POST /...`), and closed on
    as a short one is, before the headers and the body (a valid call) are read."""
    ledger, port = tmp_path / "calls.txt", free_port()
    b = broker_factory(*LEDGER_APP, "--stream-port", str(port), "--max-body-bytes", "4096",
                       env={"LEDGER_FILE": str(ledger)})
    raw = request(record("long url") + b"\n", content_type="text/plain", path="/" + "a" * 300_000)
    if not finished:
        raw = raw[: raw.index(b" HTTP/1.1")]
    received = b""
    with socket.create_connection((b.host, port), timeout=15) as s:
        try:
            s.sendall(raw)
            while chunk := s.recv(65536):  # (a timeout here: the connection stayed open)
                received += chunk
        except ConnectionResetError:  # closed with bytes unread: the error line may be lost
            pass
    assert not received or received.count(b"\n") == 1, received[:500]
    if received:
        error = json.loads(received)
        assert error["id"] is None and error["error"]["code"] == -32600, received
        assert "an HTTP request" in error["error"]["data"]
    assert_only_ndjson_ran(b, port, ledger)


@needs_chromium
def test_a_page_cannot_run_a_tool_through_the_stream_port(broker_factory, tmp_path):
    ledger, port = tmp_path / "calls.txt", free_port()
    b = broker_factory(*LEDGER_APP, "--stream-port", str(port), env={"LEDGER_FILE": str(ledger)})
    server = PageServer(CROSS_SITE_PAGE % {"target": f"http://127.0.0.1:{port}/"})
    try:
        outcome = cross_site(tmp_path, server)
    finally:
        server.stop()
    assert marks(ledger) == []
    assert outcome["sent"] == 0 and len(typing.cast(list[str], outcome["failed"])) == 4, outcome
    assert b.call("record", ["after"])["result"] == 1  # the broker still serves


def rebind(tmp_path: Path, broker_flags: list[str], ledger: Path) -> tuple[dict[str, object], Broker]:
    """Load REBIND_PAGE from http://rebind.test:PORT/page, then put the broker on PORT."""
    server = PageServer(REBIND_PAGE, hold=True)
    port = server.port
    browser = chromium(f"http://rebind.test:{port}/page", tmp_path / "profile")
    b: Broker | None = None
    try:
        wait_for(lambda: server.waiting.is_set() or browser.poll() is not None, timeout=60)
        assert server.waiting.is_set(), "the page never asked for /wait"
        server.stop()  # the /wait connection stays open: the page waits on it
        flags = [f.replace("PORT", str(port)) for f in broker_flags]
        b = start_broker(*LEDGER_APP, "--port", str(port), *flags, env={"LEDGER_FILE": str(ledger)})
        server.release.set()
        return page_outcome(browser), b
    except BaseException:
        if b is not None:
            b.stop()
        raise
    finally:
        server.release.set()
        if browser.poll() is None:
            browser.kill()
            browser.wait(10)


@needs_chromium
def test_a_rebound_page_cannot_run_a_tool_or_read_the_answer(tmp_path):
    ledger = tmp_path / "calls.txt"
    outcome, b = rebind(tmp_path, [], ledger)
    try:
        assert marks(ledger) == []
        assert outcome.get("status") == 421, outcome
        assert "Host not in allowed_hosts: rebind.test:" in str(outcome["body"])
    finally:
        assert b.stop() == 0, b.read_log()


@needs_chromium
def test_a_rebound_page_can_call_when_its_name_is_allowed(tmp_path):
    """The positive control: the same rebound page, with its name and origin allowed
    (as a deployment under that name would be), reads the answer, and the tool ran."""
    ledger = tmp_path / "calls.txt"
    outcome, b = rebind(tmp_path, ["--allowed-hosts", "rebind.test", "--allowed-origins", "http://rebind.test:PORT"],
                        ledger)
    try:
        assert outcome.get("status") == 200, outcome
        assert json.loads(str(outcome["body"])) == {"jsonrpc": "2.0", "id": 7, "result": 1}
        assert marks(ledger) == ["rebind"]
    finally:
        assert b.stop() == 0, b.read_log()


def client_hello(ticket: bytes) -> bytes:
    """A TLS 1.2 ClientHello record (RFC 5246 7.4.1.2) with SNI and a SessionTicket
    extension (RFC 5077) holding `ticket`: bytes a server chose in an earlier session."""

    def ext(kind: int, data: bytes) -> bytes:
        return struct.pack(">HH", kind, len(data)) + data

    name = b"attacker.example"
    exts = ext(0, struct.pack(">HBH", len(name) + 3, 0, len(name)) + name) + ext(0x0023, ticket)
    body = (b"\x03\x03" + bytes(range(32)).replace(b"\n", b"x") + b"\x00" + struct.pack(">H", 4)
            + b"\x13\x01\xc0\x2f" + b"\x01\x00" + struct.pack(">H", len(exts)) + exts)
    handshake = b"\x01" + struct.pack(">I", len(body))[1:] + body
    return b"\x16\x03\x01" + struct.pack(">H", len(handshake)) + handshake


def assert_closed_as_http(b: Broker, port: int, ledger: Path, raw: bytes) -> None:
    """`raw`, sent to the stream port, gets one error line saying it is an HTTP request,
    then the close; the call in its body did not run."""
    with socket.create_connection((b.host, port), timeout=15) as s:
        s.sendall(raw)
        received = read_until_closed(s)
    error = json.loads(received)  # one line
    assert error["id"] is None and error["error"]["code"] == -32600, received
    assert "an HTTP request" in error["error"]["data"], received
    assert_only_ndjson_ran(b, port, ledger)


@pytest.mark.parametrize("method", ["patch", "Patch", "M-SEARCH", "JSONRPCCALLS"])
def test_an_http_request_of_any_method_on_the_stream_port_closes_it(broker_factory, tmp_path, method):
    """Hostile testing (round 7): the request line was recognized only with 3 to 10
    upper-case letters for its method, but browsers send every method other than the six
    they normalize as written (`fetch(url, {method: "patch"})` after DNS rebinding needs no
    preflight): each head line got -32700, and the call in the body ran."""
    ledger, port = tmp_path / "calls.txt", free_port()
    b = broker_factory(*LEDGER_APP, "--stream-port", str(port), env={"LEDGER_FILE": str(ledger)})
    body = record("http") + b"\n"
    raw = request(body, content_type="text/plain", origin="http://evil.example", method=method,
                  extra=f"Content-Length: {len(body)}\r\n") + body
    assert_closed_as_http(b, port, ledger, raw)


@pytest.mark.parametrize("request_line", ["POST  / HTTP/1.1", "POST /\tHTTP/1.1", "POST\t/ HTTP/1.1", "POST /"])
def test_an_oddly_spaced_http_request_line_on_the_stream_port_closes_it(broker_factory, tmp_path, request_line):
    """Hostile testing (round 8): two spaces, a tab, or no version (HTTP/0.9's `GET /`)
    were not taken for a request line, which lenient HTTP clients and proxies may send:
    each head line got -32700, and the call in the body ran."""
    ledger, port = tmp_path / "calls.txt", free_port()
    b = broker_factory(*LEDGER_APP, "--stream-port", str(port), env={"LEDGER_FILE": str(ledger)})
    body = record("http") + b"\n"
    raw = request(body, content_type="text/plain", origin="http://evil.example") + body
    raw = request_line.encode() + raw[raw.index(b"\r\n"):]
    assert_closed_as_http(b, port, ledger, raw)


@pytest.mark.parametrize("first", ["tls", "not ascii"])
def test_a_tls_client_hello_on_the_stream_port_closes_it_before_a_call_it_carries(broker_factory, tmp_path, first):
    """Hostile testing (round 5): a browser sent to https://127.0.0.1:PORT/ after DNS
    rebinding sends a TLS ClientHello whose session ticket its attacker's server chose
    (the ALPACA attack). Its binary first line got -32700, the connection stayed open, and
    the call in the ticket ran. A line starting with a control byte (TLS records start
    with 0x16) or a non-ASCII one is another protocol: one -32700 line, then the close."""
    ledger, port = tmp_path / "calls.txt", free_port()
    b = broker_factory(*LEDGER_APP, "--stream-port", str(port), env={"LEDGER_FILE": str(ledger)})
    carried = b"\n" + record("tls") + b"\n"
    raw = client_hello(carried) if first == "tls" else "\u00e9t\u00e9".encode() + carried
    received = b""
    with socket.create_connection((b.host, port), timeout=15) as s:
        s.sendall(raw)
        try:
            while chunk := s.recv(65536):  # (a timeout here: the connection stayed open)
                received += chunk
        except ConnectionResetError:
            pass
    error = json.loads(received)  # one line
    assert error["id"] is None and error["error"]["code"] == -32700, received
    assert "not JSON text" in error["error"]["data"]
    assert_only_ndjson_ran(b, port, ledger)
