"""How the proof tools stop on a signal (benchmarks/chaos.py, benchmarks/soak.py, fuzz/run.py).

Each starts processes of its own (a broker and its workers, load generators, libFuzzer
harnesses) and stops them in a `finally`. Python's default for SIGTERM and SIGHUP ends the
process at once, skipping it (hostile testing, round 112: a broker was left serving):
`stop_on_signals` makes them raise KeyboardInterrupt(signum), as SIGINT does. `run` then
ends such an interruption in one line and 128 + the signal's number, as a shell reports
a process killed by it (130 SIGINT, 143 SIGTERM), not a traceback (new user, round 105).
"""

from __future__ import annotations

import signal
import sys
import typing

__all__ = ["run", "stop_on_signals"]


def _interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(signum)


def stop_on_signals() -> None:
    """SIGTERM and SIGHUP raise KeyboardInterrupt(signum) from now on (in the main thread)."""
    for stop_signal in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(stop_signal, _interrupt)


def run(name: str, main: typing.Callable[[], int]) -> typing.NoReturn:
    """Exit with `main()`'s status; interrupted (SIGINT, or a signal of `stop_on_signals`),
    say so on stderr as `name` and exit 128 + the signal's number."""
    try:
        status = main()
    except KeyboardInterrupt as stopped:
        signum = stopped.args[0] if stopped.args and isinstance(stopped.args[0], int) else signal.SIGINT
        print(f"{name}: interrupted by {signal.Signals(signum).name}; what it started is stopped", file=sys.stderr)
        sys.exit(128 + signum)
    sys.exit(status)
