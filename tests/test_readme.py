"""The README cannot drift from the code: its settings reference and its error table."""

from __future__ import annotations

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
