"""`raysim figure PARENT_RUN`: a suite's or sweep's curves as a paper draws them, one panel per metric and one line
per setting, the mean over its seeds at each round with a band (+/- the sample std over the seeds, or their min to
max), in the style of raysim's other figures (`raysim.tracking.plots`), written as PNG, PDF and SVG.

The histories are read back from MLflow by `raysim.studies.table.read_runs`, as `raysim table` reads them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import numpy as np

from raysim.studies.table import DEFAULT_METRICS, RunHistory, read_runs

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


def curves_figure(tracking_uri: str, target: str, metrics: list[str] | None = None, band: Band = "std") -> Figure:
    """The figure (matplotlib Figure) of a parent run id or experiment name: one panel per metric (default PM, GM
    and HM accuracy), one line per setting with its band, each panel zoomed to its trained rounds' values."""
    from raysim.studies.table import column_label
    from raysim.tracking import plots

    chosen = list(metrics or DEFAULT_METRICS)
    study = read_runs(tracking_uri, target, chosen)
    per_metric = {metric: setting_curves(study.runs, metric, band) for metric in chosen}
    panels = [
        plots.Panel(
            column_label(metric).replace("\\", ""),
            [plots.Series(curve.setting, dict(zip(curve.rounds, curve.mean, strict=True))) for curve in curves],
            ylabel=f"mean over seeds ({'min-max' if band == 'minmax' else '± std'})" if index == 0 else "",
            bounds=_bounds(metric),
        )
        for index, (metric, curves) in enumerate(per_metric.items())
    ]
    seeds = sorted({run.seed for run in study.runs})
    title = f"{study.title} (seeds {', '.join(map(str, seeds))})"
    fig = plots.round_curves(panels, title=title)
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
    tracking_uri: str, target: str, folder: Path, metrics: list[str] | None = None, band: Band = "std"
) -> list[Path]:
    """`curves_figure` written into `folder` as curves.png, .pdf and .svg; returns the paths."""
    from raysim.tracking import plots

    folder.mkdir(parents=True, exist_ok=True)
    plots.save(curves_figure(tracking_uri, target, metrics, band), folder / "curves.png")
    return [Path(name) for name in plots.figure_files(folder / "curves.png")]
