"""Command line of rpc-broker.

    rpc-broker serve [--config FILE] [--<setting> VALUE ...]
    rpc-broker stdio [--config FILE] [--<setting> VALUE ...]
    rpc-broker mcp-stdio [--config FILE] [--<setting> VALUE ...]
    rpc-broker check-config [FILE]
    rpc-broker check-app [APP] | rpc-broker reload [--config FILE] [--pid PID]
    rpc-broker bench URL [options] | rpc-broker bench plot FILE... -o PNG
    rpc-broker --version

Every ``serve`` (and ``stdio``, ``mcp-stdio``) flag is generated from the settings table in `broker.config`.
Exit codes: 0 success, 2 bad usage or bad configuration; ``serve``, ``stdio`` and ``mcp-stdio`` otherwise
return what `broker.server.serve` returns; ``bench`` returns what
`broker.loadgen.cli.main` returns (0 all answers right, 1 failures, 2 usage);
``reload`` what `broker.reloadcmd.reload` returns (1 failed, 4 timed out, 5 no broker).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import difflib
import os
import re
import signal
import sys
import typing

import broker
from broker import config

if typing.TYPE_CHECKING:
    from broker.frontend.stdio import Stdio

PROG = "rpc-broker"
# The commands that serve a face on stdin and stdout instead of serve's listeners: the module
# and name of their `broker.frontend.stdio.Stdio` (made with `_stdio_command`)
STDIO_FACES = {"stdio": ("broker.frontend.stdio", "JSONRPC"), "mcp-stdio": ("broker.frontend.stdio", "MCP")}
SERVING = ("serve", *STDIO_FACES)  # the commands that run a broker: `broker.entry`'s early signals are theirs
_PRECEDENCE = (
    "Settings come from, lowest to highest precedence: built-in defaults, the TOML\n"
    "file (keys = setting names), RPC_BROKER_<NAME> environment variables, flags."
)


def build_parser() -> argparse.ArgumentParser:
    """The ``rpc-broker`` parser with its ``serve`` and ``check-config`` subcommands."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="JSON-RPC 2.0 broker: an HTTP/1.1 front end (and, when set, newline-\n"
        "delimited JSON streams over TCP and a Unix socket; or stdin and stdout) that\n"
        "hands calls to a pool of worker processes.",
        epilog=_PRECEDENCE + f"\nRun '{PROG} serve --help' for every setting.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {broker.version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                     title="commands")
    serve = commands.add_parser(
        "serve",
        allow_abbrev=False,  # `--worker 1` is refused as unknown, not guessed (or called ambiguous)
        help="run the broker until SIGTERM/SIGINT (flags override file and environment)",
        description="Run the broker: bind the HTTP front end (and the NDJSON streams, when\n"
        "set), start the workers and serve JSON-RPC until SIGTERM or SIGINT.",
        epilog=_PRECEDENCE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    serve.add_argument("--config", metavar="FILE",
                       help="TOML file of settings; environment and flags override it")
    config.add_flags(serve.add_argument_group("settings"))
    stdio = _stdio_command(
        commands, "stdio",
        "serve JSON-RPC on stdin and stdout, one message a line, for a launcher (logs on stderr); "
        "serve's settings; exits 0 once stdin ends and every answer is written",
        "Serve JSON-RPC 2.0 to the process that started the broker: requests on stdin, one\n"
        "per line (a call, a notification or a batch; \\r\\n accepted), answers on stdout, one\n"
        "per line, as soon as each is ready: in any order, matched by id. Nothing else is\n"
        "written to stdout: the broker's lines, the access lines and what the workers print go\n"
        "to stderr. The lines' limits are the NDJSON streams' (max_body_bytes: past it a\n"
        "line is answered -32600 and skipped).",
    )
    mcp_stdio = _stdio_command(
        commands, "mcp-stdio",
        "serve the workers' tools over MCP on stdin and stdout, for an MCP host that starts it (logs on "
        "stderr); serve's settings; exits 0 once stdin ends and every answer is written",
        "Serve the app's tools over MCP (the Model Context Protocol, its stdio transport) to\n"
        "the host that started the broker: one message a line on stdin and stdout, nothing\n"
        "else on stdout. Both protocol eras: 2026-07-28 (stateless: each request's _meta\n"
        "says its version; server/discover) and 2025-11-25 (initialize, then the session is\n"
        "the process). tools/list lists the methods marked tools (Registry(tools=True), or\n"
        "@registry.method(tool=True)); tools/call runs one in a worker, with serve's deadlines;\n"
        "notifications/cancelled cancels it there. The lines' limits are the NDJSON streams'.",
    )
    check = commands.add_parser(
        "check-config",
        help="validate a TOML config file (plus RPC_BROKER_* environment and serve's flags) and print "
        "the effective settings; exit 0 if valid, 2 if not",
        description="Validate FILE (if given) together with the RPC_BROKER_* environment and the flags,\n"
        "as `serve` would take them (the addresses resolved too); print 'ok' and the\n"
        "effective settings as TOML, or the error.",
        epilog=_PRECEDENCE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    check.add_argument("file", metavar="FILE", nargs="?",
                       help="TOML config file to check (none: the environment and flags alone, as a container "
                       "sets them)")
    config.add_flags(check.add_argument_group("settings (as serve's: checked with FILE and the environment)"))
    check_app = commands.add_parser(
        "check-app",
        help="import the app in a worker process as serve would and list its methods; exit 0 if "
        "it can be served, 3 if not (as nginx -t)",
        description="Import APP (module:attribute; by default the app of the settings: FILE, the\n"
        "environment) in a worker process, as serve's workers do (this interpreter, the current\n"
        "directory, the environment), and list its methods with their signatures; or say why\n"
        "it cannot be served (its import fails, a method's type hint cannot be decoded from\n"
        "JSON) and exit 3. Run it before a reload.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    check_app.add_argument("app", metavar="APP", nargs="?", help="module:attribute of the Registry")
    check_app.add_argument("--config", metavar="FILE", help="TOML file whose app to check (without APP)")
    check_app.add_argument("--debug", action="store_true", help="print the traceback of a failure")
    reload = commands.add_parser(
        "reload",
        help="reload a running broker (SIGHUP) and wait for the outcome: exit 0 when the new workers "
        "took over, 1 when they failed to start, 2 on bad usage, 4 on timeout, 5 when no broker runs "
        "(systemd's ExecReload)",
        description="Send the broker SIGHUP and wait until the reload it asked for ends, through the\n"
        "broker's status file (the status_file setting, from --config and the environment as serve\n"
        "reads them, or --status-file).",
        # (every code `_reload` and `reloadcmd.reload` return: new user, round 108, found 2 missing)
        epilog="Exit codes:\n"
        "  0  the new workers took over\n"
        "  1  the reload failed: the new workers did not start (the reason on stderr); the old\n"
        "     ones serve on\n"
        "  2  bad usage: no status file set, a bad status_file or boot_timeout (in --config or\n"
        "     the environment), a bad --timeout, or a bad flag\n"
        "  4  no outcome within --timeout: the reload may still be running (or not have begun)\n"
        "  5  no broker to reload: stopped (its status file says so), not running (a stale\n"
        "     status file), another process, not allowed to signal it, or stopping",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    reload.add_argument("--config", metavar="FILE", help="TOML file of the broker's settings (its status_file)")
    reload.add_argument("--status-file", metavar="FILE", help="the broker's status file (overrides the settings')")
    reload.add_argument("--pid", type=int, metavar="PID",
                        help="the broker's pid (systemd: $MAINPID); the status file must be its own")
    reload.add_argument("--timeout", type=float, metavar="SECONDS",
                        help="how long to wait for the outcome (default: boot_timeout + 15 s)")
    # (a command's own parser reports what it does not know: `unknown_arguments`)
    parser.set_defaults(command_parsers={"serve": serve, "stdio": stdio, "mcp-stdio": mcp_stdio, "check-config": check,
                                         "check-app": check_app, "reload": reload})
    commands.add_parser(
        "bench", add_help=False, prefix_chars="\0",
        help="JSON-RPC load generator that checks every answer; "
        f"'{PROG} bench --help' for its flags",
    )
    return parser


_STDIO_SETTINGS = (
    "Takes serve's settings (file, environment, flags), but opens none of its JSON-RPC\n"
    "listeners (host and port, stream_port, stream_socket: unused, whatever they say),\n"
    "so that two launchers can start it at once. The one port it may open is\n"
    "metrics_port's (/metrics, /healthz, /readyz), when set; metrics are off without it.\n"
    "The one client may use every worker (connection_share is 1).\n\n"
    "When stdin ends, every call owed is answered, then the broker exits 0; SIGTERM or\n"
    "SIGINT drain as serve's do; SIGHUP reloads the workers; a stdout whose reader is\n"
    "gone (EPIPE) stops the broker, its calls in flight cancelled, exit 0."
)


def _stdio_command(commands: argparse._SubParsersAction[argparse.ArgumentParser], name: str, summary: str,
                   protocol: str) -> argparse.ArgumentParser:
    """Add the parser of a command of `STDIO_FACES`, `name`: `summary` for the list of
    commands, `protocol` (what it serves, how) first in its --help, then what every stdio
    command does with serve's settings and how it ends; serve's flags and --config."""
    parser = commands.add_parser(
        name, allow_abbrev=False, help=summary, description=protocol + "\n\n" + _STDIO_SETTINGS,
        epilog=_PRECEDENCE + f"\nExample: {PROG} {name} --workers 2 --app mytools:registry",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", metavar="FILE",
                        help="TOML file of settings (serve's); environment and flags override it")
    config.add_flags(parser.add_argument_group("settings (serve's: those of its listeners unused)"))
    return parser


def unknown_arguments(command: argparse.ArgumentParser, unknown: list[str]) -> None:
    """Exit 2 through `command`'s own parser (its usage, not the top-level one) naming
    the `unknown` arguments, with the closest flag it knows (a new user's check, round 26:
    `serve --wokers 4` printed the top-level usage and no hint). Raises SystemExit."""
    flag = unknown[0].partition("=")[0]
    known = [s for action in command._actions for s in action.option_strings if s.startswith("--")]
    # (compared without their "--", which made `--bogus` look like `--host`: round 53, LOW)
    close = difflib.get_close_matches(flag[2:], [s[2:] for s in known], n=1) if flag.startswith("--") else []
    hint = f" (did you mean --{close[0]}?)" if close else ""
    command.error(f"unrecognized arguments: {' '.join(unknown)}{hint}")


def _load(path: str | None, flags: dict[str, object]) -> config.Config | None:
    try:
        return config.load(path, os.environ, flags)
    except config.ConfigError as exc:
        print(f"{PROG}: config error: {exc}", file=sys.stderr)
        return None


def _status_dir_missing(cfg: config.Config) -> bool:
    """Whether `status_file`'s directory does not exist: said on stderr as a config error
    (check-config and serve alike: new user, round 107, check-config passed and serve warned;
    round 109, check-config refused and serve served on, `rpc-broker reload` failing later)."""
    folder = os.path.dirname(os.path.abspath(cfg.status_file)) if cfg.status_file else ""
    if folder and not os.path.isdir(folder):
        print(f"{PROG}: config error: status_file = {cfg.status_file!r}: its directory {folder} does not exist"
              " (make it; under systemd, RuntimeDirectory= makes it before ExecStartPre)", file=sys.stderr)
        return True
    return False


def _check_app(app: str | None, path: str | None, debug: bool) -> int:
    """`check-app`: run broker/worker/check.py on `app` (or the settings' app, from `path` and
    the environment) in a process of its own, as serve starts a worker; its exit status."""
    try:
        cfg = config.load(path, os.environ, {} if app is None else {"app": app})
    except config.ConfigError as exc:  # (the pattern's own message: an example, not a regex)
        print(f"{PROG}: config error: {exc}", file=sys.stderr)
        return 2
    import subprocess

    from broker.worker import WORKER_BOOT_ERROR

    argv = [sys.executable, "-m", "broker.worker.check", cfg.app, *(["--debug"] if debug else [])]
    child = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, start_new_session=True)
    try:  # (as serve gives a worker boot_timeout to say HELLO: round 114, M3, an import that hangs hung this)
        out, _ = child.communicate(timeout=cfg.boot_timeout)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()
        print(f"{PROG}: app {cfg.app!r}: its import did not end within boot_timeout {cfg.boot_timeout:g} s "
              "(serve's workers would be killed so)", file=sys.stderr)
        return WORKER_BOOT_ERROR
    sys.stdout.write(out.decode(errors="replace"))
    status = child.returncode
    # (round 114, M3: os._exit(0) at import passed; the report's line is looked for at any line's
    # start: an app that prints at its import was refused, its print first; new user, round 109)
    if status == 0 and not re.search(rb"(?m)^ok: app " + re.escape(repr(cfg.app).encode()) + rb", ", out):
        print(f"{PROG}: app {cfg.app!r}: its import ended the process (exit 0) before it was loaded", file=sys.stderr)
        return WORKER_BOOT_ERROR
    if status < 0:  # (killed by a signal: said, not exit 247)
        print(f"{PROG}: app {cfg.app!r}: its import killed the process ({signal.Signals(-status).name})",
              file=sys.stderr)
        return WORKER_BOOT_ERROR
    return status


def _reload(ns: argparse.Namespace) -> int:
    """`reload`: its status file and timeout from the flags or the settings (`--config`,
    the environment: those two settings alone, `config.load_only`); `broker.reloadcmd.reload`'s
    exit code, or 2 without a status file or with a bad value of those two."""
    from broker import reloadcmd

    try:
        given = config.load_only(ns.config, os.environ, ("status_file", "boot_timeout"))
    except config.ConfigError as exc:
        if not ns.status_file:  # (a file that is not TOML at all: new user, round 110)
            print(f"{PROG}: config error: {exc} (give --status-file to reload all the same)", file=sys.stderr)
            return 2
        print(f"{PROG}: reload: {exc}: not read (--status-file given; boot_timeout's default for the wait)",
              file=sys.stderr)
        given = {}
    path = ns.status_file or typing.cast(str, given.get("status_file", ""))
    if not path:
        print(f"{PROG}: reload: no status file: set status_file (RPC_BROKER_STATUS_FILE) for the broker and"
              " this command alike, or give --status-file", file=sys.stderr)
        return 2
    if ns.pid is not None and ns.pid <= 0:
        print(f"{PROG}: reload: --pid {ns.pid}: not a process id (is $MAINPID empty? the unit is not running)",
              file=sys.stderr)
        return reloadcmd.EXIT_NO_BROKER
    boot_timeout = typing.cast(float, given.get("boot_timeout", config.Config().boot_timeout))
    timeout = ns.timeout if ns.timeout is not None else boot_timeout + 15.0
    if not 0 < timeout < float("inf"):  # (round 116, L3: nan or inf waited for good)
        print(f"{PROG}: reload: --timeout {ns.timeout}: give seconds, a number > 0", file=sys.stderr)
        return 2
    return reloadcmd.reload(path, ns.pid, timeout)


class _Stopped(Exception):
    """A stop signal (its number) came while the config was being read."""


@contextlib.contextmanager
def _stoppable(early: typing.Sequence[int] = ()) -> typing.Iterator[None]:
    """While the config is read, SIGTERM and SIGINT stop at once (`_Stopped`): the read can
    block (a named pipe as --config, /dev/stdin), and a stop held for a loop that never
    came was ignored until SIGKILL (hostile testing, round 33). So does one of them among
    `early` (`broker.entry` caught it while the command line was imported: it was held, and
    the read blocked on; found by the suite run in parallel). Their handlers are put back
    after; SIGHUP stays as it was (held by `broker.entry`, a reload once serving)."""

    def stop(signum: int, frame: object) -> None:
        raise _Stopped(signum)

    before = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        for signum in early:  # (after the handlers: one that comes now is not missed either)
            if signum in before:
                raise _Stopped(signum)
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def _stdio_face(command: str) -> Stdio | None:
    """The face `command` serves on stdin and stdout (`STDIO_FACES`; None: serve's
    listeners), with the process's stdin and stdout taken for it now (`take_stdio`), before
    any descriptor the broker keeps is opened, and before a config error or a worker could
    print."""
    if command not in STDIO_FACES:
        return None
    import importlib

    from broker.frontend.stdio import Stdio, take_stdio

    module, name = STDIO_FACES[command]
    face = getattr(importlib.import_module(module), name)
    if not isinstance(face, Stdio):
        raise TypeError(f"{module}.{name} is not a Stdio")
    return dataclasses.replace(face, ends=take_stdio())


def main(argv: list[str] | None = None, early: list[int] | None = None) -> int:
    """Run the CLI on ``argv`` (default ``sys.argv[1:]``) and return the exit code.

    ``--help`` returns 0 and usage errors 2 (argparse's codes) instead of raising
    ``SystemExit``; a `config.ConfigError` is printed to stderr and returns 2.
    `early`: the signals `broker.entry` caught before this ran (the `rpc-broker`
    command); `serve` and `stdio` act on them, the other commands get their default
    handling back.
    """
    if early is not None:
        from broker import entry

        serving = (sys.argv[1:] if argv is None else argv)[:1] in ([c] for c in SERVING)
        if not serving:
            entry.restore()
            early = None
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["bench"]:
        from broker.loadgen.cli import main as bench_main

        return bench_main(args[1:])
    parser = build_parser()
    if not args:  # (a bare `rpc-broker`: the commands, as `git` lists them, not argparse's one line)
        parser.print_help(sys.stderr)
        return 2
    try:
        ns, unknown = parser.parse_known_args(argv)
        if unknown:
            unknown_arguments(ns.command_parsers[ns.command], unknown)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 2
    flags = {s.name: getattr(ns, s.name) for s in config.SETTINGS if hasattr(ns, s.name)}
    if ns.command == "check-app":
        return _check_app(ns.app, ns.config, ns.debug)
    if ns.command == "reload":
        return _reload(ns)
    if ns.command == "check-config":
        cfg = _load(ns.file, flags)
        if cfg is None:
            return 2
        unresolved = config.unresolved_addresses(cfg)
        if unresolved:  # (issue 12, item 13: a host serve cannot bind passed)
            print(f"{PROG}: config error: {unresolved}", file=sys.stderr)
            return 2
        if _status_dir_missing(cfg):
            return 2
        try:
            print("ok")
            print(config.dump_toml(cfg), end="", flush=True)
        except BrokenPipeError:  # (`| head -1`: the reader has what it wanted; round 34, a traceback
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # and exit 1; Python's docs,
        return 0  # "Note on SIGPIPE": no second error as stdout is flushed at exit)
    # serve, stdio
    stdio = _stdio_face(ns.command)
    try:
        with _stoppable(() if early is None else early):
            cfg = _load(ns.config, flags)
    except _Stopped as stopped:
        print(f"{PROG}: {signal.Signals(stopped.args[0]).name} while reading the config: stopped", file=sys.stderr)
        return 0
    if cfg is None or _status_dir_missing(cfg):
        return 2
    from broker.server import serve  # written separately; imported only when serving

    return serve(cfg, () if early is None else early, stdio)  # (the live list: `broker.entry` appends to it
    # until the loop's handlers take over; `early or ()` dropped a signal that came meanwhile, round 31)


if __name__ == "__main__":
    sys.exit(main())
