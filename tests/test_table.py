"""`raysim table`: the table a paper prints from a suite or sweep, checked against the children's own numbers."""

from __future__ import annotations

import csv
import math

import numpy as np
import pytest
import yaml
from mlflow.tracking import MlflowClient

from raysim.cli import main
from raysim.studies.table import (
    Format,
    RunValues,
    TableError,
    best_round,
    build_table,
    final_value,
    make_table,
    setting_of,
    value_at,
)
from tests.conftest import tiny_config


def test_the_final_value_and_the_best_round_by_the_metrics_direction():
    history = [(2, 0.5), (0, 0.1), (1, 0.7), (3, 0.7)]
    assert final_value(history) == (0.7, 3)
    assert best_round(history, "pm/acc") == 1  # the earliest best round
    assert best_round(history, "pm/loss") == 0
    assert best_round(history, "gm/loss_sum_var") == 0
    sparse = [(0, 2.0), (4, 1.0), (8, 0.5)]  # e.g. a metric logged every 4th round
    assert value_at(sparse, 4) == (1.0, 4) and value_at(sparse, 6) == (1.0, 4) and value_at([(3, 1.0)], 2) is None


def test_setting_names_of_suite_children_and_sweep_trials():
    assert setting_of("flame/q2/seed10") == "flame/q2"
    assert setting_of("fedavg") == "fedavg"
    assert setting_of("flame-rho/t003 rho=0.1,lr=0.01 seed=2") == "rho=0.1,lr=0.01"


def test_a_table_by_hand_in_three_formats():
    runs = [
        RunValues("flame/q2", 1, "a", {"pm/acc": (0.90, 40), "gm/acc": (0.50, 40)}),
        RunValues("flame/q2", 10, "b", {"pm/acc": (0.94, 38), "gm/acc": (0.54, 40)}),
        RunValues("ditto_q2", 1, "c", {"pm/acc": (0.80, 12), "gm/acc": (0.30, 40)}),
    ]
    table = build_table(runs, ["pm/acc", "gm/acc"], "best", "paper", ["ditto_q2/seed10 (FAILED)"])
    (setting, seeds, cells), (other, _, single) = table.rows
    assert (setting, seeds) == ("flame/q2", [1, 10]) and other == "ditto_q2"
    assert cells["pm/acc"].mean == pytest.approx(0.92)
    assert cells["pm/acc"].std == pytest.approx(np.std([0.9, 0.94], ddof=1))
    assert math.isnan(single["pm/acc"].std) and single["pm/acc"].n == 1

    caption = (
        "each run's best round by pm/acc (its highest), every metric at that round; mean ± sample std over "
        "seeds; left out, not finished: ditto_q2/seed10 (FAILED)"
    )
    markdown = table.render("markdown")
    assert markdown.splitlines()[0] == f"**paper**: {caption}"
    assert "| setting | seeds | pm/acc | gm/acc |" in markdown
    assert "| flame/q2 | 2 | 0.9200 ± 0.0283 (r 38-40) | 0.5200 ± 0.0283 (r 40) |" in markdown
    assert "| ditto_q2 | 1 | 0.8000 (r 12) | 0.3000 (r 40) |" in markdown

    caption_line, *lines = table.render("csv").splitlines()
    assert caption_line == f"# paper: {caption}"
    rows = list(csv.DictReader(lines))
    assert rows[0]["setting"] == "flame/q2" and rows[0]["seeds"] == "1;10"
    assert float(rows[0]["pm/acc mean"]) == pytest.approx(0.92) and rows[0]["pm/acc rounds"] == "40;38"
    assert rows[1]["pm/acc std"] == "" and rows[1]["pm/acc values"] == "0.8"

    latex = table.render("latex")
    assert latex.splitlines()[0] == f"% paper: {caption.replace('±', chr(92) + 'pm')}"
    assert "\\begin{tabular}{l r c c }" in latex and "\\end{tabular}" in latex
    assert "flame/q2 & 2 & $0.9200 \\pm 0.0283$ (r 38-40)" in latex
    assert "ditto\\_q2 & 1 & $0.8000$ (r 12)" in latex and "pm/acc & gm/acc \\\\" in latex


@pytest.fixture(scope="module")
def finished_suite(tmp_path_factory, ray_local):
    """A real suite: 2 members x 2 seeds, 3 rounds each, through `raysim run`; (tracking URI, parent run id)."""
    folder = tmp_path_factory.mktemp("suite")
    uri = f"sqlite:///{folder / 'mlflow.db'}"
    base = tiny_config(rounds=3, tracking={"uri": uri, "experiment": "table"})
    suite = {
        "name": "tiny",
        "base": base,
        "seeds": [1, 2],
        "runs": [
            {"name": "flame", "set": {}},
            {"name": "fedavg", "set": {"algorithm": {"name": "fedavg", "lr": 0.05, "batch_size": 32}}},
        ],
    }
    path = folder / "suite.yaml"
    path.write_text(yaml.safe_dump(suite))
    assert main(["run", str(path), "--quiet"]) == 0
    client = MlflowClient(uri)
    (parent,) = [r for r in client.search_runs([client.get_experiment_by_name("table").experiment_id])
                 if r.data.tags.get("suite") == "tiny"]  # fmt: skip
    return uri, parent.info.run_id


def _children(uri: str, parent: str) -> dict[str, list]:
    client = MlflowClient(uri)
    runs = client.search_runs([client.get_run(parent).info.experiment_id], f"tags.mlflow.parentRunId = '{parent}'")
    grouped: dict[str, list] = {}
    for run in runs:
        grouped.setdefault(run.info.run_name.rsplit("/seed", 1)[0], []).append(run)
    return {setting: sorted(runs, key=lambda r: int(r.data.params["seed"])) for setting, runs in grouped.items()}


@pytest.mark.slow
@pytest.mark.parametrize("at", ["final", "best"])
def test_the_table_of_a_real_suite_reproduces_its_childrens_numbers(finished_suite, at, capsys):
    uri, parent = finished_suite
    client = MlflowClient(uri)
    table = make_table(uri, parent, ["pm/acc", "gm/loss"], at)
    assert [row[0] for row in table.rows] == ["flame", "fedavg"] and table.title == "tiny"
    for setting, runs in _children(uri, parent).items():
        assert len(runs) == 2
        cells = dict((row[0], row[2]) for row in table.rows)[setting]
        for metric in ("pm/acc", "gm/loss"):
            histories = [{m.step: m.value for m in client.get_metric_history(r.info.run_id, metric)} for r in runs]
            if at == "final":
                rounds = [max(h) for h in histories]
            else:  # every metric at the round of the run's highest pm/acc (the earliest of equal ones)
                accuracy = [client.get_metric_history(r.info.run_id, "pm/acc") for r in runs]
                rounds = [min((-m.value, m.step) for m in h)[1] for h in accuracy]
            values = [h[r] for h, r in zip(histories, rounds, strict=True)]
            assert cells[metric].mean == np.mean(values) and cells[metric].rounds == tuple(rounds)
            assert cells[metric].std == np.std(values, ddof=1)
    assert main(["table", parent, "--tracking-uri", uri, "--at", at, "--metrics", "pm/acc", "gm/loss"]) == 0
    assert capsys.readouterr().out == table.render("markdown")


@pytest.mark.slow
def test_best_by_picks_the_round_of_another_metric_and_says_so(finished_suite, capsys):
    """--best-by gm/loss: every metric at the round of each run's lowest GM loss, said in every format's caption;
    --best-by without --at best is refused in one line."""
    uri, parent = finished_suite
    client = MlflowClient(uri)
    table = make_table(uri, parent, ["pm/acc", "pm/loss_var"], "best", "gm/loss")
    for setting, runs in _children(uri, parent).items():
        cells = dict((row[0], row[2]) for row in table.rows)[setting]
        rounds = [min((m.value, m.step) for m in client.get_metric_history(r.info.run_id, "gm/loss"))[1] for r in runs]
        assert cells["pm/loss_var"].rounds == cells["pm/acc"].rounds == tuple(rounds)
        variance = [{m.step: m.value for m in client.get_metric_history(r.info.run_id, "pm/loss_var")} for r in runs]
        assert cells["pm/loss_var"].values == tuple(v[r] for v, r in zip(variance, rounds, strict=True))
    said = "each run's best round by gm/loss (its lowest), every metric at that round"
    for form in ("markdown", "csv", "latex"):
        assert said in table.render(form).splitlines()[0]
    assert main(["table", parent, "--tracking-uri", uri, "--best-by", "gm/loss"]) == 2
    error = capsys.readouterr().err
    assert error == "error: --best-by needs --at best (with --at final every value is the last round's)\n"


@pytest.mark.slow
def test_the_suite_logs_its_tables_on_the_parent_and_the_cli_writes_each_format(finished_suite, tmp_path):
    uri, parent = finished_suite
    logged = {a.path for a in MlflowClient(uri).list_artifacts(parent)}
    assert {f"table_{at}.{suffix}" for at in ("final", "best") for suffix in ("md", "csv", "tex")} <= logged
    forms: tuple[tuple[Format, str], ...] = (("csv", "csv"), ("latex", "tex"))
    for form, suffix in forms:
        out = tmp_path / f"t.{suffix}"
        assert main(["table", parent, "--tracking-uri", uri, "--format", form, "--out", str(out)]) == 0
        assert out.read_text() == make_table(uri, parent).render(form)


@pytest.mark.slow
def test_an_experiment_name_tabulates_its_top_level_runs_and_bad_targets_are_one_line(finished_suite):
    uri, parent = finished_suite
    with pytest.raises(TableError) as only_studies:
        make_table(uri, "table")  # only the suite's parent and children live there
    assert str(only_studies.value) == (
        f"table: no finished run to tabulate (0 unfinished); its suites and sweeps are tabulated by their parent "
        f"runs: `raysim table {parent}` (suite 'tiny', FINISHED)"
    )
    with pytest.raises(TableError, match=r"metric 'pm/accuracy' is not logged by any run of .*; close: .*pm/acc,"):
        make_table(uri, parent, ["pm/accuracy"])
    with pytest.raises(TableError, match="neither a run id nor an experiment name"):
        make_table(uri, "no-such-thing")
    child = _children(uri, parent)["flame"][0].info.run_id
    with pytest.raises(TableError, match="has no child runs"):
        make_table(uri, child)
