"""`raysim table`: the table a paper prints from a suite or sweep, checked against the children's own numbers."""

from __future__ import annotations

import csv
import math

import numpy as np
import pytest

from raysim.cli import main
from raysim.studies.table import (
    RunValues,
    best_round,
    build_table,
    column_label,
    final_value,
    lower_is_better,
    make_table,
    setting_of,
    value_at,
)
from tests.support.table import ACCURACY, HAND_RUNS, TRAIN_LOSS, write_hand_suite

pytestmark = pytest.mark.xdist_group("unit-table")
"""One worker runs this module's tests: its hand-made suite is logged once."""


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
    escaped = caption.replace("±", "$\\pm$").replace("_", "\\_")
    assert latex.splitlines()[0] == f"% paper: {escaped}"
    assert "\\begin{tabular}{lrcc}" in latex and "\\end{tabular}" in latex and "\\end{table}" in latex
    assert "Setting & Seeds & PM acc. & GM acc. \\\\" in latex  # readable headers, not the metric keys
    assert latex.index("\\toprule") < latex.index("\\midrule") < latex.index("\\bottomrule")
    # the best mean of each column in bold: flame/q2 has the higher PM and GM accuracy
    assert "flame/q2 & 2 & $\\mathbf{0.9200 \\pm 0.0283}$ (r 38-40) & $\\mathbf{0.5200 \\pm 0.0283}$ (r 40)" in latex
    assert "ditto\\_q2 & 1 & $0.8000$ (r 12) & $0.3000$ (r 40) \\\\" in latex
    assert "\\label{tab:paper}" in latex
    assert "\\caption{paper: runs, seeds 1, 10 (column Seeds: how many each setting has). Values: each run's" in latex


def test_latex_headers_and_the_direction_of_best_per_key():
    assert [column_label(m) for m in ("pm/acc", "gm/loss_var", "hm/f1", "time/round", "update/dual_norm", "x")] == [
        "PM acc.",
        "GM loss var.",
        "HM F1",
        "time: round",
        "update: dual norm",
        "x",
    ]
    assert not lower_is_better("pm/acc") and not lower_is_better("hm/auc")
    assert lower_is_better("pm/loss") and lower_is_better("gm/acc_std") and lower_is_better("time/round")
    assert lower_is_better("traffic/uplink_bytes") and lower_is_better("server/svd_seconds")
    runs = [
        RunValues(name, 1, name, {"pm/acc": (acc, 5), "pm/loss": (loss, 5), "time/round": (time, 5)}, last_round=5)
        for name, acc, loss, time in (("a", 0.9, 0.5, 2.0), ("b", 0.9, 0.4, 3.0), ("c", 0.8, 0.6, 1.0))
    ]
    table = build_table(runs, ["pm/acc", "pm/loss", "time/round"], "final", "t")
    assert [table.best_rows(m) for m in table.metrics] == [{"a", "b"}, {"b"}, {"c"}]  # ties are all bold
    assert "\\caption{t: 5 rounds, seed 1. Values: final round;" in table.render("latex")


@pytest.fixture(scope="module")
def hand_suite(tmp_path_factory):
    """The hand-written suite (tests/support/table.py): (tracking URI, parent run id)."""
    return write_hand_suite(tmp_path_factory.mktemp("hand"))


def _rows(table) -> dict[str, tuple[list[int], dict]]:
    return {setting: (seeds, cells) for setting, seeds, cells in table.rows}


def test_a_table_of_max_over_rounds_with_population_std_is_numpys(hand_suite):
    uri, parent = hand_suite
    table = make_table(uri, parent, ["pm/acc", "pm/train_loss"], over_rounds="max", std="population")
    sample = make_table(uri, parent, ["pm/acc"], over_rounds="max")
    lowest = make_table(uri, parent, ["pm/train_loss"], over_rounds="min", std="population")
    for setting in ("fedapm", "fedavg"):
        members = [i for i, (name, _) in enumerate(HAND_RUNS) if name == setting]
        trained = ACCURACY[members, 1:]  # rounds 1..6: round 0 is the evaluation before training
        maxima = np.nanmax(trained, axis=1)
        seeds, cells = _rows(table)[setting]
        assert seeds == [HAND_RUNS[i][1] for i in members]
        assert cells["pm/acc"].values == tuple(maxima) and cells["pm/acc"].mean == np.mean(maxima)
        assert cells["pm/acc"].std == np.std(maxima)  # population, as FedAPM's code
        assert cells["pm/acc"].rounds == tuple(np.nanargmax(trained, axis=1) + 1)
        assert _rows(sample)[setting][1]["pm/acc"].std == np.std(maxima, ddof=1)
        minima = np.nanmin(TRAIN_LOSS[members, 1:], axis=1)
        assert _rows(lowest)[setting][1]["pm/train_loss"].values == tuple(minima)
        assert _rows(lowest)[setting][1]["pm/train_loss"].std == np.std(minima)
    assert _rows(table)["fedapm"][1]["pm/acc"].rounds[0] == 2  # the tie at rounds 2 and 5; round 0's 0.99 left out
    assert math.isnan(ACCURACY[4, 3]) and not math.isnan(_rows(table)["fedavg"][1]["pm/acc"].mean)
    assert table.left_out == ["fedavg/seed3 (FAILED)"]
    caption = table.render("markdown").splitlines()[0]
    assert caption == (
        "**hand**: each run's max over rounds 1 to its last of every metric; mean ± population std (np.std) over "
        "seeds; left out, not finished: fedavg/seed3 (FAILED)"
    )
    assert "mean ± sample std over seeds" in sample.render("csv").splitlines()[0]
    assert "population std (np.std)" in table.render("latex").splitlines()[0]


def test_rounds_to_a_target_averages_the_seeds_that_reach_it_and_shows_the_others(hand_suite, capsys):
    uri, parent = hand_suite
    table = make_table(uri, parent, ["pm/acc"], std="population", rounds_to=["pm/train_loss<=0.5", "pm/acc>0.8"])
    for setting in ("fedapm", "fedavg"):
        members = [i for i, (name, _) in enumerate(HAND_RUNS) if name == setting]
        for target, meets in (("pm/train_loss<=0.5", TRAIN_LOSS <= 0.5), ("pm/acc>0.8", ACCURACY > 0.8)):
            firsts = [int(np.flatnonzero(meets[i])[0]) if meets[i].any() else None for i in members]
            cell = table.reach[setting][f"rounds to {target}"]
            assert cell.rounds == tuple(firsts) and cell.lasts == (6,) * len(members)
            reached = [f for f in firsts if f is not None]
            if reached:
                assert cell.mean == np.mean(reached) and cell.std == np.std(reached)
            else:
                assert math.isnan(cell.mean) and math.isnan(cell.std)
    assert table.reach["fedapm"]["rounds to pm/train_loss<=0.5"].rounds == (3, 4, None)
    markdown = table.render("markdown")
    assert "| setting | seeds | pm/acc | rounds to pm/train_loss<=0.5 | rounds to pm/acc>0.8 |" in markdown
    loss_cells = {line.split(" | ")[0][2:]: line.split(" | ")[3] for line in markdown.splitlines()[4:]}
    assert loss_cells == {"fedapm": "3.5 ± 0.5 (1 of 3 seeds >6)", "fedavg": ">6 (2 of 2 seeds)"}
    assert "rounds to a target: the first logged round it is met" in markdown.splitlines()[0]

    rows = {row["setting"]: row for row in csv.DictReader(table.render("csv").splitlines()[1:])}
    assert rows["fedapm"]["rounds to pm/train_loss<=0.5 rounds"] == "3;4;>6"
    assert rows["fedapm"]["rounds to pm/train_loss<=0.5 reached"] == "2"
    assert float(rows["fedapm"]["rounds to pm/train_loss<=0.5 mean"]) == 3.5
    assert rows["fedavg"]["rounds to pm/train_loss<=0.5 mean"] == rows["fedavg"]["rounds to pm/train_loss<=0.5 std"]
    assert rows["fedavg"]["rounds to pm/train_loss<=0.5 mean"] == ""
    assert rows["fedavg"]["rounds to pm/train_loss<=0.5 rounds"] == ">6;>6"
    latex = table.render("latex")
    assert "rounds to pm/train\\_loss$\\leq$0.5 & rounds to pm/acc$>$0.8 \\\\" in latex
    assert "$3.5 \\pm 0.5$ (1 of 3 seeds $>$6)" in latex and "$>$6 (2 of 2 seeds)" in latex

    command = [
        "table",
        parent,
        "--tracking-uri",
        uri,
        "--metrics",
        "pm/acc",
        "--std",
        "population",
        "--rounds-to",
        "pm/train_loss<=0.5",
        "--rounds-to",
        "pm/acc>0.8",
    ]
    assert main(command) == 0
    assert capsys.readouterr().out == markdown


def test_the_fedapm_aggregation_through_the_cli_and_bad_options_in_one_line(hand_suite, capsys, tmp_path):
    uri, parent = hand_suite
    out = tmp_path / "t.csv"
    command = [
        "table",
        parent,
        "--tracking-uri",
        uri,
        "--metrics",
        "pm/acc",
        "--over-rounds",
        "max",
        "--std",
        "population",
        "--format",
        "csv",
        "--out",
        str(out),
    ]
    assert main(command) == 0
    expected = make_table(uri, parent, ["pm/acc"], over_rounds="max", std="population")
    assert out.read_text() == expected.render("csv")
    fedapm = ACCURACY[:3, 1:]
    row = next(csv.DictReader(out.read_text().splitlines()[1:]))
    assert float(row["pm/acc mean"]) == np.mean(np.nanmax(fedapm, axis=1))
    assert float(row["pm/acc std"]) == np.std(np.nanmax(fedapm, axis=1))
    capsys.readouterr()

    accepted = "expected METRIC<=VALUE, METRIC>=VALUE, METRIC<VALUE or METRIC>VALUE with a number as VALUE"
    for bad in ("pm/train_loss=0.5", "pm/train_loss<=", "<=0.5", "pm/train_loss<=0.5x", "pm/loss<=nan", "a<=1<=2"):
        assert main(["table", parent, "--tracking-uri", uri, "--rounds-to", bad]) == 2
        assert capsys.readouterr().err == f"error: --rounds-to {bad!r}: {accepted}, e.g. 'pm/train_loss<=0.5'\n"
    assert main(["table", parent, "--tracking-uri", uri, "--metrics", "pm/acc", "--rounds-to", "pm/train_los<=1"]) == 2
    assert capsys.readouterr().err.startswith("error: metric 'pm/train_los' is not logged by any run of ")
    assert main(["table", parent, "--tracking-uri", uri, "--at", "best", "--over-rounds", "max"]) == 2
    assert capsys.readouterr().err == (
        "error: --over-rounds max needs --at final: --at best takes every metric at the round where --best-by "
        "peaks, --over-rounds each metric's own max or min\n"
    )
    with pytest.raises(SystemExit) as wrong_std:
        main(["table", parent, "--tracking-uri", uri, "--std", "pop"])
    assert wrong_std.value.code == 2 and "--std: invalid choice: 'pop'" in capsys.readouterr().err


def test_targets_parse_strictly_and_extremes_skip_round_zero_and_nans():
    from raysim.studies.table import extreme_value, parse_target

    target = parse_target(" pm/train_loss <= 5e-1 ")
    assert (target.metric, target.comparison, target.threshold) == ("pm/train_loss", "<=", 0.5)
    assert target.label == "rounds to pm/train_loss<=5e-1"
    assert target.first_round([(2, 0.5), (0, 2.0), (1, math.nan), (3, 0.4)]) == 2
    assert parse_target("gm/acc>.9").first_round([(0, 0.9), (1, 0.95)]) == 1
    assert parse_target("gm/acc>=.9").first_round([(0, 0.9), (1, 0.95)]) == 0
    assert parse_target("x<-1").first_round([(0, -1.0)]) is None
    history = [(0, 9.0), (1, 1.0), (2, math.nan), (3, 3.0), (4, 3.0)]
    assert extreme_value(history, highest=True) == (3.0, 3) and extreme_value(history, highest=False) == (1.0, 1)
    assert extreme_value([(0, 9.0)], highest=False) == (9.0, 0)  # only round 0 logged: it is the value
    assert math.isnan(extreme_value([(0, 1.0), (1, math.nan)], highest=True)[0])
