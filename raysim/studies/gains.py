"""`raysim figure RUN --gain-over REFERENCE`: each client's accuracy gain over a reference run (FedAvg), as violins:
FedSLR's Fig. 3 (FedSLR, App. B.3.1, Fig. 3, per-client relative accuracy against FedAvg on CIFAR-100), the paper's one
view of how the gain spreads over the clients.

The gains are differences of two runs' per-client tables (their `clients.parquet` artifacts, raysim.tracking.reports):
for every benign training client, a column of the run (default `pm_test_acc`, the personalized model) less the
reference's score of that same client (default `gm_test_acc`, FedAvg's one model). Both runs must hold the same
clients (the same partition: the same config's dataset, partition, clients and seed), which is checked.
"""

from __future__ import annotations

import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from raysim.errors import RaysimError

if TYPE_CHECKING:
    import pandas as pd
    from matplotlib.figure import Figure
    from mlflow.tracking import MlflowClient

CLIENT_TABLE = "clients.parquet"


class GainError(RaysimError):
    """Two per-client tables that cannot be compared, or a column neither has: one line naming it."""


@dataclass(frozen=True)
class ClientGains:
    """One violin: a run's per-client gains in one column over the reference."""

    label: str
    column: str
    client_ids: np.ndarray
    gains: np.ndarray


def _benign(table: pd.DataFrame) -> pd.DataFrame:
    """The training clients that were not attackers, indexed by client_id."""
    keep = np.ones(len(table), dtype=bool)
    for flag in ("malicious", "heldout"):
        if flag in table:
            keep &= ~table[flag].astype(bool).to_numpy()
    return table[keep].set_index("client_id").sort_index()


def client_gains(
    tables: Mapping[str, pd.DataFrame],
    reference: pd.DataFrame,
    columns: Sequence[str] = ("pm_test_acc",),
    reference_column: str = "gm_test_acc",
) -> list[ClientGains]:
    """Per run (label -> its per-client table) and column: column - the reference's `reference_column`, client by
    client over the benign training clients; refused when the runs hold different clients or lack a column."""
    base = _benign(reference)
    if reference_column not in base:
        raise GainError(f"the reference table has no column {reference_column!r} (it has {', '.join(base.columns)})")
    found = []
    for label, table in tables.items():
        run = _benign(table)
        if not np.array_equal(run.index.to_numpy(), base.index.to_numpy()):
            raise GainError(
                f"{label}: its clients ({len(run)}) are not the reference's ({len(base)}); compare runs of one "
                "partition (dataset, partition, clients and seed)"
            )
        for column in columns:
            if column not in run:
                raise GainError(f"{label}: no column {column!r} in its per-client table (it has {', '.join(run)})")
            gains = run[column].to_numpy(np.float64) - base[reference_column].to_numpy(np.float64)
            found.append(ClientGains(label, column, run.index.to_numpy(), gains))
    return found


def _wrapped(label: str, width: int = 22) -> str:
    """A tick label broken into lines of at most `width` characters, its own line breaks kept."""
    return "\n".join(textwrap.fill(line, width) for line in label.split("\n"))


def gains_figure(gains: Sequence[ClientGains], reference: str, title: str = "") -> Figure:
    """Violins of the per-client gains (one per run and column) with their medians, and the zero line."""
    from raysim.tracking import plots

    fig, (axis,) = plots.figure(figsize=(max(4.0, 1.3 * len(gains) + 2), 4.5))
    data = [100.0 * g.gains for g in gains]  # accuracy points
    axis.violinplot(data, showmedians=True, showextrema=True)
    colors = plots.setting_colors(g.label for g in gains)
    bodies = axis.collections[: len(gains)]  # the violins' bodies come first, then their median and extrema lines
    for body, gain in zip(bodies, gains, strict=True):
        body.set_facecolor(colors[gain.label])
        body.set_alpha(0.6)
    axis.axhline(0.0, color="grey", linewidth=0.8, linestyle="--")
    labels = [g.label if len({x.column for x in gains}) == 1 else f"{g.label}\n{g.column}" for g in gains]
    axis.set_xticks(range(1, len(gains) + 1), [_wrapped(label) for label in labels], fontsize=8)
    axis.set_ylabel("accuracy gain per client (points)")
    clients = len(gains[0].gains) if gains else 0
    axis.set_title(title or textwrap.fill(f"gain over {reference}, {clients} clients", 60), fontsize=10)
    return fig


def read_client_table(client: MlflowClient, run_id: str) -> pd.DataFrame:
    """A run's per-client table (its clients.parquet artifact)."""
    import tempfile

    import pandas as pd
    from mlflow.exceptions import MlflowException

    with tempfile.TemporaryDirectory() as folder:
        try:
            path = client.download_artifacts(run_id, CLIENT_TABLE, folder)
        except (MlflowException, OSError) as error:
            raise GainError(f"run {run_id}: no {CLIENT_TABLE} artifact ({str(error).splitlines()[0]})") from None
        return pd.read_parquet(path)


def _runs(client: MlflowClient, target: str) -> dict[str, str]:
    """name -> run id: a parent run's finished children, or the one run `target`."""
    run = client.get_run(target)
    children = client.search_runs(
        [run.info.experiment_id], f"tags.mlflow.parentRunId = '{target}'", order_by=["attributes.start_time ASC"]
    )
    chosen = [child for child in children if child.info.status == "FINISHED"] or [run]
    return {(r.info.run_name or r.info.run_id): r.info.run_id for r in chosen}


def write_gains_figure(
    tracking_uri: str,
    target: str,
    reference: str,
    folder: Path,
    columns: Sequence[str] = ("pm_test_acc",),
    reference_column: str = "gm_test_acc",
) -> list[Path]:
    """gains.png, .pdf, .svg in `folder`: every run of `target` (a run, or a suite's parent: each finished child but
    the reference) against `reference` (a run id, or the name of one of the parent's children, e.g. fedavg)."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    from raysim.credentials import connect_uri
    from raysim.tracking import plots

    client = MlflowClient(connect_uri(tracking_uri))
    try:
        runs = _runs(client, target)
    except MlflowException:
        raise GainError(f"{target}: no such run in the tracking store") from None
    reference_id = runs.pop(reference, reference)
    runs = {name: run for name, run in runs.items() if run != reference_id}
    if not runs:
        raise GainError(f"{target}: no run to compare with the reference {reference}")
    base = read_client_table(client, reference_id)
    tables = {name: read_client_table(client, run) for name, run in runs.items()}
    shown = reference if reference != reference_id else client.get_run(reference_id).info.run_name or reference
    gains = client_gains(tables, base, columns, reference_column)
    folder.mkdir(parents=True, exist_ok=True)
    plots.save(gains_figure(gains, shown), folder / "gains.png")
    return [Path(name) for name in plots.figure_files(folder / "gains.png")]
