"""`raysim table`: the table a paper prints from a suite or sweep, checked against the children's own numbers."""

from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest
from mlflow.tracking import MlflowClient

from raysim.cli import main
from raysim.studies.table import (
    make_table,
)
from tests.support.table import ACCURACY, HAND_RUNS, TRAIN_LOSS


@pytest.fixture(scope="module")
def hand_suite(tmp_path_factory):
    """A sqlite store with a suite's parent and five finished children (plus one failed, left out) written through
    the MLflow client, each with the curves above at steps 0..6; (tracking URI, parent run id)."""
    from mlflow.entities import Metric, Param

    uri = f"sqlite:///{tmp_path_factory.mktemp('hand') / 'mlflow.db'}"
    client = MlflowClient(uri)
    experiment = client.create_experiment("hand")
    parent = client.create_run(experiment, run_name="hand", tags={"suite": "hand"}).info.run_id
    for index, (name, seed) in enumerate([*HAND_RUNS, ("fedavg", 3)]):
        run = client.create_run(experiment, run_name=f"{name}/seed{seed}", tags={"mlflow.parentRunId": parent})
        curves = {"pm/acc": ACCURACY[index % 5], "pm/train_loss": TRAIN_LOSS[index % 5]}
        metrics = [
            Metric(key, float(value), 0, step) for key, curve in curves.items() for step, value in enumerate(curve)
        ]
        client.log_batch(run.info.run_id, metrics=metrics, params=[Param("seed", str(seed))])
        client.set_terminated(run.info.run_id, "FAILED" if index == 5 else "FINISHED")
    client.set_terminated(parent, "FINISHED")
    return uri, parent


def test_the_latex_table_compiles_with_booktabs_and_bolds_the_best_means(hand_suite, tmp_path):
    """`raysim table --format latex`, `\\input` by a document that loads booktabs and graphicx, compiles with
    pdflatex (Debian's TeX Live, which `make setup` installs); the bold cell of each column is the best of the
    children's means. A table of many columns, wider than the text, is scaled to fit it (no overfull box)."""
    pdflatex = shutil.which("pdflatex")
    assert pdflatex, "pdflatex is needed: `make setup` installs Debian's texlive-latex-base and -recommended"
    uri, parent = hand_suite
    command = [
        "table",
        parent,
        "--tracking-uri",
        uri,
        "--format",
        "latex",
        "--out",
        str(tmp_path / "table.tex"),
        "--metrics",
        "pm/acc",
        "--rounds-to",
        "pm/train_loss<=0.5",
    ]
    assert main(command) == 0
    latex = (tmp_path / "table.tex").read_text()
    finals = {
        name: np.mean([ACCURACY[i, -1] for i, (n, _) in enumerate(HAND_RUNS) if n == name])
        for name in ("fedapm", "fedavg")
    }
    best = max(finals, key=lambda name: finals[name])
    rows = {line.split(" & ")[0]: line for line in latex.splitlines() if line.startswith(("fedapm &", "fedavg &"))}
    assert f"$\\mathbf{{{finals[best]:.4f}" in rows[best] and "mathbf" not in rows[({*finals} - {best}).pop()]
    assert "Setting & Seeds & PM acc. & rounds to pm/train\\_loss$\\leq$0.5 \\\\" in latex
    assert "\\caption{hand: 6 rounds, seeds 1, 2, 3 (column Seeds: how many each setting has)." in latex
    targets = [f"pm/acc>={level / 10}" for level in range(1, 10)]
    wide = make_table(uri, parent, ["pm/acc", "pm/train_loss"], rounds_to=targets).render("latex")
    (tmp_path / "wide.tex").write_text(wide)
    (tmp_path / "paper.tex").write_text(
        "\\documentclass{article}\\usepackage{booktabs}\\usepackage{graphicx}"
        "\\begin{document}\\input{table}\\input{wide}\\end{document}\n"
    )
    result = subprocess.run(
        [pdflatex, "-interaction=nonstopmode", "-halt-on-error", "paper.tex"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout[-3000:]
    assert (tmp_path / "paper.pdf").read_bytes().startswith(b"%PDF")
    assert "Output written on paper.pdf (1 page" in result.stdout
    assert "Overfull \\hbox" not in (tmp_path / "paper.log").read_text()
