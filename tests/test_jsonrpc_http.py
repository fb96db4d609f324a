"""JSON-RPC 2.0 spec-exactness, end to end: real HTTP on loopback against the real daemon.

What a client sees on the wire, checked against the specification
(https://www.jsonrpc.org/specification) and the JSONTestSuite corpus (tests/data/JSONTestSuite, MIT):

- every example of the spec's section 7, kept as data files in tests/data/spec_examples/
  and replayed by one test;
- ids echoed byte for byte (checked on the raw response bytes), null ids, repeated ids;
- invalid Request objects (-32600, id echoed when it is a valid id), unknown and
  reserved methods (-32601), bad params (-32602 with data naming the parameter);
- the limits (--max-batch, --max-body-bytes, --max-depth, nesting the parser cannot take);
- JSONTestSuite: n_ bodies are parse errors, y_ values round-trip through `echo`, i_ values
  never break anything;
- a hypothesis property over random bytes, JSON values and JSON-RPC-shaped bodies, with a
  model of the answer each one is owed.

Decisions the spec leaves to us, as the broker makes them (tests hold them):
- an id is any JSON string or number the JSON grammar allows, kept as its exact text:
  `1.5e3`, `-0`, `1E400`, `18446744073709551617` are valid and echoed as sent; `01`, `+1`,
  `.5`, `1.`, `NaN`, `0x10` are not JSON at all (-32700);
- `params: null` is not a structured value: -32600;
- an element that is not a valid Request object is answered (-32600) even without `id`,
  as the spec's own `{"foo": "boo"}` example is;
- HTTP: 204 and an empty body when nothing is owed; 400 for a single -32700/-32600
  answer; 200 for a batch and for other single answers (`broker.jsonrpc.ERRORS`).
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

import msgspec
import pytest
from conftest import TESTDATA, sample, scrape_metrics
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from broker.jsonrpc import http_status

pytestmark = pytest.mark.usefixtures("event_loop_name")  # (on both event loops: conftest.BOTH_LOOPS)

SPEC_EXAMPLES = Path(__file__).resolve().parent / "data" / "spec_examples"
JSONTESTSUITE = TESTDATA / "JSONTestSuite" / "test_parsing"
CLIENT_TIMEOUT = 10.0  # seconds: a hang fails the test instead of stalling the run

PARSE_ERROR = {"jsonrpc": "2.0", "id": None, "error": {"code": -32700, "message": "Parse error"}}
INVALID_NULL = {"jsonrpc": "2.0", "id": None, "error": {"code": -32600, "message": "Invalid Request"}}
NOT_FOUND = {"code": -32601, "message": "Method not found"}
INVALID_REQUEST = {"code": -32600, "message": "Invalid Request"}

# The demo registry (broker.demo) serves these; `fib` and `sleep` are served but kept
# out of the random inputs (CPU-heavy or slow by design).
SERVED = frozenset({"subtract", "sum", "update", "notify_hello", "get_data", "echo", "add",
                    "sleep", "fib", "worker_info"})


# --- helpers -------------------------------------------------------------------------


def loads(body: bytes) -> object:
    """Decode a response body; bytes that are not UTF-8 (passed through from a request, see
    the i_ tests) survive as surrogate escapes. NaN/Infinity are not JSON: refused."""
    def no_constants(name: str) -> object:
        raise ValueError(f"not JSON: {name}")
    return json.loads(body.decode("utf-8", "surrogateescape"), parse_constant=no_constants)


def exact(text: bytes | str) -> object:
    """Decode JSON keeping every number's type and exact text: `1.0` != `1`, `1e5` != `100000.0`."""
    return json.loads(text, parse_int=lambda s: ("int", s), parse_float=lambda s: ("float", s))


class _Id(msgspec.Struct):
    id: msgspec.Raw = msgspec.Raw()


_raw_one = msgspec.json.Decoder(_Id)
_raw_many = msgspec.json.Decoder(list[_Id])


def raw_ids(body: bytes) -> list[bytes]:
    """The exact bytes of each response's `id` member, as the broker wrote them."""
    if body.lstrip().startswith(b"["):
        return [bytes(r.id) for r in _raw_many.decode(body)]
    return [bytes(_raw_one.decode(body).id)]


def check_response(obj: object) -> dict[str, object]:
    """Assert `obj` is one well-formed Response object (spec section 5); return it."""
    assert type(obj) is dict, obj
    assert obj.get("jsonrpc") == "2.0", obj
    assert "id" in obj and (obj["id"] is None or type(obj["id"]) in (str, int, float)), obj
    assert set(obj) in ({"jsonrpc", "id", "result"}, {"jsonrpc", "id", "error"}), obj
    if "error" in obj:
        e = obj["error"]
        assert type(e) is dict and type(e.get("code")) is int and type(e.get("message")) is str, obj
        assert set(e) <= {"code", "message", "data"}, obj
    return obj


def check_answer(status: int, headers: dict[str, str], body: bytes) -> object:
    """Assert an HTTP answer to a POST is well formed; return the decoded body (None if 204)."""
    assert status < 500, (status, body)
    if status == 204:
        assert body == b"", body
        return None
    assert headers.get("content-type") == "application/json", headers
    decoded = loads(body)
    if type(decoded) is list:
        assert decoded, "a batch answer is never an empty array"
        assert status == 200, status
        for r in decoded:
            check_response(r)
    else:
        r = check_response(decoded)
        expected = http_status(r["error"]["code"]) if "error" in r else 200  # type: ignore[index]
        assert status == expected, (status, body)
    return decoded


def post(broker, body: bytes | str) -> tuple[int, bytes, object]:
    """POST `body`; check the answer is well formed; return (status, raw body, decoded)."""
    status, headers, raw = broker.post(body, timeout=CLIENT_TIMEOUT)
    return status, raw, check_answer(status, headers, raw)


def call_body(method: str, params: bytes | None, id_: bytes | None = b"1") -> bytes:
    body = b'{"jsonrpc":"2.0","method":' + json.dumps(method).encode()
    if params is not None:
        body += b',"params":' + params
    if id_ is not None:
        body += b',"id":' + id_
    return body + b"}"


def assert_healthy(broker) -> None:
    """A normal call still works, and nothing crashed in the daemon or its workers."""
    assert broker.call("subtract", [42, 23], timeout=CLIENT_TIMEOUT) == {"jsonrpc": "2.0", "id": 1, "result": 19}
    log = broker.read_log()
    assert "Traceback" not in log and " ERROR " not in log, log[-4000:]
    assert broker.proc.poll() is None


# --- 1. the spec's examples, as data files -----------------------------------------------


def parse_example(text: bytes) -> list[tuple[bytes, bytes | None]]:
    """(request bytes, expected response bytes or None) for each `-->` of a spec example.

    A line starting "--> " or "<-- " opens a section; other lines continue the open one
    (batches span lines); "#" lines are comments. No "<--", or "<-- //...", means no answer.
    """
    sections: list[tuple[bytes, list[bytes]]] = []
    for line in text.splitlines():
        if line.startswith(b"#"):
            continue
        if line[:4] in (b"--> ", b"<-- "):
            sections.append((line[:3], [line[4:]]))
        else:
            assert sections, f"text before the first '-->': {line!r}"
            sections[-1][1].append(line)
    exchanges: list[tuple[bytes, bytes | None]] = []
    for arrow, lines in sections:
        data = b"\n".join(lines)
        if arrow == b"-->":
            exchanges.append((data, None))
        else:
            assert exchanges and exchanges[-1][1] is None, "a '<--' without its '-->'"
            exchanges[-1] = (exchanges[-1][0], None if data.startswith(b"//") else data)
    return exchanges


SPEC_FILES = sorted(SPEC_EXAMPLES.glob("*.txt"))


def test_spec_examples_are_all_there():
    # Section 7 has twelve examples; each file holds one, with at least one request.
    assert len(SPEC_FILES) == 12, SPEC_FILES
    for path in SPEC_FILES:
        assert parse_example(path.read_bytes()), path.name


@pytest.mark.parametrize("path", SPEC_FILES, ids=[p.stem for p in SPEC_FILES])
def test_spec_example(broker, path):
    for request, expected in parse_example(path.read_bytes()):
        status, raw, answer = post(broker, request)
        if expected is None:
            assert (status, raw) == (204, b""), (request, raw)
            continue
        want = json.loads(expected)
        # An error object "may" carry `data` (section 5.1), which the spec's examples leave
        # out: the broker's -32600 says there which member is wrong (a string).
        for got, owed in zip(answer if type(answer) is list else [answer], want if type(want) is list else [want]):
            if "error" in owed and "data" not in owed["error"] and "error" in got:
                assert type(got["error"].pop("data", "")) is str, (request, raw)
        # Batch answers: the spec allows any order; the broker keeps request order.
        assert answer == want, (request, raw)
        assert type(answer) is type(want)


# --- 2. ids --------------------------------------------------------------------------------

VALID_IDS = [
    b'"abc"', b'"1"', b'""', b'"a\\"b\\u00e9"', '"\u00e9\u65e5"'.encode(), b"0", b"1", b"-7",
    b"18446744073709551617", b"-18446744073709551617", b"1.5e3", b"1.5E+3", b"-0", b"-0.0",
    b"1E400", b"-1e-400", b"0.1", b"123456789012345678901234567890.5", b"null",
]


@pytest.mark.parametrize("id_", VALID_IDS, ids=[i.decode() for i in VALID_IDS])
def test_id_echoed_byte_for_byte(broker, id_):
    status, raw, answer = post(broker, call_body("echo", b'["x"]', id_))
    assert status == 200
    assert raw_ids(raw) == [id_]  # the raw bytes, not a re-encoding of the decoded value
    assert answer["result"] == ["x"]
    # ... also for an error answer and inside a batch
    _, raw, answer = post(broker, call_body("foobar", None, id_))
    assert raw_ids(raw) == [id_] and answer["error"] == NOT_FOUND
    _, raw, _ = post(broker, b"[" + call_body("echo", b"[1]", id_) + b"," + call_body("nope", None, id_) + b"]")
    assert raw_ids(raw) == [id_, id_]


def test_null_id_is_answered_not_a_notification(broker):
    status, raw, answer = post(broker, b'{"jsonrpc":"2.0","method":"subtract","params":[5,3],"id":null}')
    assert (status, answer) == (200, {"jsonrpc": "2.0", "id": None, "result": 2})
    assert b'"id":null' in raw
    _, _, answer = post(broker, b'{"jsonrpc":"2.0","method":"foobar","id":null}')
    assert answer == {"jsonrpc": "2.0", "id": None, "error": NOT_FOUND}


NOT_JSON_IDS = [b"01", b"+1", b".5", b"1.", b"1e", b"-", b"NaN", b"Infinity", b"-Infinity", b"0x10",
                b"'1'", b"undefined", b"1_000"]


@pytest.mark.parametrize("id_", NOT_JSON_IDS, ids=[i.decode() for i in NOT_JSON_IDS])
def test_id_that_is_not_json_is_a_parse_error(broker, id_):
    status, _, answer = post(broker, call_body("echo", b"[1]", id_))
    assert (status, answer) == (400, PARSE_ERROR)


@pytest.mark.parametrize("id_", [b"true", b"false", b"{}", b'{"a":1}', b"[]", b"[1]"])
def test_id_of_wrong_type_is_invalid_request_with_null_id(broker, id_):
    status, _, answer = post(broker, call_body("echo", b"[1]", id_))
    assert (status, answer) == (400, {**INVALID_NULL, "error": invalid_request({"id": True, "jsonrpc": "2.0", "method": "echo"})})


def test_repeated_ids_in_a_batch_each_get_their_answer_in_order(broker):
    body = (b'[{"jsonrpc":"2.0","method":"subtract","params":[5,1],"id":1},'
            b'{"jsonrpc":"2.0","method":"subtract","params":[10,1],"id":1},'
            b'{"jsonrpc":"2.0","method":"foobar","id":1},'
            b'{"jsonrpc":"2.0","method":"subtract","params":[20,1],"id":1}]')
    status, raw, answer = post(broker, body)
    assert status == 200 and raw_ids(raw) == [b"1"] * 4
    assert answer == [
        {"jsonrpc": "2.0", "id": 1, "result": 4},
        {"jsonrpc": "2.0", "id": 1, "result": 9},
        {"jsonrpc": "2.0", "id": 1, "error": NOT_FOUND},
        {"jsonrpc": "2.0", "id": 1, "result": 19},
    ]


def test_string_id_and_number_id_are_distinct(broker):
    body = (b'[{"jsonrpc":"2.0","method":"echo","params":["string"],"id":"1"},'
            b'{"jsonrpc":"2.0","method":"echo","params":["number"],"id":1},'
            b'{"jsonrpc":"2.0","method":"echo","params":["float"],"id":1.0}]')
    _, raw, answer = post(broker, body)
    assert raw_ids(raw) == [b'"1"', b"1", b"1.0"]
    assert [r["result"] for r in answer] == [["string"], ["number"], ["float"]]
    assert [type(r["id"]) for r in answer] == [str, int, float]


# --- 3. invalid Request objects, unknown methods, notifications -------------------------

# (request, raw id the answer must carry)
INVALID_ELEMENTS = [
    (b'{"jsonrpc":"2.1","method":"x","id":7}', b"7"),
    (b'{"jsonrpc":"2.0 ","method":"x","id":7}', b"7"),
    (b'{"jsonrpc":"2","method":"x","id":"s"}', b'"s"'),
    (b'{"jsonrpc":2.0,"method":"x","id":7}', b"7"),
    (b'{"jsonrpc":null,"method":"x","id":7}', b"7"),
    (b'{"method":"subtract","params":[1,2],"id":7}', b"7"),
    (b'{"jsonrpc":"2.0","id":7}', b"7"),
    (b'{"jsonrpc":"2.0","method":1,"id":7}', b"7"),
    (b'{"jsonrpc":"2.0","method":null,"id":7}', b"7"),
    (b'{"jsonrpc":"2.0","method":["subtract"],"id":7}', b"7"),
    (b'{"jsonrpc":"2.0","method":"subtract","params":"bar","id":7}', b"7"),
    (b'{"jsonrpc":"2.0","method":"subtract","params":5,"id":7}', b"7"),
    (b'{"jsonrpc":"2.0","method":"subtract","params":true,"id":7}', b"7"),
    (b'{"jsonrpc":"2.0","method":"subtract","params":null,"id":7}', b"7"),
    (b'{"jsonrpc":"2.0","method":"subtract","params":[1,2],"id":true}', b"null"),
    (b'{"jsonrpc":"2.0","method":"subtract","params":[1,2],"id":{"a":1}}', b"null"),
    (b'{"jsonrpc":"2.0","method":"subtract","params":[1,2],"id":[7]}', b"null"),
    (b'{"jsonrpc":"2.1","method":"x","id":false}', b"null"),
    (b'{"jsonrpc":"2.1","method":"x","id":null}', b"null"),
    (b'{"jsonrpc":"2.1","method":"x"}', b"null"),  # no id, but not a Request: answered
    (b'{"jsonrpc":"2.0","method":1,"params":"bar"}', b"null"),
    (b'{"foo":"boo"}', b"null"),
    (b"{}", b"null"),
    (b"1", b"null"),
    (b'"subtract"', b"null"),
    (b"null", b"null"),
    (b"true", b"null"),
    (b"3.5", b"null"),
]


@pytest.mark.parametrize("element,id_", INVALID_ELEMENTS, ids=[e.decode() for e, _ in INVALID_ELEMENTS])
def test_invalid_request_object(broker, element, id_):
    # alone: one -32600 object, HTTP 400
    status, raw, answer = post(broker, element)
    assert status == 400 and raw_ids(raw) == [id_], raw
    assert answer["error"] == invalid_request(json.loads(element))
    # in a batch between two good calls: its own answer, in its place
    body = b'[{"jsonrpc":"2.0","method":"sum","params":[1,2],"id":"a"},' + element + \
           b',{"jsonrpc":"2.0","method":"sum","params":[3],"id":"b"}]'
    status, raw, answer = post(broker, body)
    assert status == 200 and raw_ids(raw) == [b'"a"', id_, b'"b"'], raw
    assert [r.get("result", r.get("error")) for r in answer] == [3, invalid_request(json.loads(element)), 3]


def test_invalid_utf8_in_envelope_is_a_parse_error(broker):
    # Not JSON text (RFC 8259 section 8.1): once crashed the codec into a non-JSON-RPC
    # "bad HTTP request" answer and a closed connection.
    for body in (b'{"jsonrpc":"2.0","method":"sub\xfftract","params":[1,2],"id":1}',
                 b'[{"jsonrpc":"2.\xff","method":"subtract","params":[1,2],"id":1}]'):
        status, _, answer = post(broker, body)
        assert (status, answer) == (400, PARSE_ERROR)


@pytest.mark.parametrize("method", ["rpc.Discover", "rpc.discover ", "rpc.", "rpc.subtract", "Subtract", "SUBTRACT",
                                    "subtract ", " subtract", "sum\u0000", "", "foo.get", "\u00e9"])
def test_unknown_and_reserved_methods(broker, method):
    status, _, answer = post(broker, call_body(method, b"[42,23]", b"7"))
    assert (status, answer) == (200, {"jsonrpc": "2.0", "id": 7, "error": NOT_FOUND})
    # as a notification: nothing at all
    status, raw, _ = post(broker, call_body(method, b"[42,23]", None))
    assert (status, raw) == (204, b"")


@pytest.mark.parametrize("params", [None, b'["a"]', b"[1,2,3]", b'{"minuend":1}', b'{"x":1}', b"[[[[1]]]]"])
def test_notification_with_bad_params_gets_nothing(broker, params):
    status, raw, _ = post(broker, call_body("subtract", params, None))
    assert (status, raw) == (204, b"")
    # in a batch: only the call is answered
    body = b"[" + call_body("subtract", params, None) + b"," + call_body("get_data", None, b"9") + b"]"
    _, _, answer = post(broker, body)
    assert answer == [{"jsonrpc": "2.0", "id": 9, "result": ["hello", 5]}]


def test_batch_of_only_notifications_including_unknown_ones(broker):
    body = b"[" + b",".join([call_body("update", b"[1]", None), call_body("nope", None, None),
                             call_body("rpc.x", b"{}", None), call_body("sum", b'["a"]', None)]) + b"]"
    status, raw, _ = post(broker, body)
    assert (status, raw) == (204, b"")


# --- 4. limits ---------------------------------------------------------------------------


def raw_exchange(broker, data: bytes, timeout: float = CLIENT_TIMEOUT) -> bytes:
    """Send raw bytes on a fresh connection; return all that comes back until the broker
    closes (or half-closes) the connection."""
    with socket.create_connection((broker.host, broker.port), timeout=timeout) as s:
        try:
            s.sendall(data)
        except OSError:  # the broker may stop reading early; its answer is what counts
            pass
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
        return b"".join(chunks)


def split_http(response: bytes) -> tuple[int, bytes, bytes]:
    head, _, body = response.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), head.lower(), body


def padded(body: bytes, size: int) -> bytes:
    """`body` followed by JSON whitespace up to exactly `size` bytes."""
    assert len(body) <= size
    return body + b" " * (size - len(body))


def too_large_answer(limit: int) -> dict[str, object]:
    return {"jsonrpc": "2.0", "id": None, "error": {
        "code": -32600, "message": "Invalid Request", "data": f"body exceeds max_body_bytes {limit}"}}


def test_max_batch(broker_factory):
    b = broker_factory("--workers", "1", "--max-batch", "3")
    element = b'{"jsonrpc":"2.0","method":"sum","params":[1],"id":1}'
    status, _, answer = post(b, b"[" + b",".join([element] * 3) + b"]")
    assert status == 200 and len(answer) == 3  # at the limit: served
    for n in (4, 50):
        status, _, answer = post(b, b"[" + b",".join([element] * n) + b"]")
        assert status == 400 and type(answer) is dict  # one error object, not an array
        assert answer == {"jsonrpc": "2.0", "id": None, "error": {
            "code": -32600, "message": "Invalid Request", "data": f"batch of {n} elements exceeds max_batch 3"}}
    # also when the batch is made of invalid elements (the slow path)
    status, _, answer = post(b, b"[1,2,3,4]")
    assert status == 400 and answer["error"]["code"] == -32600 and "max_batch 3" in answer["error"]["data"]
    assert_healthy(b)


def test_max_body_bytes(broker_factory):
    limit = 2048
    b = broker_factory("--workers", "1", "--max-body-bytes", str(limit))
    call = call_body("echo", b'["x"]', b"1")
    # exactly at the limit: served
    status, _, answer = post(b, padded(call, limit))
    assert (status, answer) == (200, {"jsonrpc": "2.0", "id": 1, "result": ["x"]})
    # one byte over, and far over (a client still sending when the 413 is written must
    # still get to read it: the broker half-closes instead of resetting the connection)
    for size in (limit + 1, 100_000, 3_000_000):
        status, headers, raw = b.post(padded(call, size), timeout=CLIENT_TIMEOUT)
        assert status == 413, (size, status, raw)
        assert headers.get("connection") == "close"
        assert loads(raw) == too_large_answer(limit)
    # chunked: no Content-Length, counted as the chunks arrive
    for size in (limit + 1, 3_000_000):
        body = padded(call, size)
        response = raw_exchange(b, b"POST / HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                                   b"Transfer-Encoding: chunked\r\n\r\n"
                                   + b"".join(b"%x\r\n%s\r\n" % (len(body[i:i + 1000]), body[i:i + 1000])
                                              for i in range(0, len(body), 1000)) + b"0\r\n\r\n")
        status, head, payload = split_http(response)
        assert status == 413 and loads(payload) == too_large_answer(limit), response[:300]
    # Expect: 100-continue with a Content-Length over the limit: 413 at once, no 100
    # (a JSON call: one without Content-Type, which may not call, gets a plain 413)
    response = raw_exchange(b, b"POST / HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                               b"Content-Length: 10000000\r\nExpect: 100-continue\r\n\r\n")
    status, head, payload = split_http(response)
    assert status == 413 and b"100 continue" not in head and loads(payload) == too_large_answer(limit)
    assert_healthy(b)


def nested(depth: int, inner: bytes = b"1") -> bytes:
    return b"[" * depth + inner + b"]" * depth


def test_max_depth_of_params(broker_factory):
    b = broker_factory("--workers", "1", "--max-depth", "4")
    too_deep = {"code": -32600, "message": "Invalid Request", "data": "params nest deeper than max_depth 4"}
    # `update` takes anything: depth 4 (the params array counts) is served ...
    status, _, answer = post(b, call_body("update", nested(4)))
    assert (status, answer) == (200, {"jsonrpc": "2.0", "id": 1, "result": None})
    # ... depth 5 is refused, by position and by name, with the id echoed
    status, _, answer = post(b, call_body("update", nested(5)))
    assert (status, answer) == (400, {"jsonrpc": "2.0", "id": 1, "error": too_deep})
    status, _, answer = post(b, call_body("subtract", b'{"minuend":' + nested(4) + b',"subtrahend":1}'))
    assert (status, answer) == (400, {"jsonrpc": "2.0", "id": 1, "error": too_deep})
    # named, depth 4: past the depth check, refused by the type check instead
    _, _, answer = post(b, call_body("subtract", b'{"minuend":' + nested(3) + b',"subtrahend":1}'))
    assert answer["error"]["code"] == -32602 and answer["error"]["data"]["param"] == "minuend"
    # in a batch (HTTP 200), and as a notification (nothing)
    _, _, answer = post(b, b"[" + call_body("update", nested(5), b"2") + b"," + call_body("sum", b"[1]", b"3") + b"]")
    assert answer == [{"jsonrpc": "2.0", "id": 2, "error": too_deep}, {"jsonrpc": "2.0", "id": 3, "result": 1}]
    status, raw, _ = post(b, call_body("update", nested(50), None))
    assert (status, raw) == (204, b"")
    assert_healthy(b)


def parser_limit_error(id_: object, what: str, answer: object) -> None:
    """`answer` is the -32600 owed to a request that nests past the JSON parser's limit."""
    assert type(answer) is dict
    assert answer["id"] == id_
    error = answer["error"]
    assert (error["code"], error["message"]) == (-32600, "Invalid Request")
    assert error["data"].startswith(f"{what} deeper than the JSON parser's limit of about ")


@pytest.mark.parametrize("depth", [1100, 100_000])
def test_params_past_the_parser_limit_keep_their_id_and_the_batch(broker, depth):
    """Issue 9 item 2: the deep call gets its own answer with its own id; add(1,2) is served."""
    deep = call_body("echo", nested(depth, b""), b"1")
    status, _, answer = post(broker, b"[" + deep + b"," + call_body("add", b"[1,2]", b"2") + b"]")
    assert status == 200 and type(answer) is list and len(answer) == 2
    parser_limit_error(1, "params nest", answer[0])
    assert answer[1] == {"jsonrpc": "2.0", "id": 2, "result": 3}
    # alone, and with its id after the params
    status, _, answer = post(broker, b'{"jsonrpc":"2.0","method":"echo","params":' + nested(depth, b"") + b',"id":"x"}')
    assert status == 400
    parser_limit_error("x", "params nest", answer)
    assert_healthy(broker)


def dropped_invalid(broker) -> float:
    """rpc_broker_notifications_dropped_total{reason="invalid_request"} now."""
    return sample(scrape_metrics(broker), "rpc_broker_notifications_dropped_total", reason="invalid_request")


@pytest.mark.parametrize("depth", [1100, 100_000])
def test_notification_past_the_parser_limit_gets_nothing(broker, depth):
    """Hostile testing (F6): a valid notification whose params nest past the parser's
    limit was answered 400 with a -32600 (id null); one 100 deep got 204. Both are
    notifications (section 4.1: no reply): the too-deep one cannot be forwarded, so it
    is dropped, and counted as such. In a batch it gets no slot; a batch of only such
    notifications gets no answer at all."""
    before = dropped_invalid(broker)
    deep_note = call_body("echo", nested(depth, b""), None)
    assert post(broker, call_body("echo", nested(100, b""), None))[:2] == (204, b"")
    assert post(broker, deep_note)[:2] == (204, b"")
    other = b'{"jsonrpc":"2.0","method":"echo","params":[1],"x":' + nested(depth, b"") + b"}"  # no id member
    assert post(broker, other)[:2] == (204, b"")
    _, _, answer = post(broker, b"[" + deep_note + b"," + call_body("add", b"[1,2]", b"2") + b"," + other + b"]")
    assert answer == [{"jsonrpc": "2.0", "id": 2, "result": 3}]
    assert post(broker, b"[" + deep_note + b"," + other + b"," + deep_note + b"]")[:2] == (204, b"")
    # an id member, even one too deep (an invalid id), makes it a call: answered
    status, _, answer = post(broker, call_body("echo", b"[]", nested(depth, b"")))
    assert status == 400
    parser_limit_error(None, "the request nests", answer)
    assert dropped_invalid(broker) - before == 1 + 1 + 2 + 3
    assert_healthy(broker)


def test_body_nested_far_too_deep(broker):
    limit = "not JSON, and nested deeper than the JSON parser's limit of about "
    status, _, answer = post(broker, nested(100_000, b""))  # JSON: a batch of one array
    assert (status, answer) == (200, [{**INVALID_NULL, "error": invalid_request([])}])
    status, _, answer = post(broker, b'{"a":' * 100_000 + b"1" + b"}" * 100_000)
    assert status == 400
    parser_limit_error(None, "the request nests", answer)
    for body in (
        b"[" * 100_000,  # never closed: not JSON whatever its depth
        b'{"a":' * 100_000,
        b"[" * 1100 + b'"' + b'\\"' * 16000,  # issue 9 item 1: 33 KB that took 7 s
    ):
        status, _, answer = post(broker, body)
        assert status == 400 and answer["id"] is None, body[:40]  # type: ignore[index]
        error = answer["error"]  # type: ignore[index]
        assert (error["code"], error["message"]) == (-32700, "Parse error") and error["data"].startswith(limit)
    status, _, answer = post(broker, b'["' + b"[" * 100_000)
    assert (status, answer) == (400, PARSE_ERROR)
    assert_healthy(broker)


# --- 5. invalid params ---------------------------------------------------------------------


INVALID_PARAMS = [
    ("subtract", b'[42,"23"]', "subtrahend", None),
    ("subtract", b'["42",23]', "minuend", None),
    ("subtract", b'{"minuend":42,"subtrahend":"23"}', "subtrahend", None),
    ("subtract", b"[true,1]", "minuend", None),
    ("subtract", b"[42,null]", "subtrahend", None),
    ("subtract", b"[1,2,3]", None, "too many positional params: takes at most 2, got 3"),
    ("subtract", b"[1]", "subtrahend", "missing required parameter"),
    ("subtract", b"[]", "minuend", "missing required parameter"),
    ("subtract", None, "minuend", "missing required parameter"),
    ("subtract", b'{"minuend":1}', "subtrahend", "missing required parameter"),
    ("subtract", b'{"minuend":1,"subtrahend":2,"x":3}', "x", "unexpected parameter"),
    ("subtract", b'{"Minuend":1,"subtrahend":2}', None, None),
    ("get_data", b"[1]", None, "too many positional params: takes at most 0, got 1"),
    ("get_data", b'{"a":1}', "a", "unexpected parameter"),
    ("sum", b'[1,"2"]', None, None),
    # A number past a double's range (valid JSON that msgspec cannot hold) names its
    # parameter too: in an array by place, in an object by key (issue 9).
    ("subtract", b"[42,1e400]", "subtrahend", "Number out of range"),
    ("subtract", b"[-1e400,1]", "minuend", "Number out of range"),
    ("subtract", b'{"subtrahend":1,"minuend":1e400}', "minuend", "Number out of range"),
    ("subtract", b"[[1,1e400],1]", "minuend", "Number out of range - at `minuend[1]`"),
    ("subtract", b'{"minuend":{"x":[1e400]},"subtrahend":1}', "minuend", "Number out of range - at `minuend[...][0]`"),
    ("sum", b"[1,2,1e400]", "values", "Number out of range (params[2])"),
    ("sum", b"[1,[2,1e400]]", "values", "Number out of range - at `params[1][1]`"),
    ("subtract", b"[1,2,1e400]", None, "Number out of range - at `$[2]`"),
]


@pytest.mark.parametrize("method,params,param,reason", INVALID_PARAMS,
                         ids=[f"{m}:{p.decode() if p else '-'}" for m, p, _, _ in INVALID_PARAMS])
def test_invalid_params(broker, method, params, param, reason):
    status, _, answer = post(broker, call_body(method, params, b'"p"'))
    assert status == 200
    assert answer["id"] == "p" and "result" not in answer, answer
    error = answer["error"]
    assert (error["code"], error["message"]) == (-32602, "Invalid params"), answer
    data = error["data"]
    assert set(data) == {"param", "reason"} and type(data["reason"]) is str and data["reason"], data
    if param is not None or reason is not None:
        assert data["param"] == param, data
    if reason is not None:
        assert data["reason"] == reason, data


# --- 6. JSONTestSuite --------------------------------------------------------------------------


def _suite(prefix: str) -> list[Path]:
    return sorted(JSONTESTSUITE.glob(prefix + "_*.json"))


def test_jsontestsuite_is_there():
    # The corpus is in the repository (tests/data/JSONTestSuite): a missing one is a failure.
    assert len(_suite("n")) > 150 and len(_suite("y")) > 90 and len(_suite("i")) > 30, JSONTESTSUITE


@pytest.mark.parametrize("path", _suite("n"), ids=lambda p: p.name)
def test_jsontestsuite_n_body_is_parse_error(broker, path):
    status, _, answer = post(broker, path.read_bytes())
    data = answer["error"].pop("data", None)  # type: ignore[index]
    assert data is None or data.startswith("not JSON, and nested deeper than the JSON parser's limit")
    assert (status, answer) == (400, PARSE_ERROR)


def echo_body(value: bytes) -> bytes:
    return b'{"jsonrpc":"2.0","method":"echo","params":[' + value + b'],"id":1}'


def compact(value: bytes) -> bytes:
    """`value` (valid JSON) without the whitespace outside its strings, as a returned
    msgspec.Raw is sent (one NDJSON line): everything else byte for byte."""
    out = bytearray()
    in_string = escaped = False
    for byte in value:
        if in_string:
            escaped, in_string = (not escaped and byte == 0x5C), (escaped or byte != 0x22)
        elif byte in b" \t\r\n":
            continue
        else:
            in_string = byte == 0x22
        out.append(byte)
    return bytes(out)


class _Result(msgspec.Struct):
    result: msgspec.Raw


@pytest.mark.parametrize("path", _suite("y"), ids=lambda p: p.name)
def test_jsontestsuite_y_value_round_trips_through_echo(broker, path):
    data = path.read_bytes()
    status, raw, answer = post(broker, echo_body(data))
    assert status == 200 and set(answer) == {"jsonrpc", "id", "result"}, raw
    # equal as JSON values, types and number texts kept ...
    assert exact(raw)["result"] == exact(b"[" + data + b"]")  # type: ignore[index]
    # ... and byte for byte but for whitespace outside strings (a result is one NDJSON line)
    assert bytes(msgspec.json.decode(raw, type=_Result).result) == compact(b"[" + data + b"]")


def _expected_for_value(value: object) -> tuple[int, object]:
    """(status, answer) owed for a body that is valid JSON but (like every y_ file) holds no
    valid Request object: scalars and objects get one -32600, arrays one per element."""
    if type(value) is not list:
        return 400, {"jsonrpc": "2.0", "id": expected_id(value), "error": invalid_request(value)}
    if not value:
        return 400, INVALID_NULL
    return 200, [{"jsonrpc": "2.0", "id": expected_id(v), "error": invalid_request(v)} for v in value]


@pytest.mark.parametrize("path", _suite("y"), ids=lambda p: p.name)
def test_jsontestsuite_y_body_is_invalid_request_not_parse_error(broker, path):
    data = path.read_bytes()
    value = json.loads(data)
    assert classify(value) == "invalid" or (type(value) is list and all(classify(v) == "invalid" for v in value))
    status, raw, answer = post(broker, data)
    assert (status, answer) == _expected_for_value(value), raw


NUMBERS = [p for p in _suite("y") + _suite("i") if "number" in p.name]


@pytest.mark.parametrize(
    "value",
    [b"1e400", b"-1e400", b"1E-400", b"9" * 5000, b"-" + b"1" * 5000 + b".5e99999"]
    + [p.read_bytes().strip() for p in NUMBERS],
    ids=lambda v: v[:24].decode(errors="replace"),
)
def test_echo_passes_every_valid_json_number(broker, value):
    """Issue 9 item 22: raw params pass through as docs/tools.md promises, numbers no float
    or int holds included (the JSONTestSuite y_/i_ number files among them)."""
    status, _, raw = broker.post(echo_body(value), timeout=CLIENT_TIMEOUT)  # 5000 digits: past json.loads
    assert (status, raw) == (200, b'{"jsonrpc":"2.0","id":1,"result":[' + compact(value) + b"]}")


def test_jsontestsuite_number_files_are_there():
    assert len([p for p in NUMBERS if p.name.startswith("i_")]) >= 10


@pytest.mark.parametrize("path", _suite("i"), ids=lambda p: p.name)
def test_jsontestsuite_i_never_breaks_anything(broker, path):
    data = path.read_bytes()
    # as the param of echo: a result (the value back, byte for byte) or an error
    status, raw, answer = post(broker, echo_body(data))
    if "result" in answer:
        assert status == 200 and answer["id"] == 1
        assert bytes(msgspec.json.decode(raw, type=_Result).result) == b"[" + data + b"]"
    else:
        assert answer["error"]["code"] in (-32700, -32600, -32602), raw
    # as the body: never a Request object, so some JSON-RPC error
    status, raw, answer = post(broker, data)
    answers = answer if type(answer) is list else [answer]
    assert all(a["error"]["code"] in (-32700, -32600) for a in answers), raw


# --- 7. properties: every body gets a well-formed answer, the one it is owed --------------

MISSING = object()


def valid_id(value: object) -> bool:
    return value is None or type(value) in (str, int, float)


def invalid_request(element: object) -> dict[str, object]:
    """The -32600 error object the spec owes an invalid element (`classify` "invalid"), with
    `data` saying which member is wrong, first of jsonrpc, method, id, params (new user,
    round 100: a bare "Invalid Request" said nothing)."""
    if type(element) is not dict:
        why = "a Request object is a JSON object (a batch: an array of them)"
    elif "jsonrpc" not in element:
        why = 'member "jsonrpc" missing: it must be "2.0"'
    elif element["jsonrpc"] != "2.0":
        why = 'member "jsonrpc" must be "2.0"'
    elif "method" not in element:
        why = 'member "method" missing'
    elif type(element["method"]) is not str:
        why = 'member "method" must be a string'
    elif "id" in element and not valid_id(element["id"]):
        why = 'member "id" must be a string, a number or null'
    else:
        assert "params" in element and type(element["params"]) not in (list, dict), element
        why = 'member "params" must be an array or an object'
    return {**INVALID_REQUEST, "data": why}


def classify(element: object) -> str:
    """What the spec makes of one request element: "call", "notification" or "invalid"."""
    if type(element) is not dict:
        return "invalid"
    if element.get("jsonrpc", MISSING) != "2.0" or type(element.get("method")) is not str:
        return "invalid"
    if "params" in element and type(element["params"]) not in (list, dict):
        return "invalid"
    if "id" not in element:
        return "notification"
    return "call" if valid_id(element["id"]) else "invalid"


def expected_id(element: object) -> object:
    """The id an answer to `element` must carry: its own when valid, else null."""
    if type(element) is dict and valid_id(element.get("id")):
        return element.get("id")
    return None


def check_against_model(value: object, status: int, answer: object) -> None:
    """Assert the broker's answer to the JSON `value` is the one the spec owes it."""
    if type(value) is list:
        if not value:
            assert (status, answer) == (400, INVALID_NULL)
            return
        owed = [v for v in value if classify(v) != "notification"]
        if not owed:
            assert (status, answer) == (204, None)
            return
        assert status == 200 and type(answer) is list and len(answer) == len(owed), (value, answer)
        pairs = list(zip(owed, answer))
    else:
        if classify(value) == "notification":
            assert (status, answer) == (204, None)
            return
        assert type(answer) is dict, answer
        pairs = [(value, answer)]
    for element, response in pairs:
        assert response["id"] == expected_id(element), (element, response)
        kind = classify(element)
        if kind == "invalid":
            assert response.get("error") == invalid_request(element), (element, response)
        elif element["method"] == "rpc.discover":  # (the broker's own: tests/test_discover.py)
            if element.get("params") in (None, [], {}):
                assert response["result"]["openrpc"] == "1.3.2", (element, response)
            else:
                assert response["error"]["code"] == -32602, (element, response)
        elif element["method"] not in SERVED:
            assert response.get("error") == NOT_FOUND, (element, response)
        elif "error" in response:  # a served method: a result, or its params were wrong
            assert response["error"]["code"] == -32602, (element, response)


_text = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=8)
_scalars = (st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
            | st.floats(allow_nan=False, allow_infinity=False) | _text)
json_values = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_text, inner, max_size=4),
    max_leaves=10,
)
# methods that answer at once whatever the params (no fib, no sleep)
_methods = (st.sampled_from(["subtract", "sum", "update", "notify_hello", "get_data", "echo", "add",
                             "worker_info", "foobar", "rpc.discover", "Subtract", ""])
            | _text.filter(lambda s: s not in ("fib", "sleep")))
_numbers = st.integers(min_value=-1000, max_value=1000) | st.floats(-1e6, 1e6)
_params = (st.lists(_numbers, max_size=3) | st.dictionaries(st.sampled_from(["minuend", "subtrahend", "a", "b"]),
                                                             _numbers, max_size=3)
           | json_values)
_ids = st.none() | st.integers(min_value=-(2**70), max_value=2**70) | _text | json_values


@st.composite
def rpc_elements(draw: st.DrawFn) -> object:
    """A Request-shaped object, each member right, wrong or missing."""
    members: dict[str, object] = {}
    for name, right, wrong in (
        ("jsonrpc", st.just("2.0"), st.sampled_from(["2.1", "2", "2.0 ", "", 2.0, 2, None, True, ["2.0"]])),
        ("method", _methods, json_values),
        ("params", _params, json_values),
        ("id", _ids, json_values),
    ):
        how = draw(st.sampled_from(["right", "right", "right", "wrong", "missing"]))
        if how != "missing":
            members[name] = draw(right if how == "right" else wrong)
    extra = draw(st.dictionaries(_text.filter(lambda k: k not in ("jsonrpc", "method", "params", "id")),
                                 json_values, max_size=2))
    members.update(extra)
    order = draw(st.permutations(list(members)))
    return {k: members[k] for k in order}


rpc_bodies = rpc_elements() | st.lists(rpc_elements() | json_values, max_size=6)

_VALID_BODIES = [
    call_body("subtract", b"[42,23]"),
    call_body("echo", b'[{"a":[1,2.5,"x",null,true]}]', b'"id"'),
    b"[" + call_body("sum", b"[1,2]") + b"," + call_body("update", b"[1]", None) + b"]",
]


@st.composite
def mangled_bodies(draw: st.DrawFn) -> bytes:
    """Random bytes, or a valid body truncated, with bytes replaced or inserted."""
    if draw(st.booleans()):
        return draw(st.binary(max_size=200))
    body = bytearray(draw(st.sampled_from(_VALID_BODIES)))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["cut", "replace", "insert"]))
        at = draw(st.integers(0, len(body)))
        junk = draw(st.binary(min_size=1, max_size=3) | st.sampled_from([b"[", b"{", b'"', b",", b"\\", b"\xff"]))
        if op == "cut":
            del body[at:]
        elif op == "replace":
            body[at:at + len(junk)] = junk
        else:
            body[at:at] = junk
    return bytes(body)


_PROPERTY = settings(max_examples=200, deadline=None, print_blob=True,
                     suppress_health_check=[HealthCheck.too_slow])


def test_property_random_bytes(broker):
    @_PROPERTY
    @given(body=mangled_bodies())
    def run(body: bytes) -> None:
        post(broker, body)  # well formed, < 500, within the client timeout

    run()
    assert_healthy(broker)


@pytest.mark.parametrize("values", [json_values, rpc_bodies], ids=["json_values", "rpc_shaped_bodies"])
def test_property_bodies_get_the_answers_the_model_owes(broker, values):
    """Random JSON values, and JSON-RPC-shaped bodies with wrong members: each answer
    is the one a model of the spec owes."""

    @_PROPERTY
    @given(value=values)
    def run(value: object) -> None:
        status, _, answer = post(broker, json.dumps(value))
        check_against_model(value, status, answer)

    run()
    assert_healthy(broker)


def test_params_as_deep_as_the_front_end_passes_come_back_from_echo(broker_factory):
    """Hostile testing (round 26): with max_depth 2000, `echo` of params nested 983 deep
    (which the front-end's parser passes) was -32603 "the result is not valid JSON": the
    worker's own frames sat below msgspec's, which counts Python's recursion limit. The
    worker's limit is the front-end's plus a margin: every depth is echoed, or refused by
    the front-end (-32600, its parser's limit), never -32603."""
    b = broker_factory("--workers", "1", "--max-depth", "2000")
    echoed = []
    for depth in range(960, 1010, 3):
        _, _, raw = b.post(call_body("echo", nested(depth)), timeout=CLIENT_TIMEOUT)  # (too deep for json.loads)
        if raw.startswith(b'{"jsonrpc":"2.0","id":1,"result":'):
            assert raw == b'{"jsonrpc":"2.0","id":1,"result":' + nested(depth) + b"}", depth
            echoed.append(depth)
        else:
            error = json.loads(raw)["error"]
            assert error["code"] == -32600 and "parser's limit" in error["data"], (depth, raw)
    assert echoed and max(echoed) >= 970, echoed  # (uvloop 981 and more; asyncio, whose loop is Python's frames, 975)
