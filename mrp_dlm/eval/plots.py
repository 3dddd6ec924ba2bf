"""PNG plots of a benchmark: accuracy against a speed measure, one point per grid row.

Each family (`grid.family_of`: the rows of one mode, a remask rule with its δ: a sweep
of one knob) is one colour, its points
joined in speed order and labelled with their knob value; lossless rows (static,
speculative) are stars. The head-free frontier (`pareto.frontier_rows`: dynamic decoding
at its best) is drawn as a dashed line, so that a lossy point above it beats threshold
decoding at that speed.

Deliberately not here: computing the rows (see `bench.py`). Figures are drawn on the Agg
canvas directly, never through pyplot's global state, so no display is ever needed.
"""

from __future__ import annotations

from pathlib import Path

from mrp_dlm.eval.pareto import frontier_rows
from mrp_dlm.files import write_atomic

MARKERS = {True: ("*", 200), False: ("o", 36)}  # lossless flag -> marker, size


def point_label(row: dict) -> str:
    """The swept value of a sweep point ("0.5", "3"), the whole entry for the others."""
    mode, _, value = row["label"].partition(":")
    return value.partition("@")[0] if value and not row["lossless"] else row["label"]


def family(row: dict) -> str:
    """A row's sweep (`grid.family_of`); rows written before families existed: the mode."""
    return row.get("family", row["mode"])


def plot_family(axes, rows: list[dict], x_key: str, colour: str) -> None:
    rows = sorted(rows, key=lambda row: row[x_key])
    xs, ys = [row[x_key] for row in rows], [row["accuracy"] for row in rows]
    if len(rows) > 1 and not rows[0]["lossless"]:
        axes.plot(xs, ys, color=colour, linewidth=1, alpha=0.6, zorder=2)
    for row, x, y in zip(rows, xs, ys):
        marker, size = MARKERS[row["lossless"]]
        axes.scatter([x], [y], marker=marker, s=size, color=colour, zorder=3)
        axes.annotate(point_label(row), (x, y), fontsize=6, xytext=(3, 3),
                      textcoords="offset points", color=colour)
    axes.plot([], [], color=colour, marker=MARKERS[rows[0]["lossless"]][0], linestyle="",
              label=family(rows[0]))


def plot_tradeoff(rows: list[dict], x_key: str, x_label: str, path: Path) -> None:
    """Accuracy (y) against rows' `x_key` (x) by mode family, with the frontier; to `path`."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # heavy import, only here
    from matplotlib.figure import Figure

    figure = Figure(figsize=(8, 5), dpi=110)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    shown = [row for row in rows if row[x_key] is not None]
    frontier = frontier_rows(shown, x_key).points
    if frontier:
        axes.plot(*zip(*frontier), color="0.3", linestyle="--", linewidth=2, zorder=1,
                  label="head-free frontier (dynamic)")
    families = list(dict.fromkeys(family(row) for row in shown))
    for index, name in enumerate(families):
        plot_family(axes, [row for row in shown if family(row) == name], x_key, f"C{index}")
    tasks = sorted({row["task"] for row in rows})
    axes.set(xlabel=x_label, ylabel="accuracy", title=f"{', '.join(tasks)}: accuracy vs speed")
    axes.grid(True, alpha=0.3)
    axes.legend(loc="best", fontsize=8)
    write_atomic(path, lambda tmp: figure.savefig(tmp, format="png"))
