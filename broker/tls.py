"""TLS for the TCP listeners (`tls_cert_file`, `tls_key_file`): the server's `ssl.SSLContext`, and the
client certificates it asks for (`tls_client_ca_file`).

For direct exposure, when no reverse proxy terminates TLS in front. With both files given,
every TCP listener (HTTP, the separate metrics one, the NDJSON stream's) speaks TLS only; the
Unix socket does not (it is reached through the file system's permissions). The context is
the standard library's for a server (`ssl.create_default_context(Purpose.CLIENT_AUTH)`:
TLS 1.2 at least, the library's cipher choice), with ALPN offering `http/1.1` alone (a
client asking for h2 gets HTTP/1.1, RFC 7301). A handshake must end within
`HANDSHAKE_SECONDS`; meanwhile the connection counts in max_connections
(broker/frontend/handshake.py).

Client certificates (`tls_client_ca_file`, a PEM bundle of CA certificates): when given, the
listeners ask each client for a certificate, verified against those CAs alone (not the
system's). With bearer tokens configured a client may show none (`ssl.CERT_OPTIONAL`: HTTP
clients with their tokens, health probes), but one that does not verify fails the handshake;
on the NDJSON stream_port a verified certificate whose subject commonName is a token's name
authenticates the connection as that token (`certificate_name`; broker/frontend/stream.py).
With no tokens, every TLS client must show one that verifies (`ssl.CERT_REQUIRED`): the
certificate is then the access control on every TLS listener, probes included.
"""

from __future__ import annotations

import ssl
import typing

from broker.errors import LocalError

__all__ = ["HANDSHAKE_SECONDS", "TlsError", "certificate_name", "server_context"]

HANDSHAKE_SECONDS: typing.Final = 10.0


class TlsError(LocalError):
    """The certificate, its key or the client CA file cannot be used: the message says which and why."""


def server_context(cert_file: str, key_file: str, client_ca_file: str = "",
                   require_client_cert: bool = False) -> ssl.SSLContext | None:
    """The listeners' SSLContext for PEM files `cert_file` (the certificate, then its chain)
    and `key_file` (unencrypted: the broker starts unattended), or None when both are ""
    (no TLS). With `client_ca_file` (PEM CA certificates; "" none), clients are asked for a
    certificate verified against it: one they must show if `require_client_cert` (no bearer
    tokens configured), else may. Raises `TlsError` if only one of the first two is given,
    `client_ca_file` without them, or a file cannot be loaded, or the key does not match."""
    if not cert_file and not key_file:
        if client_ca_file:  # (the client's certificate is asked for in a handshake the broker leads)
            raise TlsError("tls_client_ca_file is set but tls_cert_file and tls_key_file are not: client "
                           "certificates are asked for in TLS handshakes, which need the broker's own "
                           "certificate and key (give both, or unset tls_client_ca_file)")
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
    if client_ca_file:
        _verify_clients(context, client_ca_file, require_client_cert)
    return context


def _verify_clients(context: ssl.SSLContext, ca_file: str, required: bool) -> None:
    """Make `context` ask clients for a certificate verified against the CA certificates of PEM
    file `ca_file` alone (`create_default_context` loaded none for a server), `required` or
    optional. Raises `TlsError` naming the file if it cannot be read or holds no certificate."""
    _readable("tls_client_ca_file", ca_file)
    try:
        context.load_verify_locations(cafile=ca_file)
    except ssl.SSLError as exc:  # (a key, an empty file, DER: NO_CERTIFICATE_OR_CRL_FOUND)
        raise TlsError(f"tls_client_ca_file {ca_file} cannot be used: {exc.reason or exc} (a PEM file of the "
                       "CA certificates that issue the clients' certificates)") from None
    context.verify_mode = ssl.CERT_REQUIRED if required else ssl.CERT_OPTIONAL


def certificate_name(peercert: object) -> str:
    """The subject commonName of a client's verified certificate, as `SSLSocket.getpeercert()`
    gives it (its "subject": relative distinguished names, each a tuple of (type, value)
    pairs), or "": no certificate (None), none verified ({}: CERT_NONE), no commonName, or
    more than one (which would name the client ambiguously)."""
    subject = peercert.get("subject", ()) if type(peercert) is dict else ()
    names: list[str] = [value for rdn in subject for kind, value in rdn if kind == "commonName"]
    return names[0] if len(names) == 1 else ""


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
