"""The settings table: `Config`, each setting declared once, and the rows derived from it.

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
(rendering.py) and `load` (loading.py) all read that table, so adding a setting
means adding one field.
"""

import os
from dataclasses import dataclass
from typing import Annotated, Final, Literal, get_args, get_origin

import msgspec
from msgspec import Meta

from broker import wire
from broker.errors import LocalError
from broker.policy import GLOB

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
# honour stops it at start rather than silently meaning something else (`loading._check`).
MS: Final = 0.001 * SECONDS

LogLevel = Literal["debug", "info", "warning", "error"]
_IDENT: Final = r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*"
# A Host header's name part (RFC 9110 7.2): reg-name, IPv4, or IPv6 with or without
# brackets. The pattern lets through what may be an IPv6 literal; `loading._host_problem`
# then checks it with `ipaddress` (a regex cannot tell "10.1.2.3:8080" from IPv6).
_HOST_NAME: Final = r"^(\*|[A-Za-z0-9_.~-]+|\[[0-9A-Fa-f:.]+\]|[0-9A-Fa-f.]*:[0-9A-Fa-f:.]*)\Z"
# A serialized origin (RFC 6454 6.2): scheme "://" host [":" port], or "null", or '*'.
_ORIGIN: Final = r"^(\*|null|[A-Za-z][A-Za-z0-9+.-]*://[^/\s]+)\Z"


# A Unix socket's path: 108 bytes of sun_path with the NUL (unix(7)). The broker's worker
# socket is socket_dir + "/rpc-broker-XXXXXXXX/workers.sock" (`pool.Pool.start`): 33 more.
SOCKET_PATH_BYTES = 107
SOCKET_DIR_BYTES = SOCKET_PATH_BYTES - len("/rpc-broker-XXXXXXXX/workers.sock")
_PATH_BYTES = {"stream_socket": SOCKET_PATH_BYTES, "socket_dir": SOCKET_DIR_BYTES}


_URL_PATH = r"/(?:[A-Za-z0-9\-._~!$&'()*+,;=:@/]|%[0-9A-Fa-f]{2})*"
"""A URL's path as rpc_path and mcp_path take it: RFC 3986's path characters, a %XX escape."""


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
    reuse_port: Annotated[bool,
                          Doc("set SO_REUSEPORT on the TCP listeners (HTTP, metrics, NDJSON stream; "
                              "with TLS too): a second broker of the same user can listen on the same "
                              "ports, serve, and then the first one be stopped, with no refused "
                              "connection (docs/deployment.md, zero-downtime restart); Linux")
                          ] = False
    workers: Annotated[int, Meta(ge=0, le=1024),
                       Doc("worker processes; 0 means one per CPU")
                       ] = 0
    frontends: Annotated[int, Meta(ge=0, le=64),
                         Doc("front-end processes accepting on the same TCP ports (SO_REUSEPORT) and "
                             "sharing every worker; 0 means one per 8 CPUs. Each holds its share of "
                             "max_connections, max_queue, the byte bounds and the rate limits (at least "
                             "one request's: max_body_bytes, max_batch), and of each worker's "
                             "worker_concurrency: so max_connections and worker_concurrency must be at "
                             "least N. The kernel hands a new connection to a front-end by a hash of its "
                             "addresses, so one may refuse it at its share while another has room",
                             rule="0..64; max_connections and worker_concurrency at least the number")
                         ] = 1
    app: Annotated[str, Meta(pattern=rf"^{_IDENT}:[A-Za-z_]\w*\Z"),
                   Doc("'module:attribute' of the broker.worker.Registry to serve",
                       rule="module:attribute, as in mytools:registry (a module's dotted name, not a file path: its directory the current one or on PYTHONPATH; then the Registry's name in it)",
                       metavar="MODULE:ATTR")
                   ] = "broker.demo:registry"
    # (RFC 3986's path characters, matched as typed: hostile testing, round 32, found `/é`
    # and `/a"b` taken, which no client reaches; `\Z`, as `$` let a last newline through;
    # round 34: a `%` not starting a %XX escape, `/%zz`)
    rpc_path: Annotated[str, Meta(pattern=rf"^{_URL_PATH}\Z"),
                        Doc("HTTP path that accepts JSON-RPC POSTs",
                            rule="starts with '/', then only RFC 3986's path characters: ASCII letters "
                                 "and digits, - . _ ~ ! $ & ' ( ) * + , ; = : @ / and % (a %XX escape, "
                                 "matched as typed); no whitespace, '?' or '#' (a query or fragment is "
                                 "not part of the path it is matched against)",
                            metavar="PATH")
                        ] = "/"
    mcp_path: Annotated[str, Meta(pattern=rf"^(?:{_URL_PATH})?\Z"),
                        Doc("HTTP path that serves the workers' tools over MCP (Streamable HTTP, revisions "
                            "2026-07-28 and 2025-11-25); empty: MCP over HTTP off",
                            rule="empty, or a path written as rpc_path is, and another one",
                            metavar="PATH")
                        ] = "/mcp"
    stream_port: Annotated[int, Meta(ge=0, le=65535),
                           Doc("also serve newline-delimited JSON-RPC over TCP on host:this "
                               "port; 0 means off")
                           ] = 0
    stream_socket: Annotated[str, Meta(max_length=SOCKET_PATH_BYTES),
                             Doc("also serve newline-delimited JSON-RPC on a Unix socket at "
                                 "this path (mode 0600); empty means off",
                                 rule=f"at most {SOCKET_PATH_BYTES} bytes (a socket path's limit)", metavar="PATH")
                             ] = ""
    stream_socket_mode: Annotated[str, Meta(pattern=r"^0?[0-7]{3}\Z"),
                                  Doc("file mode of stream_socket: 0600, its user only; 0660 lets its "
                                      "group connect too (stream_socket_group)",
                                      rule="octal permission bits, as 0600 or 0660", metavar="MODE")
                                  ] = "0600"
    stream_socket_group: Annotated[str, Meta(pattern=r"^(?:[A-Za-z0-9_][A-Za-z0-9_.\-]{0,31}\$?)?\Z"),
                                   Doc("group of stream_socket (a name or number), whose members its mode's "
                                       "group bits let connect; empty means the broker's own",
                                       rule="a group name or number the broker's user is a member of",
                                       metavar="GROUP")
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
    tls_cert_file: Annotated[str,
                             Doc("PEM certificate (then its chain) for TLS on every TCP listener (HTTP, "
                                 "metrics_port, stream_port); with tls_key_file; empty means plain TCP",
                                 metavar="PATH")
                             ] = ""
    tls_key_file: Annotated[str,
                            Doc("PEM private key of tls_cert_file, unencrypted, readable by the broker's "
                                "user only", metavar="PATH")
                            ] = ""
    tls_client_ca_file: Annotated[str,
                                  Doc("PEM CA certificates that verify client certificates on every TLS "
                                      "listener (with tls_cert_file and tls_key_file): with bearer tokens a "
                                      "client may show one, and on stream_port one whose subject commonName "
                                      "is a token's name authenticates as that token; without tokens every "
                                      "TLS client must show one, probes included; empty means none asked for",
                                      metavar="PATH")
                                  ] = ""
    auth_tokens_file: Annotated[str,
                                Doc("file of the bearer tokens callers must send on rpc_path "
                                    "(Authorization: Bearer TOKEN): one NAME:TOKEN a line, or a .toml "
                                    "file of [tokens.NAME] tables with token = \"...\"; tokens also come "
                                    "from RPC_BROKER_AUTH_TOKENS; with none, no token is asked for",
                                    metavar="PATH")
                                ] = ""
    auth_metrics: Annotated[bool,
                            Doc("ask for a token on /metrics too (when tokens are given)")
                            ] = False
    allow_methods: Annotated[
        tuple[Annotated[str, Meta(pattern=rf"^{GLOB}\Z")], ...],
        Doc("the methods callers may call, as glob patterns ('notes.*'); empty means all; "
            "a call to another is answered -32601, as one to a method that does not exist",
            rule="glob patterns of method-name characters (letters, digits, _ . - / :) and * ? [...]",
            metavar="PATTERNS"),
    ] = ()
    deny_methods: Annotated[
        tuple[Annotated[str, Meta(pattern=rf"^{GLOB}\Z")], ...],
        Doc("the methods no caller may call, as glob patterns, whatever allow_methods says; "
            "answered -32601", rule="glob patterns, as allow_methods'", metavar="PATTERNS"),
    ] = ()
    rate_limit: Annotated[float, Meta(ge=0, le=1e6),
                          Doc("calls a second each caller may make (a token, or a client address "
                              "without tokens), over bursts of rate_burst: a call past it is answered "
                              "-32005 (429); batch elements count one each; 0 means no limit",
                              metavar="CALLS")
                          ] = 0.0
    rate_burst: Annotated[int, Meta(ge=0, le=1_000_000),
                          Doc("calls a caller may make at once before rate_limit holds them back; 0 "
                              "means a second's worth (rate_limit rounded up)", metavar="CALLS")
                          ] = 0
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
                              Doc("largest HTTP request body (and NDJSON line); at most "
                                  "max_frame_bytes - 1024")
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
                                      "(HTTP 503, NDJSON a -32000 line) and its bytes dropped, unless "
                                      "requests still arriving that came slower than it give it room "
                                      "(each answered 408, or a -32600 line, and closed)",
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
    max_calls_per_worker: Annotated[int, Meta(ge=0, le=1_000_000_000),
                                    Doc("recycle a worker once it was sent this many calls (batch "
                                        "elements count one each; plus its max_calls_jitter): a "
                                        "replacement starts, and takes the slot when ready, the old "
                                        "one finishing its calls (gunicorn's max_requests); 0 means off",
                                        metavar="CALLS")
                                    ] = 0
    max_calls_jitter: Annotated[int, Meta(ge=0, le=1_000_000_000),
                                Doc("each worker's max_calls_per_worker is raised by a random 0..this, "
                                    "drawn at its start, so workers started together do not recycle "
                                    "together (gunicorn's max_requests_jitter)", metavar="CALLS")
                                ] = 0
    max_worker_memory: Annotated[Bytes, Meta(ge=0, le=1 << 50),
                                 Doc("recycle a worker whose resident memory (RSS, read every 2 s) "
                                     "is over this, as max_calls_per_worker does; 0 means off")
                                 ] = 0
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
    status_file: Annotated[str, Meta(max_length=4096),
                           Doc("file where the broker publishes its pid, its state and the outcome of "
                               "each reload (JSON, replaced whole at each change), for `rpc-broker "
                               "reload`; its directory must exist; empty means none", metavar="FILE")
                           ] = ""
    debug: Annotated[bool,
                     Doc("put tracebacks in error 'data' (never on in production)")
                     ] = False
    log_level: Annotated[LogLevel,
                         Doc("logging threshold")
                         ] = "info"
    log_format: Annotated[Literal["text", "json"],
                          Doc("the broker's log lines, access lines and workers' lines on stderr: text, "
                              "or one JSON object a line (a worker's line its message)")
                          ] = "text"
    access_log: Annotated[Literal["errors", "all", "off"],
                          Doc("a line on stderr per call answered: errors (every call not answered "
                              "with a result), all (results too), or off")
                          ] = "errors"
    log_params: Annotated[bool,
                          Doc("put each call's params in its access line, the values of keys named like "
                              "a secret (any spelling of password, token, secret, auth, cookie, session, "
                              "credentials, ...key, pw, pin, otp, seed, dsn, cvv, ssn, iban and more: README, "
                              "Access log) redacted; never on with secrets in values")
                          ] = False
    event_loop: Annotated[Literal["uvloop", "asyncio"],
                          Doc("the broker process's event loop (its front-ends and dispatcher; the workers"
                              " run uvloop): uvloop, or the standard library's asyncio (as uvicorn's --loop;"
                              " the tests run the front-ends on both)")
                          ] = "uvloop"

    @property
    def worker_count(self) -> int:
        """Worker processes to start: ``workers``, or when 0 the CPUs this process may use."""
        return self.workers or _cpu_count()

    @property
    def frontend_count(self) -> int:
        """Front-end processes to run: ``frontends``, or when 0 one per 8 CPUs (at least one)."""
        return self.frontends or max(1, _cpu_count() // 8)


SHARED_LIMITS: Final = ("max_connections", "max_incoming_bytes", "max_outgoing_bytes", "max_queue",
                         "max_queue_bytes", "max_worker_params_bytes")
"""The bounds each front-end process holds its share of (`per_frontend`): the broker's, whole,
hold however many front-ends it runs."""


def per_frontend(config: Config) -> Config:
    """`config` as one of `config.frontend_count` front-end processes runs it: each of
    `SHARED_LIMITS` divided among them (rounded down), so that together they hold what the
    settings say, not N times it (as nginx's worker_connections, but counted for the whole
    broker). Each share is at least what one request may need, so that a request one
    front-end would take, every front-end takes, on an idle broker: max_incoming_bytes and
    max_queue_bytes at least max_body_bytes, max_outgoing_bytes at least
    max_response_bytes, max_queue at least max_batch (each no more than its setting); any
    bound above 0 is 1 at least.
    The whole may then pass a setting by those floors (hostile testing, round 126: an
    800 KB body refused with max_incoming_bytes 1 MB and 2 front-ends). max_connections
    and worker_concurrency of at least N are checked when the settings load
    (`config.load`). The same `config` with one front-end."""
    n = config.frontend_count
    if n <= 1:
        return config
    # (a bound of 1 or more is 1 at least: 0 is "no bound" for max_worker_params_bytes, and a share
    # rounded down to it was none; new user, round 115)
    shares = {name: max(1, value // n) if (value := getattr(config, name)) > 0 else value for name in SHARED_LIMITS}
    floors = {"max_incoming_bytes": config.max_body_bytes, "max_queue_bytes": config.max_body_bytes,
              "max_outgoing_bytes": config.max_response_bytes, "max_queue": config.max_batch}
    for name, floor in floors.items():
        shares[name] = max(shares[name], min(getattr(config, name), floor))
    return msgspec.structs.replace(config, **shares)


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
