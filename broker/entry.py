"""The `rpc-broker` command's entry point: stop and reload signals are caught from the start.

Until the broker's event loop installs its signal handlers, a signal takes its default
action: SIGHUP and SIGTERM end the process, SIGINT raises KeyboardInterrupt. Importing the
command line and the broker takes a few hundred milliseconds (more on a loaded machine),
and a `systemctl reload` sent right after `start` (the unit is `Type=exec`: started at
exec) killed the broker with SIGHUP, which systemd counts as a clean exit and does not
restart (hostile testing). This module imports nothing heavy: its first act is to catch
SIGHUP, SIGTERM and SIGINT into `pending`; `rpc-broker serve` then acts on them once its
loop's handlers are in place (`server.run`: a reload once started, a stop), and the other
commands restore the default handling and have the signals delivered again. What is left
is the interpreter's own start-up, before any of the broker's code runs (tens of ms).
"""

from __future__ import annotations

import signal
import sys
import types

__all__ = ["CAUGHT", "main", "pending", "restore"]

CAUGHT = (signal.SIGINT, signal.SIGHUP, signal.SIGTERM)  # (SIGTERM's last: once it is caught, all are)
pending: list[int] = []  # signals received before the broker's own handlers, in order


def _record(signum: int, frame: types.FrameType | None) -> None:
    pending.append(signum)


def restore() -> None:
    """Give the caught signals their default handling back, and deliver those received
    meanwhile (a SIGTERM then ends the process; a SIGINT raises KeyboardInterrupt)."""
    for sig in CAUGHT:
        signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
    received, pending[:] = list(pending), []
    for signum in received:
        signal.raise_signal(signum)


def main() -> int:
    """`rpc-broker`: catch the signals, then run the command line (`cli.main`)."""
    for sig in CAUGHT:
        signal.signal(sig, _record)
    from broker.cli import main as cli_main

    return cli_main(early=pending)


if __name__ == "__main__":
    sys.exit(main())
