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
from matplotlib.layout_engine import ConstrainedLayoutEngine  # noqa: E402
from matplotlib.ticker import FuncFormatter, LogFormatter, MaxNLocator  # noqa: E402
from matplotlib.typing import RcKeyType  # noqa: E402

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


MLFLOW_COLORS = (
    "#a6630c",
    "#c83243",
    "#b45091",
    "#8a63bf",
    "#434a93",
    "#137dae",
    "#04867d",
    "#308613",
    "#facb66",
    "#1f272d",
    "#445461",
    "#5f7281",
    "#8396a5",
    "#93320b",
    "#be501e",
    "#de7921",
    "#f2be88",
    "#115026",
    "#277c43",
    "#3ba65e",
    "#8ddda8",
    "#9e102c",
    "#c82d4c",
    "#e65b77",
    "#f792a6",
    "#0e538b",
    "#2272b4",
    "#4299e0",
    "#8acaff",
)
"""The palette MLflow 3's UI colours runs and groups from (its `RUNS_COLOR_PALETTE`, MLflow 3.17)."""


def mlflow_group_color(group: str, tag: str = "raysim.group") -> str:
    """The colour MLflow's UI gives the group of runs whose tag `tag` is `group` when the runs page is grouped by
    that tag (raysim's comparison view): a checksum of the group's id `tag.<tag>.<group>` over its UTF-16 code units
    picks one of MLFLOW_COLORS (the UI's `getStableColorForRun`). A group's colour can only be changed in the
    browser (kept in its local storage), so a study colours its settings with it: the comparison view's charts,
    the runs' own `mlflow.runColor` and raysim's figures then draw a setting alike."""
    units = f"tag.{tag}.{group}".encode("utf-16-le")
    first = second = 0
    for index in range(0, len(units), 2):
        first = (first + int.from_bytes(units[index : index + 2], "little")) % 255
        second = (second + first) % 255
    return MLFLOW_COLORS[(first | second << 8) % len(MLFLOW_COLORS)]


def group_colors(groups: Iterable[str]) -> dict[str, str]:
    """MLflow's colour (`mlflow_group_color`) of each distinct group of a study, the default `tracking.color` of its
    runs. Two groups may share one (29 colours): `line_styles` then draws them apart in raysim's figures."""
    return {group: mlflow_group_color(group) for group in dict.fromkeys(groups)}


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


@dataclass(frozen=True)
class PaperLayout:
    """A figure for a paper's page (`raysim figure --column single`): its exact width in inches (the PDF's page is
    that wide, so nothing is scaled down when it is placed in a column), every text at `font_size` points, the panels
    in a grid of `ncols` columns, the legend below them, thinner lines, no title unless given."""

    width: float
    font_size: float = 8.0
    ncols: int | None = None
    """Panels per row; None: all in one row."""
    aspect: float = 0.75
    """A panel's height over its width."""

    def grid(self, panels: int) -> tuple[int, int]:
        """(rows, columns) of the panels."""
        columns = min(self.ncols or panels, panels)
        return math.ceil(panels / columns), columns

    def rc(self) -> dict[RcKeyType, Any]:
        """Matplotlib's settings for every text of the figure at `font_size`."""
        keys: tuple[RcKeyType, ...] = (
            "font.size",
            "axes.titlesize",
            "axes.labelsize",
            "xtick.labelsize",
            "ytick.labelsize",
            "legend.fontsize",
            "figure.titlesize",
        )
        return dict.fromkeys(keys, self.font_size)


PAPER_LINE_SCALE = 0.5
"""A paper layout's lines: half LINE_WIDTHS (2.6 points is a screen figure's width, heavy in a 3.5-inch column)."""


def round_curves(
    panels: Sequence[Panel], title: str = "", panel_width: float = 5.0, paper: PaperLayout | None = None
) -> Figure:
    """Metric curves against the round, one line per series, one panel per metric, one legend for all panels; each
    linear panel's y range zoomed to its trained rounds (`zoom`). `paper`: laid out for a page (PaperLayout); the
    figure's axes are then only the panels' (a grid's unused cells removed)."""
    with plt.rc_context({} if paper is None else paper.rc()):  # every text made inside takes the paper's size
        return _round_curves(panels, title, panel_width, paper)


def _round_curves(panels: Sequence[Panel], title: str, panel_width: float, paper: PaperLayout | None) -> Figure:
    if paper is None:
        fig, axes = figure(len(panels), figsize=(panel_width * len(panels) + 2.0, 4.2))
    else:
        fig, axes = _paper_grid(paper, len(panels))
    for axis, panel in zip(axes, panels, strict=True):
        styles = line_styles(panel.series)
        scale = 1.0 if paper is None else PAPER_LINE_SCALE
        for series, style in zip(panel.series, styles, strict=True):
            rounds = sorted(series.values)
            axis.plot(
                rounds,
                [series.values[r] for r in rounds],
                linestyle=style,
                linewidth=LINE_WIDTHS.get(style, 1.5) * scale,
                color=series.color,
                marker="o" if len(rounds) <= 12 else None,
                markersize=3 * scale if paper else 3,
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
    if paper is None:
        legend_outside(fig, axes)
    else:
        legend_below(fig, axes, paper.font_size)
    if title:
        fig.suptitle(title, fontsize=None if paper is None else paper.font_size)
    return fig


def _paper_grid(paper: PaperLayout, panels: int) -> tuple[Figure, list[Axes]]:
    """The panels' axes in a grid `paper.width` wide, with room below for the legend; a grid's unused cells removed."""
    rows, columns = paper.grid(panels)
    height = rows * paper.width / columns * paper.aspect + 0.3 + paper.font_size / 72 * 3
    layout = ConstrainedLayoutEngine(w_pad=0.02, h_pad=0.02)  # inches: a column has none to spare
    fig, grid = plt.subplots(rows, columns, figsize=(paper.width, height), layout=layout, squeeze=False)
    cells = list(grid.flat)
    for unused in cells[panels:]:
        unused.remove()
    return fig, cells[:panels]


def legend_below(fig: Figure, axes: Sequence[Axes], fontsize: float) -> None:
    """One legend under the panels, as wide as the figure (a column is too narrow for one beside them)."""
    entries: dict[str, Any] = {}
    for axis in axes:
        handles, labels = axis.get_legend_handles_labels()
        for handle, label in zip(handles, labels, strict=True):
            entries.setdefault(label, handle)
    if entries:
        columns = min(len(entries), max(1, round(fig.get_figwidth() / 1.2)))
        fig.legend(
            entries.values(),
            entries.keys(),
            loc="outside lower center",
            fontsize=fontsize,
            ncols=columns,
            frameon=False,
            handlelength=2.0,
            columnspacing=1.0,
        )


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


PAPER_DPI = 300
"""A paper layout's PNG resolution (the PDF and SVG are vector)."""


def save(fig: Figure, path: str | Path, formats: Sequence[str] = FORMATS, exact_size: bool = False) -> None:
    """Write the figure as `figure_files(path, formats)` and free it. It is laid out and measured (tight bounding
    box) once, without drawing it, and each format drawn once with that layout and box: savefig's own tight box
    lays out and draws the figure twice for each file, and a draw only to measure it was a fifth of a run's PNG
    figure (0.06 of 0.31-0.35 CPU s; the files are the same, pixel for pixel). `exact_size`: the page is the
    figure's own size (a PaperLayout's width), not the box around what it draws, the PNG at PAPER_DPI."""
    if exact_size:
        for file in figure_files(path, formats):
            fig.savefig(file, dpi=PAPER_DPI)
    elif formats:
        renderer = fig.canvas.get_renderer()  # type: ignore[attr-defined]
        engine = fig.get_layout_engine()
        if engine is not None:
            engine.execute(fig)
        fig.set_layout_engine("none")
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
