"""The loader: `load` fills a `Config` from defaults, a TOML file, the environment and flags.

Theory of operation
-------------------
`load` layers the sources, lowest precedence first: defaults < TOML file <
environment < flags. Each source yields (`Setting`, value, where it came from)
triples: the file's values as TOML typed them, the environment's and the flags'
text parsed into the setting's shape (`_parse_text`, `_parse_pairs`). Each value
is checked against its field as soon as it is read (`_check`), so a `ConfigError`
names the setting, the source it came from (file path, variable or flag) and what
is wrong; the merged result is then built with one ``msgspec.convert``.
``method_timeouts`` is merged per method name across layers; every other setting
is replaced whole by a higher layer. Last, `_clash` refuses settings that are each
valid but not together, naming where each came from.
"""

import difflib
import grp
import ipaddress
import json
import os
import re
import socket
import tomllib
import typing
from collections.abc import Collection, Mapping, Sequence
from typing import Final

import msgspec

from broker.auth import ENV_TOKENS, AuthError, load_tokens
from broker.config.settings import (
    _BY_NAME,
    _PATH_BYTES,
    ENV_PREFIX,
    KIB,
    MS,
    SETTINGS,
    SOCKET_DIR_BYTES,
    SOCKET_PATH_BYTES,
    Config,
    ConfigError,
    Setting,
)
from broker.files import FileRefused, read_bounded
from broker.tls import TlsError, server_context

MAX_CONFIG_BYTES: Final = 1 << 20  # bytes of a settings file, at most (a few kB in practice)

_BOOLS: Final = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}
_AT_PATH: Final = re.compile(r" - at `[^`]*`( in `[^`]*`)?$")
_REGEX: Final = re.compile(r"^expected `str` matching regex (['\"]).*\1$")  # msgspec's wording
# (a regex holding a ' is quoted with ": rpc_path's, round 32, was shown as it is)


def _unknown(source: str, what: str) -> ConfigError:
    names = [s.name for s in SETTINGS]
    if what.startswith(ENV_PREFIX):  # (the tokens' variable too: new user, round 107, RPC_BROKER_AUTH_TOKEN
        names.append(ENV_TOKENS[len(ENV_PREFIX):].lower())  # was told "did you mean ..._AUTH_TOKENS_FILE?")
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
    if s.name in ("rpc_path", "mcp_path") and isinstance(value, str) and {".", ".."} & set(value.split("/")[1:]):
        raise ConfigError(f"{source}: {s.name} = {value!r}: a '.' or '..' segment, which clients remove "
                          "before they send the path (RFC 3986 section 5.2.4): it could not be reached")
    if s.name in ("host", "metrics_host") and isinstance(value, str) and value != "".join(value.split()):
        raise ConfigError(f"{source}: {s.name} = {value!r}: white space in an address, which nothing can be "
                          "bound to")  # (rounds 34, 35: check-config said ok, serve then failed)
    if s.name == "host" and isinstance(value, str) and value.startswith("[") and value.endswith("]"):
        raise ConfigError(f"{source}: host = {value!r}: give the address without brackets "
                          f"({value[1:-1]!r}): brackets belong in URLs, not in the address to bind")
    if s.name == "allowed_hosts" and isinstance(value, (list, tuple)):
        for i, entry in enumerate(value):
            problem = _host_problem(str(entry))
            if problem:
                raise ConfigError(f"{source}: allowed_hosts[{i}] = {entry!r}: {problem}")
    # (a map's values and a list's entries each checked alone first, so that the error names
    # the one at fault, not the whole value: new user, round 101)
    entries: list[tuple[object, object, object]] = [(None, value, value)]
    if s.kind == "map" and isinstance(value, dict):
        entries = [(key, item, {key: item}) for key, item in value.items()]
    elif s.kind == "list" and isinstance(value, list):
        entries = [(i, item, [item]) for i, item in enumerate(value)] + entries
    for key, item, wrapped in entries:
        label = s.name if key is None else f"{s.name}[{key!r}]"
        if s.unit == "seconds" and isinstance(item, (int, float)) and 0 < item < MS:
            least = "0 or at least" if s.name == "grace_period" else "at least"
            raise ConfigError(
                f"{source}: {label} = {item!r}: must be {least} {MS} (1 ms): the event loop's "
                "clock has 1 ms steps, so a shorter duration would not be kept as written"
            )
        try:
            msgspec.convert({s.name: wrapped}, Config)
        except msgspec.ValidationError as exc:
            problem = _AT_PATH.sub("", str(exc))
            problem = problem[0].lower() + problem[1:]
            if key is not None and key == "":  # (the name, not the value: round 27 gave the values' range)
                problem = "a method name is not empty"
            elif s.rule and _REGEX.search(problem):  # the rule in words, not the regex behind it
                problem = f"expected {s.rule}"
            elif s.rule:
                problem += f" (allowed: {s.rule})"
            if s.kind == "list" and key is None and isinstance(item, str):  # (new user, round 103: its form)
                problem += f"; a list in TOML: {s.name} = [{json.dumps(item)}]"
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


# A number setting's kind: how its text is read, and what the error says it expected
_NUMBERS: dict[str, tuple[typing.Callable[[str], object], str]] = {"int": (int, "an integer"), "float": (float, "a number")}


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
    number = _NUMBERS.get(s.kind)
    if number is not None:
        convert, expected = number
        try:
            if plain:
                return convert(text)
        except ValueError:
            pass
        raise bad(f"{expected}{unit}")
    if s.kind == "list":  # (empty items, a trailing comma, are no entries: `' a, b ,'` is two)
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


def _from_file(path: str, only: Collection[str] | None = None) -> list[tuple[Setting, object, str]]:
    """The file's settings, each with its source; `only`: these names alone, the other
    keys not looked at (unknown ones included)."""
    source = f"config file {path}"
    try:
        data = tomllib.loads(read_bounded(path, MAX_CONFIG_BYTES, pipes=True).decode("utf-8"))
    except FileRefused as exc:  # (hostile testing, round 131: /dev/zero read 9.9 GB in 8 s; a FIFO's
        # writer, `<(...)`, may write 1 MiB at most, and a stop signal ends the wait for it: round 33)
        raise ConfigError(f"{source}: {exc}: not a settings file") from None
    except OSError as exc:
        raise ConfigError(f"{source}: cannot read: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{source}: invalid TOML: {exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{source}: invalid TOML: not UTF-8 ({exc.reason})") from None
    out = []
    for key, value in data.items():
        if only is not None and key not in only:
            continue
        s = _BY_NAME.get(key)
        if s is None:
            raise _unknown(source, key)
        out.append((s, value, source))
    return out


def _from_env(env: Mapping[str, str], only: Collection[str] | None = None) -> list[tuple[Setting, object, str]]:
    """The `RPC_BROKER_*` variables' settings, each with its source; `only`: these names alone."""
    out = []
    for var, text in env.items():
        if not var.startswith(ENV_PREFIX) or var == ENV_TOKENS:  # (the tokens: broker.auth's)
            continue
        if only is not None and var[len(ENV_PREFIX):].lower() not in only:
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
        if len(names) == 1:  # said as a value's own error is (new user, round 100: two wordings)
            raise ConfigError(f"{sources.get(names[0], 'the default')}: {problem}")
        where = "; ".join(f"{name} from {sources.get(name, 'the default')}" for name in names)
        raise ConfigError(f"{problem} ({where})")
    try:
        server_context(cfg.tls_cert_file, cfg.tls_key_file, cfg.tls_client_ca_file)
    except TlsError as exc:
        given = [n for n in ("tls_cert_file", "tls_key_file", "tls_client_ca_file") if n in sources]
        raise ConfigError(f"{'; '.join(f'{n} from {sources[n]}' for n in given) or 'tls'}: {exc}") from None
    try:
        load_tokens(cfg.auth_tokens_file, env, sources.get("auth_tokens_file", ""))
    except AuthError as exc:
        raise ConfigError(str(exc)) from None
    return cfg


def load_only(path: str | None, env: Mapping[str, str], names: Collection[str]) -> dict[str, object]:
    """Settings `names` alone, from the TOML file at `path` and `env` (as `load` layers
    them), each checked; a name given nowhere is absent from the result (its default
    holds). The rest of the file and environment is not read: `rpc-broker reload` needs
    only the status file and boot timeout, and a mistake elsewhere in a file edited for the
    next restart must not block a reload of new code, which reads no setting (new user,
    round 107: exit 2 on `workers = -1`). Raises `ConfigError` for an unreadable file or a
    bad value of one of `names`."""
    merged: dict[str, object] = {}
    for s, value, source in [*(_from_file(path, names) if path is not None else []), *_from_env(env, names)]:
        _check(s, value, source)
        merged[s.name] = value
    return merged


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


def unresolved_addresses(cfg: Config) -> str:
    """Why `host` or `metrics_host` (with metrics_port) cannot be bound, as `serve` would
    find at the start ("" if both resolve): a name with no address (`socket.getaddrinfo`,
    the resolver serve's bind uses)."""
    names = [("host", cfg.host)] + ([("metrics_host", cfg.metrics_host)] if cfg.metrics_port else [])
    for setting, name in names:
        try:
            infos = socket.getaddrinfo(name.strip("[]"), None, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        except (OSError, UnicodeError) as exc:
            return f"{setting} = {name!r}: no address to bind ({exc}): give an IP address or a name this machine resolves"
        family, _, _, _, address = infos[0]
        try:  # (an address of another machine resolves, and serve fails to bind it: round 114)
            with socket.socket(family, socket.SOCK_STREAM) as probe:
                probe.bind((address[0], 0))
        except OSError as exc:
            return (f"{setting} = {name!r}: cannot bind {address[0]} ({exc.strerror}): give an IP address or a name "
                    "this machine resolves, of one of its own interfaces")
    return ""


def socket_group(name: str) -> int:
    """The group id of `name` (a group name, or a number); -1 for "" (the broker's own).
    Raises KeyError for an unknown one."""
    if not name:
        return -1
    return int(name) if name.isdigit() else grp.getgrnam(name).gr_gid


def _socket_group_problem(name: str, euid: int | None = None, groups: Sequence[int] | None = None) -> str:
    """Why the broker cannot give its stream socket to group `name`, or "": it does not
    exist, or the broker's user (`euid`, in `groups`; this process's by default) is not root
    and not a member (chown(2) would fail with EPERM at the start, the app imported)."""
    if not name:
        return ""
    try:
        gid = socket_group(name)
        grp.getgrgid(gid)
    except KeyError:
        return f"stream_socket_group = {name!r}: no such group on this machine"
    euid = os.geteuid() if euid is None else euid
    groups = [os.getegid(), *os.getgroups()] if groups is None else groups
    if euid != 0 and gid not in groups:
        return (f"stream_socket_group = {name!r}: the broker's user is not a member, so it cannot give the socket "
                "to it (add the user to it; under systemd, SupplementaryGroups=)")
    return ""


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
    n = cfg.frontend_count  # (each front-end holds its share: `per_frontend`; hostile testing, round 126)
    if n > 1 and cfg.max_connections < n:
        return (f"max_connections = {cfg.max_connections} must be at least the front-ends' number, {n}: each"
                " front-end holds its share of it"), ("max_connections", "frontends")
    if n > 1 and cfg.worker_concurrency < n:
        return (f"worker_concurrency = {cfg.worker_concurrency} must be at least the front-ends' number, {n}:"
                " each front-end routes over its share of a worker's places"), ("worker_concurrency", "frontends")
    if int(cfg.stream_socket_mode, 8) & 0o600 != 0o600:  # (round 114: 0000 and 0400 were taken)
        return (f"stream_socket_mode = {cfg.stream_socket_mode!r}: the owner's read and write bits (0600) are "
                "needed: the broker's user connects to it too (its stop, a probe)"), ("stream_socket_mode",)
    group = _socket_group_problem(cfg.stream_socket_group)
    if group:
        return group, ("stream_socket_group",)
    for i, origin in enumerate(cfg.allowed_origins):  # (each named by its place: hostile testing, round 110)
        if origin == "*":
            continue
        if origin == "null":
            return (
                f"allowed_origins[{i}] = 'null' would let every web page call: a sandboxed iframe or a data: page of"
                " any site sends Origin: null; list the origins of your pages, or '*' if any page may call"
            ), ("allowed_origins",)
        if "*" in origin:  # (`https://*.app.example`: no browser sends it, so it would never match)
            return (
                f"allowed_origins[{i}] = {origin!r}: '*' is a wildcard only as a whole entry (any origin); "
                "list each origin of your pages"
            ), ("allowed_origins",)
        serialized = _serialized_origin(origin)
        if serialized != origin.lower():
            return (
                f"allowed_origins[{i}] = {origin!r} is not an origin as a browser sends it in its Origin header"
                f" (RFC 6454 6.2: no user info, no default port, the port without leading zeros, the host"
                f" in ASCII), so it would never match: "
                + (f"write {serialized!r}" if serialized else "its port is not 1..65535")
            ), ("allowed_origins",)
    if cfg.rpc_path in ("/healthz", "/readyz", "/metrics"):
        return f"rpc_path = {cfg.rpc_path!r} would hide the broker's own {cfg.rpc_path}: choose another path", ("rpc_path",)
    if cfg.mcp_path in ("/healthz", "/readyz", "/metrics"):
        return f"mcp_path = {cfg.mcp_path!r} would hide the broker's own {cfg.mcp_path}: choose another path", ("mcp_path",)
    if cfg.mcp_path == cfg.rpc_path:
        return (f"mcp_path and rpc_path are both {cfg.rpc_path!r}: MCP and plain JSON-RPC need paths of their own "
                "(mcp_path = \"\" turns MCP over HTTP off)"), ("mcp_path", "rpc_path")
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
