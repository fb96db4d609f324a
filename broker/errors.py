"""The broker's own exceptions: one base, split by whose fault they report.

After h11's `ProtocolError`, with its `LocalProtocolError` / `RemoteProtocolError` split
and its `error_status_hint` (h11/_util.py):

    BrokerError
        LocalError      this side's input is wrong: the operator's settings, the tool code
                        a worker was told to load. Fixed by the operator; the broker
                        refuses to start (or to reload) and says why.
            ConfigError         (config/settings.py)
            WorkerBootError     (pool.py)
        RemoteError     a peer sent what the protocol does not allow: a worker's frames, a
                        client's params. Answered or dropped; the broker goes on.
            FrameError          (wire.py), and WireMismatch, CodeChanged under it
            InvalidParams       (worker/params.py)
            NestingTooDeep      (worker/params.py)

Each carries a `hint`: one line saying what to do about it, for whoever reads the log or
the error (a class attribute; an instance may set its own). The message itself says what
went wrong, where, and with which value.
"""

from __future__ import annotations

import typing

__all__ = ["BrokerError", "LocalError", "RemoteError"]


class BrokerError(Exception):
    """Base of every exception rpc-broker raises about its input (not its own bugs).

    remote: False for a `LocalError` (this side's input), True for a `RemoteError`
        (a peer's).
    hint: what to do about it, one line ("" when the message says all).
    """

    remote: typing.ClassVar[bool] = False
    hint: str = ""


class LocalError(BrokerError):
    """This side's input is wrong (settings, the app a worker loads): the operator fixes it."""

    remote = False


class RemoteError(BrokerError):
    """A peer (a worker process, a client) sent what the protocol does not allow."""

    remote = True
