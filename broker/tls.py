"""TLS for the TCP listeners (`tls_cert_file`, `tls_key_file`): the server's `ssl.SSLContext`.

For direct exposure, when no reverse proxy terminates TLS in front. With both files given,
every TCP listener (HTTP, the separate metrics one, the NDJSON stream's) speaks TLS only; the
Unix socket does not (it is reached through the file system's permissions). The context is
the standard library's for a server (`ssl.create_default_context(Purpose.CLIENT_AUTH)`:
TLS 1.2 at least, the library's cipher choice), with ALPN offering `http/1.1` alone (a
client asking for h2 gets HTTP/1.1, RFC 7301). A handshake must end within
`HANDSHAKE_SECONDS`; meanwhile the connection counts in max_connections
(broker/frontend/handshake.py).
"""

from __future__ import annotations

import ssl
import typing

from broker.errors import LocalError

__all__ = ["HANDSHAKE_SECONDS", "TlsError", "server_context"]

HANDSHAKE_SECONDS: typing.Final = 10.0


class TlsError(LocalError):
    """The certificate or key cannot be used: the message says which and why."""


def server_context(cert_file: str, key_file: str) -> ssl.SSLContext | None:
    """The listeners' SSLContext for PEM files `cert_file` (the certificate, then its chain)
    and `key_file` (unencrypted: the broker starts unattended), or None when both are ""
    (no TLS). Raises `TlsError` if only one is given, or they cannot be loaded or do not match."""
    if not cert_file and not key_file:
        return None
    if not cert_file or not key_file:
        given, missing = ("tls_cert_file", "tls_key_file") if cert_file else ("tls_key_file", "tls_cert_file")
        raise TlsError(f"{given} is set but {missing} is not: TLS needs both (the certificate and its key)")
    _readable("tls_cert_file", cert_file)
    _readable("tls_key_file", key_file)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.set_alpn_protocols(["http/1.1"])
    try:
        context.load_cert_chain(cert_file, key_file, password=_no_password)
    except ssl.SSLError as exc:
        raise TlsError(f"tls_cert_file {cert_file} and tls_key_file {key_file} cannot be used: {exc.reason or exc}"
                       " (PEM files: the certificate and its chain, and its key, unencrypted, that matches it)") from None
    return context


def _readable(name: str, path: str) -> None:
    """Raise `TlsError` naming setting `name` and its `path` if the file cannot be opened
    for reading (the ssl module's own errors name no file)."""
    try:
        with open(path, "rb"):
            pass
    except OSError as exc:
        raise TlsError(f"{name} {path}: cannot read it: {exc.strerror}") from None
    except ValueError:  # (a NUL byte, from a TOML "\u0000": a traceback at the start)
        raise TlsError(f"{name} {path!r}: cannot read it: a path cannot hold a NUL byte") from None


def _no_password() -> bytes:
    """An encrypted key is refused rather than asked a password for (no terminal at start)."""
    raise TlsError("tls_key_file is encrypted: give it unencrypted (the broker starts unattended), readable "
                   "by its user only")
