"""Result tables as papers print them: one row per setting of a suite or sweep (or per configuration of an
experiment's runs), one column per metric, each cell the mean +/- std over the setting's seeds (sample std, or the
population std FedAPM's code takes with `np.std`) of one value per seed: at the final round, at each run's best
round (with the rounds: the round where one metric, `best_by`, default pm/acc, peaks, every metric taken at that
round, as a paper reports a model at its best accuracy; a metric's own best would take the variances at round 0,
before any training), or each metric's own max (or min) over the trained rounds, as FedAPM's authors aggregate
(their code). Optional columns give the rounds each seed needs to reach a target, e.g. `pm/train_loss<=0.5`
(FedAPM's "communication rounds", Sec. 6.1).

The numbers are read back from MLflow, the same metric histories the UI plots, so a table can be made for any
finished suite or sweep (`raysim table PARENT_RUN`) and is also logged on the parent run when it finishes
(`table_final.*`, `table_best.*`). `build_table` is pure and does the arithmetic; `fetch_runs` reads the store.
"""

from __future__ import annotations

import csv
import difflib
import io
import math
import operator
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from raysim.errors import RaysimError

if TYPE_CHECKING:
    from mlflow.entities import Run

At = Literal["final", "best"]
Std = Literal["sample", "population"]
OverRounds = Literal["final", "max", "min"]
Format = Literal["markdown", "csv", "latex"]
DEFAULT_METRICS = ("pm/acc", "gm/acc", "hm/acc")
DEFAULT_BEST_BY = "pm/acc"
FORMATS: dict[Format, str] = {"markdown": "md", "csv": "csv", "latex": "tex"}


class TableError(RaysimError):
    """A table cannot be made: an unknown run or experiment, or a metric no run logged."""


COMPARISONS: dict[str, Callable[[float, float], bool]] = {
    "<=": operator.le,
    ">=": operator.ge,
    "<": operator.lt,
    ">": operator.gt,
}
TARGET = re.compile(
    r"^(?P<metric>[^\s<>=]+)\s*(?P<op><=|>=|<|>)\s*(?P<value>[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)$"
)


@dataclass(frozen=True)
class Target:
    """A level a metric's curve must reach, `pm/train_loss<=0.5`: the rounds to reach it are FedAPM's
    communication efficiency (FedAPM, Sec. 6.1, "rounds needed to reach a given training loss")."""

    metric: str
    comparison: str
    """One of COMPARISONS: <=, >=, < or >."""
    threshold: float
    text: str
    """As given, without blanks: the column's name is `rounds to TEXT`."""

    @property
    def label(self) -> str:
        return f"rounds to {self.text}"

    def first_round(self, history: list[tuple[int, float]]) -> int | None:
        """The first logged round at which the metric meets the target (round 0: before any training); None if
        it never does (a NaN never meets it)."""
        meets = COMPARISONS[self.comparison]
        return next((step for step, value in sorted(history) if meets(value, self.threshold)), None)


def parse_target(text: str) -> Target:
    """`METRIC<=VALUE` (or >=, <, >) as a Target; anything else is refused in one line naming --rounds-to."""
    found = TARGET.match(text.strip())
    if not found:
        raise TableError(
            f"--rounds-to {text!r}: expected METRIC<=VALUE, METRIC>=VALUE, METRIC<VALUE or METRIC>VALUE with a "
            "number as VALUE, e.g. 'pm/train_loss<=0.5'"
        )
    metric, comparison, value = found["metric"], found["op"], found["value"]
    return Target(metric, comparison, float(value), f"{metric}{comparison}{value}")


@dataclass(frozen=True)
class Reach:
    """When one run first met a Target: its round (None: never), and the last round the metric was logged."""

    first: int | None
    last: int


@dataclass(frozen=True)
class RunValues:
    """One finished run: its setting (the table row), seed, per metric (value, round) at final or best round or
    at its max or min over rounds, and per Target label when it was reached."""

    setting: str
    seed: int
    run_id: str
    values: dict[str, tuple[float, int]]
    reached: dict[str, Reach] = field(default_factory=dict)
    last_round: int | None = None
    """The last round any of its fetched metrics was logged at (None: not known, e.g. a table built by hand)."""


@dataclass(frozen=True)
class Cell:
    mean: float
    std: float
    """Standard deviation over the seeds: sample (NaN for one seed) or population (`np.std`), as Table.std."""
    n: int
    rounds: tuple[int, ...]
    """The round each seed's value comes from (the best round with `--at best`, the max's or min's round with
    `--over-rounds max|min`)."""
    values: tuple[float, ...]


@dataclass(frozen=True)
class ReachCell:
    """The rounds a setting's seeds need to reach a Target: mean +/- std over the seeds that reach it."""

    mean: float
    """NaN if no seed reaches it."""
    std: float
    rounds: tuple[int | None, ...]
    """Per seed (in seed order) its first round at the target, None if it never gets there."""
    lasts: tuple[int, ...]
    """Per seed the last round its metric was logged: one that never reaches the target needs more."""

    @property
    def missed(self) -> list[int]:
        """The last rounds of the seeds that never reach the target."""
        return [last for first, last in zip(self.rounds, self.lasts, strict=True) if first is None]

    def per_seed(self) -> list[str]:
        """Each seed's round, `>T` for a seed that does not reach the target by its last round T."""
        pairs = zip(self.rounds, self.lasts, strict=True)
        return [str(first) if first is not None else f">{last}" for first, last in pairs]


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
    std: Std = "sample"
    over_rounds: OverRounds = "final"
    """With `at` = final: each seed's value is the final round's, or each metric's own max or min over rounds."""
    targets: list[Target] = field(default_factory=list)
    reach: dict[str, dict[str, ReachCell]] = field(default_factory=dict)
    """setting -> Target label -> the rounds its seeds need to reach the target (a column after the metrics)."""
    last_rounds: list[int] = field(default_factory=list)
    """The last round each run logged (the LaTeX caption names the rounds the runs ran)."""

    def render(self, form: Format) -> str:
        return {"markdown": self.markdown, "csv": self.csv, "latex": self.latex}[form]()

    def _text(self, cell: Cell | None, latex: bool = False) -> str:
        if cell is None or cell.n == 0:
            return "-"
        pm = r" \pm " if latex else " ± "
        text = f"{cell.mean:.4f}" + ("" if math.isnan(cell.std) else f"{pm}{cell.std:.4f}")
        text = f"${text}$" if latex else text
        if self.at == "best" or self.over_rounds != "final":
            low, high = min(cell.rounds), max(cell.rounds)
            text += f" (r {low})" if low == high else f" (r {low}-{high})"
        return text

    def _reach_text(self, cell: ReachCell | None, latex: bool = False) -> str:
        """`12.5 ± 2.1`; `12.0 (1 of 3 seeds >40)` when some seeds never reach the target by their last round
        (the smallest of those rounds is shown); `>40 (3 of 3 seeds)` when none does."""
        if cell is None:
            return "-"
        more = r"$>$" if latex else ">"
        missed, n = cell.missed, len(cell.rounds)
        if len(missed) == n:
            return f"{more}{min(missed)} ({n} of {n} seeds)"
        pm = r" \pm " if latex else " ± "
        text = f"{cell.mean:.1f}" + ("" if math.isnan(cell.std) else f"{pm}{cell.std:.1f}")
        text = f"${text}$" if latex else text
        return text + (f" ({len(missed)} of {n} seeds {more}{min(missed)})" if missed else "")

    def _shown(self, setting: str, cells: dict[str, Cell], latex: bool = False) -> list[str]:
        """A row's cells as text: the metrics', then the targets'."""
        reach = self.reach.get(setting, {})
        return [self._text(cells.get(m), latex) for m in self.metrics] + [
            self._reach_text(reach.get(t.label), latex) for t in self.targets
        ]

    def markdown(self) -> str:
        head = ["setting", "seeds", *self.metrics, *(t.label for t in self.targets)]
        lines = [
            f"**{self.title}**: {self.caption()}",
            "",
            "| " + " | ".join(head) + " |",
            "|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|",
        ]
        for setting, seeds, cells in self.rows:
            shown = self._shown(setting, cells)
            lines.append("| " + " | ".join([setting.replace("|", "\\|"), str(len(seeds)), *shown]) + " |")
        return "\n".join(lines) + "\n"

    def csv(self) -> str:
        out = io.StringIO()
        out.write(f"# {self.title}: {self.caption()}\n")  # read with e.g. pandas.read_csv(path, skiprows=1)
        writer = csv.writer(out, lineterminator="\n")
        columns = ["setting", "seeds"]
        for metric in self.metrics:
            columns += [f"{metric} mean", f"{metric} std", f"{metric} n", f"{metric} rounds", f"{metric} values"]
        for target in self.targets:
            columns += [
                f"{target.label} mean",
                f"{target.label} std",
                f"{target.label} reached",
                f"{target.label} rounds",
            ]
        writer.writerow(columns)
        for setting, seeds, cells in self.rows:
            row: list[Any] = [setting, ";".join(map(str, seeds))]
            for metric in self.metrics:
                cell = cells.get(metric)
                if cell is None:
                    row += ["", "", 0, "", ""]
                    continue
                std = "" if math.isnan(cell.std) else repr(cell.std)
                row += [repr(cell.mean), std, cell.n, ";".join(map(str, cell.rounds)), ";".join(map(repr, cell.values))]
            for target in self.targets:
                reach = self.reach.get(setting, {}).get(target.label)
                if reach is None:
                    row += ["", "", 0, ""]
                    continue
                row += [
                    _number(reach.mean),
                    _number(reach.std),
                    len(reach.rounds) - len(reach.missed),
                    ";".join(reach.per_seed()),
                ]
            writer.writerow(row)
        return out.getvalue()

    def latex(self) -> str:
        """A `table` float a paper can `\\input` (preamble: booktabs and graphicx): readable headers
        (`column_label`), booktabs rules, the best mean of each column in bold (`best_rows`), a caption naming the
        rounds and seeds, and a label from the title. A table wider than the text (many columns) is scaled down to
        the text's width; a narrower one is left at its size."""
        columns = [*self.metrics, *(t.label for t in self.targets)]
        headers = [*(column_label(m) for m in self.metrics), *(_latex_escape(t.label) for t in self.targets)]
        bold = {column: self.best_rows(column) for column in columns}
        lines = [
            "% " + _latex_escape(f"{self.title}: {self.caption()}"),
            "\\begin{table}[htbp]",
            "\\centering",
            f"\\caption{{{_latex_escape(self.paper_caption())}}}",
            f"\\label{{tab:{_slug(self.title)}}}",
            "\\sbox0{%",
            "\\begin{tabular}{lr" + "c" * len(columns) + "}",
            "\\toprule",
            " & ".join(["Setting", "Seeds", *headers]) + " \\\\",
            "\\midrule",
        ]
        for setting, seeds, cells in self.rows:
            shown = self._shown(setting, cells, latex=True)
            shown = [
                _bold(text) if setting in bold[column] else text for column, text in zip(columns, shown, strict=True)
            ]
            lines.append(" & ".join([_latex_escape(setting), str(len(seeds)), *shown]) + " \\\\")
        lines += [
            "\\bottomrule",
            "\\end{tabular}}",
            "\\ifdim\\wd0>\\linewidth\\resizebox{\\linewidth}{!}{\\usebox0}\\else\\usebox0\\fi",
            "\\end{table}",
        ]
        return "\n".join(lines) + "\n"

    def best_rows(self, column: str) -> set[str]:
        """The settings whose mean in a column (a metric, or a target's rounds) is best as shown (4 decimals, 1
        for rounds): highest, or lowest for losses, variances, times, traffic and rounds to a target
        (`lower_is_better`); empty with fewer than two settings to compare."""
        target = next((t for t in self.targets if t.label == column), None)
        means: dict[str, float] = {}
        for setting, _, cells in self.rows:
            cell: Cell | ReachCell | None = self.reach.get(setting, {}).get(column) if target else cells.get(column)
            if cell is not None and not math.isnan(cell.mean):
                means[setting] = round(cell.mean, 1 if target else 4)
        if len(means) < 2:
            return set()
        best = (min if target or lower_is_better(column) else max)(means.values())
        return {setting for setting, mean in means.items() if mean == best}

    def paper_caption(self) -> str:
        """The LaTeX caption: title, the rounds the runs ran and the seeds, then `caption`."""
        seeds = sorted({seed for _, row_seeds, _ in self.rows for seed in row_seeds})
        same = all(sorted(row_seeds) == seeds for _, row_seeds, _ in self.rows)
        seeds_text = f"seed{'s' if len(seeds) > 1 else ''} {listed([str(s) for s in seeds])}" + (
            "" if same else " (column Seeds: how many each setting has)"
        )
        lasts = sorted(set(self.last_rounds))
        rounds_text = (
            f"{lasts[0]} rounds" if len(lasts) == 1 else f"{lasts[0]} to {lasts[-1]} rounds" if lasts else "runs"
        )
        return (
            f"{self.title}: {rounds_text}, {seeds_text}. Values: {self.caption()}; the best mean of each column in "
            "bold."
        )

    def caption(self) -> str:
        """Which round the values come from, what a cell is (which std), and which runs are left out."""
        if self.at == "best":
            direction = "lowest" if lower_is_better(self.best_by) else "highest"
            when = f"each run's best round by {self.best_by} (its {direction}), every metric at that round"
        elif self.over_rounds != "final":
            when = f"each run's {self.over_rounds} over rounds 1 to its last of every metric"
        else:
            when = "final round"
        spread = "population std (np.std)" if self.std == "population" else "sample std"
        text = f"{when}; mean ± {spread} over seeds"
        if self.targets:
            text += (
                "; rounds to a target: the first logged round it is met, mean ± std over the seeds that meet it, "
                ">T: seeds that do not by their last round T"
            )
        if self.left_out:
            text += f"; left out, not finished: {listed(self.left_out)}"
        return text


def listed(names: list[str], limit: int = 10) -> str:
    """Names as one comma-separated line, at most `limit` of them and how many more."""
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


KIND_LABELS = {"pm": "PM", "gm": "GM", "hm": "HM", "personal": "personal", "proto": "prototype"}
"""The model a metric key's first part names (spec: personalized, global and hybrid model)."""
NAME_LABELS = {
    "acc": "acc.",
    "acc_min": "min. acc.",
    "acc_p10": "10th pct. acc.",
    "acc_std": "acc. std",
    "acc_var": "acc. var.",
    "auc": "AUC",
    "best_acc": "best acc.",
    "f1": "F1",
    "lagging_share": "lagging share",
    "loss": "loss",
    "loss_std": "loss std",
    "loss_var": "loss var.",
    "loss_sum_var": "summed loss var.",
    "train_loss": "train loss",
}
"""Readable names of the per-model metrics raysim logs (raysim.evaluation)."""
TIME_PREFIXES = ("time/", "traffic/")
"""Metric groups (seconds, bytes) that are best when smallest."""


def column_label(metric: str) -> str:
    """A LaTeX column header for a metric key: `pm/acc` -> `PM acc.`, `time/round` -> `time: round`; a key outside
    the known ones as it is (escaped)."""
    kind, _, name = metric.partition("/")
    if kind in KIND_LABELS and name in NAME_LABELS:
        return _latex_escape(f"{KIND_LABELS[kind]} {NAME_LABELS[name]}")
    if name:
        return _latex_escape(f"{KIND_LABELS.get(kind, kind)}: {name.replace('_', ' ')}")
    return _latex_escape(metric)


def _bold(text: str) -> str:
    """A LaTeX cell in bold: the math part with \\mathbf, the rest (a `(r 3)` note) as it is."""
    return re.sub(r"\$(.+?)\$", lambda math_part: f"$\\mathbf{{{math_part[1]}}}$", text, count=1)


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-").lower() or "results"


def _latex_escape(text: str) -> str:
    escaped = re.sub(r"([&%$#_{}])", r"\\\1", text).replace("±", r"$\pm$")
    signs = {"<=": r"$\leq$", ">=": r"$\geq$", "<": "$<$", ">": "$>$"}
    return re.sub(r"<=|>=|<|>", lambda sign: signs[sign[0]], escaped)


def _number(value: float) -> str:
    """A CSV number: empty for NaN (no std of one seed, no mean of no seed)."""
    return "" if math.isnan(value) else repr(value)


def spread(values: np.ndarray, std: Std) -> float:
    """The std over seeds: population (`np.std`, ddof 0, as FedAPM's code) or sample (ddof 1; NaN for one)."""
    if std == "population":
        return float(values.std())
    return float(values.std(ddof=1)) if len(values) > 1 else math.nan


def lower_is_better(metric: str) -> bool:
    """Losses, variances, spreads, lagging shares, times and traffic are best when smallest; everything else (accuracy,
    F1, AUC) when largest."""
    name = metric.rsplit("/", 1)[-1]
    return (
        "loss" in name
        or name.endswith(("_var", "_std", "seconds"))
        or name in ("lagging_share",)
        or metric.startswith(TIME_PREFIXES)
    )


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


def extreme_value(history: list[tuple[int, float]], highest: bool) -> tuple[float, int]:
    """(value, round) of a metric history's max (`highest`) or min over the trained rounds (the earliest on ties),
    as FedAPM's code takes each seed's table value: round 0, the evaluation before any training, counts only if
    nothing else was logged; NaN rounds (a diverged run) are passed over unless all are NaN."""
    trained = [(step, value) for step, value in history if step > 0] or history
    finite = [(step, value) for step, value in trained if not math.isnan(value)]
    if not finite:
        return final_value(trained)
    chooser = max if highest else min
    best = chooser(value for _, value in finite)
    return best, min(step for step, value in finite if value == best)


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
    std: Std = "sample",
    over_rounds: OverRounds = "final",
    targets: Sequence[Target] = (),
) -> Table:
    """Group runs by setting (in order of appearance) and average each metric, and each target's rounds, over the
    setting's seeds."""
    settings = list(dict.fromkeys(r.setting for r in runs))
    rows = []
    reach: dict[str, dict[str, ReachCell]] = {}
    for setting in settings:
        members = sorted((r for r in runs if r.setting == setting), key=lambda r: r.seed)
        cells = {}
        for metric in metrics:
            found = [r.values[metric] for r in members if metric in r.values]
            if not found:
                continue
            values = np.array([v for v, _ in found], dtype=np.float64)
            cells[metric] = Cell(
                float(values.mean()),
                spread(values, std),
                len(values),
                tuple(s for _, s in found),
                tuple(float(v) for v in values),
            )
        rows.append((setting, [r.seed for r in members], cells))
        for target in targets:
            reaches = [r.reached[target.label] for r in members if target.label in r.reached]
            if not reaches:
                continue
            met = np.array([r.first for r in reaches if r.first is not None], dtype=np.float64)
            mean = float(met.mean()) if len(met) else math.nan
            std_met = spread(met, std) if len(met) else math.nan
            cell = ReachCell(mean, std_met, tuple(r.first for r in reaches), tuple(r.last for r in reaches))
            reach.setdefault(setting, {})[target.label] = cell
    lasts = [r.last_round for r in runs if r.last_round is not None]
    return Table(
        title, at, list(metrics), rows, best_by, list(left_out or []), std, over_rounds, list(targets), reach, lasts
    )


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


@dataclass(frozen=True)
class RunHistory:
    """One finished child run as read back from the store: its setting (a table row, a figure's line), seed, and
    per metric its history [(round, value)]."""

    setting: str
    seed: int
    run_id: str
    histories: dict[str, list[tuple[int, float]]]
    color: str | None = None
    """Its colour in MLflow's charts (the `mlflow.runColor` tag, `tracking.color`), the one `raysim figure` draws."""


@dataclass(frozen=True)
class StudyRuns:
    """A suite's or sweep's (or an experiment's) finished runs with their metric histories, and the runs left out."""

    title: str
    runs: list[RunHistory]
    left_out: list[str]
    """The unfinished runs, as `name (STATUS)`."""


READ_TIMEOUT_S = 10.0
"""How long `raysim table` and `raysim figure` wait for a tracking server to answer before refusing it."""


def read_runs(tracking_uri: str, target: str, metrics: Sequence[str]) -> StudyRuns:
    """The finished runs of a suite's or sweep's parent run id, or of an experiment name (its top-level runs, one
    setting per configuration but the seed), with the histories of `metrics`; a metric no run logged is refused in
    one line with the close names. `raysim table` and `raysim figure` read the store through this."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    from raysim.credentials import connect_uri, redact
    from raysim.tracking.mlflow_writer import TrackingError, check_reachable, sqlite_file

    check_reachable(connect_uri(tracking_uri), READ_TIMEOUT_S)  # `ftp://` was MLflow's traceback
    database = sqlite_file(tracking_uri)
    if database is not None and not database.is_file():  # MLflow would create an empty store to find nothing in
        raise TrackingError(f"--tracking-uri {redact(tracking_uri)}: no such database file {database}")
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
            [parent.info.experiment_id],
            f"tags.mlflow.parentRunId = '{target}'",
            max_results=50000,
            order_by=["attributes.start_time ASC"],
        )
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
            )
            if "mlflow.parentRunId" not in run.data.tags
        ]
        studies = [run for run in top_level if {"suite", "sweep"} & set(run.data.tags)]
        runs = [run for run in top_level if run not in studies]
        labels = _labels_by_configuration(runs)
    finished = [run for run in runs if run.info.status == "FINISHED"]
    if not finished:
        raise TableError(f"{target}: no finished run to tabulate ({len(runs)} unfinished){_studies_hint(studies)}")
    logged = set().union(*(run.data.metrics for run in finished))
    for metric in metrics:
        if metric not in logged:
            close = difflib.get_close_matches(metric, sorted(logged), n=3, cutoff=0.5)
            hint = f"; close: {', '.join(close)}" if close else ""
            raise TableError(f"metric {metric!r} is not logged by any run of {target}{hint}")
    histories = [
        RunHistory(
            labels[run.info.run_id],
            int(run.data.params.get("seed", 0)),
            run.info.run_id,
            {
                metric: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, metric)]
                for metric in dict.fromkeys(metrics)
            },
            run.data.tags.get("mlflow.runColor"),
        )
        for run in finished
    ]
    left_out = [f"{run.info.run_name} ({run.info.status})" for run in runs if run.info.status != "FINISHED"]
    return StudyRuns(title, histories, left_out)


def fetch_runs(
    tracking_uri: str,
    target: str,
    metrics: list[str],
    at: At,
    best_by: str = DEFAULT_BEST_BY,
    over_rounds: OverRounds = "final",
    targets: Sequence[Target] = (),
) -> tuple[str, list[RunValues], list[str]]:
    """(title, the finished runs' values, the unfinished runs left out as `name (STATUS)`) of a suite's or sweep's
    parent run id, or of an experiment name (its top-level runs, one row per configuration but the seed)."""
    needed = [*metrics, *([best_by] if at == "best" else []), *(t.metric for t in targets)]
    study = read_runs(tracking_uri, target, needed)
    values = []
    for run in study.runs:
        histories = run.histories
        if at == "final" and over_rounds == "final":
            picked = {metric: final_value(histories[metric]) for metric in metrics if histories[metric]}
        elif at == "final":
            highest = over_rounds == "max"
            picked = {metric: extreme_value(histories[metric], highest) for metric in metrics if histories[metric]}
        elif histories[best_by]:
            step = best_round(histories[best_by], best_by)
            found = {metric: value_at(histories[metric], step) for metric in metrics}
            picked = {metric: value for metric, value in found.items() if value is not None}
        else:
            picked = {}
        reached = {
            t.label: Reach(t.first_round(histories[t.metric]), max(histories[t.metric])[0])
            for t in targets
            if histories[t.metric]
        }
        last = max((step for history in histories.values() for step, _ in history), default=None)
        values.append(RunValues(run.setting, run.seed, run.run_id, picked, reached, last))
    return study.title, values, study.left_out


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
    std: Std = "sample",
    over_rounds: OverRounds = "final",
    rounds_to: Sequence[str] = (),
) -> Table:
    """The table of a parent run id or an experiment name (see the module docstring); `rounds_to` are targets as
    `parse_target` reads them (`pm/train_loss<=0.5`), a column each."""
    if at == "best" and over_rounds != "final":
        raise TableError(
            f"--over-rounds {over_rounds} needs --at final: --at best takes every metric at the round where "
            "--best-by peaks, --over-rounds each metric's own max or min"
        )
    targets = list(dict.fromkeys(parse_target(text) for text in rounds_to))
    chosen = list(metrics or DEFAULT_METRICS)
    title, runs, left_out = fetch_runs(tracking_uri, target, chosen, at, best_by, over_rounds, targets)
    return build_table(runs, chosen, at, title, left_out, best_by, std, over_rounds, targets)


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
