"""The error taxonomy (broker/errors.py): every exception the broker raises about its
input derives from `BrokerError`, local or remote, and carries a hint that the reports
the operator reads print."""

from __future__ import annotations

import msgspec
import pytest
from conftest import start_broker

from broker import wire
from broker.config import ConfigError, load
from broker.errors import BrokerError, LocalError, RemoteError
from broker.pool import CodeChanged, WorkerBootError
from broker.worker import InvalidParams, Method, NestingTooDeep


@pytest.mark.parametrize(
    ("cls", "side"),
    [
        (ConfigError, LocalError),
        (WorkerBootError, LocalError),
        (wire.FrameError, RemoteError),
        (wire.WireMismatch, RemoteError),
        (CodeChanged, RemoteError),
        (InvalidParams, RemoteError),
        (NestingTooDeep, RemoteError),
    ],
)
def test_each_error_is_local_or_remote_with_a_hint(cls, side):
    assert issubclass(cls, side) and issubclass(cls, BrokerError)
    assert cls.remote is (side is RemoteError)
    assert cls.hint and cls.hint != BrokerError.hint


def test_errors_raised_are_the_taxonomy_s():
    """Raised by the real code paths, not made by hand."""
    with pytest.raises(BrokerError) as info:
        load(None, {"RPC_BROKER_WORKERS": "-1"}, {})
    assert type(info.value) is ConfigError and not info.value.remote
    with pytest.raises(RemoteError) as frame:
        wire.FrameDecoder(1024).feed(wire.HEADER.pack(10**6, int(wire.Kind.RESULT), 1, 0))
    assert isinstance(frame.value, wire.FrameError)

    def add(a: int, b: int) -> int:
        return a + b

    with pytest.raises(RemoteError) as params:
        Method("add", add).bind(msgspec.json.encode({"a": "x", "b": 2}), 64)
    assert type(params.value) is InvalidParams and params.value.param == "a"


def test_a_boot_failure_s_log_carries_its_hint():
    with pytest.raises(RuntimeError) as info:
        start_broker("--workers", "1", "--app", "tests.apps.no_such_module:registry", timeout=60)
    message = str(info.value)
    assert message.startswith("broker exited with 3:"), message
    assert WorkerBootError.hint in message, message
