"""``rpc-broker bench plot``: latency percentile curves of several runs on one chart.

The x axis is ``1 / (1 - p)`` on a log scale, as HdrHistogram's plotter draws it, so
50%, 90%, 99%, 99.9% and 99.99% are evenly spaced; y is latency in ms. Each curve is
labelled by its file's stem (or by its target when two files share a stem).

Every input is read and checked before matplotlib is imported, so a bad file is
reported (naming it, and the key that is wrong) even where matplotlib is missing;
percentiles outside 0..100 and negative latencies are refused by the schema itself.
A run with no latency curve (no answer was measured) is left out of the chart, and
`plot` returns its path so that the caller can warn; when no input has a curve
there is nothing to draw (`PlotError`). The output's suffix picks the format
(``.png``, ``.pdf``, ``.svg``, or any other that matplotlib writes); a name without
a known suffix is refused before anything is drawn.
"""

from __future__ import annotations

import re
import typing
from pathlib import Path

import msgspec

from broker.files import FileRefused, read_bounded
from broker.loadgen.stats import SCHEMA, Report

__all__ = ["TICKS", "PlotError", "load_reports", "plot"]

TICKS: tuple[tuple[float, str], ...] = (
    (50.0, "50%"), (90.0, "90%"), (99.0, "99%"), (99.9, "99.9%"), (99.99, "99.99%"))
MAX_REPORT_BYTES = 64 * 1024 * 1024  # bytes of a --json report read, at most (a few kB in practice)
_MAX_X = 1e6  # where 100% is drawn (1 / (1 - 0.999999))


def _x(percentile: float) -> float:
    rest = 1.0 - percentile / 100.0
    return _MAX_X if rest <= 1.0 / _MAX_X else 1.0 / rest


class PlotError(ValueError):
    """An input file the plot cannot use, or an output it cannot write; the message
    names the file (and, for a report that does not follow the schema, the key)."""


_AT = re.compile(r"(.*) - at `\$\.?(.*)`", re.S)


def load_reports(files: typing.Sequence[str | Path]) -> list[tuple[Path, Report]]:
    """Read and check each ``--json`` report; raises `PlotError` for the first file
    that cannot be read, is not JSON, or does not follow the schema."""
    out: list[tuple[Path, Report]] = []
    for f in files:
        path = Path(f)
        try:
            data = read_bounded(path, MAX_REPORT_BYTES, pipes=True)
        except FileRefused as exc:
            raise PlotError(f"input file {path}: {exc}") from None
        except OSError as exc:
            raise PlotError(f"input file {path}: cannot read it: {exc.strerror or exc}") from None
        try:
            report = Report.from_json(data)
        except msgspec.ValidationError as exc:  # before DecodeError: it is a subclass
            text = str(exc)
            m = _AT.fullmatch(text)
            if m:
                text = f"key {m[2]!r}: {m[1]}"
            raise PlotError(f"input file {path}: not a report of 'rpc-broker bench --json' "
                            f"(schema {SCHEMA}): {text}") from None
        except msgspec.DecodeError as exc:
            raise PlotError(f"input file {path}: not valid JSON: {exc}") from None
        out.append((path, report))
    return out


def plot(files: typing.Sequence[str | Path], out: str | Path, title: str | None = None) -> list[Path]:
    """Draw the ``percentiles`` curves of the given ``--json`` reports into ``out``, in
    the format its suffix names; return the inputs left out for having no curve.

    Raises `PlotError` naming the file for an input that cannot be read or does
    not follow the schema, when no input has a curve, for an output suffix that
    matplotlib cannot write, or an output that cannot be written; ImportError when
    matplotlib is missing.
    """
    reports = load_reports(files)
    empty = [path for path, rep in reports if not rep.percentiles]
    if len(empty) == len(reports):
        names = ", ".join(str(path) for path in empty)
        raise PlotError(f"nothing to plot: no input has a latency curve (no answer was measured in "
                        f"{names})")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    suffix = Path(out).suffix.lower().lstrip(".")
    stems = [p.stem for p, _ in reports]
    fig, ax = plt.subplots(figsize=(9, 5.5), dpi=100)
    formats: dict[str, str] = fig.canvas.get_supported_filetypes()
    if suffix not in formats:
        plt.close(fig)
        raise PlotError(f"cannot write {out}: unknown image format {'.' + suffix if suffix else '(no suffix)'}; "
                        f"name it .png, .pdf or .svg (or {', '.join('.' + f for f in sorted(set(formats) - {'png', 'pdf', 'svg'}))})")
    try:
        top = 1.0
        drawn = 0
        for (path, rep), stem in zip(reports, stems):
            label = stem if stems.count(stem) == 1 else f"{rep.target} ({path.name})"
            pts = [(_x(p), ms) for p, ms in rep.percentiles if p < 100.0]
            if rep.percentiles:
                pts.append((_MAX_X, rep.percentiles[-1][1]))
            if not pts:
                continue
            xs, ys = zip(*pts)
            top = max(top, *xs)
            ax.plot(xs, ys, label=label, linewidth=1.5)
            drawn += 1
        ax.set_xscale("log")
        ticks = [(_x(p), name) for p, name in TICKS]
        ax.set_xticks([x for x, _ in ticks], [name for _, name in ticks])
        ax.set_xlim(1.0, max(top, ticks[-1][0]))
        ax.set_xlabel("percentile")
        ax.set_ylabel("latency (ms)")
        ax.set_ylim(bottom=0)
        ax.grid(True, which="major", alpha=0.4)
        ax.set_title(title or "Latency by percentile")
        if drawn:  # a run with no answer measured has no curve (and an empty legend warns)
            ax.legend(loc="upper left")
        fig.tight_layout()
        try:
            fig.savefig(str(out), format=suffix)
        except OSError as exc:
            raise PlotError(f"cannot write {out}: {exc.strerror or exc}") from None
    finally:
        plt.close(fig)
    return empty
