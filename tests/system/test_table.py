"""`raysim table`: the table a paper prints from a suite or sweep, checked against the children's own numbers."""

from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest

from raysim.cli import main
from raysim.studies.table import (
    make_table,
)
from tests.support.table import ACCURACY, HAND_RUNS, write_hand_suite

pytestmark = pytest.mark.xdist_group("system-table")
"""One worker runs this module's tests: its finished suite is run once."""


@pytest.fixture(scope="module")
def hand_suite(tmp_path_factory):
    """The hand-written suite (tests/support/table.py): (tracking URI, parent run id)."""
    return write_hand_suite(tmp_path_factory.mktemp("hand"))


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
