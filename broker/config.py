"""Broker settings, each declared once, and the loader that fills them.

Theory of operation
-------------------
The fields of `Config` are the one table of settings. Each field declares:

    name: Annotated[<type>, Meta(<constraint>), Doc("<one-line meaning>")] = <default>

* the field name is the setting's name and its TOML key; the CLI flag is
  ``--<name-with-dashes>`` (unless ``Doc.flag`` says otherwise) and the
  environment variable is ``RPC_BROKER_<NAME_UPPER>``;
* ``Seconds`` / ``Bytes`` carry the unit inside the type, and the defaults are
  written with the unit constants (``30 * SECONDS``, ``1 * MIB``);
* ``msgspec.Meta`` holds the constraint that msgspec enforces, and ``Literal``
  the enumerations;
* ``Doc`` holds the one-line meaning for ``--help`` and the reference page.

At import, `SETTINGS` derives one `Setting` row per field. `add_flags` (the
``rpc-broker serve`` flags), `render_reference` (README table), `dump_toml`
and `load` all read that table, so adding a setting means adding one field.

`load` layers the sources, lowest precedence first: defaults < TOML file <
environment < flags. Each value is checked against its field as soon as it is
read, so a `ConfigError` names the setting, the source it came from (file
path, variable or flag) and what is wrong; the merged result is then built
with one ``msgspec.convert``. ``method_timeouts`` is merged per method name
across layers; every other setting is replaced whole by a higher layer.
"""

import argparse
import difflib
import ipaddress
import json
import os
import re
import tomllib
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Final, Literal, get_args, get_origin

import msgspec
from msgspec import Meta

from broker import wire
from broker.errors import LocalError

ENV_PREFIX: Final = "RPC_BROKER_"


@dataclass(frozen=True, slots=True)
class Unit:
    """Unit marker inside ``Annotated``: ``name`` for docs, ``metavar`` for --help."""

    name: str
    metavar: str


@dataclass(frozen=True, slots=True)
class Doc:
    """Documentation marker inside ``Annotated``.

    ``text`` is the one-line meaning; ``rule`` a human wording of the
    constraint where the ``Meta`` alone reads badly (regex patterns);
    ``flag`` / ``metavar`` override the derived CLI flag and placeholder.
    """

    text: str
    rule: str = ""
    flag: str = ""
    metavar: str = ""


Seconds = Annotated[float, Unit("seconds", "SECONDS")]
Bytes = Annotated[int, Unit("bytes", "BYTES")]
SECONDS: Final = 1.0
BYTES: Final = 1
KIB: Final = 1024 * BYTES
MIB: Final = 1024 * KIB
GIB: Final = 1024 * MIB
# Upper bound of every duration: past it a value is a typo or an attempt at "never"
# (inf, 1e300), which deadline and timer arithmetic cannot take (int(inf) raises).
DAY: Final = 86400 * SECONDS
# Lower bound of every positive duration: the event loop's clock (uvloop) has 1 ms
# steps, so a shorter one would not be kept as written. Refused, not rounded up: as
# nginx (whose smallest time unit is ms) and gunicorn do, a value the broker cannot
# honour stops it at start rather than silently meaning something else (`_check`).
MS: Final = 0.001 * SECONDS

LogLevel = Literal["debug", "info", "warning", "error"]
_IDENT: Final = r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*"
# A Host header's name part (RFC 9110 7.2): reg-name, IPv4, or IPv6 with or without
# brackets. The pattern lets through what may be an IPv6 literal; `_host_problem`
# then checks it with `ipaddress` (a regex cannot tell "10.1.2.3:8080" from IPv6).
_HOST_NAME: Final = r"^(\*|[A-Za-z0-9_.~-]+|\[[0-9A-Fa-f:.]+\]|[0-9A-Fa-f.]*:[0-9A-Fa-f:.]*)\Z"
# A serialized origin (RFC 6454 6.2): scheme "://" host [":" port], or "null", or '*'.
_ORIGIN: Final = r"^(\*|null|[A-Za-z][A-Za-z0-9+.-]*://[^/\s]+)\Z"


# A Unix socket's path: 108 bytes of sun_path with the NUL (unix(7)). The broker's worker
# socket is socket_dir + "/rpc-broker-XXXXXXXX/workers.sock" (`pool.Pool.start`): 33 more.
SOCKET_PATH_BYTES = 107
SOCKET_DIR_BYTES = SOCKET_PATH_BYTES - len("/rpc-broker-XXXXXXXX/workers.sock")
_PATH_BYTES = {"stream_socket": SOCKET_PATH_BYTES, "socket_dir": SOCKET_DIR_BYTES}


class Config(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Validated broker settings; build one with `load` (or ``Config()`` for defaults).

    Durations are float seconds, sizes int bytes. ``method_timeouts`` maps a
    JSON-RPC method name to its deadline in seconds; treat it as read-only.
    """

    host: Annotated[str, Meta(min_length=1),
                    Doc("address to bind (loopback by default)", metavar="ADDR")
                    ] = "127.0.0.1"
    port: Annotated[int, Meta(ge=0, le=65535),
                    Doc("TCP port to listen on")
                    ] = 8080
    workers: Annotated[int, Meta(ge=0, le=1024),
                       Doc("worker processes; 0 means one per CPU")
                       ] = 0
    app: Annotated[str, Meta(pattern=rf"^{_IDENT}:[A-Za-z_]\w*\Z"),
                   Doc("'module:attribute' of the broker.worker.Registry to serve",
                       rule="module:attribute, as in mytools:registry (a module's dotted name, not a file path: its directory the current one or on PYTHONPATH; then the Registry's name in it)",
                       metavar="MODULE:ATTR")
                   ] = "broker.demo:registry"
    # (RFC 3986's path characters, matched as typed: hostile testing, round 32, found `/é`
    # and `/a"b` taken, which no client reaches; `\Z`, as `$` let a last newline through;
    # round 34: a `%` not starting a %XX escape, `/%zz`)
    rpc_path: Annotated[str, Meta(pattern=r"^/(?:[A-Za-z0-9\-._~!$&'()*+,;=:@/]|%[0-9A-Fa-f]{2})*\Z"),
                        Doc("HTTP path that accepts JSON-RPC POSTs",
                            rule="starts with '/', then only RFC 3986's path characters: ASCII letters "
                                 "and digits, - . _ ~ ! $ & ' ( ) * + , ; = : @ / and % (a %XX escape, "
                                 "matched as typed); no whitespace, '?' or '#' (a query or fragment is "
                                 "not part of the path it is matched against)",
                            metavar="PATH")
                        ] = "/"
    stream_port: Annotated[int, Meta(ge=0, le=65535),
                           Doc("also serve newline-delimited JSON-RPC over TCP on host:this "
                               "port; 0 means off")
                           ] = 0
    stream_socket: Annotated[str, Meta(max_length=SOCKET_PATH_BYTES),
                             Doc("also serve newline-delimited JSON-RPC on a Unix socket at "
                                 "this path (mode 0600); empty means off",
                                 rule=f"at most {SOCKET_PATH_BYTES} bytes (a socket path's limit)", metavar="PATH")
                             ] = ""
    allowed_hosts: Annotated[
        tuple[Annotated[str, Meta(pattern=_HOST_NAME)], ...],
        Doc("Host header names (any port) accepted on rpc_path and /metrics, besides "
            "host and metrics_host; other hosts get 421 (against DNS rebinding); '*' "
            "accepts any", rule="host names or IP addresses, without a port; or '*'", metavar="NAMES"),
    ] = ("localhost", "127.0.0.1", "[::1]")
    allowed_origins: Annotated[
        tuple[Annotated[str, Meta(pattern=_ORIGIN)], ...],
        Doc("browser origins allowed to call rpc_path (answered with CORS headers); a "
            "request with another Origin header gets 403; '*' allows any",
            rule="origins like https://app.example (no :443 or :80, as browsers send them) or '*'",
            metavar="ORIGINS"),
    ] = ()
    metrics: Annotated[bool,
                       Doc("serve Prometheus metrics at GET /metrics")
                       ] = True
    metrics_host: Annotated[str, Meta(min_length=1),
                            Doc("address of the separate metrics listener (with metrics_port)",
                                metavar="ADDR")
                            ] = "127.0.0.1"
    metrics_port: Annotated[int, Meta(ge=0, le=65535),
                            Doc("serve /metrics (and /healthz, /readyz) on this port instead "
                                "of the RPC listener; 0 means on the RPC listener")
                            ] = 0
    max_body_bytes: Annotated[Bytes, Meta(ge=1),
                              Doc("largest HTTP request body")
                              ] = 1 * MIB
    max_batch: Annotated[int, Meta(ge=1),
                         Doc("largest batch (number of elements)")
                         ] = 1000
    max_depth: Annotated[int, Meta(ge=1, le=10000),
                         Doc("largest nesting depth of a call's params (checked in "
                             "the worker; bodies past ~1000 levels are refused by the "
                             "parser whatever this says)")
                         ] = 64
    timeout: Annotated[Seconds, Meta(ge=MS, le=DAY),
                       Doc("default per-call deadline")
                       ] = 30 * SECONDS
    method_timeouts: Annotated[
        dict[Annotated[str, Meta(min_length=1)], Annotated[Seconds, Meta(ge=MS, le=DAY)]],
        Doc("per-method deadlines in seconds, overriding timeout (in TOML, quote "
            "method names that contain dots)",
            flag="--method-timeout", metavar="NAME=SECONDS"),
    ] = {}
    worker_concurrency: Annotated[int, Meta(ge=1),
                                  Doc("calls in flight per worker")
                                  ] = 100
    sync_prefetch: Annotated[int, Meta(ge=0),
                             Doc("calls a worker busy in a sync handler may hold besides it "
                                 "(it cannot start them until that handler returns; at 0 they "
                                 "wait in the broker's queue and go to the first worker free, "
                                 "rather than wait out a call of unknown length); a "
                                 "value of worker_concurrency or more turns this routing off")
                             ] = 0
    connection_share: Annotated[float, Meta(gt=0, le=1),
                                Doc("the fraction of the workers' places (workers x "
                                    "worker_concurrency) one connection's calls may hold at "
                                    "once (at least 1 call); the others wait in the queue, in "
                                    "turn, and the rest are kept for other connections (at "
                                    "0.5, two busy connections hold every place); and the "
                                    "fraction of the workers its blocking sync calls may hold "
                                    "(each holds its worker whole; at least 1); 1 lets one "
                                    "connection take them all",
                                    rule="0 < x <= 1")
                                ] = 0.5
    max_queue: Annotated[int, Meta(ge=0),
                         Doc("calls waiting for a free worker before the broker "
                             "answers 'overloaded'; at 0 none waits, and a connection's "
                             "calls past its connection_share go to an idle worker, if any "
                             "(not blocking sync calls)")
                         ] = 10000
    max_queue_bytes: Annotated[Bytes, Meta(ge=0),
                               Doc("total bytes the waiting calls hold (raw params and "
                                   "ids) before the broker answers 'overloaded'")
                               ] = 64 * MIB
    max_worker_params_bytes: Annotated[Bytes, Meta(ge=0),
                                       Doc("bytes of large params (16 KiB or more in a call; in a batch, "
                                           "such calls' together) one worker holds in its calls in flight "
                                           "(binding them takes its loop ~50 ms and ~24 MB a MiB of small "
                                           "objects), and one connection connection_share of all the workers'; past it "
                                           "such a call waits in the queue for room (one always goes); "
                                           "0: no bound")
                                       ] = 4 * MIB
    grace_period: Annotated[Seconds, Meta(ge=0, le=DAY),
                            Doc("on SIGTERM, how long in-flight calls may take; 0 answers "
                                "them 'shutting down' at once",
                                rule="0, or 0.001..86400.0")
                            ] = 30 * SECONDS
    keepalive_timeout: Annotated[Seconds, Meta(ge=MS, le=DAY),
                                 Doc("idle HTTP keep-alive connections are closed "
                                     "after this")
                                 ] = 75 * SECONDS
    request_timeout: Annotated[Seconds, Meta(ge=MS, le=DAY),
                               Doc("an HTTP request's line, headers and body must all "
                                   "arrive within this of its first byte, however they "
                                   "trickle; past it the client gets 408 and the "
                                   "connection closes")
                               ] = 30 * SECONDS
    send_timeout: Annotated[Seconds, Meta(ge=MS, le=DAY),
                            Doc("a connection whose client does not read its answers "
                                "(answers written and not taken, in the send buffer or the "
                                "kernel's send queue, and no byte of them taken: "
                                "acknowledged by the client's kernel) for this long is "
                                "reset, its unsent answers dropped (HTTP and NDJSON; "
                                "nginx's send_timeout)")
                            ] = 60 * SECONDS
    max_connections: Annotated[int, Meta(ge=1),
                               Doc("open client connections at most, per listener; at it the "
                                   "least recently active idle one makes room, else one with a "
                                   "request under way, the one whose request comes slowest "
                                   "(bytes a second; HTTP 408, NDJSON a -32600 line), and with neither a new one is refused (HTTP "
                                   "503, NDJSON a -32000 line) "
                                   "and closed (the broker raises its open-files limit to fit "
                                   "every listener's, when the system allows; else each listener "
                                   "gets its share, with a warning)")
                               ] = 10000
    max_frame_bytes: Annotated[Bytes, Meta(ge=64 * KIB, le=1 * GIB),
                               Doc("largest worker wire frame: a call's params or "
                                   "result, and the worker's method list")
                               ] = wire.MAX_FRAME_BYTES
    max_incoming_bytes: Annotated[Bytes, Meta(ge=1),
                                  Doc("request bytes still arriving or waiting, over all connections "
                                      "together: HTTP heads and bodies and NDJSON lines whose end has not "
                                      "come yet, and whole ones waiting to be dispatched (their client owed "
                                      "max_response_bytes, or not reading; the rest of a read left for a "
                                      "later turn, kept past it all the same when it would not fit: at most "
                                      "one read, 256 KiB, a connection); one "
                                      "that would take them past this is refused "
                                      "(HTTP 503, NDJSON a -32000 line) and its bytes dropped",
                                      rule="max_body_bytes or more")
                                  ] = 256 * MIB
    max_outgoing_bytes: Annotated[Bytes, Meta(ge=64 * KIB),
                                  Doc("answers owed and not yet taken by their clients, over "
                                      "all connections together, in bytes; a result past it is "
                                      "answered with -32603, and the connections owed the most "
                                      "are reset at once until it is under half",
                                      rule="max_response_bytes or more")
                                  ] = 256 * MIB
    max_response_bytes: Annotated[Bytes, Meta(ge=64 * KIB, le=1 * GIB),
                                  Doc("answers one client connection may be owed and not have "
                                      "read, in bytes (one response or batch array, or several "
                                      "pipelined); a result past it is answered with -32603, "
                                      "and the connection's next requests wait while it is "
                                      "reached or the client is not reading")
                                  ] = 32 * MIB
    restart_backoff_max: Annotated[Seconds, Meta(ge=MS, le=DAY),
                                   Doc("cap of the exponential backoff between "
                                       "restarts of a crashing worker")
                                   ] = 10 * SECONDS
    boot_timeout: Annotated[Seconds, Meta(ge=MS, le=DAY),
                            Doc("a worker that has not said HELLO this long after its spawn "
                                "(its app import hangs, or the process is stopped) is killed; "
                                "at start that is a boot failure, exit 3")
                            ] = 60 * SECONDS
    cancel_grace: Annotated[Seconds, Meta(ge=MS, le=DAY),
                            Doc("a worker that has not answered a timed-out call this "
                                "long after the CANCEL is deemed hung and killed")
                            ] = 10 * SECONDS
    socket_dir: Annotated[str, Meta(max_length=SOCKET_DIR_BYTES),
                          Doc("directory for the worker Unix sockets (each broker makes a "
                              "private 0700 one inside it; made if missing, as mkdir does: "
                              "its parent must exist); empty means one in the "
                              "temporary directory. The start-up log names it; the stop "
                              "removes it, a SIGKILL leaves it behind",
                              rule=f"at most {SOCKET_DIR_BYTES} bytes (a socket path's limit, less the "
                                   f"{SOCKET_PATH_BYTES - SOCKET_DIR_BYTES} the broker adds)", metavar="DIR")
                          ] = ""
    debug: Annotated[bool,
                     Doc("put tracebacks in error 'data' (never on in production)")
                     ] = False
    log_level: Annotated[LogLevel,
                         Doc("logging threshold")
                         ] = "info"
    event_loop: Annotated[Literal["uvloop", "asyncio"],
                          Doc("the broker process's event loop (its front-ends and dispatcher; the workers"
                              " run uvloop): uvloop, or the standard library's asyncio (as uvicorn's --loop;"
                              " the tests run the front-ends on both)")
                          ] = "uvloop"

    @property
    def worker_count(self) -> int:
        """Worker processes to start: ``workers``, or when 0 the CPUs this process may use."""
        return self.workers or _cpu_count()


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))  # respects taskset / cpusets
    except (AttributeError, OSError):
        return os.cpu_count() or 1


class ConfigError(LocalError):
    """A setting could not be loaded; the message names source, setting and problem."""

    hint = "rpc-broker check-config [FILE] checks settings; rpc-broker serve --help lists them all"


Kind = Literal["bool", "int", "float", "str", "choice", "map", "list"]


@dataclass(frozen=True, slots=True)
class Setting:
    """One row of the settings table, derived from a `Config` field.

    ``default`` is the Python value; ``unit`` is "" / "seconds" / "bytes";
    ``rule`` is the constraint in words ("" when any value of the type goes).
    """

    name: str
    kind: Kind
    default: object
    unit: str
    rule: str
    doc: str
    flag: str
    env: str
    metavar: str
    choices: tuple[str, ...]


def _split(tp: object) -> tuple[object, tuple[object, ...]]:
    """``Annotated[base, *extras]`` -> ``(base, extras)``; any other type -> ``(tp, ())``."""
    if get_origin(tp) is Annotated:
        base, *extras = get_args(tp)
        return base, tuple(extras)
    return tp, ()


def _rule_of(meta: Meta | None) -> str:
    if meta is None:
        return ""
    parts = []
    if meta.ge is not None and meta.le is not None:
        parts.append(f"{meta.ge}..{meta.le}")
    else:
        for op, bound in ((">=", meta.ge), (">", meta.gt), ("<=", meta.le), ("<", meta.lt)):
            if bound is not None:
                parts.append(f"{op} {bound}")
    if meta.min_length == 1:
        parts.append("non-empty")
    elif meta.min_length is not None:
        parts.append(f"at least {meta.min_length} characters")
    if meta.max_length is not None:
        parts.append(f"at most {meta.max_length} characters")
    if meta.pattern is not None:
        parts.append(f"matches {meta.pattern}")
    return ", ".join(parts)


_KIND_OF_TYPE: Final[dict[object, Kind]] = {bool: "bool", int: "int", float: "float", str: "str"}
_METAVAR_OF_KIND: Final[dict[Kind, str]] = {
    "bool": "", "int": "INT", "float": "NUMBER", "str": "TEXT", "choice": "", "map": "", "list": "LIST",
}


def _derive(field: msgspec.structs.FieldInfo) -> Setting:
    base, extras = _split(field.type)
    docs = [x for x in extras if isinstance(x, Doc)]
    if not docs:
        raise TypeError(f"Config.{field.name} has no Doc(...) annotation")
    doc = docs[0]
    value_extras = extras
    choices: tuple[str, ...] = ()
    if get_origin(base) is dict:
        kind: Kind = "map"
        _, value_extras = _split(get_args(base)[1])
    elif get_origin(base) is tuple:
        kind = "list"
        _, value_extras = _split(get_args(base)[0])
    elif get_origin(base) is Literal:
        kind, choices = "choice", tuple(str(c) for c in get_args(base))
    else:
        kind = _KIND_OF_TYPE[base]
    unit = next((x for x in value_extras if isinstance(x, Unit)), None)
    meta = next((x for x in value_extras if isinstance(x, Meta)), None)
    rule = doc.rule or _rule_of(meta)
    if kind == "choice":
        rule = "one of " + ", ".join(choices)
    elif kind == "map" and rule:
        rule = f"each value {rule}"
    elif kind == "list" and rule and not doc.rule:
        rule = f"each item {rule}"
    default = field.default_factory() if field.default is msgspec.NODEFAULT else field.default
    metavar = doc.metavar or (unit.metavar if unit else "") or _METAVAR_OF_KIND[kind]
    if kind == "choice":
        metavar = "{" + ",".join(choices) + "}"
    return Setting(
        name=field.name, kind=kind, default=default, unit=unit.name if unit else "",
        rule=rule, doc=doc.text, flag=doc.flag or "--" + field.name.replace("_", "-"),
        env=ENV_PREFIX + field.name.upper(), metavar=metavar, choices=choices,
    )


SETTINGS: Final[tuple[Setting, ...]] = tuple(_derive(f) for f in msgspec.structs.fields(Config))
_BY_NAME: Final[dict[str, Setting]] = {s.name: s for s in SETTINGS}


# -- rendering ---------------------------------------------------------------


def _toml(value: object) -> str:
    """TOML literal for a setting value (str, bool, int, float, str list or str->float dict)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        # JSON string escapes are valid TOML; DEL is a control character to TOML (it must be
        # escaped in a basic string), not to JSON (round 30: check-config wrote it raw)
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(value, float):
        return repr(value)  # 30.0, inf, nan are TOML floats
    if isinstance(value, dict):
        items = ", ".join(f"{_toml(str(k))} = {_toml(v)}" for k, v in value.items())
        return "{ " + items + " }" if items else "{}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return str(value)


def _default_text(s: Setting) -> str:
    text = _toml(s.default)
    if s.unit and s.kind != "map":
        text += f" {s.unit}"
    if s.unit == "bytes" and isinstance(s.default, int) and s.default % MIB == 0:
        text += f" ({s.default // MIB} MiB)"
    return text


def add_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """Add one flag per setting to ``parser`` (dest = setting name, absent unless given).

    Values arrive as text (bools as ``--x/--no-x``, ``method_timeouts`` as a
    list of ``NAME=SECONDS``); `load` parses and checks them, so bad values
    become a `ConfigError` naming the flag.
    """
    for s in SETTINGS:
        help_text = f"{s.doc}. Default: {_default_text(s)}."
        if s.rule:
            help_text += f" Allowed: {s.rule}."
        if s.kind in ("map", "list"):
            help_text += " Repeatable."
        help_text += f" Env: {s.env}."
        help_text = help_text.replace("%", "%%")
        if s.kind == "bool":
            parser.add_argument(s.flag, dest=s.name, action=argparse.BooleanOptionalAction,
                                default=argparse.SUPPRESS, help=help_text)
        elif s.kind in ("map", "list"):
            parser.add_argument(s.flag, dest=s.name, action="append", metavar=s.metavar,
                                default=argparse.SUPPRESS, help=help_text)
        else:
            parser.add_argument(s.flag, dest=s.name, metavar=s.metavar,
                                default=argparse.SUPPRESS, help=help_text)


def render_reference() -> str:
    """Markdown table of every setting (setting / TOML key / flag / env var / default / meaning)."""
    rows = [
        "| setting | TOML key | flag | env var | default | meaning |",
        "|---|---|---|---|---|---|",
    ]
    for s in SETTINGS:
        key = f"`[{s.name}]` table" if s.kind == "map" else f"`{s.name}`"
        if s.kind == "bool":
            flag = f"`{s.flag}` / `--no-{s.flag[2:]}`"
        else:
            flag = f"`{s.flag} {s.metavar}`"
        meaning = s.doc[0].upper() + s.doc[1:] + "."
        if s.rule:
            meaning += f" Allowed: {s.rule}."
        if s.kind == "map":
            meaning += " Env value: a JSON object; flag repeatable."
        elif s.kind == "list":
            meaning += " Env value and flag: comma-separated; flag repeatable."
        cells = [s.name, key, flag, f"`{s.env}`", f"`{_default_text(s)}`", meaning]
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(rows) + "\n"


def dump_toml(cfg: Config) -> str:
    """Effective settings of ``cfg`` as TOML text, one ``name = value`` line per setting."""
    lines = []
    for s in SETTINGS:
        line = f"{s.name} = {_toml(getattr(cfg, s.name))}"
        if s.name == "workers":
            line += f"  # {cfg.worker_count} processes"
        lines.append(line)
    return "\n".join(lines) + "\n"


# -- loading -----------------------------------------------------------------

_BOOLS: Final = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}
_AT_PATH: Final = re.compile(r" - at `[^`]*`( in `[^`]*`)?$")
_REGEX: Final = re.compile(r"^expected `str` matching regex (['\"]).*\1$")  # msgspec's wording
# (a regex holding a ' is quoted with ": rpc_path's, round 32, was shown as it is)


def _unknown(source: str, what: str) -> ConfigError:
    names = [s.name for s in SETTINGS]
    close = difflib.get_close_matches(what.lower().removeprefix(ENV_PREFIX.lower()), names, n=1)
    # (in the form it was written in: an environment variable's name for one, as the
    # new user's check found RPC_BROKER_WORKER answered "did you mean 'workers'?")
    suggestion = (ENV_PREFIX + close[0].upper()) if close and what.startswith(ENV_PREFIX) else close[0] if close else ""
    hint = f" (did you mean {suggestion!r}?)" if close else ""
    return ConfigError(f"{source}: unknown setting {what!r}{hint}")


def _check(s: Setting, value: object, source: str) -> None:
    """Validate one value against its `Config` field; raise `ConfigError` naming it."""
    limit = _PATH_BYTES.get(s.name)
    if limit is not None and isinstance(value, str) and "\0" in value:  # (hostile testing: a traceback at start)
        raise ConfigError(f"{source}: {s.name} = {value!r}: a path cannot hold a NUL byte")
    if limit is not None and isinstance(value, str) and len(os.fsencode(value)) > limit:
        raise ConfigError(
            f"{source}: {s.name} = {value!r}: expected at most {limit} bytes (it has {len(os.fsencode(value))}): "
            f"a Unix socket's path holds at most {SOCKET_PATH_BYTES} bytes (sun_path, unix(7))"
            + (f", and the broker adds {SOCKET_PATH_BYTES - SOCKET_DIR_BYTES} to socket_dir"
               if s.name == "socket_dir" else "")
        )
    if s.name == "rpc_path" and isinstance(value, str) and {".", ".."} & set(value.split("/")):
        raise ConfigError(f"{source}: rpc_path = {value!r}: a '.' or '..' segment, which clients remove "
                          "before they send the path (RFC 3986 section 5.2.4): it could not be reached")
    if s.name in ("host", "metrics_host") and isinstance(value, str) and value != "".join(value.split()):
        raise ConfigError(f"{source}: {s.name} = {value!r}: white space in an address, which nothing can be "
                          "bound to")  # (rounds 34, 35: check-config said ok, serve then failed)
    if s.name == "host" and isinstance(value, str) and value.startswith("[") and value.endswith("]"):
        raise ConfigError(f"{source}: host = {value!r}: give the address without brackets "
                          f"({value[1:-1]!r}): brackets belong in URLs, not in the address to bind")
    if s.name == "allowed_hosts" and isinstance(value, (list, tuple)):
        for entry in value:
            problem = _host_problem(str(entry))
            if problem:
                raise ConfigError(f"{source}: allowed_hosts entry {entry!r}: {problem}")
    entries = value.items() if s.kind == "map" and isinstance(value, dict) else [(None, value)]
    for key, item in entries:
        label = s.name if key is None else f"{s.name}[{key!r}]"
        if s.unit == "seconds" and isinstance(item, (int, float)) and 0 < item < MS:
            least = "0 or at least" if s.name == "grace_period" else "at least"
            raise ConfigError(
                f"{source}: {label} = {item!r}: must be {least} {MS} (1 ms): the event loop's "
                "clock has 1 ms steps, so a shorter duration would not be kept as written"
            )
        try:
            msgspec.convert({s.name: item if key is None else {key: item}}, Config)
        except msgspec.ValidationError as exc:
            problem = _AT_PATH.sub("", str(exc))
            problem = problem[0].lower() + problem[1:]
            if key is not None and key == "":  # (the name, not the value: round 27 gave the values' range)
                problem = "a method name is not empty"
            elif s.rule and _REGEX.search(problem):  # the rule in words, not the regex behind it
                problem = f"expected {s.rule}"
            elif s.rule:
                problem += f" (allowed: {s.rule})"
            if s.kind == "map" and isinstance(item, dict):  # TOML's dotted key: `cart.total = 2` is a table
                problem += f"; a method name with a dot is quoted in TOML: \"{key}.{next(iter(item), '')}\" = ..."
            raise ConfigError(f"{source}: {label} = {item!r}: {problem}") from None


def _host_problem(entry: str) -> str:
    """What is wrong with an `allowed_hosts` entry that passed `_HOST_NAME`, or "".

    An entry with a colon must be an IPv6 literal (RFC 4291 2.2, checked with
    `ipaddress`), bracketed or not; `name:port`, `IPv4:port` and `[IPv6]:port` are
    refused with a hint, since an entry matches its name on any port."""
    if ":" not in entry:
        return ""
    bare = entry[1:-1] if entry.startswith("[") and entry.endswith("]") else entry
    try:
        ipaddress.IPv6Address(bare)
        return ""
    except ValueError:
        pass
    name, _, port = entry.rpartition(":")
    if port.isdigit() and name and (":" not in name or (name.startswith("[") and name.endswith("]"))):
        return (f"has a port ({port}); entries match their host on any port, so write {name!r}")
    return "not an IPv6 address (an entry with ':' must be one, like ::1 or [::1])"


def _parse_text(s: Setting, text: str, source: str) -> object:
    """Parse an env/flag string into the setting's Python shape; range checks come later."""
    def bad(expected: str) -> ConfigError:
        return ConfigError(f"{source}: {s.name} = {text!r}: expected {expected}")

    unit = f" of {s.unit}" if s.unit else ""
    if s.kind == "bool":
        try:
            return _BOOLS[text.strip().lower()]
        except KeyError:
            raise bad("one of 1/0/true/false/yes/no") from None
    # (Python's int() and float() also take "8_080" and other scripts' digits: not the
    # numbers a TOML file or a flag would take, hostile testing)
    plain = text.isascii() and "_" not in text
    if s.kind == "int":
        try:
            if plain:
                return int(text)
        except ValueError:
            pass
        raise bad(f"an integer{unit}")
    if s.kind == "float":
        try:
            if plain:
                return float(text)
        except ValueError:
            pass
        raise bad(f"a number{unit}")
    if s.kind == "list":
        return [item.strip() for item in text.split(",") if item.strip()]
    if s.kind == "map":
        try:
            parsed: object = msgspec.json.decode(text)
        except msgspec.DecodeError as exc:
            raise bad(f'a JSON object like {{"method": seconds}} ({exc})') from None
        if not isinstance(parsed, dict):
            raise bad('a JSON object like {"method": seconds}')
        return parsed
    return text


def _parse_pairs(s: Setting, pairs: Sequence[str], source: str) -> dict[str, object]:
    """``["a=1", "b=2.5"]`` -> ``{"a": 1.0, "b": 2.5}``; a later pair wins. Split at the
    last ``=``: a method name may hold one (``filter=eq=0.5``), a number never does."""
    out: dict[str, object] = {}
    for pair in pairs:
        name, sep, seconds = pair.rpartition("=")
        name = name.strip()
        try:
            if not sep or not name:
                raise ValueError
            out[name] = float(seconds)
        except ValueError:
            raise ConfigError(f"{source}: {s.name}: expected NAME=SECONDS, got {pair!r}") from None
    return out


def _from_file(path: str) -> list[tuple[Setting, object, str]]:
    source = f"config file {path}"
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"{source}: cannot read: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{source}: invalid TOML: {exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{source}: invalid TOML: not UTF-8 ({exc.reason})") from None
    out = []
    for key, value in data.items():
        s = _BY_NAME.get(key)
        if s is None:
            raise _unknown(source, key)
        out.append((s, value, source))
    return out


def _from_env(env: Mapping[str, str]) -> list[tuple[Setting, object, str]]:
    out = []
    for var, text in env.items():
        if not var.startswith(ENV_PREFIX):
            continue
        source = f"environment variable {var}"
        s = _BY_NAME.get(var[len(ENV_PREFIX):].lower())
        if s is None or s.env != var:
            raise _unknown(source, var)
        out.append((s, _parse_text(s, text, source), source))
    return out


def _from_flags(flags: Mapping[str, object]) -> list[tuple[Setting, object, str]]:
    out = []
    for name, value in flags.items():
        s = _BY_NAME.get(name)
        if s is None:
            raise _unknown("flags", name)
        if value is None:
            continue
        source = f"flag {s.flag}"
        if s.kind == "map" and isinstance(value, (str, list, tuple)):
            value = _parse_pairs(s, [value] if isinstance(value, str) else value, source)
        elif s.kind == "list" and isinstance(value, (str, list, tuple)):
            value = [item for text in ([value] if isinstance(value, str) else value)
                     for item in typing.cast(list[str], _parse_text(s, str(text), source))]
        elif isinstance(value, str) and s.kind not in ("str", "choice"):
            value = _parse_text(s, value, source)
        out.append((s, value, source))
    return out


def load(path: str | None, env: Mapping[str, str], flags: Mapping[str, object]) -> Config:
    """Build the `Config`: defaults < TOML file at ``path`` < ``env`` < ``flags``.

    ``env`` is an environment mapping (only ``RPC_BROKER_*`` names are read;
    values are text: bools 1/0/true/false/yes/no, ``method_timeouts`` a JSON
    object). ``flags`` maps setting names to values; ``None`` means not given,
    strings are parsed like env values, and ``method_timeouts`` may be a list
    of ``"NAME=SECONDS"``. Raises `ConfigError` naming source, setting and
    problem for: an unreadable or invalid TOML file, an unknown key or
    ``RPC_BROKER_*`` variable, an unparsable value, a wrong type or a value
    out of range.
    """
    layers = [*(_from_file(path) if path is not None else []), *_from_env(env), *_from_flags(flags)]
    merged: dict[str, object] = {}
    sources: dict[str, str] = {}  # setting name -> where its value came from
    for s, value, source in layers:
        _check(s, value, source)
        sources[s.name] = source if s.name not in sources or s.kind != "map" else f"{sources[s.name]} and {source}"
        previous = merged.get(s.name)
        if isinstance(previous, dict) and isinstance(value, dict):
            value = {**previous, **value}  # method_timeouts: merged per method name
        if type(value) is float and value == 0:  # (-0.0 is 0: echoed as "-0.0", hostile testing)
            value = 0.0
        merged[s.name] = value
    try:
        cfg = msgspec.convert(merged, Config)
    except msgspec.ValidationError as exc:  # unreachable once every value passed _check
        raise ConfigError(f"invalid configuration: {exc}") from None
    clash = _clash(cfg)
    if clash is not None:
        problem, names = clash
        where = "; ".join(f"{name} from {sources.get(name, 'the default')}" for name in names)
        raise ConfigError(f"{problem} ({where})")
    return cfg


def _serialized_origin(origin: str) -> str:
    """`origin` (`scheme://host[:port]`) lower-cased as a browser serializes it for its
    Origin header (RFC 6454 6.2): no user info, the host in ASCII (IDNA), no port when it
    is the scheme's default, and no leading zeros; "" if its port is not 1..65535. (Hostile
    testing, rounds 26 and 27: `https://app.example:443`, `:0443`, `user@` and `bücher`
    were accepted, and never matched any request.)"""
    scheme, _, authority = origin.partition("://")
    host_port = authority.rpartition("@")[2]
    host, colon, port = host_port.rpartition(":") if not host_port.endswith("]") else (host_port, "", "")
    if not colon:
        host, port = host_port, ""
    if port:
        if not port.isdigit() or not 1 <= int(port) <= 65535:
            return ""
        port = str(int(port))
        if {"https": "443", "http": "80"}.get(scheme.lower()) == port:
            port = ""
    try:
        host = host.encode("idna").decode() if not host.isascii() else host
    except UnicodeError:
        return ""
    return f"{scheme}://{host}{':' + port if port else ''}".lower()


def _clash(cfg: Config) -> tuple[str, tuple[str, ...]] | None:
    """Settings that are each valid but clash: (the problem, the settings involved), or None."""
    if cfg.max_body_bytes > cfg.max_frame_bytes - 1 * KIB:
        return (
            f"max_body_bytes = {cfg.max_body_bytes} must be at most max_frame_bytes - 1024"
            f" = {cfg.max_frame_bytes - 1 * KIB}: a call's params travel to its worker in one frame"
        ), ("max_body_bytes", "max_frame_bytes")
    if cfg.max_incoming_bytes < cfg.max_body_bytes:
        return (
            f"max_incoming_bytes = {cfg.max_incoming_bytes} must be at least max_body_bytes"
            f" = {cfg.max_body_bytes}: a body of that size arriving in pieces would always be refused"
        ), ("max_incoming_bytes", "max_body_bytes")
    if cfg.max_outgoing_bytes < cfg.max_response_bytes:
        return (
            f"max_outgoing_bytes = {cfg.max_outgoing_bytes} must be at least max_response_bytes"
            f" = {cfg.max_response_bytes}: one connection's answers could not reach their own limit"
        ), ("max_outgoing_bytes", "max_response_bytes")
    if "null" in cfg.allowed_origins:
        return (
            "allowed_origins = 'null' would let every web page call: a sandboxed iframe or a data: page of any site"
            " sends Origin: null; list the origins of your pages, or '*' if any page may call"
        ), ("allowed_origins",)
    for origin in cfg.allowed_origins:
        if origin in ("*", "null"):
            continue
        serialized = _serialized_origin(origin)
        if serialized != origin.lower():
            return (
                f"allowed_origins {origin!r} is not an origin as a browser sends it in its Origin header"
                f" (RFC 6454 6.2: no user info, no default port, the port without leading zeros, the host"
                f" in ASCII), so it would never match: "
                + (f"write {serialized!r}" if serialized else "its port is not 1..65535")
            ), ("allowed_origins",)
    if cfg.rpc_path in ("/healthz", "/readyz", "/metrics"):
        return f"rpc_path = {cfg.rpc_path!r} would hide the broker's own {cfg.rpc_path}: choose another path", ("rpc_path",)
    if cfg.metrics_port and not cfg.metrics:
        return "metrics_port is set but metrics = false: set metrics = true, or metrics_port = 0", ("metrics_port", "metrics")
    ports = {"port": cfg.port, "stream_port": cfg.stream_port}
    if cfg.metrics:
        ports["metrics_port"] = cfg.metrics_port
    seen: dict[int, str] = {}
    for name, port in ports.items():
        if port == 0:  # 0: off (stream_port, metrics_port) or OS-chosen (port)
            continue
        if port in seen:
            return f"{name} = {port} is also {seen[port]}: each listener needs its own port", (seen[port], name)
        seen[port] = name
    return None
