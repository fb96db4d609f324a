"""A test app with a method called `other`, the metrics' label of unknown methods: refused."""

from broker.worker import Registry

registry = Registry()


@registry.method
def other() -> str:
    return "a real method"
