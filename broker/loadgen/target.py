"""What a run aims at and the records it passes around: the parsed `Target`, the `Spec`
a load process runs, the `Progress` and `ProcessResult` records a load process sends
back (msgspec-encoded across processes), and the `RunError` family. Plain data, no I/O.
"""

from __future__ import annotations

import os
import typing
import urllib.parse

import msgspec

from broker.loadgen.check import Tally
from broker.loadgen.workload import Call, IdMode

__all__ = ["MCP_ERAS", "TARGET_FORMS", "UNIX_PATH_MAX", "McpEra", "ProcessDied", "ProcessResult", "Progress", "RunError",
           "RunInterrupted", "Spec", "Target"]


class RunError(Exception):
    """The run could not be done at all (bad target, a load process died, ...)."""


UNIX_PATH_MAX = 107  # bytes of a Unix socket path (sun_path is 108 with its NUL)
TARGET_FORMS = "http://host:port/path, tcp://host:port or unix:///path/to.sock"


class Target(typing.NamedTuple):
    """Where to send: parsed from ``http://host:port/path`` (HTTP/1.1),
    ``tcp://host:port`` or ``unix:///path/to.sock`` (newline-delimited JSON).

    scheme: "http", "tcp" or "unix".
    host / port: of http and tcp ("" and 0 for unix).
    path: the HTTP request path, or the Unix socket path ("" for tcp).
    """

    scheme: str
    host: str
    port: int
    path: str
    url: str

    @property
    def stream(self) -> bool:
        """True for the NDJSON targets (tcp, unix)."""
        return self.scheme != "http"

    @property
    def where(self) -> str:
        """The address, for messages: ``host:port`` or ``unix://path``."""
        return f"unix://{self.path}" if self.scheme == "unix" else f"{self.host}:{self.port}"

    @classmethod
    def parse(cls, url: str) -> Target:
        """Parse a target URL; raises `RunError` for an unsupported or malformed one."""
        try:
            parts = urllib.parse.urlsplit(url)
        except ValueError as exc:  # "Invalid IPv6 URL", "[zz] does not appear to be an IPv6 address"
            raise RunError(f"malformed target {url!r}: {exc}") from None
        if parts.scheme == "unix":
            path = url[len("unix://"):] if url.startswith("unix://") else ""
            if not path:
                raise RunError(f"no socket path in {url!r}: write unix:///path/to.sock")
            if len(os.fsencode(path)) > UNIX_PATH_MAX:
                raise RunError(f"Unix socket path too long in {url!r}: "
                               f"{len(os.fsencode(path))} bytes, at most {UNIX_PATH_MAX}")
            return cls("unix", "", 0, path, url)
        if parts.scheme not in ("http", "tcp"):
            raise RunError(f"target must be {TARGET_FORMS}; got {url!r}")
        try:
            port = parts.port
        except ValueError as exc:
            raise RunError(f"bad port in {url!r}: {exc}") from None
        if not parts.hostname:
            raise RunError(f"no host in {url!r}")
        if parts.scheme == "tcp":
            if port is None:
                raise RunError(f"no port in {url!r}: write tcp://host:port")
            if parts.path not in ("", "/") or parts.query or parts.fragment:
                raise RunError(f"a tcp:// target has no path or query: {url!r}")
            return cls("tcp", parts.hostname, port, "", url)
        path = parts.path or "/"
        if parts.query:
            path += "?" + parts.query
        return cls("http", parts.hostname, 80 if port is None else port, path, url)


McpEra = typing.Literal["modern", "legacy"]
MCP_ERAS: tuple[McpEra, ...] = typing.get_args(McpEra)


class Spec(msgspec.Struct, frozen=True, kw_only=True):
    """Everything a load process needs (sent to spawned processes as msgpack).

    Units: seconds for durations, requests/s for ``rate`` (None = closed loop).
    token: the bearer token to send ("" for none): HTTP's ``Authorization: Bearer``
    on every request, a ``tcp://`` stream's first line (``rpc.authenticate``).
    mcp: None for JSON-RPC; else the target is an MCP Streamable HTTP endpoint driven with
    ``tools/call`` in this era (`broker.loadgen.mcp`), and each of ``calls`` names a tool
    (``method``) and its arguments (``params``, an object).
    """

    target: str
    calls: list[Call]
    connections: int = 16
    depth: int = 1
    pipeline: int = 1
    rate: float | None = None
    batch: int = 1
    ids: IdMode = "int"
    processes: int = 1
    duration: float = 10.0
    warmup: float = 1.0
    timeout: float = 30.0
    seed: int = 0
    token: str = ""
    mcp: McpEra | None = None


class Progress(msgspec.Struct, frozen=True, tag="progress"):
    """Counters of one load process so far (p99_ms: its own p99, 0 if not computed)."""

    calls: int
    errors: int
    failures: int
    transport_errors: int
    p99_ms: float


class ProcessResult(msgspec.Struct, frozen=True, tag="result"):
    """What one load process hands back at the end.

    histogram: `Latency.encode()` of its latencies (µs).
    unsent: open-loop requests that were due but never sent before the drain ended.
    refused_batches: batches the server answered with one error for the whole body.
    drain_s: how long answers kept coming after the measured window (an overloaded
        server in open loop answers the backlog then).
    """

    requests: int
    calls: int
    errors_by_code: dict[int, int]
    wrong_id: int
    missing: int
    duplicate: int
    malformed: int
    transport_errors: int
    unsent: int
    histogram: bytes
    drain_s: float = 0.0  # seconds from the end of the measured window to the last answer
    first_problem: str = ""
    refused_batches: int = 0
    interrupted: int = 0  # the signal that stopped the run early (0: it ran its course)
    window_s: float = 0.0  # the measured window's real length (shorter when interrupted)
    abandoned: int = 0  # interrupted: requests still in flight when it stopped (not errors)
    reconnects: int = 0  # connections reopened after a close, a reset or a failed connect
    backoffs: int = 0  # of those, the ones that waited first (after a failure)
    resent: int = 0  # HTTP: requests sent again after an unannounced close between answers
    unauthorized: int = 0  # answers refusing the token (`Tally.unauthorized`)
    # Open loop, of the measured window's schedule: requests sent, and those the process itself was
    # late for (sent `connection.LATE_S` or more after their intended time, or never sent, with room
    # on their connection: the load generator fell behind, not the server)
    sent: int = 0
    behind: int = 0
    # MCP (`Tally`'s fields of the same names)
    tool_errors: dict[str, int] = msgspec.field(default_factory=dict)
    initialized: int = 0
    sessions: int = 0
    protocol_version: str = ""

    def tally(self) -> Tally:
        """The counters as a `Tally`."""
        t = Tally()
        t.requests, t.calls = self.requests, self.calls
        t.errors_by_code = dict(self.errors_by_code)
        t.refused_batches = self.refused_batches
        t.wrong_id, t.missing, t.duplicate, t.malformed = (
            self.wrong_id, self.missing, self.duplicate, self.malformed)
        t.transport_errors = self.transport_errors
        t.resent = self.resent
        t.unauthorized = self.unauthorized
        t.tool_errors = dict(self.tool_errors)
        t.initialized, t.sessions, t.protocol_version = self.initialized, self.sessions, self.protocol_version
        t.first_problem = self.first_problem
        return t


class RunInterrupted(RunError):
    """Interrupted (signal ``signum``) before the load started: nothing was measured."""

    def __init__(self, signum: int) -> None:
        super().__init__("interrupted before the load started")
        self.signum = signum


class ProcessDied(RunError):
    """A load process died; ``results``: what the others measured (they were stopped)."""

    def __init__(self, message: str, results: list[ProcessResult]) -> None:
        super().__init__(message)
        self.results = results

