"""The one place that draws raysim's figures, so that every report looks and reads the same.

Per-round curves (a run's convergence.png, a suite's comparison.png, a sweep's accuracy_vs_round.png) go
through `round_curves`: integer round ticks, one legend outside the data area, and a line style per series
so that a curve drawn over an equal one stays visible (the hybrid model often equals PM or GM). Every figure
is written by `save` (tight bounding box; the Agg backend, as the driver and Ray workers have no display).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.ticker import FuncFormatter, LogFormatter, MaxNLocator  # noqa: E402

LINE_STYLES = ("-", "--", ":", "-.")
"""Cycled over the series of a panel: solid first, then dashed, dotted, dash-dotted drawn over it."""
LINE_WIDTHS = {"-": 2.6, "--": 1.6, ":": 2.0, "-.": 1.5}
"""The solid line is the widest, so that an equal curve drawn over it in a broken style leaves it visible."""
DPI = 110
COLORS = tuple(plt.rcParams["axes.prop_cycle"].by_key()["color"])
"""Matplotlib's default colour cycle, for figures that colour by hand (one colour per model or series)."""


@dataclass(frozen=True)
class Series:
    """One line: a value per round."""

    label: str
    values: Mapping[int, float]
    """round -> value; rounds need not be contiguous (evaluation every k rounds)."""
    color: Any = None
    """A matplotlib colour; None takes the next of the default cycle."""
    linestyle: str | None = None
    """None takes LINE_STYLES[i % 4] for the panel's i-th series."""


@dataclass(frozen=True)
class Panel:
    """One set of axes of a `round_curves` figure."""

    title: str
    series: Sequence[Series]
    ylabel: str = ""
    yscale: str = "linear"


def figure(
    ncols: int = 1, figsize: tuple[float, float] = (7.0, 4.5), sharey: bool = False
) -> tuple[Figure, list[Axes]]:
    """A figure with `ncols` axes side by side, laid out so that an outside legend and titles never overlap."""
    fig, axes = plt.subplots(1, ncols, figsize=figsize, sharey=sharey, layout="constrained", squeeze=False)
    return fig, list(axes[0])


def round_curves(panels: Sequence[Panel], title: str = "", sharey: bool = False, panel_width: float = 5.0) -> Figure:
    """Metric curves against the round, one line per series, one panel per metric, one legend for all panels;
    `sharey` gives the panels one y range (e.g. PM, GM and HM accuracy side by side)."""
    fig, axes = figure(len(panels), figsize=(panel_width * len(panels) + 2.0, 4.2), sharey=sharey)
    for axis, panel in zip(axes, panels, strict=True):
        for index, series in enumerate(panel.series):
            rounds = sorted(series.values)
            style = series.linestyle or LINE_STYLES[index % len(LINE_STYLES)]
            axis.plot(
                rounds,
                [series.values[r] for r in rounds],
                linestyle=style,
                linewidth=LINE_WIDTHS.get(style, 1.5),
                color=series.color,
                marker="o" if len(rounds) <= 12 else None,
                markersize=3,
                label=series.label,
            )
        axis.set(title=panel.title, xlabel="round", ylabel=panel.ylabel, yscale=panel.yscale)
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))
        if panel.yscale == "log":  # plain numbers (0.2, 1.5) rather than 2 x 10^-1 on short ranges
            axis.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
            axis.yaxis.set_minor_formatter(LogFormatter(labelOnlyBase=False, minor_thresholds=(1, 0.4)))
        axis.grid(alpha=0.3)
    legend_outside(fig, axes)
    if title:
        fig.suptitle(title)
    return fig


def legend_outside(fig: Figure, axes: Sequence[Axes], fontsize: float = 8) -> None:
    """One legend right of the axes (never over a curve), listing each label of any panel once."""
    entries: dict[str, Any] = {}
    for axis in axes:
        handles, labels = axis.get_legend_handles_labels()
        for handle, label in zip(handles, labels, strict=True):
            entries.setdefault(label, handle)
    if entries:
        columns = 1 + len(entries) // 25
        fig.legend(entries.values(), entries.keys(), loc="outside right upper", fontsize=fontsize, ncols=columns)


def save(fig: Figure, path: str | Path) -> None:
    """Write the figure as PNG (tight bounding box) and free it."""
    fig.savefig(path, dpi=DPI, bbox_inches="tight")
    plt.close(fig)
