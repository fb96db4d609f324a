"""A test app whose handlers write to the worker's stdout and stderr themselves: a print,
a write with no newline (what the broker's reading of the workers' output must take whole),
a write to descriptor 1 past `sys.stdout`, and a child process's print (none of which may
reach `rpc-broker stdio`'s stdout)."""

import os
import subprocess
import sys

from broker.worker import Registry

registry = Registry()


@registry.method
def say(text: str) -> bool:
    """print(text): to the worker's stdout."""
    print(text)
    return True


@registry.method
def mutter(text: str) -> bool:
    """`text` to the worker's stderr, no newline after it."""
    sys.stderr.write(text)
    sys.stderr.flush()
    return True


@registry.method
def scribble(text: str) -> bool:
    """`text` and a newline written straight to descriptor 1 (os.write), past `sys.stdout`."""
    os.write(1, text.encode() + b"\n")
    return True


@registry.method
def spawn_echo(text: str) -> int:
    """A child process (echo) prints `text` to the stdout it inherits; its exit status."""
    return subprocess.run(["echo", text], check=False).returncode


@registry.method
def descriptors() -> list[str]:
    """What the worker's descriptors 0, 1 and 2 are (/proc/self/fd: "pipe:[inode]", a path...)."""
    return [os.readlink(f"/proc/self/fd/{fd}") for fd in (0, 1, 2)]


@registry.method
def fail(text: str) -> None:
    """Raise ValueError(text): the worker logs it, the client's text in its message."""
    raise ValueError(text)


@registry.method
def pid() -> int:
    """The worker's process id (a -32002's error data tells a client as much)."""
    return os.getpid()
