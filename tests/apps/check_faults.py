"""An app whose import misbehaves as CHECK_FAULT says (tests/test_check_app.py): `exit0`
ends the process with status 0, `kill` SIGKILLs it, `hang` sleeps past any boot timeout;
`print` prints at its import (and is a good app)."""

import os
import signal
import time

from broker.worker import Registry

how = os.environ.get("CHECK_FAULT", "")
if how == "print":
    print("import-time print")
elif how == "exit0":
    os._exit(0)
elif how == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
elif how == "hang":
    time.sleep(600)

registry = Registry()


@registry.method
def f() -> int:
    return 1
