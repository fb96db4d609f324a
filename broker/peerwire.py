"""The control channel between the first front-end and the others (`serve --frontends N`), sans-IO.

The first front-end process (the one `rpc-broker serve` runs: it supervises the workers)
and each other front-end it starts (a "peer") share one Unix socketpair. Messages are
JSON objects, one per line, tagged by `type` (`Message`); a `WorkerJoined` carries one
file descriptor beside its line (SCM_RIGHTS, with the line's first byte: sent by
`peers.Control`, read by `Receiver`): the peer's end of a socketpair whose other end the
worker got at its start (`--link-fd`, broker/worker/links.py).
The first front-end is the one source of truth on the workers: a peer routes to a worker
only once told `Serve`, and stops at `Retire` or `Lost`; a reload's method table comes as
`Methods` before the first `Serve` of its generation.

Peer to first front-end: `Ready` (its listeners serve), `Counters` (every SHARE_SECONDS,
empty: its word that its loop runs), `Want` (a GET /metrics came to it). /metrics is made on
demand, one view on every front-end: for a scrape on any of them, the first front-end asks
every peer for its series (`Collect`), each answers with them (`Counters`, the round's
number), it adds them to its own and sends the summed body (`Exposition`) to each peer that
wanted one (broker/peers.py). Either way, `Struck`: a worker died holding calls of these
methods, as one front-end saw it; a peer's goes to the first front-end, which tells the others.
"""

from __future__ import annotations

import array
import socket
import typing

import msgspec

from broker.auth import Token
from broker.wire import MethodInfo

__all__ = [
    "MAX_LINE_BYTES",
    "SHARE_SECONDS",
    "Collect",
    "Counters",
    "Exposition",
    "Killed",
    "Lost",
    "Message",
    "Methods",
    "PeerWireError",
    "Ready",
    "Receiver",
    "Retire",
    "Serve",
    "Setup",
    "Struck",
    "Want",
    "WorkerJoined",
    "decode",
    "encode",
    "recv",
]

SHARE_SECONDS = 1.0  # how often the peers say their loop runs (`Counters`, empty)
MAX_LINE_BYTES = 1 << 30  # a message's line at most: a method table's infos (up to max_frame_bytes, 1 GiB), a
# large app's metrics (hostile testing, round 126: 2,200 methods made a 17 MB /metrics, past 16 MiB, and the peer went)


class Setup(msgspec.Struct, tag="setup", frozen=True):
    """The first message to a peer: its `number` (1 and up), the `config` (the `Config`'s
    fields as JSON values: broker/config), and its listening sockets: (the front-end's
    transport, "http" or "tcp", and the descriptor it inherited), bound by the first front-end
    to its own ports with SO_REUSEPORT; the `tokens` the first front-end read at its start
    (auth_tokens_file and RPC_BROKER_AUTH_TOKENS: a peer started later reads neither, which
    only a restart of the broker reads again)."""

    number: int
    config: dict[str, typing.Any]
    listeners: list[tuple[str, int]]
    tokens: list[Token] = []


class WorkerJoined(msgspec.Struct, tag="worker", frozen=True):
    """A worker process started: `slot`, `pid`, the reload `generation` it belongs to; the
    peer's end of its connection is the descriptor sent with this line."""

    slot: int
    pid: int
    generation: int


class Methods(msgspec.Struct, tag="methods", frozen=True):
    """The method table of `generation` (its workers' HELLO): names in index order, those
    that are sync, and each one's description (the catalogue: MCP tools, rpc.discover)."""

    generation: int
    names: list[str]
    sync: list[str]
    infos: list[MethodInfo]


class Serve(msgspec.Struct, tag="serve", frozen=True):
    """Route calls to worker `pid` (its HELLO came on the first front-end's connection)."""

    pid: int


class Retire(msgspec.Struct, tag="retire", frozen=True):
    """Send worker `pid` no more calls: BYE on the peer's connection; it exits once every
    front-end's calls are answered (a reload's swap, a recycle, a leave, the stop)."""

    pid: int


class Lost(msgspec.Struct, tag="lost", frozen=True):
    """Worker `pid` is gone: `reason` as the first front-end says it ("exited with 1",
    "killed by SIGKILL (hung: ...)"): the peer's calls on it are answered -32002 with it."""

    pid: int
    reason: str


class Exposition(msgspec.Struct, tag="exposition", frozen=True):
    """The broker's /metrics body (every front-end's series summed: broker/metrics.py), made
    for the peer's `Want`: its scrapes waiting are answered with it."""

    body: str


class Collect(msgspec.Struct, tag="collect", frozen=True):
    """Send your series now (`Counters` with this `round`): a /metrics body is being made."""

    round: int


class Want(msgspec.Struct, tag="want", frozen=True):
    """A GET /metrics came to the peer: send it the next `Exposition`."""


class Counters(msgspec.Struct, tag="counters", frozen=True):
    """A peer's series (`metrics.samples`: family, sample name, labels, value) for
    `Collect`'s `round`, which the first front-end adds to its own (round -1: its last, at its
    stop, kept in the broker's sum); with round 0, every `SHARE_SECONDS`, no series: the peer's
    loop runs (`peers.Peers.check`), and `sent`, the calls it sent each worker (by pid;
    recycling by max_calls_per_worker counts them)."""

    samples: list[tuple[str, str, dict[str, str], float]] = []
    round: int = 0
    sent: dict[int, int] = {}


class Killed(msgspec.Struct, tag="killed", frozen=True):
    """The peer killed worker `pid` (SIGKILL), for `reason` ("hung: ..."): the first front-end
    says so when it reaps it, and restarts it as it does a worker it killed itself."""

    pid: int
    reason: str


class Struck(msgspec.Struct, tag="struck", frozen=True):
    """A worker died holding calls of the methods `methods` (by name), as a front-end saw it
    (`caught`: its one call there): every front-end strikes them too (broker/isolation.py), so
    that each runs their calls alone, not only the one that saw the death (hostile testing,
    round 132: each front-end's own first crash of a method another already isolated took the
    calls beside it). A peer sends it to the first front-end, which strikes them and tells the
    other peers."""

    methods: list[str]
    caught: bool = False
    pid: int = 0  # the worker's whose death it was: a front-end that saw it too strikes once (`Membership.struck`)


class Ready(msgspec.Struct, tag="ready", frozen=True):
    """The peer's listeners serve (its workers are ready: the `Serve`s it was sent)."""

    number: int


Message = (Setup | WorkerJoined | Methods | Serve | Retire | Lost | Exposition | Collect | Want | Counters | Killed | Ready
           | Struck)
_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(Message)


class PeerWireError(Exception):
    """A line that is no `Message`, too long, or a descriptor where none belongs (or none
    where one does): the channel is broken; the first front-end stops the peer."""


def encode(message: Message) -> bytes:
    """One line: the message's JSON and a newline."""
    return _encoder.encode(message) + b"\n"


def decode(line: bytes) -> Message:
    """The message of one line (its newline stripped or not); raises `PeerWireError`."""
    try:
        return _decoder.decode(line)
    except msgspec.MsgspecError as exc:
        raise PeerWireError(f"bad control line: {exc}") from None


class Receiver:
    """The reading end's state: bytes and descriptors as `recvmsg` gives them, messages out.

    Feed each read's data and descriptors (`feed`); it returns the complete messages, each
    `WorkerJoined` paired with its descriptor, in order. A descriptor is taken by the first
    `WorkerJoined` line not yet paired (sendmsg's ancillary data arrives with the first byte
    of its message, and lines are sent whole in order). Raises `PeerWireError` on a bad line,
    a line past MAX_LINE_BYTES, or descriptors and WorkerJoined lines that do not pair up;
    the descriptors it still holds then are closed by `close`.
    """

    def __init__(self, max_line_bytes: int = MAX_LINE_BYTES) -> None:
        self._buf = bytearray()
        self._fds: list[int] = []
        self._max = max_line_bytes

    def feed(self, data: bytes, fds: typing.Sequence[int] = ()) -> list[tuple[Message, int]]:
        """The messages completed by `data` (with `fds` received beside it): (message, its
        descriptor or -1)."""
        self._fds.extend(fds)
        self._buf += data
        out: list[tuple[Message, int]] = []
        while True:
            end = self._buf.find(b"\n")
            if end < 0:
                if len(self._buf) > self._max:
                    raise PeerWireError(f"a control line past {self._max} bytes")
                return out
            line = bytes(self._buf[:end])
            del self._buf[: end + 1]
            message = decode(line)
            fd = -1
            if isinstance(message, WorkerJoined):
                if not self._fds:
                    raise PeerWireError("a WorkerJoined line came without its descriptor")
                fd = self._fds.pop(0)
            out.append((message, fd))
            if self._fds and not self._buf:
                raise PeerWireError(f"{len(self._fds)} descriptor(s) came with no WorkerJoined line")

    def close(self) -> None:
        """Close the descriptors received and not handed out."""
        for fd in self._fds:
            try:
                socket.close(fd)
            except OSError:
                pass
        self._fds.clear()


def recv(sock: socket.socket, receiver: Receiver, size: int = 1 << 16) -> list[tuple[Message, int]] | None:
    """Read once from `sock` (blocking or ready) into `receiver`; None at end of file."""
    data, ancdata, _flags, _addr = sock.recvmsg(size, socket.CMSG_SPACE(64 * array.array("i").itemsize))
    fds: list[int] = []
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            got = array.array("i")
            got.frombytes(payload[: len(payload) - len(payload) % got.itemsize])
            fds.extend(got)
    if not data and not fds:
        return None
    return receiver.feed(data, fds)
