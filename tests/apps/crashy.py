"""A test app whose `crash` handler kills its own worker process."""

import os
import socket
import typing

from broker.worker import Registry

registry = Registry()


@registry.method
def crash() -> None:
    """Exits the worker at once with status 1 (no reply is ever sent)."""
    os._exit(1)


@registry.method
async def crash_async() -> None:
    """`crash` as an async handler: never routed as blocking its worker, whatever it does."""
    os._exit(1)


@registry.method
async def crash_if(crash: bool) -> str:
    """Exits the worker when `crash` is true, else answers: a tool that crashes for some params
    (async: never routed as blocking its worker)."""
    if crash:
        os._exit(1)
    return "fine"


@registry.method
def crash_after(seconds: float) -> str:
    """Answers, then a thread of its exits the worker with status 1 `seconds` later."""
    import threading
    import time

    threading.Thread(target=lambda: (time.sleep(seconds), os._exit(1)), daemon=True).start()
    return "answered"


@registry.method
def slow_crash(seconds: float) -> None:
    """Runs `seconds` (a sync call: its worker is busy in it), then exits the worker."""
    import time

    time.sleep(seconds)
    os._exit(1)


@registry.method
def pid() -> int:
    return os.getpid()


def _each_socket(act: typing.Callable[[socket.socket], object]) -> None:
    """Calls `act` on a duplicate of each of the process's open sockets (the broker's among
    them); an OSError from `act` is ignored."""
    for name in os.listdir("/proc/self/fd"):
        try:
            sock = socket.socket(fileno=os.dup(int(name)))
        except OSError:  # not a socket
            continue
        try:
            act(sock)
        except OSError:
            pass
        finally:
            sock.close()


@registry.method
def hang_up(seconds: float) -> None:
    """Shuts down the worker's sockets (the broker reads their end), lives `seconds` more,
    then exits with status 1: the gap between a socket's end and its process's exit."""
    import time

    _each_socket(lambda sock: sock.shutdown(socket.SHUT_RDWR))
    time.sleep(seconds)
    os._exit(1)


@registry.method
async def bad_frame() -> None:
    """Writes bytes that are no frame to its sockets (the broker's among them), then waits to
    be told to go: the broker closes its socket, and the worker exits."""
    import asyncio

    _each_socket(lambda sock: sock.send(b"hello garbage\n\x00\x00\x00"))
    await asyncio.sleep(30)


@registry.method
async def nap(seconds: float) -> float:
    """Sleeps `seconds` (async: many share a worker) and answers them: an innocent call."""
    import asyncio

    await asyncio.sleep(seconds)
    return seconds


@registry.method
async def nap_then_crash(seconds: float) -> None:
    """`nap`, then exits the worker (async: its worker takes other calls while it sleeps)."""
    import asyncio

    await asyncio.sleep(seconds)
    os._exit(1)


@registry.method
def stop_self() -> None:
    """Stops its own worker (SIGSTOP): a worker stopped in a call, killed as hung once past its
    deadline and cancel_grace."""
    import signal

    os.kill(os.getpid(), signal.SIGSTOP)


@registry.method
def sleep_then(seconds: float, crash: bool = False) -> float:
    """Sleeps `seconds` (a sync call: its worker is busy in it, reading nothing), then exits the
    worker if `crash`, else answers them."""
    import time

    time.sleep(seconds)
    if crash:
        os._exit(1)
    return seconds


@registry.method
async def block_then_crash(seconds: float) -> None:
    """An async handler that holds its worker's loop `seconds` (time.sleep: a common mistake; the
    worker reads nothing meanwhile), then exits the worker."""
    import time

    time.sleep(seconds)
    os._exit(1)


@registry.method
async def size(pad: str) -> int:
    """The length of `pad` (async: an innocent call with large params)."""
    return len(pad)
