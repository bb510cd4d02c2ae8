"""The one place that draws raysim's figures, so that every report looks and reads the same.

Per-round curves (a run's convergence.png, a suite's comparison.png, a sweep's accuracy_vs_round.png) go
through `round_curves`: integer round ticks, one legend outside the data area, and a line style per series
so that a curve drawn over an equal one stays visible (the hybrid model often equals PM or GM), and a y range
zoomed to the later half of the trained rounds (`zoom`: accuracies near 0.95 would otherwise sit on a 0-1 axis).
Every figure is written by `save` as PNG, PDF and SVG side by side, or the formats a run's `tracking.figures`
names (tight bounding box; the Agg backend, as the driver and Ray workers have no display); `figure_files` names
the files, for logging them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib
import numpy as np

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
FORMATS = ("png", "pdf", "svg")
"""Every figure in each: PNG to look at (MLflow's UI shows it), PDF and SVG for a paper or slides."""
ZOOM_MARGIN = 0.05
"""Of the data's span, above and below it, when `zoom` sets a panel's y range."""
COLORS = tuple(plt.rcParams["axes.prop_cycle"].by_key()["color"])
"""Matplotlib's default colour cycle, for figures that colour by hand (one colour per model or series)."""
MANY_COLORS = tuple(matplotlib.colors.to_hex(matplotlib.colormaps["tab20"](i)) for i in range(20))
"""For more settings than COLORS holds: tab20's pairs of a dark and a light shade."""


def setting_colors(settings: Iterable[str]) -> dict[str, str]:
    """A colour (#rrggbb) per distinct setting, in order of first appearance: the default cycle for up to ten
    settings, tab20 for more (repeating past twenty). A study's children carry theirs as `tracking.color`, so that
    MLflow's charts and raysim's figures draw a setting alike."""
    distinct = list(dict.fromkeys(settings))
    palette = COLORS if len(distinct) <= len(COLORS) else MANY_COLORS
    return {setting: matplotlib.colors.to_hex(palette[i % len(palette)]) for i, setting in enumerate(distinct)}


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
    bounds: tuple[float, float] | None = None
    """The metric's possible range (accuracy: 0 to 1): the zoomed y range never leaves it."""


def line_styles(series: Sequence[Series]) -> list[str]:
    """Each series' line style: its own, else LINE_STYLES in turn, skipping a style that an earlier series of the
    same colour already has (tab20 repeats past twenty settings, and 20 is a multiple of the four styles: the 21st
    setting would otherwise be drawn exactly as the first)."""
    taken: set[tuple[str, str]] = set()
    styles = []
    for index, one in enumerate(series):
        color = "" if one.color is None else matplotlib.colors.to_hex(one.color)
        turns = [LINE_STYLES[(index + k) % len(LINE_STYLES)] for k in range(len(LINE_STYLES))]
        style = one.linestyle or next((s for s in turns if (color, s) not in taken), turns[0])
        taken.add((color, style))
        styles.append(style)
    return styles


def figure(
    ncols: int = 1, figsize: tuple[float, float] = (7.0, 4.5), sharey: bool = False
) -> tuple[Figure, list[Axes]]:
    """A figure with `ncols` axes side by side, laid out so that an outside legend and titles never overlap."""
    fig, axes = plt.subplots(1, ncols, figsize=figsize, sharey=sharey, layout="constrained", squeeze=False)
    return fig, list(axes[0])


def round_curves(panels: Sequence[Panel], title: str = "", panel_width: float = 5.0) -> Figure:
    """Metric curves against the round, one line per series, one panel per metric, one legend for all panels; each
    linear panel's y range zoomed to its trained rounds (`zoom`)."""
    fig, axes = figure(len(panels), figsize=(panel_width * len(panels) + 2.0, 4.2))
    for axis, panel in zip(axes, panels, strict=True):
        styles = line_styles(panel.series)
        for series, style in zip(panel.series, styles, strict=True):
            rounds = sorted(series.values)
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
        if panel.yscale == "linear":
            start = _zoom_start(panel)
            later = [v for series in panel.series for r, v in series.values.items() if r >= start]
            zoom(axis, later or [v for series in panel.series for v in series.values.values()], panel.bounds)
    legend_outside(fig, axes)
    if title:
        fig.suptitle(title)
    return fig


def _zoom_start(panel: Panel) -> int:
    """The first round a panel's y range is zoomed to: the later half of its training rounds. Round 0 (chance
    level) and a slow method's first rounds would otherwise stretch the axis down and squeeze the converged curves
    at the top into one line; a method that stays low still sets the range with its later rounds."""
    last = max((r for series in panel.series for r in series.values), default=0)
    return max(1, last // 2)


def zoom(axis: Axes, values: Iterable[float], bounds: tuple[float, float] | None = None) -> None:
    """Set the y range to the values' span plus ZOOM_MARGIN of it on each side, kept within `bounds` (0-1 for an
    accuracy: the full 0-1 axis only where the data spans it). Curves pass `zoom` their later rounds (`_zoom_start`);
    a curve's start below the range leaves through the bottom edge."""
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return
    low, high = min(finite), max(finite)
    margin = ZOOM_MARGIN * (high - low) or max(abs(high) * 0.01, 1e-3)
    low, high = low - margin, high + margin
    if bounds is not None:
        low, high = max(low, bounds[0]), min(high, bounds[1])
    axis.set_ylim(low, high)


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


def figure_files(name: str | Path, formats: Sequence[str] = FORMATS) -> list[str]:
    """The files `save` writes for `name.png` in `formats` (default PNG, PDF and SVG), as names or paths as given."""
    path = Path(name)
    return [str(path.with_suffix(f".{form}")) for form in formats]


def save(fig: Figure, path: str | Path, formats: Sequence[str] = FORMATS) -> None:
    """Write the figure as `figure_files(path, formats)` and free it. It is laid out and measured (tight bounding
    box) once, and each format drawn with that layout and box: 25-30 % faster for a run's three files than
    savefig's own tight box, which lays out and draws the figure twice for each file."""
    if formats:
        fig.canvas.draw()
        fig.set_layout_engine("none")
        renderer = fig.canvas.get_renderer()  # type: ignore[attr-defined]
        box = fig.get_tightbbox(renderer).padded(plt.rcParams["savefig.pad_inches"])
        for file in figure_files(path, formats):
            fig.savefig(file, dpi=DPI, bbox_inches=box)
    plt.close(fig)


LABEL_RADII = (5, 10, 16, 24, 34, 46, 60, 76, 94, 114, 136, 160, 186, 214)
"""Distances (points) from its marker at which `place_labels` tries a label, nearest first; beyond the first two a
thin leader line joins label and marker."""
LABEL_DIRECTIONS = 16


def place_labels(
    fig: Figure,
    axis: Axes,
    labels: Sequence[tuple[str, float, float]],
    markers: Sequence[tuple[float, float, float]],
    fontsize: float = 7,
) -> list[Any]:
    """Annotate each (text, x, y) so that no label overlaps another label or a marker: greedy, in the given order,
    each label at the nearest of LABEL_RADII x LABEL_DIRECTIONS offsets whose rendered extent is free and inside the
    axes. `markers` are every drawn marker as (x, y, size in points^2, scatter's `s`). The figure's layout is fixed
    first (a later layout pass would move the axes under the placed labels). A label with no free place (more than
    the axes can hold) goes at its marker; the tests check that none does for raysim's reports."""
    fig.canvas.draw()
    fig.set_layout_engine("none")
    renderer = fig.canvas.get_renderer()  # type: ignore[attr-defined]
    scale = fig.dpi / 72.0
    bounds = axis.get_window_extent(renderer)
    to_pixels = axis.transData.transform
    taken = []  # rows of x0, y0, x1, y1 in pixels: the markers, then each placed label
    for x, y, size in markers:
        px, py = to_pixels((x, y))
        half = math.sqrt(size) / 2 * scale + 1
        taken.append((px - half, py - half, px + half, py + half))
    radii = np.repeat(np.array(LABEL_RADII, dtype=float), LABEL_DIRECTIONS) * scale
    angles = np.tile(2 * np.pi * np.arange(LABEL_DIRECTIONS) / LABEL_DIRECTIONS, len(LABEL_RADII))
    placed = []
    for text, x, y in labels:
        probe = axis.text(0, 0, text, fontsize=fontsize)
        extent = probe.get_window_extent(renderer)
        probe.remove()
        width, height = extent.width + 2, extent.height + 2
        px, py = to_pixels((x, y))
        # every candidate at once, nearest first; the label extends away from its marker (left of it when to the
        # left, below it when below)
        x0 = px + radii * np.cos(angles) - width * (1 - np.cos(angles)) / 2
        y0 = py + radii * np.sin(angles) - height * (1 - np.sin(angles)) / 2
        boxes = np.stack([x0, y0, x0 + width, y0 + height], axis=1)
        inside = (
            (boxes[:, 0] >= bounds.x0)
            & (boxes[:, 2] <= bounds.x1)
            & (boxes[:, 1] >= bounds.y0)
            & (boxes[:, 3] <= bounds.y1)
        )
        others = np.array(taken).reshape(-1, 4)
        clash = (
            (boxes[:, None, 0] < others[None, :, 2])
            & (others[None, :, 0] < boxes[:, None, 2])
            & (boxes[:, None, 1] < others[None, :, 3])
            & (others[None, :, 1] < boxes[:, None, 3])
        ).any(axis=1)
        free = np.flatnonzero(inside & ~clash)
        chosen = int(free[0]) if len(free) else None
        box = tuple(boxes[chosen]) if chosen is not None else (px, py, px + width, py + height)
        radius = LABEL_RADII[chosen // LABEL_DIRECTIONS] if chosen is not None else 0
        taken.append(box)
        offset = ((box[0] + 1 - px) / scale, (box[1] + 1 - py) / scale)
        leader = {"arrowstyle": "-", "lw": 0.5, "color": "0.5", "shrinkA": 0, "shrinkB": 2} if radius > 10 else None
        placed.append(
            axis.annotate(
                text,
                (x, y),
                xytext=offset,
                textcoords="offset points",
                fontsize=fontsize,
                ha="left",
                va="bottom",
                alpha=0.85,
                arrowprops=leader,
            )
        )
    return placed
