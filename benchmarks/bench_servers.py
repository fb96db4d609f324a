"""`make bench`'s servers: what each runs, launching one as a child process on 127.0.0.1,
and the correctness probe every server answers before any load (benchmarks/run.py).
"""

from __future__ import annotations

import dataclasses
import http.client
import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import typing
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PEERS = HERE / "peers"
PY = sys.executable

# ---------------------------------------------------------------------------------------------
# Servers


@dataclasses.dataclass(frozen=True)
class Server:
    name: str
    kind: str  # "broker", "reference", "stick" (issue 14's measuring sticks), "peer" or "mcp-peer"
    description: str
    argv: Callable[[int], list[str]]
    requires: tuple[str, ...] = ()  # modules that must be importable (peers of the bench extra)
    only: tuple[str, ...] = ()  # the scenario keys it runs (empty: all)
    tree: Path | None = None  # another checkout whose code it runs (`--against`); None: this one
    path: str = "/"  # where it answers JSON-RPC over HTTP POST
    serves: tuple[str, ...] = ()  # the only methods it has (empty: the demo's add, fib and sleep too)


def _broker(workers: int, *flags: str) -> Callable[[int], list[str]]:
    return lambda port: [PY, "-m", "broker", "serve", "--host", "127.0.0.1", "--port", str(port),
                         "--workers", str(workers), "--log-level", "warning", *flags]


SERVERS = [
    Server("reference", "reference", "benchmarks/reference_server.py: 1 process, uvloop + httptools + msgspec",
           lambda port: [PY, str(HERE / "reference_server.py"), "--port", str(port)]),
    Server("broker-2w", "broker", "rpc-broker serve --workers 2", _broker(2)),
    Server("broker-1w", "broker", "rpc-broker serve --workers 1", _broker(1)),
    Server("broker-2w-nometrics", "broker", "rpc-broker serve --workers 2 --no-metrics: what the metrics cost "
           "(S1 at 64 connections and S2 only)", _broker(2, "--no-metrics"), only=("S1-64", "S2")),
    Server("broker-2w-access-all", "broker", "rpc-broker serve --workers 2 --access-log all: what a line per call "
           "costs (S1 at 64 connections only; its lines to the runner's log file)", _broker(2, "--access-log", "all"),
           only=("S1-64",)),
    # Issue 14's `--frontends` curve, as far as this machine's cores go: N front-ends beside broker-2w's one
    *(Server(f"broker-2w-{n}fe", "broker", f"rpc-broker serve --workers 2 --frontends {n}: {n} front-end processes "
             "on the port (S1 at 64 connections and S2 only)", _broker(2, "--frontends", str(n)), only=("S1-64", "S2"))
      for n in (2, 4, 8) if n <= max(os.cpu_count() or 1, 2)),
    Server("aiohttp-1p", "peer", "aiohttp + jsonrpcserver, 1 process (uvloop)",
           lambda port: [PY, str(PEERS / "aiohttp_jsonrpcserver.py"), "--port", str(port)],
           ("aiohttp", "jsonrpcserver")),
    Server("aiohttp-2p", "peer", "aiohttp + jsonrpcserver, 2 processes under gunicorn (GunicornUVLoopWebWorker)",
           lambda port: [PY, "-m", "gunicorn", "aiohttp_jsonrpcserver:app", "--chdir", str(PEERS),
                         "--workers", "2", "--worker-class", "aiohttp.GunicornUVLoopWebWorker",
                         "--bind", f"127.0.0.1:{port}", "--backlog", "2048", "--log-level", "warning"],
           ("aiohttp", "jsonrpcserver", "gunicorn")),
    Server("fastapi-1w", "peer", "fastapi-jsonrpc under uvicorn, 1 worker (uvloop, httptools)",
           lambda port: _uvicorn(port, 1), ("fastapi_jsonrpc", "uvicorn")),
    Server("fastapi-2w", "peer", "fastapi-jsonrpc under uvicorn, 2 workers (uvloop, httptools)",
           lambda port: _uvicorn(port, 2), ("fastapi_jsonrpc", "uvicorn")),
]


STICKS_ENV = "BENCH_STICKS_DIR"  # a directory to take the sticks from instead; empty: none (the tests')


def reference_dir(root: Path = ROOT, env: typing.Mapping[str, str] = os.environ) -> tuple[Path | None, list[Path]]:
    """Issue 14's measuring sticks: `shared/reference/` beside the checkout `root` (as CI clones
    it), or beside the main checkout when `root` is a git worktree elsewhere; or the directory
    `env[STICKS_ENV]` names, none if it is empty. Returns (the directory or None, every place
    looked in)."""
    if STICKS_ENV in env:
        given = Path(env[STICKS_ENV]) if env[STICKS_ENV] else None
        found = given is not None and (given / "limit_uvloop.py").is_file() and (given / "broker_proto.py").is_file()
        return (given if found else None), ([given] if given is not None else [])
    looked = [root.parent / "shared" / "reference"]
    try:  # a worktree's common git directory is the main checkout's .git
        common = subprocess.run(["git", "-C", str(root), "rev-parse", "--path-format=absolute", "--git-common-dir"],
                                capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        common = ""
    if common:
        looked.append(Path(common).parent.parent / "shared" / "reference")
    looked = list(dict.fromkeys(looked))
    for where in looked:
        if (where / "limit_uvloop.py").is_file() and (where / "broker_proto.py").is_file():
            return where, looked
    return None, looked


REFERENCE_DIR, REFERENCE_LOOKED = reference_dir()
STICK_METHODS = ("add", "echo")  # all the sticks have: no fib, no sleep, no /mcp
LIMIT = "limit-uvloop"  # issue 14's targets are ratios to this one


def _stick(script: str, *flags: str) -> Callable[[int], list[str]]:
    # Run from where they are, never copied, with this interpreter (the venv has uvloop,
    # httptools, msgspec and orjson).
    return lambda port: [PY, str(REFERENCE_DIR / script if REFERENCE_DIR else script), "--port", str(port), *flags]


STICKS = [
    Server(LIMIT, "stick", "../shared/reference/limit_uvloop.py: issue 14's one-process reference (uvloop + "
           "httptools + msgspec answering inline; `add` and `echo` only, at /rpc)", _stick("limit_uvloop.py"),
           only=("S1-16", "S1-64", "S2", "S5b"), path="/rpc", serves=STICK_METHODS),
    *(Server(f"proto-{n}w", "stick", f"../shared/reference/broker_proto.py --fast --workers {n}: the throwaway "
             f"prototype of this design, {n} worker{'s' * (n > 1)} (`add` and `echo` only, at /rpc)",
             _stick("broker_proto.py", "--fast", "--workers", str(n)), only=("S1-16", "S1-64", "S2"),
             path="/rpc", serves=STICK_METHODS) for n in (1, 2)),
]
SERVERS[1:1] = STICKS if REFERENCE_DIR else []  # (beside the reference in every table)
MCP_KEYS = ("M1-16", "M1-64", "M3-4", "M3-16")  # the MCP scenarios
MCP_SDK = ["mcp-sdk-1p", "mcp-sdk-2p"]  # the ratios of the MCP tables are to these
MCP_SERVERS = ("broker-2w", *MCP_SDK)  # the servers the MCP scenarios run
SERVERS += [
    Server("mcp-sdk-1p", "mcp-peer", "the official MCP SDK's own server (mcp's MCPServer, named FastMCP before 2.0), "
           "1 process, stateless JSON mode (stateless_http and json_response: its fastest), uvicorn with uvloop + "
           "httptools (MCP scenarios only)", lambda port: _mcp_sdk(port, 1), ("mcp", "uvicorn"), only=MCP_KEYS),
    Server("mcp-sdk-2p", "mcp-peer", "the same, 2 processes (uvicorn --workers 2: stateless, so any process "
           "answers any request)", lambda port: _mcp_sdk(port, 2), ("mcp", "uvicorn"), only=MCP_KEYS),
]
QUICK_SERVERS = ["reference", *([LIMIT] if REFERENCE_DIR else []), "broker-2w"]


def _mcp_sdk(port: int, workers: int) -> list[str]:
    return [PY, str(PEERS / "mcp_sdk_server.py"), "--port", str(port), "--workers", str(workers),
            "--mode", "stateless-json"]


def _uvicorn(port: int, workers: int) -> list[str]:
    return [PY, "-m", "uvicorn", "fastapi_jsonrpc_app:app", "--app-dir", str(PEERS), "--host", "127.0.0.1",
            "--port", str(port), "--workers", str(workers), "--loop", "uvloop", "--http", "httptools",
            "--no-access-log", "--log-level", "warning"]


def missing_modules(server: Server) -> list[str]:
    return [m for m in server.requires if importlib.util.find_spec(m) is None]


def port_range(text: str) -> range:
    """"38100-38199" as range(38100, 38200); argparse reports a ValueError as a usage error."""
    low, _, high = text.partition("-")
    ports = range(int(low), int(high or low) + 1)
    if not ports or ports.start < 1 or ports.stop > 65536:
        raise ValueError(text)
    return ports


PORTS: range | None = None  # --ports: the servers' ports come from there (default: any free one)


def free_port() -> int:
    """A port free on 127.0.0.1 now: the first in `PORTS` (raises SystemExit if none is), or
    one the system picks."""
    for port in PORTS if PORTS is not None else (0,):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return int(s.getsockname()[1])
    raise SystemExit(f"no free port in --ports {PORTS.start}-{PORTS.stop - 1}")  # type: ignore[union-attr]


class Running:
    """A server child process, its URL and its log file."""

    def __init__(self, server: Server, logdir: Path) -> None:
        self.server = server
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}{server.path}"
        self.log_path = logdir / f"{server.name}.log"
        with self.log_path.open("wb") as log:
            tree = server.tree or ROOT  # (`-m broker` imports from the working directory first)
            env = {**os.environ, "PYTHONPATH": str(tree)} if server.tree else None
            self.proc = subprocess.Popen(server.argv(self.port), stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, cwd=tree, env=env)

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"exited with {self.proc.returncode}: {self.log_tail()}")
            try:
                post(self.port, b'{"jsonrpc":"2.0","method":"add","params":{"a":1,"b":2},"id":0}', timeout=2,
                     path=self.server.path)
                return
            except (OSError, http.client.HTTPException):
                time.sleep(0.1)
        raise RuntimeError(f"not answering after {timeout} s: {self.log_tail()}")

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-600:].strip()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


# ---------------------------------------------------------------------------------------------
# Correctness probe


def post(port: int, body: bytes, timeout: float = 10.0, path: str = "/") -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", path, body=body, headers={"content-type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def fib_value(n: int) -> int:
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


def _req(method: str, params: object, id_: object = None) -> dict[str, object]:
    req: dict[str, object] = {"jsonrpc": "2.0", "method": method, "params": params}
    if id_ is not None:
        req["id"] = id_
    return req


def _check(answer: object, id_: object, expect: object) -> str | None:
    """None if `answer` is the Response to call `id_` with result `expect`, else what is wrong."""
    if not isinstance(answer, dict) or answer.get("jsonrpc") != "2.0" or answer.get("id") != id_:
        return f"not the response to id {id_!r}: {answer!r}"[:200]
    if "error" in answer or answer.get("result") != expect or type(answer.get("result")) is not type(expect):
        return f"id {id_!r}: expected result {expect!r}, got {answer!r}"[:200]
    return None


def probe(port: int, fib_n: int, path: str = "/", serves: tuple[str, ...] = ()) -> tuple[list[str], list[str]]:
    """Check one server's answers at `path`; returns (problems, notes). No problems: it
    answered correctly.

    Required: add, fib, sleep by name, a batch of the three (ids matched, any order), an unknown
    method answered -32601. Noted only: positional params, an id echoed byte for byte, a
    notification answered 204. A server that `serves` only some methods (the measuring sticks:
    `add`) is probed with those alone, its batch made of `add` calls.
    """
    problems: list[str] = []
    notes: list[str] = []
    every = not serves or {"fib", "sleep"} <= set(serves)

    def ask(body: bytes) -> tuple[int, bytes]:
        return post(port, body, path=path)

    def one(req: dict[str, object], expect: object) -> None:
        status, body = ask(json.dumps(req).encode())
        try:
            answer = json.loads(body)
        except ValueError:
            problems.append(f"{req['method']}: HTTP {status}, not JSON: {body[:100]!r}")
            return
        wrong = _check(answer, req["id"], expect)
        if wrong:
            problems.append(f"{req['method']}: {wrong}")

    one(_req("add", {"a": 1, "b": 2}, 1), 3)
    one(_req("add", {"a": 1.5, "b": 2}, "x"), 3.5)
    if every:
        one(_req("fib", {"n": fib_n}, 2), fib_value(fib_n))
        one(_req("sleep", {"seconds": 0.01}, 3), 0.01)
    batch = [_req("sleep", {"seconds": 0.02}, "s") if every else _req("add", {"a": 0.01, "b": 0.01}, "s"),
             _req("add", {"a": 2, "b": 3}, "a"),
             _req("fib", {"n": 10}, 7) if every else _req("add", {"a": 5, "b": 50}, 7), _req("add", {"a": 0, "b": 0})]
    status, body = ask(json.dumps(batch).encode())
    try:
        answers = json.loads(body)
    except ValueError:
        answers = None
    if not isinstance(answers, list) or len(answers) != 3:
        problems.append(f"batch: expected 3 answers, got HTTP {status} {body[:200]!r}")
    else:
        by_id = {a.get("id"): a for a in answers if isinstance(a, dict)}
        for id_, expect in (("s", 0.02), ("a", 5), (7, 55)):  # (0.01 + 0.01 is 0.02 exactly)
            wrong = _check(by_id.get(id_), id_, expect)
            if wrong:
                problems.append(f"batch: {wrong}")
    status, body = ask(json.dumps(_req("no_such_method", {}, 9)).encode())
    try:
        code = json.loads(body)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        code = None
    if code != -32601:
        problems.append(f"unknown method: expected error -32601, got HTTP {status} {body[:200]!r}")

    status, body = ask(b'{"jsonrpc":"2.0","method":"add","params":[1,2],"id":1}')
    if b'"result":3' not in body.replace(b" ", b""):
        notes.append("rejects positional params (`[1,2]`)")
    status, body = ask(b'{"jsonrpc":"2.0","method":"add","params":{"a":1,"b":2},"id":1.5e3}')
    if b"1.5e3" not in body:
        notes.append("re-encodes ids (`1.5e3` came back as `" + re.sub(r'.*"id":\s*([^,}]+).*', r"\1",
                                                                        body.decode(errors="replace")) + "`)")
    status, body = ask(b'{"jsonrpc":"2.0","method":"add","params":{"a":1,"b":2}}')
    if status != 204:
        notes.append(f"answers a notification with HTTP {status}"
                     + (" and an empty body" if not body else f" and {len(body)} bytes") + " (not 204)")
    return problems, notes


