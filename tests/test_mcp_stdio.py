"""`rpc-broker mcp-stdio`: MCP over stdin and stdout (broker/frontend/mcp.py on the stream front-end's
framing), driven by the official `mcp` SDK's stdio client, which spawns the broker, in its default
mode (2026-07-28) and in `mode="legacy"` (2025-11-25); then raw lines for what the SDK never sends."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import typing
from pathlib import Path

import anyio
import pytest
from mcp.client.client import Client
from mcp.client.stdio import StdioServerParameters, stdio_client
from mcp.shared.exceptions import MCPError

ROOT = Path(__file__).resolve().parent.parent
MODES = {"auto": "2026-07-28", "legacy": "2025-11-25"}
ARGS = ["-m", "broker", "mcp-stdio", "--workers", "2", "--app", "tests.apps.mcp_tools:registry"]


PARAMS = StdioServerParameters(command=sys.executable, args=ARGS, cwd=str(ROOT),
                               env={**os.environ, "PYTHONPATH": str(ROOT)})
"""The broker as an MCP host starts it."""


class Spawned:
    """`rpc-broker mcp-stdio` with pipes: lines in, lines out (for what the SDK does not send)."""

    def __init__(self, *flags: str) -> None:
        self.proc = subprocess.Popen([sys.executable, *ARGS, *flags], cwd=ROOT, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ,
                                                                                          "PYTHONPATH": str(ROOT)})

    def ask(self, *lines: bytes) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(b"".join(lines))
        self.proc.stdin.flush()

    def read(self) -> dict[str, typing.Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line.endswith(b"\n"), (line, self.finish())
        return json.loads(line)

    def finish(self, timeout: float = 30.0) -> tuple[int, bytes, bytes]:
        """Close stdin; the broker answers what it owes and exits: its status, the rest of stdout, stderr."""
        out, err = self.proc.communicate(timeout=timeout)
        return self.proc.returncode, out, err


@pytest.mark.parametrize("mode", MODES)
def test_the_sdk_spawns_lists_calls_and_cancels(tmp_path: Path, mode: str, request: pytest.FixtureRequest) -> None:
    token = f"stdio-{mode}"
    errlog = (tmp_path / "stderr.log").open("w+")
    request.addfinalizer(errlog.close)

    async def main() -> dict[str, typing.Any]:
        # (its stderr, the broker's log, into a file: `errlog`)
        async with Client(stdio_client(PARAMS, errlog=errlog), mode=mode) as client:  # type: ignore[arg-type]
            got: dict[str, typing.Any] = {"version": client.session.protocol_version}
            got["tools"] = {t.name: t for t in (await client.list_tools()).tools}
            results: list[typing.Any] = [None] * 50

            async def one(i: int) -> None:
                results[i] = await client.call_tool("slow_sum", {"a": i, "b": 1})

            async with anyio.create_task_group() as tg:
                for i in range(50):
                    tg.start_soon(one, i)
            got["results"] = results
            got["bad"] = await client.call_tool("add", {"a": 1})
            with pytest.raises(MCPError) as raised:
                await client.call_tool("nope", {})
            got["unknown"] = raised.value.error
            with anyio.move_on_after(1.0):
                await client.call_tool("wait", {"token": token})
            got["after"] = await client.call_tool("shout", {"text": "hello"})
            return got

    got = anyio.run(main)
    assert got["version"] == MODES[mode]
    assert sorted(got["tools"]) == ["add", "boom", "die", "norm", "shout", "slow_sum", "wait"]
    assert got["tools"]["add"].input_schema["required"] == ["a", "b"]
    assert [r.structured_content["total"] for r in got["results"]] == [i + 1 for i in range(50)]
    assert len({r.structured_content["pid"] for r in got["results"]}) == 2
    assert got["bad"].is_error is True and "'b'" in got["bad"].content[0].text
    assert (got["unknown"].code, got["unknown"].message) == (-32602, "Unknown tool: nope")
    assert got["after"].structured_content == {"result": "HELLO"}  # (its print went to the log, not stdout)
    errlog.flush()
    errlog.seek(0)
    log = errlog.read()
    assert f"cancelled {token}" in log and "hello" in log


def test_stdout_has_nothing_but_json_lines_even_when_a_tool_prints() -> None:
    b = Spawned()
    call = {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "shout", "arguments": {"text": "hi"}}}
    b.ask(json.dumps(call).encode() + b"\n")
    status, out, err = b.finish()
    assert status == 0
    lines = out.splitlines()
    assert [json.loads(line)["result"]["structuredContent"] for line in lines] == [{"result": "HI"}]
    assert b"hi" in err


def test_crlf_a_raw_u2028_in_a_string_and_a_line_of_2_mib() -> None:
    b = Spawned("--max-body-bytes", str(4 * 1024 * 1024))
    big = "x" * (2 * 1024 * 1024)
    init = {"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {"protocolVersion": "2025-11-25"}}
    sep = {"jsonrpc": "2.0", "id": 1, "method": "tools/call",
           "params": {"name": "shout", "arguments": {"text": "a\u2028b"}}}
    large = {"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {"name": "shout", "arguments": {"text": big}}}
    b.ask(json.dumps(init).encode() + b"\r\n",
          json.dumps(sep, ensure_ascii=False).encode() + b"\r\n",
          json.dumps(large).encode() + b"\n")
    answers = {}
    for _ in range(3):
        message = b.read()
        answers[message["id"]] = message
    assert answers[0]["result"]["protocolVersion"] == "2025-11-25"
    assert answers[1]["result"]["structuredContent"] == {"result": "A\u2028B"}
    assert answers[2]["result"]["structuredContent"] == {"result": big.upper()}
    status, out, _ = b.finish()
    assert (status, out) == (0, b"")


def test_notifications_are_never_answered_and_a_batch_is_refused() -> None:
    b = Spawned()
    b.ask(b'{"jsonrpc":"2.0","method":"notifications/initialized"}\n',
          b'{"jsonrpc":"2.0","method":"notifications/initialized","params":[1]}\n',  # (bad params: still no answer)
          b'[{"jsonrpc":"2.0","id":1,"method":"ping"}]\n',
          b'{"jsonrpc":"2.0","id":2,"method":"ping"}\n',
          # (a probe without `_meta`: new user, round 111, its exception ended the session, calls and all)
          b'{"jsonrpc":"2.0","id":3,"method":"server/discover"}\n')
    refused = b.read()
    assert (refused["id"], refused["error"]["code"]) == (None, -32600) and "batch" in refused["error"]["data"]
    assert b.read() == {"jsonrpc": "2.0", "id": 2, "result": {}}
    assert b.read()["result"]["supportedVersions"][0] == "2026-07-28"
    status, out, _ = b.finish()
    assert (status, out) == (0, b"")


def test_a_line_nested_past_the_parser_s_limit_is_answered_and_the_session_goes_on() -> None:
    """Hostile testing, round 124: a line nested 1,000 deep raised in the MCP front-end, and the broker
    stopped, its calls in flight lost."""
    b = Spawned()
    b.ask(b'{"x":' + b"[" * 1000 + b"]" * 1000 + b"}\n", b'{"jsonrpc":"2.0","id":2,"method":"ping"}\n')
    refused = b.read()
    assert refused["id"] is None and refused["error"]["code"] in (-32600, -32700)
    assert b.read() == {"jsonrpc": "2.0", "id": 2, "result": {}}
    status, out, _ = b.finish()
    assert (status, out) == (0, b"")
