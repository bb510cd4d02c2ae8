"""The run's artifacts: the per-client table (Parquet) and the convergence plot (PNG, PDF, SVG: tracking.figures)."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from raysim.evaluation.records import ClientEvaluation
from raysim.tracking import plots


def write_client_table(
    evaluations: list[ClientEvaluation], extra: Mapping[int, Mapping[str, object]], path: Path
) -> None:
    """One row per client: its final PM/GM/HM scores plus `extra` columns (e.g. sample counts)."""
    rows = [{**e.row(), **extra.get(e.client_id, {})} for e in sorted(evaluations, key=lambda e: e.client_id)]
    pq.write_table(pa.Table.from_pylist(rows), path)


def write_table_json(parquet: Path, path: Path) -> None:
    """A Parquet table as MLflow's table artifact (`{"columns": [...], "data": [[...], ...]}`, NaN as null), which
    the MLflow UI shows as a table."""
    table = pq.read_table(parquet)
    rows = [[None if isinstance(v, float) and math.isnan(v) else v for v in row.values()] for row in table.to_pylist()]
    path.write_text(json.dumps({"columns": table.column_names, "data": rows}))


def write_convergence_plot(
    history: dict[int, dict[str, float]], title: str, path: Path, formats: Sequence[str] = plots.FORMATS
) -> None:
    """Mean test accuracy and training loss of PM (solid), GM (dotted) and HM (dashed: it often equals PM, which
    then shows through its gaps) against the round, in `formats` (plots.save)."""
    if not formats:
        return
    rounds = [r for r in sorted(history) if "pm/acc" in history[r]]

    def series(label: str, key: str, style: str) -> plots.Series:
        return plots.Series(label, {r: history[r][key] for r in rounds if key in history[r]}, linestyle=style)

    kinds = (("pm", "-"), ("gm", ":"), ("hm", "--"))
    accuracy = [series(kind.upper(), f"{kind}/acc", style) for kind, style in kinds]
    if rounds and all("heldout/pm/acc" in history[r] for r in rounds):  # clients.heldout: adapted target clients
        accuracy.append(series("held-out PM", "heldout/pm/acc", "-."))
    scored = any("pm/train_loss" in history[r] for r in rounds)  # tracking.train_loss: false leaves it out
    part, what = ("train_loss", "training") if scored else ("loss", "test")
    loss = [series(kind.upper(), f"{kind}/{part}", style) for kind, style in kinds]
    figure = plots.round_curves(
        [
            plots.Panel("test accuracy", accuracy, "mean test accuracy over clients", bounds=(0, 1)),
            plots.Panel(f"{what} loss", loss, f"mean {what} loss over clients", yscale="log"),
        ],
        title=title,
    )
    plots.save(figure, path, formats)


def write_partition_table(counts: dict[str, np.ndarray], extra: Mapping[int, Mapping[str, object]], path: Path) -> None:
    """The partition summary: one row per (client, label) with its train/test/val sample counts."""
    clients, classes = counts["train"].shape
    rows = [
        {"client_id": c, "label": k, **{part: int(counts[part][c, k]) for part in counts}, **extra.get(c, {})}
        for c in range(clients)
        for k in range(classes)
    ]
    pq.write_table(pa.Table.from_pylist(rows), path)


def write_partition_heatmap(
    counts: dict[str, np.ndarray], title: str, path: Path, formats: Sequence[str] = plots.FORMATS
) -> None:
    """Label distribution per client: share of each label in the client's samples (all parts), with its size, in
    `formats` (plots.save)."""
    if not formats:
        return
    total = sum(counts.values(), np.zeros_like(counts["train"]))
    sizes = total.sum(axis=1)
    shares = total / np.maximum(sizes, 1)[:, None]
    clients, classes = total.shape
    figure, (axis,) = plots.figure(figsize=(min(4 + 0.45 * classes, 14), min(2 + 0.22 * clients, 40)))
    image = axis.imshow(shares, aspect="auto", cmap="viridis", vmin=0.0, vmax=1.0, interpolation="nearest")
    axis.set(xlabel="label", ylabel="client (samples)", title=title)
    axis.set_xticks(range(classes))
    step = max(1, clients // 40)
    axis.set_yticks(range(0, clients, step), [f"{c} ({sizes[c]})" for c in range(0, clients, step)], fontsize=7)
    figure.colorbar(image, ax=axis, label="share of the client's samples")
    plots.save(figure, path, formats)
