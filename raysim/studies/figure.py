"""`raysim figure PARENT_RUN`: a suite's or sweep's curves as a paper draws them, one panel per metric and one line
per setting, the mean over its seeds at each round with a band (+/- the sample std over the seeds, or their min to
max), in the style of raysim's other figures (`raysim.tracking.plots`), written as PNG, PDF and SVG; each setting in
its colour of MLflow's charts. For a paper (`--column single`, `--width`, `--font-size`, `--ncols`): the PDF exactly
a column wide with its text at the size asked (8 pt by default, never below 5 pt), nothing scaled when placed.

The histories are read back from MLflow by `raysim.studies.table.read_runs`, as `raysim table` reads them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import numpy as np

from raysim.studies.table import DEFAULT_METRICS, RunHistory, TableError, read_runs
from raysim.tracking.plots import PaperLayout

if TYPE_CHECKING:
    from matplotlib.figure import Figure

Band = Literal["std", "minmax"]
ACCURACY_LIKE = ("acc", "f1", "auc", "share", "fraction", "density")
"""Metric names with values in 0-1: the zoomed y range stays within it."""


@dataclass(frozen=True)
class SettingCurve:
    """One setting's curve of one metric: per round (logged by every seed) the mean over the seeds and the band."""

    setting: str
    rounds: list[int]
    mean: list[float]
    low: list[float]
    high: list[float]
    seeds: int


def setting_curves(runs: list[RunHistory], metric: str, band: Band = "std") -> list[SettingCurve]:
    """Per setting (in order of appearance) the mean over its seeds at each round every seed logged, and the band:
    mean +/- sample std (none with one seed) or the seeds' min and max."""
    curves = []
    for setting in dict.fromkeys(run.setting for run in runs):
        histories = [dict(run.histories[metric]) for run in runs if run.setting == setting and run.histories[metric]]
        if not histories:
            continue
        rounds = sorted(set.intersection(*(set(h) for h in histories)))
        values = np.array([[h[r] for r in rounds] for h in histories], dtype=np.float64)  # seeds x rounds
        mean = values.mean(axis=0)
        if band == "minmax":
            low, high = values.min(axis=0), values.max(axis=0)
        elif len(histories) > 1:
            std = values.std(axis=0, ddof=1)
            low, high = mean - std, mean + std
        else:
            low = high = mean
        curves.append(SettingCurve(setting, rounds, mean.tolist(), low.tolist(), high.tolist(), len(histories)))
    return curves


def _bounds(metric: str) -> tuple[float, float] | None:
    name = metric.rsplit("/", 1)[-1]
    return (0.0, 1.0) if any(part in name for part in ACCURACY_LIKE) and "loss" not in name else None


COLUMN_WIDTHS = {"single": 3.5, "double": 7.16}
"""A paper's column widths in inches (`--column`): IEEE's two-column page (3.5 in and 7.16 in; ACM's are 3.33 in and
7.0 in, given with `--width`)."""
MIN_FONT_PT = 5.0
MAX_FONT_PT = 24.0


@dataclass(frozen=True)
class FigureLook:
    """How `raysim figure` draws a study: for a paper (`paper`: width, font size, grid), each setting's colour and
    legend label, the title. The default is the screen figure with the colours the settings have in MLflow."""

    paper: PaperLayout | None = None
    colors: Mapping[str, str] = field(default_factory=dict)
    """setting -> a matplotlib colour; a setting not named keeps its MLflow colour (`mlflow.runColor`)."""
    labels: Mapping[str, str] = field(default_factory=dict)
    """setting -> its legend label; a setting not named is labelled by its name."""
    title: str | None = None
    """None: the study's name and seeds on the screen figure, none on a paper one (a caption says it)."""


def paper_layout(
    width: float | None = None, column: str | None = None, font_size: float | None = None, ncols: int | None = None
) -> PaperLayout | None:
    """The page layout `--width`/`--column`, `--font-size` and `--ncols` ask for (None: none of them given), each
    refused in one line when out of range."""
    if width is not None and column is not None:
        raise TableError("--width and --column: give one (--column single is --width 3.5, double --width 7.16)")
    if column is not None and column not in COLUMN_WIDTHS:
        raise TableError(f"--column {column!r}: allowed: {', '.join(COLUMN_WIDTHS)}")
    if width is None and column is None and font_size is None and ncols is None:
        return None
    inches = width if width is not None else COLUMN_WIDTHS[column or "single"]
    if not 1.0 <= inches <= 20.0:
        raise TableError(f"--width {inches:g}: a width in inches between 1 and 20 (a column is 3.5, a page 7.16)")
    size = 8.0 if font_size is None else font_size
    if not MIN_FONT_PT <= size <= MAX_FONT_PT:
        raise TableError(f"--font-size {size:g}: points between {MIN_FONT_PT:g} and {MAX_FONT_PT:g}")
    if ncols is not None and ncols < 1:
        raise TableError(f"--ncols {ncols}: at least 1")
    return PaperLayout(inches, size, ncols)


def parse_pairs(pairs: list[str] | None, option: str) -> dict[str, str]:
    """`SETTING=VALUE` arguments (`--color fedavg=#1f77b4`, `--label fedavg=FedAvg`) as a dict; a pair without `=`
    or with an invalid colour is refused in one line."""
    import matplotlib.colors

    found: dict[str, str] = {}
    for pair in pairs or []:
        setting, equals, value = pair.partition("=")
        if not equals or not setting or not value:
            raise TableError(
                f"{option} {pair!r}: give SETTING=VALUE, e.g. {option} fedavg="
                + ("#1f77b4" if option == "--color" else "FedAvg")
            )
        if option == "--color" and not matplotlib.colors.is_color_like(value):
            raise TableError(f"{option} {pair!r}: {value!r} is not a colour (#rrggbb or a matplotlib name: tab:blue)")
        found[setting] = value
    return found


def _check_settings(given: Mapping[str, str], settings: list[str], option: str) -> None:
    unknown = [name for name in given if name not in settings]
    if unknown:
        raise TableError(f"{option} {unknown[0]!r}: not a setting of the study; its settings: {', '.join(settings)}")


def curves_figure(
    tracking_uri: str, target: str, metrics: list[str] | None = None, band: Band = "std", look: FigureLook | None = None
) -> Figure:
    """The figure (matplotlib Figure) of a parent run id or experiment name: one panel per metric (default PM, GM
    and HM accuracy), one line per setting with its band, each panel zoomed to its trained rounds' values; each
    setting in its colour of MLflow's charts (its runs' `mlflow.runColor`), unless `look` names another."""
    from raysim.studies.table import column_label
    from raysim.tracking import plots

    look = look or FigureLook()
    chosen = list(metrics or DEFAULT_METRICS)
    study = read_runs(tracking_uri, target, chosen)
    settings = list(dict.fromkeys(run.setting for run in study.runs))
    _check_settings(look.colors, settings, "--color")
    _check_settings(look.labels, settings, "--label")
    fallback = plots.setting_colors(settings)
    logged = {run.setting: run.color for run in reversed(study.runs) if run.color}
    colors = {setting: look.colors.get(setting) or logged.get(setting) or fallback[setting] for setting in settings}
    per_metric = {metric: setting_curves(study.runs, metric, band) for metric in chosen}
    panels = [
        plots.Panel(
            column_label(metric).replace("\\", ""),
            [
                plots.Series(
                    look.labels.get(curve.setting, curve.setting),
                    dict(zip(curve.rounds, curve.mean, strict=True)),
                    color=colors[curve.setting],
                )
                for curve in curves
            ],
            ylabel=f"mean over seeds ({'min-max' if band == 'minmax' else '± std'})" if index == 0 else "",
            bounds=_bounds(metric),
        )
        for index, (metric, curves) in enumerate(per_metric.items())
    ]
    if look.paper is not None:
        panels = [replace(panel, ylabel="") for panel in panels]  # the caption says what the band is
    seeds = sorted({run.seed for run in study.runs})
    title = f"{study.title} (seeds {', '.join(map(str, seeds))})" if look.paper is None else ""
    fig = plots.round_curves(panels, title=title if look.title is None else look.title, paper=look.paper)
    for axis, (metric, curves) in zip(fig.axes, per_metric.items(), strict=False):
        lines = axis.get_lines()
        for line, curve in zip(lines, curves, strict=True):
            axis.fill_between(curve.rounds, curve.low, curve.high, color=line.get_color(), alpha=0.15, linewidth=0)
        shown = [
            v
            for curve in curves
            for r, lo, hi in zip(curve.rounds, curve.low, curve.high, strict=True)
            if r >= 1 or len(curve.rounds) == 1
            for v in (lo, hi)
        ]
        plots.zoom(axis, [v for v in shown if not math.isnan(v)], _bounds(metric))
    return fig


def write_figure(
    tracking_uri: str,
    target: str,
    folder: Path,
    metrics: list[str] | None = None,
    band: Band = "std",
    look: FigureLook | None = None,
) -> list[Path]:
    """`curves_figure` written into `folder` as curves.png, .pdf and .svg (a paper layout's at its exact width);
    returns the paths."""
    from raysim.tracking import plots

    folder.mkdir(parents=True, exist_ok=True)
    figure = curves_figure(tracking_uri, target, metrics, band, look)
    plots.save(figure, folder / "curves.png", exact_size=look is not None and look.paper is not None)
    return [Path(name) for name in plots.figure_files(folder / "curves.png")]
