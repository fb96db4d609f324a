"""Reading a file an operator names (settings, tokens, a bench mix or report): a regular file of a bounded size.

A device (/dev/zero) or a huge file is refused at once, saying so, instead of being read until
memory runs out (hostile testing, round 114: /dev/zero as the token file; round 131: as the
config file, 9.9 GB in 8 s); a FIFO too, but where a shell's `<(...)` is meant (the settings, a
mix), which is read as its writer writes, up to the same bound.
"""

from __future__ import annotations

import errno
import os
import stat

__all__ = ["FileRefused", "read_bounded"]


class FileRefused(ValueError):
    """A file `read_bounded` will not read: not a regular file, or larger than its bound."""


def read_bounded(path: str | os.PathLike[str], limit: int, pipes: bool = False) -> bytes:
    """The bytes of `path`, a regular file (or, with `pipes`, a FIFO or a pipe: a shell's
    `<(...)`, read as its writer writes) of at most `limit` bytes. Anything else is opened
    non-blocking (a FIFO's open does not wait for a writer) and checked on its descriptor.
    Raises OSError when it cannot be opened or read (IsADirectoryError for a directory),
    `FileRefused` saying why when it is not a regular file (a device, a FIFO, a socket) or
    is larger than `limit`."""
    piped = pipes and stat.S_ISFIFO(os.stat(path).st_mode)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | (0 if piped else os.O_NONBLOCK))
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):  # (as open(2) for writing, or read(2), would say it)
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), os.fspath(path))
        if not (stat.S_ISREG(mode) or (piped and stat.S_ISFIFO(mode))):
            kind = "a FIFO" if stat.S_ISFIFO(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "a socket"
            raise FileRefused(f"not a regular file ({kind})")
        os.set_blocking(fd, True)
        with os.fdopen(fd, "rb", closefd=False) as file:
            data = file.read(limit + 1)
    finally:
        os.close(fd)
    if len(data) > limit:
        raise FileRefused(f"larger than {limit} bytes")
    return data
