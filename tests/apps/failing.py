"""A test app whose `fail` handler answers with the error code it is given."""

from broker.worker import Registry, RpcError

registry = Registry()


@registry.method
def fail(code: int) -> None:
    """Raises RpcError(code): an application error object with any integer code."""
    raise RpcError(code, "failed as asked")
