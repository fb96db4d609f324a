"""The README cannot drift from the code: its settings reference and its error table."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from broker.config import render_reference
from broker.jsonrpc import ERRORS

README = Path(__file__).resolve().parent.parent / "README.md"
BEGIN = "<!-- settings:begin -->\n"
END = "<!-- settings:end -->"


@pytest.fixture(scope="module")
def readme() -> str:
    return README.read_text(encoding="utf-8")


def _section(text: str, heading: str) -> str:
    """The body of the `## heading` section, up to the next `## ` heading."""
    match = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert match, f"README has no '## {heading}' section"
    return match.group(1)


def test_settings_reference_is_render_reference_output(readme: str) -> None:
    assert readme.count(BEGIN) == 1, f"README needs exactly one {BEGIN.strip()!r} line"
    assert readme.count(END) == 1, f"README needs exactly one {END!r} line"
    between = readme.split(BEGIN, 1)[1].split(END, 1)[0]
    assert between == render_reference(), (
        "the settings table in README.md is stale; paste the output of\n"
        '.venv/bin/python -c "from broker.config import render_reference; print(render_reference())"\n'
        f"between the {BEGIN.strip()} and {END} lines"
    )


def _error_table(readme: str) -> tuple[int, dict[int, list[str]]]:
    """The Errors section's code table: the HTTP status column's index, and the rows
    by code (cells stripped)."""
    status_col = -1
    rows: dict[int, list[str]] = {}
    for line in _section(readme, "Errors").splitlines():
        if not line.startswith("|"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[0] == "code":
            status_col = next((i for i, c in enumerate(cells) if "HTTP status" in c), -1)
        elif re.fullmatch(r"-?\d+", cells[0]):
            rows[int(cells[0])] = cells
    assert status_col > 0, "the Errors section needs a table with 'code' and 'HTTP status' columns"
    return status_col, rows


@pytest.mark.parametrize("code", sorted(ERRORS, reverse=True))
def test_error_table_has_code_with_its_http_status(readme: str, code: int) -> None:
    info = ERRORS[code]
    status_col, rows = _error_table(readme)
    assert code in rows, f"README's error table has no row for {code}"
    row = rows[code]
    assert row[status_col] == str(info.http_status), (
        f"README's row for {code} should give HTTP status {info.http_status}: {row}"
    )
    assert info.message in row, f"README's row for {code} should give the message {info.message!r}: {row}"


def test_error_table_has_no_unknown_codes(readme: str) -> None:
    unknown = set(_error_table(readme)[1]) - set(ERRORS)
    assert not unknown, f"README's error table lists codes not in broker.jsonrpc.ERRORS: {sorted(unknown)}"


def _check_config_sample(readme: str) -> tuple[str, list[tuple[str, str]]]:
    """The Configuration section's `broker.toml` and its `check-config` console sample as
    (toml text, [(command line, output shown after it)])."""
    section = _section(readme, "Configuration")
    toml = re.search(r"```toml\n(.*?)```", section, re.S)
    console = re.search(r"```console\n(\$ [^\n]*check-config.*?)```", section, re.S)
    assert toml and console, "the Configuration section needs its broker.toml and check-config samples"
    runs = re.findall(r"^\$ ([^\n]*)\n(.*?)(?=^\$ |\Z)", console.group(1), re.M | re.S)
    return toml.group(1), runs


def test_check_config_sample_is_what_the_command_prints(
    readme: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each `check-config` command of the sample, run on the README's own broker.toml (and
    a bad.toml of `workers = -1`), prints exactly what the README shows."""
    from broker import cli

    toml, runs = _check_config_sample(readme)
    (tmp_path / "broker.toml").write_text(toml, encoding="utf-8")
    (tmp_path / "bad.toml").write_text("workers = -1\n", encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    for name in [n for n in os.environ if n.startswith("RPC_BROKER_")]:
        monkeypatch.delenv(name)
    cats = [(cmd, shown) for cmd, shown in runs if cmd.startswith("cat ")]
    assert cats == [("cat bad.toml", "workers = -1\n")]  # (what the test writes, shown as the README says)
    runs = [(cmd, shown) for cmd, shown in runs if not cmd.startswith("cat ")]
    assert [cmd.split("check-config")[1].split()[0] for cmd, _ in runs] == ["broker.toml", "broker.toml", "bad.toml"]
    for command, shown in runs:
        env, _, rest = command.partition(".venv/bin/rpc-broker ")
        assert rest.startswith("check-config "), f"README sample runs {command!r}: spell it .venv/bin/rpc-broker"
        with monkeypatch.context() as m:
            for assignment in env.split():
                m.setenv(*assignment.split("=", 1))
            code = cli.main(rest.split("|")[0].split())
        out, err = capsys.readouterr()
        printed = out + err
        if "| grep " in rest:
            word = rest.split("| grep ")[1].strip()
            printed = "".join(line for line in printed.splitlines(keepends=True) if word in line)
        assert printed == shown, f"README's output of {command!r} is stale; the command prints:\n{printed}"
        assert code == (2 if "bad.toml" in rest else 0)


def test_the_python_client_example_prints_what_it_shows(readme: str) -> None:
    """A new user's check (round 37): the README had no Python client, and urllib's default
    form content type is refused. The Examples' Python block, run as written against a real
    broker (its URL's port changed), prints the answers its comments show."""
    import subprocess
    import sys

    from conftest import start_broker

    match = re.search(r"^```python\n(.*?)^```", _section(readme, "Examples"), re.M | re.S)
    assert match, "the Examples need a Python client"
    code = match.group(1)
    shown = [line.split("  # ", 1)[1] for line in code.splitlines() if line.startswith("print(")]
    assert len(shown) >= 2
    b = start_broker("--workers", "1")
    try:
        code = code.replace("http://localhost:8080/", f"http://127.0.0.1:{b.port}{b.path}")
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        assert done.stdout.splitlines() == shown, done.stderr
    finally:
        assert b.stop() == 0, b.read_log()


def test_curl_si_samples_show_the_headers_the_broker_sends(readme: str, tmp_path: Path) -> None:
    """Each `curl -si` sample of the Examples, sent to a real broker started as they say
    (`--workers 2 --method-timeout sleep=2`), gets the status line and header names the
    README shows, in order (the `date` value differs, the rest of the body does not); and
    the NDJSON section's Python one-liner, run as written, prints the answer it shows."""
    import shlex
    import socket
    import subprocess
    import sys

    from conftest import start_broker

    samples = []
    for output in re.findall(r"^\$ (curl -si [^\n]*\n.*?)(?=^\$ |^```)", _section(readme, "Examples"), re.M | re.S):
        command, _, rest = output.partition("\n")
        head, _, body = rest.rstrip("\n").partition("\n\n")
        samples.append((command, head, body))
    assert len(samples) >= 6
    sock = str(tmp_path / "rpc.sock")
    b = start_broker("--workers", "2", "--method-timeout", "sleep=2", "--stream-socket", sock)
    try:
        for command, head, body in samples:
            argv = shlex.split(command)
            data = argv[argv.index("-d") + 1].encode()
            with socket.create_connection((b.host, b.port), timeout=30) as s:
                s.sendall(b"POST / HTTP/1.1\r\nHost: localhost:8080\r\ncontent-type: application/json\r\n"
                          b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(data), data))
                answer = b"".join(iter(lambda s=s: s.recv(65536), b"")).decode()
            got_head, _, got_body = answer.partition("\r\n\r\n")
            got = [line.split(":")[0] if ":" in line else line for line in got_head.split("\r\n")]
            shown = [line.split(":")[0] if ":" in line else line for line in head.split("\n")]
            got.remove("connection")  # curl keeps the connection; this client asked to close
            assert got == shown, f"{command}: the broker sends {got_head!r}"
            if "pid" not in body:
                assert got_body.strip() == body.strip(), command
        one_liner = re.search(r"^\$ printf '%s\\n' ('[^\n]*') \\\n  \| (python3 -c [^\n]*) /tmp/rpc.sock\n(.*?)```",
                              _section(readme, "Examples"), re.M | re.S)
        assert one_liner, "the NDJSON example needs its Python one-liner"
        argv = shlex.split(one_liner.group(2))
        done = subprocess.run([sys.executable, *argv[1:], sock], input=shlex.split(one_liner.group(1))[0].encode() + b"\n",
                              capture_output=True, timeout=30)
        assert done.stdout.decode() == one_liner.group(3), done.stderr
    finally:
        assert b.stop() == 0, b.read_log()
