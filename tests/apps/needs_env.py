"""An app whose import fails on a missing environment variable (tests/test_lifecycle.py)."""

import os

# The line a boot failure's log names:
TOKEN = os.environ["MY_TOOL_TOKEN"]
