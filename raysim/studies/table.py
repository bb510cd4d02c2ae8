"""Result tables as papers print them: one row per setting of a suite or sweep (or per configuration of an
experiment's runs), one column per metric, each cell the mean +/- sample std over the setting's seeds at the final
round or at each run's best round (with the rounds).

The numbers are read back from MLflow, the same metric histories the UI plots, so a table can be made for any
finished suite or sweep (`raysim table PARENT_RUN`) and is also logged on the parent run when it finishes
(`table_final.*`, `table_best.*`). `build_table` is pure and does the arithmetic; `fetch_runs` reads the store.
"""

from __future__ import annotations

import csv
import difflib
import io
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from raysim.errors import RaysimError

At = Literal["final", "best"]
Format = Literal["markdown", "csv", "latex"]
DEFAULT_METRICS = ("pm/acc", "gm/acc", "hm/acc")
FORMATS: dict[str, str] = {"markdown": "md", "csv": "csv", "latex": "tex"}


class TableError(RaysimError):
    """A table cannot be made: an unknown run or experiment, or a metric no run logged."""


@dataclass(frozen=True)
class RunValues:
    """One finished run: its setting (the table row), seed, and per metric (value, round) at final or best."""

    setting: str
    seed: int
    run_id: str
    values: dict[str, tuple[float, int]]


@dataclass(frozen=True)
class Cell:
    mean: float
    std: float
    """Sample standard deviation over the seeds (NaN for one seed)."""
    n: int
    rounds: tuple[int, ...]
    """The round each seed's value comes from (the best round with `--at best`)."""
    values: tuple[float, ...]


@dataclass
class Table:
    title: str
    at: At
    metrics: list[str]
    rows: list[tuple[str, list[int], dict[str, Cell]]]
    """(setting, its seeds, metric -> cell), in the order the settings first ran."""
    left_out: int = 0
    """Child runs that did not finish (not in the table)."""

    def render(self, form: Format) -> str:
        return {"markdown": self.markdown, "csv": self.csv, "latex": self.latex}[form]()

    def _text(self, cell: Cell | None, latex: bool = False) -> str:
        if cell is None or cell.n == 0:
            return "-"
        pm = r" \pm " if latex else " ± "
        text = f"{cell.mean:.4f}" + ("" if math.isnan(cell.std) else f"{pm}{cell.std:.4f}")
        text = f"${text}$" if latex else text
        if self.at == "best":
            low, high = min(cell.rounds), max(cell.rounds)
            text += f" (r {low})" if low == high else f" (r {low}-{high})"
        return text

    def markdown(self) -> str:
        head = ["setting", "seeds", *self.metrics]
        lines = [
            f"**{self.title}**: {self.at} round, mean ± sample std over seeds" + self._footnote(),
            "",
            "| " + " | ".join(head) + " |",
            "|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|",
        ]
        for setting, seeds, cells in self.rows:
            shown = [self._text(cells.get(m)) for m in self.metrics]
            lines.append("| " + " | ".join([setting.replace("|", "\\|"), str(len(seeds)), *shown]) + " |")
        return "\n".join(lines) + "\n"

    def csv(self) -> str:
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        columns = ["setting", "seeds"]
        for metric in self.metrics:
            columns += [f"{metric} mean", f"{metric} std", f"{metric} n", f"{metric} rounds", f"{metric} values"]
        writer.writerow(columns)
        for setting, seeds, cells in self.rows:
            row: list[Any] = [setting, ";".join(map(str, seeds))]
            for metric in self.metrics:
                cell = cells.get(metric)
                if cell is None:
                    row += ["", "", 0, "", ""]
                    continue
                std = "" if math.isnan(cell.std) else repr(cell.std)
                row += [repr(cell.mean), std, cell.n, ";".join(map(str, cell.rounds)),
                        ";".join(map(repr, cell.values))]  # fmt: skip
            writer.writerow(row)
        return out.getvalue()

    def latex(self) -> str:
        lines = [
            f"% {self.title}: {self.at} round, mean \\pm sample std over seeds{self._footnote()}",
            "\\begin{tabular}{l r " + "c " * len(self.metrics) + "}",
            "\\hline",
            " & ".join(["setting", "seeds", *(_latex_escape(m) for m in self.metrics)]) + " \\\\",
            "\\hline",
        ]
        for setting, seeds, cells in self.rows:
            shown = [self._text(cells.get(m), latex=True) for m in self.metrics]
            lines.append(" & ".join([_latex_escape(setting), str(len(seeds)), *shown]) + " \\\\")
        lines += ["\\hline", "\\end{tabular}"]
        return "\n".join(lines) + "\n"

    def _footnote(self) -> str:
        return f" ({self.left_out} unfinished runs left out)" if self.left_out else ""


def _latex_escape(text: str) -> str:
    return re.sub(r"([&%$#_{}])", r"\\\1", text).replace("±", r"$\pm$")


def lower_is_better(metric: str) -> bool:
    """Losses, variances, spreads and lagging shares are best when smallest; everything else when largest."""
    name = metric.rsplit("/", 1)[-1]
    return "loss" in name or name.endswith(("_var", "_std")) or name in ("lagging_share",)


def pick(history: list[tuple[int, float]], at: At, metric: str) -> tuple[float, int]:
    """(value, round) of a metric history: its last round's, or its best (earliest best round on ties)."""
    ordered = sorted(history)
    if at == "final":
        step, value = ordered[-1]
        return value, step
    chooser = min if lower_is_better(metric) else max
    best = chooser(value for _, value in ordered)
    return best, next(step for step, value in ordered if value == best)


def build_table(runs: list[RunValues], metrics: list[str], at: At, title: str, left_out: int = 0) -> Table:
    """Group runs by setting (in order of appearance) and average each metric over the setting's seeds."""
    settings = list(dict.fromkeys(r.setting for r in runs))
    rows = []
    for setting in settings:
        members = sorted((r for r in runs if r.setting == setting), key=lambda r: r.seed)
        cells = {}
        for metric in metrics:
            found = [r.values[metric] for r in members if metric in r.values]
            if not found:
                continue
            values = np.array([v for v, _ in found], dtype=np.float64)
            std = float(values.std(ddof=1)) if len(values) > 1 else math.nan
            cells[metric] = Cell(float(values.mean()), std, len(values), tuple(s for _, s in found),
                                 tuple(float(v) for v in values))  # fmt: skip
        rows.append((setting, [r.seed for r in members], cells))
    return Table(title, at, list(metrics), rows, left_out)


SUITE_CHILD = re.compile(r"^(?P<setting>.+)/seed(?P<seed>-?\d+)$")
SWEEP_CHILD = re.compile(r"^.+?/t\d{3,} (?P<setting>.+) seed=(?P<seed>-?\d+)$")


def setting_of(run_name: str) -> str:
    """The setting of a suite child (`name/seedN`, or `name` without seeds) or sweep trial
    (`sweep/t003 rho=0.1 seed=1`)."""
    for pattern in (SWEEP_CHILD, SUITE_CHILD):
        found = pattern.match(run_name)
        if found:
            return found["setting"]
    return run_name


def fetch_runs(tracking_uri: str, target: str, metrics: list[str], at: At) -> tuple[str, list[RunValues], int]:
    """(title, the finished runs' values, how many unfinished runs were left out) of a suite's or sweep's
    parent run id, or of an experiment name (its top-level runs, one row per configuration but the seed)."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    from raysim.tracking.credentials import connect_uri, redact

    client = MlflowClient(connect_uri(tracking_uri))
    try:
        parent = client.get_run(target)
    except MlflowException:
        parent = None
    if parent is not None:
        title = parent.data.tags.get("suite") or parent.data.tags.get("sweep") or parent.info.run_name
        runs = client.search_runs(
            [parent.info.experiment_id], f"tags.mlflow.parentRunId = '{target}'", max_results=50000,
            order_by=["attributes.start_time ASC"],
        )  # fmt: skip
        if not runs:
            raise TableError(f"run {target} has no child runs: give the parent run of a suite or sweep")
        labels = {run.info.run_id: setting_of(run.info.run_name or "") for run in runs}
    else:
        experiment = client.get_experiment_by_name(target)
        if experiment is None:
            raise TableError(f"{target}: neither a run id nor an experiment name in {redact(tracking_uri)}")
        title = target
        runs = [
            run
            for run in client.search_runs([experiment.experiment_id], max_results=50000,
                                          order_by=["attributes.start_time ASC"])  # fmt: skip
            if "mlflow.parentRunId" not in run.data.tags and not {"suite", "sweep"} & set(run.data.tags)
        ]
        labels = _labels_by_configuration(runs)
    finished = [run for run in runs if run.info.status == "FINISHED"]
    if not finished:
        raise TableError(f"{target}: no finished run to tabulate ({len(runs)} unfinished)")
    logged = set().union(*(run.data.metrics for run in finished))
    for metric in metrics:
        if metric not in logged:
            close = difflib.get_close_matches(metric, sorted(logged), n=3, cutoff=0.5)
            hint = f"; close: {', '.join(close)}" if close else ""
            raise TableError(f"metric {metric!r} is not logged by any run of {target}{hint}")
    values = []
    for run in finished:
        picked = {}
        for metric in metrics:
            history = [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, metric)]
            if history:
                picked[metric] = pick(history, at, metric)
        seed = int(run.data.params.get("seed", 0))
        values.append(RunValues(labels[run.info.run_id], seed, run.info.run_id, picked))
    return title, values, len(runs) - len(finished)


def _labels_by_configuration(runs: list[Any]) -> dict[str, str]:
    """A label per run of an experiment: the parameters that differ between its configurations (seed and
    tracking aside), e.g. `algorithm.name=flame, partition.q=2`; the algorithm's name if there is one
    configuration (all runs then make one row)."""

    def configuration(run) -> dict[str, str]:
        return {k: v for k, v in run.data.params.items() if k != "seed" and not k.startswith("tracking.")}

    configs = [configuration(run) for run in runs]
    keys = sorted({k for c in configs for k in c})
    differing = [k for k in keys if len({c.get(k) for c in configs}) > 1]
    if not differing:
        return {run.info.run_id: run.data.params.get("algorithm.name", "runs") for run in runs}
    return {
        run.info.run_id: ", ".join(f"{k}={c.get(k, '-')}" for k in differing)
        for run, c in zip(runs, configs, strict=True)
    }


def make_table(
    tracking_uri: str, target: str, metrics: list[str] | None = None, at: At = "final"
) -> Table:
    """The table of a parent run id or an experiment name (see the module docstring)."""
    chosen = list(metrics or DEFAULT_METRICS)
    title, runs, left_out = fetch_runs(tracking_uri, target, chosen, at)
    return build_table(runs, chosen, at, title, left_out)


def write_tables(tracking_uri: str, parent: str, folder: Path, metrics: list[str] | None = None) -> list[Path]:
    """table_{final,best}.{md,csv,tex} of a finished suite or sweep, written into `folder` (to log on its parent)."""
    written = []
    for at in ("final", "best"):
        table = make_table(tracking_uri, parent, metrics, at)  # type: ignore[arg-type]
        for form, suffix in FORMATS.items():
            path = folder / f"table_{at}.{suffix}"
            path.write_text(table.render(form))  # type: ignore[arg-type]
            written.append(path)
    return written
