"""Rate limits (sans-IO): calls per second per caller, a token bucket each.

A caller is a token's name when tokens are given (broker/auth.py), else the client's
address (its IP, whatever its port; every Unix-socket client is one caller, "unix"). Each
caller has a bucket of `burst` calls that refills at `rate` calls a second (the token
bucket of RFC 2697's single-rate meter, and of nginx's `limit_req ... burst=N nodelay`):
a call takes one; with none left it is refused, -32005 "Rate limited" (429 over HTTP, with
`Retry-After`). Calls are counted, not requests: each element of a batch takes one, and
only those past the limit are refused, the rest run; a notification takes one too, and
past the limit is dropped (it has no answer to carry the error). `rate_limit` and
`rate_burst` set every caller's bucket; a .toml token file's table may set its token's.

The buckets of addresses are kept in a bounded table (`MAX_ADDRESSES`): past it, the ones
least recently used go first, a bucket full again being no different from a new one.
"""

from __future__ import annotations

import math
import time
import typing
from collections import OrderedDict

__all__ = ["MAX_ADDRESSES", "MAX_BURST", "MAX_RATE", "MAX_WAIT_SECONDS", "UNLIMITED", "Bucket", "Limiter", "Rate", "address_of", "burst_for", "share"]

MAX_WAIT_SECONDS: typing.Final = 1e9  # a refusal's retry_after_seconds at most (some 31 years)
MAX_ADDRESSES: typing.Final = 65536
MAX_RATE: typing.Final = 1e6  # calls a second: past it, no limit a broker could reach
MAX_BURST: typing.Final = 1_000_000
_clock = time.monotonic


def address_of(peer: object) -> str:
    """The caller's address from a transport's "peername": its IP ("unix" on a Unix
    socket, whose peer has none: "" or None; "stdio" on stdio)."""
    return str(peer[0]) if isinstance(peer, tuple) and peer else "stdio" if peer == "stdio" else "unix"


def burst_for(rate: float) -> int:
    """The burst a rate has when none is given: a second's calls, at least 1."""
    return max(1, math.ceil(rate))


class Rate(typing.NamedTuple):
    """A bucket's shape: `rate` calls a second (> 0) and `burst` calls at most at once (>= 1)."""

    rate: float
    burst: int


UNLIMITED: typing.Final = Rate(0.0, 0)  # a token's own rate_limit = 0: no bucket, whatever the global rate


def share(rate: Rate, n: int) -> Rate:
    """One of `n` front-end processes' share of `rate` (`serve --frontends N`): a caller's
    connections may land on any of them, each with its own buckets, so each holds rate/n and
    burst/n rounded down (at least 1), and together never more than `rate` (nor its burst, but
    for a burst under n). `UNLIMITED` stays so. (New user, round 114: rounded up, a burst of 3
    on 2 front-ends let 4 calls through.)"""
    if n <= 1 or rate.rate <= 0.0:  # (UNLIMITED, or one equal to it: a peer's tokens are decoded anew)
        return rate
    return Rate(rate.rate / n, max(1, rate.burst // n))


class Bucket:
    """One caller's token bucket (`Rate`); `refused_total`: calls refused by it."""

    __slots__ = ("at", "burst", "level", "name", "rate", "refused_total")

    def __init__(self, rate: Rate, name: str = "") -> None:
        self.rate = rate.rate
        self.burst = float(rate.burst)
        self.level = self.burst  # calls it may take now
        self.at = _clock()  # when `level` was last brought up to date
        self.name = name  # the caller: a token's name, or "" for an address
        self.refused_total = 0

    def take(self) -> bool:
        """Take one call from the bucket, if it has one: True; else False (refused, counted)."""
        now = _clock()
        level = self.level + (now - self.at) * self.rate
        self.at = now
        if level > self.burst:
            level = self.burst
        if level >= 1.0:
            self.level = level - 1.0
            return True
        self.level = level
        self.refused_total += 1
        return False

    def retry_after(self) -> float:
        """Seconds until it has a call again (from its last `take`), rounded up to ms, at
        most `MAX_WAIT_SECONDS` (hostile testing, round 115, L1: a rate of 1e-310 made it
        infinite, and its ceil raised OverflowError in the refusal)."""
        return math.ceil(min(MAX_WAIT_SECONDS, max(0.0, 1.0 - self.level) / self.rate) * 1000) / 1000


class Limiter:
    """The buckets: one per token (`for_token`) and one per address (`for_address`), or
    none at all when no rate is set (`for_*` return None)."""

    __slots__ = ("_addresses", "_default", "_tokens", "refused_addresses")

    def __init__(self, default: Rate | None = None, by_token: typing.Mapping[str, Rate] | None = None,
                 tokens: typing.Iterable[str] = ()) -> None:
        self._default = default
        self._tokens: dict[str, Bucket] = {}
        for name in tokens:
            rate = (by_token or {}).get(name, default)
            if rate is not None and rate.rate > 0.0:  # (not UNLIMITED, nor one equal to it: new user,
                # round 115, a peer's tokens are decoded anew, and `is` told its rate_limit 0 apart: a
                # bucket of rate 0, whose refusal's Retry-After divided by zero)
                self._tokens[name] = Bucket(rate, name)
        self._addresses: OrderedDict[str, Bucket] = OrderedDict()
        self.refused_addresses = 0  # refused by the buckets of addresses dropped from the table

    def for_token(self, name: str) -> Bucket | None:
        """Token `name`'s bucket, or None if it has no rate."""
        return self._tokens.get(name)

    def for_address(self, address: str) -> Bucket | None:
        """The bucket of client address `address` (an IP, or "unix"), made if new; None
        if no default rate is set."""
        if self._default is None:
            return None
        addresses = self._addresses
        bucket = addresses.get(address)
        if bucket is None:
            bucket = addresses[address] = Bucket(self._default)
            if len(addresses) > MAX_ADDRESSES:
                _, dropped = addresses.popitem(last=False)
                self.refused_addresses += dropped.refused_total
        else:
            addresses.move_to_end(address)
        return bucket

    def refused(self) -> dict[str, int]:
        """Calls refused so far, by token name ("" for those of addresses)."""
        counts = {name: bucket.refused_total for name, bucket in self._tokens.items()}
        counts[""] = self.refused_addresses + sum(b.refused_total for b in self._addresses.values())
        return counts
