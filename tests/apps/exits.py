"""A test app that exits at import, as $EXITS_AT_IMPORT says: "sys.exit:<message>",
"sys.exit0" (sys.exit(0)) or "os._exit:<status>" (no cleanup, no message)."""

import os
import sys

from broker.worker import Registry

how = os.environ.get("EXITS_AT_IMPORT", "")
if how.startswith("sys.exit:"):
    sys.exit(how.partition(":")[2])
if how == "sys.exit0":
    sys.exit(0)
if how.startswith("os._exit:"):
    os._exit(int(how.partition(":")[2]))

registry = Registry()


@registry.method
def pid() -> int:
    return os.getpid()
