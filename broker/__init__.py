"""rpc-broker: a multi-process JSON-RPC 2.0 broker (see README.md and docs/architecture.md)."""

from __future__ import annotations

__all__ = ["version"]


def version() -> str:
    """The installed distribution's version (PEP 566 metadata, as `rpc-broker --version`,
    `/healthz` and `rpc_broker_build_info` show it), or "unknown" when run from a source
    tree that was never installed. (importlib.metadata imported here: not by every worker.)"""
    from importlib import metadata

    try:
        return metadata.version("rpc-broker")
    except metadata.PackageNotFoundError:
        return "unknown"
