"""plots.save measures a figure's tight box from its layout, without drawing it first: its files are those of the
figure drawn, then measured, then written, pixel for pixel (the constrained layout of curves with a legend outside
the panels, and a panel whose labels place_labels fitted after drawing)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pytest
from matplotlib.figure import Figure

from raysim.tracking import plots


def _curves() -> Figure:
    rounds = range(21)
    series = [plots.Series(f"method {k}", {r: 0.1 + 0.04 * r * (k + 1) / 3 for r in rounds}) for k in range(3)]
    loss = [plots.Series(f"method {k}", {r: 2.0 / (r + k + 1) for r in rounds}) for k in range(3)]
    panels = [plots.Panel("test accuracy", series, bounds=(0, 1)), plots.Panel("loss", loss, yscale="log")]
    return plots.round_curves(panels, title="a long title over both panels of the run's curves")


def _labelled() -> Figure:
    fig, (axis,) = plots.figure()
    points = [(0.1 * k, 0.5 + 0.04 * k) for k in range(8)]
    axis.scatter(*zip(*points, strict=True), s=30)
    plots.place_labels(
        fig, axis, [(f"client {k}", x, y) for k, (x, y) in enumerate(points)], [(*p, 30) for p in points]
    )
    return fig


def _drawn_then_measured(fig: Figure, path: Path) -> None:
    fig.canvas.draw()
    fig.set_layout_engine("none")
    box = fig.get_tightbbox(fig.canvas.get_renderer()).padded(plt.rcParams["savefig.pad_inches"])  # type: ignore[attr-defined]
    fig.savefig(path, dpi=plots.DPI, bbox_inches=box)
    plt.close(fig)


@pytest.mark.parametrize("make", [_curves, _labelled], ids=["curves", "labelled"])
def test_a_figure_laid_out_without_drawing_is_written_as_one_drawn_first(make: Callable[[], Figure], tmp_path):
    plots.save(make(), tmp_path / "saved.png", ["png"])
    _drawn_then_measured(make(), tmp_path / "drawn.png")
    saved, drawn = plt.imread(tmp_path / "saved.png"), plt.imread(tmp_path / "drawn.png")
    assert saved.shape == drawn.shape and np.array_equal(saved, drawn)
