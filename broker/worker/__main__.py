"""``python -m broker.worker``: a worker process, as the broker starts it (broker/pool.py).

The code is broker/worker/process.py's: this file runs as `__main__`, and defines nothing
that the package's modules (imported as `broker.worker....`, once) would hold a second copy of.
"""

import sys

from broker.worker.process import main

if __name__ == "__main__":
    sys.exit(main())
