"""broker/frontend/mcp.py, sans-IO: `McpServer.handle` on messages as bytes, with a real `Catalog` of
`wire.MethodInfo`s (what a worker's HELLO carries), and `ToolCall.finish` on answers as the
dispatcher makes them. The protocol's cases the SDK never sends are here; the SDK's are in
tests/test_mcp_http.py and tests/test_mcp_stdio.py."""

from __future__ import annotations

import json
import typing

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from broker.catalog import Catalog
from broker.frontend.mcp import (
    PAGE_SIZE,
    Cancel,
    McpServer,
    Meta,
    Reply,
    Session,
    ToolCall,
    header_value,
)
from broker.frontend.mcpsessions import MAX_SESSIONS, Sessions
from broker.jsonrpc import Codec, error_object, response_error, response_result
from broker.wire import MethodInfo

MODERN = "2026-07-28"
META = {"io.modelcontextprotocol/protocolVersion": MODERN, "io.modelcontextprotocol/clientCapabilities": {}}
INT = {"type": "integer"}


def tool(name: str, wrap: bool = True) -> MethodInfo:
    schema = {"type": "object", "properties": {"a": INT}, "required": ["a"], "additionalProperties": False}
    output = {"type": "object", "properties": {"result": INT}, "required": ["result"]} if wrap else {
        "type": "object", "properties": {"total": INT}}
    return MethodInfo(name, tool=True, doc=f"{name}'s doc", input_schema=schema, output_schema=output,
                      wrap_result=wrap)


CATALOG = Catalog([tool("add"), tool("total", wrap=False), MethodInfo("plain", doc="not a tool")])


def server(catalog: Catalog = CATALOG, **kwargs: typing.Any) -> McpServer:
    return McpServer(lambda: catalog, Codec(), **kwargs)


def message(method: str, params: dict[str, object] | None = None, id_: object = 1, modern: bool = True) -> bytes:
    body: dict[str, object] = {"jsonrpc": "2.0", "method": method}
    if id_ is not None:
        body["id"] = id_
    if params is not None or modern:
        body["params"] = {**(params or {}), **({"_meta": META} if modern else {})}
    return json.dumps(body).encode()


def headers(method: str, name: str | None = None) -> Meta:
    return Meta(MODERN.encode(), method.encode(), name.encode() if name is not None else None)


def answer(outcome: object) -> tuple[int, dict[str, typing.Any]]:
    assert isinstance(outcome, Reply), outcome
    return outcome.status, json.loads(outcome.body)


def test_server_discover_says_what_is_supported() -> None:
    status, body = answer(server().handle(message("server/discover"), headers("server/discover")))
    result = body["result"]
    assert status == 200 and result["supportedVersions"][0] == MODERN and "2025-11-25" in result["supportedVersions"]
    assert result["capabilities"] == {"tools": {"listChanged": False}}
    assert result["_meta"]["io.modelcontextprotocol/serverInfo"]["name"] == "rpc-broker"
    assert (result["resultType"], result["cacheScope"]) == ("complete", "public") and result["ttlMs"] > 0


def test_tools_list_is_the_catalogue_s_tools_by_name_with_caching_hints() -> None:
    status, body = answer(server().handle(message("tools/list"), headers("tools/list")))
    result = body["result"]
    assert status == 200 and [t["name"] for t in result["tools"]] == ["add", "total"]
    assert (result["resultType"], result["cacheScope"]) == ("complete", "public") and "nextCursor" not in result
    assert result["_meta"]["io.modelcontextprotocol/serverInfo"]["name"] == "rpc-broker"
    _, legacy = answer(server().handle(message("tools/list", modern=False)))
    assert legacy["result"] == {"tools": result["tools"]}  # (no resultType, ttlMs, cacheScope before 2026-07-28)
    _, private = answer(server(private=True).handle(message("tools/list"), headers("tools/list")))
    assert private["result"]["cacheScope"] == "private"


def test_a_token_s_denied_tools_are_neither_listed_nor_called() -> None:
    s = server()
    _, body = answer(s.handle(message("tools/list"), headers("tools/list"), denied={"add"}))
    assert [t["name"] for t in body["result"]["tools"]] == ["total"]
    _, body = answer(s.handle(message("tools/call", {"name": "add", "arguments": {"a": 1}}), headers("tools/call", "add"),
                              denied={"add"}))
    assert body["error"] == {"code": -32602, "message": "Unknown tool: add"}


def test_tools_list_pages_by_cursor_and_a_bad_cursor_is_refused() -> None:
    catalog = Catalog([tool(f"t{i:03}") for i in range(PAGE_SIZE * 2 + 5)])
    s = server(catalog)
    names: list[str] = []
    cursor = None
    for _ in range(5):
        params = {} if cursor is None else {"cursor": cursor}
        _, body = answer(s.handle(message("tools/list", params), headers("tools/list")))
        names += [t["name"] for t in body["result"]["tools"]]
        cursor = body["result"].get("nextCursor")
        if cursor is None:
            break
    assert names == sorted(t.name for t in catalog._tools.values())  # (every one, once, in order)
    status, body = answer(s.handle(message("tools/list", {"cursor": "%%%"}), headers("tools/list")))
    assert (status, body["error"]["code"]) == (400, -32602)


def test_a_tools_call_becomes_a_call_of_the_tool_with_the_client_s_id_and_arguments() -> None:
    raw = message("tools/call", {"name": "add", "arguments": {"a": 1}}, id_="x-1")
    call = server().handle(raw, headers("tools/call", "add"))
    assert isinstance(call, ToolCall)
    assert (call.request.method, bytes(call.request.params), bytes(call.request.id)) == ("add", b'{"a": 1}', b'"x-1"')
    ok = json.loads(call.finish(response_result(b'"x-1"', b"2")))
    assert ok["result"].pop("_meta")["io.modelcontextprotocol/serverInfo"]["name"] == "rpc-broker"
    assert ok == {"jsonrpc": "2.0", "id": "x-1", "result": {
        "content": [{"type": "text", "text": "2"}], "structuredContent": {"result": 2}, "isError": False,
        "resultType": "complete"}}
    total = server().handle(message("tools/call", {"name": "total"}), headers("tools/call", "total"))
    assert isinstance(total, ToolCall) and not total.request.params  # (no arguments: none given to the tool)
    result = json.loads(total.finish(response_result(b"1", b'{"total":3}')))["result"]
    assert (result["structuredContent"], result["content"][0]["text"]) == ({"total": 3}, '{"total":3}')


@pytest.mark.parametrize(("error", "text"), [
    (error_object(-32602, "Invalid params", {"param": "a", "reason": "Expected `int`, got `str`"}),
     "Invalid arguments: argument 'a': Expected `int`, got `str`"),
    (error_object(-32603, "Internal error", {"type": "ZeroDivisionError"}), "Internal error: ZeroDivisionError"),
    (error_object(-32001, data={"timeout": 30.0}), 'The tool call timed out ({"timeout":30.0})'),
    (error_object(-32002, data={"pid": 7}), 'The worker process running the tool died ({"pid":7})'),
    (error_object(-32000, data="queue full"), "The server is overloaded: retry later (queue full)"),
    (error_object(1001, "discount out of range", {"discount": 2}), 'Error 1001: discount out of range ({"discount":2})'),
    # (floats msgspec's reader takes 2-20 us each for, read by float(): the same text; round 139)
    (error_object(1002, "far", {"v": [1e308, 1e23, -2.5e-300]}), 'Error 1002: far ({"v":[1e308,1e23,-2.5e-300]})'),
    (b'{"code":1003,"message":"beyond","data":[1e400]}', "Error 1003: beyond"),  # (not decoded: not shown)
])
def test_an_error_answer_is_a_tool_execution_error_with_a_readable_text(error: bytes, text: str) -> None:
    call = server().handle(message("tools/call", {"name": "add", "arguments": {}}, modern=False))
    assert isinstance(call, ToolCall)
    result = json.loads(call.finish(response_error(b"1", error)))["result"]
    assert result == {"content": [{"type": "text", "text": text}], "isError": True}  # (legacy: no resultType)


@pytest.mark.parametrize("code", [-32601, -32800])
def test_a_tool_s_own_error_codes_are_tool_errors_never_protocol_errors(code: int) -> None:
    """Hostile testing, round 123: a tool raising RpcError(-32601) was answered "Unknown tool", and one
    raising -32800 passed as the broker's "Request cancelled", its message and data the tool's."""
    call = server().handle(message("tools/call", {"name": "add"}, modern=False))
    assert isinstance(call, ToolCall)
    result = json.loads(call.finish(response_error(b"1", error_object(code, "Request cancelled", "mine"))))["result"]
    assert result["isError"] is True and result["content"][0]["text"] == f'Error {code}: Request cancelled (mine)'


@pytest.mark.parametrize(("wrap", "value", "why"), [
    (False, b"[1,2]", "array where it declares object"),
    (False, b"null", "null where it declares object"),
    (False, b"5", "number where it declares object"),
    (True, b"null", "null where it declares integer"),  # (a float's NaN is written null)
    (True, b"1.5", "number where it declares integer"),
    (True, b'"x"', "string where it declares integer"),
])
def test_a_result_that_does_not_fit_the_output_schema_is_a_tool_error(wrap: bool, value: bytes, why: str) -> None:
    """Hostile testing, round 123: structuredContent was whatever the handler returned, its declared type aside."""
    call = server().handle(message("tools/call", {"name": "add" if wrap else "total"}, modern=False))
    assert isinstance(call, ToolCall)
    result = json.loads(call.finish(response_result(b"1", value)))["result"]
    assert result == {"content": [{"type": "text", "text": f"The tool's result does not fit its outputSchema: {why}"}],
                      "isError": True}


def test_a_result_whose_call_tool_result_passes_max_response_bytes_is_a_tool_error() -> None:
    """Hostile testing, round 123: max_response_bytes held the result, and its CallToolResult (text escaped,
    and structuredContent) took up to 3 times that."""
    s = McpServer(lambda: CATALOG, Codec(), limit=1000)
    value = b'{"total":"' + b'\\"' * 200 + b'"}'  # (412 bytes, each \\" 4 as text)
    call = s.handle(message("tools/call", {"name": "total"}, modern=False))
    assert isinstance(call, ToolCall)
    text = json.loads(call.finish(response_result(b"1", value)))["result"]["content"][0]["text"]
    assert text.startswith("The tool's result, 412 bytes, takes ") and text.endswith("past max_response_bytes 1000")
    small = s.handle(message("tools/call", {"name": "total"}, modern=False))
    assert isinstance(small, ToolCall)
    assert json.loads(small.finish(response_result(b"1", b'{"total":1}')))["result"]["isError"] is False


@pytest.mark.parametrize(("body", "why"), [
    (b'[{"jsonrpc":"2.0","id":1,"method":"ping"}]', "batch"),
    (b'{"jsonrpc":"2.0","id":null,"method":"ping"}', "never null"),
    (b'{"jsonrpc":"2.0","id":1,"method":"ping","params":[1]}', "params must be an object"),
    (b'{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":5}}', "Expected `str | null`, got `int`"),
    (b'{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"add","arguments":[1]}}', "must be an object"),
    (b'{"jsonrpc":"2.0","id":1,"method":"initialize","params":{}}', "protocolVersion"),
])
def test_what_mcp_refuses_that_json_rpc_allows(body: bytes, why: str) -> None:
    status, answered = answer(server().handle(body, Meta()))
    assert status == 400 and why in json.dumps(answered["error"])


def test_a_modern_request_without_client_capabilities_is_400_with_32602() -> None:
    body = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {
        "_meta": {"io.modelcontextprotocol/protocolVersion": MODERN}}}).encode()
    status, answered = answer(server().handle(body, headers("tools/list")))
    assert (status, answered["error"]["code"]) == (400, -32602) and "clientCapabilities" in answered["error"]["data"]


def test_a_legacy_request_claiming_the_modern_version_in_its_header_is_refused() -> None:
    status, answered = answer(server().handle(message("tools/list", modern=False), headers("tools/list")))
    assert (status, answered["error"]["code"]) == (400, -32602)


def test_ping_is_legacy_only() -> None:
    assert answer(server().handle(message("ping", modern=False)))[1]["result"] == {}
    status, answered = answer(server().handle(message("ping"), headers("ping")))
    assert (status, answered["error"]["code"]) == (404, -32601)
    status, answered = answer(server().handle(message("ping")))  # (stdio: no HTTP status to speak of)
    assert (status, answered["error"]["code"]) == (200, -32601)


def test_initialize_answers_the_client_s_version_or_the_newest() -> None:
    for asked, agreed in (("2025-06-18", "2025-06-18"), ("2025-11-25", "2025-11-25"), ("1999-01-01", "2025-11-25"),
                          ("2026-07-28", "2025-11-25")):
        session = Session()
        _, body = answer(server().handle(message("initialize", {"protocolVersion": asked}, modern=False), None, session))
        assert body["result"]["protocolVersion"] == agreed == session.version


def test_http_sessions_are_minted_bounded_and_forgotten_when_idle() -> None:
    now = [0.0]
    s = server(sessions=Sessions(max_sessions=3, idle=10.0, clock=lambda: now[0]))
    ids = []
    for _ in range(4):
        reply = s.handle(message("initialize", {"protocolVersion": "2025-11-25"}, modern=False), Meta())
        assert isinstance(reply, Reply)
        ids.append(reply.headers.split(b": ")[1].strip() if reply.headers else b"")
    assert s.sessions == 3 and ids[3] == b""  # (the table full: the fourth got none, and no one's went)
    ping = message("ping", modern=False)
    assert answer(s.handle(ping, Meta(session_id=ids[0])))[0] == 200
    now[0] = 20.0
    assert answer(s.handle(ping, Meta(session_id=ids[0])))[0] == 404  # (idle past session_idle)
    assert s.sessions == 0 and MAX_SESSIONS >= 1000


@pytest.mark.parametrize("modern", [False, True])
def test_notifications_cancelled_names_a_call_of_the_session(modern: bool) -> None:
    session = Session()  # (stdio's: the process's, in either era)
    call = server().handle(message("tools/call", {"name": "add", "arguments": {"a": 1}}, id_=9, modern=modern),
                           None, session)
    assert isinstance(call, ToolCall)
    handle = object()
    call.started(handle)
    cancel = server().handle(message("notifications/cancelled", {"requestId": 9}, id_=None, modern=modern), None,
                             session)
    assert cancel == Cancel(session, b"9") and session.calls[b"9"] is handle
    call.finish(response_result(b"9", b"1"))
    assert session.calls == {}  # (answered: no longer cancellable)


@pytest.mark.parametrize(("raw", "value"), [
    (b"add", "add"), (b"=?base64?YWRk?=", "add"), (b"=?base64?SGVsbG8sIOS4lueVjA==?=", "Hello, 世界"),
    (b"=?base64?%%?=", None), (b"a\x01b", None), (b"caf\xc3\xa9", None),
])
def test_header_values_and_their_base64_form(raw: bytes, value: str | None) -> None:
    assert header_value(raw) == value


@given(st.binary(max_size=300))
def test_any_bytes_get_an_answer_or_a_call_never_an_exception(body: bytes) -> None:
    outcome = server().handle(body, Meta(b"2026-07-28", b"tools/call", b"add"), None)
    assert isinstance(outcome, (Reply, ToolCall, Cancel))
    if isinstance(outcome, Reply) and outcome.body:
        msgspec.json.decode(outcome.body)


def test_a_call_its_client_left_is_forgotten_by_its_session_and_not_a_later_one_of_its_id() -> None:
    session = Session()
    body = message("tools/call", {"name": "add", "arguments": {"a": 1}}, id_=3, modern=False)
    first, second = (server().handle(body, None, session) for _ in range(2))
    assert isinstance(first, ToolCall) and isinstance(second, ToolCall)
    first.started("first")
    second.started("second")  # (the client reused the id while the first ran)
    first.forgotten()  # (the first's connection was lost: broker/frontend/http.py, connection_lost)
    assert session.calls == {b"3": "second"}
    second.finish(response_result(b"3", b"1"))
    assert session.calls == {}


_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
                     max_leaves=8)
_METHODS = st.sampled_from(["initialize", "ping", "server/discover", "tools/list", "tools/call",
                            "notifications/initialized", "notifications/cancelled", "resources/list", "x"])
_VERSIONS = st.sampled_from([MODERN, "2025-11-25", "2024-11-05", "1900-01-01"]) | _JSON
_META_VALUES = st.fixed_dictionaries({}, optional={
    "io.modelcontextprotocol/protocolVersion": _VERSIONS, "io.modelcontextprotocol/clientCapabilities": _JSON})
_PARAMS = st.fixed_dictionaries({}, optional={
    "_meta": _META_VALUES | _JSON, "name": st.sampled_from(["add", "total", "plain", "nope"]) | _JSON,
    "arguments": _JSON, "cursor": st.text(max_size=12) | _JSON, "requestId": _JSON,
    "protocolVersion": _VERSIONS}) | _JSON
_HEADER = st.none() | st.sampled_from([b"2026-07-28", b"2025-11-25", b"tools/call", b"add", b"=?base64?YWRk?=", b""]) \
    | st.binary(max_size=12)


@given(method=_METHODS, id_=st.none() | st.integers() | st.text(max_size=5) | _JSON, has_id=st.booleans(),
       params=st.none() | _PARAMS, http=st.booleans(), headers=st.tuples(_HEADER, _HEADER, _HEADER, _HEADER),
       in_session=st.booleans())
def test_any_message_gets_an_answer_a_call_or_a_cancel_never_an_exception(
        method: str, id_: object, has_id: bool, params: object, http: bool,
        headers: tuple[bytes | None, ...], in_session: bool) -> None:
    """Hostile testing's shape of input (new user, round 111: `server/discover` without `_meta` raised, which
    ended a stdio session with its calls in flight): well-formed envelopes, any members."""
    body: dict[str, object] = {"jsonrpc": "2.0", "method": method}
    if has_id:
        body["id"] = id_
    if params is not None:
        body["params"] = params
    outcome = server().handle(json.dumps(body).encode(), Meta(*headers) if http else None,
                              Session() if in_session else None)
    assert isinstance(outcome, (Reply, ToolCall, Cancel))
    if isinstance(outcome, Reply) and outcome.body:
        answered = msgspec.json.decode(outcome.body)
        assert set(answered) == {"jsonrpc", "id", "result"} or set(answered) == {"jsonrpc", "id", "error"}
    if isinstance(outcome, ToolCall):
        outcome.finish(response_result(bytes(outcome.request.id), b"1"))


def test_a_session_is_its_client_s_alone() -> None:
    """Hostile testing, round 123: with another token, a client used, cancelled in and ended a session given its id."""
    s = server()
    reply = s.handle(message("initialize", {"protocolVersion": "2025-11-25"}, modern=False), Meta(), client="token a")
    assert isinstance(reply, Reply)
    sid = reply.headers.split(b": ")[1].strip()
    ping = message("ping", modern=False)
    assert answer(s.handle(ping, Meta(session_id=sid), client="token b"))[0] == 404
    assert not s.end_session(sid, "token b")
    assert answer(s.handle(ping, Meta(session_id=sid), client="token a"))[0] == 200
    assert s.end_session(sid, "token a") and s.sessions == 0


def test_a_client_past_its_share_of_sessions_evicts_its_own_not_another_s() -> None:
    """Hostile testing, round 123: 10,000 initialize in half a second evicted every other client's session."""
    sessions = Sessions(max_sessions=10, per_client=3)
    keep = sessions.begin("address 10.0.0.2", "2025-11-25")
    flood = [sessions.begin("address 10.0.0.1", "2025-11-25") for _ in range(100)]
    assert len(sessions) == 4 and sessions.find(keep.id.encode(), "address 10.0.0.2") is keep
    assert [sessions.find(f.id.encode(), "address 10.0.0.1") is f for f in flood[-4:]] == [False, True, True, True]
    for i in range(20):  # (round 124: past max_sessions, no one's goes: the newcomers get none)
        begun = sessions.begin(f"address 10.1.0.{i}", "2025-11-25")
        assert (begun is None) == (i >= 6)
    assert len(sessions) == 10 and sessions.find(keep.id.encode(), "address 10.0.0.2") is keep


def test_initialize_with_the_table_full_is_served_without_a_session() -> None:
    s = server(sessions=Sessions(max_sessions=1))
    first = s.handle(message("initialize", {"protocolVersion": "2025-11-25"}, modern=False), Meta(), client="a")
    second = s.handle(message("initialize", {"protocolVersion": "2025-11-25"}, modern=False), Meta(), client="b")
    assert isinstance(first, Reply) and isinstance(second, Reply)
    assert first.headers.startswith(b"mcp-session-id: ") and second.headers == b"" and second.status == 200
    assert json.loads(second.body)["result"]["protocolVersion"] == "2025-11-25"


def test_an_error_s_text_is_cut_to_fit_max_response_bytes() -> None:
    """Hostile testing, round 124: an error's text (the param's repr, or a tool's data, escaped twice) took
    max_response_bytes twice."""
    s = McpServer(lambda: CATALOG, Codec(), limit=10_000)
    call = s.handle(message("tools/call", {"name": "add"}, modern=False))
    assert isinstance(call, ToolCall)
    error = error_object(-32602, "Invalid params", {"param": "\\" * 4000, "reason": "unknown"})
    answered = call.finish(response_error(b"1", error))
    text = json.loads(answered)["result"]["content"][0]["text"]
    assert len(answered) <= 10_000 and text.endswith(" ... (cut at max_response_bytes)")


def test_a_tool_s_own_request_cancelled_error_is_a_tool_error() -> None:
    """Hostile testing, round 124: RpcError(-32800, "Request cancelled") was byte for byte the front-end's own
    answer to a cancelled request, and passed as it."""
    from broker.frontend.mcp import cancelled

    call = server().handle(message("tools/call", {"name": "add"}, modern=False))
    assert isinstance(call, ToolCall)
    result = json.loads(call.finish(cancelled(b"1")))["result"]
    assert result["isError"] is True and result["content"][0]["text"] == "Error -32800: Request cancelled"
    call.cancelled = True  # (what `cancel_mcp` marks)
    assert json.loads(call.finish(cancelled(b"1")))["error"]["code"] == -32800


def test_a_modern_request_s_session_header_is_ignored() -> None:
    """Hostile testing, round 123: an unknown Mcp-Session-Id on a 2026-07-28 request was 404 (its streamable-http
    page, "Backward Compatibility": ignore it)."""
    status, body = answer(server().handle(message("tools/list"), Meta(*headers("tools/list")[:3], b"nope")))
    assert status == 200 and body["result"]["tools"]


@pytest.mark.parametrize("body", [b'{"jsonrpc":"2.0","id":1,"result":{}}',
                                  b'{"jsonrpc":"2.0","id":1,"error":{"code":1,"message":"x"}}'])
def test_a_response_sent_by_the_client_is_ignored_on_stdio_and_refused_over_http(body: bytes) -> None:
    """Hostile testing, round 123: on stdio its -32600, with its id, could be taken for an answer to the host's
    own request 1."""
    assert server().handle(body, None, Session()) == Reply(202, b"")
    status, answered = answer(server().handle(body, Meta()))
    assert (status, answered["id"], answered["error"]["code"]) == (400, None, -32600)  # (round 124: no id)
    for method in (b"null", b'""'):  # (round 124: answered with its id on stdio)
        assert server().handle(body[:-1] + b',"method":' + method + b"}", None, Session()) == Reply(202, b"")


def test_a_line_nested_past_the_parser_s_limit_is_answered_never_raised() -> None:
    """Hostile testing, round 124: a line nested 1,000 deep raised RecursionError on stdio (looking for a
    response in it), and the broker stopped."""
    for depth in (600, 1000, 5000):
        deep = b'{"x":' + b"[" * depth + b"]" * depth + b"}"
        outcome = server().handle(deep, None, Session())
        assert isinstance(outcome, Reply) and json.loads(outcome.body)["error"]["code"] in (-32600, -32700)
        call = b'{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"add","arguments":{"a":' + \
            b"[" * depth + b"]" * depth + b"}}}"
        assert isinstance(server().handle(call, None, Session()), (Reply, ToolCall))


def test_a_legacy_version_in_a_request_s_meta_is_told_how_it_is_served() -> None:
    body = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {"_meta": {
        **META, "io.modelcontextprotocol/protocolVersion": "2025-11-25"}}}).encode()
    status, answered = answer(server().handle(body))
    assert (status, answered["error"]["code"]) == (400, -32022)
    assert answered["error"]["message"] == ("Unsupported protocol version: 2025-11-25 is served after initialize, "
                                            "not by a request's _meta")


def test_a_large_error_data_is_shown_cut_never_decoded() -> None:
    """Hostile testing, round 125: 15 MB of an RpcError's data were decoded and encoded again on the event
    loop, which held every client 824 ms; now its first 4 KiB are shown as they are."""
    from broker.frontend.mcp import DATA_READ_BYTES, DATA_SHOWN_BYTES

    call = server().handle(message("tools/call", {"name": "add"}, modern=False))
    assert isinstance(call, ToolCall)
    data = [{}] * (DATA_READ_BYTES // 2)
    text = json.loads(call.finish(response_error(b"1", error_object(1, "m", data))))["result"]["content"][0]["text"]
    shown = "[" + ",".join(["{}"] * DATA_READ_BYTES)
    assert text == f"Error 1: m ({shown[:DATA_SHOWN_BYTES]} ... {len(json.dumps(data, separators=(',', ':')))} bytes of data in all)"


def test_a_result_too_large_to_fit_is_refused_before_its_text_is_made_and_the_id_counts() -> None:
    """Hostile testing, round 125: the result was escaped (184 ms for 15 MB) before being found too large;
    and a long id was not counted."""
    s = McpServer(lambda: CATALOG, Codec(), limit=1000)
    call = s.handle(message("tools/call", {"name": "total"}, modern=False))
    assert isinstance(call, ToolCall)
    text = json.loads(call.finish(response_result(b"1", b'{"total":"' + b"x" * 600 + b'"}')))["result"]["content"][0]["text"]
    assert text == ("The tool's result, 612 bytes, takes 1225 bytes or more as a CallToolResult (its text and its "
                    "structuredContent), past max_response_bytes 1000")
    long_id = "i" * 500
    call = s.handle(message("tools/call", {"name": "total"}, id_=long_id, modern=False))
    assert isinstance(call, ToolCall)
    answered = call.finish(response_result(f'"{long_id}"'.encode(), b'{"total":"' + b"x" * 200 + b'"}'))
    assert json.loads(answered)["result"]["isError"] is True and len(answered) <= 1000
