"""The run's artifacts: the per-client table (Parquet) and the convergence plot (PNG)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

from raysim.metrics import ClientEvaluation  # noqa: E402


def write_client_table(evaluations: list[ClientEvaluation], extra: dict[int, dict[str, float]], path: Path) -> None:
    """One row per client: its final PM/GM/HM scores plus `extra` columns (e.g. sample counts)."""
    rows = [{**e.row(), **extra.get(e.client_id, {})} for e in sorted(evaluations, key=lambda e: e.client_id)]
    pq.write_table(pa.Table.from_pylist(rows), path)


def write_convergence_plot(history: dict[int, dict[str, float]], title: str, path: Path) -> None:
    """Mean test accuracy of PM (solid), GM (dashed) and HM (dotted) against the round."""
    figure, (acc_axis, loss_axis) = plt.subplots(1, 2, figsize=(11, 4))
    rounds = sorted(r for r in history if "pm/acc" in history[r])
    for kind, style in (("pm", "-"), ("gm", "--"), ("hm", ":")):
        acc_axis.plot(rounds, [history[r][f"{kind}/acc"] for r in rounds], style, label=kind.upper())
        loss_axis.plot(rounds, [history[r][f"{kind}/train_loss"] for r in rounds], style, label=kind.upper())
    if all("heldout/pm/acc" in history[r] for r in rounds):  # clients.heldout: the adapted target clients
        acc_axis.plot(rounds, [history[r]["heldout/pm/acc"] for r in rounds], "-.", label="held-out PM")
    acc_axis.set(xlabel="round", ylabel="mean test accuracy over clients", title=title)
    loss_axis.set(xlabel="round", ylabel="mean training loss over clients", yscale="log")
    for axis in (acc_axis, loss_axis):
        axis.grid(alpha=0.3)
        axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def write_partition_table(counts: dict[str, np.ndarray], extra: dict[int, dict[str, float]], path: Path) -> None:
    """The partition summary: one row per (client, label) with its train/test/val sample counts."""
    clients, classes = counts["train"].shape
    rows = [
        {"client_id": c, "label": k, **{part: int(counts[part][c, k]) for part in counts}, **extra.get(c, {})}
        for c in range(clients)
        for k in range(classes)
    ]
    pq.write_table(pa.Table.from_pylist(rows), path)


def write_partition_heatmap(counts: dict[str, np.ndarray], title: str, path: Path) -> None:
    """Label distribution per client: share of each label in the client's samples (all parts), with its size."""
    total = sum(counts.values())
    sizes = total.sum(axis=1)
    shares = total / np.maximum(sizes, 1)[:, None]
    clients, classes = total.shape
    figure, axis = plt.subplots(figsize=(min(4 + 0.45 * classes, 14), min(2 + 0.22 * clients, 40)))
    image = axis.imshow(shares, aspect="auto", cmap="viridis", vmin=0.0, vmax=1.0, interpolation="nearest")
    axis.set(xlabel="label", ylabel="client (samples)", title=title)
    axis.set_xticks(range(classes))
    step = max(1, clients // 40)
    axis.set_yticks(range(0, clients, step), [f"{c} ({sizes[c]})" for c in range(0, clients, step)], fontsize=7)
    figure.colorbar(image, ax=axis, label="share of the client's samples")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
