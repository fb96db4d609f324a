"""A test app with a method called `other`, the metrics' name for unknown methods."""

from broker.worker import Registry

registry = Registry()


@registry.method
def other() -> str:
    return "a real method"
