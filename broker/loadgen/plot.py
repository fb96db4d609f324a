"""``rpc-broker bench plot``: latency percentile curves of several runs on one chart.

The x axis is ``1 / (1 - p)`` on a log scale, as HdrHistogram's plotter draws it, so
50%, 90%, 99%, 99.9% and 99.99% are evenly spaced; y is latency in ms. Each curve is
labelled by its file's stem (or by its target when two files share a stem).
"""

from __future__ import annotations

import typing
from pathlib import Path

from broker.loadgen.stats import Report

__all__ = ["TICKS", "plot"]

TICKS: tuple[tuple[float, str], ...] = (
    (50.0, "50%"), (90.0, "90%"), (99.0, "99%"), (99.9, "99.9%"), (99.99, "99.99%"))
_MAX_X = 1e6  # where 100% is drawn (1 / (1 - 0.999999))


def _x(percentile: float) -> float:
    rest = 1.0 - percentile / 100.0
    return _MAX_X if rest <= 1.0 / _MAX_X else 1.0 / rest


def plot(files: typing.Sequence[str | Path], out: str | Path, title: str | None = None) -> None:
    """Draw the ``percentiles`` curves of the given ``--json`` reports into the PNG ``out``.

    Raises OSError for unreadable files, `msgspec.ValidationError` /
    `msgspec.DecodeError` for a file that does not follow the schema.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    reports = [(Path(f), Report.from_json(Path(f).read_bytes())) for f in files]
    stems = [p.stem for p, _ in reports]
    fig, ax = plt.subplots(figsize=(9, 5.5), dpi=100)
    try:
        top = 1.0
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
        ax.set_xscale("log")
        ticks = [(_x(p), name) for p, name in TICKS]
        ax.set_xticks([x for x, _ in ticks], [name for _, name in ticks])
        ax.set_xlim(1.0, max(top, ticks[-1][0]))
        ax.set_xlabel("percentile")
        ax.set_ylabel("latency (ms)")
        ax.set_ylim(bottom=0)
        ax.grid(True, which="major", alpha=0.4)
        ax.set_title(title or "Latency by percentile")
        ax.legend(loc="upper left")
        fig.tight_layout()
        fig.savefig(str(out), format="png")
    finally:
        plt.close(fig)
