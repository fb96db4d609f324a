"""The NDJSON stream listener's Unix socket file (stream_socket): checked, made with its mode and group, removed.

`server.run` checks the path before the workers start (`check_socket_path`: not a link, not
another file, no live listener on it), binds it once they are ready (`unix_server`: a
leftover of a broker that died is replaced), and removes it at the stop if it is still its
own (`remove_socket`).
"""

from __future__ import annotations

import asyncio
import errno
import os
import socket
import stat
import typing

__all__ = ["check_socket_path", "remove_socket", "unix_server"]


def check_socket_path(path: str) -> None:
    """Raise OSError if `path` is a symbolic link, exists and is not a socket, or a live
    process listens on it; a leftover socket file (a broker that died) passes
    (`unix_server` replaces it).

    The probe's connect does not block (hostile testing, round 32): a listener whose
    queue is full (`listen(0)`, never accepting) held a blocking one, and with it the
    loop's thread: the broker hung at start, logging nothing and deaf to SIGTERM. Now
    connected, or EAGAIN (a full queue), is in use (EADDRINUSE); ECONNREFUSED (nobody
    listens) is stale; any other error (EACCES: another user's socket) is raised as it
    is, the file left alone. A symbolic link (round 32: a dangling one passed, then the
    bind failed with EADDRINUSE, "another process listens there") is refused at once."""
    if os.path.islink(path):
        raise OSError(f"{path} is a symbolic link: not replaced; give the socket's own path")
    directory = os.path.dirname(path) or "."
    if path.endswith("/") or not os.path.isdir(directory):  # (round 33: found only at the bind, the app imported)
        raise OSError(f"{path}: " + ("names a directory, not a socket file" if path.endswith("/") else
                                     f"its directory {directory} does not exist or is not a directory"))
    if os.path.exists(path):
        if not stat.S_ISSOCK(os.stat(path).st_mode):
            raise OSError(f"{path} exists and is not a socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.setblocking(False)
            code = probe.connect_ex(path)
        finally:
            probe.close()
        if code in (errno.ECONNREFUSED, errno.ENOENT):
            return  # nobody listens: stale (or gone since)
        if code in (0, errno.EAGAIN, errno.EWOULDBLOCK, errno.EINPROGRESS):
            raise OSError(errno.EADDRINUSE, f"{path} is in use by another process")  # (the hint: `cannot_listen`)
        raise OSError(code, f"{path}: cannot tell whether another process listens on it: {os.strerror(code)}")


async def unix_server(
    loop: asyncio.AbstractEventLoop, factory: typing.Callable[[], asyncio.BaseProtocol], path: str,
    mode: int = 0o600, gid: int = -1,
) -> asyncio.Server:
    """Listen on a Unix socket at `path`, mode 0600 from the start, then given to group
    `gid` (-1: left the broker's) and set to `mode` (stream_socket_mode and _group: the
    group first, so that its group bits never open it to another group). A leftover
    socket file (a broker that died) is replaced; one a live process listens on is not."""
    check_socket_path(path)
    if os.path.exists(path):
        os.unlink(path)  # stale
    old = os.umask(0o177)
    try:
        server = await loop.create_unix_server(factory, path, backlog=2048)
    finally:
        os.umask(old)
    try:
        if gid != -1:
            os.chown(path, -1, gid)
        if mode != 0o600:
            os.chmod(path, mode)
    except OSError:
        server.close()
        raise
    return server


def remove_socket(made: tuple[str, int, int] | None) -> None:
    """Remove the socket file this broker made, if it is still that file (another
    broker may have been started on the path since it was moved away)."""
    if made is not None:
        path, dev, ino = made
        try:
            now = os.stat(path)
            if stat.S_ISSOCK(now.st_mode) and (now.st_dev, now.st_ino) == (dev, ino):
                os.unlink(path)
        except OSError:
            pass
