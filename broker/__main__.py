"""``python -m broker``: the rpc-broker command line."""

import sys

from broker.entry import main

if __name__ == "__main__":
    sys.exit(main())
