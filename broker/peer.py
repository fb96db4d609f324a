"""A front-end process past the first (`serve --frontends N`): `python -m broker.peer --control FD`.

Started by the first front-end (broker/peers.py), never by hand. It reads its `Setup` from
the control socket it inherited (its number, the settings, the listening sockets bound for
it), then serves as the broker does (`server.serve`, with a `Peer`): the same front-ends and
dispatcher over the workers the first front-end hands over (broker/members.py), on the
listening sockets it got, and none of its own (no Unix socket, metrics port or status file:
the first front-end's). It dies with the first front-end; SIGTERM stops it as it stops the
broker (the first front-end sends it at its stop).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import signal
import socket
import sys
import typing

import msgspec

from broker import peerwire
from broker.config import Config
from broker.peers import Control
from broker.peerwire import SHARE_SECONDS, Collect, Counters, Exposition, Killed, Ready, Setup, Struck, Want

if typing.TYPE_CHECKING:
    from broker.auth import Token
    from broker.members import Members
    from broker.metrics import Flat

__all__ = ["Peer", "main"]

log = logging.getLogger("broker")

SETUP_SECONDS = 30.0  # the first front-end sends the Setup at once: past this, it is gone


@dataclasses.dataclass
class Peer:
    """What `server.run` needs to run as a peer: its `number`, its listening sockets by
    front-end transport ("http", "tcp"), and its control socket (`attach` reads it once the
    workers' `Members` exist)."""

    number: int
    listeners: dict[str, socket.socket]
    control: socket.socket
    receiver: peerwire.Receiver = dataclasses.field(default_factory=peerwire.Receiver)
    pending: list[tuple[peerwire.Message, int]] = dataclasses.field(default_factory=list)
    # The broker's /metrics body, as the first front-end last sent it (`Exposition`)
    exposition: bytes = b"# the first front-end has not sent the broker's metrics yet\n"
    channel: Control | None = None  # the control socket's, once `attach`ed
    tokens: list[Token] = dataclasses.field(default_factory=list)  # the first front-end's (`Setup`)
    samples: typing.Callable[[], list[Flat]] = list  # this front-end's series (`Collect`), once it serves
    members: Members | None = None  # its workers, once `attach`ed
    _asked: list[typing.Callable[[], None]] = dataclasses.field(default_factory=list, init=False)  # `gather`'s, Want sent
    _waiting: list[typing.Callable[[], None]] = dataclasses.field(default_factory=list, init=False)  # for the next Want
    _stopped: bool = dataclasses.field(default=False, init=False)  # `stopping`

    def attach(self, loop: asyncio.AbstractEventLoop, members: Members, lost: typing.Callable[[], None]) -> None:
        """Read the control socket on `loop` from now on, each message to `members`
        (those read with the Setup first); `lost` is called at its end (the first
        front-end is gone)."""

        def heard(message: peerwire.Message, fd: int) -> None:
            if isinstance(message, Exposition):
                self.exposition = message.body.encode()
                done, self._asked = self._asked, []
                for call in done:
                    call()
                self._want()
            elif isinstance(message, Collect):
                typing.cast(Control, self.channel).send(Counters(samples=self.samples(), round=message.round))
            else:
                loop.create_task(members.handle(message, fd))

        self.members = members
        for message, fd in self.pending:
            heard(message, fd)
        self.pending.clear()
        # (the setup's receiver: a line read in part with the Setup goes on; hostile testing, round
        # 127: a new one dropped that part, and the rest was a bad line that ended the peer)
        self.channel = Control(loop, self.control, heard, lost, self.receiver)
        channel = self.channel
        members.on_kill = lambda pid, reason: channel.send(Killed(pid=pid, reason=reason))
        # (a worker died under calls this one saw: the first front-end and the others strike them too)
        members.dispatcher.on_struck = lambda methods, caught, pid: channel.send(
            Struck(methods=methods, caught=caught, pid=pid))
        self._beat(loop)  # (from now on, serving or not yet: `Peers.check`)

    def share(self, samples: typing.Callable[[], list[Flat]]) -> None:
        """From now on answer the first front-end's `Collect` with `samples()`."""
        self.samples = samples

    def _beat(self, loop: asyncio.AbstractEventLoop) -> None:
        """Every SHARE_SECONDS from `attach`, send the first front-end a `Counters` with no
        series: its word that this front-end's loop runs (`Peers.check`), with the calls it
        sent each worker (recycling)."""
        if self.channel is None or self.channel.closed:
            return
        workers = self.members.workers if self.members is not None else {}
        self.channel.send(Counters(sent={pid: worker.calls for pid, worker in workers.items()}))
        loop.call_later(SHARE_SECONDS, self._beat, loop)

    async def last_words(self) -> None:
        """At the stop, once drained: send the first front-end this front-end's series one
        last time, which it keeps in the broker's sum (the calls answered here since the last
        scrape: hostile testing, round 128, they were lost), and wait until they are written."""
        if self.channel is None or self.channel.closed or self.samples is list:
            return
        self.channel.send(Counters(samples=self.samples(), round=-1))
        await self.channel.flushed(5.0)

    def stopping(self) -> None:
        """The stop: answer the scrapes waiting with the last body (the first front-end may
        send none now: hostile testing, round 130), and those to come at once."""
        self._stopped = True
        done, self._asked, self._waiting = self._asked + self._waiting, [], []
        for call in done:
            call()

    def gather(self, done: typing.Callable[[], None]) -> None:
        """A scrape came (`HttpFrontend.gather`): call `done` once the first front-end sent a
        body made after now (`Exposition`; broker/scrapes.py)."""
        if self._stopped:
            asyncio.get_running_loop().call_soon(done)
            return
        self._waiting.append(done)
        self._want()

    def _want(self) -> None:
        if self._waiting and not self._asked and self.channel is not None:
            self._asked, self._waiting = self._waiting, []
            self.channel.send(Want())

    def serving(self) -> None:
        """Tell the first front-end this one's listeners serve."""
        if self.channel is not None:
            self.channel.send(Ready(number=self.number))


def _setup(control: socket.socket) -> tuple[Setup, list[tuple[peerwire.Message, int]], peerwire.Receiver]:
    """Read the Setup (blocking, SETUP_SECONDS at most), and whatever came after it."""
    control.settimeout(SETUP_SECONDS)
    receiver = peerwire.Receiver()
    got: list[tuple[peerwire.Message, int]] = []
    while not got:
        more = peerwire.recv(control, receiver)
        if more is None:
            raise SystemExit("rpc-broker peer: the first front-end closed the control socket before the setup")
        got += more
    first, _ = got[0]
    if not isinstance(first, Setup):
        raise SystemExit(f"rpc-broker peer: the first control message is {type(first).__name__}, not Setup")
    return first, got[1:], receiver


def main(argv: list[str] | None = None) -> int:
    """`python -m broker.peer --control FD --parent-pid PID`: serve until SIGTERM; the exit
    status as `rpc-broker serve`'s."""
    parser = argparse.ArgumentParser(prog="python -m broker.peer")
    parser.add_argument("--control", type=int, required=True)
    parser.add_argument("--parent-pid", type=int, default=0)
    args = parser.parse_args(argv)
    from broker.worker.forks import die_with_parent

    die_with_parent(args.parent_pid or os.getppid())
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # (a terminal's ^C reaches the group: the first front-end stops us)
    try:  # (run by hand, with anything: a line, not a traceback; hostile testing, round 126)
        control = socket.socket(fileno=args.control)
        setup, pending, receiver = _setup(control)
        config = msgspec.convert(setup.config, Config)
        listeners = {transport: socket.socket(fileno=fd) for transport, fd in setup.listeners}
    except (OSError, peerwire.PeerWireError, msgspec.ValidationError) as exc:
        raise SystemExit(f"rpc-broker peer: no setup from the first front-end on descriptor {args.control}: {exc}"
                         " (a peer is started by `rpc-broker serve --frontends N`, not by hand)") from None
    peer = Peer(setup.number, listeners, control, receiver, pending, tokens=setup.tokens)
    from broker.server import serve

    return serve(config, peer=peer)


if __name__ == "__main__":
    sys.exit(main())
