"""``python -m broker``: the rpc-broker command line."""

import sys

from broker.cli import main

if __name__ == "__main__":
    sys.exit(main())
