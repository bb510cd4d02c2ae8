"""Parent-run reports of a suite: robustness (benign accuracy vs malicious fraction) and fairness scatter.

The robustness and fairness figures of the papers we reproduce: final accuracy over benign clients
against the fraction of malicious clients, one line per (algorithm, aggregation, attack), for PM, GM and HM;
and the variance across benign clients of test loss against mean accuracy, one point per run and model
("closer to the bottom right is better"). Runs without an attack count as fraction 0 of every attack line.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.figure import Figure

from raysim.tracking import plots

KINDS = ("pm", "gm", "hm")


def _mean_over_seeds(children: list[Any]) -> dict[str, dict[str, Any]]:
    """Per run name: its config (first seed) and the mean of each final summary metric over its seeds."""
    grouped: dict[str, list[Any]] = defaultdict(list)
    for child in children:
        grouped[child.name].append(child)
    return {
        name: {
            "config": runs[0].config,
            "summary": {
                k: float(np.mean([r.outcome.summary.get(k, np.nan) for r in runs])) for k in runs[0].outcome.summary
            },
        }
        for name, runs in grouped.items()
    }


def robustness_points(children: list[Any]) -> dict[tuple[str, str, str], list[tuple[float, dict[str, float]]]]:
    """(algorithm, aggregation rule, attack) -> sorted [(fraction, final benign PM/GM/HM accuracy)]."""
    runs = _mean_over_seeds(children)
    attacks = sorted({r["config"].attack.kind for r in runs.values() if r["config"].attack.active})
    lines: dict[tuple[str, str, str], list[tuple[float, dict[str, float]]]] = defaultdict(list)
    for run in runs.values():
        config, summary = run["config"], run["summary"]
        accuracy = {k: summary.get(f"final/{k}/acc", np.nan) for k in KINDS}
        fraction = config.attack.fraction if config.attack.active else 0.0
        for attack in [config.attack.kind] if config.attack.active else attacks:
            lines[(config.algorithm.name, config.aggregation.rule, attack)].append((fraction, accuracy))
    return {key: sorted(points, key=lambda p: p[0]) for key, points in lines.items()}


def write_robustness_plot(children: list[Any], title: str, path: Path) -> bool:
    """Benign accuracy vs malicious fraction for PM/GM/HM, each panel zoomed to its values; False (nothing written)
    without attacked runs."""
    if not any(c.config.attack.active for c in children):
        return False
    lines = robustness_points(children)
    figure, axes = plots.figure(3, figsize=(17, 4.2))
    for index, ((algorithm, rule, attack), points) in enumerate(sorted(lines.items())):
        label = f"{algorithm}{'' if rule == 'mean' else f' +{rule}'} / {attack}"
        style = plots.LINE_STYLES[index % len(plots.LINE_STYLES)]
        for axis, kind in zip(axes, KINDS, strict=True):
            axis.plot([p[0] for p in points], [p[1][kind] for p in points], style, marker="o", label=label)
    for axis, kind in zip(axes, KINDS, strict=True):
        axis.set(title=f"{kind.upper()}: benign test accuracy", xlabel="fraction of malicious clients")
        axis.grid(alpha=0.3)
        plots.zoom(axis, [p[1][kind] for points in lines.values() for p in points], (0, 1))
    axes[0].set_ylabel("mean over benign clients (final)")
    plots.legend_outside(figure, axes)
    figure.suptitle(title)
    plots.save(figure, path)
    return True


def fairness_figure(children: list[Any], title: str) -> Figure:
    """Variance of test loss across benign clients vs mean test accuracy, per run and model (PM/GM/HM). Markers
    shrink from PM to HM and PM/GM are hollow, so a model that lands on another (HM often equals PM) still shows;
    each run is labelled once per distinct point, where the label overlaps no other label and no marker
    (`plots.place_labels`)."""
    runs = _mean_over_seeds(children)
    figure, (axis,) = plots.figure(figsize=(9, 6))
    labels: dict[tuple[str, float, float], tuple[str, float, float]] = {}
    markers: list[tuple[float, float, float]] = []
    shapes = (("o", 110, "none"), ("s", 60, "none"), ("^", 22, None))
    for index, (kind, (marker, size, face)) in enumerate(zip(KINDS, shapes, strict=True)):
        color = plots.COLORS[index % len(plots.COLORS)]
        xs = [r["summary"].get(f"final/{kind}/acc", np.nan) for r in runs.values()]
        ys = [r["summary"].get(f"final/{kind}/loss_var", np.nan) for r in runs.values()]
        axis.scatter(xs, ys, marker=marker, s=size, facecolors=face or color, edgecolors=color, label=kind.upper())
        for name, x, y in zip(runs, xs, ys, strict=True):
            if np.isfinite(x) and np.isfinite(y):
                markers.append((x, y, size))
                labels.setdefault((name, round(x, 4), round(y, 6)), (name, x, y))
    axis.set(xlabel="mean test accuracy (benign clients)", ylabel="variance of test loss across clients", title=title)
    axis.grid(alpha=0.3)
    axis.margins(0.12)  # room around the outermost markers for their labels
    plots.legend_outside(figure, [axis])
    plots.place_labels(figure, axis, list(labels.values()), markers)
    return figure


def write_fairness_scatter(children: list[Any], title: str, path: Path) -> None:
    plots.save(fairness_figure(children, title), path)


def write_suite_reports(children: list[Any], title: str, folder: Path) -> list[str]:
    """Write robustness.png (if any run is attacked) and fairness.png, each with its PDF and SVG, into `folder`;
    returns the file names."""
    written = []
    if write_robustness_plot(children, f"{title}: robustness", folder / "robustness.png"):
        written += plots.figure_files("robustness.png")
    write_fairness_scatter(children, f"{title}: fairness", folder / "fairness.png")
    written += plots.figure_files("fairness.png")
    return written
