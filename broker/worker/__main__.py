"""``python -m broker.worker``: a worker process, as the broker starts it (broker/pool.py)."""

import sys

from broker.worker import main

if __name__ == "__main__":
    sys.exit(main())
