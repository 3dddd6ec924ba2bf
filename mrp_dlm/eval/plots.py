"""PNG plots of a benchmark: accuracy against a speed measure, one point per grid row.

Lossless rows (static, speculative: the same tokens as static) are drawn with a distinct
marker, and each point is labelled with its grid entry ("speculative:3").

Deliberately not here: computing the rows (see `bench.py`). Figures are drawn on the Agg
canvas directly, never through pyplot's global state, so no display is ever needed.
"""

from __future__ import annotations

from pathlib import Path

from mrp_dlm.model.loading import write_atomic

MARKERS = {True: ("*", 220, "lossless (same tokens as static)"),
           False: ("o", 60, "lossy")}  # lossless flag -> marker, size, legend entry


def plot_tradeoff(rows: list[dict], x_key: str, x_label: str, path: Path) -> None:
    """Scatter of accuracy (y) against rows' `x_key` (x), saved to `path`."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # heavy import, only here
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7, 4.5), dpi=100)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    for lossless, (marker, size, legend) in MARKERS.items():
        chosen = [row for row in rows if row["lossless"] == lossless and row[x_key] is not None]
        if chosen:
            axes.scatter([row[x_key] for row in chosen], [row["accuracy"] for row in chosen],
                         marker=marker, s=size, label=legend, zorder=3)
    for row in rows:
        if row[x_key] is not None:
            axes.annotate(row["label"], (row[x_key], row["accuracy"]), fontsize=7,
                          xytext=(4, 4), textcoords="offset points")
    tasks = sorted({row["task"] for row in rows})
    axes.set(xlabel=x_label, ylabel="accuracy", title=f"{', '.join(tasks)}: accuracy vs speed")
    axes.grid(True, alpha=0.3)
    axes.legend(loc="best", fontsize=8)
    write_atomic(path, lambda tmp: figure.savefig(tmp, format="png"))
