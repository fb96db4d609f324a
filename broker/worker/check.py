"""`rpc-broker check-app`'s worker side: the app imported as a worker imports it, its methods listed.

Run as `python -m broker.worker.check APP [--debug]` by `rpc-broker check-app` (broker/cli.py),
with the interpreter, current directory and environment `serve` gives its workers, so that
what it finds is what the workers would: the import (`process.load_registry`, the workers'
own), each method's registration (a type hint msgspec cannot decode refused, naming the
parameter), the number of methods. Prints each method, one a line, as

    NAME(SIGNATURE) -> RETURN   sync|async[, raw params][, tool]

then a line naming the MCP tools (`Registry.method(tool=True)`, "tools: none" if none), and
exits 0; or logs why the app cannot be served and exits `WORKER_BOOT_ERROR` (3), as a
worker would at the start (nginx -t, for an app).
"""

from __future__ import annotations

import argparse
import inspect
import logging
import sys

from broker.worker import WORKER_BOOT_ERROR
from broker.worker.process import load_registry

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """List the methods of an app, or say why it cannot be served (exit 3)."""
    parser = argparse.ArgumentParser(prog="python -m broker.worker.check")
    parser.add_argument("app")
    parser.add_argument("--debug", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level="INFO", format="%(levelname)s %(message)s", stream=sys.stderr)
    registry = load_registry(args.app, args.debug)
    if registry is None:
        return WORKER_BOOT_ERROR
    rows = []
    for method in registry.methods():
        try:  # (the hints as they resolve, not as written: an alias shows what it stands for)
            shown = f"{method.name}{inspect.signature(method.fn, eval_str=True)}"
        except Exception:  # (a hint that does not evaluate here: as written; a builtin without one)
            try:
                shown = f"{method.name}{inspect.signature(method.fn)}"
            except (TypeError, ValueError):
                shown = f"{method.name}(...)"
        kind = ("async" if method.is_async else "sync") + (", raw params" if method.raw_params else "") + (
            ", tool" if method.tool else "")
        rows.append((shown, kind))
    width = max((len(shown) for shown, _ in rows), default=0)
    print(f"ok: app {args.app!r}, {len(rows)} method{'s' if len(rows) != 1 else ''}")
    for shown, kind in rows:
        print(f"  {shown:<{width}}  {kind}")
    tools = sorted(method.name for method in registry.methods() if method.tool)
    print(f"tools: {', '.join(tools)}" if tools else "tools: none (Registry.method(tool=True) offers one to MCP hosts)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
