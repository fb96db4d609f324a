"""MCP over Streamable HTTP (`/mcp`, broker/frontend/mcp.py): the official `mcp` SDK's client in its
default mode (2026-07-28, stateless) and in `mode="legacy"` (2025-11-25, initialize and a session),
against a real broker and its worker processes; then raw HTTP requests for what the SDK never sends."""

from __future__ import annotations

import json
import time
import typing

import anyio
import pytest
from mcp.client.client import Client
from mcp.shared.exceptions import MCPError

from tests.conftest import Broker, sample, scrape_metrics, start_broker, wait_for

MODES = {"auto": "2026-07-28", "legacy": "2025-11-25"}
MODERN = "2026-07-28"
META = {"io.modelcontextprotocol/protocolVersion": MODERN, "io.modelcontextprotocol/clientCapabilities": {}}


@pytest.fixture(scope="module")
def broker() -> typing.Iterator[Broker]:
    b = start_broker("--workers", "2", "--app", "tests.apps.mcp_tools:registry")
    yield b
    assert b.stop() == 0, b.read_log()


def url(b: Broker) -> str:
    return f"http://127.0.0.1:{b.port}/mcp"


def run(fn: typing.Callable[[], typing.Awaitable[object]]) -> typing.Any:
    return anyio.run(fn)


@pytest.mark.parametrize("mode", MODES)
def test_the_sdk_connects_in_each_era(broker: Broker, mode: str) -> None:
    async def main() -> tuple[str | None, list[str]]:
        async with Client(url(broker), mode=mode) as client:  # type: ignore[arg-type]
            tools = await client.list_tools()
            return client.session.protocol_version, [t.name for t in tools.tools]

    version, names = run(main)
    assert version == MODES[mode]
    assert names == ["add", "boom", "die", "norm", "shout", "slow_sum", "wait"]  # (sorted; `hidden` is not a tool)


@pytest.mark.parametrize("mode", MODES)
def test_tools_are_listed_with_schemas_from_their_type_hints(broker: Broker, mode: str) -> None:
    async def main() -> dict[str, typing.Any]:
        async with Client(url(broker), mode=mode) as client:  # type: ignore[arg-type]
            return {t.name: t for t in (await client.list_tools()).tools}

    tools = run(main)
    add = tools["add"]
    assert add.title == "Add two integers"
    assert add.description == "a + b."
    assert add.input_schema == {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                                "required": ["a", "b"], "additionalProperties": False}
    assert add.output_schema == {"type": "object", "properties": {"result": {"type": "integer"}}, "required": ["result"]}
    assert add.annotations is not None and add.annotations.read_only_hint is True
    norm = tools["norm"].input_schema
    assert "$ref" not in json.dumps(norm) and norm["properties"]["p"]["properties"]["x"] == {"type": "number"}
    assert norm["required"] == ["p"]


@pytest.mark.parametrize("mode", MODES)
def test_fifty_concurrent_calls_are_answered_by_several_workers(broker: Broker, mode: str) -> None:
    async def main() -> list[typing.Any]:
        results: list[typing.Any] = [None] * 50
        async with Client(url(broker), mode=mode) as client:  # type: ignore[arg-type]
            async def one(i: int) -> None:
                results[i] = await client.call_tool("slow_sum", {"a": i, "b": 1000})

            async with anyio.create_task_group() as tg:
                for i in range(50):
                    tg.start_soon(one, i)
        return results

    results = run(main)
    pids = set()
    for i, result in enumerate(results):
        assert result.is_error is False
        assert result.structured_content["total"] == i + 1000
        assert json.loads(result.content[0].text) == result.structured_content
        pids.add(result.structured_content["pid"])
    assert len(pids) == 2


@pytest.mark.parametrize("mode", MODES)
def test_a_scalar_result_is_wrapped_and_bad_arguments_are_a_tool_error(broker: Broker, mode: str) -> None:
    async def main() -> tuple[typing.Any, typing.Any]:
        async with Client(url(broker), mode=mode) as client:  # type: ignore[arg-type]
            return await client.call_tool("add", {"a": 2, "b": 3}), await client.call_tool("add", {"a": "two", "b": 3})

    good, bad = run(main)
    assert (good.is_error, good.structured_content, good.content[0].text) == (False, {"result": 5}, "5")
    assert bad.is_error is True and bad.structured_content is None
    assert bad.content[0].text == "Invalid arguments: argument 'a': Expected `int`, got `str`"


@pytest.mark.parametrize("mode", MODES)
def test_an_unknown_tool_is_a_protocol_error(broker: Broker, mode: str) -> None:
    async def main() -> MCPError:
        async with Client(url(broker), mode=mode) as client:  # type: ignore[arg-type]
            for name in ("nope", "hidden"):  # (`hidden` is a method, not a tool)
                with pytest.raises(MCPError) as raised:
                    await client.call_tool(name, {})
                assert raised.value.error.code == -32602 and raised.value.error.message == f"Unknown tool: {name}"
            return raised.value

    run(main)


@pytest.mark.parametrize("mode", MODES)
def test_a_cancelled_call_is_cancelled_in_its_worker(broker: Broker, mode: str) -> None:
    token = f"http-{mode}"

    async def main() -> None:
        async with Client(url(broker), mode=mode) as client:  # type: ignore[arg-type]
            with anyio.move_on_after(1.0):
                await client.call_tool("wait", {"token": token})
            # (the next call on the same client is served: nothing was lost)
            assert (await client.call_tool("add", {"a": 1, "b": 1})).structured_content == {"result": 2}

    run(main)
    wait_for(lambda: f"cancelled {token}" in broker.read_log(), timeout=10.0)


# ---- raw HTTP: what the SDK does not send ----


def post(b: Broker, message: object, headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], typing.Any]:
    status, got, body = b.post(json.dumps(message), path="/mcp", headers=headers)
    return status, got, json.loads(body) if body else None


def modern(method: str, params: dict[str, object] | None = None, id_: object = 1,
           **headers: str) -> tuple[dict[str, object], dict[str, str]]:
    message = {"jsonrpc": "2.0", "id": id_, "method": method, "params": {**(params or {}), "_meta": META}}
    return message, {"mcp-protocol-version": MODERN, "mcp-method": method, **headers}


def test_a_notification_is_accepted_with_202_and_no_body(broker: Broker) -> None:
    status, headers, body = post(broker, {"jsonrpc": "2.0", "method": "notifications/initialized"})
    assert (status, headers["content-length"], body) == (202, "0", None)


@pytest.mark.parametrize("method", ["GET", "DELETE"])
def test_get_and_delete_are_405(broker: Broker, method: str) -> None:
    conn = broker.connection()
    conn.request(method, "/mcp", headers={"mcp-protocol-version": MODERN})
    response = conn.getresponse()
    assert (response.status, response.getheader("allow")) == (405, "POST")
    conn.close()


def test_an_unknown_method_is_404_with_32601(broker: Broker) -> None:
    status, _, body = post(broker, *modern("resources/list"))
    assert status == 404 and body["error"]["code"] == -32601 and body["id"] == 1


def test_an_unsupported_version_is_400_with_32022_and_what_is_supported(broker: Broker) -> None:
    message, headers = modern("tools/list")
    message["params"]["_meta"] = {**META, "io.modelcontextprotocol/protocolVersion": "1900-01-01"}  # type: ignore[index]
    status, _, body = post(broker, message, {**headers, "mcp-protocol-version": "1900-01-01"})
    assert status == 400 and body["error"]["code"] == -32022
    assert body["error"]["data"] == {"supported": ["2026-07-28", "2025-11-25", "2025-06-18", "2025-03-26", "2024-11-05"],
                                     "requested": "1900-01-01"}


@pytest.mark.parametrize(("header", "value", "why"), [
    ("mcp-method", "tools/list", "Mcp-Method header value 'tools/list' does not match body value 'tools/call'"),
    ("mcp-name", "shout", "Mcp-Name header value 'shout' does not match body value 'add'"),
    ("mcp-protocol-version", "2025-11-25", "MCP-Protocol-Version header value '2025-11-25' does not match body value"),
    ("mcp-name", None, "Mcp-Name header missing"),
])
def test_a_header_that_does_not_match_the_body_is_400_with_32020(broker: Broker, header: str, value: str | None,
                                                                 why: str) -> None:
    message, headers = modern("tools/call", {"name": "add", "arguments": {"a": 1, "b": 2}}, **{"mcp-name": "add"})
    if value is None:
        del headers[header]
    else:
        headers[header] = value
    status, _, body = post(broker, message, headers)
    assert status == 400 and body["error"]["code"] == -32020 and why in body["error"]["message"]


def test_a_base64_encoded_mcp_name_matches(broker: Broker) -> None:
    message, headers = modern("tools/call", {"name": "add", "arguments": {"a": 1, "b": 2}},
                              **{"mcp-name": "=?base64?YWRk?="})
    status, _, body = post(broker, message, headers)
    assert status == 200 and body["result"]["structuredContent"] == {"result": 3}
    assert body["result"]["resultType"] == "complete"


def test_a_foreign_origin_is_403(broker: Broker) -> None:
    message, headers = modern("tools/list")
    status, _, body = post(broker, message, {**headers, "origin": "https://evil.example"})
    assert status == 403 and "Origin not in allowed_origins" in body["error"]["data"]


def test_an_unknown_session_is_404(broker: Broker) -> None:
    status, _, body = post(broker, {"jsonrpc": "2.0", "id": 7, "method": "tools/list"},
                           {"mcp-session-id": "no-such-session", "mcp-protocol-version": "2025-11-25"})
    assert status == 404 and body["id"] == 7 and body["error"]["message"] == "Session not found"


def test_initialize_counter_offers_the_newest_version_for_one_it_does_not_know(broker: Broker) -> None:
    status, headers, body = post(broker, {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2099-01-01", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}})
    assert status == 200 and body["result"]["protocolVersion"] == "2025-11-25"
    assert body["result"]["capabilities"] == {"tools": {"listChanged": False}}
    session = headers["mcp-session-id"]
    status, _, body = post(broker, {"jsonrpc": "2.0", "id": 2, "method": "ping"},
                           {"mcp-session-id": session, "mcp-protocol-version": "2025-11-25"})
    assert (status, body["result"]) == (200, {})
    conn = broker.connection()
    conn.request("DELETE", "/mcp", headers={"mcp-session-id": session})
    assert conn.getresponse().status == 204
    conn.close()
    status, _, _ = post(broker, {"jsonrpc": "2.0", "id": 3, "method": "ping"}, {"mcp-session-id": session})
    assert status == 404


def test_server_discover_without_meta_is_answered(broker: Broker) -> None:
    """New user, round 111: it raised, and the connection was answered 400 "callback error"."""
    status, _, body = post(broker, {"jsonrpc": "2.0", "id": 1, "method": "server/discover"})
    assert status == 200 and body["result"]["supportedVersions"][0] == MODERN


def test_a_batch_is_refused(broker: Broker) -> None:
    status, _, body = post(broker, [{"jsonrpc": "2.0", "id": 1, "method": "ping"}])
    assert status == 400 and body["error"]["code"] == -32600 and "batch" in body["error"]["data"]


def test_mcp_path_moves_the_endpoint_and_empty_turns_it_off() -> None:
    moved = start_broker("--workers", "1", "--mcp-path", "/agents/mcp", "--app", "tests.apps.mcp_tools:registry")
    off = start_broker("--workers", "1", "--mcp-path", "")
    try:
        assert f"serving MCP (Streamable HTTP) on http://127.0.0.1:{moved.port}/agents/mcp" in moved.read_log()
        message, headers = modern("tools/list")
        status, _, body = moved.post(json.dumps(message), path="/agents/mcp", headers=headers)
        assert status == 200 and json.loads(body)["result"]["tools"]
        assert moved.post(json.dumps(message), path="/mcp", headers=headers)[0] == 404
        assert off.post(json.dumps(message), path="/mcp", headers=headers)[0] == 404
        assert "serving MCP" not in off.read_log()
    finally:
        assert moved.stop() == 0 and off.stop() == 0


@pytest.mark.parametrize("accept", [None, "text/event-stream", "*/*", "application/json"])
def test_any_accept_header_gets_a_json_answer(broker: Broker, accept: str | None) -> None:
    message, headers = modern("tools/call", {"name": "add", "arguments": {"a": 2, "b": 2}}, **{"mcp-name": "add"})
    if accept is not None:
        headers["accept"] = accept
    status, got, body = post(broker, message, headers)
    assert (status, got["content-type"], body["result"]["structuredContent"]) == (200, "application/json", {"result": 4})


def test_metrics_count_mcp_requests_by_method_and_era_and_tool_calls_by_tool_and_result(broker: Broker) -> None:
    before = scrape_metrics(broker)
    call, headers = modern("tools/call", {"name": "add", "arguments": {"a": 1, "b": 2}}, **{"mcp-name": "add"})
    assert post(broker, call, headers)[0] == 200
    bad, headers = modern("tools/call", {"name": "add", "arguments": {"a": "x", "b": 2}}, **{"mcp-name": "add"})
    assert post(broker, bad, headers)[2]["result"]["isError"] is True
    unknown, headers = modern("tools/call", {"name": "nope"}, **{"mcp-name": "nope"})
    assert post(broker, unknown, headers)[2]["error"]["code"] == -32602
    assert post(broker, {"jsonrpc": "2.0", "id": 1, "method": "ping"})[0] == 200
    after = scrape_metrics(broker)

    def moved(name: str, **labels: str) -> float:
        return sample(after, name, **labels) - sample(before, name, **labels)

    assert moved("rpc_broker_mcp_requests_total", method="tools/call", era="2026-07-28") == 3
    assert moved("rpc_broker_mcp_requests_total", method="ping", era="legacy") == 1
    assert moved("rpc_broker_mcp_tool_calls_total", tool="add", result="ok") == 1
    assert moved("rpc_broker_mcp_tool_calls_total", tool="add", result="tool_error") == 1
    assert moved("rpc_broker_mcp_tool_calls_total", tool="other", result="unknown_tool") == 1
    assert moved("rpc_broker_calls_total", method="add", outcome="ok") == 1  # (the call's own, as any call's)
    assert ("rpc_broker_mcp_tool_calls_total", (("result", "ok"), ("tool", "wait"))) in after  # (every tool's series)


@pytest.mark.parametrize("mode", MODES)
def test_a_handler_s_error_a_timeout_and_a_worker_s_death_are_tool_errors(mode: str) -> None:
    b = start_broker("--workers", "2", "--app", "tests.apps.mcp_tools:registry", "--method-timeout", "wait=0.3")

    async def main() -> list[typing.Any]:
        async with Client(url(b), mode=mode) as client:  # type: ignore[arg-type]
            return [await client.call_tool("boom", {"text": "no good"}), await client.call_tool("wait", {"token": "t"}),
                    await client.call_tool("die", {}), await client.call_tool("add", {"a": 1, "b": 2})]

    try:
        raised, timed_out, died, after = run(main)
    finally:
        assert b.stop() == 0, b.read_log()
    assert raised.is_error and raised.content[0].text == "Internal error: ValueError"  # (its message: --debug's)
    assert timed_out.is_error and timed_out.content[0].text.startswith("The tool call timed out")
    assert died.is_error and died.content[0].text.startswith("The worker process running the tool died")
    assert after.structured_content == {"result": 3}  # (the pool goes on: the other worker, or the new one)


def test_an_app_with_no_tool_is_said_to_serve_mcp_none() -> None:
    """New user, round 111: the README's own app (a `Registry()`) served an MCP host no tool, and nothing said so."""
    warning = "MCP serves no tools: app tests.apps.chatty:registry marks none"
    none = start_broker("--workers", "1", "--app", "tests.apps.chatty:registry")
    off = start_broker("--workers", "1", "--app", "tests.apps.chatty:registry", "--mcp-path", "")
    some = start_broker("--workers", "1", "--app", "tests.apps.mcp_tools:registry")
    assert none.stop() == 0 and off.stop() == 0 and some.stop() == 0  # (their whole logs read)
    assert warning in none.read_log() and warning not in off.read_log()
    assert "MCP serves no tools" not in some.read_log()


def test_a_half_close_cancels_the_mcp_call_owed_and_answers_the_rest(broker: Broker) -> None:
    """Hostile testing, round 124: a client that half-closed (`nc -N`) was reset, the plain call pipelined
    before its tools/call unanswered too. Now the tools/call is cancelled in its worker and answered -32800,
    the plain call answered, in order."""
    import socket

    plain = b'{"jsonrpc":"2.0","id":7,"method":"add","params":[1,2]}'
    call = json.dumps({"jsonrpc": "2.0", "id": 8, "method": "tools/call",
                       "params": {"name": "wait", "arguments": {"token": "half-close"}}}).encode()
    head = "POST {} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n"
    with socket.create_connection(("127.0.0.1", broker.port), timeout=30) as sock:
        sock.sendall(head.format("/", len(plain)).encode() + plain + head.format("/mcp", len(call)).encode() + call)
        time.sleep(0.5)  # (both dispatched)
        sock.shutdown(socket.SHUT_WR)
        got = b""
        while chunk := sock.recv(65536):
            got += chunk
    first, second = (json.loads(part.split(b"\r\n\r\n", 1)[1].split(b"HTTP/1.1")[0]) for part in got.split(b"HTTP/1.1 ")[1:])
    assert first == {"jsonrpc": "2.0", "id": 7, "result": 3}
    assert second == {"jsonrpc": "2.0", "id": 8, "error": {"code": -32800, "message": "Request cancelled"}}
    wait_for(lambda: "cancelled half-close" in broker.read_log(), timeout=10.0)
