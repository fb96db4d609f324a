"""A test app that fails to import once the file named by $BREAKABLE_APP_FLAG exists
(a deploy gone bad between start and reload)."""

import os

from broker.worker import Registry

if os.path.exists(os.environ.get("BREAKABLE_APP_FLAG", "/nonexistent")):
    raise ImportError("this deploy is broken")

registry = Registry()


@registry.method
def pid() -> int:
    return os.getpid()
