"""The run's artifacts: the per-client table (Parquet) and the convergence plot (PNG)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
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
    acc_axis.set(xlabel="round", ylabel="mean test accuracy over clients", title=title)
    loss_axis.set(xlabel="round", ylabel="mean training loss over clients", yscale="log")
    for axis in (acc_axis, loss_axis):
        axis.grid(alpha=0.3)
        axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
