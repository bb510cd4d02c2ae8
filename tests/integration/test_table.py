"""`raysim table`: the table a paper prints from a suite or sweep, checked against the children's own numbers."""

from __future__ import annotations

import numpy as np
import pytest
import yaml
from matplotlib.colors import to_rgb
from mlflow.tracking import MlflowClient

from raysim.cli import main
from raysim.studies.figure import curves_figure
from raysim.studies.table import (
    Format,
    TableError,
    make_table,
)
from tests.support.experiments import IN_PROCESS, tiny_config
from tests.support.stores import fresh_store

pytestmark = pytest.mark.xdist_group("integration-table")
"""One worker runs this module's tests: its finished suite is run once."""


@pytest.fixture(scope="module")
def finished_suite(tmp_path_factory):
    """A real suite: 2 members x 2 seeds, 3 rounds each, through `raysim run`; (tracking URI, parent run id)."""
    folder = tmp_path_factory.mktemp("suite")
    uri = fresh_store(folder / "mlflow.db")
    base = tiny_config(rounds=3, tracking={"uri": uri, "experiment": "table"}, runtime=IN_PROCESS)
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
    (parent,) = [
        r
        for r in client.search_runs([client.get_experiment_by_name("table").experiment_id])
        if r.data.tags.get("suite") == "tiny"
    ]
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


@pytest.mark.slow
def test_raysim_figure_draws_each_settings_mean_over_seeds_with_its_band(finished_suite, tmp_path, capsys):
    """The plotted line of each setting and metric is the mean over its seeds of the children's histories in the
    store; the band spans mean +/- their sample std; the CLI writes the PNG, PDF and SVG."""
    uri, parent = finished_suite
    client = MlflowClient(uri)
    metrics = ["pm/acc", "gm/loss"]
    figure = curves_figure(uri, parent, metrics)
    children = _children(uri, parent)
    for axis, metric in zip(figure.axes, metrics, strict=True):
        drawn = {line.get_label(): (line, band) for line, band in zip(axis.get_lines(), axis.collections, strict=True)}
        assert set(drawn) == set(children) == {"flame", "fedavg"}
        for setting, runs in children.items():
            histories = np.array(
                [
                    [m.value for m in sorted(client.get_metric_history(r.info.run_id, metric), key=lambda m: m.step)]
                    for r in runs
                ]
            )
            line, band = drawn[setting]
            rounds, mean = line.get_data()
            assert list(rounds) == list(range(histories.shape[1])) == [0, 1, 2, 3]
            assert np.array_equal(mean, histories.mean(axis=0))
            assert tuple(band.get_facecolor()[0][:3]) == to_rgb(line.get_color())
            top = band.get_paths()[0].vertices[:, 1].max()
            assert top == pytest.approx((histories.mean(axis=0) + histories.std(axis=0, ddof=1)).max())
    command = ["figure", parent, "--tracking-uri", uri, "--metrics", "pm/acc", "hm/acc", "--out", str(tmp_path)]
    assert main(command) == 0
    assert capsys.readouterr().out.startswith(f"wrote {tmp_path / 'curves.png'}")
    assert (tmp_path / "curves.png").read_bytes().startswith(b"\x89PNG")
    assert (tmp_path / "curves.pdf").read_bytes().startswith(b"%PDF")
    assert "<svg" in (tmp_path / "curves.svg").read_text()
    assert main(["figure", parent, "--tracking-uri", uri, "--metrics", "pm/accuracy"]) == 2
    assert capsys.readouterr().err.startswith("error: metric 'pm/accuracy' is not logged by any run of")


@pytest.mark.slow
def test_fedapms_aggregation_of_a_real_suite_reproduces_its_childrens_curves(finished_suite):
    """--over-rounds max/min --std population and --rounds-to on the curves the driver logged (step = round,
    round 0 the evaluation before training)."""
    uri, parent = finished_suite
    client = MlflowClient(uri)

    def curves(runs: list, metric: str) -> list[np.ndarray]:
        histories = [sorted(client.get_metric_history(r.info.run_id, metric), key=lambda m: m.step) for r in runs]
        assert all([m.step for m in h] == [0, 1, 2, 3] for h in histories)
        return [np.array([m.value for m in h]) for h in histories]

    children = _children(uri, parent)
    # a target some curves meet after training and others may not: the median GM loss of the trained rounds
    threshold = float(np.median(np.concatenate([c[1:] for runs in children.values() for c in curves(runs, "gm/loss")])))
    target = f"gm/loss<={threshold!r}"
    highest = make_table(uri, parent, ["pm/acc"], over_rounds="max", std="population", rounds_to=[target])
    lowest = make_table(uri, parent, ["gm/loss"], over_rounds="min", std="population")
    for setting, runs in children.items():
        maxima = [float(curve[1:].max()) for curve in curves(runs, "pm/acc")]
        cell = dict((row[0], row[2]) for row in highest.rows)[setting]["pm/acc"]
        assert cell.values == tuple(maxima) and cell.mean == np.mean(maxima) and cell.std == np.std(maxima)
        loss = curves(runs, "gm/loss")
        minima = [float(curve[1:].min()) for curve in loss]
        assert dict((row[0], row[2]) for row in lowest.rows)[setting]["gm/loss"].values == tuple(minima)
        firsts = [int(np.flatnonzero(curve <= threshold)[0]) if (curve <= threshold).any() else None for curve in loss]
        assert highest.reach[setting][f"rounds to {target}"].rounds == tuple(firsts)


def _pdf_font_sizes(path) -> set[float]:
    """Every font size (`/F1 8 Tf`) the PDF's page draws text at, read from its compressed content streams."""
    import re
    import zlib

    data = path.read_bytes()
    sizes = set()
    for stream in re.finditer(rb"stream\r?\n(.*?)\r?\nendstream", data, re.S):
        try:
            content = zlib.decompress(stream.group(1))
        except zlib.error:
            continue
        sizes |= {float(size) for size in re.findall(rb"/F\d+ ([\d.]+) Tf", content)}
    return sizes


@pytest.mark.slow
def test_raysim_figure_for_a_paper_is_a_column_wide_with_every_text_at_least_7_pt(finished_suite, tmp_path, capsys):
    """`--column single`: the PDF's page is 3.5 in (252 pt) wide, every text (tick labels included) at 8 pt; a grid
    of panels by `--ncols`, PM alone by `--metrics`; each setting in its MLflow colour (`mlflow.runColor`) unless
    `--color` names another, labelled as `--label` says; a bad option is one line naming it."""
    import re

    from raysim.studies.figure import FigureLook, paper_layout

    uri, parent = finished_suite
    children = _children(uri, parent)
    logged = {setting: runs[0].data.tags["mlflow.runColor"] for setting, runs in children.items()}
    command = ["figure", parent, "--tracking-uri", uri, "--column", "single", "--out", str(tmp_path)]
    assert main([*command, "--label", "flame=FLAME", "--color", "fedavg=#000000"]) == 0
    page = re.search(rb"/MediaBox \[ *0 0 ([\d.]+) ([\d.]+) *\]", (tmp_path / "curves.pdf").read_bytes())
    assert page is not None and float(page.group(1)) == pytest.approx(3.5 * 72)
    sizes = _pdf_font_sizes(tmp_path / "curves.pdf")
    assert sizes == {8.0}, sizes  # the tick labels as every other text: none below 7 pt
    figure = curves_figure(uri, parent, None, look=FigureLook(paper_layout(column="single"), {"fedavg": "#000000"}))
    assert [axis.get_position().width < 0.5 for axis in figure.axes] == [True, True, True]  # one row of three
    assert {line.get_label(): line.get_color() for line in figure.axes[0].get_lines()} == {
        "flame": logged["flame"],
        "fedavg": "#000000",
    }
    grid = curves_figure(uri, parent, None, look=FigureLook(paper_layout(column="double", ncols=2)))
    rows = sorted({round(axis.get_position().y0, 3) for axis in grid.axes})
    assert len(grid.axes) == 3 and len(rows) == 2 and grid.get_figwidth() == pytest.approx(7.16)
    alone = curves_figure(uri, parent, ["pm/acc"], look=FigureLook(paper_layout(width=3.3), labels={"flame": "FLAME"}))
    assert [line.get_label() for line in alone.axes[0].get_lines()] == ["FLAME", "fedavg"] and not alone._suptitle
    capsys.readouterr()
    for bad, said in [
        (["--color", "nope=#000000"], "error: --color 'nope': not a setting of the study; its settings: flame, fedavg"),
        (["--color", "flame=notacolour"], "error: --color 'flame=notacolour': 'notacolour' is not a colour"),
        (["--font-size", "3"], "error: --font-size 3: points between 5 and 24"),
        (["--width", "3"], "error: --width and --column: give one"),
    ]:
        assert main([*command, *bad]) == 2
        assert capsys.readouterr().err.startswith(said)
