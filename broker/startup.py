"""The start's checks of its environment and settings, and the warnings it logs (`server.run`).

Kept apart from broker/server.py, which wires the broker together: each function here
reads a setting or the system and says what a start should know (an open-files limit too
small for max_connections, a listener reachable with no tokens, a secret file others may
read, a method deadline for a method nobody serves).
"""

from __future__ import annotations

import difflib
import ipaddress
import logging
import os
import stat
import typing

from broker.config import ConfigError

__all__ = ["exposure_warnings", "fit_open_files", "secret_file_warnings", "warn_unserved_timeouts"]

log = logging.getLogger("broker")


def fit_open_files(max_connections: int, listeners: int, extra: int) -> int:
    """Raise the soft RLIMIT_NOFILE towards the hard limit so that `listeners` listeners
    of `max_connections` client sockets each fit, plus `extra` descriptors (the probes'
    reserve, the metrics listener, refused connections still being answered, worker
    sockets, logs), as nginx's worker_rlimit_nofile does; return the connection limit
    per listener that really fits (at least 1). Every listener has its own
    max_connections, so sizing for one let idle NDJSON connections use up the
    descriptors HTTP needed: its probes were reset unanswered (hostile testing).
    Raises `ConfigError` when not even one connection per listener fits."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = max_connections * listeners + extra
    if soft != resource.RLIM_INFINITY and soft < want:
        new = want if hard == resource.RLIM_INFINITY else min(want, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
            soft = new
        except (ValueError, OSError):
            pass
    fits = max_connections if soft == resource.RLIM_INFINITY else min(max_connections, (soft - extra) // listeners)
    if fits < 1:  # (hostile testing: at 100, a worker's restart failed with EMFILE and its slot was lost)
        raise ConfigError(
            f"the open-files limit ({soft}, hard {hard}) is too small: the broker needs {extra + listeners} "
            f"descriptors at least, {want} for max_connections {max_connections} on {listeners} listener(s) "
            "(raise it: ulimit -n, systemd's LimitNOFILE)"
        )
    if fits < max_connections:
        log.warning("open-files limit %d allows %d connections per listener (%d listeners), not max_connections %d"
                    " (raise the hard limit, systemd's LimitNOFILE or ulimit -Hn, or set max_connections to %d"
                    " or less: this warning then goes)", soft, max(1, fits), listeners, max_connections, max(1, fits))
    return max(1, fits)


def exposure_warnings(host: str, tokens: bool, tls: bool, auth_metrics: bool, client_certs: bool = False) -> list[str]:
    """The warnings of a start whose access control does less than it seems: a broker
    listening past loopback (`host` not a loopback address or `localhost`) with no bearer
    `tokens` asked for (hostile testing, round 114: an empty token file served 0.0.0.0 with
    no word of it) nor `client_certs` (tls_client_ca_file: without tokens, every TLS client
    must show a certificate), or with tokens but no `tls` (they travel in clear text);
    `auth_metrics` with no tokens (it asks for none: new user, round 106)."""
    warnings = []
    if auth_metrics and not tokens:
        warnings.append("auth_metrics is set but no bearer tokens are given: /metrics asks for none")
    loopback = host == "localhost"
    try:
        loopback = loopback or ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # (a name: not known to be loopback)
        pass
    if loopback:
        return warnings
    if not tokens and not (tls and client_certs):
        warnings.append(f"host {host} is reachable past this machine and no bearer tokens are asked for: whoever"
                        " reaches it can call every tool (auth_tokens_file or RPC_BROKER_AUTH_TOKENS; README,"
                        " Authentication)")
    elif not tls:
        warnings.append(f"host {host} is reachable past this machine and its bearer tokens travel in clear text:"
                        " give tls_cert_file and tls_key_file, or terminate TLS at a proxy in front")
    return warnings


def secret_file_warnings(files: typing.Mapping[str, str]) -> list[str]:
    """The warnings for secret files (`files`: setting name -> path; "" none) that users
    other than their owner may read (group or others: mode & 0o077), as ssh's for a private
    key, but not refused (a Kubernetes Secret's files are 0644 by default, and a group of the
    broker's may be meant). New user, round 106: a 0644 key and token file were taken
    silently, though the README asks for 0600."""
    warnings = []
    for name, path in files.items():
        try:
            mode = os.stat(path).st_mode if path else 0
        except OSError:
            continue  # (read at the start already: the error was said then)
        if mode & 0o077:
            warnings.append(f"{name} {path} is readable by users other than its owner (mode {stat.S_IMODE(mode):04o}):"
                            f" make it 0600 (chmod 600 {path}), owned by the broker's user")
    return warnings


def warn_unserved_timeouts(method_timeouts: typing.Mapping[str, float], methods: typing.Sequence[str]) -> list[str]:
    """Log a WARNING for each `method_timeouts` name the workers do not serve (a typo or
    a wrong case: names are case-sensitive, JSON-RPC 2.0 section 4), with the closest
    served names (`difflib`); return those names. Called once the method table is known
    (after the workers' HELLO, and after each reload)."""
    served = set(methods)
    unserved = [name for name in method_timeouts if name not in served]
    for name in unserved:
        close = difflib.get_close_matches(name, methods, n=3) or [m for m in methods if m.lower() == name.lower()]
        hint = f" (did you mean {', '.join(map(repr, close))}?)" if close else ""
        log.warning("method_timeouts names %r, which the workers do not serve: its deadline is unused%s",
                    name, hint)
    return unserved
