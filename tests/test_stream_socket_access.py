"""Who may connect to the NDJSON Unix socket (issue 12, item 5): stream_socket_mode and
stream_socket_group, so that a group of local clients can (under the shipped systemd unit,
DynamicUser, only root could). A real broker, its socket's mode and group read back, and a
call over it; the settings' checks.
"""

from __future__ import annotations

import grp
import json
import os
import socket
import stat
from pathlib import Path

import pytest

from broker import cli
from broker.config.loading import _socket_group_problem

CALL = b'{"jsonrpc":"2.0","method":"add","params":[2,3],"id":1}\n'


def call_over(path: Path) -> dict[str, object]:
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(10)
        sock.connect(str(path))
        sock.sendall(CALL)
        data = b""
        while not data.endswith(b"\n"):
            chunk = sock.recv(4096)
            assert chunk
            data += chunk
    return json.loads(data)


def test_the_socket_is_its_users_alone_by_default(broker_factory, tmp_path: Path):
    path = tmp_path / "s.sock"
    b = broker_factory("--workers", "1", "--stream-socket", str(path))
    st = os.stat(path)
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_gid == os.getegid()
    assert call_over(path) == {"jsonrpc": "2.0", "id": 1, "result": 5}
    assert "lets every user" not in b.read_log()


@pytest.mark.parametrize("group", ["daemon", "1"])
def test_a_group_given_the_socket_may_connect_by_its_mode(broker_factory, tmp_path: Path, group: str):
    path = tmp_path / "s.sock"
    broker_factory("--workers", "1", "--stream-socket", str(path), "--stream-socket-mode", "0660",
                   "--stream-socket-group", group)
    st = os.stat(path)
    assert stat.S_IMODE(st.st_mode) == 0o660 and st.st_gid == grp.getgrnam("daemon").gr_gid == 1
    assert call_over(path) == {"jsonrpc": "2.0", "id": 1, "result": 5}


def test_a_socket_open_to_every_user_is_warned_about(broker_factory, tmp_path: Path):
    path = tmp_path / "s.sock"
    b = broker_factory("--workers", "1", "--stream-socket", str(path), "--stream-socket-mode", "666")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o666
    assert f"WARNING stream_socket_mode 666 lets every user of this machine connect to {path} and call every tool" \
        in b.read_log()


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in [v for v in os.environ if v.startswith("RPC_BROKER_")]:
        monkeypatch.delenv(var)


@pytest.mark.parametrize(("text", "problem"), [
    ('stream_socket_group = "no-such-group-here"', "stream_socket_group = 'no-such-group-here': no such group"),
    ('stream_socket_group = "99999"', "stream_socket_group = '99999': no such group"),
    ('stream_socket_group = "a b"', "stream_socket_group"),
    ('stream_socket_mode = "0800"', "stream_socket_mode"),
    ('stream_socket_mode = "6600"', "stream_socket_mode"),
    ('stream_socket_mode = "rw"', "stream_socket_mode"),
    # (hostile testing, round 114: modes the broker's own user could not connect with)
    ('stream_socket_mode = "0000"', "stream_socket_mode = '0000': the owner's read and write bits (0600) are needed"),
    ('stream_socket_mode = "0460"', "stream_socket_mode = '0460': the owner's read and write bits"),
])
def test_a_bad_mode_or_group_is_refused_at_the_start(tmp_path: Path, clean_env, capsys, text, problem):
    path = tmp_path / "b.toml"
    path.write_text(text + "\n")
    assert cli.main(["check-config", str(path)]) == 2
    assert problem in capsys.readouterr().err


def test_a_user_not_in_the_group_cannot_give_it_the_socket():
    """chown(2) to a group one is not a member of fails (EPERM) unless root: said at the start."""
    assert _socket_group_problem("daemon", euid=1000, groups=[1000]) == (
        "stream_socket_group = 'daemon': the broker's user is not a member, so it cannot give the socket to it "
        "(add the user to it; under systemd, SupplementaryGroups=)")
    assert _socket_group_problem("daemon", euid=1000, groups=[1000, 1]) == ""
    assert _socket_group_problem("daemon", euid=0, groups=[0]) == ""
    assert _socket_group_problem("", euid=1000, groups=[1000]) == ""
