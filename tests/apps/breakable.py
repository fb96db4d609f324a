"""A test app that fails to import once the file named by $BREAKABLE_APP_FLAG exists
(a deploy gone bad between start and reload), after $BREAKABLE_APP_SLOW seconds if set."""

import os

from broker.worker import Registry

if os.path.exists(os.environ.get("BREAKABLE_APP_FLAG", "/nonexistent")):
    import time

    time.sleep(float(os.environ.get("BREAKABLE_APP_SLOW", "0")))  # (an import that takes its time to fail)
    raise ImportError("this deploy is broken")

registry = Registry()


@registry.method
def pid() -> int:
    return os.getpid()
