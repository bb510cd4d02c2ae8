"""Result tables as papers print them: one row per setting of a suite or sweep (or per configuration of an
experiment's runs), one column per metric, each cell the mean +/- sample std over the setting's seeds at the final
round or at each run's best round (with the rounds): the round where one metric (`best_by`, default pm/acc)
peaks, every metric taken at that round, as a paper reports a model at its best accuracy (a metric's own best
would take the variances at round 0, before any training).

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from raysim.errors import RaysimError

if TYPE_CHECKING:
    from mlflow.entities import Run

At = Literal["final", "best"]
Format = Literal["markdown", "csv", "latex"]
DEFAULT_METRICS = ("pm/acc", "gm/acc", "hm/acc")
DEFAULT_BEST_BY = "pm/acc"
FORMATS: dict[Format, str] = {"markdown": "md", "csv": "csv", "latex": "tex"}


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
    best_by: str = DEFAULT_BEST_BY
    """With `at` = best: the metric whose best round each run's values are taken at."""
    left_out: list[str] = field(default_factory=list)
    """The runs that did not finish (not in the table), as `name (STATUS)`."""

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
            f"**{self.title}**: {self.caption()}",
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
        out.write(f"# {self.title}: {self.caption()}\n")  # read with e.g. pandas.read_csv(path, skiprows=1)
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
            f"% {self.title}: " + self.caption().replace("±", r"\pm"),
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

    def caption(self) -> str:
        """Which round the values come from, what a cell is, and which runs are left out."""
        if self.at == "best":
            direction = "lowest" if lower_is_better(self.best_by) else "highest"
            when = f"each run's best round by {self.best_by} (its {direction}), every metric at that round"
        else:
            when = "final round"
        text = f"{when}; mean ± sample std over seeds"
        if self.left_out:
            text += f"; left out, not finished: {listed(self.left_out)}"
        return text


def listed(names: list[str], limit: int = 10) -> str:
    """Names as one comma-separated line, at most `limit` of them and how many more."""
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _latex_escape(text: str) -> str:
    return re.sub(r"([&%$#_{}])", r"\\\1", text).replace("±", r"$\pm$")


def lower_is_better(metric: str) -> bool:
    """Losses, variances, spreads and lagging shares are best when smallest; everything else when largest."""
    name = metric.rsplit("/", 1)[-1]
    return "loss" in name or name.endswith(("_var", "_std")) or name in ("lagging_share",)


def final_value(history: list[tuple[int, float]]) -> tuple[float, int]:
    """(value, round) of a metric history at its last round."""
    step, value = max(history)
    return value, step


def best_round(history: list[tuple[int, float]], metric: str) -> int:
    """The round at which a metric history is best: highest, or lowest for losses, variances and spreads
    (`lower_is_better`); the earliest on ties."""
    chooser = min if lower_is_better(metric) else max
    best = chooser(value for _, value in history)
    return min(step for step, value in history if value == best)


def value_at(history: list[tuple[int, float]], step: int) -> tuple[float, int] | None:
    """(value, round) of a metric history at `step`, or, not logged then, at the last round before it; None if it
    was first logged after `step`."""
    earlier = [(s, v) for s, v in history if s <= step]
    if not earlier:
        return None
    found, value = max(earlier)
    return value, found


def build_table(
    runs: list[RunValues],
    metrics: list[str],
    at: At,
    title: str,
    left_out: list[str] | None = None,
    best_by: str = DEFAULT_BEST_BY,
) -> Table:
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
    return Table(title, at, list(metrics), rows, best_by, list(left_out or []))


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


def fetch_runs(
    tracking_uri: str, target: str, metrics: list[str], at: At, best_by: str = DEFAULT_BEST_BY
) -> tuple[str, list[RunValues], list[str]]:
    """(title, the finished runs' values, the unfinished runs left out as `name (STATUS)`) of a suite's or sweep's
    parent run id, or of an experiment name (its top-level runs, one row per configuration but the seed)."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    from raysim.credentials import connect_uri, redact

    client = MlflowClient(connect_uri(tracking_uri))
    try:
        parent = client.get_run(target)
    except MlflowException:
        parent = None
    studies: list[Run] = []
    runs: list[Run]
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
        top_level = [
            run
            for run in client.search_runs(
                [experiment.experiment_id], max_results=50000, order_by=["attributes.start_time ASC"]
            )  # fmt: skip
            if "mlflow.parentRunId" not in run.data.tags
        ]
        studies = [run for run in top_level if {"suite", "sweep"} & set(run.data.tags)]
        runs = [run for run in top_level if run not in studies]
        labels = _labels_by_configuration(runs)
    finished = [run for run in runs if run.info.status == "FINISHED"]
    if not finished:
        raise TableError(f"{target}: no finished run to tabulate ({len(runs)} unfinished){_studies_hint(studies)}")
    logged = set().union(*(run.data.metrics for run in finished))
    for metric in [*metrics, *([best_by] if at == "best" else [])]:
        if metric not in logged:
            close = difflib.get_close_matches(metric, sorted(logged), n=3, cutoff=0.5)
            hint = f"; close: {', '.join(close)}" if close else ""
            raise TableError(f"metric {metric!r} is not logged by any run of {target}{hint}")
    values = []
    for run in finished:
        histories = {metric: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, metric)]
                     for metric in dict.fromkeys([*metrics, best_by])}  # fmt: skip
        if at == "final":
            picked = {metric: final_value(histories[metric]) for metric in metrics if histories[metric]}
        elif histories[best_by]:
            step = best_round(histories[best_by], best_by)
            found = {metric: value_at(histories[metric], step) for metric in metrics}
            picked = {metric: value for metric, value in found.items() if value is not None}
        else:
            picked = {}
        seed = int(run.data.params.get("seed", 0))
        values.append(RunValues(labels[run.info.run_id], seed, run.info.run_id, picked))
    left_out = [f"{run.info.run_name} ({run.info.status})" for run in runs if run.info.status != "FINISHED"]
    return title, values, left_out


def _studies_hint(studies: list[Any]) -> str:
    """Where an experiment's results are when it holds only suites and sweeps: their parent runs, which
    `raysim table PARENT_RUN` tabulates (newest first)."""
    if not studies:
        return ""
    shown = [
        f"`raysim table {run.info.run_id}` ({'suite' if 'suite' in run.data.tags else 'sweep'} "
        f"{run.data.tags.get('suite') or run.data.tags.get('sweep')!r}, {run.info.status})"
        for run in reversed(studies[-5:])
    ]
    more = f" and {len(studies) - 5} older" if len(studies) > 5 else ""
    return f"; its suites and sweeps are tabulated by their parent runs: {', '.join(shown)}{more}"


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
    tracking_uri: str,
    target: str,
    metrics: list[str] | None = None,
    at: At = "final",
    best_by: str = DEFAULT_BEST_BY,
) -> Table:
    """The table of a parent run id or an experiment name (see the module docstring)."""
    chosen = list(metrics or DEFAULT_METRICS)
    title, runs, left_out = fetch_runs(tracking_uri, target, chosen, at, best_by)
    return build_table(runs, chosen, at, title, left_out, best_by)


def write_tables(tracking_uri: str, parent: str, folder: Path, metrics: list[str] | None = None) -> list[Path]:
    """table_{final,best}.{md,csv,tex} of a finished suite or sweep, written into `folder` (to log on its parent)."""
    written = []
    for at in ("final", "best"):
        table = make_table(tracking_uri, parent, metrics, at)
        for form, suffix in FORMATS.items():
            path = folder / f"table_{at}.{suffix}"
            path.write_text(table.render(form))
            written.append(path)
    return written
